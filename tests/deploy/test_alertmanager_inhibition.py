"""The shipped inhibition rules, run by a real Alertmanager on loopback: alerts posted to its API, their
inhibited state read back from /api/v2/alerts. amtool checks only that the config parses and where an alert
is routed; a rule that parses but mutes the wrong alert (or none) fails here, in a second or two, without
the Prometheus of the end-to-end test.

Every case is a pair of alerts (source, target) under a job label of its own, all posted at once; a last
pair that must be inhibited is posted after them. Alertmanager's inhibitor reads new alerts in the order
they arrive, so once that last target is inhibited every earlier source has been seen, and a target that
is not inhibited then never will be.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import ALERTMANAGER_YML

from harness import Alertmanager, free_port, http_get, wait_until

pytestmark = pytest.mark.e2e

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
NODE = {"instance": "node-a:9488"}

# case -> (source labels, target labels, whether the target is inhibited, the source resolved already)
CASES: dict[str, tuple[dict[str, str], dict[str, str], bool, bool]] = {
    "page-mutes-its-warning": (
        {"alertname": "GPUMemoryUsageHigh", "severity": "critical", "uuid": GPU_A},
        {"alertname": "GPUMemoryUsageHigh", "severity": "warning", "uuid": GPU_A},
        True,
        False,
    ),
    "page-on-another-gpu": (
        {"alertname": "GPUMemoryUsageHigh", "severity": "critical", "uuid": GPU_B},
        {"alertname": "GPUMemoryUsageHigh", "severity": "warning", "uuid": GPU_A},
        False,
        False,
    ),
    "xid-page-mutes-an-xid-warning-of-the-gpu": (
        {"alertname": "GPUXidError", "severity": "critical", "uuid": GPU_A, "xid": "79"},
        {"alertname": "GPUXidError", "severity": "warning", "uuid": GPU_A, "xid": "13"},
        True,
        False,
    ),
    "page-of-another-alert": (
        {"alertname": "GPUXidError", "severity": "critical", "uuid": GPU_A, "xid": "79"},
        {"alertname": "GPUMemoryUsageHigh", "severity": "warning", "uuid": GPU_A},
        False,
        False,
    ),
    "rank-page-mutes-its-warning": (
        {"alertname": "TrainingStalled", "severity": "critical", "uuid": GPU_A, "rank": "3"},
        {"alertname": "TrainingStalled", "severity": "warning", "uuid": GPU_A, "rank": "3"},
        True,
        False,
    ),
    "page-of-another-rank": (
        {"alertname": "TrainingStalled", "severity": "critical", "uuid": GPU_A, "rank": "3"},
        {"alertname": "TrainingStalled", "severity": "warning", "uuid": GPU_A, "rank": "4"},
        False,
        False,
    ),
    "warning-never-mutes-the-page": (
        {"alertname": "GPUMemoryUsageHigh", "severity": "warning", "uuid": GPU_A},
        {"alertname": "GPUMemoryUsageHigh", "severity": "critical", "uuid": GPU_A},
        False,
        False,
    ),
    "resolved-page-mutes-nothing": (
        {"alertname": "GPUMemoryUsageHigh", "severity": "critical", "uuid": GPU_A},
        {"alertname": "GPUMemoryUsageHigh", "severity": "warning", "uuid": GPU_A},
        False,
        True,
    ),
    "card-mutes-the-budget-of-its-severity": (
        {"alertname": "GPUMemoryUsageHigh", "severity": "critical", "uuid": GPU_A},
        {"alertname": "TorchMemoryBudgetHigh", "severity": "critical", "uuid": GPU_A, "rank": "0"},
        True,
        False,
    ),
    "card-warning-mutes-the-budget-warning": (
        {"alertname": "GPUMemoryUsageHigh", "severity": "warning", "uuid": GPU_A},
        {"alertname": "TorchMemoryBudgetHigh", "severity": "warning", "uuid": GPU_A, "rank": "0"},
        True,
        False,
    ),
    "card-page-leaves-a-budget-warning": (
        {"alertname": "GPUMemoryUsageHigh", "severity": "critical", "uuid": GPU_A},
        {"alertname": "TorchMemoryBudgetHigh", "severity": "warning", "uuid": GPU_A, "rank": "0"},
        False,
        False,
    ),
    "card-of-another-gpu-leaves-the-budget": (
        {"alertname": "GPUMemoryUsageHigh", "severity": "critical", "uuid": GPU_B},
        {"alertname": "TorchMemoryBudgetHigh", "severity": "critical", "uuid": GPU_A, "rank": "0"},
        False,
        False,
    ),
    "budget-never-mutes-the-card": (
        {"alertname": "TorchMemoryBudgetHigh", "severity": "critical", "uuid": GPU_A, "rank": "0"},
        {"alertname": "GPUMemoryUsageHigh", "severity": "warning", "uuid": GPU_A},
        False,
        False,
    ),
    # a cause mutes the symptoms of its job (the job's identity equal), never another job's nor a jobless rank's
    "gpu-lost-mutes-its-jobs-hang": (
        {"alertname": "GPULost", "severity": "critical", "uuid": GPU_A, "job_id": "J"},
        {"alertname": "TrainingStalled", "severity": "critical", "job_id": "J"},
        True,
        False,
    ),
    "critical-xid-mutes-its-jobs-straggler": (
        {"alertname": "GPUXidError", "severity": "critical", "uuid": GPU_A, "xid": "79", "job_id": "J"},
        {"alertname": "TrainingRankStraggler", "severity": "warning", "uuid": GPU_B, "rank": "3", "job_id": "J"},
        True,
        False,
    ),
    "rank-exit-mutes-its-jobs-hang": (
        {"alertname": "TrainingRankExited", "severity": "critical", "rank": "2", "reason": "oom", "job_id": "J"},
        {"alertname": "TrainingStalled", "severity": "critical", "job_id": "J"},
        True,
        False,
    ),
    "node-lost-mutes-its-jobs-hang": (
        {"alertname": "TrainingNodeLost", "severity": "critical", "hostname": "b", "job_id": "J"},
        {"alertname": "TrainingStalled", "severity": "critical", "job_id": "J"},
        True,
        False,
    ),
    "node-lost-mutes-its-target-down": (
        {"alertname": "TrainingNodeLost", "severity": "critical", "hostname": "b", "job_id": "J"},
        {"alertname": "VramwatchTargetDown", "severity": "warning"},
        True,
        False,
    ),
    "cause-of-another-job": (
        {"alertname": "GPULost", "severity": "critical", "uuid": GPU_A, "job_id": "K"},
        {"alertname": "TrainingStalled", "severity": "critical", "job_id": "J"},
        False,
        False,
    ),
    "cause-of-no-job-mutes-no-jobless-rank": (
        {"alertname": "GPULost", "severity": "critical", "uuid": GPU_A},
        {"alertname": "TrainingStalled", "severity": "critical", "uuid": GPU_B, "rank": "0"},
        False,
        False,
    ),
    "xid-warning-is-no-cause": (
        {"alertname": "GPUXidError", "severity": "warning", "uuid": GPU_A, "xid": "13", "job_id": "J"},
        {"alertname": "TrainingStalled", "severity": "critical", "job_id": "J"},
        False,
        False,
    ),
    "hang-page-mutes-its-ranks-stall-warnings": (
        {"alertname": "TrainingStalled", "severity": "critical", "job_id": "J"},
        {"alertname": "TrainingStalled", "severity": "warning", "uuid": GPU_B, "rank": "5", "job_id": "J"},
        True,
        False,
    ),
    "symptom-never-mutes-the-cause": (
        {"alertname": "TrainingStalled", "severity": "critical", "job_id": "J"},
        {"alertname": "TrainingRankExited", "severity": "critical", "rank": "2", "reason": "oom", "job_id": "J"},
        False,
        False,
    ),
}
LAST = "page-mutes-its-warning"  # posted again, last, under a job of its own: the barrier


def _alert(labels: dict[str, str], job: str, resolved: bool = False) -> dict[str, Any]:
    now = datetime.now(UTC)
    a: dict[str, Any] = {"labels": {**NODE, **labels, "job": job}, "startsAt": (now - timedelta(minutes=5)).isoformat()}
    # open-ended alerts stay firing for resolve_timeout (5m), longer than this module runs
    if resolved:
        a["endsAt"] = (now - timedelta(minutes=1)).isoformat()
    return a


def _post(am: Alertmanager, alerts: list[dict[str, Any]]) -> None:
    req = urllib.request.Request(
        f"{am.url}/api/v2/alerts",
        data=json.dumps(alerts).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def _alerts(am: Alertmanager, job: str) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"filter": f'job="{job}"'})
    code, body = http_get(f"{am.url}/api/v2/alerts?{q}")
    assert code == 200, body
    return json.loads(body)


def _state(am: Alertmanager, job: str, labels: dict[str, str]) -> dict[str, Any] | None:
    want = {**NODE, **labels, "job": job}
    for a in _alerts(am, job):
        if a["labels"] == want:
            return a["status"]
    return None


@pytest.fixture(scope="module")
def am(tmp_path_factory: pytest.TempPathFactory):
    cfg = yaml.safe_load(ALERTMANAGER_YML.read_text())
    dead = f"http://127.0.0.1:{free_port()}/"  # nothing listens: no notification leaves the test
    for r in cfg["receivers"]:
        for w in r.get("webhook_configs", []):
            w["url"] = dead
    server = Alertmanager(Path(tmp_path_factory.mktemp("am")), cfg).start()
    try:
        batch = []
        for case, (source, target, _, resolved) in CASES.items():
            batch += [_alert(source, case, resolved), _alert(target, case)]
        _post(server, batch)
        source, target, _, _ = CASES[LAST]
        _post(server, [_alert(source, "barrier"), _alert(target, "barrier")])
        wait_until(
            lambda: (_state(server, "barrier", target) or {}).get("inhibitedBy"),
            30,
            "the barrier's warning to be inhibited",
        )
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_inhibition(am: Alertmanager, case: str) -> None:
    source, target, inhibited, resolved = CASES[case]
    status = _state(am, case, target)
    assert status is not None, _alerts(am, case)
    if inhibited:
        assert status["state"] == "suppressed" and len(status["inhibitedBy"]) == 1, status
    else:
        assert status["state"] == "active" and status["inhibitedBy"] == [], status
    src = _state(am, case, source)
    if resolved:
        assert src is None or src["state"] != "active"  # a resolved alert is dropped or shown as such
    else:
        assert src is not None, _alerts(am, case)  # firing (muted itself only where the target pages)
