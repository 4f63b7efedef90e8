"""End to end: the simulated GPU -> `vramwatch serve` -> a real Prometheus running the generated rules
-> a real Alertmanager running the shipped alertmanager.yml -> webhook receivers in this test.

The rules are the shipped ones on a faster clock (``MonitoringConfig.scaled``: 5m becomes 5s), with
Prometheus evaluating every second; the Alertmanager config is ``deploy/alertmanager/alertmanager.yml``
with only its receiver URLs and timers swapped for the test's. One stack serves the module's tests,
each on its own simulated GPU:

- GPU 0, rank 0: memory to 90% (warning, not paged), 97% (paged; the warning inhibited), 50% (resolved);
- GPU 1: a critical Xid pages and resolves; GPU 2 gets an application Xid that only warns;
- GPU 2, rank 2: a busy stall (steps stop, utilisation pinned, power low) pages once for the job, naming
  rank 2 as the first to stop, and resolves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import ROOT, Alertmanager, Exporter, Prometheus, start_sim_rank, stop_proc, wait_until
from vramwatch.monitoring.alerts.render import rule_file, to_yaml
from vramwatch.monitoring.config import DEFAULT
from vramwatch.sim.state import edit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# the shipped rules, 60x faster; a few bounds kept above a loaded CI machine's scheduling noise
CFG = dataclasses.replace(
    DEFAULT.scaled(1 / 60),
    selector='job="vramwatch"',
    stall_min_seconds=4.0,
    busy_stall_min_seconds=3.0,
    sample_stale_seconds=15.0,
    xid_window="8s",
    dashboard_url="https://grafana.example.com",
)
JOB_ID = "e2e-alerting"
WAIT = 60.0  # bound on each wait; typical latencies are a few seconds


class Webhooks:
    """Alertmanager's webhook receivers: POST /page and /warning, each notification recorded."""

    def __init__(self) -> None:
        self.notifications: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        hooks = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with hooks.lock:
                    hooks.notifications.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self, path: str, alertname: str, status: str = "firing", **labels: str) -> list[dict[str, Any]]:
        """Alerts of that name and status (and labels) that reached receiver ``path``."""
        with self.lock:
            got = list(self.notifications)
        return [
            a
            for p, n in got
            if p == path
            for a in n["alerts"]
            if a["labels"].get("alertname") == alertname
            and a["status"] == status
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def all(self) -> list[tuple[str, dict[str, Any]]]:
        with self.lock:
            return list(self.notifications)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def alertmanager_config(webhook_port: int) -> dict[str, Any]:
    """The shipped config; only the receiver URLs and the timers change."""
    cfg = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    for r in cfg["receivers"]:
        for w in r.get("webhook_configs", []):
            path = urllib.parse.urlsplit(w["url"]).path
            w["url"] = f"http://127.0.0.1:{webhook_port}{path}"
    for route in [cfg["route"], *cfg["route"].get("routes", [])]:
        route.update({"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"})
    return cfg


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.hooks = Webhooks()
        self.am = Alertmanager(tmp, alertmanager_config(self.hooks.port), extra_args=["--log.level=debug"]).start()
        self.exp = Exporter(tmp / "node", gpus=3, nvml_interval=0.25)
        with edit(self.exp.spool) as node:
            for g in node.gpus:  # a training node: busy GPUs drawing power
                g.utilization, g.power_w = 0.95, 550.0
        self.exp.start()
        self.uuids = [g.uuid for g in self.exp.node().gpus]
        self.ranks: dict[int, tuple[subprocess.Popen, Path]] = {}
        for rank, fill in ((0, 0.5), (2, 0.1)):
            control = tmp / f"control-{rank}.json"
            self.control(control, {"fill_ratio": fill})
            proc = start_sim_rank(
                self.exp,
                rank,
                "--duration",
                "600",
                "--fill-gib",
                "1",
                "--activation-gib",
                "0",
                "--control",
                str(control),
                world_size=3,
                cuda_visible=str(rank),
                job_id=JOB_ID,
            )
            self.ranks[rank] = (proc, control)
        rules = tmp / "vramwatch.rules.yml"
        rules.write_text(to_yaml(rule_file(CFG)))
        self.prom = Prometheus(
            tmp, [f"127.0.0.1:{self.exp.port}"], rule_files=[str(rules)], alertmanager=f"127.0.0.1:{self.am.port}"
        ).start()
        self.prom.wait_for('vramwatch_training_steps_total{rank="2"} > 20', timeout=WAIT)
        self.prom.wait_for("gpu_power_watts", timeout=WAIT, check=lambda r: len(r) == 3)

    @staticmethod
    def control(path: Path, state: dict[str, Any]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)

    def drive(self, rank: int, **state: Any) -> None:
        self.control(self.ranks[rank][1], state)

    def stop(self) -> None:
        for proc, _ in self.ranks.values():
            stop_proc(proc)
        for part in (self.prom, self.exp, self.am, self.hooks):
            part.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("e2e-alerting"))
    yield s
    # whatever happened in between: no warning ever reached the pager, no page went to the warnings
    try:
        for path, n in s.hooks.all():
            severities = {a["labels"].get("severity") for a in n["alerts"]}
            assert severities == ({"critical"} if path == "/page" else {"warning"}), (path, n["alerts"])
    finally:
        s.stop()


def _wait(what: str, predicate, timeout: float = WAIT):
    return wait_until(predicate, timeout, what, interval=0.25)


def test_memory_warning_does_not_page_then_critical_pages_and_resolves(stack):
    gpu0 = stack.uuids[0]
    stack.drive(0, fill_ratio=0.90)
    warned = _wait(
        "the 85% warning on the warning receiver",
        lambda: stack.hooks.alerts("/warning", "GPUMemoryUsageHigh", uuid=gpu0, severity="warning"),
    )
    assert warned[0]["annotations"]["runbook_url"].endswith("#gpumemoryusagehigh")
    assert "of its memory in use" in warned[0]["annotations"]["description"]
    # the warning is firing and has been delivered: it must not have paged
    assert not stack.hooks.alerts("/page", "GPUMemoryUsageHigh")
    assert not stack.hooks.alerts("/page", "TorchMemoryBudgetHigh")

    stack.drive(0, fill_ratio=0.97)
    paged = _wait(
        "the 95% page", lambda: stack.hooks.alerts("/page", "GPUMemoryUsageHigh", uuid=gpu0, severity="critical")
    )
    assert paged[0]["labels"]["job"] == "vramwatch"
    assert "GPU 0 (" + gpu0 + ")" in paged[0]["annotations"]["description"]

    def inhibited(alertname: str, severity: str):
        for a in stack.am.alerts(alertname):
            if a["labels"].get("severity") == severity and a["labels"].get("uuid") == gpu0:
                return a["status"]["inhibitedBy"]
        return None

    # while the page fires, Alertmanager inhibits the warning of the same name on the same GPU ...
    _wait("the warning to be inhibited by the page", lambda: inhibited("GPUMemoryUsageHigh", "warning"))
    # ... and the allocator-budget alert that fired with it (an uncapped rank: its budget is the card)
    _wait("the budget alert to be inhibited by the card's", lambda: inhibited("TorchMemoryBudgetHigh", "critical"))

    stack.drive(0, fill_ratio=0.5)
    _wait("the page to resolve", lambda: stack.hooks.alerts("/page", "GPUMemoryUsageHigh", "resolved", uuid=gpu0))


def test_critical_xid_pages_an_application_xid_warns_both_resolve(stack):
    gpu1, gpu2 = stack.uuids[1], stack.uuids[2]
    with edit(stack.exp.spool) as node:
        node.inject_xid(1, 79)
        node.inject_xid(2, 13)
    paged = _wait("the Xid 79 page", lambda: stack.hooks.alerts("/page", "GPUXidError", uuid=gpu1, xid="79"))
    assert paged[0]["labels"]["severity"] == "critical"
    assert paged[0]["labels"]["action"] == "restart_bm" and "reboot" in paged[0]["annotations"]["description"]
    warned = _wait("the Xid 13 warning", lambda: stack.hooks.alerts("/warning", "GPUXidError", uuid=gpu2, xid="13"))
    assert warned[0]["labels"]["action"] == "restart_app"
    assert "restart the application" in warned[0]["annotations"]["description"]  # the demo's Xid says what to do
    assert not stack.hooks.alerts("/page", "GPUXidError", xid="13")
    # no recovery action exists for an event: it resolves once the window (8 s here) has passed
    _wait("the Xid page to resolve", lambda: stack.hooks.alerts("/page", "GPUXidError", "resolved", uuid=gpu1))
    _wait("the Xid warning to resolve", lambda: stack.hooks.alerts("/warning", "GPUXidError", "resolved", uuid=gpu2))


def test_the_drivers_recovery_action_pages_until_it_is_none(stack):
    gpu = stack.uuids[1]
    with edit(stack.exp.spool) as node:
        node.gpu(1).recovery_action = 4  # NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET
    paged = _wait("the recovery page", lambda: stack.hooks.alerts("/page", "GPURecoveryAction", uuid=gpu))
    assert paged[0]["labels"]["action"] == "drain_and_reset"
    assert "drain the GPU's jobs, then reset it" in paged[0]["annotations"]["description"]
    with edit(stack.exp.spool) as node:
        node.gpu(1).recovery_action = 0
    _wait(
        "the recovery page to resolve", lambda: stack.hooks.alerts("/page", "GPURecoveryAction", "resolved", uuid=gpu)
    )


def test_busy_stall_pages_and_resolves_when_steps_resume(stack):
    with edit(stack.exp.spool) as node:  # the hang signature: utilisation pinned, power falling
        node.gpu(2).utilization, node.gpu(2).power_w = 1.0, 100.0
    stack.drive(2, stall=True)
    paged = _wait("the busy-stall page", lambda: stack.hooks.alerts("/page", "TrainingStalled", job_id=JOB_ID))
    # one page for the job (its two ranks share it), naming the rank that stopped
    assert len(paged) == 1 and paged[0]["labels"]["severity"] == "critical" and "rank" not in paged[0]["labels"]
    description = paged[0]["annotations"]["description"]
    assert description.startswith(f"1 rank(s) of job {JOB_ID}"), description
    assert "The first of its job's ranks to stop: rank 2 of job" in description, description
    # the link opens the training-memory dashboard on this job
    link = paged[0]["annotations"]["dashboard_url"]
    assert link.startswith(f"{CFG.dashboard_url}/d/vramwatch-training-memory?"), link
    assert f"&var-job_id={JOB_ID}" in link and "{{" not in link
    assert not stack.hooks.alerts("/warning", "TrainingStalled", rank="2"), "a busy stall is not an idle stall"

    stack.drive(2, stall=False)
    with edit(stack.exp.spool) as node:
        node.gpu(2).utilization, node.gpu(2).power_w = 0.95, 550.0
    _wait(
        "the stall page to resolve", lambda: stack.hooks.alerts("/page", "TrainingStalled", "resolved", job_id=JOB_ID)
    )
