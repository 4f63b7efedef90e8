"""The /metrics bytes, rendered at most once per gap and served from memory in between.

What the families show changes when a rank publishes (once per ``interval``) or a collector reads (once
per ``nvml_interval``), so the server renders at most once per ``gap``, the shorter of the two: a scrape
serves the last render until it is a gap old, and samples at most one gap plus one interval old. The
server's event loop answers a scrape that needs no render itself (:meth:`CachedExposition.reply_now`:
no file is touched); one that needs a render goes to a worker thread, and concurrent ones share one
render. Each content type asked for is encoded by prometheus_client's own encoder once per render, and
gzipped once per render when asked.

``vramwatch_sample_age_seconds`` is as of the render: at most one gap old (the contract says so). A dead
rank's final sample stays for ``dead_rank_grace_seconds``, so a render that carries final samples
expires when the first of them leaves. A render from a failed read of the spool is never served again
(the next scrape reads again), nor one from before the server's guard changed its word on the spool.
Without scrapes the server's loop still renders now and then (:meth:`CachedExposition.keep_read`): the
read reaps what dead ranks left.
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

from vramwatch.server.collectors import ScrapeContext
from vramwatch.server.registry import ExporterCollector

log = logging.getLogger("vramwatch")

AGE_GAP = 1.0  # default gap: an unchanged render older than this is rendered again, for its ages
_MAX_BODIES = 8  # bodies kept per render: the Accept header picks the content type, and a client may send any


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


class RegistryExposition:
    """No cache: every request renders the registry (for a registry handed straight to the HTTP server)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        encoder, ctype = choose_encoder(accept)
        body = encoder(self.registry)
        return Reply(gzipped(body), ctype, "gzip") if gzip_ok else Reply(body, ctype)


@dataclass(eq=False)
class _Render:
    ctx: ScrapeContext
    fams: list[Metric]
    ok: bool  # the spool was read: else it is never served again
    guard: tuple[str, int]  # the guard's word on the spool it was rendered with (trouble, vanishings)
    expires: float | None  # wall time the first dead rank's final sample in it leaves (None: never)
    built_at: float
    bodies: dict[tuple[str, bool], bytes] = field(default_factory=dict)  # (content type, gzipped) -> bytes


class CachedExposition:
    """The server's /metrics: rendered at most once a gap, served from memory in between."""

    def __init__(self, exporter: ExporterCollector, gap: float = AGE_GAP, clock: Callable[[], float] = time.time):
        self.exporter = exporter
        self.gap = gap
        self._clock = clock
        self._lock = threading.Lock()  # one render at a time: concurrent scrapes share it
        self._render: _Render | None = None
        self.renders = 0  # how many times the families were rendered (tests read it)

    def current(self) -> _Render:
        """The render a scrape serves now, rendered again if it is a gap old or stale."""
        with self._lock:
            r = self._current(render=True)
            assert r is not None
            return r

    def keep_read(self, every: float) -> None:
        """Render when the last render is ``every`` s old, scraped or not: the spool's read behind it reaps the
        files of ranks that are gone (for the server's own loop)."""
        r = self._render
        if r is None or time.monotonic() - r.built_at >= every:
            try:
                self.current()
            except Exception:  # the next scrape renders for itself, and answers 500 if that fails too
                log.debug("vramwatch: rendering /metrics failed", exc_info=True)

    def _current(self, render: bool) -> _Render | None:
        exp = self.exporter
        # the spool's `up` and errors follow the guard, which hands them over after its check: a spool made
        # again (empty, as before) shows its trouble's end and its count at once
        guard = (exp.spool_trouble, exp.spool_vanished)
        r = self._render
        if (
            r is None
            or not r.ok
            or r.guard != guard
            or time.monotonic() - r.built_at >= self.gap
            or (r.expires is not None and self._clock() >= r.expires)
        ):
            if not render:
                return None
            ctx = exp.context()
            fams = list(exp.families(ctx))
            r = self._render = _Render(ctx, fams, exp.last_read_ok, guard, exp.last_read_expires, time.monotonic())
            self.renders += 1
        else:
            exp.mark_served(r.ctx)
        return r

    def _reply(self, accept: str, gzip_ok: bool, render: bool) -> Reply | None:
        encoder, ctype = choose_encoder(accept)
        r = self._current(render)
        body = None if r is None else r.bodies.get((ctype, gzip_ok))
        if body is None:
            if r is None or not render:
                return None
            body = r.bodies.get((ctype, False))
            if body is None:  # each body is encoded (and gzipped) once per render, whoever asks first
                body = encoder(_Families(r.fams))
                if len(r.bodies) < _MAX_BODIES:
                    r.bodies[(ctype, False)] = body
            if gzip_ok:
                body = gzipped(body)
                if len(r.bodies) < _MAX_BODIES:
                    r.bodies[(ctype, True)] = body
        return Reply(body, ctype, "gzip") if gzip_ok else Reply(body, ctype)

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        with self._lock:
            reply = self._reply(accept, gzip_ok, render=True)
            assert reply is not None
            return reply

    def reply_now(self, accept: str, gzip_ok: bool) -> Reply | None:
        """:meth:`reply`'s answer if it needs no render and no encoding, else None: for the server's event loop,
        which hands only the scrapes that need one to a worker thread (a thread costs more than the answer)."""
        if not self._lock.acquire(blocking=False):
            return None  # a worker is rendering: it answers after that
        try:
            return self._reply(accept, gzip_ok, render=False)
        finally:
            self._lock.release()
