"""A sample's payload: the numbers JSON cannot hold are refused, and a payload decodes to its sample."""

from __future__ import annotations

import json
import math

import pytest
from samples import rank_sample

from vramwatch import spool
from vramwatch.rank.heartbeat import BUCKETS
from vramwatch.spool import codec


def _rank_sample(**over: object) -> spool.RankSample:
    base = dict(
        rank=3,
        local_rank=1,
        world_size=8,
        hostname="node-7",
        pid=4242,
        time=1796300000.25,
        devices=(
            spool.DeviceSample(
                0,
                "GPU-5e1a0000-0000-4000-8000-000000000000",
                {"torch_cuda_memory_allocated_bytes": 2147483648.0, "torch_cuda_memory_fragmentation_ratio": 1 / 3},
                {"parameters": 1.0, "gradients": 2.0, "optimizer_state": 3.0, "other": 4.0},
            ),
        ),
        allocator_info=spool.AllocatorInfo("native", "false", "", ""),
        heartbeat=spool.HeartbeatSnapshot(7, 1796300000.0, BUCKETS, (0,) * 20 + (7,), 3.5, 0.5, None, 768.0, None),
        collectors={"allocator": spool.CollectorHealth(1, 0, 3.5e-05), "roles": spool.CollectorHealth(1, 0, 0.0012)},
        flops_per_token=57600.0,
        job_id="4242.0",
    )
    base.update(over)
    return rank_sample(**base)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_number_is_refused_as_before(bad):
    for s in (
        _rank_sample(time=bad),
        _rank_sample(devices=(spool.DeviceSample(0, "GPU-1", {"x": bad}),)),
        _rank_sample(devices=(spool.DeviceSample(0, "GPU-1", {}, {"other": bad}),)),
        _rank_sample(flops_per_token=bad),
    ):
        with pytest.raises(ValueError):
            codec.encode_sample(s)


def test_decodes_to_the_same_sample():
    s = _rank_sample()
    assert spool.decode_sample(codec.encode_sample(s)) == s


def test_the_training_state_round_trips_and_is_left_out_when_empty():
    t = spool.TrainingState(
        "exception",
        "InjectedFault",
        41,
        {"collective": 1.5, "data": 0.25},
        "eval",
        5.0,
        {"loss": 2, "grad_norm": 0},
        "nan",
        "",
    )
    s = _rank_sample(training=t)
    assert spool.decode_sample(codec.encode_sample(s)) == s
    assert b'"training"' not in codec.encode_sample(_rank_sample(training=spool.TrainingState()))


@pytest.mark.parametrize(
    "field,bad",
    [
        ("exit", {"reason": "killed", "detail": ""}),  # the server's word, never a rank's
        ("exit", {"reason": "finished", "detail": "a b"}),
        ("exit", {"reason": "finished", "detail": "x" * 65}),
        ("collectives", -1),
        ("waits", {"gpu": 1.0}),
        ("waits", {"data": -1.0}),
        ("phase", {"name": "lunch", "start": 1.0}),
        ("nonfinite", {"lr": 1}),
        ("loss", "NaN!"),
    ],
)
def test_a_training_field_out_of_its_set_is_refused(field, bad):
    doc = json.loads(codec.encode_sample(_rank_sample()))
    doc["training"] = {field: bad}
    with pytest.raises(spool.SampleRejected, match="training"):
        spool.decode_sample(json.dumps(doc).encode())
