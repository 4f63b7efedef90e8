"""A real Prometheus scraping the exporter over TLS with basic auth, and with client certificates (mTLS)."""

from __future__ import annotations

import base64
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import bcrypt
import pytest
from tlsutil import make_pki

from harness import http_get, wait_until

pytestmark = pytest.mark.e2e

PASSWORD = "correct horse battery staple"


def _client_ctx(pki, cert=None, key=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def _get(url: str, ctx: ssl.SSLContext, auth: tuple[str, str] | None = None) -> tuple[int, bytes, dict]:
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _start_tls(exp, pki) -> None:
    """Exporter.start() waits over plain HTTP; this one waits over TLS."""
    exp.proc = subprocess.Popen(
        [sys.executable, "-m", "vramwatch", "serve"],
        env=exp.env,
        stdout=exp.log,
        stderr=exp.log,
        stdin=subprocess.DEVNULL,
    )

    def ready():
        assert exp.proc.poll() is None, "the exporter exited; see its log"
        try:
            with socket.create_connection(("127.0.0.1", exp.port), timeout=1) as s:
                return s
        except OSError:
            return None

    wait_until(ready, 20, "the TLS exporter to listen")


def test_prometheus_scrapes_over_tls_with_basic_auth(tmp_path, exporter, prometheus, sim_rank):
    pki = make_pki(tmp_path / "pki")
    web = tmp_path / "web.yml"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    web.write_text(
        f"tls_server_config:\n  cert_file: {pki.cert}\n  key_file: {pki.key}\n"
        f"http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"
        f"basic_auth_users:\n  prometheus: {hashed}\n"
    )
    exp = exporter(web_config_file=str(web))
    _start_tls(exp, pki)
    sim_rank(exp, 0, "--duration", "60")
    url = f"https://127.0.0.1:{exp.port}/metrics"
    ctx = _client_ctx(pki)
    # without or with wrong credentials: 401 asking for basic auth, no metrics
    for creds in (None, ("prometheus", "wrong"), ("root", PASSWORD), ("prometheus", PASSWORD + " ")):
        code, body, headers = _get(url, ctx, creds)
        assert code == 401, (creds, code)
        assert headers.get("WWW-Authenticate", "").startswith("Basic")
        assert headers.get("X-Content-Type-Options") == "nosniff"
        assert b"torch_cuda" not in body
    code, body, headers = _get(url, ctx, ("prometheus", PASSWORD))
    assert code == 200 and b"vramwatch_build_info" in body
    assert headers.get("X-Content-Type-Options") == "nosniff"
    # plain HTTP to the TLS port: refused with a hint, never the metrics
    code, body = http_get(f"http://127.0.0.1:{exp.port}/metrics", timeout=5)
    assert code == 400 and b"HTTPS" in body
    # a client that does not trust our CA refuses the server
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(url, timeout=5, context=ssl.create_default_context())

    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD)
    prom = prometheus(
        [f"127.0.0.1:{exp.port}"],
        extra_scrape={
            "scheme": "https",
            "tls_config": {"ca_file": str(pki.ca)},
            "basic_auth": {"username": "prometheus", "password_file": str(password_file)},
        },
    )
    prom.wait_for('up{job="vramwatch"} == 1', timeout=30)
    prom.wait_for('torch_cuda_memory_allocated_bytes{rank="0"}', timeout=30)
    prom.wait_for('vramwatch_training_steps_total{rank="0"} > 0', timeout=30)


def test_prometheus_with_a_wrong_password_sees_the_target_down(tmp_path, exporter, prometheus):
    pki = make_pki(tmp_path / "pki")
    web = tmp_path / "web.yml"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    web.write_text(
        f"tls_server_config: {{cert_file: {pki.cert}, key_file: {pki.key}}}\n"
        f"basic_auth_users: {{prometheus: {hashed}}}\n"
    )
    exp = exporter(web_config_file=str(web))
    _start_tls(exp, pki)
    password_file = tmp_path / "password"
    password_file.write_text("not it")
    prom = prometheus(
        [f"127.0.0.1:{exp.port}"],
        extra_scrape={
            "scheme": "https",
            "tls_config": {"ca_file": str(pki.ca)},
            "basic_auth": {"username": "prometheus", "password_file": str(password_file)},
        },
    )
    prom.wait_for('up{job="vramwatch"} == 0', timeout=30)
    code, body = http_get(prom.url + "/api/v1/targets")
    assert b"401" in body, body[:500]


def test_mtls_requires_a_client_certificate_from_the_trusted_ca(tmp_path, exporter, prometheus):
    pki = make_pki(tmp_path / "pki")
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {pki.cert}\n  key_file: {pki.key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.client_ca}\n"
        "  min_version: TLS12\n"
    )
    exp = exporter(web_config_file=str(web))
    _start_tls(exp, pki)
    url = f"https://127.0.0.1:{exp.port}/metrics"
    code, body, _ = _get(url, _client_ctx(pki, pki.client_cert, pki.client_key))
    assert code == 200 and b"vramwatch_build_info" in body
    for ctx in (_client_ctx(pki), _client_ctx(pki, pki.other_client_cert, pki.other_client_key)):
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _get(url, ctx)
    prom = prometheus(
        [f"127.0.0.1:{exp.port}"],
        extra_scrape={
            "scheme": "https",
            "tls_config": {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)},
        },
    )
    prom.wait_for('up{job="vramwatch"} == 1', timeout=30)
    prom.wait_for("vramwatch_build_info", timeout=30)


# Long enough for 7 or more of Prometheus' 1 s scrapes (timeout 1 s) inside the flood; it keeps both cores busy
# (16 clients' TLS handshakes, bcrypt at cost 10), so each second of it is two of the suite's CPU.
FLOOD_SECONDS = 9


def test_a_password_flood_does_not_blind_prometheus(tmp_path, exporter, prometheus):
    """16 clients guessing passwords over TLS while a real Prometheus scrapes with basic auth: every scrape
    in the window succeeds (up == 1), because a verified pair is recognised without a bcrypt and the
    guesses never take a worker."""
    import threading
    import time

    pki = make_pki(tmp_path / "pki")
    web = tmp_path / "web.yml"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()  # a real cost: ~75 ms a check
    web.write_text(
        f"tls_server_config: {{cert_file: {pki.cert}, key_file: {pki.key}}}\n"
        f"basic_auth_users: {{prometheus: {hashed}}}\n"
    )
    exp = exporter(web_config_file=str(web))
    _start_tls(exp, pki)
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD)
    prom = prometheus(
        [f"127.0.0.1:{exp.port}"],
        extra_scrape={
            "scheme": "https",
            "tls_config": {"ca_file": str(pki.ca)},
            "basic_auth": {"username": "prometheus", "password_file": str(password_file)},
        },
    )
    prom.wait_for('up{job="vramwatch"} == 1', timeout=30)
    url = f"https://127.0.0.1:{exp.port}/metrics"
    ctx = _client_ctx(pki)
    stop = threading.Event()
    codes: list[int] = []

    def guess(i: int) -> None:
        n = 0
        while not stop.is_set():
            user = "prometheus" if i % 2 else f"user{i}"
            try:
                codes.append(_get(url, ctx, (user, f"guess-{i}-{n}"))[0])
            except OSError:
                codes.append(0)
            n += 1

    flood = [threading.Thread(target=guess, args=(i,), daemon=True) for i in range(16)]
    start = time.time()
    for t in flood:
        t.start()
    time.sleep(FLOOD_SECONDS)
    stop.set()
    for t in flood:
        t.join(10)
    end = time.time()
    window = int(end - start) - 1
    # every scrape Prometheus made inside the flood's window, as raw samples
    samples = prom.query(f'up{{job="vramwatch"}}[{window}s]', end)[0]["values"]
    values = [float(v) for _, v in samples]
    assert len(values) >= window // 2, f"Prometheus scraped only {len(values)} times in {window} s"
    assert values == [1.0] * len(values), f"scrapes failed during the flood: {values}"
    assert len(codes) > 200 and 200 not in codes, (len(codes), sorted(set(codes)))
    assert {401, 429} <= set(codes), sorted(set(codes))
