"""The dashboard's leak projection is held at a multiple of the limit, evaluated by promtool on real series."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import yaml

from harness import tool
from vramwatch.monitoring.config import DEFAULT
from vramwatch.monitoring.dashboards.memory import PROJECTION_CAP, capped_projection
from vramwatch.monitoring.promql import LEAK_PROJECTION_RECORD

CFG = dataclasses.replace(DEFAULT, leak_window="10m", leak_horizon_hours=1.0)


def test_the_projection_is_capped_at_the_limit_multiple_and_uncapped_without_a_limit(tmp_path: Path):
    expr = capped_projection("predict_linear(peak[10m], 3600)", "limit")
    # at 20m over a 10m window, 1 h ahead: a slope of 1/min reaches 20 + 60 = 80, of 10/min 200 + 600 = 800
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": 'peak{rank="0"}', "values": "0+1x30"},
                    {"series": 'peak{rank="1"}', "values": "0+10x30"},
                    {"series": 'peak{rank="2"}', "values": "0+10x30"},
                    {"series": 'limit{rank="0"}', "values": "100x30"},
                    {"series": 'limit{rank="1"}', "values": "100x30"},
                ],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "20m",
                        "exp_samples": [
                            {"labels": '{rank="0"}', "value": 80},  # under the cap: the projection itself
                            {"labels": '{rank="1"}', "value": PROJECTION_CAP * 100},  # held at the cap
                            {"labels": '{rank="2"}', "value": 800},  # no limit series: drawn uncapped
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(tests))
    r = subprocess.run([tool("promtool"), "test", "rules", "t.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_memory_dashboard_draws_the_capped_projection():
    from vramwatch.monitoring.dashboards import memory

    built = memory.build(CFG).build()
    (panel,) = [p for p in built.panels if getattr(p, "title", "") == "Per-step peak and leak projection"]
    (b,) = [t for t in panel.targets if t.ref_id == "B"]
    assert b.expr.startswith(f"({LEAK_PROJECTION_RECORD}{{")  # the leak alert's own projection, recorded
    assert f"< ({PROJECTION_CAP:g} * torch_cuda_memory_limit_bytes" in b.expr
