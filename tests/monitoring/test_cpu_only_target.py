"""A target without NVML raises no alert: a real server's exposition, held for 40 minutes, through every
shipped rule under promtool. The server runs on the simulated node configured without NVML, and with
the real nvidia-ml-py on this machine, which has no NVML at all (nvmlInit: LIBRARY_NOT_FOUND)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from harness import tool, wait_until
from vramwatch.monitoring.alerts.render import rule_file, to_yaml
from vramwatch.monitoring.alerts.rules import alert_names
from vramwatch.monitoring.config import DEFAULT

pytestmark = pytest.mark.e2e

TARGET = {"instance": "cpu1:9488", "job": "vramwatch"}
MINUTES = 40


def _series(name: str, labels: dict[str, str]) -> str:
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted({**labels, **TARGET}.items()))
    return f"{name}{{{inner}}}"


def promtool_case(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> dict:
    """The scrape, as input series constant for MINUTES; every alert expected silent at the end."""
    inputs = [{"series": _series("up", {}), "values": f"1x{MINUTES}"}]
    for name, samples in sorted(metrics.items()):
        for labels, value in samples:
            inputs.append({"series": _series(name, labels), "values": f"{value!r}x{MINUTES}"})
    checks = [{"eval_time": f"{MINUTES}m", "alertname": a} for a in alert_names(DEFAULT)]
    return {
        "rule_files": ["vramwatch.rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {"name": "a target without NVML", "interval": "1m", "input_series": inputs, "alert_rule_test": checks}
        ],
    }


def run_promtool(metrics: dict, d: Path) -> subprocess.CompletedProcess:
    (d / "vramwatch.rules.yml").write_text(to_yaml(rule_file(DEFAULT)))
    (d / "cpu_only.yaml").write_text(yaml.safe_dump(promtool_case(metrics)))
    return subprocess.run(
        [tool("promtool"), "test", "rules", "cpu_only.yaml"], cwd=d, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("mode", ["real", "library_not_found", "driver_not_loaded", "no_devices"])
def test_a_target_without_nvml_raises_no_alert(exporter, tmp_path, mode):
    if mode == "real":
        exp = exporter(simulate=False)
    else:
        exp = exporter()
        node = exp.node()
        node.nvml_absent = mode
        exp.save_node(node)
    exp.start()

    def settled() -> dict | None:
        m = exp.metrics()
        up = {lab["collector"] for lab, _ in m.get("vramwatch_collector_up", [])}
        return m if m.get("vramwatch_nvml_available") and {"nvml", "xid", "processes"} <= up else None

    m = wait_until(settled, 20, "the server's first NVML reads")
    if m.get("gpu_info"):
        pytest.skip("this machine has NVML")
    reason = "library_not_found" if mode == "real" else mode
    assert m["vramwatch_nvml_available"] == [({"reason": reason}, 0.0)]
    r = run_promtool(m, tmp_path)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_the_check_can_fail(tmp_path):
    """The same case with the NVML collector down: promtool reports the alert that fired."""
    m = {"vramwatch_collector_up": [({"collector": "nvml", "rank": ""}, 0.0)]}
    r = run_promtool(m, tmp_path)
    assert r.returncode != 0 and "VramwatchCollectorDown" in r.stdout + r.stderr
