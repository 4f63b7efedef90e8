"""The fleet dashboard's Xid count per host (the counter now less the counter then), evaluated by promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from harness import tool

pytest.importorskip("grafana_foundation_sdk")

from vramwatch.monitoring.config import DEFAULT
from vramwatch.monitoring.dashboards.common import Scope
from vramwatch.monitoring.dashboards.fleet import xid_count_since


def test_events_in_the_range_count_through_a_restart_and_from_a_new_series(tmp_path: Path):
    expr = f"sum by (instance) ({xid_count_since(Scope(DEFAULT), '1h')})"
    expr = expr.replace('=~"$', '=~"').replace('=~"', '=~".*|')  # every variable at All
    series = 'gpu_xid_errors_total{instance="%s", uuid="GPU-%s", xid="%s"}'
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "10m",
                # at 90m, the last hour runs from 30m: samples at 30m, 40m, ..., 90m
                "input_series": [
                    {"series": series % ("a", "0", "79"), "values": "0 0 0 1 1 1 2 2 2 2"},  # +1 in the hour
                    {"series": series % ("a", "1", "79"), "values": "5 5 5 5 5 5 5 5 5 5"},  # old events only
                    {"series": series % ("b", "0", "79"), "values": "4 4 4 4 4 0 1 1 1 1"},  # restart: 1 since
                    {"series": series % ("c", "0", "31"), "values": "_ _ _ _ _ _ _ 1 1 1"},  # appeared at 1
                    {"series": series % ("d", "0", "79"), "values": "0 0 0 0 0 0 0 0 0 0"},
                ],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "90m",
                        "exp_samples": [
                            {"labels": '{instance="a"}', "value": 1},
                            {"labels": '{instance="b"}', "value": 1},
                            {"labels": '{instance="c"}', "value": 1},
                            {"labels": '{instance="d"}', "value": 0},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(tests))
    r = subprocess.run([tool("promtool"), "test", "rules", "t.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
