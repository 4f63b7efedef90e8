"""A kept-alive connection's repeated request is answered in one step (``_kept_answer``): the same bytes
as the general path, the connection kept as the youngest idle one, and every case it does not know how to
take in one step (a new, partial or pipelined head, a render, auth, an answer the socket will not take at
once) left to the general path.

The server runs in this process on loopback with a fixed Date header, so answers compare byte for byte.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest
from test_http_exact import PASSWORD, _basic, connect, make_server, password_hash  # noqa: F401 - fixtures

from harness import read_answer
from vramwatch.server.auth import BasicAuth
from vramwatch.server.exposition_cache import Reply
from vramwatch.server.http import KEEPALIVE_IDLE, ExporterHTTPServer

TEXT = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n"


class Ready:
    """An exposition whose answers are current renders (the loop serves them), unless ``rendering``."""

    def __init__(self, body: bytes = b"m 1\n") -> None:
        self.body = body
        self.rendering = False
        self.renders = 0

    def reply_now(self, accept: str, gzip_ok: bool) -> Reply | None:
        return None if self.rendering else Reply(self.body, TEXT, "gzip" if gzip_ok else None)

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        self.renders += 1
        return Reply(self.body, TEXT, "gzip" if gzip_ok else None)


@pytest.fixture
def counted(make_server):  # noqa: F811 - the fixture imported above
    """A server over ``Ready`` that counts the requests the general path took (``_head_complete``)."""

    def make(exposition: Ready | None = None, **kw) -> tuple[ExporterHTTPServer, list[bytes]]:
        srv = make_server(exposition or Ready(), **kw)
        general: list[bytes] = []
        real = srv._head_complete
        srv._head_complete = lambda conn, head: (general.append(head), real(conn, head))[1]  # type: ignore[method-assign]
        return srv, general

    return make


def _until(cond: Callable[[], bool], what: str) -> None:
    """The loop may still be moving a connection when the client has its answer: wait (bounded) for it."""
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _kept(srv: ExporterHTTPServer, s: socket.socket) -> None:
    _until(lambda: any(c.sock.getpeername() == s.getsockname() for c in list(srv._idle.values())), "never kept")


def _ask(srv: ExporterHTTPServer, s: socket.socket, request: bytes) -> bytes:
    s.sendall(request)
    got = read_answer(s, request.startswith(b"HEAD "))
    if b"HTTP/1.1 " in got[:9]:
        _kept(srv, s)
    return got


@pytest.mark.parametrize(
    "request_",
    [
        SCRAPE,
        SCRAPE.replace(b"GET ", b"HEAD ", 1),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",  # no gzip
        b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
def test_a_repeated_request_on_a_kept_connection_gets_the_general_paths_bytes_in_one_step(counted, request_):
    srv, general = counted()
    with connect(srv) as s:
        first = _ask(srv, s, request_)  # a new connection's first head: the general path
        assert general == [request_] and first.startswith(b"HTTP/1.1 ")
        served = srv.served_on_loop
        for _ in range(3):
            assert _ask(srv, s, request_) == first
        assert general == [request_], "the repeats took the one step"
        assert srv.served_on_loop == served + 3, "each counted as the loop's answer"


def test_connection_close_on_a_kept_connection_is_answered_alike_and_closes(counted):
    srv, general = counted()
    close = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with connect(srv) as s:
        s.sendall(close)
        expected = read_answer(s)  # to the server's close: the general path's answer
    with connect(srv) as s:
        _ask(srv, s, SCRAPE)
        s.sendall(close)  # a head the server has seen, on a kept connection
        assert read_answer(s) == expected and s.recv(1) == b""
    assert general == [close, SCRAPE], "the third took the one step"
    assert not srv._idle, "closed, not kept"


def test_the_connection_answered_becomes_the_youngest_idle_one_with_a_fresh_deadline(counted):
    srv, general = counted(max_pending=2)
    older, younger = connect(srv), connect(srv)
    try:
        _ask(srv, older, SCRAPE)
        _ask(srv, younger, SCRAPE)
        (conn_older, _) = srv._idle.values()
        conn_older.deadline = time.monotonic() + 30.0  # it has waited a minute of its 90 s
        _ask(srv, older, SCRAPE)  # one step; the loop may still be moving it when the client has its answer
        _until(lambda: list(srv._idle.values())[-1] is conn_older, "the youngest now")
        assert conn_older.deadline > time.monotonic() + KEEPALIVE_IDLE - 5, "the idle deadline from now"
        with connect(srv) as third:  # a third kept connection: the longest unused makes room
            _ask(srv, third, SCRAPE)
            assert younger.recv(1) == b"", "the one not used since closed"
            assert _ask(srv, older, SCRAPE).startswith(b"HTTP/1.1 200 OK"), "the one just used still kept"
        assert len(general) == 3
    finally:
        older.close()
        younger.close()


@pytest.mark.parametrize(
    "send",
    [
        pytest.param(lambda s: (s.sendall(SCRAPE[:20]), time.sleep(0.05), s.sendall(SCRAPE[20:])), id="partial-head"),
        pytest.param(lambda s: s.sendall(SCRAPE + SCRAPE), id="two-pipelined"),
        pytest.param(lambda s: s.sendall(SCRAPE.replace(b"Host: x", b"Host: y")), id="a-new-head"),
    ],
)
def test_heads_not_seen_whole_before_take_the_general_path(counted, send):
    srv, general = counted()
    with connect(srv) as s:
        expected = _ask(srv, s, SCRAPE)
        send(s)
        got = read_answer(s)
        assert got.startswith(b"HTTP/1.1 200 OK") and got.endswith(b"\r\n\r\nm 1\n")
        if len(general) == 3:  # pipelined: the second answer too
            assert got == expected and read_answer(s) == expected
    assert len(general) >= 2 and srv.served_on_loop == len(general)


def test_a_scrape_that_needs_a_render_goes_to_a_worker(counted):
    exposition = Ready()
    srv, general = counted(exposition)
    with connect(srv) as s:
        expected = _ask(srv, s, SCRAPE)
        exposition.rendering = True  # a change arrived: the next answer is a worker's render
        assert _ask(srv, s, SCRAPE) == expected
        assert exposition.renders == 1 and len(general) == 2 and srv.served_on_loop == 1


def test_with_auth_each_request_on_a_kept_connection_is_checked(counted, password_hash):  # noqa: F811
    auth = BasicAuth((("prometheus", password_hash),))
    checks: list[str | None] = []
    check = auth.check
    auth.check = lambda header: (checks.append(header), check(header))[1]  # type: ignore[method-assign]
    srv, general = counted(authorize=auth)
    request_ = SCRAPE.replace(b"\r\n\r\n", b"\r\n" + _basic(PASSWORD) + b"\r\n", 1)
    with connect(srv) as s:
        for _ in range(3):
            assert _ask(srv, s, request_).startswith(b"HTTP/1.1 200 OK")
    assert len(checks) == 3 and len(general) == 3, "credentials are checked on every request"


def test_an_answer_the_socket_does_not_take_at_once_is_written_in_the_loops_turns(counted):
    body = b"x" * (8 << 20)  # more than the socket buffers hold
    srv, general = counted(Ready(body))
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        s.connect(("127.0.0.1", srv.server_address[1]))
        request_ = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        first = _ask(srv, s, request_)
        s.sendall(request_)
        time.sleep(0.1)  # the loop's send takes what fits; the rest waits for room
        assert read_answer(s) == first and first.endswith(body)
        _kept(srv, s)
        assert _ask(srv, s, request_) == first, "kept after the long write, and answered in one step again"
    assert len(general) == 1 and srv.served_on_loop == 3
