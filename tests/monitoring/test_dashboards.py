"""The Grafana dashboards: structure, metric names, thresholds from MonitoringConfig, files in sync."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("grafana_foundation_sdk")

from promql_names import in_contract, metric_names

from vramwatch.monitoring import promql
from vramwatch.monitoring.alerts.rules import groups
from vramwatch.monitoring.config import DEFAULT, MonitoringConfig
from vramwatch.monitoring.dashboards import build_all, render
from vramwatch.monitoring.dashboards import cli as dcli
from vramwatch.monitoring.dashboards.walk import (
    TimeContext,
    label_values_query,
    spec,
    substitute,
    variable_names,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# The shape users rely on: dashboard -> row -> [(panel type, title)].
EXPECTED = {
    "vramwatch-training-memory": {
        "Memory": [
            ("timeseries", "Allocated, reserved, card total and limit"),
            ("timeseries", "Memory by role"),
            ("timeseries", "Memory pressure"),
            ("timeseries", "Memory outside PyTorch"),
            ("timeseries", "Fragmentation"),
            ("timeseries", "Largest free block and split leftovers"),
            ("table", "Allocator settings in force"),
            ("timeseries", "Compute- or memory-bound?"),
        ],
        "Allocator events and leaks": [
            ("timeseries", "cudaMalloc retries and OOMs"),
            ("timeseries", "Per-step peak and leak projection"),
        ],
        "Progress": [
            ("timeseries", "Step time"),
            ("timeseries", "Steps per second"),
            ("timeseries", "Tokens per second"),
            ("timeseries", "Energy per token"),
            ("timeseries", "Model FLOPs utilisation"),
            ("timeseries", "Step-time skew by rank"),
            ("timeseries", "Heartbeat age"),
            ("timeseries", "Sample age"),
        ],
    },
    "vramwatch-gpu-health": {
        "Power and utilisation": [
            ("timeseries", "Power against utilisation"),
            ("timeseries", "Temperature"),
            ("timeseries", "Clocks"),
            ("timeseries", "Clock throttle reasons"),
            ("timeseries", "GPU memory utilisation"),
        ],
        "Activity (NVML GPM, Hopper and newer)": [
            ("timeseries", "Compute- or memory-bound?"),
            ("timeseries", "PCIe and NVLink throughput"),
        ],
        "Errors and other processes": [
            ("table", "Xid events"),
            ("timeseries", "ECC errors, remapped rows, PCIe replays, NVLink errors"),
            ("timeseries", "Foreign processes"),
            ("timeseries", "GPU answering"),
            ("table", "GPUs"),
        ],
    },
    "vramwatch-fleet": {
        "Now": [("stat", "GPUs"), ("stat", "Ranks"), ("stat", "Stalled ranks"), ("stat", "Firing alerts")],
        "Memory pressure": [
            ("table", "GPUs by memory pressure"),
            ("timeseries", "Memory pressure, the ten fullest GPUs"),
        ],
        "Progress, errors and alerts": [
            ("table", "Ranks by heartbeat age"),
            ("bargauge", "Xid events by host"),
            ("table", "Firing alerts"),
        ],
    },
}


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    return {m.uid: json.loads(render.dashboard_json(m)) for m in build_all()}


@pytest.fixture(scope="module")
def specs():
    return {m.uid: spec(m) for m in build_all()}


def _panel(d: dict, title: str) -> dict:
    (p,) = [p for p in d["panels"] if p.get("title") == title]
    return p


def _exprs(d: dict) -> list[str]:
    out = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    out += [a["expr"] for a in d["annotations"]["list"] if a.get("expr")]
    out += [label_values_query(v["query"])[0] for v in d["templating"]["list"] if v["type"] == "query"]
    return out


# --- structure ---


def test_rows_and_panels_are_as_designed(dashboards):
    got = {}
    for uid, d in dashboards.items():
        rows: dict[str, list] = {}
        current = None
        for p in d["panels"]:
            if p["type"] == "row":
                current = rows.setdefault(p["title"], [])
            else:
                assert current is not None, f"{uid}: panel {p['title']!r} before the first row"
                current.append((p["type"], p["title"]))
        got[uid] = rows
    assert got == EXPECTED


def test_dashboard_header(dashboards):
    for uid, d in dashboards.items():
        assert d["uid"] == uid and d["title"].startswith("vramwatch / ")
        assert d["schemaVersion"] == 42  # grafana-foundation-sdk 0.0.21: Grafana 12+
        assert d["tags"] == list(DEFAULT.dashboard_tags)
        assert d["editable"] is True and d["time"] == {"from": "now-1h", "to": "now"}
        assert d["graphTooltip"] == 1  # shared crosshair across panels


# variable -> the label it selects on, in order, for the default config
DEFAULT_VARIABLES = {
    "job": "job",
    "namespace": "namespace",
    "batch_kubernetes_io_job_name": "batch_kubernetes_io_job_name",
    "training_kubeflow_org_job_name": "training_kubeflow_org_job_name",
    "job_name": "job_name",
    "job_id": "job_id",
    "node": "node",
    "host": "instance",
    "gpu": "uuid",
    "rank": "rank",
}
# vramwatch's own variables; the others are the target's labels
OWN = ("job_id", "gpu", "rank")
# what each variable's own query leaves out of the ones before it: the GPUs are narrowed to the chosen jobs
# through the hosts (the GPU families have no job_id), the ranks' info has no GPU
NOT_NARROWED_BY = {"gpu": {"job_id"}, "rank": {"gpu"}}


def _check_variables(d: dict, expected: dict[str, str]) -> None:
    vs = d["templating"]["list"]
    assert [v["name"] for v in vs] == ["datasource", *expected], d["uid"]
    assert vs[0]["type"] == "datasource" and vs[0]["query"] == "prometheus"
    for i, v in enumerate(vs[1:], start=1):
        assert v["type"] == "query" and v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert v["multi"] and v["includeAll"]
        if v["name"] == "host":
            # no custom All: Grafana expands it to the hosts offered, the targets of the chosen jobs' ranks
            assert "allValue" not in v, v
        else:
            # ".*" also matches a series without the label: an absent label narrows nothing
            assert v["allValue"] == ".*", v["name"]
        assert v["current"]["value"] == "$__all"
        assert v["refresh"] == 2  # on time range change: new jobs appear
        assert re.fullmatch(r"label_values\(.+, \w+\)", v["query"])
        # narrowed by every variable before it, and by no later one
        earlier = {x["name"] for x in vs[1:i]}
        assert variable_names(v["query"]) == earlier - NOT_NARROWED_BY.get(v["name"], set()), v["name"]
    # node and host: every target's build_info (no job_id, so job_id=~".*" keeps it), or the chosen jobs' ranks
    for v in vs:
        if v["name"] in ("node", "host"):
            assert v["query"].startswith('label_values({__name__=~"vramwatch_build_info|vramwatch_rank_info", ')
    labels = {v["name"]: re.search(r", (\w+)\)$", v["query"]).group(1) for v in vs[1:]}
    assert labels == expected
    # every panel query on a target's series narrows by each target variable, on its label
    for p in d["panels"]:
        for t in p.get("targets", []):
            if "ALERTS" in t["expr"]:
                continue
            for var, label in expected.items():
                if var not in OWN:
                    assert f'{label}=~"${var}"' in t["expr"], (p["title"], var, t["expr"])


def test_variables_chain_datasource_job_labels_node_host_gpu_rank(dashboards):
    for d in dashboards.values():
        _check_variables(d, DEFAULT_VARIABLES)
        assert d["templating"]["list"][1]["label"] == "Scrape job"
        assert {v["name"]: v["label"] for v in d["templating"]["list"]}["batch_kubernetes_io_job_name"] == "Job"


def test_variables_take_their_labels_from_the_config():
    cfg = dataclasses.replace(DEFAULT, job_labels=("job", "kube_namespace", "team"), node_label="kubernetes_node")
    for m in build_all(cfg):
        d = json.loads(render.dashboard_json(m))
        _check_variables(
            d,
            {
                "job": "job",
                "kube_namespace": "kube_namespace",
                "team": "team",
                "job_id": "job_id",
                "node": "kubernetes_node",
                "host": "instance",
                "gpu": "uuid",
                "rank": "rank",
            },
        )
        text = render.dashboard_json(m)
        assert "batch_kubernetes_io_job_name" not in text and 'node=~"' not in text


def test_firing_alerts_keep_alerts_without_the_selected_labels(dashboards):
    fleet = dashboards["vramwatch-fleet"]
    exprs = [t["expr"] for p in fleet["panels"] if p["title"] == "Firing alerts" for t in p["targets"]]
    assert len(exprs) == 2  # the stat and the table
    for firing in exprs:
        for var, label in DEFAULT_VARIABLES.items():  # the job labels and the node
            if var in (*OWN, "host"):
                continue
            assert f'{label}=~"${var}|"' in firing
        assert "instance" not in firing  # alerts aggregated over a job's targets have no instance


def test_links_lead_to_the_other_dashboards_with_time_and_variables(dashboards):
    for uid, d in dashboards.items():
        links = d["links"]
        assert [link["url"] for link in links] == [f"/d/{u}" for u in EXPECTED if u != uid], uid
        for link in links:
            assert link["type"] == "link" and link["includeVars"] is True and link["keepTime"] is True
            target = dashboards[link["url"].removeprefix("/d/")]
            assert target["title"] == f"vramwatch / {link['title']}"
            # carrying the variables works because every dashboard has the same ones
            assert [v["name"] for v in target["templating"]["list"]] == [v["name"] for v in d["templating"]["list"]]


def test_every_panel_and_target_uses_the_datasource_variable(dashboards):
    for d in dashboards.values():
        for p in d["panels"]:
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(set(refs)) == len(refs) and all(refs), p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}"
                if p["type"] == "timeseries":
                    assert t.get("range") is True and not t.get("instant"), p["title"]
                else:
                    assert t["instant"] is True and t["format"] == "table", p["title"]


def test_panel_ids_unique_and_grid_without_overlap(dashboards):
    for uid, d in dashboards.items():
        ids = [p["id"] for p in d["panels"]]
        assert len(set(ids)) == len(ids) and 0 not in ids, uid
        cells = set()
        for p in d["panels"]:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, (uid, p["title"])
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{uid}: {p['title']!r} overlaps another panel"
                    cells.add((x, y))


def test_timeseries_show_a_legend_and_a_unit(dashboards):
    for d in dashboards.values():
        for p in d["panels"]:
            if p["type"] == "timeseries":
                assert p["options"]["legend"]["showLegend"] is True, p["title"]
                assert p["fieldConfig"]["defaults"]["unit"], p["title"]
                assert all(t.get("legendFormat") for t in p["targets"]), p["title"]


def test_json_loads_back_into_the_sdk_model(dashboards):
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    for uid, d in dashboards.items():
        back = Dashboard.from_json(d)
        assert back.uid == uid and len(back.panels) == len(d["panels"])
        assert json.loads(render.dashboard_json(back)) == d


# --- metric names come from the contract ---


def test_metric_name_extraction_finds_names_and_only_names():
    expr = (
        'sum by (job, le) (rate(foo_bucket{a=~"$x|b", c="d"}[$__rate_interval])) / on (job) group_left (gpu)'
        ' bar_total{x="y"} > 0.35 * time() - ${__from:date:seconds} or vector(0) and baz'
    )
    assert metric_names(expr) == {"foo_bucket", "bar_total", "baz"}
    assert not in_contract("torch_cuda_memory_allocated") and not in_contract("gpu_info_bucket")
    assert in_contract("vramwatch_training_step_duration_seconds_bucket")


def test_every_metric_in_every_query_is_in_the_contract(dashboards):
    used = set()
    for uid, d in dashboards.items():
        for expr in _exprs(d):
            names = metric_names(expr)
            assert names, f"{uid}: no metric in {expr!r}"
            bad = {n for n in names if not in_contract(n)}
            assert not bad, f"{uid}: {sorted(bad)} not in vramwatch.monitoring.contract, in {expr!r}"
            used |= names
    # a recorded series shows the families its rule reads
    recorded = {r["record"]: r["expr"] for g in groups() for r in g["rules"] if "record" in r}
    used |= {n for name in used & recorded.keys() for n in metric_names(recorded[name])}
    # the families the dashboards must show
    for name in (
        "torch_cuda_memory_allocated_bytes",
        "torch_cuda_memory_reserved_bytes",
        "gpu_memory_total_bytes",
        "torch_cuda_memory_limit_bytes",
        "gpu_non_torch_memory_bytes",
        "torch_cuda_memory_fragmentation_ratio",
        "torch_cuda_memory_largest_free_block_bytes",
        "torch_cuda_memory_alloc_retries_total",
        "torch_cuda_memory_ooms_total",
        "torch_cuda_memory_step_peak_allocated_bytes",
        "torch_cuda_allocator_info",
        "vramwatch_training_step_duration_seconds_bucket",
        "vramwatch_training_last_step_timestamp_seconds",
        "vramwatch_sample_age_seconds",
        "gpu_power_watts",
        "gpu_utilization_ratio",
        "gpu_temperature_celsius",
        "gpu_sm_clock_hertz",
        "gpu_clock_throttle",
        "gpu_xid_errors_total",
        "gpu_last_xid_timestamp_seconds",
        "gpu_ecc_errors_total",
        "gpu_remapped_rows",
        "gpu_pcie_replays_total",
        "gpu_foreign_processes",
        "ALERTS",
    ):
        assert name in used, name


def test_every_template_variable_is_defined(specs):
    tc = TimeContext(0, 3600, 15)
    for s in specs.values():
        values = {v.name: ".*" for v in s.variables}
        for p in s.panels:
            for t in p.targets:
                out = substitute(t.expr, values, tc)
                assert "$" not in out, out
        for a in s.annotations:
            substitute(a.expr, values, tc)
    with pytest.raises(KeyError, match=r"\$nope"):
        substitute('up{x=~"$nope"}', {}, tc)


# --- thresholds come from MonitoringConfig ---


def _steps(p: dict) -> list[float]:
    return [s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"] if s["value"] is not None]


def _check_thresholds(cfg: MonitoringConfig) -> None:
    ds = {m.uid: json.loads(render.dashboard_json(m)) for m in build_all(cfg)}
    mem, health, fleet = ds["vramwatch-training-memory"], ds["vramwatch-gpu-health"], ds["vramwatch-fleet"]
    ratios = [cfg.memory_warning_ratio, cfg.memory_critical_ratio]
    assert _steps(_panel(mem, "Memory pressure")) == ratios
    assert _steps(_panel(fleet, "GPUs by memory pressure")) == ratios
    assert _steps(_panel(fleet, "Memory pressure, the ten fullest GPUs")) == ratios
    assert _steps(_panel(mem, "Fragmentation")) == [cfg.fragmentation_ratio]
    assert _steps(_panel(mem, "Sample age")) == [cfg.sample_stale_seconds]
    # only the heartbeat column turns red (the stall bound itself is always at least the minimum)
    (hb,) = _panel(fleet, "Ranks by heartbeat age")["fieldConfig"]["overrides"][-1:]
    assert hb["matcher"] == {"id": "byName", "options": "heartbeat age"}
    hb_props = {p["id"]: p["value"] for p in hb["properties"]}
    assert [s["value"] for s in hb_props["thresholds"]["steps"]] == [None, cfg.stall_min_seconds]
    assert hb_props["custom.cellOptions"]["type"] == "color-background"
    for p in (_panel(mem, "Memory pressure"), _panel(mem, "Fragmentation")):
        assert p["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "dashed"
    # the stall signature: power (left) with the stall level, utilisation (right) with its line
    power = _panel(health, "Power against utilisation")
    exprs = {t["refId"]: t["expr"] for t in power["targets"]}
    assert exprs["A"].startswith("gpu_power_watts{") and exprs["C"].startswith("gpu_utilization_ratio{")
    assert exprs["B"].startswith(f"{cfg.busy_power_ratio!r} * gpu_power_limit_watts{{")
    (right,) = [o for o in power["fieldConfig"]["overrides"] if o["matcher"]["options"] == "C"]
    props = {p["id"]: p["value"] for p in right["properties"]}
    assert props["custom.axisPlacement"] == "right" and props["unit"] == "percentunit"
    assert [s["value"] for s in props["thresholds"]["steps"] if s["value"] is not None] == [cfg.busy_utilization_ratio]
    # the leak projection is the leak alert's own (recorded): as far ahead, over the alert's window
    leak = {t["refId"]: t["expr"] for t in _panel(mem, "Per-step peak and leak projection")["targets"]}
    horizon = cfg.leak_horizon_hours * 3600
    assert leak["B"].startswith(f"({promql.LEAK_PROJECTION_RECORD}{{")
    recorded = {r["record"]: r["expr"] for g in groups(cfg) for r in g["rules"] if "record" in r}
    assert recorded[promql.LEAK_PROJECTION_RECORD].endswith(
        f"[{cfg.leak_window}], {int(horizon) if horizon.is_integer() else horizon!r})"
    )
    # the stall bound uses the alert's factor, window (its recorded mean) and minimum
    bound = {t["refId"]: t["expr"] for t in _panel(mem, "Heartbeat age")["targets"]}["B"]
    assert bound.startswith(f"clamp_min({cfg.stall_factor:g} * {promql.STALL_MEAN_RECORD}{{")
    assert f"[{cfg.stall_window}]" in recorded[promql.STALL_MEAN_RECORD]
    assert bound.endswith(f"}}, {cfg.stall_min_seconds:g})")
    # the step-time p99: the chosen ranks' histograms summed per job, at the panel's own rate interval and
    # at most 360 points (no rule records quantiles for every rank of the fleet)
    panel = _panel(mem, "Step time")
    step = {t["refId"]: t["expr"] for t in panel["targets"]}
    peers = ", ".join(cfg.peer_labels)
    assert step["B"].startswith(
        f"histogram_quantile(0.99, sum by ({peers}, le) (rate(vramwatch_training_step_duration_seconds_bucket{{"
    )
    assert step["B"].endswith("[$__rate_interval])))") and panel["maxDataPoints"] == 360
    assert not any("quantile" in name for name in recorded)


def test_thresholds_are_the_monitoring_config_values():
    _check_thresholds(DEFAULT)


def test_thresholds_follow_a_changed_config():
    cfg = dataclasses.replace(
        DEFAULT,
        memory_warning_ratio=0.71,
        memory_critical_ratio=0.83,
        fragmentation_ratio=0.41,
        sample_stale_seconds=33.0,
        stall_min_seconds=77.0,
        stall_factor=6.5,
        busy_utilization_ratio=0.77,
        busy_power_ratio=0.22,
        leak_horizon_hours=2.5,
        leak_window="45m",
        stall_window="20m",
        selector='cluster="a"',
        dashboard_tags=("x",),
    )
    _check_thresholds(cfg)
    text = "".join(render.dashboard_json(m) for m in build_all(cfg))
    for old in ("0.85", "0.95", "0.35", "14400"):
        assert old not in text, f"{old} is retyped somewhere instead of read from MonitoringConfig"
    # the selector narrows every query
    for m in build_all(cfg):
        for expr in _exprs(json.loads(render.dashboard_json(m))):
            if "ALERTS" not in expr:
                assert 'cluster="a"' in expr, expr


# --- generated files ---


def test_generated_files_are_in_sync():
    assert render.stale(DEPLOY) == [], "run: python -m vramwatch dashboards --write deploy"


def test_configmap_holds_every_dashboard_for_the_sidecar():
    text = (DEPLOY / "kubernetes" / "dashboards-configmap.yaml").read_text()
    cm = yaml.safe_load(text)
    assert cm["apiVersion"] == "v1" and cm["kind"] == "ConfigMap"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted((DEPLOY / "grafana" / "dashboards").glob("vramwatch-*.json"))
    assert sorted(cm["data"]) == [f.name for f in files] == sorted(f"{uid}.json" for uid in EXPECTED)
    for f in files:
        assert json.loads(cm["data"][f.name]) == json.loads(f.read_text())
    # kubectl apply keeps a copy in an annotation, limited to 256 KiB
    assert len(text.encode()) < 250_000


def test_cli_check_fails_on_stale_files_and_write_fixes_them(tmp_path, capsys):
    parser = __import__("argparse").ArgumentParser()
    dcli.add_arguments(parser)
    assert dcli.run(parser.parse_args(["--check", str(tmp_path)])) == 1
    assert dcli.run(parser.parse_args(["--write", str(tmp_path)])) == 0
    assert dcli.run(parser.parse_args(["--check", str(tmp_path)])) == 0
    p = tmp_path / "grafana" / "dashboards" / "vramwatch-fleet.json"
    p.write_text(p.read_text().replace("Fleet overview", "Fleet"))
    (tmp_path / "grafana" / "dashboards" / "vramwatch-old.json").write_text("{}")
    capsys.readouterr()
    assert dcli.run(parser.parse_args(["--check", str(tmp_path)])) == 1
    err = capsys.readouterr().err
    assert "vramwatch-fleet.json" in err and "vramwatch-old.json (no longer generated)" in err
    assert dcli.run(parser.parse_args(["--uid", "vramwatch-fleet"])) == 0
    assert json.loads(capsys.readouterr().out)["uid"] == "vramwatch-fleet"


def test_runtime_does_not_need_the_sdk_or_matplotlib():
    # every command line builds the plugin parsers (vramwatch serve's too): they must stay light
    code = (
        "import sys, vramwatch, vramwatch.rank.handle, vramwatch.server.main, vramwatch.server.registry\n"
        "from vramwatch.cli import build_parser\n"
        "build_parser().parse_args(['serve'])\n"
        "bad = [m for m in ('grafana_foundation_sdk', 'matplotlib') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
