"""deploy/helm/vramwatch: `helm lint`, and `helm template` in its variants against the Kubernetes and
Prometheus Operator schemas (strict, as for the kustomize base). The rules it renders equal the Python rules
of the same config, through each value (an alert off, its `for`, severity, labels, the links, a user's rule
file); the schema refuses typos; the objects equal the kustomize base's; the generated parts are covered by
`vramwatch alerts --check`, and a new alert reaches the chart by regenerating. helm comes from `make tools`."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import DEPLOY, K8S, operator_validators, run, validate_object, yaml_docs

from harness import ROOT, tool
from vramwatch import _version
from vramwatch.monitoring import helm
from vramwatch.monitoring.alerts.render import rule_file
from vramwatch.monitoring.config import DEFAULT

CHART = DEPLOY / "helm" / "vramwatch"


def template(*args: str, chart: Path = CHART) -> subprocess.CompletedProcess:
    return run(tool("helm"), "template", "vw", str(chart), "--namespace", "training", *args)


def objects(*args: str, chart: Path = CHART) -> list[dict]:
    r = template(*args, chart=chart)
    assert r.returncode == 0, r.stderr
    return yaml_docs(r.stdout)


def kinds(objs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


def with_values(tmp_path: Path, values: dict[str, Any], *args: str) -> dict[str, list[dict]]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return kinds(objects("-f", str(path), *args))


def rules_spec(tmp_path: Path, values: dict[str, Any], *args: str) -> dict:
    (rule,) = with_values(tmp_path, values, *args)["PrometheusRule"]
    return rule["spec"]


def alert_rules(spec: dict, name: str) -> list[dict]:
    return [r for g in spec["groups"] for r in g["rules"] if r.get("alert") == name]


TLS = {"ca": {"secret": {"name": "vramwatch-tls", "key": "ca.crt"}}, "serverName": "vramwatch"}
AUTH = {"username": {"name": "vw-auth", "key": "user"}, "password": {"name": "vw-auth", "key": "pass"}}
ENDPOINT = {
    "scheme": "https",
    "tlsConfig": TLS,
    "basicAuth": AUTH,
    "honorLabels": True,
    "interval": "30s",
    "relabelings": [{"targetLabel": "cluster", "replacement": "gpu-east"}],
    "metricRelabelings": [{"action": "drop", "sourceLabels": ["__name__"], "regex": "torch_cuda_memory_segment.*"}],
    "additionalLabels": {"team": "ml"},
}
VARIANTS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "example in-process": ("--set", "example.enabled=true", "--set", "example.mode=in-process"),
    "example sidecar": ("--set", "example.enabled=true"),
    "servicemonitor": ("--set", "serviceMonitor.enabled=true", "--set", "podMonitor.enabled=false"),
    "labels": ("--set", "release=prometheus", "--set", "commonLabels.team=ml", "--set", "dashboards.namespace=grafana"),
    "networkpolicy": ("--set", "networkPolicy.enabled=true"),
    "tls and basic auth (podmonitor)": ("--set-json", "podMonitor=" + json.dumps({"enabled": True, **ENDPOINT})),
    "tls and basic auth (servicemonitor)": (
        "--set-json",
        "serviceMonitor=" + json.dumps({"enabled": True, **ENDPOINT}),
        "--set",
        "podMonitor.enabled=false",
    ),
    "every alert value": (
        "--set-json",
        'alerts={"GPULost": {"enabled": false}, "TorchMemoryLeak": {"for": "1h", "severity": "critical", '
        '"labels": {"team": "ml"}}, "GPUMemoryUsageHigh": {"for": {"warning": "10m"}}}',
        "--set",
        "prometheusRule.dashboardUrl=https://grafana.example.com",
        "--set",
        "prometheusRule.runbookUrl=https://wiki.example/{alertname}",
        "--set",
        "prometheusRule.additionalRuleLabels.cluster=east",
    ),
}


@pytest.fixture(scope="module")
def crd_validators():
    return operator_validators()


@pytest.mark.parametrize("variant", ["defaults", "every alert value", "example sidecar", "networkpolicy"])
def test_helm_lint_strict(variant):
    r = run(tool("helm"), "lint", "--strict", str(CHART), *VARIANTS[variant])
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


def test_the_templates_are_short_and_readable():
    """No generated template: every template is hand-written, no line over 160 characters."""
    for path in sorted((CHART / "templates").iterdir()):
        lines = path.read_text().splitlines()
        assert len(lines) < 200, f"{path.name}: {len(lines)} lines"
        long = [i + 1 for i, line in enumerate(lines) if len(line) > 160]
        assert not long, f"{path.name}: lines {long} are over 160 characters"


def test_the_defaults_render_the_monitoring_objects():
    k = kinds(objects())
    assert sorted(k) == ["ConfigMap", "PodMonitor", "PrometheusRule"]  # no NetworkPolicy unless asked
    assert {o["metadata"]["namespace"] for objs in k.values() for o in objs} == {"training"}
    for kind in ("PodMonitor", "PrometheusRule"):  # what kube-prometheus-stack selects by
        assert k[kind][0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert "release" not in k["ConfigMap"][0]["metadata"]["labels"]


def test_labels_and_namespace_come_from_values():
    k = kinds(objects(*VARIANTS["labels"]))
    for kind in ("PodMonitor", "PrometheusRule"):
        assert k[kind][0]["metadata"]["labels"]["release"] == "prometheus"
    assert all(o["metadata"]["labels"]["team"] == "ml" for objs in k.values() for o in objs)
    (cm,) = k["ConfigMap"]
    assert cm["metadata"]["namespace"] == "grafana" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_name_and_namespace_overrides():
    k = kinds(objects("--set", "nameOverride=gpu", "--set", "namespaceOverride=monitoring"))
    assert {o["metadata"]["namespace"] for objs in k.values() for o in objs} == {"monitoring"}
    assert k["PrometheusRule"][0]["metadata"]["name"] == "vw-gpu"
    assert k["PodMonitor"][0]["metadata"]["labels"]["app.kubernetes.io/name"] == "gpu"
    k = kinds(objects("--set", "fullnameOverride=vramwatch"))
    assert k["PodMonitor"][0]["metadata"]["name"] == "vramwatch"


def test_the_rules_are_the_python_rules_with_the_defaults():
    (rule,) = kinds(objects())["PrometheusRule"]
    assert rule["spec"] == rule_file(DEFAULT)
    assert rule["spec"] == yaml_docs(K8S / "prometheusrule.yaml")[0]["spec"]
    assert not any("dashboard_url" in r.get("annotations", {}) for g in rule["spec"]["groups"] for r in g["rules"])


def test_the_links_are_the_python_rules_links(tmp_path):
    urls = {"dashboardUrl": "https://grafana.example.com", "runbookUrl": "https://wiki.example/{alertname}#{anchor}"}
    spec = rules_spec(tmp_path, {"prometheusRule": urls})
    cfg = dataclasses.replace(DEFAULT, dashboard_url=urls["dashboardUrl"], runbook_url=urls["runbookUrl"])
    assert spec == rule_file(cfg)


def test_an_alert_off_is_the_python_rules_without_it(tmp_path):
    spec = rules_spec(tmp_path, {"alerts": {"GPULost": {"enabled": False}, "TrainingStalled": {"enabled": False}}})
    assert spec == rule_file(dataclasses.replace(DEFAULT, disabled_alerts=("GPULost", "TrainingStalled")))


def test_every_alert_off_leaves_only_the_recording_rules(tmp_path):
    names = yaml.safe_load((CHART / "values.yaml").read_text())["alerts"]
    spec = rules_spec(tmp_path, {"alerts": {n: {"enabled": False} for n in names}})
    assert [r for g in spec["groups"] for r in g["rules"]] == [
        r for g in rule_file(DEFAULT)["groups"] for r in g["rules"] if "record" in r
    ]


def test_for_and_severity_per_alert_and_per_severity(tmp_path):
    values = {
        "alerts": {
            "TorchMemoryLeak": {"for": "2h", "severity": "critical"},
            "GPUMemoryUsageHigh": {"for": {"warning": "10m"}, "severity": {"warning": "info"}},
        }
    }
    spec = rules_spec(tmp_path, values)
    (leak,) = alert_rules(spec, "TorchMemoryLeak")
    assert leak["for"] == "2h" and leak["labels"]["severity"] == "critical"
    warn, crit = alert_rules(spec, "GPUMemoryUsageHigh")
    assert (warn["for"], warn["labels"]["severity"]) == ("10m", "info")
    assert (crit["for"], crit["labels"]["severity"]) == ("1m", "critical"), "the critical rule keeps its own"
    (oom,) = alert_rules(spec, "TorchOutOfMemory")  # at once: stays at once
    assert "for" not in oom


def test_labels_per_alert_and_for_every_alert(tmp_path):
    values = {
        "alerts": {"GPULost": {"labels": {"team": "infra", "severity": "ignored"}}},
        "prometheusRule": {"additionalRuleLabels": {"cluster": "east"}},
    }
    spec = rules_spec(tmp_path, values)
    (lost,) = alert_rules(spec, "GPULost")
    assert lost["labels"] == {"severity": "critical", "team": "infra", "cluster": "east"}
    cfg = dataclasses.replace(DEFAULT, extra_labels=(("cluster", "east"),))
    for got, want in zip(spec["groups"], rule_file(cfg)["groups"], strict=True):
        for g, w in zip(got["rules"], want["rules"], strict=True):
            if g.get("alert") != "GPULost":
                assert g == w


@pytest.mark.parametrize("form", ["prometheusrule", "rules"])
def test_a_users_rule_file_replaces_the_shipped_one(form, tmp_path):
    """README: custom thresholds come from `vramwatch alerts --config F`, given with --set-file."""
    config = tmp_path / "monitoring.yaml"
    config.write_text("memory_warning_ratio: 0.7\nleak_horizon_hours: 8\n")
    r = subprocess.run(
        [sys.executable, "-m", "vramwatch", "alerts", "--config", str(config), "--format", form],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    (tmp_path / "rules.yaml").write_text(r.stdout)
    spec = rules_spec(
        tmp_path,
        {"alerts": {"GPULost": {"enabled": False}}},
        "--set-file",
        f"prometheusRule.rules={tmp_path / 'rules.yaml'}",
    )
    cfg = dataclasses.replace(DEFAULT, memory_warning_ratio=0.7, leak_horizon_hours=8.0, disabled_alerts=("GPULost",))
    assert spec == rule_file(cfg)


@pytest.mark.parametrize(("text", "message"), [("groups: [", "is not YAML"), ("nothing: 1\n", "holds no rule groups")])
def test_a_bad_rule_file_fails_naming_the_value(text, message, tmp_path):
    (tmp_path / "rules.yaml").write_text(text)
    r = template("--set-file", f"prometheusRule.rules={tmp_path / 'rules.yaml'}")
    assert r.returncode != 0 and message in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "podmonitor.enabled=false"), "podmonitor"),
        (("--set", "podMonitor.enabeld=false"), "enabeld"),
        (("--set", "alerts.GPULots.enabled=false"), "GPULots"),
        (("--set", "alerts.GPULost.for=five minutes"), "for"),
        (("--set", "alerts.GPULost.severity=page"), "severity"),
        (("--set", "alerts.GPULost.severity.pager=critical"), "severity"),
        (("--set", "podMonitor.scheme=ftp"), "scheme"),
        (("--set", "prometheusRule.dashboardUrl=grafana:3000"), "dashboardUrl"),
        (("--set", "prometheusRule.additionalRuleLabels.severity=info"), "severity"),
        (("--set", "scrape.port=http"), "port"),
        (("--set", "networkPolicy.enabled=yes please"), "enabled"),
    ],
)
def test_the_schema_rejects_a_typo_or_a_bad_value(args, message):
    r = template(*args)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_a_monitor_turned_off_is_not_rendered():
    assert "PodMonitor" not in kinds(objects("--set", "podMonitor.enabled=false"))
    assert "PrometheusRule" not in kinds(objects("--set", "prometheusRule.enabled=false"))
    assert "ConfigMap" not in kinds(objects("--set", "dashboards.enabled=false"))


@pytest.mark.parametrize("monitor", ["podMonitor", "serviceMonitor"])
def test_tls_basic_auth_and_relabelings_reach_the_monitor(monitor):
    args = VARIANTS[f"tls and basic auth ({monitor.lower()})"]
    k = kinds(objects(*args))
    (obj,) = k["PodMonitor" if monitor == "podMonitor" else "ServiceMonitor"]
    assert obj["metadata"]["labels"]["team"] == "ml" and obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (ep,) = obj["spec"]["podMetricsEndpoints" if monitor == "podMonitor" else "endpoints"]
    assert ep["scheme"] == "https" and ep["tlsConfig"] == TLS and ep["basicAuth"] == AUTH
    assert ep["honorLabels"] is True and ep["interval"] == "30s"
    # the chart's own relabelings first (job, node), then the user's
    assert [r.get("targetLabel") for r in ep["relabelings"]] == ["job", "node", "cluster"]
    assert ep["metricRelabelings"] == ENDPOINT["metricRelabelings"]


def test_monitor_and_servicemonitor_together_fail():
    r = template("--set", "serviceMonitor.enabled=true")
    assert r.returncode != 0 and "choose one" in r.stderr


def test_the_objects_are_the_kustomize_bases():
    k = kinds(objects("--set", "networkPolicy.enabled=true"))
    base = {d["kind"]: d for p in ("podmonitor.yaml", "networkpolicy.yaml") for d in yaml_docs(K8S / p)}
    (ep,) = k["PodMonitor"][0]["spec"]["podMetricsEndpoints"]
    assert (ep.pop("scheme"), ep.pop("honorLabels")) == ("http", False)  # the Operator's defaults, said
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


def test_chart_metadata_and_values():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == _version.__version__
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["networkPolicy"]["enabled"] is False
    shipped = {
        r["alert"]
        for g in yaml_docs(CHART / "files" / "vramwatch.rules.yml")[0]["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    assert set(values["alerts"]) == shipped and all(v == {"enabled": True} for v in values["alerts"].values())


def _vramwatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vramwatch", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_alerts_check_covers_the_chart(tmp_path):
    """A hand edit of a generated part of the chart fails `vramwatch alerts --check`; --write keeps the
    hand-written parts of values.yaml and the schema."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy, symlinks=True)
    chart = copy / "helm" / "vramwatch"
    assert _vramwatch("alerts", "--check", str(copy)).returncode == 0
    for rel, old, new in [
        ("files/vramwatch.rules.yml", "for: 5m", "for: 6m"),
        ("values.yaml", "GPULost:", "GPULots:"),
        ("values.schema.json", '"GPULost",', ""),
    ]:
        saved = (chart / rel).read_text()
        (chart / rel).write_text(saved.replace(old, new, 1))
        r = _vramwatch("alerts", "--check", str(copy))
        assert r.returncode == 1 and rel.split("/")[-1] in r.stderr, rel
        (chart / rel).write_text(saved)
    values = chart / "values.yaml"
    values.write_text(values.read_text().replace("port: 9488", "port: 9400"))
    assert _vramwatch("alerts", "--write", str(copy)).returncode == 0
    assert "port: 9400" in values.read_text() and "GPULost:" in values.read_text(), "the hand-written head is kept"


def test_a_new_alert_reaches_the_chart_with_its_values(tmp_path):
    """Regenerating from rules with one more alert (the opt-in VramwatchTargetAbsent stands in for a new one)
    gives it a value and a schema entry, and its values work."""
    chart = tmp_path / "deploy" / "helm" / "vramwatch"
    shutil.copytree(CHART, chart)
    cfg = dataclasses.replace(DEFAULT, target_absent_for="15m")
    for rel, text in helm.generated(cfg, tmp_path / "deploy").items():
        (tmp_path / "deploy" / rel).write_text(text)
    assert "VramwatchTargetAbsent" in yaml.safe_load((chart / "values.yaml").read_text())["alerts"]
    (rule,) = kinds(objects(chart=chart))["PrometheusRule"]
    assert rule["spec"] == rule_file(cfg)
    (rule,) = kinds(objects("--set", "alerts.VramwatchTargetAbsent.for=1h", chart=chart))["PrometheusRule"]
    (absent,) = alert_rules(rule["spec"], "VramwatchTargetAbsent")
    assert absent["for"] == "1h"
    (rule,) = kinds(objects("--set", "alerts.VramwatchTargetAbsent.enabled=false", chart=chart))["PrometheusRule"]
    assert rule["spec"] == rule_file(DEFAULT)
