"""Exact behaviour of the scrape server's pieces, table-driven: the parsers, the date, the answers.

Written against mutation survivors (docs/mutation.md): each case pins one value that a plausible
slip (an off-by-one, a swapped partition, a wrong status line or header) would change.
"""

from __future__ import annotations

import base64
import errno
import logging
import queue
import re
import socket
import struct
import threading
import time
import types

import pytest

from harness import read_answer
from vramwatch.server import http as http_module
from vramwatch.server.admission import Admission, Decision
from vramwatch.server.auth import BasicAuth
from vramwatch.server.exposition_cache import Reply
from vramwatch.server.http import (
    MAX_HEADER_LINES,
    ExporterHTTPServer,
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
    assert date() == b"Sun, 06 Nov 1994 08:49:37 GMT"
    now[0] = 784111777.75
    assert date() == b"Sun, 06 Nov 1994 08:49:37 GMT" and date._last == (784111777, date())
    now[0] = 784111778.0
    assert date() == b"Sun, 06 Nov 1994 08:49:38 GMT"


# --- the server's exact answers --------------------------------------------------------------------

DATE = "Sun, 06 Nov 1994 08:49:37 GMT"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FakeExposition:
    """What answers /metrics: records each call; ``fail`` makes a render raise."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        self.calls.append(("reply", accept, gzip_ok))
        self.gate.wait(10)
        if self.fail:
            raise RuntimeError("collector exploded")
        return Reply(b"m 1\n", METRICS_TYPE, "gzip" if gzip_ok else None)


def _run(srv: ExporterHTTPServer) -> threading.Thread:
    srv._date = lambda: DATE.encode()  # a fixed Date header: answers compare byte for byte
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    return t


def _stop(srv: ExporterHTTPServer, t: threading.Thread) -> None:
    srv.shutdown()
    srv.server_close()
    t.join(5)


@pytest.fixture
def make_server():
    running: list[tuple[ExporterHTTPServer, threading.Thread]] = []

    def make(exposition=None, **kw) -> ExporterHTTPServer:
        kw.setdefault("timeout", 5.0)
        srv = ExporterHTTPServer(("127.0.0.1", 0), exposition or FakeExposition(), **kw)
        running.append((srv, _run(srv)))
        return srv

    yield make
    for srv, t in running:
        if hasattr(srv.exposition, "gate"):
            srv.exposition.gate.set()
        _stop(srv, t)


def connect(srv: ExporterHTTPServer, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=timeout)


def ask(srv: ExporterHTTPServer, request: bytes) -> tuple[bytes, str]:
    """The whole answer (up to the server's close, or one keep-alive answer) and the client's peer name."""
    with connect(srv) as s:
        host, port = s.getsockname()[:2]
        peer = f"{host}:{port}"
        s.sendall(request)
        return read_answer(s, request.startswith(b"HEAD ")), peer


def answer(status: str, ctype: str, body: bytes, *extra: str, head: bool = False, length: int | None = None) -> bytes:
    lines = [status, "Server: vramwatch", f"Date: {DATE}", f"Content-Type: {ctype}"]
    lines += [f"Content-Length: {len(body) if length is None else length}", *extra]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + (b"" if head else body)


NOT_FOUND = b"not found; see /metrics\n"
LANDING_TYPE = "text/html; charset=utf-8"

ANSWERS = [
    (b"GET /metrics HTTP/1.0\r\n\r\n", answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n"), ("", False)),
    (
        b"GET /metrics?x=1 HTTP/1.0\r\nAccept: a/b\r\n\r\n",
        answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n"),
        ("a/b", False),
    ),
    (
        b"GET /metrics HTTP/1.1\r\nAccept-Encoding: gzip\r\nConnection: close\r\n\r\n",
        answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n", "Content-Encoding: gzip"),
        ("", True),
    ),
    (
        b"GET /metrics HTTP/1.1\r\nAccept: x/y\r\nAccept-Encoding: gzip;q=0\r\n\r\n",
        answer("HTTP/1.1 200 OK", METRICS_TYPE, b"m 1\n"),
        ("x/y", False),
    ),
    (b"HEAD /metrics HTTP/1.0\r\n\r\n", answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n", head=True), ("", False)),
    (b"GET / HTTP/1.0\r\n\r\n", answer("HTTP/1.0 200 OK", LANDING_TYPE, http_module.LANDING), None),
    (b"GET /?q HTTP/1.1\r\n\r\n", answer("HTTP/1.1 200 OK", LANDING_TYPE, http_module.LANDING), None),
    (b"HEAD / HTTP/1.0\r\n\r\n", answer("HTTP/1.0 200 OK", LANDING_TYPE, http_module.LANDING, head=True), None),
    (b"GET /-/healthy HTTP/1.0\r\n\r\n", answer("HTTP/1.0 200 OK", "text/plain", b"OK\n"), None),
    (b"GET /-/ready?x HTTP/1.0\r\n\r\n", answer("HTTP/1.0 200 OK", "text/plain", b"OK\n"), None),
    (b"GET /-/healthy?a?b HTTP/1.0\r\n\r\n", answer("HTTP/1.0 200 OK", "text/plain", b"OK\n"), None),
    (b"HEAD /-/ready HTTP/1.1\r\n\r\n", answer("HTTP/1.1 200 OK", "text/plain", b"OK\n", head=True), None),
    (b"GET /nothing HTTP/1.0\r\n\r\n", answer("HTTP/1.0 404 Not Found", "text/plain", NOT_FOUND), None),
    (b"GET /metricsx HTTP/1.0\r\n\r\n", answer("HTTP/1.0 404 Not Found", "text/plain", NOT_FOUND), None),
    (b"HEAD /x HTTP/1.1\r\n\r\n", answer("HTTP/1.1 404 Not Found", "text/plain", NOT_FOUND, head=True), None),
]


@pytest.mark.parametrize(("request_", "expected", "call"), ANSWERS)
def test_answers_byte_for_byte(make_server, request_, expected, call):
    srv = make_server()
    got, _ = ask(srv, request_)
    assert got == expected
    assert srv.exposition.calls == ([] if call is None else [("reply", *call)])


def test_extra_headers_follow_every_answer_and_refusal(make_server):
    srv = make_server(headers={"X-Frame-Options": "deny", "X-A": "b"})
    got, _ = ask(srv, b"GET /-/healthy HTTP/1.0\r\n\r\n")
    assert got == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n", "X-Frame-Options: deny", "X-A: b")
    got, _ = ask(srv, b"GET /metrics HTTP/1.0\r\nAccept-Encoding: gzip\r\n\r\n")
    assert got == answer(
        "HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n", "Content-Encoding: gzip", "X-Frame-Options: deny", "X-A: b"
    )
    got, _ = ask(srv, b"TRACE / HTTP/1.0\r\n\r\n")
    assert got.endswith(b"Allow: GET, HEAD\r\nX-Frame-Options: deny\r\nX-A: b\r\n\r\nmethod not allowed\n")


def test_a_failing_render_answers_500_and_logs_why(make_server, caplog):
    srv = make_server()
    srv.exposition.fail = True
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        got, _ = ask(srv, b"GET /metrics HTTP/1.1\r\n\r\n")
        head, _ = ask(srv, b"HEAD /metrics HTTP/1.0\r\n\r\n")
    body = b"collection failed; see the server log\n"
    assert got == answer("HTTP/1.1 500 Internal Server Error", "text/plain", body)
    assert head == answer("HTTP/1.0 500 Internal Server Error", "text/plain", body, head=True)
    failed = [r for r in caplog.records if r.getMessage() == "vramwatch: rendering /metrics failed"]
    assert len(failed) == 2 and failed[0].exc_info[0] is RuntimeError


def test_a_kept_alive_connection_answers_again_and_closes_on_request(make_server):
    srv = make_server()
    with connect(srv) as s:
        for _ in range(2):
            s.sendall(b"GET /-/healthy HTTP/1.1\r\n\r\n")
            assert read_answer(s) == answer("HTTP/1.1 200 OK", "text/plain", b"OK\n")
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")  # a worker's answer keeps it too
        assert read_answer(s) == answer("HTTP/1.1 200 OK", METRICS_TYPE, b"m 1\n")
        s.sendall(b"GET /-/healthy HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert read_answer(s) == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")
        assert s.recv(10) == b""  # and the server closed it


def test_kept_alive_scrapes_skip_the_expiry_sweep_until_a_deadline_is_due(make_server):
    srv = make_server()
    sweeps: list[float] = []
    expire = srv._expire
    srv._expire = lambda now: (sweeps.append(now), expire(now))[1]  # type: ignore[method-assign]
    with connect(srv) as s:
        for _ in range(20):  # the kept connection's idle deadline is KEEPALIVE_IDLE away: nothing is due
            s.sendall(b"GET /-/healthy HTTP/1.1\r\n\r\n")
            assert read_answer(s) == answer("HTTP/1.1 200 OK", "text/plain", b"OK\n")
    assert len(sweeps) <= 2  # the first turn's (nothing known yet) and at most one the client's close caused


class NowExposition(FakeExposition):
    """An exposition with the cache's fast path: ``now`` is what reply_now answers (or raises)."""

    def __init__(self, now) -> None:
        super().__init__()
        self.now = now

    def reply_now(self, accept: str, gzip_ok: bool) -> Reply | None:
        self.calls.append(("reply_now", accept, gzip_ok))
        if isinstance(self.now, Exception):
            raise self.now
        return self.now


def test_the_loop_answers_from_reply_now_without_a_worker(make_server):
    srv = make_server(NowExposition(Reply(b"fast\n", "text/x", "gzip")))
    started: list[bool] = []
    real = srv._start
    srv._start = lambda conn, scrape: started.append(scrape) or real(conn, scrape)
    got, _ = ask(srv, b"HEAD /metrics?a HTTP/1.1\r\nAccept: q/r\r\nAccept-Encoding: x-gzip\r\n\r\n")
    assert got == answer("HTTP/1.1 200 OK", "text/x", b"fast\n", "Content-Encoding: gzip", head=True)
    got, _ = ask(srv, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert got == answer("HTTP/1.0 200 OK", "text/x", b"fast\n", "Content-Encoding: gzip")
    assert srv.exposition.calls == [("reply_now", "q/r", True), ("reply_now", "", False)]
    assert srv.served_on_loop == 2 and started == []
    ask(srv, b"GET / HTTP/1.0\r\n\r\n")  # no render needed: the loop's too, without asking reply_now
    assert srv.served_on_loop == 3 and len(srv.exposition.calls) == 2


@pytest.mark.parametrize("now", [None, RuntimeError("cache broke")])
def test_no_fast_answer_goes_to_a_worker(make_server, now, caplog):
    srv = make_server(NowExposition(now))
    started: list[bool] = []
    real = srv._start
    srv._start = lambda conn, scrape: started.append(scrape) or real(conn, scrape)
    req = b"GET /metrics HTTP/1.0\r\nAccept: q/r\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n"
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        got, _ = ask(srv, req)
    assert got == answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n")
    assert srv.exposition.calls == [("reply_now", "q/r", False), ("reply", "q/r", False)]
    assert srv.served_on_loop == 0 and started == [True]
    if now is not None:
        (rec,) = [r for r in caplog.records if r.getMessage() == "vramwatch: serving /metrics from the cache failed"]
        assert rec.exc_info[0] is RuntimeError  # why, for whoever turns debug on
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --- refusals: status line, headers, body, log line -------------------------------------------------


def refusal(code: int, reason: str, body: str, *extra: str, head: bool = False) -> bytes:
    lines = [f"HTTP/1.0 {code} {reason}", "Server: vramwatch", "Content-Type: text/plain; charset=utf-8"]
    lines += [f"Content-Length: {len(body) + 1}", "Connection: close", *extra]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + (b"" if head else body.encode() + b"\n")


REFUSALS = [
    (
        b"GET /metrics\r\n\r\n",
        refusal(400, "Bad Request", "bad request line"),
        "bad-request",
        "answered 400 (bad request line: b'GET /metrics')",
    ),
    (
        b"TRACE /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        refusal(405, "Method Not Allowed", "method not allowed", "Allow: GET, HEAD"),
        "method",
        "answered 405 (method not allowed: b'TRACE /metrics HTTP/1.1')",
    ),
    (
        b"POST / HTTP/1.0\r\n\r\n",
        refusal(405, "Method Not Allowed", "method not allowed", "Allow: GET, HEAD"),
        "method",
        "answered 405 (method not allowed: b'POST / HTTP/1.0')",
    ),
    (
        b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADER_LINES + 1)) + b"\r\n",
        refusal(431, "Request Header Fields Too Large", "more than 64 header lines"),
        "too-many-headers",
        "answered 431 (more than 64 header lines: b'GET / HTTP/1.1')",
    ),
    (
        b"GET / HTTP/1.1\r\nX-Big: " + b"a" * http_module.MAX_REQUEST_HEAD,
        refusal(431, "Request Header Fields Too Large", "request head over 16384 bytes"),
        "too-large",
        "answered 431 (request head over 16384 bytes)",
    ),
    (
        b"GET /" + b"a" * 100 + b" HTTP/1.1 x\r\n\r\n",
        refusal(400, "Bad Request", "bad request line"),
        "bad-request",
        "answered 400 (bad request line: b'GET /" + "a" * 75 + "')",  # the line's first 80 bytes
    ),
]


@pytest.mark.parametrize(("request_", "expected", "kind", "logged"), REFUSALS)
def test_refusals_byte_for_byte_and_their_log_line(make_server, caplog, request_, expected, kind, logged):
    srv = make_server()
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        got, peer = ask(srv, request_)
    assert got == expected
    assert caplog.messages == [f"vramwatch http: {peer}: {logged}"]
    assert srv.refused == {kind: 1} and srv.rejected == 0 and srv.exposition.calls == []


def _until(cond, limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


PASSWORD = "s3cret"


@pytest.fixture(scope="module")
def password_hash() -> str:
    bcrypt = pytest.importorskip("bcrypt")
    return bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


def _basic(password: str) -> bytes:
    return b"Authorization: Basic " + base64.b64encode(f"prometheus:{password}".encode()) + b"\r\n"


UNAUTHORIZED = 'WWW-Authenticate: Basic realm="vramwatch"'


@pytest.mark.parametrize(
    ("request_", "expected", "kind", "logged"),
    [
        (
            b"GET /metrics HTTP/1.1\r\n\r\n",
            refusal(401, "Unauthorized", "unauthorized", UNAUTHORIZED),
            "no-credentials",
            "answered 401 (unauthorized: b'GET /metrics HTTP/1.1')",
        ),
        (
            b"HEAD / HTTP/1.0\r\n\r\n",
            refusal(401, "Unauthorized", "unauthorized", UNAUTHORIZED, head=True),
            "no-credentials",
            "answered 401 (unauthorized: b'HEAD / HTTP/1.0')",
        ),
        (
            b"GET / HTTP/1.1\r\n" + _basic("wrong") + b"\r\n",
            refusal(401, "Unauthorized", "unauthorized", UNAUTHORIZED),
            "auth-failed",
            "answered 401 (unauthorized: b'GET / HTTP/1.1')",
        ),
        (
            b"HEAD /metrics HTTP/1.1\r\n" + _basic("wrong") + b"\r\n",
            refusal(401, "Unauthorized", "unauthorized", UNAUTHORIZED, head=True),
            "auth-failed",
            "answered 401 (unauthorized: b'HEAD /metrics HTTP/1.1')",
        ),
    ],
)
def test_auth_refusals_byte_for_byte(make_server, password_hash, caplog, request_, expected, kind, logged):
    srv = make_server(authorize=BasicAuth((("prometheus", password_hash),)))
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        got, peer = ask(srv, request_)
    assert got == expected
    assert caplog.messages == [f"vramwatch http: {peer}: {logged}"]
    assert srv.refused == {kind: 1}
    got, _ = ask(srv, b"GET /-/healthy HTTP/1.0\r\n" + _basic(PASSWORD) + b"\r\n")  # the right pair, on a worker
    assert got == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_an_exhausted_failure_budget_answers_429(make_server, password_hash, caplog, method):
    srv = make_server(authorize=BasicAuth((("prometheus", password_hash),)))
    sources: list[str] = []
    srv.failure_budget = types.SimpleNamespace(take=lambda source: sources.append(source) or False)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        got, peer = ask(srv, f"{method} /metrics HTTP/1.0\r\n".encode() + _basic("guess") + b"\r\n")
    body = "too many failed authentications; retry later"
    assert got == refusal(429, "Too Many Requests", body, head=method == "HEAD")  # a HEAD's answer has no body
    assert caplog.messages == [f"vramwatch http: {peer}: answered 429 ({body}: b'{method} /metrics HTTP/1.0')"]
    assert srv.refused == {"auth-throttled": 1} and sources == ["127.0.0.1"]


def test_a_client_sending_during_its_bcrypt_check_is_not_polled(make_server, password_hash):
    """The connection is unwatched while its password is checked: bytes it sends meanwhile (level-triggered
    epoll) must not wake the loop over and over until the check ends."""
    auth = BasicAuth((("prometheus", password_hash),))
    checking = threading.Event()
    verify = auth.verify
    auth.verify = lambda creds: (checking.set(), time.sleep(0.3), verify(creds))[2]  # type: ignore[method-assign]
    srv = make_server(authorize=auth)
    steps: list[object] = []
    step = srv._step
    srv._step = lambda conn: (steps.append(conn), step(conn))[1]  # type: ignore[method-assign]
    with connect(srv) as s:
        s.sendall(b"GET /-/healthy HTTP/1.0\r\n" + _basic(PASSWORD) + b"\r\n")
        assert checking.wait(5)
        s.sendall(b"more bytes while the password is checked")
        got = read_answer(s)
    assert got == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")
    assert len(steps) <= 20  # a handful (reads, the write, the linger), not a wake per poll of the 0.3 s (160,000)


class _FullQueue(queue.Queue):
    """An auth queue with no room for a check: every bcrypt check is refused; shutdown's sentinel still goes in."""

    def put_nowait(self, item: object) -> None:
        if item is not None:
            raise queue.Full
        super().put_nowait(item)


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_full_auth_queue_answers_503(make_server, password_hash, caplog, method):
    srv = make_server(authorize=BasicAuth((("prometheus", password_hash),)))
    waiting_on, srv._auth_queue = srv._auth_queue, _FullQueue()
    waiting_on.put_nowait(None)  # the auth thread waits on the old queue: end it now, not one poll after the test
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        got, peer = ask(srv, f"{method} /metrics HTTP/1.1\r\n".encode() + _basic("guess") + b"\r\n")
    body = "too many authentications in progress"
    assert got == refusal(503, "Service Unavailable", body, head=method == "HEAD")
    assert caplog.messages == [f"vramwatch http: {peer}: answered 503 ({body}: b'{method} /metrics HTTP/1.1')"]
    assert srv.refused == {"auth-busy": 1}


def test_the_auth_thread_runs_while_serving_and_ends_with_it(make_server, password_hash):
    """shutdown() returns with the auth thread gone, even with a check under way: the next server (a test's,
    or a restarted one) starts with none of the old one's threads."""
    basic = BasicAuth((("prometheus", password_hash),))
    checking = threading.Event()
    verify = basic.verify
    basic.verify = lambda creds: (checking.set(), time.sleep(0.3), verify(creds))[2]  # type: ignore[method-assign]
    srv = make_server(authorize=basic)
    _until(lambda: any(t.name == "vramwatch-http-auth" for t in threading.enumerate()))
    (auth,) = [t for t in threading.enumerate() if t.name == "vramwatch-http-auth"]
    assert auth.daemon
    with connect(srv) as s:
        s.sendall(b"GET /-/healthy HTTP/1.0\r\n" + _basic(PASSWORD) + b"\r\n")
        assert checking.wait(5)
        srv.shutdown()
    assert not auth.is_alive() and srv._sel is None


# --- overload: 503 ---------------------------------------------------------------------------------


def test_busy_workers_answer_503_byte_for_byte(make_server, caplog):
    srv = make_server(max_connections=2)  # one slot for others, one kept for Prometheus' scrapes
    srv.exposition.gate.clear()
    with connect(srv) as blocker:
        blocker.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # not a scrape: takes the others' slot
        _until(lambda: srv.exposition.calls)
        with caplog.at_level(logging.WARNING, logger="vramwatch"):
            got, peer = ask(srv, b"GET /metrics HTTP/1.1\r\n\r\n")
            head, peer2 = ask(srv, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        srv.exposition.gate.set()
        assert read_answer(blocker) == answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n")
    assert got == refusal(503, "Service Unavailable", "too many requests", "Retry-After: 1")
    assert head == refusal(503, "Service Unavailable", "too many requests", "Retry-After: 1", head=True)
    detail = "answered 503 (all 2 workers busy; not a Prometheus scrape)"
    assert caplog.messages == [f"vramwatch http: {peer}: {detail}"]  # the second one a minute: counted
    assert srv.refused == {"busy": 2} and srv.rejected == 2
    got, _ = ask(srv, b"GET /metrics HTTP/1.0\r\n\r\n")  # its slot is free again
    assert got == answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n")


class _NoThread(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


@pytest.mark.parametrize("scrape", [False, True])
def test_a_worker_that_cannot_start_answers_503_and_frees_its_slot(make_server, monkeypatch, caplog, scrape):
    srv = make_server(max_connections=1)
    monkeypatch.setattr(http_module, "threading", types.SimpleNamespace(Thread=_NoThread))
    req = b"GET /metrics HTTP/1.1\r\n" + (b"X-Prometheus-Scrape-Timeout-Seconds: 10\r\n" if scrape else b"") + b"\r\n"
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        got, peer = ask(srv, req)
    assert got == refusal(503, "Service Unavailable", "too many requests", "Retry-After: 1")
    assert caplog.messages == [f"vramwatch http: {peer}: answered 503 (all 1 workers busy; no thread could be started)"]
    assert srv.refused == {"busy": 1} and srv.rejected == 1
    assert (srv.admission.in_use, srv.admission.others_in_use) == (0, 0)
    monkeypatch.undo()
    got, _ = ask(srv, req)
    assert got == answer("HTTP/1.1 200 OK", METRICS_TYPE, b"m 1\n")


def test_a_bug_in_answering_costs_the_connection_not_the_slot(make_server, caplog):
    srv = make_server(max_connections=1)
    real = srv._answer

    def broken(req):
        raise KeyError("bug")

    srv._answer = broken
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        got, peer = ask(srv, b"GET /metrics HTTP/1.1\r\n\r\n")
    assert got == b""  # closed with no answer
    (rec,) = caplog.records
    assert rec.getMessage() == f"vramwatch: answering {peer} failed" and rec.exc_info[0] is KeyError
    assert srv.admission.in_use == 0
    srv._answer = real
    got, _ = ask(srv, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert got == answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n")


# --- TLS: the handshake ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory):
    import ssl

    from tlsutil import make_pki

    pki = make_pki(tmp_path_factory.mktemp("pki"))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(str(pki.cert), str(pki.key))
    return server_ctx, ssl.create_default_context(cafile=str(pki.ca))


def _read_to_close(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        out += b"<RST>"
    return out


def test_tls_answers_and_plain_http_to_the_tls_port_gets_400(make_server, tls_contexts, caplog):
    server_ctx, client_ctx = tls_contexts
    srv = make_server(ssl_context=server_ctx)
    with connect(srv) as raw, client_ctx.wrap_socket(raw, server_hostname="localhost") as s:
        s.sendall(b"GET /-/healthy HTTP/1.0\r\n\r\n")
        assert read_answer(s) == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")
    with caplog.at_level(logging.WARNING, logger="vramwatch"), connect(srv) as s:
        host, port = s.getsockname()[:2]
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive asked: still closed after the 400
        got = _read_to_close(s)
    hint = b"Client sent an HTTP request to an HTTPS server.\n"
    assert got == (
        b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 48\r\n"
        b"Connection: close\r\n\r\n" + hint
    )
    assert caplog.messages == [f"vramwatch http: {host}:{port} sent plain HTTP to the TLS port; answered 400"]
    assert srv.refused == {"plain-to-tls": 1}


def test_a_failed_tls_handshake_is_logged_and_closed(make_server, tls_contexts, caplog):
    srv = make_server(ssl_context=tls_contexts[0])
    with caplog.at_level(logging.WARNING, logger="vramwatch"), connect(srv) as s:
        host, port = s.getsockname()[:2]
        s.sendall(b"\x16\x03\x01\x00\x05hello")  # a handshake record that is no ClientHello
        got = _read_to_close(s)
    assert b"HTTP" not in got  # a TLS alert at most, then the close
    (line,) = caplog.messages
    assert re.fullmatch(rf"vramwatch http: {host}:{port} failed the TLS handshake: [A-Z0-9_]+", line), line
    assert srv.refused == {"tls": 1}
    assert not srv._pending and not srv._writing and not srv._closing


class _NoTLS:
    """An ssl_context whose wrap_socket fails (a broken context)."""

    def wrap_socket(self, sock, **kw):
        raise ValueError("boom")


def test_a_socket_tls_cannot_wrap_is_noted_and_closed_and_the_next_still_accepted(make_server, caplog):
    srv = make_server(ssl_context=_NoTLS())
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        with connect(srv) as s, connect(srv) as s2:
            addr = s.getsockname()[:2]
            assert _read_to_close(s) in (b"", b"<RST>")
            assert _read_to_close(s2) in (b"", b"<RST>")
    assert caplog.messages == [f"vramwatch http: cannot start TLS with {addr!r}: boom"]
    assert srv.refused == {"tls": 2} and not srv._pending


# --- accepting --------------------------------------------------------------------------------------


def test_the_oldest_of_too_many_pending_heads_is_evicted(make_server, caplog):
    srv = make_server(max_pending=2)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        with connect(srv) as s1, connect(srv) as s2:
            _until(lambda: len(srv._pending) == 2)
            assert caplog.messages == [] and srv.refused == {}
            host, port = s1.getsockname()[:2]
            with connect(srv) as s3:
                assert _read_to_close(s1) in (b"", b"<RST>")  # the oldest: closed
                _until(lambda: len(srv._pending) == 2)
                for s in (s2, s3):
                    s.sendall(b"GET /-/healthy HTTP/1.0\r\n\r\n")
                    assert read_answer(s) == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")
    assert caplog.messages == [
        f"vramwatch http: 2 connections were still sending their request heads; closed the oldest, "
        f"from {host}:{port} (a flood of slow clients?)"
    ]
    assert srv.refused == {"evicted": 1}


class _FailingAccept:
    """The listening socket, whose next accept() fails as with EMFILE."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self.failures = sock, 1

    def accept(self):
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_failed_accept_is_logged_and_the_connection_taken_next_round(caplog):
    srv = ExporterHTTPServer(("127.0.0.1", 0), FakeExposition(), timeout=5.0)
    srv.socket = _FailingAccept(srv.socket)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        t = _run(srv)
        try:
            got, _ = ask(srv, b"GET /-/healthy HTTP/1.0\r\n\r\n")
        finally:
            _stop(srv, t)
    assert got == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")
    assert caplog.messages == ["vramwatch http: cannot accept a connection: Too many open files"]
    assert srv.refused == {} and "accept" in srv._abuse._last  # logged, not a refusal


def test_a_head_that_does_not_come_in_time_is_closed_by_the_loop_alone(make_server, caplog):
    srv = make_server(timeout=0.3)
    with caplog.at_level(logging.WARNING, logger="vramwatch"), connect(srv) as s:
        host, port = s.getsockname()[:2]
        s.sendall(b"GET / HTTP/1.1\r\n")  # and nothing more: no other event wakes the loop
        t0 = time.monotonic()
        assert _read_to_close(s) in (b"", b"<RST>")
        assert time.monotonic() - t0 < 2.0
    assert caplog.messages == [
        f"vramwatch http: {host}:{port} sent no complete request head within 0.3 s; "
        "closed it (a slow or stalled client)"
    ]


# --- writing, lingering, closing -------------------------------------------------------------------


class BigExposition(FakeExposition):
    BODY = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than the socket buffers hold

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        return Reply(self.BODY, METRICS_TYPE)


def _big_exchange(srv: ExporterHTTPServer, client_ctx=None) -> tuple[bytes, bytes]:
    with connect(srv) as raw:
        s = raw if client_ctx is None else client_ctx.wrap_socket(raw, server_hostname="localhost")
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        time.sleep(0.2)  # the server's buffers fill: it waits to write
        got = read_answer(s)
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # and the connection serves again
        return got, _read_to_close(s)


def test_an_answer_larger_than_the_socket_buffers_is_written_whole_over_tls(make_server, tls_contexts, caplog):
    srv = make_server(BigExposition(), ssl_context=tls_contexts[0], timeout=2.0)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        got, again = _big_exchange(srv, tls_contexts[1])
    assert got == answer("HTTP/1.1 200 OK", METRICS_TYPE, BigExposition.BODY)
    assert again == answer("HTTP/1.0 200 OK", METRICS_TYPE, BigExposition.BODY)
    assert caplog.messages == []


def test_an_answer_larger_than_the_socket_buffers_is_written_whole(make_server, caplog):
    # a plain socket's full send buffer raises BlockingIOError: it waits for room to write (it used to be
    # taken for want-read, so the answer stalled until its deadline and arrived cut short)
    srv = make_server(BigExposition(), timeout=1.0)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        got, again = _big_exchange(srv)
    assert got == answer("HTTP/1.1 200 OK", METRICS_TYPE, BigExposition.BODY)
    assert again == answer("HTTP/1.0 200 OK", METRICS_TYPE, BigExposition.BODY)


def test_a_client_that_resets_mid_answer_is_closed_quietly(make_server, caplog):
    srv = make_server(BigExposition())
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        for _ in range(3):
            s = connect(srv)
            s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            s.recv(1000)  # the answer has begun
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # RST
        _until(lambda: not srv._writing and not srv._closing and not srv._idle)
    assert caplog.messages == []
    got, _ = ask(srv, b"GET /-/healthy HTTP/1.0\r\n\r\n")
    assert got == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")


def test_a_client_still_sending_after_a_refusal_gets_its_answer_and_no_reset(make_server, caplog):
    srv = make_server()
    with caplog.at_level(logging.WARNING, logger="vramwatch"), connect(srv) as s:
        s.sendall(b"POST /upload HTTP/1.1\r\nContent-Length: 60000\r\n\r\n" + b"x" * 30000)
        time.sleep(0.1)  # the server has answered and shut its side
        s.sendall(b"y" * 30000)  # the rest of the body, after the answer
        got = _read_to_close(s)
    assert got == refusal(405, "Method Not Allowed", "method not allowed", "Allow: GET, HEAD")
    assert len(caplog.messages) == 1 and "answered 405" in caplog.messages[0]


def test_shutdown_closes_every_connection_and_the_auth_queue(caplog):
    srv = ExporterHTTPServer(("127.0.0.1", 0), FakeExposition(), timeout=5.0)
    a, b = socket.socketpair()
    srv._auth_queue.put_nowait((types.SimpleNamespace(sock=a), None, None))  # a bcrypt check never taken
    t = _run(srv)
    with caplog.at_level(logging.WARNING, logger="vramwatch"), connect(srv) as s, connect(srv) as s2:
        _until(lambda: len(srv._pending) == 2)
        s2.sendall(b"GET / HTTP/1.1\r\n\r\n")
        read_answer(s2)
        _until(lambda: len(srv._idle) == 1)
        _stop(srv, t)
        assert _read_to_close(s) in (b"", b"<RST>") and _read_to_close(s2) in (b"", b"<RST>")
    assert a.fileno() == -1
    b.close()
    assert srv._sel is None and srv._auth_queue.empty()  # no auth thread: nothing put for it
    assert not srv._pending and not srv._idle and caplog.messages == []


def test_next_timeout_is_the_nearest_deadline_within_the_poll_interval():
    """The select's timeout, and the nearest deadline itself: the loop sweeps for expiries only once it is due."""
    srv = ExporterHTTPServer(("127.0.0.1", 0), FakeExposition())
    try:
        assert srv._next_timeout(0.5) == 0.5 and srv._due == float("inf")  # nothing to sweep, ever
        now = time.monotonic()
        srv._idle[1] = types.SimpleNamespace(deadline=now + 100)
        assert srv._next_timeout(0.5) == 0.5 and srv._due == now + 100  # the sweep waits for the deadline
        srv._pending[1] = types.SimpleNamespace(deadline=now + 0.2)
        assert 0.1 < srv._next_timeout(0.5) <= 0.2 and srv._due == now + 0.2
        srv._writing[1] = types.SimpleNamespace(deadline=now - 1)
        assert srv._next_timeout(0.5) == 0.0 and srv._due == now - 1
        srv._writing.clear()
        srv._closing[1] = types.SimpleNamespace(deadline=now + 0.05)
        assert 0.0 < srv._next_timeout(0.5) <= 0.05
        srv._closing.clear()
        srv._pending.clear()
        srv._idle.clear()
        srv.admission = Admission(1)
        assert srv.admission.offer("a", True, now + 100) is Decision.START
        assert srv.admission.offer("b", True, now + 100) is Decision.QUEUED
        assert 0.04 < srv._next_timeout(0.5) <= 0.05  # a waiting scrape: its deadline is looked at soon
    finally:
        srv.server_close()


def test_abuse_log_says_once_a_minute_and_counts_the_rest(monkeypatch, caplog):
    now = [1000.0]
    monkeypatch.setattr(http_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    note = http_module._AbuseLog()
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        note("a", "first %s", "x")
        now[0] += 59.9
        note("a", "quiet")
        note("a", "quiet")
        note("b", "other %d", 7)  # its own kind, its own minute
        now[0] += 0.1  # a minute after the first line: said again, with the count
        note("a", "again %s", "y")
        now[0] += 60
        note("a", "later")
    assert caplog.messages == [
        "vramwatch http: first x",
        "vramwatch http: other 7",
        "vramwatch http: again y (2 more like it in the last 60 s)",
        "vramwatch http: later",
    ]


def test_scrapes_wait_for_a_slot_in_turn_then_get_503(make_server, caplog):
    srv = make_server(max_connections=1)  # one slot, one scrape may wait for it
    srv.exposition.gate.clear()
    scrape = b"GET /metrics HTTP/1.1\r\nX-Prometheus-Scrape-Timeout-Seconds: %s\r\n\r\n"
    busy = refusal(503, "Service Unavailable", "too many requests", "Retry-After: 1")
    with connect(srv) as blocker, connect(srv) as waiting:
        blocker.sendall(scrape % b"10")
        _until(lambda: srv.exposition.calls)
        with caplog.at_level(logging.WARNING, logger="vramwatch"):
            waiting.sendall(scrape % b"2")  # waits a quarter of its timeout: 0.5 s
            _until(lambda: srv.admission.waiting == 1)
            got, peer = ask(srv, scrape % b"10")  # nobody else may wait: refused at once
            assert got == busy
            srv._abuse = http_module._AbuseLog()  # the next 503 is logged too
            host, port = waiting.getsockname()[:2]
            assert read_answer(waiting) == busy  # its wait ran out
        srv.exposition.gate.set()
        assert read_answer(blocker) == answer("HTTP/1.1 200 OK", METRICS_TYPE, b"m 1\n")
    assert caplog.messages == [
        f"vramwatch http: {peer}: answered 503 (all 1 workers busy; a scrape)",
        f"vramwatch http: {host}:{port}: answered 503 (all 1 workers busy; a scrape that waited its turn)",
    ]
    assert srv.refused == {"busy": 2} and srv.rejected == 2 and len(srv.exposition.calls) == 1


def test_a_hash_bcrypt_rejects_is_a_401_never_a_pass(make_server, caplog):
    srv = make_server(authorize=BasicAuth((("prometheus", "$2b$04$not-a-hash"),)))
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        got, peer = ask(srv, b"GET /metrics HTTP/1.0\r\n" + _basic("anything") + b"\r\n")
    assert got == refusal(401, "Unauthorized", "unauthorized", UNAUTHORIZED)
    assert caplog.messages == [f"vramwatch http: {peer}: answered 401 (unauthorized: b'GET /metrics HTTP/1.0')"]
    assert srv.exposition.calls == []


def test_a_query_with_two_question_marks_still_takes_the_fast_path(make_server):
    srv = make_server(NowExposition(Reply(b"fast\n", "text/x")))
    got, _ = ask(srv, b"GET /metrics?a?b HTTP/1.0\r\n\r\n")
    assert got == answer("HTTP/1.0 200 OK", "text/x", b"fast\n")
    assert srv.exposition.calls == [("reply_now", "", False)] and srv.served_on_loop == 1


def test_lingering_ends_at_the_clients_close_and_after_a_bounded_drain(make_server, monkeypatch):
    monkeypatch.setattr(http_module, "LINGER", 30.0)  # only the client's close or the drain bound ends it
    srv = make_server()
    with_body = b"GET /-/healthy HTTP/1.0\r\nContent-Length: 1000\r\n\r\n"  # a body the server never reads
    with connect(srv) as s:
        s.sendall(with_body)
        assert _read_to_close(s) == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")
        assert len(srv._closing) == 1  # the server still reads what the client might send
        s.sendall(b"z" * 1000)
        time.sleep(0.05)
        assert len(srv._closing) == 1
    _until(lambda: not srv._closing, 5.0)  # the client's close: gone at once, not at the deadline
    with connect(srv) as s:
        s.sendall(with_body)
        assert _read_to_close(s) == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")
        try:
            s.sendall(b"z" * (1 << 20))  # more than it drains at once: it stops reading and closes
        except OSError:
            pass  # reset: the server closed with bytes unread, as it should after its drain
        _until(lambda: not srv._closing, 5.0)  # while this client is still connected


def test_a_request_read_whole_is_closed_at_once_with_a_fin(make_server, monkeypatch):
    """A GET that said no body and left nothing unread: closed with the answer (no linger, no poll
    round), and the client reads the whole answer and then an orderly end, not a reset."""
    monkeypatch.setattr(http_module, "LINGER", 30.0)
    srv = make_server()
    for request in (b"GET /-/healthy HTTP/1.0\r\n\r\n", b"GET /-/healthy HTTP/1.1\r\nConnection: close\r\n\r\n"):
        with connect(srv) as s:
            s.sendall(request)
            got = _read_to_close(s)
            assert not srv._closing and not srv._pending and not srv._writing
        assert got == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")  # a closing answer says HTTP/1.0
    assert not any(srv.refused.values())


@pytest.mark.parametrize(
    "after",
    [
        pytest.param(b"GET /-/healthy HTTP/1.0\r\n\r\n", id="a-pipelined-request"),
        pytest.param(b"z" * 100, id="stray-bytes"),
    ],
)
def test_bytes_past_a_closing_request_make_the_server_linger_so_the_answer_is_not_reset(
    make_server, monkeypatch, after
):
    monkeypatch.setattr(http_module, "LINGER", 30.0)
    srv = make_server()
    with connect(srv) as s:
        s.sendall(b"GET /-/healthy HTTP/1.0\r\n\r\n" + after)  # one segment: both are read together
        assert _read_to_close(s) == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")  # no <RST>
        assert len(srv._closing) == 1
    _until(lambda: not srv._closing, 5.0)


@pytest.mark.parametrize(
    "request_", [b"POST /metrics HTTP/1.0\r\n\r\n", b"GET /metrics HTTP/1.1\r\n\r\n"], ids=["405", "503"]
)
def test_a_refusal_lingers_even_when_its_request_was_read_whole(make_server, monkeypatch, request_):
    """A refused client may well send more (a body, its next request): refusals always linger. The 503
    comes after the request was admitted as read whole, so the refusal itself must undo that."""
    monkeypatch.setattr(http_module, "LINGER", 30.0)
    srv = make_server(max_connections=2)
    srv.exposition.gate.clear()
    with connect(srv) as blocker:
        blocker.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # not a scrape: the others' one slot
        _until(lambda: srv.exposition.calls)
        with connect(srv) as s:
            s.sendall(request_)
            assert _read_to_close(s)[:13] in (b"HTTP/1.0 405 ", b"HTTP/1.0 503 ")
            assert len(srv._closing) == 1
        srv.exposition.gate.set()
        assert read_answer(blocker) == answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n")


def test_bytes_that_come_while_a_worker_renders_make_the_server_linger(make_server, monkeypatch):
    """Bytes the loop never read (it does not watch a connection a worker has) are still seen at the
    close: the server lingers rather than reset the answer away."""
    monkeypatch.setattr(http_module, "LINGER", 30.0)
    srv = make_server()
    srv.exposition.gate.clear()
    with connect(srv) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        _until(lambda: srv.exposition.calls)
        s.sendall(b"z" * 100)
        time.sleep(0.05)
        srv.exposition.gate.set()
        assert _read_to_close(s) == answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n")
        assert len(srv._closing) == 1


def test_tls_connections_always_linger(make_server, tls_contexts, monkeypatch):
    monkeypatch.setattr(http_module, "LINGER", 30.0)
    srv = make_server(ssl_context=tls_contexts[0])
    with connect(srv) as raw:
        s = tls_contexts[1].wrap_socket(raw, server_hostname="localhost")
        s.sendall(b"GET /-/healthy HTTP/1.0\r\n\r\n")
        assert read_answer(s) == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")
        _until(lambda: len(srv._closing) == 1, 5.0)


def test_a_queued_scrape_is_served_when_the_slot_frees_and_counted_as_a_scrape(make_server):
    srv = make_server(max_connections=1)
    srv.exposition.gate.clear()
    scrape = b"GET /metrics HTTP/1.1\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n"
    with connect(srv) as blocker, connect(srv) as waiting:
        blocker.sendall(scrape)
        _until(lambda: srv.exposition.calls)
        waiting.sendall(scrape)
        _until(lambda: srv.admission.waiting == 1)
        srv.exposition.gate.set()
        for s in (blocker, waiting):
            assert read_answer(s) == answer("HTTP/1.1 200 OK", METRICS_TYPE, b"m 1\n")
    _until(lambda: srv.admission.in_use == 0)
    assert (srv.admission.in_use, srv.admission.others_in_use, srv.admission.waiting) == (0, 0, 0)
    assert srv.rejected == 0 and len(srv.exposition.calls) == 2


def test_a_worker_is_a_daemon_thread_named_for_the_server(make_server):
    srv = make_server()
    srv.exposition.gate.clear()
    with connect(srv) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        _until(lambda: srv.exposition.calls)
        workers = [t for t in threading.enumerate() if t.name == "vramwatch-http"]
        srv.exposition.gate.set()
        assert read_answer(s) == answer("HTTP/1.0 200 OK", METRICS_TYPE, b"m 1\n")
    assert len(workers) == 1 and workers[0].daemon


@pytest.mark.parametrize(("extra", "kept"), [(0, True), (1, False)])
def test_a_head_up_to_head_cache_bytes_is_remembered(make_server, extra, kept):
    srv = make_server()
    start = b"GET /-/healthy HTTP/1.0\r\nX-Pad: "
    head = start + b"p" * (http_module.HEAD_CACHE_BYTES + extra - len(start) - 4) + b"\r\n\r\n"
    assert len(head) == http_module.HEAD_CACHE_BYTES + extra
    got, _ = ask(srv, head)
    assert got == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")
    assert (head in srv._heads) is kept


def test_pipelined_requests_are_answered_in_order_on_one_connection(make_server):
    srv = make_server()
    ok = answer("HTTP/1.1 200 OK", "text/plain", b"OK\n")
    with connect(srv) as s:
        s.sendall(b"GET /-/healthy HTTP/1.1\r\n\r\nGET /nothing HTTP/1.1\r\n\r\nGET /-/ready HTTP/1.1\r\n\r\n")
        want = ok + answer("HTTP/1.1 404 Not Found", "text/plain", NOT_FOUND) + ok
        got = b""
        while len(got) < len(want) and (chunk := s.recv(65536)):
            got += chunk
        assert got == want
        s.sendall(b"GET /-/healthy HTTP/1.1\r\nConnection: close\r\n\r\nGET /-/ready HTTP/1.1\r\n\r\n")
        assert _read_to_close(s) == answer("HTTP/1.0 200 OK", "text/plain", b"OK\n")  # and nothing after close
    _until(lambda: not srv._idle and not srv._pending and not srv._closing)
