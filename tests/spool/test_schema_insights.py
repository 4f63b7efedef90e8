"""The optional fields of a rank sample: memory by role, tokens and samples, FLOPs per token."""

from __future__ import annotations

import dataclasses
import json

import pytest
from samples import rank_sample

from vramwatch import spool

ROLES = {"parameters": 2e9, "gradients": 2e9, "optimizer_state": 4e9, "other": 1e9}


def _sample() -> spool.RankSample:
    return rank_sample(
        0,
        world_size=2,
        pid=1234,
        time=1000.0,
        devices=(spool.DeviceSample(0, "GPU-1", {"torch_cuda_memory_allocated_bytes": 9e9}, dict(ROLES)),),
        heartbeat=spool.HeartbeatSnapshot(steps=3, tokens=6144.0, samples=6.0),
        flops_per_token=6e9,
    )


def test_the_new_fields_round_trip():
    s = _sample()
    assert spool.decode_sample(spool.encode_sample(s)) == s


def test_a_sample_without_them_decodes_as_before():
    doc = json.loads(spool.encode_sample(_sample()))
    del doc["flops_per_token"], doc["heartbeat"]["tokens"], doc["heartbeat"]["samples"], doc["devices"][0]["roles"]
    back = spool.decode_sample(json.dumps(doc).encode())
    assert (back.flops_per_token, back.heartbeat.tokens, back.heartbeat.samples) == (None, None, None)
    assert back.devices[0].roles == {}


@pytest.mark.parametrize(
    ("edit", "detail"),
    [
        (lambda d: d["devices"][0]["roles"].update(weights=1.0), "devices[0].roles key 'weights'"),
        (lambda d: d["devices"][0]["roles"].update(parameters=-1.0), "devices[0].roles.parameters"),
        (lambda d: d["heartbeat"].update(tokens="many"), "heartbeat.tokens"),
        (lambda d: d.update(flops_per_token=-5), "flops_per_token"),
    ],
)
def test_bad_values_reject_the_sample_naming_the_field(edit, detail):
    doc = json.loads(spool.encode_sample(_sample()))
    edit(doc)
    with pytest.raises(spool.SampleRejected) as e:
        spool.decode_sample(json.dumps(doc).encode())
    assert detail in e.value.detail


def test_the_ranks_collector_exports_them():
    from vramwatch.server.collectors import ScrapeContext
    from vramwatch.server.collectors.ranks import families

    ctx = ScrapeContext((_sample(),), 1001.0, "node-a")
    got = {f.name: f.samples for f in families(ctx) if f.samples}
    roles = {s.labels["role"]: s.value for s in got["vramwatch_memory_role_bytes"]}
    assert roles == ROLES
    assert got["vramwatch_memory_role_bytes"][0].labels["uuid"] == "GPU-1"
    assert got["vramwatch_training_tokens"][0].value == 6144.0
    assert got["vramwatch_training_samples"][0].value == 6.0
    assert got["vramwatch_model_flops_per_token"][0].value == 6e9


def test_without_them_nothing_new_is_exported():
    from vramwatch.server.collectors import ScrapeContext
    from vramwatch.server.collectors.ranks import families

    s = dataclasses.replace(
        _sample(),
        devices=(spool.DeviceSample(0, "GPU-1", {}),),
        heartbeat=spool.HeartbeatSnapshot(steps=3),
        flops_per_token=None,
    )
    got = {f.name for f in families(ScrapeContext((s,), 1001.0, "node-a")) if f.samples}
    new = {"vramwatch_memory_role_bytes", "vramwatch_training_tokens", "vramwatch_training_samples"}
    assert not got & (new | {"vramwatch_model_flops_per_token"})
