"""Exact behaviour of the scrape server's pieces, table-driven: the parsers, the date, the answers.

Written against mutation survivors (docs/mutation.md): each case pins one value that a plausible
slip (an off-by-one, a swapped partition, a wrong status line or header) would change.
"""

from __future__ import annotations

import socket

import pytest

from vramwatch.server import http as http_module
from vramwatch.server.http import (
    MAX_HEADER_LINES,
    _head_end,
    _nonblocking,
    _parse_fields,
    _parse_head,
    _Refusal,
    _tokens,
    accepts_gzip,
    imf_fixdate,
)

# --- accepts_gzip ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("gzip", True),
        ("x-gzip", True),  # the old alias (RFC 9110, 8.4.1.3)
        ("X-GZip", True),
        ("x-gzip;q=0", False),
        ("gzip;level=1;q=0", False),  # q after another parameter still weighs
        ("gzip;level=1;q=0.5", True),
        ("gzip; level=1 ; Q=0", False),
        ("gzip;q==1", False),  # a malformed weight ("=1") is no consent
        ("gzip;q=abc", False),
        ("gzip;q=0.001", True),
        ("gzip;q=0.000", False),
        ("*;q=0, deflate", False),
        ("*", True),
        ("deflate, *;level=2;q=0", False),
        ("", False),
        ("identity", False),
        ("gzip;q=0, *", False),  # an explicit gzip entry wins over *
        ("*;q=0, gzip", True),
    ],
)
def test_accepts_gzip_table(header, ok):
    assert accepts_gzip(header) is ok


# --- _nonblocking --------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [None, 1.0, 5.0])
def test_nonblocking_makes_any_blocking_socket_nonblocking(timeout):
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(timeout)
        _nonblocking(a)
        assert a.gettimeout() == 0.0
        _nonblocking(a)  # already: stays so
        assert a.gettimeout() == 0.0


# --- _head_end -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("buf", "start", "end"),
    [
        (b"GET / HTTP/1.0\r\n\r\n", 0, 18),
        (b"GET / HTTP/1.0\r\n\r\nGET /", 0, 18),  # a pipelined next request stays after the end
        (b"GET / HTTP/1.0\n\n", 0, 16),  # bare LF lines
        (b"GET / HTTP/1.0\n\nrest", 0, 16),
        (b"\n\r\n", 0, 3),  # an empty head ends at once
        (b"\n\n", 0, 2),
        (b"GET / HTTP/1.0\r\n\r\n", 17, 18),  # the last chunk was one byte: the terminator spans chunks
        (b"GET / HTTP/1.0\r\n\r\n", 15, 18),
        (b"GET / HTTP/1.0\n\n", 15, 16),
        (b"GET / HTTP/1.0\r\n", 0, -1),
        (b"GET", 0, -1),
        (b"", 0, -1),
        # bytes before start - len(terminator) were searched already (the caller's last look)
        (b"x\n\r\nyyy\n\r\n", 9, 10),
        (b"x\n\nyyyy\n\n", 9, 9),
    ],
)
def test_head_end_table(buf, start, end):
    assert _head_end(buf, start) == end


# --- _parse_fields ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rest", "fields"),
    [
        (b"Host: x\r\nAccept: y\r\n\r\n", {"host": "x", "accept": "y"}),
        (b"Host: x\nAccept: y\n\n", {"host": "x", "accept": "y"}),
        (b"HOST:   x  \r\n\r\n", {"host": "x"}),
        (b"Host: x:80\r\n\r\n", {"host": "x:80"}),  # the first colon ends the name
        (b"A: XX\r\n\r\n", {"a": "XX"}),  # only the CR is stripped from a line's end
        (b"A: \xe9\r\n\r\n", {"a": "\xe9"}),  # latin-1: every byte is a character
        (b"A: 1\r\n two\r\nB: 2\r\n\r\n", {"a": "1 two", "b": "2"}),  # a fold continues the field
        (b"A: 1\r\n\t two \r\n  three\r\nB: 2\r\n\r\n", {"a": "1 two three", "b": "2"}),
        (b" lead\r\nHost: x\r\n\r\n", {"host": "x"}),  # a fold with no field before it is dropped
        (b"A: 1\r\nA: 2\r\n more\r\nB: 3\r\n\r\n", {"a": "1", "b": "3"}),  # the repeat's fold goes with it
        (b"A: 1\r\n   \r\nB: 2\r\n\r\n", {"a": "1 ", "b": "2"}),  # whitespace only: a fold, no end
        (b"A: 1\r\nnocolon\r\nB: 2\r\n\r\n", {"a": "1"}),  # no field: the head ends
        (b"A: 1\r\nBad Name: x\r\nB: 2\r\n\r\n", {"a": "1"}),  # no field name with a space
        (b"A: 1\r\n\rX: y\r\n\r\n", {"a": "1"}),  # a CR at a line's start is no field name's
        (b"A: 1\r\nX\r\n\r\n", {"a": "1"}),
        (b"A: 1\r\n\r\nB: 2\r\n", {"a": "1"}),  # the blank line ends the head
        (b"", {}),
    ],
)
def test_parse_fields_table(rest, fields):
    got = _parse_fields(rest)
    assert dict(got._fields) == fields
    assert len(got) == len(fields) and sorted(got) == sorted(fields)
    for name, value in fields.items():
        assert got[name.upper()] == value


# --- _parse_head and _tokens ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head", "method", "path", "keep"),
    [
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "GET", "/metrics", True),
        (b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n", "GET", "/metrics", False),
        (b"HEAD /a?b=\xe9 HTTP/1.1\r\n\r\n", "HEAD", "/a?b=\xe9", True),
        (b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", "GET", "/", False),
        (b"GET / HTTP/1.1\r\nconnection: Keep-Alive, Close\r\n\r\n", "GET", "/", False),
        (b"GET / HTTP/1.1\r\nConnection: close,TE\r\n\r\n", "GET", "/", False),
        (b"GET / HTTP/1.1\r\nConnection: keep-alive\r\n\r\n", "GET", "/", True),
        (b"GET / HTTP/1.1\r\nConnection: closed\r\n\r\n", "GET", "/", True),
        (b"GET / HTTP/1.1\n\n", "GET", "/", True),
    ],
)
def test_parse_head_table(head, method, path, keep):
    req = _parse_head(head)
    assert (req.method, req.path, req.keep_alive, req.gzip) == (method, path, keep, None)


@pytest.mark.parametrize(
    "head",
    [
        b"GET / HTTP/1.1X\r\n\r\n",
        b"GET / HTTP/1.2\r\n\r\n",
        b"GET / http/1.1\r\n\r\n",
        b"GET /\r\n\r\n",
        b"GET / x HTTP/1.1\r\n\r\n",
        b"\r\n\r\n",
    ],
)
def test_parse_head_bad_request_lines(head):
    with pytest.raises(_Refusal) as e:
        _parse_head(head)
    assert (e.value.code, e.value.kind, e.value.body, str(e.value)) == (
        400,
        "bad-request",
        "bad request line",
        "bad request line",
    )


@pytest.mark.parametrize(
    ("lines", "refused"), [(MAX_HEADER_LINES - 1, False), (MAX_HEADER_LINES, False), (MAX_HEADER_LINES + 1, True)]
)
def test_parse_head_header_line_limit(lines, refused):
    head = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(lines)) + b"\r\n"
    if not refused:
        assert len(_parse_head(head).headers) == lines
        return
    with pytest.raises(_Refusal) as e:
        _parse_head(head)
    assert (e.value.code, e.value.kind, e.value.body) == (431, "too-many-headers", "more than 64 header lines")


@pytest.mark.parametrize(
    ("value", "tokens"),
    [
        ("close", ["close"]),
        ("Keep-Alive, Close", ["keep-alive", "close"]),
        ("close,keep-alive", ["close", "keep-alive"]),
        ("", [""]),
    ],
)
def test_tokens_table(value, tokens):
    assert _tokens(value) == tokens


# --- imf_fixdate and _Date -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "text"),
    [
        (0.0, "Thu, 01 Jan 1970 00:00:00 GMT"),
        (784111777.0, "Sun, 06 Nov 1994 08:49:37 GMT"),  # RFC 9110's own example
        (951782400.5, "Tue, 29 Feb 2000 00:00:00 GMT"),
        (1735689599.0, "Tue, 31 Dec 2024 23:59:59 GMT"),
        (-86400.0 * 365, "Wed, 01 Jan 1969 00:00:00 GMT"),
    ],
)
def test_imf_fixdate_table(now, text):
    assert imf_fixdate(now) == text


def test_date_is_formatted_once_a_second(monkeypatch):
    now = [784111777.25]
    monkeypatch.setattr(http_module.time, "time", lambda: now[0])
    date = http_module._Date()
    assert date() == "Sun, 06 Nov 1994 08:49:37 GMT"
    now[0] = 784111777.75
    assert date() == "Sun, 06 Nov 1994 08:49:37 GMT" and date._last == (784111777, date())
    now[0] = 784111778.0
    assert date() == "Sun, 06 Nov 1994 08:49:38 GMT"
