"""A well-formed but mis-shaped sample drops only itself: the scrape stays whole, other ranks and NVML included."""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from samples import rank_sample

from harness import parse_metrics
from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import Runner
from vramwatch.server.collectors.nvml import NvmlCollector
from vramwatch.server.exposition_cache import CachedExposition
from vramwatch.server.registry import ExporterCollector
from vramwatch.sim.nvml import SimNvml
from vramwatch.sim.state import SimNode
from vramwatch.spool import files

BAD_FILE = "rank-1-424242.json"


def _sample(rank: int) -> spool.RankSample:
    return rank_sample(
        rank,
        world_size=2,
        uuid="GPU-sim-0",
        values={"torch_cuda_memory_reserved_bytes": 3e9},
        allocator_info=spool.AllocatorInfo("native", "false", "", ""),
        heartbeat=spool.HeartbeatSnapshot(steps=5, last_step_time=time.time(), buckets=(0.1, 1.0), counts=(1, 2, 1)),
        collectors={"allocator": spool.CollectorHealth(1, 0, 0.0002)},
        oom_snapshot=spool.OomSnapshot("/tmp/snap.pickle", time.time()),
    )


VALID = json.loads(spool.encode_sample(_sample(1)))


def _paths(v: Any, here: tuple = ()) -> list[tuple]:
    out = [here] if here else []
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, here + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, here + (i,))
    return out


PATHS = [p for p in _paths(VALID) if p != ("v",)]
DELETE = object()
ODD = st.one_of(
    st.just(DELETE),
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.just(10**400),  # beyond any float
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["5", "1e309", "NaN", "-1"]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _mutate(doc: dict, path: tuple, value: Any) -> dict:
    doc = copy.deepcopy(doc)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if value is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


class Rig:
    """A spool with a good rank 0, a rank 1 file (its lock held here) to plant payloads in, and NVML."""

    def __init__(self, d: str) -> None:
        self.dir = d
        self.settings = Settings(simulate=True, spool_dir=d)
        self.good = spool.RankPublisher(d, 0)
        self.good.publish(_sample(0))
        self.bad_path = os.path.join(d, BAD_FILE)
        self._lock = files.hold_lock(files.lock_path_of(self.bad_path))
        session = nb.NvmlSession(self.settings, module=SimNvml.from_node(SimNode.default(1)))
        self.nvml = Runner(NvmlCollector(self.settings, session), self.settings)
        self.nvml.poll_once()
        self.exporter = ExporterCollector(self.settings, d, [self.nvml])
        self.exposition = CachedExposition(self.exporter)  # what the server answers /metrics with

    def plant(self, doc: Any) -> None:
        with open(self.bad_path, "wb") as fh:
            fh.write(files.frame(json.dumps(doc, allow_nan=True).encode()))
        if self.exposition._render is not None:  # a gap later: the next scrape renders the new sample
            self.exposition._render.built_at -= self.exposition.gap

    def scrape(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        return parse_metrics(self.exposition.reply("", False).body.decode())  # raising here is a 500

    def close(self) -> None:
        self.good.close()
        if self._lock is not None:
            os.close(self._lock)


@pytest.fixture(scope="module")
def rig():
    with tempfile.TemporaryDirectory() as d:
        r = Rig(d)
        yield r
        r.close()


def _ranks(m) -> set[str]:
    return {lab["rank"] for lab, _ in m.get("vramwatch_rank_info", [])}


def _spool_errors(m) -> float:
    return next(v for lab, v in m["vramwatch_collector_errors_total"] if lab["collector"] == "spool")


def _check_whole(m) -> None:
    assert "0" in _ranks(m), "the good rank is gone"
    assert any(lab["rank"] == "0" for lab, _ in m.get("torch_cuda_memory_reserved_bytes", []))
    assert m.get("gpu_up") and m.get("gpu_power_watts"), "the NVML series are gone"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), value=ODD)
def test_any_one_field_mutated_drops_at_most_that_rank(rig, path, value):
    assume(path != ("rank",) or not isinstance(value, int))  # another valid rank number: not a bad sample
    before = _spool_errors(rig.scrape())
    rig.plant(_mutate(VALID, path, value))
    m = rig.scrape()
    _check_whole(m)
    if "1" not in _ranks(m):
        assert _spool_errors(m) > before, f"rank 1 dropped uncounted ({path}={value!r})"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("heartbeat", "steps"), "5"),  # a string where a number belongs
        (("heartbeat", "counts"), DELETE),  # a missing nested field
        (("heartbeat", "counts", 0), -1),  # a negative count
        (("rank",), 1e309),  # parsed as inf: int() of it overflowed, out of the codec's reach
        (("hostname",), 7),
        (("devices", 0, "uuid"), None),
        (("collectors", "allocator", "up"), 2),
    ],
    ids=lambda v: "DELETE" if v is DELETE else repr(v)[:24],  # stable across xdist workers (no address)
)
def test_named_mis_shapes_are_dropped_counted_and_logged_once(tmp_path, caplog, path, value):
    caplog.set_level(logging.WARNING, "vramwatch")
    rig = Rig(str(tmp_path))
    rig.plant(_mutate(VALID, path, value))
    first = rig.scrape()
    second = rig.scrape()
    for m in (first, second):
        _check_whole(m)
        assert "1" not in _ranks(m)
    # counted per read of the spool: the second scrape is served from the same render (nothing changed)
    assert _spool_errors(second) == _spool_errors(first) > 0
    lines = [r.getMessage() for r in caplog.records if BAD_FILE in r.getMessage()]
    assert len(lines) == 1 and "malformed" in lines[0], lines
    rig.plant(VALID)
    assert "1" in _ranks(rig.scrape())
    rig.close()


def test_one_rank_failing_to_render_leaves_out_only_that_rank(tmp_path, caplog, monkeypatch):
    """Defence in depth: were a sample to pass the codec and still break rendering, only its rank goes."""
    from vramwatch.server.collectors import ranks

    real = ranks._live_rank

    def flaky(fams, s, *args):
        if s.rank == 1:
            fams["vramwatch_training_steps_total"].add_metric(["1", "1"], 1.0)  # half-rendered, then broken
            raise TypeError("boom")
        return real(fams, s, *args)

    monkeypatch.setattr(ranks, "_live_rank", flaky)
    rig = Rig(str(tmp_path))
    rig.plant(VALID)
    m = rig.scrape()
    _check_whole(m)
    assert _ranks(m) == {"0"} and not any(lab["rank"] == "1" for lab, _ in m["vramwatch_training_steps_total"])
    up = {lab["collector"]: v for lab, v in m["vramwatch_collector_up"] if lab["rank"] == ""}
    assert up["spool"] == 0
    assert "rank 1's sample cannot be rendered" in caplog.text
    rig.close()
