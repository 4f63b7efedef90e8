"""The monitoring config file: the example lists every key and loads to the defaults, bad keys and values
exit 2 naming them, the YAML is read bounded, and the documented commands (docs/monitoring-config.md,
the kustomize overlay of deploy/kubernetes/README.md) render what the file says."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness import ROOT, tool
from vramwatch.errors import ConfigError
from vramwatch.monitoring import config_file
from vramwatch.monitoring.alerts.render import rule_file
from vramwatch.monitoring.alerts.rules import alert_names, alerts
from vramwatch.monitoring.config import DEFAULT, MonitoringConfig
from vramwatch.yaml_bounded import MAX_YAML_BYTES

EXAMPLE = ROOT / "deploy" / "monitoring.example.yaml"
DOC = ROOT / "docs" / "monitoring-config.md"
K8S_README = ROOT / "deploy" / "kubernetes" / "README.md"
FIELDS = [f.name for f in dataclasses.fields(MonitoringConfig)]


def _vramwatch(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "vramwatch", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _load_text(tmp_path: Path, text: str) -> MonitoringConfig:
    path = tmp_path / "monitoring.yaml"
    path.write_text(text)
    return config_file.load(str(path))


# --- the example file ---


def test_the_example_lists_every_key_in_order_and_loads_to_the_defaults():
    keys = re.findall(r"^([a-z_]+):", EXAMPLE.read_text(), flags=re.M)
    assert keys == FIELDS
    assert config_file.load(str(EXAMPLE)) == DEFAULT
    assert EXAMPLE.read_text() == config_file.example_yaml(), "run `vramwatch alerts --write deploy`"


def test_every_key_is_documented_and_checked_where_it_has_a_range():
    for f in dataclasses.fields(MonitoringConfig):
        assert f.metadata.get("doc"), f.name
    unchecked = {f.name for f in dataclasses.fields(MonitoringConfig) if f.metadata.get("check") is None}
    assert unchecked == {"job_gpus_only", "dashboard_tags"}  # a bool, free tags


def test_a_changed_example_round_trips(tmp_path):
    cfg = dataclasses.replace(
        DEFAULT,
        memory_warning_ratio=0.8,
        extra_labels=(("team", "ml-infra"), ("tier", "1")),
        disabled_alerts=("GPUClockThrottled",),
        dashboard_url="",
        rank_skew_min_bytes=float(3 << 30),
    )
    assert _load_text(tmp_path, config_file.example_yaml(cfg)) == cfg


# --- what a file changes ---


def test_the_documented_example_renders_what_it_says(tmp_path):
    block = re.search(r"<!-- config example[^\n]*-->\n```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/monitoring-config.md lost its example"
    cfg = _load_text(tmp_path, block.group(1))
    by = {(r["alert"], r["labels"]["severity"]): r for r in alerts(cfg)}
    warn = by[("GPUMemoryUsageHigh", "warning")]
    assert "> 0.8\n" in warn["expr"] and warn["for"] == "10m" and 'namespace="ml"' in warn["expr"]
    assert warn["labels"]["team"] == "ml-infra"
    assert warn["annotations"]["runbook_url"] == "https://wiki.example.com/gpu/GPUMemoryUsageHigh"
    assert warn["annotations"]["dashboard_url"].startswith("https://grafana.example.com/d/vramwatch-training-memory?")
    assert "GPUClockThrottled" not in alert_names(cfg) and "GPULost" in alert_names(cfg)
    assert 'rank=~"0|15"' in by[("TrainingRankMemorySkew", "warning")]["expr"]
    (tmp_path / "r.yml").write_text(yaml.safe_dump(rule_file(cfg)))
    r = subprocess.run([tool("promtool"), "check", "rules", "r.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_dashboard_url_no_annotation(tmp_path):
    cfg = _load_text(tmp_path, "dashboard_url: ''\n")
    assert all("dashboard_url" not in r["annotations"] for r in alerts(cfg))


def test_alerts_and_dashboards_render_from_the_file(tmp_path):
    (tmp_path / "m.yaml").write_text("memory_warning_ratio: 0.77\nselector: 'job=\"train\"'\n")
    r = _vramwatch("alerts", "--config", "m.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "> 0.77\n" in r.stdout and 'job="train"' in r.stdout
    # --selector on top of the file
    r = _vramwatch("alerts", "--config", "m.yaml", "--selector", 'job="other"', cwd=tmp_path)
    assert r.returncode == 0 and 'job="other"' in r.stdout and 'job="train"' not in r.stdout
    pytest.importorskip("grafana_foundation_sdk")
    r = _vramwatch("dashboards", "--config", "m.yaml", "--write", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    memory = (tmp_path / "out" / "grafana" / "dashboards" / "vramwatch-training-memory.json").read_text()
    assert "0.77" in memory and 'job=\\"train\\"' in memory
    assert _vramwatch("dashboards", "--config", "m.yaml", "--check", "out", cwd=tmp_path).returncode == 0
    assert _vramwatch("dashboards", "--check", "out", cwd=tmp_path).returncode == 1  # the defaults differ


# --- what is refused ---

BAD = [
    ("memory_warn_ratio: 0.8\n", "unknown monitoring setting 'memory_warn_ratio'", "did you mean memory_warning_ratio"),
    ("memory_warning_ratio: high\n", "memory_warning_ratio='high'", "must be a number"),
    ("memory_warning_ratio: true\n", "memory_warning_ratio=True", "must be a number"),
    ("memory_critical_ratio: 1.5\n", "memory_critical_ratio=1.5", "ratio above 0 and at most 1"),
    ("busy_power_ratio: 0\n", "busy_power_ratio=0.0", "ratio above 0"),
    ("memory_warning_ratio: 0.97\n", "memory_warning_ratio=0.97", "must be below memory_critical_ratio (0.95)"),
    ("stall_for: 2 minutes\n", "stall_for='2 minutes'", "not a Prometheus duration"),
    ("stall_for: 5\n", "stall_for=5", "quote it"),
    ("stall_window: 0s\n", "stall_window='0s'", "above 0"),
    ("disabled_alerts: [GPUMemoryHigh]\n", "disabled_alerts=('GPUMemoryHigh',)", "no alert named GPUMemoryHigh"),
    ("disabled_alerts: GPULost\n", "disabled_alerts='GPULost'", "must be a list"),
    ("selector: 'job=\"x\"}'\n", "selector='job=\"x\"}'", "PromQL label matchers"),
    ("rank_skew_exempt: ['']\n", "rank_skew_exempt=('',)", "empty matcher set"),
    ("rank_skew_ratio: 0.9\n", "rank_skew_ratio=0.9", "above 1"),
    ("rank_skew_min_bytes: -1\n", "rank_skew_min_bytes=-1.0", "0 or more"),
    ("extra_labels: {severity: page}\n", "extra_labels=(('severity', 'page'),)", "must not set severity"),
    ("extra_labels: {team-name: x}\n", "extra_labels=", "'team-name' is not a Prometheus label name"),
    ("extra_labels: [team]\n", "extra_labels=['team']", "must be a mapping"),
    ("job_labels: [job, __name__]\n", "job_labels=", "'__name__' is not a Prometheus label name"),
    ("runbook_url: 'ftp://wiki/x'\n", "runbook_url='ftp://wiki/x'", "http:// or https://"),
    ("runbook_url: 'https://wiki/{name}'\n", "runbook_url='https://wiki/{name}'", "unknown placeholder(s) name"),
    ("dashboard_url: 'https://grafana/'\n", "dashboard_url='https://grafana/'", "must not end with /"),
    ("job_gpus_only: 1\n", "job_gpus_only=1", "true or false"),
    ("xid_critical: [79, x]\n", "xid_critical=[79, 'x']", "whole numbers"),
    ("xid_warning: [13, 79]\n", "xid_warning=(13, 79)", "Xid 79 also in xid_critical"),
    ("throttle_reasons: [HW Slowdown]\n", "throttle_reasons=", "not a throttle reason name"),
    ("gpu_peak_flops: [{a: 1, b: 2}]\n", "gpu_peak_flops=", "list of one-entry mappings"),
    ("gpu_peak_flops: [[a, 1]]\n", "gpu_peak_flops=", "list of one-entry mappings"),
    ("gpu_peak_flops: {a: x}\n", "gpu_peak_flops=", "regexes to FLOP/s"),
    ("- memory_warning_ratio\n", "monitoring.yaml: must hold a mapping", ""),
]


def test_gpu_peak_flops_as_the_charts_list_is_the_mapping_in_order(tmp_path):
    """The Helm chart's form (a list of one-entry mappings) loads to the same config as the mapping."""
    listed = _load_text(tmp_path, "gpu_peak_flops: [{'NVIDIA L4.*': 121.0e+12}, {'NVIDIA A.*': 312.0e+12}]\n")
    mapped = _load_text(tmp_path, "gpu_peak_flops: {'NVIDIA L4.*': 121.0e+12, 'NVIDIA A.*': 312.0e+12}\n")
    assert listed == mapped
    assert listed.gpu_peak_flops == (("NVIDIA L4.*", 121e12), ("NVIDIA A.*", 312e12))


@pytest.mark.parametrize("text,names,why", BAD, ids=[b[0].split(":")[0].strip("- \n") for b in BAD])
def test_a_bad_key_or_value_is_named(tmp_path, text, names, why):
    with pytest.raises(ConfigError) as e:
        _load_text(tmp_path, text)
    msg = str(e.value)
    assert names in msg and why in msg and "monitoring.yaml" in msg, msg


@pytest.mark.parametrize("command", ["alerts", "dashboards"])
def test_the_clis_exit_2_naming_the_key(tmp_path, command):
    (tmp_path / "m.yaml").write_text("memory_warning_ratio: 0.97\n")
    r = _vramwatch(command, "--config", "m.yaml", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"vramwatch {command}: invalid monitoring setting memory_warning_ratio=0.97 (from m.yaml)" in r.stderr
    assert not r.stdout
    r = _vramwatch(command, "--config", "missing.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "missing.yaml" in r.stderr


# an alias bomb of about 300 bytes: nine levels of nine aliases, 9^9 strings once expanded
BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


@pytest.mark.parametrize(
    "text,why",
    [
        (BOMB, "YAML aliases (*name) are not allowed (line 2)"),
        ("selector: &s 'job=\"x\"'\ntarget_selector: *s\n", "aliases"),
        ("extra_labels: " + "[" * 200 + "]" * 200 + "\n", "nested deeper than 32 levels"),
        ("selector: 'x\n", "not YAML"),
        ("selector: !!python/object:os.system x\n", "not YAML"),
        ("a: 1\n---\nb: 2\n", "not YAML"),
        ("x" * (MAX_YAML_BYTES + 1), f"larger than {MAX_YAML_BYTES} bytes"),
    ],
    ids=["alias-bomb", "alias", "deep", "unclosed", "python-tag", "two-documents", "too-large"],
)
def test_the_yaml_is_read_bounded(tmp_path, text, why):
    path = tmp_path / "monitoring.yaml"
    path.write_text(text)
    started = time.monotonic()
    with pytest.raises(ConfigError) as e:
        config_file.load(str(path))
    assert time.monotonic() - started < 2.0  # refused before anything is expanded
    assert why in str(e.value) and str(path) in str(e.value), str(e.value)


def test_not_utf8_is_refused(tmp_path):
    path = tmp_path / "monitoring.yaml"
    path.write_bytes(b"selector: '\xff'\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        config_file.load(str(path))


def test_an_empty_file_is_the_defaults(tmp_path):
    assert _load_text(tmp_path, "") == DEFAULT
    assert _load_text(tmp_path, "# nothing changed\n") == DEFAULT


# --- the kustomize overlay of deploy/kubernetes/README.md ---


def test_the_documented_overlay_renders_the_configs_rules_and_dashboards(tmp_path):
    pytest.importorskip("grafana_foundation_sdk")
    text = K8S_README.read_text()
    block = re.search(r"<!-- config overlay[^\n]*-->\n```sh\n(.*?)```", text, re.S)
    assert block, "deploy/kubernetes/README.md lost its config overlay commands"
    patches = re.search(r"```yaml\n(patches:\n.*?)```", text[block.end() :], re.S)
    assert patches
    (tmp_path / "vramwatch").symlink_to(ROOT)
    overlay = tmp_path / "my-gpu-monitoring"
    overlay.mkdir()
    cwd = tmp_path
    for line in block.group(1).splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[0] == "cd":
            cwd = cwd / argv[1]
        elif argv[0] == "cp":
            (cwd / argv[2]).write_text((cwd / argv[1]).read_text())
            # "then keep only the keys you change": one change, to see it arrive
            (cwd / argv[2]).write_text("memory_warning_ratio: 0.81\nextra_labels: {team: ml-infra}\n")
        else:
            assert argv[0] == "vramwatch", line
            out = argv.index(">") if ">" in argv else None
            r = _vramwatch(*argv[1:out], cwd=cwd)
            assert r.returncode == 0, f"{line}: {r.stderr}"
            if out is not None:
                (cwd / argv[out + 1]).write_text(r.stdout)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../vramwatch/deploy/kubernetes\n" + patches.group(1)
    )
    r = subprocess.run([tool("kubectl"), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    objs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(r.stdout) if o}
    rule = objs[("PrometheusRule", "vramwatch")]
    assert rule["metadata"]["namespace"] == "training"  # still the base's, patched in place
    cfg = dataclasses.replace(DEFAULT, memory_warning_ratio=0.81, extra_labels=(("team", "ml-infra"),))
    assert rule["spec"] == rule_file(cfg)
    board = objs[("ConfigMap", "vramwatch-dashboards")]["data"]["vramwatch-training-memory.json"]
    assert '"value": 0.81' in board
