"""deploy/helm/vramwatch: `helm lint`, and `helm template` in its variants against the Kubernetes and
Prometheus Operator schemas (strict, as for the kustomize base); the rules it renders equal the Python
rules for the same thresholds (defaults and others), the objects equal the kustomize base's, and the
generated parts are covered by `vramwatch alerts --check`. helm comes from `make tools`."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import DEPLOY, K8S, operator_validators, run, validate_object, yaml_docs

from harness import ROOT, tool
from vramwatch import _version
from vramwatch.monitoring import helm
from vramwatch.monitoring.alerts.render import rule_file
from vramwatch.monitoring.config import DEFAULT, GIB, MonitoringConfig

CHART = DEPLOY / "helm" / "vramwatch"


def template(*args: str, chart: Path = CHART) -> subprocess.CompletedProcess:
    return run(tool("helm"), "template", "vw", str(chart), "--namespace", "training", *args)


def objects(*args: str) -> list[dict]:
    r = template(*args)
    assert r.returncode == 0, r.stderr
    return yaml_docs(r.stdout)


def kinds(objs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


VARIANTS = {
    "defaults": (),
    "example in-process": ("--set", "example.enabled=true", "--set", "example.mode=in-process"),
    "example sidecar": ("--set", "example.enabled=true"),
    "servicemonitor": ("--set", "serviceMonitor.enabled=true", "--set", "podMonitor.enabled=false"),
    "labels": ("--set", "release=prometheus", "--set", "commonLabels.team=ml", "--set", "dashboards.namespace=grafana"),
}


@pytest.fixture(scope="module")
def crd_validators():
    return operator_validators()


def test_helm_lint_strict():
    r = run(tool("helm"), "lint", "--strict", str(CHART))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_object_validates(variant, crd_validators):
    objs = objects(*VARIANTS[variant])
    assert objs
    for obj in objs:
        try:
            validate_object(obj, crd_validators)
        except Exception as e:
            raise AssertionError(f"{variant}: {obj['kind']}/{obj['metadata']['name']}: {e}") from e


def test_the_defaults_render_the_monitoring_objects():
    k = kinds(objects())
    assert sorted(k) == ["ConfigMap", "NetworkPolicy", "PodMonitor", "PrometheusRule"]
    assert {o["metadata"]["namespace"] for objs in k.values() for o in objs} == {"training"}
    for kind in ("PodMonitor", "PrometheusRule"):  # what kube-prometheus-stack selects by
        assert k[kind][0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert "release" not in k["NetworkPolicy"][0]["metadata"]["labels"]


def test_labels_and_namespace_come_from_values():
    k = kinds(objects(*VARIANTS["labels"]))
    for kind in ("PodMonitor", "PrometheusRule"):
        assert k[kind][0]["metadata"]["labels"]["release"] == "prometheus"
    assert all(o["metadata"]["labels"]["team"] == "ml" for objs in k.values() for o in objs)
    (cm,) = k["ConfigMap"]
    assert cm["metadata"]["namespace"] == "grafana" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_the_rules_are_the_python_rules_with_the_defaults():
    (rule,) = kinds(objects())["PrometheusRule"]
    assert rule["spec"] == rule_file(DEFAULT)
    assert rule["spec"] == yaml_docs(K8S / "prometheusrule.yaml")[0]["spec"]


def other_config() -> dict[str, Any]:
    """A valid non-default value for every key the rules use (the dashboards-only keys apart)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(DEFAULT):
        v = getattr(DEFAULT, f.name)
        if isinstance(v, bool):
            out[f.name] = not v
        elif isinstance(v, float):
            out[f.name] = float(8 * GIB) if f.name == "rank_skew_min_bytes" else round(v * 0.9 + 0.0125, 4)
        elif f.name.endswith(("_for", "_window")):
            out[f.name] = "7m" if v != "7m" else "9m"
    out.update(
        selector='namespace="ml"',  # quotes: also inside the hang alert's Go string
        target_selector='job="train-vw"',
        xid_critical=(48, 79),
        xid_warning=(13, 31),
        runbook_url="https://wiki.example.com/gpu/{alertname}#{anchor}",
        dashboard_url="https://grafana.example.com",
        extra_labels=(("team", "ml-infra"), ("tier", "gold")),
        disabled_alerts=("GPUClockThrottled",),
        job_labels=("job", "namespace"),
        throttle_reasons=("hw_slowdown",),
        rank_skew_exempt=('rank="0"', 'job="pp", rank=~"0|15"'),
    )
    for key in helm.DASHBOARD_ONLY:
        out.pop(key, None)
    return out


# the other side of the keys that change the rules' shape
SHAPES = {
    "dashboard_url": "",  # no dashboard link annotation
    "rank_skew_exempt": (),  # no `unless`
    "disabled_alerts": ("GPUForeignProcess", "TrainingRankMemorySkew"),  # a whole group goes
    "target_absent_for": "",  # the opt-in rule goes
}


def helm_values(changes: dict[str, Any]) -> dict[str, Any]:
    return {"monitoring": {helm.value_key(k): helm._plain(k, v) for k, v in changes.items()}}


@functools.cache
def _rendered(values_yaml: str) -> tuple[dict, ...]:
    """`helm template -f` of these values, once per distinct values: the rules and the dashboards tests of a
    key ask for the same rendering (helm's output depends only on the chart and the values), and a helm run
    is ~0.2 s of CPU."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "values.yaml"
        path.write_text(values_yaml)
        return tuple(objects("-f", str(path)))


def through_helm(changes: dict[str, Any]) -> dict[str, list[dict]]:
    """The chart's objects, by kind, with these monitoring keys changed (a copy: tests may change it)."""
    return kinds(copy.deepcopy(list(_rendered(yaml.safe_dump(helm_values(changes))))))


def rules_through_helm(changes: dict[str, Any], crd_validators=None) -> dict:
    (rule,) = through_helm(changes)["PrometheusRule"]
    if crd_validators is not None:
        validate_object(rule, crd_validators)
    return rule["spec"]


def test_every_monitoring_config_key_is_a_chart_value():
    """values.yaml and its schema hold every MonitoringConfig key (a new key fails here until the chart has it)."""
    keys = {helm.value_key(f.name) for f in dataclasses.fields(MonitoringConfig)}
    values = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["monitoring"]
    assert set(values) == keys
    assert set(schema["properties"]) == keys and set(schema["required"]) == keys
    other = other_config()
    assert set(other) | set(helm.DASHBOARD_ONLY) == {f.name for f in dataclasses.fields(MonitoringConfig)}
    for key, v in other.items():  # every value the tests below set is a real change
        assert v != getattr(DEFAULT, key), key


@pytest.mark.parametrize("key", sorted(set(other_config()) | set(SHAPES)))
def test_each_key_set_through_helm_reaches_the_rules(key, crd_validators):
    """One key at a time, with the other value of it: helm template == the Python rules of that config."""
    value = SHAPES[key] if key in SHAPES and key not in other_config() else other_config()[key]
    spec = rules_through_helm({key: value}, crd_validators)
    cfg = dataclasses.replace(DEFAULT, **{key: value})
    assert spec == rule_file(cfg)
    assert spec != rule_file(DEFAULT), f"{key}: the value changed nothing"


# durations as a user may write them: the rules normalise them (90s is for: 1m30s), a `for` of 0 or none
# leaves the rule without one
DURATION_CASES = [
    ("memory_warning_for", "90s"),
    ("memory_warning_for", ""),
    ("memory_critical_for", "0s"),
    ("stall_window", "1h30m"),
    ("xid_window", "120m"),
    ("target_absent_for", "90s"),
]


@pytest.mark.parametrize(("key", "value"), DURATION_CASES)
def test_durations_through_helm_are_normalised_as_the_python_rules(key, value):
    spec = rules_through_helm({key: value})
    assert spec == rule_file(dataclasses.replace(DEFAULT, **{key: value}))


@pytest.mark.parametrize("shape", ["every key", "the other shapes"])
def test_every_key_at_once_through_helm(shape, tmp_path, crd_validators):
    """All keys changed together (the rules' shapes both ways); promtool accepts the result."""
    changes = other_config()
    if shape == "the other shapes":
        changes.update(SHAPES, selector="", job_gpus_only=True)
    spec = rules_through_helm(changes, crd_validators)
    assert spec == rule_file(dataclasses.replace(DEFAULT, **changes))
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(spec))
    r = run(tool("promtool"), "check", "rules", str(tmp_path / "rules.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_helm_set_on_the_command_line_reaches_the_rule():
    """`helm template --set` / `--set-json`, as a user types them (--set reads 0.8 as a string: --set-json)."""
    (rule,) = kinds(
        objects(
            "--set",
            "monitoring.memoryWarningFor=10m",
            "--set-json",
            "monitoring.memoryWarningRatio=0.8",
            "--set-json",
            'monitoring.selector="namespace=\\"ml\\""',
            "--set-json",
            'monitoring.disabledAlerts=["GPUClockThrottled"]',
            "--set",
            "monitoring.extraLabels.team=ml-infra",
        )
    )["PrometheusRule"]
    cfg = dataclasses.replace(
        DEFAULT,
        memory_warning_for="10m",
        memory_warning_ratio=0.8,
        selector='namespace="ml"',
        disabled_alerts=("GPUClockThrottled",),
        extra_labels=(("team", "ml-infra"),),
    )
    assert rule["spec"] == rule_file(cfg)


# a non-default value of each key that changes only the dashboards (peaks: order kept, one above 1e15)
DASHBOARD_VALUES: dict[str, Any] = {
    "node_label": "kubernetes_node",
    "dashboard_tags": ("gpu", "ml-infra"),
    "gpu_peak_flops": (("NVIDIA L4.*", 121e12), ("NVIDIA B200.*", 2.25e15), ("NVIDIA A.*", 312e12)),
}
# more values worth a dashboard each: durations not in normal form (stall_bound normalises them), the
# target variables' corner cases (a job label that is the node label, none, the node label `instance`)
DASHBOARD_CASES: list[tuple[str, Any]] = [
    ("stall_window", "90s"),
    ("straggler_window", "1h30m"),
    ("job_labels", ()),
    ("job_labels", ("node", "job")),
    ("node_label", "instance"),
    ("leak_horizon_hours", 0.25),
    ("gpu_peak_flops", (("NVIDIA H100.*", 1e16), ("NVIDIA H200.*", 1.5e-05))),
]


def dashboards_through_helm(changes: dict[str, Any]) -> dict[str, Any]:
    """The chart's dashboards ConfigMap for these keys, each dashboard's JSON parsed."""
    (cm,) = through_helm(changes)["ConfigMap"]
    return {name: json.loads(text) for name, text in cm["data"].items()}


def python_dashboards(cfg: MonitoringConfig) -> dict[str, Any]:
    return {name: json.loads(text) for name, text in _dashboard_texts(cfg)}


@functools.cache
def _dashboard_texts(cfg: MonitoringConfig) -> tuple[tuple[str, str], ...]:
    """Each dashboard's JSON for this config, built once per config (several tests compare the same one)."""
    from vramwatch.monitoring.dashboards import build_all
    from vramwatch.monitoring.dashboards.render import dashboard_json

    return tuple((f"{m.uid}.json", dashboard_json(m)) for m in build_all(cfg))


def test_the_dashboards_are_the_python_dashboards_with_the_defaults():
    (cm,) = kinds(objects())["ConfigMap"]
    shipped = {p.name: json.loads(p.read_text()) for p in (DEPLOY / "grafana" / "dashboards").glob("*.json")}
    assert {name: json.loads(text) for name, text in cm["data"].items()} == shipped == python_dashboards(DEFAULT)


DASHBOARD_PARAMS = [
    *((k, other_config()[k]) for k in sorted(other_config())),
    *SHAPES.items(),
    *DASHBOARD_VALUES.items(),
    *DASHBOARD_CASES,
]


@pytest.mark.parametrize(("key", "value"), DASHBOARD_PARAMS, ids=[f"{k}={v!r}"[:60] for k, v in DASHBOARD_PARAMS])
def test_each_key_set_through_helm_reaches_the_dashboards(key, value):
    """One key at a time: the chart's dashboards == the Python dashboards of that config (keys the
    dashboards do not use included: the chart must not change them either)."""
    cfg = dataclasses.replace(DEFAULT, **{key: value})
    assert dashboards_through_helm({key: value}) == python_dashboards(cfg)


# the keys the dashboards use (tests/deploy/test_helm.py checks each changes them; docs/monitoring-config.md)
DASHBOARD_KEYS = frozenset(
    {
        *DASHBOARD_VALUES,
        "selector",
        "job_labels",
        "memory_warning_ratio",
        "memory_critical_ratio",
        "memory_warning_for",
        "fragmentation_ratio",
        "stall_factor",
        "stall_min_seconds",
        "stall_window",
        "busy_utilization_ratio",
        "busy_power_ratio",
        "leak_horizon_hours",
        "leak_window",
        "sample_stale_seconds",
        "straggler_ratio",
        "straggler_window",
        "straggler_for",
        "xid_critical",
        "xid_warning",
    }
)


def test_which_keys_change_the_dashboards():
    """The list in docs/monitoring-config.md: these keys change the dashboards, the others do not."""
    values = {**other_config(), **DASHBOARD_VALUES}
    base = python_dashboards(DEFAULT)
    changing = {k for k, v in values.items() if python_dashboards(dataclasses.replace(DEFAULT, **{k: v})) != base}
    assert changing == DASHBOARD_KEYS
    doc = (ROOT / "docs" / "monitoring-config.md").read_text()
    assert all(f"`{k}`" in doc for k in DASHBOARD_KEYS)


@pytest.mark.parametrize("shape", ["every key", "the other shapes"])
def test_every_key_at_once_through_helm_reaches_the_dashboards(shape):
    changes = {**other_config(), **DASHBOARD_VALUES}
    if shape == "the other shapes":
        changes.update(SHAPES, selector="", job_labels=(), node_label="instance")
    cfg = dataclasses.replace(DEFAULT, **changes)
    assert dashboards_through_helm(changes) == python_dashboards(cfg)


def test_helm_dashboards_equal_the_dashboards_command(tmp_path):
    """`vramwatch dashboards --config F --write DIR` and `helm template -f` of the same keys: equal."""
    config = {
        "selector": 'namespace="ml"',
        "node_label": "kubernetes_node",
        "dashboard_tags": ["gpu"],
        "memory_warning_ratio": 0.8,
        "stall_window": "90s",
        "job_labels": ["job", "namespace"],
        "gpu_peak_flops": [{"NVIDIA L4.*": 121e12}, {"NVIDIA A.*": 312e12}],  # the chart's form, in a file
    }
    (tmp_path / "monitoring.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "vramwatch",
            "dashboards",
            "--config",
            str(tmp_path / "monitoring.yaml"),
            "--write",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    want = {p.name: json.loads(p.read_text()) for p in (out / "grafana" / "dashboards").glob("*.json")}
    values = {"monitoring": {helm.value_key(k): v for k, v in config.items()}}
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    (cm,) = kinds(objects("-f", str(tmp_path / "values.yaml")))["ConfigMap"]
    got = {name: json.loads(text) for name, text in cm["data"].items()}
    assert got == want and got != python_dashboards(DEFAULT)
    assert all(d["tags"] == ["gpu"] for d in got.values())


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ('monitoring.nodeLabel="kubernetes-node"', "nodeLabel"),
        ("monitoring.dashboardTags=[1]", "dashboardTags"),
        ('monitoring.gpuPeakFlops={"NVIDIA L4.*": 121e12}', "gpuPeakFlops"),  # a mapping: its order is lost
        ('monitoring.gpuPeakFlops=[{"NVIDIA L4.*": 0}]', "gpuPeakFlops"),
        ('monitoring.gpuPeakFlops=[{"a": 1, "b": 2}]', "gpuPeakFlops"),
        ('monitoring.gpuPeakFlops=[{"NVIDIA \\"L4": 1}]', "gpuPeakFlops"),
        ('monitoring.stallWindow="90 s"', "stallWindow"),
    ],
)
def test_the_schema_rejects_a_bad_dashboard_value(setting, message):
    r = template("--set-json", setting)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_values_hold_the_monitoring_config_defaults():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    want = {helm.value_key(f.name): helm._plain(f.name, getattr(DEFAULT, f.name)) for f in dataclasses.fields(DEFAULT)}
    assert values["monitoring"] == want


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("monitoring.memoryWarningRatio=high", "memoryWarningRatio"),
        ("monitoring.memoryWarningFor=5 minutes", "memoryWarningFor"),
        ("monitoring.memoryWarningRatioo=0.8", "memoryWarningRatioo"),
        ("monitoring.disabledAlerts[0]=NoSuchAlert", "disabledAlerts"),
        ("monitoring.memoryCriticalRatio=1.5", "memoryCriticalRatio"),
    ],
)
def test_the_schema_rejects_a_bad_threshold(setting, message):
    r = template("--set-string" if "Ratio=high" in setting or "minutes" in setting else "--set", setting)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_monitor_and_servicemonitor_together_fail():
    r = template("--set", "serviceMonitor.enabled=true")
    assert r.returncode != 0 and "choose one" in r.stderr


def test_the_objects_are_the_kustomize_bases():
    k = kinds(objects())
    base = {d["kind"]: d for p in ("podmonitor.yaml", "networkpolicy.yaml") for d in yaml_docs(K8S / p)}
    assert k["PodMonitor"][0]["spec"] == base["PodMonitor"]["spec"]
    assert k["NetworkPolicy"][0]["spec"] == base["NetworkPolicy"]["spec"]
    (cm,) = k["ConfigMap"]
    shipped = {p.name: json.loads(p.read_text()) for p in (DEPLOY / "grafana" / "dashboards").glob("*.json")}
    assert {name: json.loads(text) for name, text in cm["data"].items()} == shipped


@pytest.mark.parametrize(
    ("mode", "path"), [("in-process", K8S / "job.yaml"), ("sidecar", K8S / "sidecar" / "job.yaml")]
)
def test_the_example_job_is_the_kustomize_one(mode, path):
    objs = kinds(objects("--set", "example.enabled=true", "--set", f"example.mode={mode}"))
    (job,) = objs["Job"]
    want = yaml_docs(path)[0]
    got_pod, want_pod = job["spec"]["template"], want["spec"]["template"]
    # names differ (the release's), and kustomize hashes the script ConfigMap's name
    want_pod["metadata"]["labels"]["app.kubernetes.io/name"] = got_pod["metadata"]["labels"]["app.kubernetes.io/name"]
    script = next(v for v in got_pod["spec"]["volumes"] if v["name"] == "script")["configMap"]["name"]
    next(v for v in want_pod["spec"]["volumes"] if v["name"] == "script")["configMap"]["name"] = script
    assert got_pod == want_pod
    (cm,) = [c for c in objs["ConfigMap"] if c["metadata"]["name"] == script]
    assert cm["data"]["train.py"] == (K8S / "train.py").read_text()


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == _version.__version__
    assert (
        json.loads((CHART / "values.schema.json").read_text())["properties"]["monitoring"]["additionalProperties"]
        is False
    )


def test_alerts_check_covers_the_chart(tmp_path):
    """A hand edit of a generated part of the chart fails `vramwatch alerts --check`."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy, symlinks=True)
    env_cmd = [sys.executable, "-m", "vramwatch", "alerts", "--check", str(copy)]
    assert subprocess.run(env_cmd, capture_output=True, cwd=ROOT, timeout=60).returncode == 0
    values = copy / "helm" / "vramwatch" / "values.yaml"
    values.write_text(values.read_text().replace("memoryWarningRatio: 0.85", "memoryWarningRatio: 0.8"))
    r = subprocess.run(env_cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and "values.yaml" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "vramwatch", "alerts", "--write", str(copy)], capture_output=True, cwd=ROOT, timeout=60
    )
    assert r.returncode == 0 and "memoryWarningRatio: 0.85" in values.read_text()
    assert "# the example training Job" in values.read_text(), "the hand-written head is kept"
