"""The exposition cache's edges: the bounds on what a client may make it keep,
the refresher's clock boundaries (on a fake clock), its thread and its failures, and reply_now's refusals."""

from __future__ import annotations

import dataclasses
import gzip
import logging
import re
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from test_exposition_cache import GRACE, Clock, Refresher, _dead, sample, two_ranks

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
    n.cached.stop()
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


def test_at_most_8_formats_are_kept_and_refreshed_the_rest_rendered_per_scrape(node):
    cached = node.cached
    ctypes = [choose_encoder(a)[1] for a in ACCEPTS_10]
    assert len(set(ctypes)) == 10
    for _ in range(2):
        for a in ACCEPTS_10:
            got, want = cached.reply(a, False), node.whole.reply(a, False)
            assert got.content_type == want.content_type and _spool_time_out(got.body) == _spool_time_out(want.body)
    assert list(cached.current().formats) == ctypes[:8]
    assert list(cached._asked) == ctypes[:8]
    gz = cached.reply(ACCEPTS_10[9], True)  # a ninth format, gzipped: served, still not kept
    assert gzip.decompress(gz.body) == cached.reply(ACCEPTS_10[9], False).body
    assert list(cached._asked) == ctypes[:8] and list(cached.current().formats) == ctypes[:8]
    assert cached.renders == 1


def test_at_most_32_accept_headers_have_their_encoder_remembered(node):
    cached = node.cached
    a = "text/plain;version=1.0.0;escaping=underscores"
    assert choose_encoder(a) is not choose_encoder(a)  # a new answer every call: `is` tells a remembered one
    first = cached._encoder(a)
    assert first == (first[0], choose_encoder(a)[1]) and cached._encoder(a) is first
    for i in range(31):
        cached._encoder(f"text/plain;q=0.{i:02d}")
    assert len(cached._encoders) == 32
    x = "text/plain;q=1"
    one, two = cached._encoder(x), cached._encoder(x)
    assert one == two and one is not two and x not in cached._encoders
    assert cached._encoder(a) is first and len(cached._encoders) == 32


def test_gzip_asked_later_is_built_by_the_refresher_from_then_on(node):
    cached = node.cached
    refresher = Refresher(cached)
    enc, ctype = cached._encoder("")
    cached.reply("", False)
    cached.reply("", False)
    assert cached._asked == {ctype: (enc, False)}
    node.publish(steps=4)
    assert refresher.step()
    assert cached._render is not None and cached._render.formats[ctype].gz is None  # nobody asked for gzip
    assert cached.reply_now("", True) is None
    cached.reply("", True)
    assert cached._asked == {ctype: (enc, True)}
    cached.reply("", False)  # a plain scrape does not take it back
    assert cached._asked == {ctype: (enc, True)}
    node.publish(steps=5)
    cached.render_cost = 0.0  # (the last render's share of a core: not this test's)
    assert refresher.step()
    assert cached._render.formats[ctype].gz is not None
    now = cached.reply_now("", True)
    assert now is not None and now == cached.reply("", True)


# --- reply_now ---


def test_reply_now_answers_only_what_needs_no_render_and_no_lock(node, monkeypatch):
    cached = node.cached
    assert cached.reply_now("", False) is None  # nothing rendered
    cached.reply("", False)
    assert cached.reply_now("", False) is None  # rendered, but no refresher keeps it current
    refresher = Refresher(cached)
    assert cached.reply_now("", False) == cached.reply("", False)
    assert cached.reply_now("", True) is None  # gzip never asked: not built
    assert cached.reply_now(OM, False) is None  # a format never asked
    cached.reply("", True)
    assert cached.reply_now("", True) == cached.reply("", True)
    read = node.exp.rank_view.read

    def failing(now: float) -> object:
        raise OSError("spool gone")

    monkeypatch.setattr(node.exp.rank_view, "read", failing)
    node.publish(steps=6)
    assert refresher.step() and cached._render is not None and cached._render.key is None
    assert cached.reply_now("", False) is None  # the last read failed: a worker reads again
    monkeypatch.setattr(node.exp.rank_view, "read", read)
    assert b"steps_total" in cached.reply("", False).body
    assert cached.reply_now("", False) is not None
    cached.stop()
    assert cached.reply_now("", False) is None  # the refresher is gone


def test_reply_now_declines_a_render_whose_dead_rank_left(node):
    cached = node.cached
    refresher = Refresher(cached)
    cached.reply("", False)
    _dead(node.spool, 5, node.clock.now)
    assert refresher.step()
    now = cached.reply_now("", False)
    assert now is not None and b'rank="5"' in now.body
    node.clock.now += GRACE + 1
    assert cached.reply_now("", False) is None
    assert b'rank="5"' not in cached.reply("", False).body


def test_a_render_expires_at_the_instant_its_first_final_sample_leaves(node):
    cached = node.cached
    cached.reply("", False)
    assert cached._render is not None and cached._render.expires is None
    assert not cached._render.expired(float("inf"))
    _dead(node.spool, 5, node.clock.now - 1.0)
    cached.reply("", False)
    r = cached._render
    assert r.expires == node.clock.now - 1.0 + GRACE
    assert not r.expired(r.expires - 0.001) and r.expired(r.expires) and r.expired(r.expires + 1)
    n = cached.renders
    node.clock.now = r.expires
    cached.reply("", False)
    assert cached.renders == n + 1


# --- what is rendered again, without the refresher ---


def test_a_collectors_health_alone_renders_again(node):
    cached, health = node.cached, node.runner.health
    cached.reply("", False)
    labels = b'{collector="counter",job_id="",rank=""}'
    changes = [
        ("duration", 0.125, b"vramwatch_collector_duration_seconds"),
        ("errors", 7, b"vramwatch_collector_errors_total"),
    ]
    changes.append(("up", 0, b"vramwatch_collector_up"))
    for i, (attr, value, family) in enumerate(changes):
        setattr(health, attr, value)
        body = cached.reply("", False).body
        assert family + labels + b" %r\n" % float(value) in body
        assert cached.renders == 2 + i
    cached.reply("", False)
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
    assert cached._render is not None and cached._render.key is None and cached.renders == 1
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


def test_a_render_holds_the_snapshots_its_key_names(node):
    # held, so that no later snapshot can take the id() the key compares
    cached, runner = node.cached, node.runner
    cached.reply("", False)
    assert cached._render is not None and cached._render.snapshots == [1]
    runner.poll_once()
    cached.reply("", False)
    assert cached._render.snapshots == [2] and cached._render.snapshots[0] is runner.snapshot
    refresher = Refresher(cached)
    runner.poll_once()
    assert refresher.step() and cached._render.snapshots == [3]


# --- the refresher, stepped on a fake clock ---


class FakeTime:
    """The cache module's ``time``: monotonic and thread (CPU) time stepped by the test."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.cpu = 10.0
        self.cpu_per_call = 0.0

    def monotonic(self) -> float:
        return self.mono

    def thread_time(self) -> float:
        t = self.cpu
        self.cpu += self.cpu_per_call
        return t


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    t = FakeTime()
    monkeypatch.setattr(exposition_cache, "time", t)
    return t


def test_a_refresh_without_a_render_does_nothing_however_recent_the_scrape(node, fake_time):
    fake_time.mono = 10.0  # ten seconds after boot: not idle either
    assert not node.cached.refresh() and node.cached.renders == 0


def test_the_refresher_rests_after_exactly_idle_s_without_a_scrape(node, fake_time):
    cached = node.cached
    refresher = Refresher(cached)
    cached.reply("", False)  # at 1000
    node.publish(steps=4)
    fake_time.mono = 1000.0 + exposition_cache.IDLE_S  # 300 s: not yet idle
    assert refresher.step() and cached.renders == 2
    node.publish(steps=5)
    fake_time.mono += 0.5
    assert not refresher.step() and cached.renders == 2
    assert (
        b'steps_total{job_id="",local_rank="0",rank="0"} 4.0' in cached.reply("", False).body
    )  # the scrape is served what there is, and wakes it
    assert refresher.step() and cached.renders == 3


def test_reply_now_counts_as_a_scrape_for_idleness(node, fake_time):
    cached = node.cached
    refresher = Refresher(cached)
    cached.reply("", False)  # at 1000
    fake_time.mono = 1250.0
    assert cached.reply_now("", False) is not None
    node.publish(steps=4)
    fake_time.mono = 1400.0  # 400 s after the last reply(), 150 s after the last reply_now()
    assert refresher.step() and cached.renders == 2


def test_renders_keep_to_their_share_of_a_core_exactly(node, fake_time):
    cached = node.cached
    refresher = Refresher(cached)
    cached.reply("", False)  # built at 1000
    cached.render_cost = 1.0  # at most 2% of a core: the next render 50 s after this one
    node.publish(steps=4)
    fake_time.mono = 1049.5
    assert not refresher.step()
    fake_time.mono = 1050.0
    assert refresher.step() and cached.renders == 2


def test_min_gap_holds_a_newer_sample_back_exactly_that_long(node, fake_time):
    cached = node.cached
    refresher = Refresher(cached, min_gap=2.0)
    cached.reply("", False)  # built at 1000
    node.publish(steps=4)
    fake_time.mono = 1001.5
    assert not refresher.step()
    fake_time.mono = 1002.0
    assert refresher.step() and cached.renders == 2


def test_render_cost_is_the_refresh_renders_own_thread_time(node, fake_time):
    cached = node.cached
    refresher = Refresher(cached)
    cached.reply("", False)
    node.publish(steps=4)
    fake_time.cpu_per_call = 0.25
    assert refresher.step() and cached.render_cost == 0.25
    node.publish(steps=5)
    fake_time.mono += 12.0  # under 0.25 / 2%: the next waits
    assert not refresher.step()
    fake_time.mono += 0.5
    assert refresher.step()


def test_an_expired_render_is_rendered_again_whatever_the_gap_and_share(node, fake_time):
    cached = node.cached
    refresher = Refresher(cached, min_gap=3600.0)
    _dead(node.spool, 5, node.clock.now)
    cached.reply("", False)
    cached.render_cost = 3600.0
    assert not refresher.step()
    node.clock.now += GRACE + 1
    assert refresher.step() and b'rank="5"' not in cached.reply("", False).body


def test_without_start_a_refresh_renders_any_change(node):
    cached = node.cached
    cached.reply("", False)
    assert not cached.refresh()
    node.publish(steps=4)
    assert cached.refresh() and cached.renders == 2


def test_a_refresh_that_finds_a_scrape_rendered_meanwhile_does_nothing(node, monkeypatch):
    cached = node.cached
    refresher = Refresher(cached)
    cached.reply("", False)
    r = cached._render
    assert r is not None
    other = dataclasses.replace(r)  # what a scrape rendered while the refresh waited for the lock

    class ScrapeFirst:
        def __enter__(self) -> None:
            cached._render = other

        def __exit__(self, *exc: object) -> None:
            return None

    node.publish(steps=4)
    monkeypatch.setattr(cached, "_build_lock", ScrapeFirst())
    assert not refresher.step()
    assert cached._render is other and cached.renders == 1


def test_within_the_gap_a_refresh_lists_the_ranks_and_reads_no_header(node, monkeypatch):
    cached = node.cached
    refresher = Refresher(cached, min_gap=3600.0)
    cached.reply("", False)
    real = spool.spool_state
    looks: list[object] = []
    listing_fails = [False]

    def spool_state(d: str, headers: bool = True) -> spool.SpoolState | None:
        looks.append(headers)
        return None if listing_fails[0] and not headers else real(d, headers)

    monkeypatch.setattr(spool, "spool_state", spool_state)
    assert not refresher.step() and looks == [False]
    looks.clear()
    listing_fails[0] = True  # which ranks live is unknown: the sources are looked at, and are the same
    assert not refresher.step() and looks == [False, True] and cached.renders == 1


# --- the refresher's thread ---


@pytest.mark.parametrize(
    ("min_gap", "look", "want"),
    [
        (0.0, None, 0.02),
        (0.08, None, 0.02),
        (0.2, None, 0.05),
        (0.4, None, 0.1),
        (1.0, None, 0.25),
        (10.0, None, 0.25),
        (10.0, 3.0, 3.0),
        (0.0, 0.5, 0.5),
    ],
)
def test_the_refresher_looks_every_quarter_gap_within_20_to_250_ms(node, monkeypatch, min_gap, look, want):
    cached = node.cached
    seen: list[tuple[float, str, bool]] = []
    me = threading.current_thread

    monkeypatch.setattr(cached, "_loop", lambda look: seen.append((look, me().name, me().daemon)))
    cached.start(min_gap, look)
    assert cached._thread is not None
    cached._thread.join(timeout=5.0)
    assert seen == [(want, "vramwatch-render", True)] and cached.min_gap == min_gap


def test_stop_joins_the_refresher_for_at_most_5_s(node, monkeypatch):
    never_started = CachedExposition(node.exp)
    never_started.stop()  # nothing to join
    assert not never_started.refreshing
    cached = node.cached
    cached.start(min_gap=0.0, look=3600.0)
    t = cached._thread
    assert t is not None and cached.refreshing
    joins: list[object] = []
    real = t.join
    monkeypatch.setattr(t, "join", lambda timeout=None: joins.append(timeout) or real(timeout))
    cached.stop()
    assert joins == [5.0] and not t.is_alive() and not cached.refreshing


def test_a_failing_background_render_is_logged_dropped_and_the_loop_goes_on(node, monkeypatch, caplog):
    cached = node.cached
    caplog.set_level(logging.DEBUG, logger="vramwatch")
    cached.reply("", False)
    calls: list[int] = []

    def refresh() -> bool:
        calls.append(1)
        raise RuntimeError("render broke")

    monkeypatch.setattr(cached, "refresh", refresh)
    cached.start(min_gap=0.0, look=0.01)
    deadline = time.monotonic() + 10.0
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) >= 3 and cached._render is None and cached.refreshing
    cached.stop()
    failed = [r for r in caplog.records if r.name == "vramwatch" and "background render" in r.getMessage()]
    assert len(failed) >= 3
    for rec in failed:
        assert rec.levelno == logging.DEBUG and rec.getMessage() == "vramwatch: background render failed"
        assert rec.exc_info is not None and rec.exc_info[0] is RuntimeError
    assert b"counter_reads 1.0" in cached.reply("", False).body and cached.renders == 2  # the scrape renders


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the test
def test_a_refresher_that_dies_stops_the_loop_serving_without_a_render(node, monkeypatch):
    # the scrape reads a flag, not Thread.is_alive(): the dying thread must clear it, or the loop would
    # serve the last render for ever with nothing keeping it current
    cached = node.cached
    cached.reply("", False)
    assert cached.reply_now("", False) is None  # no refresher yet: a worker answers

    def refresh() -> bool:
        raise SystemExit  # what no `except Exception` catches: the thread ends

    monkeypatch.setattr(cached, "refresh", refresh)
    cached.start(min_gap=0.0, look=0.01)
    assert cached._thread is not None
    cached._thread.join(timeout=10.0)
    assert not cached._thread.is_alive() and not cached.refreshing
    assert cached.reply_now("", False) is None
