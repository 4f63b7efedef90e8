"""The transport from outside: body framing (RFC 9112), pipelining, the TLS handshake's deadline, the web
config read again on use, and accept under EMFILE. Servers run on loopback, in this process or a child."""

from __future__ import annotations

import base64
import logging
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import bcrypt
import pytest
from prometheus_client import CollectorRegistry, Gauge
from tlsutil import make_pki

from harness import child_env, read_answer, wait_until
from vramwatch.server.http import ExporterHTTPServer
from vramwatch.server.webconfig import load_web_config

HASH_OLD = bcrypt.hashpw(b"old-secret", bcrypt.gensalt(4)).decode()
HASH_NEW = bcrypt.hashpw(b"new-secret", bcrypt.gensalt(4)).decode()


def _registry() -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    Gauge("transport_up", "test", registry=reg).set(1)
    return reg


class Running:
    def __init__(self, srv: ExporterHTTPServer) -> None:
        self.srv = srv
        self.port = srv.server_address[1]
        self.thread = threading.Thread(target=srv.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def serve():
    running: list[Running] = []

    def make(**kw) -> Running:
        r = Running(ExporterHTTPServer(("127.0.0.1", 0), _registry(), **kw))
        running.append(r)
        return r

    yield make
    for r in running:
        r.stop()


def _answers(s: socket.socket, settle: float = 0.5) -> list[bytes]:
    """Every answer that comes on ``s`` until it is quiet for ``settle`` s (or closed), split by status line."""
    s.settimeout(settle)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return [b"HTTP/" + part for part in data.split(b"HTTP/")[1:]]


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


# --- body framing ---
def test_a_body_on_a_kept_alive_get_is_read_not_answered_as_a_second_request(serve):
    r = serve()
    smuggled = b"GET /-/healthy HTTP/1.1\r\nHost: xy\r\n\r\n"
    assert len(smuggled) == 37
    with socket.create_connection(("127.0.0.1", r.port)) as s:
        s.sendall(b"GET /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 37\r\n\r\n" + smuggled)
        first = _answers(s)
        assert [_status(a) for a in first] == [404], first  # one answer: the body was a body
        s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")  # and the connection is still in step
        assert [_status(a) for a in _answers(s)] == [200]


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        (b"Transfer-Encoding: chunked\r\n", 400),
        (b"Transfer-Encoding: gzip, chunked\r\n", 400),
        (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", 400),
        (b"Content-Length: 5\r\nContent-Length: 5\r\n", 400),  # duplicate, even if equal
        (b"Content-Length: 5\r\nContent-Length: 6\r\n", 400),
        (b"Content-Length: 5, 5\r\n", 400),
        (b"Content-Length: -1\r\n", 400),
        (b"Content-Length: +5\r\n", 400),
        (b"Content-Length: 0x5\r\n", 400),
        (b"Content-Length : 5\r\n", 400),  # whitespace before the colon
        (b"Content-Length: 99999999999\r\n", 413),
    ],
)
def test_framing_a_server_cannot_trust_is_refused_and_closed(serve, caplog, fields, code):
    r = serve()
    with caplog.at_level(logging.WARNING, logger="vramwatch"), socket.create_connection(("127.0.0.1", r.port)) as s:
        s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\nhello0\r\n\r\nGET / HTTP/1.1\r\n\r\n")
        answers = _answers(s, 2.0)
    assert [_status(a) for a in answers] == [code], answers  # refused, and nothing after it is read as a request
    assert b"Connection: close" in answers[0]
    assert f"answered {code}" in caplog.text


def test_a_small_body_is_dropped_and_the_connection_kept(serve):
    r = serve()
    with socket.create_connection(("127.0.0.1", r.port)) as s:
        s.sendall(b"GET /-/healthy HTTP/1.1\r\nContent-Length: 4\r\n\r\nabcd" + b"GET / HTTP/1.1\r\n\r\n")
        assert [_status(a) for a in _answers(s)] == [200, 200]


# --- pipelining ---
@pytest.mark.parametrize("kept", [False, True], ids=["new", "kept-alive"])
def test_pipelined_requests_beyond_16_kib_are_answered_in_order(serve, kept):
    r = serve()
    paths = ["/-/healthy", "/", "/nope", "/metrics"] * 10
    pad = b"X-Pad: " + b"p" * 1000 + b"\r\n"
    batch = b"".join(b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (p.encode(), pad) for p in paths)
    assert len(batch) > 16 * 1024 * 2
    with socket.create_connection(("127.0.0.1", r.port)) as s:
        if kept:  # the batch comes to a connection waiting for its next request
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert [_status(a) for a in _answers(s, 0.3)] == [200]
        s.sendall(batch)
        answers = _answers(s, 1.5)
    want = {"/-/healthy": 200, "/": 200, "/nope": 404, "/metrics": 200}
    assert [_status(a) for a in answers] == [want[p] for p in paths]
    assert all(b"transport_up 1.0" in a for a, p in zip(answers, paths, strict=True) if p == "/metrics")


# --- TLS ---
@pytest.mark.timing
def test_a_stalled_tls_handshake_is_cut_at_the_deadline_and_holds_up_no_other(serve, tmp_path, caplog):
    pki = make_pki(tmp_path / "pki")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(pki.cert), str(pki.key))
    r = serve(ssl_context=ctx, timeout=1.0)
    client = ssl.create_default_context(cafile=str(pki.ca))
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        stalled = [socket.create_connection(("127.0.0.1", r.port)) for _ in range(3)]
        half = socket.create_connection(("127.0.0.1", r.port))
        half.sendall(b"\x16\x03\x01\x02\x00\x01")  # the start of a ClientHello, then nothing
        t0 = time.monotonic()
        with client.wrap_socket(socket.create_connection(("127.0.0.1", r.port)), server_hostname="localhost") as s:
            s.sendall(b"GET /-/healthy HTTP/1.0\r\n\r\n")
            assert read_answer(s).startswith(b"HTTP/1.0 200 OK")
        assert time.monotonic() - t0 < 0.9, "served beside the stalled handshakes, before their deadline"
        wait_until(lambda: r.srv.refused["slow"] == 4, 5, "the stalled handshakes cut")
    for s in [*stalled, half]:
        s.settimeout(2)
        assert s.recv(1) == b""  # closed by the server
        s.close()
    assert "sent no complete TLS handshake within 1 s; closed it" in caplog.text


# --- the web config, read again on use ---
def _basic(user: str, password: str) -> bytes:
    return b"Authorization: Basic " + base64.b64encode(f"{user}:{password}".encode()) + b"\r\n"


def _get(port: int, creds: bytes = b"", ctx: ssl.SSLContext | None = None) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        s = ctx.wrap_socket(raw, server_hostname="localhost") if ctx else raw
        s.sendall(b"GET /metrics HTTP/1.0\r\n" + creds + b"\r\n")
        return _status(read_answer(s, quiet=(ConnectionResetError,)))


def test_a_rotated_password_works_at_once_and_the_old_one_stops(serve, tmp_path, caplog):
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alice: {HASH_OLD}\n  bob: {HASH_OLD}\n")
    r = serve(web_config=load_web_config(str(web)))
    r.srv.failure_budget.burst = 10  # more bcrypt checks from this one source than its default budget
    with caplog.at_level(logging.INFO, logger="vramwatch"):
        assert _get(r.port, _basic("alice", "old-secret")) == 200
        assert _get(r.port, _basic("alice", "old-secret")) == 200  # verified before: from the cache
        assert _get(r.port, _basic("bob", "old-secret")) == 200
        web.write_text(f"basic_auth_users:\n  alice: {HASH_NEW}\n")  # alice rotated, bob removed
        assert _get(r.port, _basic("alice", "new-secret")) == 200
        assert _get(r.port, _basic("alice", "old-secret")) == 401
        assert _get(r.port, _basic("bob", "old-secret")) == 401
    assert f"vramwatch: web config {web} changed; reloaded it (no TLS, 1 basic-auth users)" in caplog.messages


def test_turning_on_client_certificates_in_the_file_takes_the_next_connection(serve, tmp_path, caplog):
    pki = make_pki(tmp_path / "pki")
    web = tmp_path / "web.yml"
    tls = f"tls_server_config:\n  cert_file: {pki.cert}\n  key_file: {pki.key}\n"
    web.write_text(tls)
    r = serve(web_config=load_web_config(str(web)))
    anonymous = ssl.create_default_context(cafile=str(pki.ca))
    with_cert = ssl.create_default_context(cafile=str(pki.ca))
    with_cert.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    assert _get(r.port, ctx=anonymous) == 200
    with caplog.at_level(logging.INFO, logger="vramwatch"):
        web.write_text(tls + f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.client_ca}\n")
        with pytest.raises((ssl.SSLError, ConnectionError, IndexError)):
            _get(r.port, ctx=anonymous)
        assert _get(r.port, ctx=with_cert) == 200
    assert any("reloaded it (TLS client_auth_type RequireAndVerifyClientCert" in m for m in caplog.messages)


# --- accept while out of descriptors ---
EMFILE_SERVER = r"""
import resource, sys, threading
from prometheus_client import CollectorRegistry, Gauge
from vramwatch.server.http import ExporterHTTPServer

reg = CollectorRegistry(auto_describe=False)
Gauge("emfile_up", "test", registry=reg).set(1)
srv = ExporterHTTPServer(("127.0.0.1", 0), reg, timeout=30.0)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
import os
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 24, hard))  # room for about 20 connections
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


def _cpu_seconds(pid: int) -> float:
    import os

    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timing
def test_out_of_descriptors_accept_waits_instead_of_spinning(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", EMFILE_SERVER],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    held: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(40):  # more than it may hold: the rest wait in the backlog
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # a head that never ends: held until the 30 s deadline
            held.append(s)
        time.sleep(1.0)  # it runs out of descriptors
        before = _cpu_seconds(proc.pid)
        time.sleep(3.0)
        used = _cpu_seconds(proc.pid) - before
        assert used < 0.25, f"the server used {used:.2f} s of CPU in 3 s while out of descriptors"
        for s in held:
            s.close()
        held.clear()
        wait_until(lambda: _get(port) == 200, 10, "a scrape once descriptors are free again")
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.wait()
    assert "cannot accept a connection: Too many open files; trying again in 0.5 s" in proc.stderr.read()


def test_the_tls_config_is_chosen_per_connection_not_at_accept(tmp_path: Path) -> None:
    """A connection accepted before the certificate changed but handshaking after it gets the new one."""
    pki, other = make_pki(tmp_path / "a"), make_pki(tmp_path / "b")
    cert, key = tmp_path / "s.crt", tmp_path / "s.key"
    cert.write_bytes(pki.cert.read_bytes())
    key.write_bytes(pki.key.read_bytes())
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config: {{cert_file: {cert}, key_file: {key}}}\n")
    r = Running(ExporterHTTPServer(("127.0.0.1", 0), _registry(), web_config=load_web_config(str(web))))
    try:
        assert _get(r.port, ctx=ssl.create_default_context(cafile=str(pki.ca))) == 200
        cert.write_bytes(other.cert.read_bytes())
        key.write_bytes(other.key.read_bytes())
        assert _get(r.port, ctx=ssl.create_default_context(cafile=str(other.ca))) == 200
    finally:
        r.stop()
