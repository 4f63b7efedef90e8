"""The /metrics bytes, rendered at most once per gap and served from memory in between.

What the families show changes when a rank publishes (once per ``interval``) or a collector reads (once
per ``nvml_interval``), so the server renders once per ``gap``, the shorter of the two, and a scrape
serves the last render: samples at most one gap plus one interval old. While anyone scrapes (one in the
last ``IDLE_S``), a refresher thread renders when the render is a gap old, and encodes it in each format
scrapes asked for (Prometheus text, OpenMetrics, gzipped or not), so the server's event loop answers a
scrape from memory (:meth:`CachedExposition.reply_now`); a scrape that finds no current render (the
first one, one after a long pause, a format never asked for) renders on a worker thread, and concurrent
ones share one render.

``vramwatch_sample_age_seconds`` is as of the render: at most one gap (and one look of the refresher) old,
as the contract says. A dead rank's final sample stays for ``dead_rank_grace_seconds``, so a render that
carries final samples expires when the first of them leaves. A render from a failed read of the spool is
never served again (the next scrape reads again), nor one from before the server's guard changed its
word on the spool.
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
Encoder = Callable[..., bytes]

AGE_GAP = 1.0  # default gap: a render older than this is rendered again, for its ages
IDLE_S = 300.0  # no scrape this long: the refresher rests until the next one
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
        self.look = min(0.25, max(0.02, gap / 4))  # how often the refresher looks at the render's age
        self._clock = clock
        self._lock = threading.Lock()  # one render at a time: concurrent scrapes share it
        self._render: _Render | None = None
        self._asked: dict[tuple[str, bool], Encoder] = {}  # the formats scrapes asked for: encoded ahead
        self._scraped_at = -IDLE_S  # monotonic time of the last scrape
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renders = 0  # how many times the families were rendered (tests read it)

    # --- the refresher: renders before a scrape needs it, while anyone scrapes ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="vramwatch-render", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    @property
    def refreshing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.wait(self.look):
            try:
                self.refresh()
            except Exception:  # the next scrape renders for itself, and answers 500 if that fails too
                log.debug("vramwatch: background render failed", exc_info=True)

    def refresh(self) -> bool:
        """Render (and encode each format asked for) if the render is a gap old and someone scraped in the
        last ``IDLE_S``; whether it did. Nothing is rendered before the first scrape."""
        if time.monotonic() - self._scraped_at > IDLE_S:
            return False
        with self._lock:
            r = self._render
            if r is not None and not self._stale(r, 0.0):
                return False
            r = self._build()
            for (ctype, gzip_ok), encoder in list(self._asked.items()):
                self._body(r, ctype, gzip_ok, encoder)
            self._render = r  # swapped in whole: the loop serves the last one meanwhile
            return True

    # --- renders ---
    def _stale(self, r: _Render, slack: float) -> bool:
        exp = self.exporter
        # the spool's `up` and errors follow the guard, which hands them over after its check: a spool made
        # again (empty, as before) shows its trouble's end and its count at once
        return (
            not r.ok
            or r.guard != (exp.spool_trouble, exp.spool_vanished)
            or time.monotonic() - r.built_at >= self.gap + slack
            or (r.expires is not None and self._clock() >= r.expires)
        )

    def _build(self) -> _Render:
        exp = self.exporter
        guard = (exp.spool_trouble, exp.spool_vanished)
        ctx = exp.context()
        fams = list(exp.families(ctx))
        self.renders += 1
        return _Render(ctx, fams, exp.last_read_ok, guard, exp.last_read_expires, time.monotonic())

    def current(self) -> _Render:
        """The render a scrape serves now, rendered again if it is a gap old or stale."""
        with self._lock:
            r = self._current(render=True)
            assert r is not None
            return r

    def _current(self, render: bool) -> _Render | None:
        self._scraped_at = time.monotonic()
        r = self._render
        # while the refresher runs, it renders at its next look: a render up to one look past the gap will do
        if r is None or self._stale(r, self.look if self.refreshing else 0.0):
            if not render:
                return None
            r = self._render = self._build()
        else:
            self.exporter.mark_served(r.ctx)
        return r

    @staticmethod
    def _body(r: _Render, ctype: str, gzip_ok: bool, encoder: Encoder) -> bytes:
        """The render's bytes in one format, encoded (and gzipped) once per render, whoever asks first."""
        body = r.bodies.get((ctype, gzip_ok))
        if body is None:
            body = r.bodies.get((ctype, False))
            if body is None:
                body = encoder(_Families(r.fams))
                if len(r.bodies) < _MAX_BODIES:
                    r.bodies[(ctype, False)] = body
            if gzip_ok:
                body = gzipped(body)
                if len(r.bodies) < _MAX_BODIES:
                    r.bodies[(ctype, True)] = body
        return body

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        encoder, ctype = choose_encoder(accept)
        with self._lock:
            if (ctype, gzip_ok) not in self._asked and len(self._asked) < _MAX_BODIES:
                self._asked[(ctype, gzip_ok)] = encoder
            r = self._current(render=True)
            assert r is not None
            body = self._body(r, ctype, gzip_ok, encoder)
        return Reply(body, ctype, "gzip") if gzip_ok else Reply(body, ctype)

    def reply_now(self, accept: str, gzip_ok: bool) -> Reply | None:
        """:meth:`reply`'s answer if it needs no render and no encoding, else None: for the server's event loop,
        which hands only the scrapes that need one to a worker thread (a thread costs more than the answer), and
        never waits for a render under way."""
        ctype = choose_encoder(accept)[1]
        r = self._render  # no lock: a render under way is swapped in whole when done
        body = None if r is None else r.bodies.get((ctype, gzip_ok))
        if body is None or self._current(render=False) is not r:
            return None
        return Reply(body, ctype, "gzip") if gzip_ok else Reply(body, ctype)
