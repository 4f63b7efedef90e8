"""The scrape server against bad clients: garbage, huge heads, slowloris, floods, odd methods and paths.

The server runs in this process, so its threads can be counted directly.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily

from harness import read_answer
from vramwatch.server.http import MAX_REQUEST_HEAD, ExporterHTTPServer, accepts_gzip

MAX_CONN = 4
TIMEOUT = 1.5


class _Gate:
    """A collector that can be made to block (a slow scrape) or to fail."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Semaphore(0)
        self.fail = False

    def describe(self):
        return []

    def collect(self):
        self.entered.release()
        self.open.wait(10)
        if self.fail:
            raise RuntimeError("collector exploded")
        g = GaugeMetricFamily("robustness_up", "test")
        g.add_metric([], 1.0)
        yield g


@pytest.fixture
def server():
    reg = CollectorRegistry(auto_describe=False)
    gate = _Gate()
    reg.register(gate)
    Gauge("robustness_static", "test", registry=reg).set(1)
    srv = ExporterHTTPServer(("127.0.0.1", 0), reg, max_connections=MAX_CONN, timeout=TIMEOUT)
    srv.gate = gate
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv
    gate.open.set()
    srv.shutdown()
    srv.server_close()


def _port(srv) -> int:
    return srv.server_address[1]


def exchange(srv, data: bytes, timeout: float = 5.0, half_close: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", _port(srv)), timeout=timeout) as s:
        try:
            s.sendall(data)
            if half_close:  # no more bytes coming: the server need not wait for its deadline
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        return read_answer(s, data.startswith(b"HEAD "), (ConnectionResetError, TimeoutError))


_STATUS = re.compile(rb"^HTTP/1\.[01] (\d{3}) ")


def check_response(raw: bytes) -> int | None:
    """Status code of a well-formed response (Content-Length matching the body), None if closed silently."""
    if not raw:
        return None
    m = _STATUS.match(raw)
    assert m, raw[:200]
    head, _, body = raw.partition(b"\r\n\r\n")
    lengths = re.findall(rb"\r\nContent-Length: (\d+)", head)
    assert lengths, head
    assert int(lengths[0]) == len(body) or b"HEAD" in raw, (head, len(body))
    return int(m.group(1))


def scrape(srv) -> int:
    return check_response(exchange(srv, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))


def _threads_settle(limit: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while threading.active_count() > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count()


MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET /metrics HTTP/9.9\r\n\r\n",
    b"GET /metrics HTTP/1.1 extra\r\n\r\n",
    b"GET /metrics HTTX/1.1\r\n\r\n",
    b"\x00\xff\xfe\x16\x03\x01 binary\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS ClientHello to the plain port
    b"GET /metrics HTTP/1.0\r\nno colon here\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\n: empty name\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\nContent-Length: -1\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\nContent-Length: 99999999999\r\n\r\n",
    b"GET /metrics HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /%00%ff/../../etc/passwd HTTP/1.0\r\n\r\n",
    b"GET http://evil.example/metrics HTTP/1.1\r\nHost: evil.example\r\n\r\n",
    b"GET /metrics?" + b"a=" * 3000 + b" HTTP/1.0\r\n\r\n",
    b"GET /metrics HTTP/1.0\nBare: lf\n\n",
    b"FOO /metrics HTTP/1.0\r\n\r\n",
]


@pytest.mark.parametrize("payload", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_requests_get_a_clean_answer(server, payload):
    code = check_response(exchange(server, payload, half_close=True))
    assert code is None or 200 <= code < 600
    assert scrape(server) == 200


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.binary(max_size=512)
    | st.builds(
        lambda a, b: b"GET " + a + b" HTTP/1.0\r\n" + b + b"\r\n\r\n", st.binary(max_size=64), st.binary(max_size=256)
    )
)
def test_fuzzed_requests_never_break_the_server(server, payload):
    check_response(exchange(server, payload, timeout=TIMEOUT + 3, half_close=True))
    assert scrape(server) == 200


@pytest.mark.parametrize(
    "header,gzip",
    [
        ("gzip", True),
        ("gzip, deflate, br", True),
        ("deflate, GZIP;q=0.5", True),
        ("gzip;q=0", False),
        ("gzip; q=0.000", False),
        ("deflate", False),
        ("", False),
        ("*", True),
        ("*;q=0", False),
        ("*, gzip;q=0", False),
        ("gzip;q=bogus", False),
        ("notgzip", False),
    ],
)
def test_gzip_follows_the_accept_encoding_weights(header, gzip):
    assert accepts_gzip(header) is gzip


def test_gzip_refused_by_weight_gets_plain_text(server):
    def headers(accept: bytes) -> bytes:
        raw = exchange(server, b"GET /metrics HTTP/1.0\r\nAccept-Encoding: " + accept + b"\r\n\r\n")
        assert check_response(raw) == 200
        return raw.split(b"\r\n\r\n", 1)[0]

    assert b"Content-Encoding: gzip" in headers(b"gzip")
    assert b"Content-Encoding" not in headers(b"gzip;q=0")


def test_methods_and_paths(server):
    assert check_response(exchange(server, b"GET /nope HTTP/1.0\r\n\r\n")) == 404
    assert check_response(exchange(server, b"GET / HTTP/1.0\r\n\r\n")) == 200
    assert check_response(exchange(server, b"GET /-/healthy HTTP/1.0\r\n\r\n")) == 200
    head = exchange(server, b"HEAD /metrics HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and head.endswith(b"\r\n\r\n"), head  # headers, no body
    for method in (b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"):
        raw = exchange(server, method + b" /metrics HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello")
        assert check_response(raw) == 405, raw
        assert b"\r\nAllow: GET, HEAD\r\n" in raw
    big_post = exchange(server, b"POST /metrics HTTP/1.0\r\nContent-Length: 40000\r\n\r\n" + b"x" * 40000)
    assert check_response(big_post) == 405  # answered, not reset, though the body went unread


def test_huge_heads_get_431_and_memory_stays_bounded(server):
    one_line = b"GET /metrics HTTP/1.0\r\nX-Big: " + b"a" * (MAX_REQUEST_HEAD * 4) + b"\r\n\r\n"
    many = b"GET /metrics HTTP/1.0\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 200) for i in range(400)) + b"\r\n"
    long_line = b"GET /" + b"m" * (MAX_REQUEST_HEAD * 3) + b" HTTP/1.0\r\n\r\n"
    for payload in (one_line, many, long_line):
        assert check_response(exchange(server, payload)) == 431
    before = _rss()
    for _ in range(60):
        exchange(server, many)
        exchange(server, one_line)
    grown = _rss() - before
    assert grown < 20 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 120 huge requests"
    assert scrape(server) == 200


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_slowloris_takes_no_slot_and_is_cut_off_at_the_deadline(server):
    base = threading.active_count()
    socks = []
    for _ in range(MAX_CONN * 2):
        s = socket.create_connection(("127.0.0.1", _port(server)), timeout=10)
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        socks.append(s)
    time.sleep(0.3)
    assert scrape(server) == 200, "a connection still sending its head holds no worker"
    settle = time.monotonic() + 2.0  # the scrape's own worker may still be ending its thread
    while threading.active_count() > base and time.monotonic() < settle:
        time.sleep(0.02)
    assert threading.active_count() <= base, "nor a thread"
    # they keep trickling a byte at a time, well inside any per-read timeout ...
    closed_at: dict[int, float] = {}
    start = time.monotonic()
    while len(closed_at) < len(socks) and time.monotonic() - start < TIMEOUT + 4:
        for i, s in enumerate(socks):
            if i in closed_at:
                continue
            try:
                s.sendall(b"X")
                s.settimeout(0.01)
                if s.recv(1) == b"":
                    closed_at[i] = time.monotonic() - start
            except (TimeoutError, BlockingIOError):
                pass
            except OSError:
                closed_at[i] = time.monotonic() - start
        time.sleep(0.2)
    # ... and are still cut off at the connection's deadline
    assert len(closed_at) == len(socks), f"slowloris connections still open: {closed_at}"
    assert max(closed_at.values()) < TIMEOUT + 1.5
    for s in socks:
        s.close()
    assert server.refused["slow"] == len(socks)
    assert scrape(server) == 200


PROMETHEUS_SCRAPE = (
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: Prometheus/2.42.0\r\n"
    b"Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n"
    b"X-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n"
)


def test_max_connections_concurrent_scrapes_then_a_clean_503(server):
    gate = server.gate
    gate.open.clear()  # every scrape now blocks inside collect()
    results: list[int | None] = []

    def prometheus_scrape():
        results.append(check_response(exchange(server, PROMETHEUS_SCRAPE)))

    threads = [threading.Thread(target=prometheus_scrape) for _ in range(MAX_CONN)]
    for t in threads:
        t.start()
    for _ in range(MAX_CONN):
        assert gate.entered.acquire(timeout=5), "the scrapes should all be inside collect()"
    extra = [check_response(exchange(server, b"GET /metrics HTTP/1.0\r\n\r\n")) for _ in range(5)]
    assert extra == [503] * 5
    assert server.rejected >= 5
    gate.open.set()
    for t in threads:
        t.join(10)
    assert results == [200] * MAX_CONN
    assert scrape(server) == 200


def test_a_failing_collection_is_a_500_not_a_dropped_connection(server):
    server.gate.fail = True
    raw = exchange(server, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert check_response(raw) == 500
    server.gate.fail = False
    assert scrape(server) == 200


def test_connection_flood_keeps_threads_bounded(server):
    base = threading.active_count()
    peak = base
    stop = threading.Event()

    def watch():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, threading.active_count())
            time.sleep(0.005)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    held = []
    for i in range(200):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", _port(server)))
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        except OSError:
            pass
        held.append(s)
    time.sleep(0.5)
    for s in held:
        s.close()
    stop.set()
    w.join()
    assert peak <= base + 1 + MAX_CONN, f"threads peaked at {peak} (base {base})"
    assert _threads_settle(base) <= base
    assert scrape(server) == 200
