"""``vramwatch serve`` holds only what serving needs: no torch, no dashboards SDK, no other command's modules.

Every module a process imports stays resident (the server's RSS budget: a process that only initialises NVML,
plus 15 MB), and torch in the server could create a CUDA context. The server runs as ``vramwatch serve`` does
(the command line, at default settings, NVML on), answers a scrape, and then reports what it has imported.
"""

from __future__ import annotations

import json
import subprocess
import sys

from harness import child_env, free_port

# what must never be in the server: heavy, or another command's, or the rank side's
FORBIDDEN = (
    "torch",
    "numpy",
    "yaml",  # only with a web config file or a monitoring config: neither is the server's default
    "bcrypt",  # only when basic_auth_users is set
    "grafana_foundation_sdk",
    "matplotlib",
    "jinja2",
    "jsonschema",
    "hypothesis",
    "requests",
    "urllib3",
    "cryptography",
    "psutil",
    "vramwatch.rank",
    "vramwatch.sim",
    "vramwatch.demo",
    "vramwatch.docs",
    "vramwatch.report",
    "vramwatch.monitoring.alerts",
    "vramwatch.monitoring.dashboards",
    "vramwatch.monitoring.helm",
    "vramwatch.monitoring.config_file",
    "vramwatch.integrations",
    # hmac, only for basic auth (prometheus_client.exposition, whose encoders the server uses, brings
    # http.server, wsgiref, urllib.request and ssl; asyncio brings ssl too)
    "hmac",
)

# The server's command line in the main thread (it installs signal handlers); a second thread scrapes
# once the port answers, prints the modules and the RSS, and ends the process.
SERVE = r"""
import json, os, socket, sys, threading, time

def report():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as s:
                s.sendall(b"GET /metrics HTTP/1.0\r\nAccept-Encoding: gzip\r\n\r\n")
                while s.recv(65536):
                    pass
            break
        except OSError:
            time.sleep(0.1)
    with open("/proc/self/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))
    print(json.dumps({"modules": sorted(sys.modules), "rss_kb": rss}), flush=True)
    os._exit(0)

threading.Thread(target=report, daemon=True).start()
from vramwatch.cli import main
main(["serve"])
"""


def test_the_server_imports_nothing_heavy(tmp_path):
    port = free_port()
    env = child_env(VRAMWATCH_SPOOL_DIR=str(tmp_path / "spool"), VRAMWATCH_PORT=str(port))
    p = subprocess.run(
        [sys.executable, "-c", SERVE, str(port)], env=env, capture_output=True, text=True, timeout=90, check=True
    )
    got = json.loads(p.stdout.strip().splitlines()[-1])
    modules = got["modules"]
    assert "vramwatch.server.http" in modules  # it did serve
    bad = sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    assert not bad, f"vramwatch serve imported {bad}"
