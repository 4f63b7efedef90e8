"""The leak alert says when, not only how much: promtool evaluates its description's query (time to the budget
at the peak's rate over the leak window), on the shipped rule with its other annotations left out."""

from __future__ import annotations

import subprocess

import yaml

from harness import tool
from vramwatch.monitoring.alerts.render import rule_file, to_yaml
from vramwatch.monitoring.config import DEFAULT
from vramwatch.monitoring.promql import LEAK_PROJECTION_RECORD

LABELS = 'instance="n1:9488", job="vramwatch", uuid="GPU-a", device="0", rank="0", local_rank="0"'


def _leak_rule_only() -> dict:
    """The leak alert (its description alone) and the projection it reads, recorded."""
    for group in rule_file(DEFAULT)["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "TorchMemoryLeak":
                rule = dict(rule, annotations={"description": rule["annotations"]["description"]})
                (projection,) = [r for r in group["rules"] if r.get("record") == LEAK_PROJECTION_RECORD]
                return {"groups": [{"name": "leak", "rules": [projection, rule]}]}
    raise AssertionError("no TorchMemoryLeak rule")


def test_the_leak_description_says_when_the_peak_meets_the_budget(tmp_path):
    (tmp_path / "leak.rules.yml").write_text(to_yaml(_leak_rule_only()))
    # +200 MB a minute from 10 GB toward 65 GB: at 90m the peak is 28 GB, 37 GB short: 185 minutes at that rate
    case = {
        "rule_files": ["leak.rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f"torch_cuda_memory_step_peak_allocated_bytes{{{LABELS}}}",
                        "values": "10000000000+200000000x120",
                    },
                    {"series": f"torch_cuda_memory_limit_bytes{{{LABELS}}}", "values": "65000000000x120"},
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "90m",
                        "alertname": "TorchMemoryLeak",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", **dict(_pairs(LABELS))},
                                "exp_annotations": {
                                    "description": (
                                        "rank 0 (local rank 0) on n1:9488, cuda:0 (GPU-a): the per-step high-water "
                                        "mark of allocated bytes is rising; extrapolated over the last 1h it "
                                        "reaches 70.78GiB in 4 hours, beyond the rank's budget "
                                        "(torch_cuda_memory_limit_bytes). At that rate it meets the budget in "
                                        "about 3h 5m 0s."
                                    )
                                },
                            }
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "leak.test.yml").write_text(yaml.safe_dump(case, sort_keys=False))
    r = subprocess.run(
        [tool("promtool"), "test", "rules", "leak.test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _pairs(text: str) -> list[tuple[str, str]]:
    return [(k.strip(), v.strip().strip('"')) for k, v in (p.split("=", 1) for p in text.split(", "))]
