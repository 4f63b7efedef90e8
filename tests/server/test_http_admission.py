"""Who gets served when the port is abused: slow clients, password floods, more scrapers than workers.

The server runs in this process on loopback, plain or over TLS, with or without basic auth.
"""

from __future__ import annotations

import base64
import logging
import socket
import ssl
import statistics
import threading
import time

import bcrypt
import pytest
from prometheus_client import CollectorRegistry, Gauge
from test_http_robustness import _Gate, check_response
from tlsutil import make_pki

from harness import read_answer
from vramwatch.server.admission import Admission, Decision, is_scrape, scrape_wait
from vramwatch.server.auth import BasicAuth, FailureBudget
from vramwatch.server.http import MAX_HEADER_LINES, ExporterHTTPServer

PASSWORD = "s3cret"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(6)).decode()


def basic(user: str, password: str) -> bytes:
    return b"Authorization: Basic " + base64.b64encode(f"{user}:{password}".encode()) + b"\r\n"


class Target:
    """A running server and how to talk to it (TLS or not, with the right credentials or not)."""

    def __init__(self, srv: ExporterHTTPServer, client_ctx: ssl.SSLContext | None, auth: bool) -> None:
        self.srv, self.client_ctx, self.auth = srv, client_ctx, auth
        self.port = srv.server_address[1]

    def connect(self, timeout: float = 10.0) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        if self.client_ctx is not None:
            s = self.client_ctx.wrap_socket(s, server_hostname="localhost")
        return s

    def creds(self) -> bytes:
        return basic("prometheus", PASSWORD) if self.auth else b""

    def exchange(self, data: bytes, timeout: float = 10.0) -> bytes:
        with self.connect(timeout) as s:
            s.sendall(data)
            return read_answer(s, data.startswith(b"HEAD "), (ConnectionResetError, TimeoutError, ssl.SSLError))

    def get(self, path: str = "/metrics", extra: bytes = b"", prometheus: bool = False) -> int | None:
        scrape = b"X-Prometheus-Scrape-Timeout-Seconds: 10\r\n" if prometheus else b""
        req = b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + scrape + self.creds() + extra + b"\r\n"
        return check_response(self.exchange(req))


def _serve(tmp_path_factory, *, tls: bool, auth: bool, max_connections: int = 4, timeout: float = 10.0):
    reg = CollectorRegistry(auto_describe=False)
    gate = _Gate()
    reg.register(gate)
    Gauge("admission_static", "test", registry=reg).set(1)
    server_ctx = client_ctx = None
    if tls:
        pki = make_pki(tmp_path_factory.mktemp("pki"))
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(str(pki.cert), str(pki.key))
        client_ctx = ssl.create_default_context(cafile=str(pki.ca))
    srv = ExporterHTTPServer(
        ("127.0.0.1", 0),
        reg,
        max_connections=max_connections,
        timeout=timeout,
        ssl_context=server_ctx,
        authorize=BasicAuth((("prometheus", HASH),)) if auth else None,
    )
    srv.gate = gate
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    return srv, client_ctx


@pytest.fixture(params=["plain", "tls", "plain+auth", "tls+auth"])
def target(request, tmp_path_factory):
    srv, ctx = _serve(tmp_path_factory, tls="tls" in request.param, auth="auth" in request.param)
    yield Target(srv, ctx, "auth" in request.param)
    srv.gate.open.set()
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def plain(tmp_path_factory):
    srv, _ = _serve(tmp_path_factory, tls=False, auth=False)
    yield Target(srv, None, False)
    srv.gate.open.set()
    srv.shutdown()
    srv.server_close()


def _trickle(t: Target, n: int, stop: threading.Event) -> list[socket.socket]:
    """``n`` slowloris sockets sending their head a byte a second until ``stop``."""
    socks = [t.connect() for _ in range(n)]

    def run():
        payload = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
        i = 0
        while not stop.wait(1.0) and i < len(payload):
            for s in socks:
                try:
                    s.sendall(payload[i : i + 1])
                except OSError:
                    pass
            i += 1

    threading.Thread(target=run, daemon=True).start()
    return socks


# --- slowloris (issue 22 item 4) ---
def test_trickling_sockets_cannot_take_the_slots_a_scraper_needs(target):
    stop = threading.Event()
    socks = _trickle(target, 16, stop)  # four times max_connections
    try:
        codes = [target.get(prometheus=True) for _ in range(30)]
    finally:
        stop.set()
        for s in socks:
            s.close()
    assert codes == [200] * 30


def test_slow_heads_are_cut_at_the_deadline_with_a_log_line(tmp_path_factory, caplog):
    srv, ctx = _serve(tmp_path_factory, tls=True, auth=True, timeout=1.0)
    t = Target(srv, ctx, True)
    try:
        with caplog.at_level(logging.WARNING, logger="vramwatch"):
            stop = threading.Event()
            socks = _trickle(t, 8, stop)
            deadline = time.monotonic() + 5
            while srv.refused["slow"] < 8 and time.monotonic() < deadline:
                time.sleep(0.1)
            stop.set()
            for s in socks:
                s.close()
        assert srv.refused["slow"] == 8
        assert "sent no complete request head within 1 s; closed it" in caplog.text
        assert t.get() == 200
    finally:
        srv.shutdown()
        srv.server_close()


def test_more_slow_clients_than_pending_room_evicts_the_oldest(tmp_path_factory, caplog):
    srv, _ = _serve(tmp_path_factory, tls=False, auth=False)
    srv.max_pending = 8
    t = Target(srv, None, False)
    try:
        with caplog.at_level(logging.WARNING, logger="vramwatch"):
            socks = [t.connect() for _ in range(20)]
            for s in socks:
                s.sendall(b"GET /metrics HTTP/1.1\r\n")
            assert t.get(prometheus=True) == 200  # the newest connection is always admitted
        assert srv.refused["evicted"] >= 12
        assert "closed the oldest" in caplog.text
        for s in socks:
            s.close()
    finally:
        srv.shutdown()
        srv.server_close()


# --- HTTP abuse, with and without TLS and basic auth (issue 20 item 3) ---
ABUSE = [
    ("too-large", b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n", 431),
    (
        "too-many-headers",
        b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADER_LINES + 5)) + b"\r\n",
        431,
    ),
    ("method", b"TRACE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    ("method", b"CONNECT evil.example:443 HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    ("method", b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 405),
    ("bad-request", b"GET /metrics\r\n\r\n", 400),
    ("bad-request", b"\x00\xff garbage\r\n\r\n", 400),
]


@pytest.mark.parametrize("kind,payload,code", ABUSE, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(ABUSE)])
def test_abuse_gets_a_clean_answer_and_a_log_line(target, caplog, kind, payload, code):
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        raw = target.exchange(payload)
    assert check_response(raw) == code, raw[:200]
    assert target.srv.refused[kind] == 1
    assert f"answered {code}" in caplog.text
    assert target.get() == 200


def test_refusals_are_logged_once_a_minute_then_counted(plain, caplog):
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        for _ in range(50):
            plain.exchange(b"TRACE / HTTP/1.0\r\n\r\n")
        plain.srv._abuse._last["method"] -= 61  # a minute later
        plain.exchange(b"TRACE / HTTP/1.0\r\n\r\n")
    lines = [r.getMessage() for r in caplog.records if "answered 405" in r.getMessage()]
    assert len(lines) == 2 and lines[1].endswith("(49 more like it in the last 60 s)"), lines


# --- basic auth (issue 21 item 2) ---
@pytest.fixture
def authed(tmp_path_factory):
    srv, ctx = _serve(tmp_path_factory, tls=True, auth=True)
    yield Target(srv, ctx, True)
    srv.gate.open.set()
    srv.shutdown()
    srv.server_close()


def test_a_password_flood_never_takes_the_slots_an_authenticated_scraper_needs(authed):
    assert authed.get(prometheus=True) == 200  # Prometheus authenticated once: its pair is verified
    calls = []
    real = authed.srv.auth._bcrypt

    class Counting:
        gensalt, hashpw = staticmethod(real.gensalt), staticmethod(real.hashpw)

        @staticmethod
        def checkpw(p, h):
            calls.append(p)
            return real.checkpw(p, h)

    authed.srv.auth._bcrypt = Counting
    stop = threading.Event()
    answers: list[int | None] = []

    def guess(i: int) -> None:
        n = 0
        while not stop.is_set():
            wrong = basic("prometheus" if i % 2 else f"user{i}", f"guess-{i}-{n}")
            req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + wrong + b"\r\n"
            try:
                answers.append(check_response(authed.exchange(req, timeout=5)))
            except OSError:
                answers.append(None)
            n += 1

    flood = [threading.Thread(target=guess, args=(i,), daemon=True) for i in range(16)]
    for th in flood:
        th.start()
    try:
        started = time.monotonic()
        codes = []
        while time.monotonic() - started < 6:
            codes.append(authed.get(prometheus=True))
            time.sleep(0.2)
    finally:
        stop.set()
        for th in flood:
            th.join(10)
    elapsed = time.monotonic() - started
    assert codes and codes == [200] * len(codes)
    assert len(answers) > 100 and set(answers) <= {401, 429, 503}, set(answers)
    assert answers.count(200) == 0
    budget = authed.srv.failure_budget
    assert len(calls) <= budget.burst + budget.rate * (elapsed + 2), "bcrypt work per source is bounded"
    assert authed.srv.refused["auth-throttled"] > 0


def test_a_new_source_still_gets_its_bcrypt_while_another_floods():
    budget = FailureBudget(rate=1.0, burst=3.0)
    now = 100.0
    assert [budget.take("10.0.0.1", now) for _ in range(5)] == [True, True, True, False, False]
    assert budget.take("10.0.0.2", now)  # another address has its own bucket
    assert not budget.take("10.0.0.1", now + 0.5) and budget.take("10.0.0.1", now + 1.6)


def _median_refusal(auth: BasicAuth, user: str, n: int = 7) -> float:
    times = []
    for i in range(n):
        creds = (user.encode(), f"wrong-{i}".encode())
        t0 = time.perf_counter()
        assert not auth.verify(creds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@pytest.mark.timing
def test_refusing_an_unknown_user_takes_as_long_as_a_known_one():
    # cost 9: a dummy of any other cost (e.g. a fixed cost-10 one) is 2x off and fails this
    auth = BasicAuth((("alice", bcrypt.hashpw(b"pw", bcrypt.gensalt(9)).decode()),))
    auth.verify((b"warm-up", b"x"))  # makes the dummy hash once
    known, unknown = [], []
    for _ in range(3):  # interleaved, so load on the machine hits both alike
        known.append(_median_refusal(auth, "alice", 3))
        unknown.append(_median_refusal(auth, "mallory", 3))
    ratio = statistics.median(unknown) / statistics.median(known)
    assert 0.7 < ratio < 1.4, f"unknown/known refusal time {ratio:.2f}"


def test_users_hashed_at_different_costs_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        BasicAuth((("a", bcrypt.hashpw(b"x", bcrypt.gensalt(4)).decode()), ("b", HASH)))
    assert "different bcrypt costs (4, 6)" in caplog.text


# --- overload: Prometheus' scrapes first (issue 21 item 3) ---
def test_overload_sheds_other_requests_first(plain):
    srv = plain.srv
    srv.gate.open.clear()  # every collection blocks until the gate opens
    results: dict[str, list[int | None]] = {"plain": [], "prometheus": []}

    def run(kind: str) -> None:
        results[kind].append(plain.get(prometheus=kind == "prometheus"))

    def start(kind: str) -> threading.Thread:
        th = threading.Thread(target=run, args=(kind,), daemon=True)
        th.start()
        return th

    held = [start("plain") for _ in range(3)]
    for _ in held:
        assert srv.gate.entered.acquire(timeout=5)
    # three of four workers busy with plain requests: the fourth is kept for scrapes
    assert plain.get() == 503
    held.append(start("prometheus"))
    assert srv.gate.entered.acquire(timeout=5), "a scrape takes the kept worker"
    waiting = start("prometheus")  # every worker busy: a scrape waits for one ...
    deadline = time.monotonic() + 5
    while srv.admission.waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.admission.waiting == 1
    assert plain.get() == 503  # ... where another request gets its 503 at once
    srv.gate.open.set()
    for th in [*held, waiting]:
        th.join(10)
    assert results["prometheus"] == [200, 200]
    assert results["plain"] == [200, 200, 200]


class _SlowCollector:
    """A collection that takes a while, so requests pile up."""

    def describe(self):
        return []

    def collect(self):
        time.sleep(0.02)
        return []


def test_under_sustained_overload_prometheus_scrapes_are_served(tmp_path_factory):
    srv, _ = _serve(tmp_path_factory, tls=False, auth=False, max_connections=2)
    t = Target(srv, None, False)
    slow = threading.Event()
    srv.exposition.registry.register(_SlowCollector())  # a plain registry: rendered per request
    codes: dict[bool, list[int | None]] = {True: [], False: []}

    def client(prometheus: bool) -> None:
        while not slow.is_set():
            codes[prometheus].append(t.get(prometheus=prometheus))

    threads = [threading.Thread(target=client, args=(i < 3,), daemon=True) for i in range(10)]
    for th in threads:
        th.start()
    time.sleep(4)
    slow.set()
    for th in threads:
        th.join(10)
    srv.shutdown()
    srv.server_close()
    prom, other = codes[True], codes[False]
    assert prom and prom.count(200) == len(prom), f"Prometheus got {sorted(set(prom))}"
    assert other.count(503) > 0, "the others are the ones shed"


def test_admission_rules():
    a: Admission[str] = Admission(4)
    assert a.reserved == 1
    assert [a.offer(f"o{i}", False, 0) for i in range(4)] == [Decision.START] * 3 + [Decision.REFUSE]
    assert a.offer("p1", True, 10) is Decision.START
    assert [a.offer(f"p{i}", True, 10) for i in range(2, 7)] == [Decision.QUEUED] * 4 + [Decision.REFUSE]
    assert a.release(False) == ["p2"]  # a freed worker goes to the oldest waiting scrape
    assert a.offer("o5", False, 0) is Decision.REFUSE  # scrapes are waiting: others are not let in
    assert a.expire(11) == ["p3", "p4", "p5"]
    assert Admission(1).reserved == 0 and Admission(8).reserved == 2


def test_two_slots_keep_one_for_scrapes():
    a: Admission[str] = Admission(2)
    assert [a.offer("o1", False, 0), a.offer("o2", False, 0)] == [Decision.START, Decision.REFUSE]
    assert a.offer("p1", True, 10) is Decision.START


def test_slots_come_back_after_any_mix_of_requests():
    """A long-running server: after others, queued scrapes and expiries have come and gone, the slots are all
    free again and the others still get no more than total - reserved of them."""
    a: Admission[str] = Admission(4)
    for _ in range(3):
        others = [a.offer(f"o{i}", False, 0) for i in range(3)]
        assert others == [Decision.START] * 3
        assert a.offer("p0", True, 10) is Decision.START
        assert a.offer("p1", True, 10) is Decision.QUEUED
        assert a.release(False) == ["p1"]  # p1 now holds the other's slot, as a scrape
        assert a.release(True) == [] and a.release(True) == []  # p0, p1
        assert [a.release(False), a.release(False)] == [[], []]
        assert a.in_use == 0 and a.others_in_use == 0
    assert [a.offer(f"o{i}", False, 0) for i in range(4)] == [Decision.START] * 3 + [Decision.REFUSE]


def test_a_scrape_whose_deadline_is_now_expires_and_none_is_lost():
    a: Admission[str] = Admission(4)
    assert [a.offer(f"busy{i}", True, 0) for i in range(4)] == [Decision.START] * 4
    for name, deadline in (("p1", 5.0), ("p2", 10.0), ("p3", 11.0)):
        assert a.offer(name, True, deadline) is Decision.QUEUED
    assert a.expire(10.0) == ["p1", "p2"]  # p2's deadline is now: answered, not left waiting
    assert a.waiting == 1
    assert a.release(True) == ["p3"]  # the one left still gets the freed slot
    assert a.expire(20.0) == [] and a.waiting == 0


def test_shutdown_hands_back_every_waiting_scrape():
    a: Admission[str] = Admission(2)
    assert [a.offer(n, True, 10) for n in ("busy1", "busy2", "p1", "p2")] == [Decision.START] * 2 + [
        Decision.QUEUED
    ] * 2
    assert a.drop_all() == ["p1", "p2"]  # the server closes them
    assert a.waiting == 0 and a.release(True) == []


@pytest.mark.parametrize(
    "method,path,headers,scrape",
    [
        ("GET", "/metrics", {"X-Prometheus-Scrape-Timeout-Seconds": "10"}, True),
        ("GET", "/metrics?x=1", {"Accept": "application/openmetrics-text;version=1.0.0"}, True),
        ("GET", "/metrics?module=a?b", {"X-Prometheus-Scrape-Timeout-Seconds": "10"}, True),  # a second `?`
        ("GET", "/metrics", {"Accept": "text/plain"}, False),
        ("HEAD", "/metrics", {"X-Prometheus-Scrape-Timeout-Seconds": "10"}, False),
        ("GET", "/", {"X-Prometheus-Scrape-Timeout-Seconds": "10"}, False),
    ],
)
def test_what_counts_as_a_scrape(method, path, headers, scrape):
    assert is_scrape(method, path, headers) is scrape


def test_a_scrape_waits_at_most_a_quarter_of_its_timeout():
    assert scrape_wait({"X-Prometheus-Scrape-Timeout-Seconds": "2"}) == 0.5
    assert scrape_wait({"X-Prometheus-Scrape-Timeout-Seconds": "60"}) == 1.0
    assert scrape_wait({"X-Prometheus-Scrape-Timeout-Seconds": "0.5"}) == 0.125  # a sub-second timeout too
    for bad in ("nan", "-1", "x", "", "0"):  # 0: no timeout given, not "no wait"
        assert scrape_wait({"X-Prometheus-Scrape-Timeout-Seconds": bad}) == 1.0


def test_no_credentials_is_401_wrong_ones_401_and_the_scrape_200(authed):
    raw = authed.exchange(b"GET /metrics HTTP/1.0\r\n\r\n")
    assert check_response(raw) == 401 and b'WWW-Authenticate: Basic realm="vramwatch"' in raw
    wrong = basic("prometheus", "nope")
    assert check_response(authed.exchange(b"GET /metrics HTTP/1.0\r\n" + wrong + b"\r\n")) == 401
    assert authed.get() == 200
    assert authed.srv.refused["no-credentials"] == 1 and authed.srv.refused["auth-failed"] == 1
