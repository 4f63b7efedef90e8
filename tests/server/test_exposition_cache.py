"""The cached /metrics: rendered at most once a gap (at once for a birth or death), byte-identical to a whole render."""

from __future__ import annotations

import dataclasses
import gzip
import os
import re
import threading
import time
import zlib
from collections.abc import Iterable

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from samples import rank_sample

from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.server import registry as registry_module
from vramwatch.server.collectors import Collector, Runner, ScrapeContext, Tick
from vramwatch.server.exposition_cache import CachedExposition, RegistryExposition
from vramwatch.server.registry import ExporterCollector
from vramwatch.spool import files

ACCEPTS = [
    "",  # Prometheus text 0.0.4
    "text/plain;version=1.0.0;escaping=underscores",
    "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text;version=1.0.0;q=0.9,text/plain;q=0.5",
]
AGE = re.compile(rb"^(vramwatch_sample_age_seconds\{.*\}) \S+$", re.M)
SPOOL_DURATION = re.compile(rb'(vramwatch_collector_duration_seconds\{collector="spool",job_id="",rank=""\}) \S+')


def sample(rank: int, t: float, steps: int = 3) -> spool.RankSample:
    return rank_sample(
        rank,
        world_size=8,
        time=t,
        uuid=f"GPU-{rank}",
        values={"torch_cuda_memory_reserved_bytes": 3e9 + rank},
        heartbeat=spool.HeartbeatSnapshot(steps=steps, last_step_time=t, buckets=(0.1, 1.0), counts=(1, 1, 0)),
        collectors={"allocator": spool.CollectorHealth(up=1, errors=0, duration=0.0002)},
    )


class Counter(Collector[int]):
    """A server-side collector whose snapshot is the number of reads so far."""

    name = "counter"

    def __init__(self) -> None:
        self.n = 0

    def read(self, tick: Tick) -> int:
        self.n += 1
        return self.n

    def families(self, snapshot: int, ctx: ScrapeContext) -> Iterable[Metric]:
        g = GaugeMetricFamily("counter_reads", "Reads so far.")
        g.add_metric([], float(snapshot))
        return (g,)


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def two_ranks(
    d: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[ExporterCollector, RegistryExposition, list[spool.RankPublisher], Runner[int], Clock]:
    """A spool with two live ranks, the server's collector over it (one server-side collector, read once),
    a whole render of it for comparison, and one clock for all: the fixtures of the cache's tests."""
    clock = Clock()
    monkeypatch.setattr(registry_module.time, "time", clock)  # the whole render's clock is the same one
    pubs = [spool.RankPublisher(d, r) for r in range(2)]
    for r, p in enumerate(pubs):
        p.publish(sample(r, clock.now - 0.5))
    settings = Settings(spool_dir=d)
    runner = Runner(Counter(), settings)
    runner.poll_once()
    exp = ExporterCollector(settings, d, [runner])
    exp.monotonic = clock  # the final samples' windows too
    reg = CollectorRegistry(auto_describe=False)
    reg.register(exp)
    return exp, RegistryExposition(reg), pubs, runner, clock


@pytest.fixture
def node(tmp_path, monkeypatch):
    """Two live ranks, the cache over them, a whole render, a clock."""
    exp, whole, pubs, runner, clock = two_ranks(str(tmp_path), monkeypatch)
    yield exp, CachedExposition(exp, clock=clock), whole, pubs, runner, clock
    for p in pubs:
        p.close()


def gap_later(cached: CachedExposition) -> None:
    """The last render is one gap old: the next scrape renders again."""
    cached.current().built_at -= cached.gap


def same_but_spool_time(a: bytes, b: bytes) -> bool:
    # the spool's read duration is measured per read: the one value two reads never share
    return SPOOL_DURATION.sub(rb"\1 X", a) == SPOOL_DURATION.sub(rb"\1 X", b)


@pytest.mark.parametrize("accept", ACCEPTS)
def test_cached_bytes_equal_a_whole_render_and_its_ages_move_once_a_gap(node, accept):
    _, cached, whole, _, _, clock = node
    first = cached.reply(accept, False)
    assert same_but_spool_time(first.body, whole.reply(accept, False).body)
    clock.now += 7.25
    assert cached.reply(accept, False) == first and cached.renders == 1  # the ages are the render's
    gap_later(cached)  # the render is a gap old: rendered again, with today's ages
    a, b = cached.reply(accept, False), whole.reply(accept, False)
    assert a.content_type == b.content_type and a.encoding is None
    assert same_but_spool_time(a.body, b.body)
    assert re.search(rb'vramwatch_sample_age_seconds\{job_id="",local_rank="1",rank="1"\} 7.75\n', a.body)
    assert cached.renders == 2


@pytest.mark.parametrize("accept", ACCEPTS)
def test_gzip_is_one_member_holding_the_same_text(node, accept):
    _, cached, _, _, _, clock = node
    plain = cached.reply(accept, False).body
    clock.now += 1.5
    for _ in range(2):  # built on the first gzip scrape, reused on the second
        gz = cached.reply(accept, True)
        assert gz.encoding == "gzip"
        d = zlib.decompressobj(31)  # one gzip member: a client that reads one gets it all
        text = d.decompress(gz.body)
        assert d.eof and not d.unused_data
        assert text == plain
    assert cached.renders == 1


def test_a_new_sample_or_snapshot_waits_for_the_gap_then_renders_once(node):
    _, cached, _, pubs, runner, clock = node
    for _ in range(5):
        cached.reply("", False)
    assert cached.renders == 1
    pubs[0].publish(sample(0, clock.now - 0.5, steps=4))
    runner.poll_once()
    body = cached.reply("", False).body
    assert b'steps_total{job_id="",local_rank="0",rank="0"} 3.0' in body and b"counter_reads 1.0" in body
    gap_later(cached)
    body = cached.reply("", False).body
    assert b'vramwatch_training_steps_total{job_id="",local_rank="0",rank="0"} 4.0' in body and cached.renders == 2
    assert b"counter_reads 2.0" in body
    cached.reply("", True)
    assert cached.renders == 2


GRACE = Settings().dead_rank_grace_seconds


def _dead(tmp_path, rank: int, t: float) -> None:
    """A rank that published at ``t`` and died: its file stays, its lock is held by nobody."""
    (tmp_path / f"rank-{rank}-999999.json").write_bytes(files.frame(spool.encode_sample(sample(rank, t))))
    (tmp_path / f"rank-{rank}-999999.lock").write_bytes(b"")


def _live_gauges(body: bytes, rank: int) -> bool:
    return re.search(rb'torch_cuda_memory_reserved_bytes\{[^}]*rank="%d"' % rank, body) is not None


def test_a_dead_ranks_final_sample_is_cached_for_its_grace_window_then_gone(node, tmp_path):
    _, cached, _, _, _, clock = node
    cached.reply("", False)
    _dead(tmp_path, 5, clock.now)
    assert b'rank="5"' not in cached.reply("", False).body  # within the gap: the last render
    gap_later(cached)
    n = cached.renders
    bodies = [cached.reply("", False).body for _ in range(3)]
    assert cached.renders == n + 1, "rendered once at the gap, then served from memory"
    assert all(b'rank="5"' in b and not _live_gauges(b, 5) for b in bodies)  # counters, no memory gauges
    clock.now += GRACE - 1
    assert b'rank="5"' in cached.reply("", False).body and cached.renders == n + 1
    clock.now += 2  # its window is over: rendered again at once, the gap notwithstanding
    assert b'rank="5"' not in cached.reply("", False).body and cached.renders == n + 2
    assert not (tmp_path / "rank-5-999999.json").exists()
    cached.reply("", False)
    assert cached.renders == n + 2  # back to the cache


def test_a_rejected_file_is_counted_per_read_of_the_spool(node, tmp_path):
    _, cached, _, pubs, _, clock = node
    name = "rank-3-13.json"
    (tmp_path / name).write_bytes(files.frame(b"\x00not json"))
    fd = files.hold_lock(files.lock_path_of(str(tmp_path / name)))
    assert fd is not None

    def spool_errors() -> tuple[float, float]:
        body = cached.reply("", False).body
        err = re.search(rb'vramwatch_collector_errors_total\{collector="spool",job_id="",rank=""\} (\S+)', body)
        up = re.search(rb'vramwatch_collector_up\{collector="spool",job_id="",rank=""\} (\S+)', body)
        assert err and up
        return float(err.group(1)), float(up.group(1))

    try:
        assert [spool_errors() for _ in range(3)] == [(1.0, 0.0)] * 3  # one read, down while the file lasts
        gap_later(cached)
        assert spool_errors() == (2.0, 0.0)  # the next read met it again
    finally:
        os.close(fd)


def test_concurrent_scrapes_share_one_render(node):
    _, cached, _, pubs, _, clock = node
    pubs[1].publish(sample(1, clock.now, steps=9))
    bodies: list[bytes] = []
    start = threading.Barrier(8)

    def scrape() -> None:
        start.wait()
        bodies.append(cached.reply("", True).body)

    threads = [threading.Thread(target=scrape) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(bodies) == 8 and len({gzip.decompress(b) for b in bodies}) == 1
    assert cached.renders == 1


def test_only_asked_formats_are_rendered(node):
    _, cached, _, _, _, _ = node
    cached.reply("", False)
    render = cached.current()
    text = "text/plain; version=0.0.4; charset=utf-8"
    assert list(render.bodies) == [(text, False)]  # no gzip yet
    cached.reply("", True)
    assert list(render.bodies) == [(text, False), (text, True)]


def test_sample_replace_keeps_the_size_used_above():
    a = spool.encode_sample(sample(0, 1.0, steps=3))
    b = spool.encode_sample(dataclasses.replace(sample(0, 1.0, steps=3), heartbeat=sample(0, 1.0, steps=4).heartbeat))
    assert len(a) == len(b) and a != b
