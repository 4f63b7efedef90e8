"""`scripts/demo_stack.py` (make demo): Prometheus scrapes the demo (up == 1), Alertmanager is ready, and
Ctrl-C leaves nothing running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
from deploy_files import RULES

from harness import ROOT, free_port, http_get, port_open, wait_port_closed, wait_until


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{d.name}: {cmd}")
    return found


@pytest.mark.e2e
def test_demo_stack_scrapes_the_demo_and_cleans_up(tmp_path):
    prom_port, am_port, exp_port = free_port(), free_port(), free_port()
    out = open(tmp_path / "stack.out", "w+b")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "scripts" / "demo_stack.py"),
            "--prometheus-port",
            str(prom_port),
            "--alertmanager-port",
            str(am_port),
            "--port",
            str(exp_port),
            "--scrape-interval",
            "1s",
            "--ranks",
            "1",
            "--spool-dir",
            str(tmp_path / "spool"),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        # the default grace (90 s) and linger (10 s): Ctrl-C must not leave the exporter's port bound for them
        env={k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")},
    )
    prom = f"http://127.0.0.1:{prom_port}"

    def output() -> str:
        return (tmp_path / "stack.out").read_text(errors="replace")

    try:
        wait_until(
            lambda: proc.poll() is None and "vramwatch demo:" in output(), 90, "the stack to start and the demo to run"
        )
        assert f"Prometheus   {prom}" in output() and f"Alertmanager http://127.0.0.1:{am_port}" in output()
        work = re.search(r"files and logs in (\S+)", output()).group(1)

        def up() -> bool:
            q = urllib.parse.urlencode({"query": 'up{job="vramwatch"}'})
            res = json.loads(http_get(f"{prom}/api/v1/query?{q}")[1])["data"]["result"]
            return bool(res) and res[0]["value"][1] == "1" and res[0]["metric"]["instance"] == f"127.0.0.1:{exp_port}"

        wait_until(up, 60, "Prometheus to scrape the demo (up == 1)", interval=0.5)

        def steps() -> bool:
            q = urllib.parse.urlencode({"query": 'vramwatch_training_steps_total{job="vramwatch"} > 0'})
            return bool(json.loads(http_get(f"{prom}/api/v1/query?{q}")[1])["data"]["result"])

        wait_until(steps, 60, "the demo rank's steps in Prometheus", interval=0.5)
        assert http_get(f"http://127.0.0.1:{am_port}/-/ready")[0] == 200
        rules = json.loads(http_get(f"{prom}/api/v1/rules")[1])["data"]["groups"]
        assert rules and all(g["file"] == str(RULES) for g in rules), "the generated rules are loaded"
        ams = json.loads(http_get(f"{prom}/api/v1/alertmanagers")[1])["data"]["activeAlertmanagers"]
        assert [a["url"] for a in ams] == [f"http://127.0.0.1:{am_port}/api/v2/alerts"]
        assert _processes_mentioning(work), "Prometheus and Alertmanager run with the stack's directory"
        time.sleep(2.5)  # the rank-started server polls its ranks each second: let it see one before Ctrl-C
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it to the foreground group
        interrupted = time.monotonic()
        assert proc.wait(timeout=60) == 130
        stopped_in = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        out.close()
    assert "vramwatch stack: stopped Prometheus and Alertmanager" in output()
    for port in (prom_port, am_port):
        assert not port_open(port), f"port {port} still open after the stack stopped"
    assert not Path(work).exists(), "the stack's directory is left behind"
    assert not _processes_mentioning(work), "a server outlived the stack"
    assert not _processes_mentioning(f"--port {exp_port}"), "the demo outlived the stack"
    left = {p.name for p in (tmp_path / "spool").iterdir()}
    leftovers = {"nvml.json", "sim-node.json", "server.json"} & left | {n for n in left if n.startswith("rank-")}
    assert not leftovers, f"the demo left state a later run would read: {leftovers}"
    assert stopped_in < 15, f"the stack took {stopped_in:.1f}s to stop"
    try:
        wait_port_closed(exp_port, 3)  # the demo stopped the server its rank started: not after grace and linger
    except AssertionError:
        spool = tmp_path / "spool"
        raise AssertionError(
            f"exporter still up; spool: {sorted(p.name for p in spool.iterdir())}; "
            f"server.log: {(spool / 'server.log').read_text()[-3000:]}; "
            f"servers: {_processes_mentioning('vramwatch serve')}"
        ) from None
