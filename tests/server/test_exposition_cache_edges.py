"""The exposition cache's edges: the gzip member byte by byte, the bounds on what a client may make it keep,
the refresher's clock boundaries (on a fake clock), its thread and its failures, and reply_now's refusals."""

from __future__ import annotations

import dataclasses
import gzip
import logging
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from test_exposition_cache import GRACE, Clock, Refresher, _dead, same_but_spool_time, sample, two_ranks

from vramwatch import spool
from vramwatch.server import exposition_cache
from vramwatch.server.collectors import Runner, ScrapeContext
from vramwatch.server.exposition_cache import CachedExposition, RegistryExposition, Reply, _stored_blocks, zlib_gzip
from vramwatch.server.promtext import choose_encoder
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


def families_after_the_age(exp: ExporterCollector, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two families after the age family (the exporter yields none), so the part after it is real text."""
    real = exp.families

    def families(ctx: ScrapeContext) -> Iterator[Metric]:
        yield from real(ctx)
        yield _gauge("zz_after_a", 300)
        yield _gauge("zz_after_b", 3)

    monkeypatch.setattr(exp, "families", families)


def deflate(data: bytes, level: int = 1, flush: int = zlib.Z_FINISH) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
    return c.compress(data) + c.flush(flush)


def stored(data: bytes) -> bytes:
    """RFC 1951 stored blocks, not final: BTYPE 00, then LEN and its complement, at most 65535 bytes each."""
    chunks = [data[i : i + 65535] for i in range(0, len(data), 65535)] or [b""]
    return b"".join(b"\x00" + len(c).to_bytes(2, "little") + (65535 - len(c)).to_bytes(2, "little") + c for c in chunks)


def inflate_raw(stream: bytes) -> bytes:
    d = zlib.decompressobj(-zlib.MAX_WBITS)
    out = d.decompress(stream)
    assert d.eof and not d.unused_data
    return out


# --- the gzip pieces ---


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"vramwatch 0\n",  # its CRC32 is over 2**31: packed unsigned
        b"".join(b'gpu_bytes{gpu="%d",rank="%d"} %d\n' % (i % 8, i, 3 * 10**9 + i * 7919) for i in range(400)),
    ],
)
def test_zlib_gzip_is_one_member_of_level_1_raw_deflate_with_crc_and_size(body):
    want = GZIP_HEADER + deflate(body) + struct.pack("<II", zlib.crc32(body), len(body))
    assert zlib_gzip(body) == want
    assert gzip.decompress(want) == body
    if len(body) > 1000:  # what tells the level and the raw stream apart on this text
        assert deflate(body, 2) != deflate(body)
        assert zlib.compress(body, 1) != deflate(body)
    if body == b"vramwatch 0\n":
        assert zlib.crc32(body) >= 2**31


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
        assert whole.reply(accept, True) == Reply(zlib_gzip(body), ctype, "gzip")


class Sliced(bytes):
    """Bytes that fail a slice past the blocks' count: a split that went wrong stops at once rather than
    copying gigabytes (a step of 1 over 128 KiB would)."""

    def __getitem__(self, key):  # type: ignore[no-untyped-def,override]
        if isinstance(key, slice):
            self.slices = getattr(self, "slices", 0) + 1
            assert self.slices <= -(-len(self) // 65535), "more slices than blocks"
        return super().__getitem__(key)


@pytest.mark.parametrize("n", [0, 1, 65535, 65536, 2 * 65535 + 3])
def test_stored_blocks_split_at_65535_bytes_each_with_its_length_and_complement(n):
    data = Sliced(i % 251 for i in range(n))
    blocks = _stored_blocks(data)
    assert blocks == stored(bytes(data))
    assert len(blocks) == n + 5 * max(1, -(-n // 65535))
    assert inflate_raw(blocks + deflate(b"")) == data  # then a final empty block: the stream is whole


def _split(text: bytes, tail_marker: bytes | None) -> tuple[bytes, bytes, bytes]:
    """A scrape's text as the part before the age family, the age family, and the part after it."""
    start = text.index(AGE_HELP)
    if tail_marker is not None:
        end = text.index(tail_marker)
    else:
        end = len(text) - len(b"# EOF\n") if text.endswith(b"# EOF\n") else len(text)
    return text[:start], text[start:end], text[end:]


@pytest.mark.parametrize("accept", ["", OM])
def test_a_gzip_scrape_is_byte_for_byte_the_spliced_member(node, monkeypatch, accept):
    families_after_the_age(node.exp, monkeypatch)
    plain = node.cached.reply(accept, False).body
    assert same_but_spool_time(plain, node.whole.reply(accept, False).body)  # both families after the age
    head, age, tail = _split(plain, b"# HELP zz_after_a ")
    assert age.count(b"\nvramwatch_sample_age_seconds{") == 2 and tail.count(b"# HELP zz_after_") == 2
    # level 1, the head flushed to a byte boundary with no history, the age lines stored, the tail deflated
    assert deflate(head, 2, zlib.Z_FULL_FLUSH) != deflate(head, 1, zlib.Z_FULL_FLUSH)
    assert deflate(tail, 2) != deflate(tail, 1)
    want = (
        GZIP_HEADER
        + deflate(head, 1, zlib.Z_FULL_FLUSH)
        + stored(age)
        + deflate(tail)
        + struct.pack("<II", zlib.crc32(plain), len(plain))
    )
    for _ in range(2):  # built at the first gzip scrape, reused at the second
        gz = node.cached.reply(accept, True)
        assert gz == Reply(want, node.whole.reply(accept, False).content_type, "gzip")
    (fmt,) = node.cached.current().formats.values()
    assert fmt.gz == (deflate(head, 1, zlib.Z_FULL_FLUSH), deflate(tail), zlib.crc32(head))
    assert fmt.gz_head == fmt.gz[0] and (fmt.head, fmt.tail) == (head, tail)


def test_age_lines_over_64_kib_go_as_several_stored_blocks(node, monkeypatch):
    real = node.exp.context

    def context() -> ScrapeContext:  # 300 ranks with long job ids: age lines of ~80 KB
        ctx = real()
        base = ctx.samples[0]
        many = tuple(dataclasses.replace(base, rank=i, local_rank=i, job_id="j" * 200) for i in range(300))
        return dataclasses.replace(ctx, samples=many)

    monkeypatch.setattr(node.exp, "context", context)
    plain = node.cached.reply("", False).body
    head, age, tail = _split(plain, None)
    assert len(age) > 65535 and tail == b""
    gz = node.cached.reply("", True).body
    assert gz == GZIP_HEADER + deflate(head, 1, zlib.Z_FULL_FLUSH) + stored(age) + deflate(b"") + struct.pack(
        "<II", zlib.crc32(plain), len(plain)
    )
    assert gzip.decompress(gz) == plain


def test_an_age_line_is_cut_at_its_last_space_so_label_values_with_spaces_stay_whole(node, monkeypatch):
    real = node.exp.context

    def context() -> ScrapeContext:  # a label value may hold spaces (the spool's job ids do not)
        ctx = real()
        return dataclasses.replace(ctx, samples=tuple(dataclasses.replace(s, job_id="job a b") for s in ctx.samples))

    monkeypatch.setattr(node.exp, "context", context)
    node.clock.now += 2.0
    body = node.cached.reply("", False).body
    assert b'vramwatch_sample_age_seconds{job_id="job a b",local_rank="1",rank="1"} 2.5\n' in body
    assert same_but_spool_time(body, node.whole.reply("", False).body)


def test_the_ages_are_of_the_caches_clock(node):
    # not the wall clock's (which the fixture's clock is): the cache's own, at the scrape
    t = node.clock.now
    cached = CachedExposition(node.exp, clock=lambda: t + 12.0)
    body = cached.reply("", False).body
    for r in range(2):
        line = b'vramwatch_sample_age_seconds{job_id="",local_rank="%d",rank="%d"} 12.5\n' % (r, r)
        assert line in body


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

    def read(now: float) -> object:
        if failing:
            raise OSError("spool gone")
        return real(now)

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
