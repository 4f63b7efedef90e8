"""vramwatch.server.registry: the server's own series (mode, build, the spool's health) and what a read leaves."""

from __future__ import annotations

import re
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from samples import rank_sample

from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.server.collectors import Health
from vramwatch.server.registry import ExporterCollector
from vramwatch.spool.node import Refused
from vramwatch.spool.reader import Rejected


def _sample(rank: int) -> spool.RankSample:
    return rank_sample(
        rank, world_size=2, uuid=f"GPU-{rank}", values={"torch_cuda_memory_reserved_bytes": 3e9}, heartbeat=None
    )


class _Own:
    """One of the server's own collectors, as the registry sees a Runner."""

    name = "nvml"

    def __init__(self) -> None:
        self.health = Health()

    def collect(self, ctx):
        return []


@pytest.fixture
def exp(tmp_path):
    d = str(tmp_path / "spool")
    spool.ensure_dir(d)
    return ExporterCollector(Settings(spool_dir=d, hostname="node-a"), d, [_Own()])


def _text(exp: ExporterCollector) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(exp)
    return generate_latest(reg).decode()


def _reads(exp, monkeypatch, *reads) -> None:
    it = iter(reads)

    def read(now, mono=None):
        r = next(it)
        if isinstance(r, Exception):
            raise r
        return r, {}

    monkeypatch.setattr(exp.rank_view, "read", read)


def test_a_job_server_says_job_and_its_build_and_its_collectors_have_no_rank(exp):
    text = _text(exp)
    assert 'vramwatch_server_mode{mode="job"} 1.0' in text
    assert re.search(r'^vramwatch_build_info\{hostname="node-a",version="[^"]+"\} 1\.0$', text, re.M), text
    assert 'vramwatch_collector_up{collector="nvml",job_id="",rank=""} 1.0' in text
    assert 'vramwatch_collector_up{collector="spool",job_id="",rank=""} 1.0' in text


def test_the_spool_is_down_while_it_is_in_trouble(exp):
    exp.spool_trouble = "/run/x: Permission denied"
    assert 'vramwatch_collector_up{collector="spool",job_id="",rank=""} 0.0' in _text(exp)
    exp.spool_trouble = ""
    assert 'vramwatch_collector_up{collector="spool",job_id="",rank=""} 1.0' in _text(exp)


def test_a_failing_read_is_down_counted_logged_once_and_tried_again(exp, monkeypatch, caplog):
    _reads(exp, monkeypatch, OSError("boom"), OSError("boom"), spool.SpoolRead(live=[_sample(0)]))
    for _ in range(2):
        ctx = exp.context()
        assert ctx.samples == () and not exp.last_read_ok and exp.last_read_expires is None
    assert exp.spool_health.up == 0 and exp.spool_health.errors == 2
    assert caplog.messages == ["vramwatch: reading the spool failed: OSError('boom')"]
    assert [r.name for r in caplog.records] == ["vramwatch"]
    assert 0 <= exp.spool_health.duration < 5
    ctx = exp.context()
    assert exp.last_read_ok and exp.spool_health.up == 1 and [s.rank for s in ctx.samples] == [0]


def test_refused_and_rejected_entries_are_logged_once_each(exp, monkeypatch, caplog):
    refused = [Refused("job-1/rank-0.json", "owned by uid 7"), Refused("job-2/rank-0.json", "owned by uid 7")]
    rejected = [Rejected("rank-3.json", "malformed", "not JSON")]
    read = spool.SpoolRead(refused=refused, rejected=rejected)
    _reads(exp, monkeypatch, read, read)
    exp.context()
    exp.context()
    assert caplog.messages == [*(f"vramwatch: {f.describe()}" for f in refused), f"vramwatch: {rejected[0].describe()}"]
    assert {r.name for r in caplog.records} == {"vramwatch"}
    assert exp.spool_health.up == 0  # a rejected rank's series are missing: up 0 while it lasts


def test_a_scrape_carrying_ranks_is_remembered(exp, monkeypatch):
    t0 = time.monotonic()
    assert not exp.served_ranks_since(t0)
    final_only = spool.SpoolRead(final=[_sample(1)], expires=1234.5)
    _reads(exp, monkeypatch, spool.SpoolRead(), final_only, spool.SpoolRead(live=[_sample(0)]))
    empty = exp.context()
    assert not exp.served_ranks_since(t0)
    exp.context()  # only a dead rank's final sample: still ranks served
    assert exp.served_ranks_since(t0)
    assert exp.last_read_expires == 1234.5  # when the reader says the first final sample leaves
    live = exp.context()
    t1 = time.monotonic()
    exp.mark_served(empty)  # a cached scrape without ranks
    assert not exp.served_ranks_since(t1)
    exp.mark_served(live)  # a cached scrape with ranks
    assert exp.served_ranks_since(t1)


def test_the_read_carried_counters_reach_the_scrape(exp, monkeypatch):
    carried = {("GPU-0", 0, "1", 1, "j"): {"x": 1.0}}
    monkeypatch.setattr(exp.rank_view, "read", lambda now, mono=None: (spool.SpoolRead(), carried))
    assert exp.context().carried == carried


def test_a_rank_that_cannot_be_rendered_is_logged_once_per_cause(exp, caplog):
    s = _sample(3)
    for e in (ValueError("bad"), ValueError("bad"), TypeError("worse")):
        exp._rank_failed(s, e)
    assert caplog.messages == [
        f"vramwatch: rank 3's sample cannot be rendered (ValueError('bad')); its series (job_id {s.job_id!r}) "
        "are left out",
        f"vramwatch: rank 3's sample cannot be rendered (TypeError('worse')); its series (job_id {s.job_id!r}) "
        "are left out",
    ]
    assert exp.spool_health.errors == 3
