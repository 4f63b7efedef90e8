"""The exposition cache's edges: the bounds on what a client may make it keep, and what renders again."""

from __future__ import annotations

import dataclasses
import gzip
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from test_exposition_cache import GRACE, Clock, _dead, gap_later, sample, two_ranks

from vramwatch import spool
from vramwatch.server import exposition_cache
from vramwatch.server.collectors import Runner
from vramwatch.server.exposition_cache import CachedExposition, RegistryExposition, Reply, gzipped
from vramwatch.server.registry import ExporterCollector

GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # RFC 1952: deflate, no flags, mtime 0, OS unknown
TEXT = "text/plain; version=0.0.4; charset=utf-8"
OM = "application/openmetrics-text; version=1.0.0"
OM_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
AGE_HELP = b"# HELP vramwatch_sample_age_seconds "


@dataclasses.dataclass
class Node:
    exp: ExporterCollector
    cached: CachedExposition
    whole: RegistryExposition
    pubs: list[spool.RankPublisher]
    runner: Runner[int]
    clock: Clock
    spool: Path

    def publish(self, rank: int = 0, steps: int = 4) -> None:
        self.pubs[rank].publish(sample(rank, self.clock.now - 0.5, steps=steps))


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    """test_exposition_cache's node: two live ranks, one server-side collector, one clock for all."""
    exp, whole, pubs, runner, clock = two_ranks(str(tmp_path), monkeypatch)
    n = Node(exp, CachedExposition(exp, clock=clock), whole, pubs, runner, clock, tmp_path)
    yield n
    for p in pubs:
        p.close()


def _gauge(name: str, n: int) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, f"{name}, for the tests.", labels=["i"])
    for i in range(n):
        g.add_metric([f"series-{i}"], i * 1.5)
    return g


# --- the gzip pieces ---


def test_registry_exposition_renders_every_request_with_the_asked_type_and_encoding():
    class Static:
        def collect(self) -> Iterable[Metric]:
            return [_gauge("static_value", 50)]

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Static())  # type: ignore[arg-type]
    whole = RegistryExposition(reg)
    for accept, ctype in [("", TEXT), (OM, OM_TYPE)]:
        body = choose_encoder(accept)[0](reg)
        assert b"static_value" in body
        assert whole.reply(accept, False) == Reply(body, ctype, None)
        assert whole.reply(accept, True) == Reply(gzipped(body), ctype, "gzip")


# --- what a client can make it keep ---

# the spool's read duration, the one value two reads never share, under any escaping of its name
SPOOL_DURATION = re.compile(rb'(vramwatch_+collector_+duration_+seconds\{collector="spool",[^}]*\}) \S+')


def _spool_time_out(text: bytes) -> bytes:
    return SPOOL_DURATION.sub(rb"\1 X", text)


ACCEPTS_10 = [
    "",
    *(f"text/plain;version=1.0.0;escaping={e}" for e in ("underscores", "dots", "values", "allow-utf-8")),
    "application/openmetrics-text",
    *(f"application/openmetrics-text;version=1.0.0;escaping={e}" for e in ("dots", "values", "allow-utf-8")),
    "application/openmetrics-text;version=1.0.0;escaping=underscores",
]


def test_at_most_8_bodies_are_kept_per_render_the_rest_encoded_per_scrape(node):
    cached = node.cached
    ctypes = [choose_encoder(a)[1] for a in ACCEPTS_10]
    assert len(set(ctypes)) == 10
    for _ in range(2):
        for a in ACCEPTS_10:
            got, want = cached.reply(a, False), node.whole.reply(a, False)
            assert got.content_type == want.content_type and _spool_time_out(got.body) == _spool_time_out(want.body)
    assert list(cached.current().bodies) == [(c, False) for c in ctypes[:8]]
    gz = cached.reply(ACCEPTS_10[9], True)  # a ninth format, gzipped: served, still not kept
    assert gzip.decompress(gz.body) == cached.reply(ACCEPTS_10[9], False).body
    assert len(cached.current().bodies) == 8
    assert cached.renders == 1


def test_a_render_expires_at_the_instant_its_first_final_sample_leaves(node):
    cached = node.cached
    cached.reply("", False)
    assert cached._render is not None and cached._render.expires is None
    _dead(node.spool, 5, node.clock.now - 1.0)
    gap_later(cached)
    cached.reply("", False)
    r = cached._render
    assert r.expires == node.clock.now - 1.0 + GRACE
    n = cached.renders
    node.clock.now = r.expires - 0.001
    cached.reply("", False)
    assert cached.renders == n
    node.clock.now = r.expires
    cached.reply("", False)
    assert cached.renders == n + 1


def test_a_render_is_served_for_less_than_one_gap_whatever_else(node, monkeypatch):
    mono = [1000.0]
    monkeypatch.setattr(exposition_cache.time, "monotonic", lambda: mono[0])
    cached = node.cached
    cached.reply("", False)
    mono[0] = 1000.0 + cached.gap - 0.25
    cached.reply("", False)
    assert cached.renders == 1
    mono[0] = 1000.0 + cached.gap
    cached.reply("", False)
    assert cached.renders == 2


# --- what is rendered again ---


def test_a_collectors_health_is_rendered_at_the_gap(node):
    cached, health = node.cached, node.runner.health
    cached.reply("", False)
    labels = b'{collector="counter",job_id="",rank=""}'
    changes = [
        ("duration", 0.125, b"vramwatch_collector_duration_seconds"),
        ("errors", 7, b"vramwatch_collector_errors_total"),
        ("up", 0, b"vramwatch_collector_up"),
    ]
    for attr, value, family in changes:
        setattr(health, attr, value)
        gap_later(cached)
        assert family + labels + b" %r\n" % float(value) in cached.reply("", False).body
    assert cached.renders == 4


def test_a_failed_read_is_read_again_by_the_next_scrape(node, monkeypatch):
    cached = node.cached
    real = node.exp.rank_view.read
    failing = [True]

    def read(now: float, mono: float) -> object:
        if failing:
            raise OSError("spool gone")
        return real(now, mono)

    monkeypatch.setattr(node.exp.rank_view, "read", read)
    up = b'vramwatch_collector_up{collector="spool",job_id="",rank=""} '
    assert up + b"0.0\n" in cached.reply("", False).body
    assert cached._render is not None and not cached._render.ok and cached.renders == 1
    failing.clear()  # nothing on disk changed, and yet
    assert up + b"1.0\n" in cached.reply("", False).body
    assert cached.renders == 2
    cached.reply("", False)
    assert cached.renders == 2


def test_the_spool_coming_back_alone_renders_again(node):
    """The guard makes a vanished spool again, then the server clears its trouble: a render between the two
    (new directory, trouble still set) must not be served until something else changes (a `make test` run
    read `up` 0 for 5 s after the spool came back)."""
    cached, exp = node.cached, node.exp
    up = b'vramwatch_collector_up{collector="spool",job_id="",rank=""} '
    exp.spool_trouble = "the spool is a file"
    assert up + b"0.0\n" in cached.reply("", False).body and cached.renders == 1
    exp.spool_trouble = ""  # nothing on disk changed since that render, and yet
    assert up + b"1.0\n" in cached.reply("", False).body and cached.renders == 2
    cached.reply("", False)
    assert cached.renders == 2
    # a vanishing the guard counted and mended within one check: the spool made again (empty, as before) reads
    # the same as the old one, and the count must show all the same
    exp.spool_health.errors += 1
    exp.spool_vanished += 1
    errors = b'vramwatch_collector_errors_total{collector="spool",job_id="",rank=""} '
    assert errors + b"1.0\n" in cached.reply("", False).body and cached.renders == 3


# --- reply_now: the event loop's answer, never a render ---


def test_reply_now_serves_only_a_current_render_in_a_format_already_built(node):
    cached = node.cached
    assert cached.reply_now("", False) is None  # nothing rendered
    first = cached.reply("", False)
    assert cached.reply_now("", False) == first
    assert cached.reply_now("", True) is None  # gzip never asked: not built on the loop
    assert cached.reply_now(OM, False) is None  # nor another format
    assert cached.reply_now("", True) is None
    assert cached.reply("", True).encoding == "gzip" and cached.reply_now("", True) == cached.reply("", True)
    node.publish(steps=9)
    assert cached.reply_now("", False) == first  # a newer sample waits for the gap
    gap_later(cached)
    assert cached.reply_now("", False) is None  # then a worker renders it
    assert cached.renders == 1
    latest = cached.reply("", False)
    assert b'rank="0"} 9.0' in latest.body and cached.renders == 2
    with cached._lock:  # a render under way: the loop serves the last one meanwhile, without waiting
        assert cached.reply_now("", False) == latest


def test_reply_now_declines_a_render_of_a_failed_read(node, monkeypatch):
    cached = node.cached
    monkeypatch.setattr(node.exp.rank_view, "read", lambda now, mono: (_ for _ in ()).throw(OSError("gone")))
    cached.reply("", False)
    assert cached._render is not None and not cached._render.ok
    assert cached.reply_now("", False) is None


# --- the refresher, stepped by the test ---


def test_the_refresher_renders_nothing_before_the_first_scrape_nor_after_idle_s(node, monkeypatch):
    mono = [1000.0]
    monkeypatch.setattr(exposition_cache.time, "monotonic", lambda: mono[0])
    cached = node.cached
    assert not cached.refresh() and cached.renders == 0
    cached.reply("", True)
    assert not cached.refresh() and cached.renders == 1  # younger than a gap
    mono[0] += cached.gap
    assert cached.refresh() and cached.renders == 2
    assert cached.reply_now("", True) is not None  # the asked format was encoded ahead: no worker needed
    assert cached.reply_now(OM, False) is None  # one never asked was not
    last_scrape = mono[0]
    mono[0] = last_scrape + exposition_cache.IDLE_S
    assert cached.refresh() and cached.renders == 3
    mono[0] += cached.gap + 0.001
    assert not cached.refresh() and cached.renders == 3  # nobody scraped for longer than IDLE_S: it rests


def test_with_the_refresher_running_a_render_a_look_past_the_gap_is_served(node, monkeypatch):
    mono = [1000.0]
    monkeypatch.setattr(exposition_cache.time, "monotonic", lambda: mono[0])
    cached = node.cached
    first = cached.reply("", False)
    monkeypatch.setattr(type(cached), "refreshing", property(lambda self: True))
    mono[0] += cached.gap + cached.look - 0.125  # the refresher renders at its next look
    assert cached.reply_now("", False) == first and cached.renders == 1
    mono[0] += 0.125
    assert cached.reply_now("", False) is None


def test_start_runs_the_refresher_and_stop_joins_it(node):
    cached = node.cached
    cached.start()
    try:
        assert cached.refreshing
        cached.reply("", False)
        node.publish(steps=9)
        wait = time.monotonic() + 10
        while cached.renders < 2 and time.monotonic() < wait:
            time.sleep(0.05)
        assert cached.renders >= 2 and b'rank="0"} 9.0' in cached.reply_now("", False).body
    finally:
        cached.stop()
    assert not cached.refreshing


def test_a_refresh_builds_aside_while_the_loop_serves_the_last_render(node, monkeypatch):
    mono = [1000.0]
    monkeypatch.setattr(exposition_cache.time, "monotonic", lambda: mono[0])
    monkeypatch.setattr(type(node.cached), "refreshing", property(lambda self: True))
    cached, exp = node.cached, node.exp
    first = cached.reply("", True)
    mono[0] += cached.gap + 0.125  # due for the refresher, still served
    during: list[object] = []
    real = exp.families

    def families(ctx):  # the scrape that comes while the refresher renders
        during.append(cached.reply_now("", True))
        return real(ctx)

    monkeypatch.setattr(exp, "families", families)
    assert cached.refresh() and during == [first]
    assert cached.reply_now("", True) not in (None, first)  # the new render, gzip built ahead
