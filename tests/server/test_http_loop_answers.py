"""The event loop answers a scrape itself when its render is current: no worker, same bytes, true ages.

The server and the cache run in this process over a real spool, on loopback; the clock is the test's,
so an age in a body says when the body was made.
"""

from __future__ import annotations

import gzip
import re
import socket
import threading
import time

import pytest
from test_exposition_cache import _live_gauges, same_but_spool_time, sample, two_ranks

from harness import read_answer
from vramwatch import spool
from vramwatch.server import http as http_module
from vramwatch.server.exposition_cache import CachedExposition, Reply
from vramwatch.server.http import HEAD_CACHE, HEAD_CACHE_BYTES, KEEPALIVE_IDLE, ExporterHTTPServer

PROMETHEUS = (
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: Prometheus/2.42.0\r\n"
    b"Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n"
    b"Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n"
)
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


@pytest.fixture
def served(tmp_path, monkeypatch):
    """Two live ranks, the cache with its refresher (stepped by hand), and the server over it."""
    exp, whole, pubs, _, clock = two_ranks(str(tmp_path), monkeypatch)
    cached = CachedExposition(exp, clock=clock)
    cached.start(min_gap=0.0, look=3600.0)  # alive, but renders only when a test calls refresh()
    srv = ExporterHTTPServer(("127.0.0.1", 0), cached, max_connections=2, timeout=5.0)
    started: list[int] = []
    real_start = srv._start
    monkeypatch.setattr(srv, "_start", lambda conn, scrape: started.append(1) or real_start(conn, scrape))
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv, cached, whole, clock, started, pubs, tmp_path
    srv.shutdown()
    srv.server_close()
    cached.stop()
    for p in pubs:
        p.close()


def exchange(srv: ExporterHTTPServer, request: bytes) -> tuple[bytes, bytes]:
    with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5) as s:
        s.sendall(request)
        raw = read_answer(s, request.startswith(b"HEAD "))
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, body


def header(head: bytes, name: bytes) -> bytes | None:
    m = re.search(rb"\r\n" + name + rb": ([^\r]*)", head)
    return m.group(1) if m else None


def test_a_current_render_is_served_by_the_loop_with_ages_at_scrape_time(served):
    srv, cached, whole, clock, started, _, _ = served
    head, _ = exchange(srv, PROMETHEUS)  # the first scrape renders: a worker's job
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and started == [1] and srv.served_on_loop == 0
    for step in (7.25, 3.0):
        clock.now += step  # the render gets older; only the ages move
        head, body = exchange(srv, PROMETHEUS)
        assert started == [1], "the loop answered: no worker was started"
        assert header(head, b"Content-Encoding") == b"gzip" and int(header(head, b"Content-Length")) == len(body)
        assert header(head, b"Content-Type") == whole.reply(OPENMETRICS, False).content_type.encode()
        assert header(head, b"Server") == b"vramwatch" and header(head, b"Date").endswith(b" GMT")
        text = gzip.decompress(body)
        assert same_but_spool_time(text, whole.reply(OPENMETRICS, False).body)  # as a whole render now
    assert re.search(rb'vramwatch_sample_age_seconds\{job_id="",local_rank="1",rank="1"\} 10.75\n', text)
    assert srv.served_on_loop == 2 and cached.renders == 1


def test_head_and_other_paths_are_answered_by_the_loop(served):
    srv, _, _, _, started, _, _ = served
    exchange(srv, PROMETHEUS)
    head, body = exchange(srv, PROMETHEUS.replace(b"GET ", b"HEAD ", 1))
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and body == b"" and int(header(head, b"Content-Length")) > 0
    assert exchange(srv, b"GET /-/healthy HTTP/1.0\r\n\r\n")[1] == b"OK\n"
    head, _ = exchange(srv, b"GET /nothing HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 404 Not Found\r\n")
    assert started == [1]


def test_a_format_not_built_yet_goes_to_a_worker(served):
    srv, _, _, _, started, _, _ = served
    exchange(srv, PROMETHEUS)
    _, body = exchange(srv, b"GET /metrics HTTP/1.0\r\n\r\n")  # text 0.0.4, no gzip: not rendered yet
    assert started == [1, 1] and b"# TYPE vramwatch_sample_age_seconds gauge" in body
    exchange(srv, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert started == [1, 1]  # built now: the loop serves it from then on


def test_a_rank_that_dies_or_appears_is_shown_by_the_scrape_after_the_refreshers_next_look(served):
    srv, cached, _, clock, started, pubs, tmp_path = served
    exchange(srv, PROMETHEUS)
    pubs[1].close()  # rank 1 dies: its lock is freed, no refresh has looked yet
    text = gzip.decompress(exchange(srv, PROMETHEUS)[1])
    assert _live_gauges(text, 1), "the loop's answer touches no file: it is the last render's"
    assert cached.refresh()  # the refresher's look
    text = gzip.decompress(exchange(srv, PROMETHEUS)[1])
    assert b'rank="1"' in text and not _live_gauges(text, 1), "shown dead: its final sample only"
    late = spool.RankPublisher(str(tmp_path), 6)
    try:
        late.publish(sample(6, clock.now))
        cached.render_cost = 0.0  # (the share of a core a render may take is not this test's)
        assert cached.refresh()
        text = gzip.decompress(exchange(srv, PROMETHEUS)[1])
        assert _live_gauges(text, 6), "a new rank"
    finally:
        late.close()
    assert started == [1], "all but the first answered by the loop"


def test_a_head_sent_again_byte_for_byte_reuses_its_parse_and_answers_alike(served, monkeypatch):
    srv, cached, _, clock, started, pubs, _ = served
    parsed: list[bytes] = []
    real = http_module._parse_head
    monkeypatch.setattr(http_module, "_parse_head", lambda head: parsed.append(head) or real(head))
    exchange(srv, PROMETHEUS)
    clock.now += 2.5
    head, body = exchange(srv, PROMETHEUS)
    assert parsed == [PROMETHEUS] and started == [1], "parsed once, and the loop answered the second"
    assert header(head, b"Content-Encoding") == b"gzip"  # its encoder and gzip choice reused too
    text = gzip.decompress(body)
    assert re.search(rb'vramwatch_sample_age_seconds\{job_id="",local_rank="1",rank="1"\} 3.0\n', text), "aged now"
    pubs[1].close()  # the parse is reused, what it is answered with is not: a death shows after a look
    assert cached.refresh()
    assert not _live_gauges(gzip.decompress(exchange(srv, PROMETHEUS)[1]), 1) and len(parsed) == 1
    head, body = exchange(srv, PROMETHEUS.replace(b"GET ", b"HEAD ", 1))  # other bytes: parsed, its own answer
    assert len(parsed) == 2 and body == b"" and head.startswith(b"HTTP/1.1 200 OK\r\n")
    for i in range(HEAD_CACHE + 8):  # a client sending new heads each time holds a bounded table
        exchange(srv, PROMETHEUS.replace(b"Host: x", b"Host: x%d" % i))
    assert len(srv._heads) == HEAD_CACHE and PROMETHEUS not in srv._heads, "the oldest made room"
    big = PROMETHEUS.replace(b"Host: x", b"Host: " + b"x" * HEAD_CACHE_BYTES)
    assert exchange(srv, big)[0].startswith(b"HTTP/1.1 200 OK") and big not in srv._heads


class _Huge:
    """An exposition whose every answer is ready and bigger than the socket buffers hold."""

    body = b"x" * (16 << 20)

    def reply_now(self, accept: str, gzip_ok: bool) -> Reply:
        return Reply(self.body, "text/plain")

    def reply(self, accept: str, gzip_ok: bool) -> Reply:
        return self.reply_now(accept, gzip_ok)


def test_clients_that_do_not_read_their_answers_hold_a_bounded_number_of_them():
    srv = ExporterHTTPServer(("127.0.0.1", 0), _Huge(), timeout=5.0, max_pending=4)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    held = []
    try:
        for _ in range(7):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", srv.server_address[1]))
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # and never reads
            held.append(s)
        deadline = time.monotonic() + 5
        # the last answer may still be on its way into _writing when the third refusal is counted
        while (srv.refused["slow-reader"] < 3 or len(srv._writing) < 4) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.refused["slow-reader"] == 3 and len(srv._writing) == 4  # the oldest three were closed
        with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5) as s:
            s.sendall(b"GET /-/healthy HTTP/1.0\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.0 200 OK")  # the loop still answers others
    finally:
        for s in held:
            s.close()
        srv.shutdown()
        srv.server_close()


def _until(cond, what: str, seconds: float = 5.0) -> None:
    """The loop moves a connection after the client has its answer: wait (bounded) for it to."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_prometheus_keeps_its_connection_and_each_scrape_on_it_is_answered_by_the_loop(served):
    srv, _, _, clock, started, _, _ = served
    exchange(srv, PROMETHEUS)  # the first render, on a worker
    with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5) as s:
        for i in range(3):  # one connection, three scrapes: no new TCP connection per scrape
            clock.now += 1.0
            s.sendall(PROMETHEUS)
            head, _, body = read_answer(s).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and header(head, b"Connection") is None
            assert re.search(rb'rank="1"\} %.1f\n' % (i + 1.5), gzip.decompress(body)), "aged at each scrape"
        _until(lambda: len(srv._idle) == 1, "kept for the next scrape")
        assert started == [1]
    _until(lambda: not srv._idle, "our close: the loop closes its end too")


def test_a_pipelined_second_request_is_answered_after_the_first(served):
    srv, _, _, _, started, _, _ = served
    exchange(srv, PROMETHEUS)
    with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5) as s:
        s.sendall(PROMETHEUS + PROMETHEUS.replace(b"GET /metrics", b"GET /-/healthy", 1))
        raw = b""
        while not raw.endswith(b"\r\n\r\nOK\n"):  # both answers, in one read or more
            chunk = s.recv(65536)
            assert chunk, f"closed after {raw[:200]!r}"
            raw += chunk
        head, _, rest = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and header(head, b"Content-Encoding") == b"gzip"
        body, second = rest[: int(header(head, b"Content-Length"))], rest[int(header(head, b"Content-Length")) :]
        assert gzip.decompress(body).endswith(b"# EOF\n"), "the first answer whole"
        assert second.startswith(b"HTTP/1.1 200 OK\r\n") and second.endswith(b"\r\n\r\nOK\n")


@pytest.mark.parametrize(
    "request_line",
    [b"GET /metrics HTTP/1.0\r\n", b"GET /metrics HTTP/1.1\r\nConnection: keep-alive, Close\r\n"],
)
def test_http_1_0_and_connection_close_are_answered_in_http_1_0_and_closed(served, request_line):
    srv, _, _, _, _, _, _ = served
    with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5) as s:
        s.sendall(request_line + b"Host: x\r\n\r\n")
        raw = read_answer(s)  # up to the server's close: it never waits for a second request
    assert raw.startswith(b"HTTP/1.0 200 OK\r\n") and not srv._idle


def test_an_idle_kept_connection_is_closed_quietly_at_its_deadline_and_the_oldest_makes_room(served, caplog):
    srv, _, _, _, _, _, _ = served
    srv.max_pending = 2
    socks: list[socket.socket] = []
    try:
        for _ in range(3):  # one after the other: each answered and kept before the next comes
            socks.append(s := socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5))
            s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_answer(s).endswith(b"OK\n")
            _until(lambda s=s: any(c.sock.getpeername() == s.getsockname() for c in srv._idle.values()), "kept")
        assert socks[0].recv(1) == b"", "the oldest was closed for the third"
        assert len(srv._idle) == 2
        for c in list(srv._idle.values()):
            c.deadline = 0.0  # their idle time is over
        srv._wake()
        for s in socks[1:]:
            assert s.recv(1) == b"", "closed by the server"
        assert not srv._idle and not srv.refused, "no refusal: an unused kept connection is no abuse"
    finally:
        for s in socks:
            s.close()


def test_a_kept_connection_gets_a_heads_deadline_once_its_next_request_begins(served):
    srv, _, _, _, _, _, _ = served
    with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5) as s:
        s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
        read_answer(s)
        _until(lambda: len(srv._idle) == 1, "kept")
        (conn,) = srv._idle.values()
        assert conn.deadline > time.monotonic() + KEEPALIVE_IDLE - 5
        s.sendall(b"GET /metrics HTTP/1.1\r\n")  # a slow client's first line, then nothing
        _until(lambda: not srv._idle, "its first bytes make it a pending head")
        assert conn.where is srv._pending
        assert conn.deadline <= time.monotonic() + srv.conn_timeout  # the head's own, not the idle one's
