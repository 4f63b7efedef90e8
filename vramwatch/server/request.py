"""A request head, read as RFC 9112 says a server must: the request line, header fields, body framing.

The server answers GET and HEAD only, and no answer depends on a body, but a body a request declares
is part of the connection's byte stream: it is read and dropped (``Content-Length``), or the
connection ends after the answer (:class:`Refusal`). What would let a body be taken for the next
request is refused: ``Transfer-Encoding`` (the server reads no chunked bodies), a ``Content-Length``
given twice or not a plain number, obsolete line folding, whitespace before a field's colon.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

__all__ = ["MAX_BODY", "MAX_HEADER_LINES", "MAX_REQUEST_HEAD", "Refusal", "Request", "accepts_gzip", "parse_head"]

MAX_REQUEST_HEAD = 16 * 1024  # request line + fields; a Prometheus scrape sends well under 1 KiB
MAX_HEADER_LINES = 64  # Prometheus sends about six
MAX_BODY = 64 * 1024  # a declared body up to this is read and dropped; a larger one is refused (413)

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")  # RFC 9110 5.6.2: a field name
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # in a field value: no CR, LF, NUL (RFC 9110 5.5)
_DIGITS = re.compile(r"[0-9]{1,18}\Z")


class Refusal(Exception):
    """A request the server answers with ``code`` and closes; ``kind`` names it in logs and counts."""

    def __init__(self, code: int, kind: str, body: str) -> None:
        super().__init__(body)
        self.code, self.kind, self.body = code, kind, body


class Headers(Mapping[str, str]):
    """A request's fields by case-insensitive name; a repeated field keeps its first value."""

    def __init__(self, fields: dict[str, str]) -> None:
        self._fields = fields  # lower-case names

    def __getitem__(self, name: str) -> str:
        return self._fields[name.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


@dataclass
class Request:
    method: str
    target: str
    headers: Headers
    keep_alive: bool  # HTTP/1.1 without "Connection: close"
    body_length: int  # the declared body's bytes (0: none)
    route: str = field(init=False)  # the target without its query

    def __post_init__(self) -> None:
        self.route = self.target.split("?", 1)[0]

    @property
    def gzip_ok(self) -> bool:
        return accepts_gzip(self.headers.get("accept-encoding", ""))


def parse_head(lines: list[bytes]) -> Request:
    """The request in ``lines`` (the request line, then the field lines, without CRLFs or the blank line).

    A bare LF is no line end (RFC 9112 lets a recipient choose): a line holding one is malformed."""
    words = lines[0].split(b" ")
    if len(words) != 3 or words[2] not in (b"HTTP/1.0", b"HTTP/1.1") or not words[0] or not words[1]:
        raise Refusal(400, "bad-request", "bad request line")
    if len(lines) - 1 > MAX_HEADER_LINES:
        raise Refusal(431, "too-many-headers", f"more than {MAX_HEADER_LINES} header lines")
    headers: dict[str, str] = {}
    lengths: list[str] = []
    for raw in lines[1:]:
        line = raw.decode("latin-1")
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.match(name) or _CONTROL.search(value):  # also a fold, space before the colon
            raise Refusal(400, "bad-request", "malformed header field")
        key = name.lower()
        value = value.strip(" \t")
        if key == "content-length":
            lengths += value.split(",")
        headers.setdefault(key, value)
    if "transfer-encoding" in headers:
        raise Refusal(400, "framing", "Transfer-Encoding is not accepted; send no body")
    body = 0
    if lengths:
        if len(lengths) > 1 or not _DIGITS.match(lengths[0].strip(" \t")):
            raise Refusal(400, "framing", "Content-Length must be given once, as a number")
        body = int(lengths[0])
        if body > MAX_BODY:
            raise Refusal(413, "framing", f"request body over {MAX_BODY} bytes")
    method, target = words[0].decode("latin-1"), words[1].decode("latin-1")
    keep = words[2] == b"HTTP/1.1" and "close" not in _tokens(headers.get("connection", ""))
    return Request(method, target, Headers(headers), keep, body)


def _tokens(value: str) -> list[str]:
    """A comma-separated field's tokens, lower case (``Connection: Keep-Alive, Close``)."""
    return [t.strip().lower() for t in value.split(",")]


@functools.lru_cache(maxsize=64)  # a node's scrapers send one or two of these, every scrape
def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` field (RFC 9110, 12.5.3) allows gzip: ``gzip`` or ``*`` with q > 0.

    A substring test would answer ``gzip;q=0`` (gzip refused) with gzip; an explicit ``gzip`` entry
    wins over ``*``.
    """
    star: bool | None = None
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0  # a malformed weight is no consent
        if coding in ("gzip", "x-gzip"):
            return q > 0
        if coding == "*":
            star = q > 0
    return bool(star)
