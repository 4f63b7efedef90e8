"""vramwatch_server_mode says what serves a target: a server of one user's ranks (job), or the node daemon (node).
VramwatchTargetDown reads it (tests/monitoring/alerts/exporter.yaml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import Exporter
from harness.exporter import parse_metrics
from harness.net import free_port, http_get, wait_until
from harness.procs import child_env, stop_proc


def test_a_server_of_ones_own_ranks_says_job(tmp_path: Path) -> None:
    ex = Exporter(tmp_path).start()
    try:
        assert parse_metrics(ex.scrape())["vramwatch_server_mode"] == [({"mode": "job"}, 1.0)]
    finally:
        ex.stop()


def test_the_node_daemon_says_node(tmp_path: Path) -> None:
    port = free_port()
    env = child_env(VRAMWATCH_NODE_DIR=str(tmp_path / "root"), VRAMWATCH_PORT=str(port), VRAMWATCH_SIMULATE="true")
    proc = subprocess.Popen([sys.executable, "-m", "vramwatch", "serve", "--node"], env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    try:

        def answers() -> bool:
            assert proc.poll() is None
            try:
                return http_get(url, 1)[0] == 200
            except OSError:
                return False

        wait_until(answers, 30, "the node daemon")
        assert parse_metrics(http_get(url)[1].decode())["vramwatch_server_mode"] == [({"mode": "node"}, 1.0)]
    finally:
        stop_proc(proc)
