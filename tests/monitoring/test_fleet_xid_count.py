"""The fleet dashboard's Xid events per host (from the newest event's timestamp), evaluated by promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from harness import tool

pytest.importorskip("grafana_foundation_sdk")

from vramwatch.monitoring.config import DEFAULT
from vramwatch.monitoring.dashboards.common import Scope
from vramwatch.monitoring.dashboards.fleet import xid_events_in_range


def test_events_in_the_range_count_through_a_restart_and_from_a_new_series(tmp_path: Path):
    expr = f"sum by (instance) ({xid_events_in_range(Scope(DEFAULT))})"
    expr = expr.replace("$__range", "1h").replace("${__from:date:seconds}", "1800")  # at 90m, from 30m
    expr = expr.replace('=~"$', '=~"').replace('=~"', '=~".*|')  # every variable at All
    series = 'gpu_last_xid_timestamp_seconds{instance="%s", uuid="GPU-%s", xid="%s"}'
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "10m",
                # samples at 0m, 10m, ..., 90m; the value is the newest event's time in seconds
                "input_series": [
                    {"series": series % ("a", "0", "79"), "values": "_ 300 300 300 2100 2100 2100 2100 2100 2100"},
                    {"series": series % ("a", "1", "79"), "values": "300x9"},  # old events only
                    # the exporter restarted at 50m (series gone), then an event at 58m
                    {"series": series % ("b", "0", "79"), "values": "300 300 300 300 300 _ 3500 3500 3500 3500"},
                    {"series": series % ("c", "0", "31"), "values": "_ _ _ _ _ _ _ 4000 4000 4000"},  # new series
                    {"series": series % ("c", "1", "13"), "values": "_ _ _ _ 2000 2000 2000 5000 5000 5000"},
                ],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "90m",
                        "exp_samples": [
                            {"labels": '{instance="a"}', "value": 1},
                            {"labels": '{instance="b"}', "value": 1},
                            {"labels": '{instance="c"}', "value": 3},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(tests))
    r = subprocess.run([tool("promtool"), "test", "rules", "t.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
