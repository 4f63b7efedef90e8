"""Alert rules: structure, names from the contract, thresholds only from MonitoringConfig, generated
files in sync, the shipped Alertmanager config, and a runbook section per alert."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import subprocess

import pytest
import yaml

from harness import ROOT, tool
from vramwatch.monitoring import contract, dashboard_ids, promql
from vramwatch.monitoring.alerts import cli
from vramwatch.monitoring.alerts.render import prometheus_rule, rule_file, to_yaml
from vramwatch.monitoring.alerts.rules import alert_names, alerts, anchor, groups
from vramwatch.monitoring.config import DEFAULT, MonitoringConfig, format_duration, parse_duration

DASHBOARD_UIDS = {dashboard_ids.TRAINING_MEMORY_UID, dashboard_ids.GPU_HEALTH_UID, dashboard_ids.FLEET_UID}

ALERTS_DIR = ROOT / "vramwatch" / "monitoring" / "alerts"
ALERTMANAGER = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
SCHEMAS = ROOT / "tests" / "data" / "schemas" / "prometheus-operator"
EVERYTHING = dataclasses.replace(DEFAULT, target_absent_for="15m", dashboard_url="https://grafana.example.com")


# --- structure ---


def test_every_rule_has_severity_summary_description_and_runbook():
    names = [g["name"] for g in groups()]
    assert len(names) == len(set(names))
    for r in alerts(EVERYTHING):
        assert re.fullmatch(r"[A-Z][A-Za-z]+", r["alert"]), r["alert"]
        assert r["labels"]["severity"] in ("critical", "warning")
        ann = r["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url", "dashboard_url"}, r["alert"]
        assert "{{" not in ann["summary"] and ann["summary"].endswith("."), ann["summary"]
        if not r["expr"].startswith("absent("):  # absent() has neither labels nor a value worth showing
            assert "$labels." in ann["description"] or "$value" in ann["description"], r["alert"]
        assert ann["runbook_url"] == DEFAULT.runbook_url.format(anchor=r["alert"].lower())
        uid = re.fullmatch(re.escape(EVERYTHING.dashboard_url) + r"/d/([a-z-]+)\?orgId=1(\{\{.*)", ann["dashboard_url"])
        assert uid and uid.group(1) in DASHBOARD_UIDS, ann["dashboard_url"]
        if "for" in r:
            assert parse_duration(r["for"]) > 0


def test_the_issue_rule_set_is_there():
    by = {(r["alert"], r["labels"]["severity"]): r for r in alerts()}
    # memory: 85% for 5m warns, 95% with a for of at most 1m pages, on both ratios, one name per ratio
    for name in ("GPUMemoryUsageHigh", "TorchMemoryBudgetHigh"):
        warn, crit = by[(name, "warning")], by[(name, "critical")]
        assert "> 0.85" in warn["expr"] and warn["for"] == "5m"
        assert "> 0.95" in crit["expr"] and parse_duration(crit["for"]) <= 60
    recorded = {r["record"]: r["expr"] for g in groups() for r in g["rules"] if "record" in r}
    assert by[("GPUMemoryUsageHigh", "critical")]["expr"].startswith(f"{promql.MEMORY_RATIO_RECORD} > 0.95")
    assert "gpu_memory_used_bytes / gpu_memory_total_bytes" in recorded[promql.MEMORY_RATIO_RECORD]
    assert by[("TorchMemoryBudgetHigh", "critical")]["expr"].startswith(f"{promql.BUDGET_RATIO_RECORD} > 0.95")
    assert recorded[promql.BUDGET_RATIO_RECORD] == "torch_cuda_memory_reserved_bytes / torch_cuda_memory_limit_bytes"
    assert by[("TorchMemoryLeak", "warning")]["expr"].startswith(promql.LEAK_PROJECTION_RECORD)
    assert recorded[promql.LEAK_PROJECTION_RECORD].startswith(
        "predict_linear(torch_cuda_memory_step_peak_allocated_bytes"
    )
    assert {
        ("TrainingStalled", "critical"),
        ("TrainingStalled", "warning"),
        ("GPUXidError", "critical"),
        ("GPUXidError", "warning"),
        ("GPULost", "critical"),
        ("TorchAllocatorRetries", "warning"),
        ("TorchOutOfMemory", "warning"),
        ("TorchMemoryFragmented", "warning"),
        ("GPUForeignProcess", "warning"),
        ("TrainingRankMemorySkew", "warning"),
        ("GPUClockThrottled", "warning"),
        ("VramwatchTargetDown", "warning"),
        ("VramwatchSamplesStale", "warning"),
        ("VramwatchCollectorDown", "warning"),
    } <= set(by)
    # only these page
    assert {a for a, s in by if s == "critical"} == {
        "GPUMemoryUsageHigh",
        "TorchMemoryBudgetHigh",
        "TrainingStalled",
        "GPUXidError",
        "GPURecoveryAction",
        "GPULost",
        "TrainingRankExited",
        "TrainingNodeLost",
        "TrainingLossNonFinite",
    }


def test_warning_critical_pairs_share_a_name_and_the_labels_alertmanager_inhibits_on():
    am = yaml.safe_load(ALERTMANAGER.read_text())
    equal = set(am["inhibit_rules"][0]["equal"])
    assert {"alertname", "uuid"} <= equal
    pairs = {
        a
        for a in alert_names()
        if {r["labels"]["severity"] for r in alerts() if r["alert"] == a} == {"critical", "warning"}
    }
    assert pairs == {"GPUMemoryUsageHigh", "TorchMemoryBudgetHigh", "TrainingStalled", "GPUXidError"}


# --- metric names come from the contract ---

_KEYWORDS = {
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (a small PromQL scanner, enough for our rules)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", e):
        if m.group(2) or m.group(1) in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group(1))
    return names


def test_the_scanner_finds_metric_names():
    expr = (
        'rate(a_total{x="1", y=~"b|c"}[5m]) / on(job, uuid) group_left(name) b_info offset 1h'
        " > 0.5 and ignoring(gpu) sum by (job) (c_bytes)"
    )
    assert metric_names(expr) == {"a_total", "b_info", "c_bytes"}


def test_every_metric_in_every_expr_is_in_the_contract():
    used = set()
    # the rules' own recorded series (vramwatch:...): every record's expression is scanned like an alert's
    recorded = {r["record"] for g in groups(EVERYTHING) for r in g["rules"] if "record" in r}
    assert recorded and all(name.startswith("vramwatch:") for name in recorded)
    records = [r for g in groups(EVERYTHING) for r in g["rules"] if "record" in r]
    for r in [*alerts(EVERYTHING), *records]:
        for name in metric_names(r["expr"]):
            if name in recorded:
                continue
            base = re.sub(r"_(sum|count|bucket)$", "", name) if name not in contract.BY_NAME else name
            what = r.get("alert") or r["record"]
            known = base in contract.BY_NAME or name == "up"
            assert known, f"{what}: {name} is not in the contract"
            used.add(base)
    # the scanner is not vacuous: the families the alerts are built on are all found
    assert {
        "gpu_memory_used_bytes",
        "torch_cuda_memory_limit_bytes",
        "vramwatch_training_step_duration_seconds",
        "gpu_last_xid_timestamp_seconds",
        "gpu_clock_throttle",
        "up",
    } <= used


def test_the_pager_groups_a_jobs_alerts_by_the_rules_job_identity():
    am = yaml.safe_load(ALERTMANAGER.read_text())
    pager = next(r for r in am["route"]["routes"] if r["receiver"] == "pager")
    (job_route,) = pager["routes"]
    assert job_route["matchers"] == ['job_id=~".+"']
    assert job_route["group_by"] == list(DEFAULT.peer_labels)  # no alertname: every page of a job in one group
    causes = next(r for r in am["inhibit_rules"] if "TrainingRankExited" in str(r["source_matchers"]))
    assert causes["equal"] == list(DEFAULT.peer_labels)
    assert 'job_id=~".+"' in causes["source_matchers"]  # a cause of no job mutes no jobless rank


def test_selector_reaches_every_vramwatch_series():
    cfg = dataclasses.replace(DEFAULT, selector='job="train"')
    for r in (r for g in groups(cfg) for r in g["rules"]):  # records too: they read the raw families
        e = re.sub(r"\[[^\]]*\]", "", r["expr"])
        for m in re.finditer(r"(?<![\w.:])((?:torch_cuda|gpu|vramwatch)_[a-z0-9_]+)(\{[^}]*\})?", e):
            assert m.group(2) and 'job="train"' in m.group(2), f"{r.get('alert') or r['record']}: {m.group(0)}"


def test_throttle_reasons_are_the_nvml_collectors_names():
    nvml = pytest.importorskip("vramwatch.server.collectors.nvml")
    names = {name for _, name in nvml.THROTTLE_REASONS}
    assert set(DEFAULT.throttle_reasons) <= names


# --- thresholds only in MonitoringConfig ---

_ALLOWED_NUMBERS = {0, 1, 0.5}  # 0.5: the median in quantile(0.5, ...)
_PRINTF = re.compile(r"%\.\d+f|%d")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:ms|[smhdwy])?(?![\w.])")  # 0.85, 120, 5m


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


# the modules that build expressions and texts (config.py holds the values; cli.py and render.py only
# serialise)
RULE_MODULES = sorted(p for p in ALERTS_DIR.glob("*.py") if p.name not in ("config.py", "cli.py", "render.py"))


@pytest.mark.parametrize("path", RULE_MODULES, ids=lambda p: p.name)
def test_no_threshold_literals_outside_monitoring_config(path):
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or id(node) in docs:
            continue
        v = node.value
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            assert v in _ALLOWED_NUMBERS, f"{path.name}:{node.lineno}: literal {v!r}"
        elif isinstance(v, str):
            for m in _NUMBER.finditer(_PRINTF.sub("", v)):
                assert m.group(0) in {"0", "1", "0.5"}, f"{path.name}:{node.lineno}: {m.group(0)!r} in {v!r}"


def _perturbed(f: dataclasses.Field, v):
    if f.name == "dashboard_url":
        return "https://grafana.example"
    if f.name == "disabled_alerts":
        return ("GPULost",)
    if f.name == "rank_skew_exempt":
        return ('rank="7"',)
    if f.name == "extra_labels":
        return (("team", "ml-infra"),)
    if f.name == "job_labels":
        return ("job", "cluster")
    if f.name == "gpu_peak_flops":
        return (("NVIDIA B200.*", 2.25e15), *v)
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v * 1.37 + 0.01
    if isinstance(v, tuple):
        return v + ((999,) if all(isinstance(x, int) for x in v) else ("x",))
    if f.name.endswith(("_for", "_window")):
        return "7m" if v != "7m" else "8m"
    if f.name == "runbook_url":
        return "https://runbooks.example/{anchor}"
    return 'job="x"'


@pytest.mark.parametrize(
    "field",
    [f for f in dataclasses.fields(MonitoringConfig) if f.name not in ("dashboard_tags", "node_label")],
    ids=lambda f: f.name,
)
def test_every_parameter_changes_the_rules(field):
    """Each knob of MonitoringConfig is one the rules actually read (dashboard_tags, node_label: dashboards
    only)."""
    base = to_yaml(rule_file(EVERYTHING))
    changed = dataclasses.replace(EVERYTHING, **{field.name: _perturbed(field, getattr(EVERYTHING, field.name))})
    assert to_yaml(rule_file(changed)) != base


def test_scaled_config_shrinks_every_time_and_nothing_else():
    fast = DEFAULT.scaled(1 / 60)
    assert fast.memory_warning_for == "5s" and fast.memory_critical_for == "1s" and fast.leak_window == "1m"
    assert fast.stall_min_seconds == pytest.approx(2.0) and fast.sample_stale_seconds == pytest.approx(1.0)
    assert fast.memory_warning_ratio == DEFAULT.memory_warning_ratio and fast.target_absent_for == ""
    by = {(r["alert"], r["labels"]["severity"]): r for r in alerts(fast)}
    assert by[("GPUMemoryUsageHigh", "warning")]["for"] == "5s"
    xids = next(r for g in groups(fast) for r in g["rules"] if r.get("record") == promql.XID_EVENTS_RECORD)
    assert "[15s]" in xids["expr"] and promql.XID_EVENTS_RECORD in by[("GPUXidError", "critical")]["expr"]


@pytest.mark.parametrize("text,seconds", [("5m", 300), ("1h30m", 5400), ("500ms", 0.5), ("1d", 86400), ("90s", 90)])
def test_durations_round_trip(text, seconds):
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize("bad", ["", "5", "5 m", "m5", "1.5h", "5mm"])
def test_bad_durations_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


# --- rendering and the generated files ---


def _run(*argv: str) -> int:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.run(p.parse_args(list(argv)))


def test_generated_files_are_in_sync():
    assert _run("--check", str(ROOT / "deploy")) == 0, "run `vramwatch alerts --write deploy`"
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules" / "vramwatch.rules.yml").read_text())
    assert shipped == rule_file(DEFAULT)


def test_check_fails_on_a_stale_or_missing_file(tmp_path, capsys):
    assert _run("--check", str(tmp_path)) == 1
    assert _run("--write", str(tmp_path)) == 0
    assert _run("--check", str(tmp_path)) == 0
    path = tmp_path / cli.RULES_PATH
    path.write_text(path.read_text().replace("> 0.85", "> 0.86"))
    assert _run("--check", str(tmp_path)) == 1
    assert str(path) in capsys.readouterr().err


def test_cli_prints_a_rule_file_or_a_prometheusrule(capsys):
    assert _run() == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc == rule_file(DEFAULT)
    assert _run("--format", "prometheusrule", "--release", "monitoring", "--namespace", "ml") == 0
    pr = yaml.safe_load(capsys.readouterr().out)
    assert pr["kind"] == "PrometheusRule" and pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["metadata"]["labels"]["release"] == "monitoring" and pr["metadata"]["namespace"] == "ml"
    assert pr["spec"] == rule_file(DEFAULT)
    assert _run("--format", "prometheusrule", "--release", "") == 0
    assert "release" not in yaml.safe_load(capsys.readouterr().out)["metadata"]["labels"]


def test_multiline_expressions_render_as_block_scalars():
    text = to_yaml(rule_file(DEFAULT))
    assert "expr: |-\n" in text and "\\n" not in text


def test_prometheusrule_validates_against_the_operator_crd():
    jsonschema = pytest.importorskip("jsonschema")
    crd_path = SCHEMAS / "monitoring.coreos.com_prometheusrules.yaml"
    if not crd_path.exists():
        pytest.skip("no PrometheusRule CRD schema in tests/data")
    crd = yaml.safe_load(crd_path.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    # not check_schema(): the CRD's Go regexes (e.g. '^(?i)(abort|warn)?$') are no Python regexes
    validator = jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])
    validator.validate(prometheus_rule(DEFAULT))
    validator.validate(yaml.safe_load((ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml").read_text()))
    bad = prometheus_rule(DEFAULT)
    bad["spec"]["groups"][0]["rules"][0]["for"] = 5  # the schema is not vacuous
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(bad)


# --- Alertmanager ---


def _amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("amtool"), *args], capture_output=True, text=True, timeout=60)


def test_amtool_accepts_the_shipped_alertmanager_config():
    r = _amtool("check-config", str(ALERTMANAGER))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "labels,receiver",
    [
        (["severity=critical", "alertname=GPUMemoryUsageHigh"], "pager"),
        (["severity=critical", "alertname=GPUXidError", "xid=79"], "pager"),
        (["severity=warning", "alertname=GPUMemoryUsageHigh"], "warnings"),
        (["alertname=SomethingElse"], "warnings"),
    ],
)
def test_routes(labels, receiver):
    r = _amtool("config", "routes", "test", f"--config.file={ALERTMANAGER}", *labels)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == [receiver]


def test_the_card_alert_mutes_the_budget_alert_of_the_same_severity_only():
    am = yaml.safe_load(ALERTMANAGER.read_text())
    (rule,) = [r for r in am["inhibit_rules"] if r["target_matchers"] == ['alertname="TorchMemoryBudgetHigh"']]
    assert rule["source_matchers"] == ['alertname="GPUMemoryUsageHigh"']
    assert {"severity", "uuid", "instance"} <= set(rule["equal"])


def test_every_severity_of_the_rules_has_a_route():
    am = yaml.safe_load(ALERTMANAGER.read_text())
    routed = {m for route in am["route"]["routes"] for m in route["matchers"]}
    for sev in {r["labels"]["severity"] for r in alerts()}:
        assert f'severity="{sev}"' in routed
    assert set(am["route"]["group_by"]) >= {"job", "uuid"}
    assert all(w["url"].startswith("http://127.0.0.1:") for rc in am["receivers"] for w in rc["webhook_configs"])


# --- runbooks ---


def _github_slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    text = RUNBOOKS.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {_github_slug(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def test_a_runbook_section_for_every_alert():
    sections = runbook_sections()
    for name in alert_names(EVERYTHING):
        body = sections.get(anchor(name))
        assert body is not None, f"docs/runbooks.md has no section ## {name}"
        for part in ("**Meaning.**", "**Confirm.**", "**Act.**"):
            assert part in body, f"## {name} lacks {part}"


def test_runbooks_carry_the_field_notes_remedies():
    text = RUNBOOKS.read_text()
    for remedy in (
        "expandable_segments:True",
        "garbage_collection_threshold:0.8",
        "max_split_size_mb:128",
        "empty_cache()",
        "exclusive",
        "checkpoint",
        "reboot",
    ):
        assert remedy in text, remedy
    for xid in DEFAULT.xid_critical + DEFAULT.xid_warning:
        assert re.search(rf"\|\s*{xid}\s*\|", text), f"Xid {xid} missing from the runbook's Xid table"


def test_the_readme_alerts_snippet_runs_and_its_rules_pass_promtool(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    (snippet,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "README.md#alerts", "exec"), {})
    text = (tmp_path / "vramwatch.rules.yml").read_text()
    assert "> 0.8\n" in text and 'job="train"' in text and "team: ml" in text
    r = subprocess.run(
        [tool("promtool"), "check", "rules", "vramwatch.rules.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
