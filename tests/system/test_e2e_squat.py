"""Another process takes the exporter's port: what a real Prometheus sees, and the expression that catches it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_e2e_tls import _start_tls
from tlsutil import make_pki

from harness import port_open, stop_proc, wait_until

pytestmark = pytest.mark.e2e

# the proposed identity rule (docs/security.md, "A squatted port"): a target that served vramwatch in the last
# 10 minutes answers without it
IMPOSTOR = (
    'up{job="vramwatch"} == 1 unless on(job, instance) vramwatch_build_info '
    "and on(job, instance) max_over_time(vramwatch_build_info[10m])"
)
SQUATTER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"fake_gpu_memory_used_bytes 0\\n"
        self.send_response(200); self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _squat(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SQUATTER, str(port)])
    wait_until(lambda: port_open(port), 20, "the squatter to listen")
    return proc


def test_a_plain_http_squatter_is_caught_by_the_identity_expression(exporter, prometheus):
    exp = exporter().start()
    prom = prometheus([f"127.0.0.1:{exp.port}"])
    prom.wait_for("vramwatch_build_info", timeout=30)
    assert prom.query(IMPOSTOR) == []  # the real exporter: silent
    exp.stop()
    wait_until(lambda: not port_open(exp.port), 20, "the exporter to let go of its port")
    squatter = _squat(exp.port)
    try:
        prom.wait_for('up{job="vramwatch"} == 1 unless on(job, instance) vramwatch_build_info', timeout=30)
        hits = prom.wait_for(IMPOSTOR, timeout=30)
        assert hits[0]["metric"]["instance"] == f"127.0.0.1:{exp.port}"
    finally:
        stop_proc(squatter)


def test_a_squatter_without_the_certificate_fails_prometheus_tls(tmp_path, exporter, prometheus):
    pki = make_pki(tmp_path / "pki")
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config: {{cert_file: {pki.cert}, key_file: {pki.key}}}\n")
    exp = exporter(web_config_file=str(web))
    _start_tls(exp, pki)
    prom = prometheus(
        [f"127.0.0.1:{exp.port}"], extra_scrape={"scheme": "https", "tls_config": {"ca_file": str(pki.ca)}}
    )
    prom.wait_for('up{job="vramwatch"} == 1', timeout=30)
    exp.stop()
    wait_until(lambda: not port_open(exp.port), 20, "the exporter to let go of its port")
    squatter = _squat(exp.port)
    try:
        prom.wait_for('up{job="vramwatch"} == 0', timeout=30)  # VramwatchTargetDown's condition
        prom.wait_for("up == 0 and on(job, instance) max_over_time(vramwatch_build_info[10m])", timeout=30)
    finally:
        stop_proc(squatter)
