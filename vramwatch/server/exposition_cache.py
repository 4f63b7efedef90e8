"""The /metrics bytes, rendered once per change of what they show and served from memory in between.

What the families show changes only when a rank publishes (once per ``interval``) or a collector
reads (once per ``nvml_interval``). A refresher thread looks for such a change every fraction of an
interval (each rank file's record header and lock, each collector's snapshot and health: no
decoding) and renders again when it sees one, at most once per ``min(interval, nvml_interval)``, and
never more often than keeps its renders within ``RENDER_MAX_SHARE`` of a core; a
scrape serves the last render and costs no read at all. Until the first scrape nothing is rendered,
and after ``IDLE_S`` without one the refresher rests again. A render is built aside and swapped in,
so a scrape never waits on it. Without the refresher (it is not started, or died) a scrape compares
the sources itself and renders when they changed, once for concurrent scrapes.

Freshness: a scrape serves the newest render, at most one render gap plus one look behind the spool
(about 1.25 s at the defaults; Prometheus scrapes every 15 s or more); for a rank that appeared or
died, one look (0.25 s at the defaults). ``vramwatch_sample_age_seconds`` moves with the clock rather
than with the samples: a render older than the gap is rendered again even when nothing changed, so the
ages served are at most one render old (the contract says so). Each content type asked for is encoded
by prometheus_client's own encoder once per render, and gzipped once per render when asked.

Dead ranks: a rank's death (its lock freed) changes the sources, so it is rendered at the next look;
its final sample then stays for ``dead_rank_grace_seconds`` without changing anything on disk, so a
render that carries final samples expires when the first of them leaves, and is rendered again then.
A rejected file or a failed read is counted per read of the spool, and a failed read is tried again
at the next look.

Serving: :meth:`CachedExposition.reply_now` is the part of a scrape that needs neither a render nor a
lock (the render is current and has the asked format built), so the HTTP server's event loop answers
such a scrape itself; anything else goes to a worker thread through :meth:`CachedExposition.reply`.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from vramwatch import spool
from vramwatch.server.collectors import ScrapeContext
from vramwatch.server.registry import ExporterCollector

log = logging.getLogger("vramwatch")

Encoder = Callable[..., bytes]
_MAX_FORMATS = 8  # content types kept per render: the Accept header picks one, and a client may send any
_MAX_ACCEPTS = 32  # Accept headers whose encoder is remembered (Prometheus and curl send one each)


@dataclass(frozen=True)
class Reply:
    """A /metrics answer: the body, its Content-Type, and its Content-Encoding (None: identity)."""

    body: bytes
    content_type: str
    encoding: str | None = None


class Exposition(Protocol):
    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        """The /metrics answer for a request's ``Accept`` header, gzipped when the client allows it."""
        ...


class _Families:
    """What ``collect()`` of a registry yields: a fixed list, so prometheus_client can render it."""

    def __init__(self, fams: Iterable[Metric]) -> None:
        self.fams = list(fams)

    def collect(self) -> list[Metric]:
        return self.fams


def gzipped(body: bytes) -> bytes:
    """``body`` as one gzip member at level 1 (a scrape is small and served often), mtime 0."""
    return gzip.compress(body, compresslevel=1, mtime=0)


def _reply(body: bytes, ctype: str, gzip_ok: bool) -> Reply:
    return Reply(gzipped(body), ctype, "gzip") if gzip_ok else Reply(body, ctype)


class RegistryExposition:
    """No cache: every request renders the registry (for a registry handed straight to the HTTP server)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        encoder, ctype = choose_encoder(accept)
        return _reply(encoder(self.registry), ctype, gzip_ok)


@dataclass
class _Format:
    """One content type's bytes of a render, and their gzip form once it was asked for."""

    body: bytes
    gz: bytes | None = None  # one attribute, set whole: the event loop reads it without the render's lock


@dataclass(eq=False)
class _Render:
    """One render's families and, per content type asked for so far, its bytes."""

    ctx: ScrapeContext
    fams: list[Metric]
    key: tuple[object, ...] | None  # the sources it was rendered from; None: compare unequal to anything
    expires: float | None  # wall time the first dead rank's final sample in it leaves (None: never)
    snapshots: list[object]  # held, so no new snapshot can take an id() in the key
    built_at: float
    formats: dict[str, _Format] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _names: tuple[tuple[str, bool], ...] | None = None

    @property
    def names(self) -> tuple[tuple[str, bool], ...] | None:
        """The rank files it was rendered from, each with whether its rank was alive (None: unknown)."""
        if self.key is None:
            return None
        if self._names is None:  # a scrape compares them every time: build the tuple once
            state: spool.SpoolState = self.key[0]  # type: ignore[assignment]
            self._names = tuple((name, alive) for name, _, alive in state)
        return self._names

    def format(self, ctype: str, encoder: Encoder, gzip_ok: bool) -> _Format:
        with self.lock:
            f = self.formats.get(ctype)
            if f is None:
                f = _Format(encoder(_Families(self.fams)))
                if len(self.formats) < _MAX_FORMATS:
                    self.formats[ctype] = f
            if gzip_ok and f.gz is None:
                f.gz = gzipped(f.body)
            return f

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires


AGE_GAP = 1.0  # without a refresher, a render's ages are served at most this old
IDLE_S = 300.0  # no scrape this long: the refresher stops rendering until the next one
# Most of one core the refresher's renders may use: a render that takes longer than this share of
# its gap (a large node: 64 ranks render in tens of ms) spaces the next one out instead.
RENDER_MAX_SHARE = 0.02


class CachedExposition:
    """The server's /metrics: rendered when the spool or a collector changed, else served from memory."""

    def __init__(self, exporter: ExporterCollector, clock: Callable[[], float] = time.time) -> None:
        self.exporter = exporter
        self._clock = clock
        self._build_lock = threading.Lock()  # one render at a time
        self._render: _Render | None = None
        self._asked: dict[str, tuple[Encoder, bool]] = {}  # content type -> encoder, gzip wanted
        self._scraped_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the refresher runs: a flag its thread clears on the way out, so that a scrape asks no lock
        # (Thread.is_alive() takes one: a cold scrape's microseconds on the loop)
        self._refreshing = False
        self.min_gap = 0.0
        self.render_cost = 0.0  # CPU seconds of the refresher's last render (its thread's clock)
        self.renders = 0  # how many times the families were rendered (tests and benchmarks read it)
        self._encoders: dict[str, tuple[Encoder, str]] = {}  # Accept header -> choose_encoder's answer

    # --- the refresher ---
    def start(self, min_gap: float, look: float | None = None) -> None:
        """Render on change from a thread, at most once per ``min_gap`` s, looking every ``look`` s
        (default: a quarter of the gap, within 0.02-0.25 s)."""
        self.min_gap = min_gap
        look = min(0.25, max(0.02, min_gap / 4)) if look is None else look
        self._thread = threading.Thread(target=self._loop, args=(look,), name="vramwatch-render", daemon=True)
        self._refreshing = True
        try:
            self._thread.start()
        except BaseException:
            self._refreshing = False
            raise

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _loop(self, look: float) -> None:
        try:
            while not self._stop.wait(look):
                try:
                    self.refresh()
                except Exception:
                    # the next scrape renders for itself, and answers 500 if that fails too
                    log.debug("vramwatch: background render failed", exc_info=True)
                    self._render = None
        finally:
            self._refreshing = False

    def refresh(self) -> bool:
        """Render again if the sources changed since the last render; whether it did.

        Within ``min_gap`` of the last render only which ranks live is looked at (a directory listing
        and a lock probe per rank, no record read): a rank that appeared or died is rendered at this
        look, a newer sample at the first look after the gap."""
        r = self._render
        if r is None or time.monotonic() - self._scraped_at > IDLE_S:
            return False  # nobody scrapes: nothing to keep fresh
        expired = r.expired(self._clock())  # once per dead rank: never waits
        if not expired:
            since = time.monotonic() - r.built_at
            if since < self.render_cost / RENDER_MAX_SHARE:
                return False  # a birth or death waits too: renders stay within their share of a core
            if since < self.min_gap and (r.names is None or self._names() == r.names):
                return False
        with self._build_lock:
            if self._render is not r:
                return False  # a scrape rendered meanwhile
            snapshots = self._snapshots()
            key = self._sources(snapshots)
            if key is not None and key == r.key and not expired and time.monotonic() - r.built_at < self.age_gap:
                return False  # unchanged, and its ages are younger than a gap
            t0 = time.thread_time()
            new = self._build(snapshots, key)
            for ctype, (encoder, gzip_ok) in list(self._asked.items()):
                new.format(ctype, encoder, gzip_ok)  # ready before the next scrape asks
            self._render = new
            self.render_cost = time.thread_time() - t0
            return True

    @property
    def age_gap(self) -> float:
        """An unchanged render older than this is rendered again, for its ages (the gap; AGE_GAP without one)."""
        return self.min_gap or AGE_GAP

    @property
    def refreshing(self) -> bool:
        return self._refreshing

    # --- renders ---
    def _snapshots(self) -> list[object]:
        return [c.snapshot for c in self.exporter.collectors]

    def _sources(self, snapshots: list[object]) -> tuple[object, ...] | None:
        """What the families depend on besides the clock; None when only a read will do."""
        state = spool.spool_state(self.exporter.spool_dir)
        if state is None:
            return None
        health = tuple((c.health.up, c.health.errors, c.health.duration) for c in self.exporter.collectors)
        # the spool's `up` and errors follow the guard, which the server hands over after the guard's check: a
        # render between the two has the new directory and the old trouble, and a spool made again (empty,
        # as before) reads as the old one
        guard = (self.exporter.spool_trouble, self.exporter.spool_vanished)
        return state, tuple(map(id, snapshots)), health, guard

    def _build(self, snapshots: list[object], key: tuple[object, ...] | None) -> _Render:
        # the snapshots and the spool were looked at before the read: whatever changes in between
        # only makes the next look render again
        ctx = self.exporter.context()
        fams = list(self.exporter.families(ctx))
        exp = self.exporter
        self.renders += 1
        return _Render(
            ctx,
            fams,
            key if exp.last_read_ok else None,
            exp.last_read_expires,
            snapshots,
            time.monotonic(),
        )

    def current(self) -> _Render:
        """The render a scrape serves now, rendering one if none will do."""
        self._scraped_at = time.monotonic()
        r = self._render
        if r is not None and r.key is not None and self.refreshing and not r.expired(self._clock()):
            # the refresher keeps it current: a newer sample, a rank that appeared or died, comes with
            # its next look (the scrape itself touches no file)
            return self._serve(r)
        with self._build_lock:  # concurrent scrapes wait for one render instead of each doing its own
            r = self._render
            snapshots = self._snapshots()
            key = self._sources(snapshots)
            stale = r is not None and time.monotonic() - r.built_at >= self.age_gap  # its ages too old
            if r is None or r.expired(self._clock()) or key is None or key != r.key or stale:
                r = self._render = self._build(snapshots, key)
        return self._serve(r)

    def _names(self) -> tuple[tuple[str, bool], ...] | None:
        state = spool.spool_state(self.exporter.spool_dir, headers=False)
        return None if state is None else tuple((name, alive) for name, _, alive in state)

    def _serve(self, r: _Render) -> _Render:
        self.exporter.mark_served(r.ctx)
        return r

    def _encoder(self, accept: str) -> tuple[Encoder, str]:
        """``choose_encoder``, remembered for the few Accept headers a node's scrapers send."""
        hit = self._encoders.get(accept)
        if hit is None:
            hit = choose_encoder(accept)
            if len(self._encoders) < _MAX_ACCEPTS:  # the header is the client's: never an unbounded table
                self._encoders[accept] = hit
        return hit

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        encoder, ctype = self._encoder(accept)
        if ctype not in self._asked and len(self._asked) < _MAX_FORMATS:
            self._asked[ctype] = (encoder, gzip_ok)
        elif gzip_ok and ctype in self._asked and not self._asked[ctype][1]:
            self._asked[ctype] = (encoder, True)
        f = self.current().format(ctype, encoder, gzip_ok)
        return Reply(f.gz, ctype, "gzip") if gzip_ok and f.gz is not None else Reply(f.body, ctype)

    def reply_now(self, accept: str, gzip_ok: bool) -> Reply | None:
        """The answer :meth:`reply` would give, if it needs no render and no lock; else None.

        For the server's event loop: it serves a scrape without handing it to a worker when the
        refresher keeps the render current and this format (and its gzip form, if asked) is built.
        The checks are :meth:`current`'s fast path, and none touches a file (a listing and a lock probe
        per rank cost a scrape 9 us at 1 rank, 37 us at 8, 262 us at 64 on the CPU machine, and each
        system call gave the GIL to whatever thread wanted it); anything else (no render yet, a failed
        read, a format never asked for, no refresher) is left to :meth:`reply` on a worker.
        """
        r = self._render
        if r is None or not self._refreshing or r.expired(self._clock()):
            return None
        _, ctype = self._encoder(accept)
        f = r.formats.get(ctype)
        if f is None or (gzip_ok and f.gz is None):
            return None
        if r.key is None:
            return None  # the last read failed: a worker reads again
        self._scraped_at = time.monotonic()
        self._serve(r)
        return Reply(f.gz, ctype, "gzip") if gzip_ok and f.gz is not None else Reply(f.body, ctype)
