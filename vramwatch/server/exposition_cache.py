"""The /metrics bytes, rendered once per change of what they show and served from memory in between.

A scrape costs a look at the spool (each rank file's record header and lock: no decoding) and a
comparison with what the last render saw: the same rank records, the same collector snapshots and
health. When all match, the scrape gets the bytes rendered then; otherwise it renders again, once,
while concurrent scrapes wait for that render instead of doing their own. A source changes at most
once per its interval (a rank per ``interval``, NVML per ``nvml_interval``), so that is how often a
render runs, whatever the scrape rate.

Freshness: ``vramwatch_sample_age_seconds`` is the one family that moves with the clock rather than
with the samples, so it is not cached: each format's bytes are kept as the part before that family and
the part after it, and every scrape renders the family (one line per rank) between them, with the
scrape's own time, as before. The gzip form is one gzip member whose deflate stream is spliced the
same way: the parts before and after are compressed once (each ends on a byte boundary, with no
back-reference across it) and the age lines go between them as a stored block; only the CRC32 over
the whole text is computed per scrape. What a format shows for the same inputs is byte-identical to
rendering it whole; a format (and its gzip form) is rendered only once a scrape asks for it.

A spool read that met trouble (a dead rank to reap, a rejected file, an error) is never reused: until
the spool is clean again every scrape reads it, so what a scrape means there (a dead rank served once,
an error counted per scrape) is unchanged.
"""

from __future__ import annotations

import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from vramwatch import spool
from vramwatch.server.collectors import ScrapeContext, ranks
from vramwatch.server.registry import ExporterCollector

Encoder = Callable[..., bytes]
_OM_EOF = b"# EOF\n"
_MAX_FORMATS = 8  # content types kept per render: the Accept header picks one, and a client may send any
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, mtime 0, OS unknown


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


class RegistryExposition:
    """No cache: every request renders the registry (for a registry handed straight to the HTTP server)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        encoder, ctype = choose_encoder(accept)
        body = encoder(self.registry)
        if gzip_ok:
            return Reply(zlib_gzip(body), ctype, "gzip")
        return Reply(body, ctype)


def zlib_gzip(body: bytes) -> bytes:
    """``body`` as one gzip member, compressed at level 1 (a scrape is small and served often)."""
    c = zlib.compressobj(1, zlib.DEFLATED, -zlib.MAX_WBITS)
    return _GZIP_HEADER + c.compress(body) + c.flush() + struct.pack("<II", zlib.crc32(body), len(body) & 0xFFFFFFFF)


def _stored_blocks(data: bytes) -> bytes:
    """``data`` as non-final stored deflate blocks, starting on a byte boundary."""
    out = []
    for i in range(0, len(data), 0xFFFF):
        chunk = data[i : i + 0xFFFF]
        out.append(struct.pack("<BHH", 0, len(chunk), len(chunk) ^ 0xFFFF) + chunk)
    return b"".join(out)


@dataclass
class _Format:
    """One content type's bytes around the age family, and their deflate forms once gzip was asked for.

    The age family itself is kept as its comment lines and, per rank, its sample line up to the value:
    a scrape only formats the values (as prometheus_client does) between them.
    """

    encoder: Encoder
    head: bytes
    tail: bytes
    age_meta: bytes
    age_lines: list[bytes]
    gz_head: bytes | None = None
    gz_tail: bytes | None = None
    head_crc: int = 0

    def gzip_parts(self) -> tuple[bytes, bytes]:
        if self.gz_head is None or self.gz_tail is None:
            c = zlib.compressobj(1, zlib.DEFLATED, -zlib.MAX_WBITS)
            self.gz_head = c.compress(self.head) + c.flush(zlib.Z_FULL_FLUSH)  # byte-aligned, no history after
            c = zlib.compressobj(1, zlib.DEFLATED, -zlib.MAX_WBITS)
            self.gz_tail = c.compress(self.tail) + c.flush()
            self.head_crc = zlib.crc32(self.head)
        return self.gz_head, self.gz_tail


@dataclass
class _Render:
    """One render's families and, per content type asked for so far, its bytes."""

    ctx: ScrapeContext
    before: list[Metric]
    after: list[Metric]
    formats: dict[str, _Format] = field(default_factory=dict)

    def format(self, ctype: str, encoder: Encoder) -> _Format:
        f = self.formats.get(ctype)
        if f is None:
            age = _strip_eof(encoder(_Families([ranks.age_family(self.ctx.samples, self.ctx.now)])))
            lines = age.splitlines(keepends=True)
            meta = b"".join(x for x in lines if x.startswith(b"#"))
            # a sample line is "name{labels} value\n": the value is its last field
            samples = [x.rsplit(b" ", 1)[0] + b" " for x in lines if not x.startswith(b"#")]
            head, tail = _strip_eof(encoder(_Families(self.before))), encoder(_Families(self.after))
            f = _Format(encoder, head, tail, meta, samples)
            if len(self.formats) < _MAX_FORMATS:
                self.formats[ctype] = f
        return f


def _strip_eof(text: bytes) -> bytes:
    # OpenMetrics ends the exposition with "# EOF": a part before the end must not carry it
    return text[: -len(_OM_EOF)] if text.endswith(_OM_EOF) else text


class CachedExposition:
    """The server's /metrics: rendered when the spool or a collector changed, else served from memory."""

    def __init__(self, exporter: ExporterCollector, clock: Callable[[], float] = time.time) -> None:
        self.exporter = exporter
        self._clock = clock
        self._lock = threading.Lock()
        self._render: _Render | None = None
        self._key: tuple[object, ...] | None = None
        self._snapshots: list[object] = []  # held, so no new snapshot can take an old one's id()
        self.renders = 0  # how many times the families were rendered (tests and benchmarks read it)

    def _sources(self, snapshots: list[object]) -> tuple[object, ...] | None:
        """What the families depend on besides the clock; None when only a read will do."""
        state = spool.spool_state(self.exporter.spool_dir)
        if state is None:
            return None
        health = tuple((c.health.up, c.health.errors, c.health.duration) for c in self.exporter.collectors)
        return state, tuple(map(id, snapshots)), health

    def current(self) -> _Render:
        """The render that matches the sources now, rendering it if none does (once for concurrent callers)."""
        with self._lock:
            # the snapshots first, then the spool, then the read: whatever changes in between only
            # makes the next scrape render again
            snapshots = [c.snapshot for c in self.exporter.collectors]
            key = self._sources(snapshots)
            if key is not None and key == self._key and self._render is not None:
                self.exporter.mark_served(self._render.ctx)
                return self._render
            ctx = self.exporter.context()
            fams = list(self.exporter.families(ctx))
            cut = next(i for i, f in enumerate(fams) if f.name == ranks.AGE_FAMILY)
            self._render = _Render(ctx, fams[:cut], fams[cut + 1 :])
            self._key = key if self.exporter.last_read_clean else None
            self._snapshots = snapshots  # the ids in the key stay theirs while they are held
            self.renders += 1
            return self._render

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        encoder, ctype = choose_encoder(accept)
        render = self.current()
        with self._lock:
            fmt = render.format(ctype, encoder)
            gz = fmt.gzip_parts() if gzip_ok else None
        now = self._clock()
        lines = zip(fmt.age_lines, render.ctx.samples, strict=True)
        age = fmt.age_meta + b"".join(p + floatToGoString(spool.sample_age(s, now)).encode() + b"\n" for p, s in lines)
        if gz is None:
            return Reply(fmt.head + age + fmt.tail, ctype)
        crc = zlib.crc32(fmt.tail, zlib.crc32(age, fmt.head_crc))
        size = len(fmt.head) + len(age) + len(fmt.tail)
        body = b"".join((_GZIP_HEADER, gz[0], _stored_blocks(age), gz[1], struct.pack("<II", crc, size & 0xFFFFFFFF)))
        return Reply(body, ctype, "gzip")
