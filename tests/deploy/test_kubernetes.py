"""deploy/kubernetes, as written and as `kubectl kustomize` renders it (the base with its release-label
component, and the README's overlay with the sidecar component), against the Kubernetes 1.29 and 1.33
schemas (kubernetes-validate, strict: unknown fields fail) and the Prometheus Operator CRDs' openAPIV3Schema
(jsonschema, made strict the same way), plus what the schemas cannot see: selectors that match the pods,
named ports that exist, settings vramwatch accepts. kubectl comes from `make tools`."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from deploy_files import K8S, operator_validators, run, validate_object, yaml_docs

from harness import ROOT, free_port, http_get, parse_metrics, tool, wait_port_closed, wait_until
from vramwatch import config


@pytest.fixture(scope="module")
def readme_overlay(tmp_path_factory) -> Path:
    """The overlay of deploy/kubernetes/README.md, beside a 'checkout' named vramwatch (a link to the repo)."""
    text = (K8S / "README.md").read_text()
    block = re.search(r"<!-- overlay example[^\n]*-->\n```yaml\n(.*?)```", text, re.S)
    assert block, "deploy/kubernetes/README.md lost its overlay example"
    d = tmp_path_factory.mktemp("overlay")
    (d / "vramwatch").symlink_to(ROOT)
    (d / "my-gpu-monitoring").mkdir()
    (d / "my-gpu-monitoring" / "kustomization.yaml").write_text(block.group(1))
    return d / "my-gpu-monitoring"


def render(directory: Path) -> list[dict]:
    """`kubectl kustomize DIR`: the objects `kubectl apply -k DIR` would send."""
    r = run(tool("kubectl"), "kustomize", str(directory))
    assert r.returncode == 0, f"kubectl kustomize {directory}: {r.stderr}"
    return yaml_docs(r.stdout)


@pytest.fixture(scope="module")
def variants(readme_overlay) -> dict[str, list[dict]]:
    return {"in-process": render(K8S), "overlay (sidecar)": render(readme_overlay)}


def _kinds(objs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


def test_base_renders_every_piece():
    k = _kinds(render(K8S))
    assert sorted(k) == ["ConfigMap", "Job", "NetworkPolicy", "PodMonitor", "PrometheusRule"]
    assert {o["metadata"]["namespace"] for objs in k.values() for o in objs} == {"training"}
    dashboards = [c for c in k["ConfigMap"] if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert dashboards and all(name.endswith(".json") for name in dashboards[0]["data"])
    for kind in ("PodMonitor", "PrometheusRule"):  # components/release-label
        assert k[kind][0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert [j["metadata"]["name"] for j in k["Job"]] == ["vramwatch-example"]
    # the Job mounts the generated script ConfigMap under its hashed name (kustomize rewrites the reference)
    (script,) = [c for c in k["ConfigMap"] if "train.py" in c["data"]]
    assert script["metadata"]["name"].startswith("vramwatch-example-script-")
    volumes = {v["name"]: v for v in k["Job"][0]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["script"]["configMap"]["name"] == script["metadata"]["name"]


def test_readme_overlay_swaps_the_job_and_relabels(variants):
    k = _kinds(variants["overlay (sidecar)"])
    assert [j["metadata"]["name"] for j in k["Job"]] == ["vramwatch-example-sidecar"]
    assert {o["metadata"]["namespace"] for objs in k.values() for o in objs} == {"ml-team"}
    for kind in ("PodMonitor", "PrometheusRule"):
        assert k[kind][0]["metadata"]["labels"]["release"] == "prometheus"


def test_both_readme_overlays_together_keep_the_release_label(readme_overlay, tmp_path):
    """The README's overlay (release label) with its config overlay added as documented ("beside the overlay's
    other settings"): the config's rules arrive, and the PrometheusRule keeps the overlay's release label, the
    one Prometheus selects it by (a rendered rule carrying the default label would put it back)."""
    pytest.importorskip("grafana_foundation_sdk")  # `vramwatch dashboards --config` renders with the SDK
    import yaml

    text = (K8S / "README.md").read_text()
    commands = re.search(r"<!-- config overlay[^\n]*-->\n```sh\n(.*?)```", text, re.S)
    assert commands, "deploy/kubernetes/README.md lost its config overlay commands"
    patches = re.search(r"```yaml\n(patches:\n.*?)```", text[commands.end() :], re.S)
    assert patches, "deploy/kubernetes/README.md lost the config overlay's patches"
    overlay = readme_overlay.parent / "both"
    overlay.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for line in commands.group(1).splitlines():
        argv = shlex.split(line, comments=True)
        if not argv or argv[0] == "cd":  # run in the overlay
            continue
        if argv[0] == "cp":  # "then keep only the keys you change": one change, to see it arrive
            (overlay / argv[2]).write_text("memory_warning_ratio: 0.81\n")
            continue
        assert argv[0] == "vramwatch", line
        out = argv.index(">") if ">" in argv else len(argv)
        r = subprocess.run(
            [sys.executable, "-m", *argv[:out]], cwd=overlay, env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, f"{line}: {r.stderr}"
        if out < len(argv):
            (overlay / argv[out + 1]).write_text(r.stdout)
    kustomization = yaml.safe_load((readme_overlay / "kustomization.yaml").read_text())
    kustomization["patches"] += yaml.safe_load(patches.group(1))["patches"]  # after the release patch
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    k = _kinds(render(overlay))
    (rule,) = k["PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["metadata"]["namespace"] == "ml-team"
    assert any(r.get("expr", "").endswith("> 0.81") for g in rule["spec"]["groups"] for r in g["rules"])
    assert k["PodMonitor"][0]["metadata"]["labels"]["release"] == "prometheus"


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def test_every_manifest_file_is_checked():
    names = {str(p.relative_to(K8S)) for p in _manifest_files()}
    assert {
        "podmonitor.yaml",
        "networkpolicy.yaml",
        "job.yaml",
        "sidecar/job.yaml",
        "prometheusrule.yaml",
        "dashboards-configmap.yaml",
    } <= names, names


@pytest.fixture(scope="module")
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    return operator_validators()


def _validate(obj: dict, crd_validators) -> None:
    validate_object(obj, crd_validators)


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_file_validates(path, crd_validators):
    for doc in yaml_docs(path):
        _validate(doc, crd_validators)


def test_rendered_variants_validate(variants, crd_validators):
    for name, objs in variants.items():
        for obj in objs:
            try:
                _validate(obj, crd_validators)
            except Exception as e:
                raise AssertionError(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {e}") from e


def test_the_validation_can_fail(crd_validators):
    """The strict checks catch a typo the apiserver would otherwise prune silently, and the native sidecar
    needs Kubernetes >= 1.28 (so the 1.29 schemas are the ones that know it)."""
    pm = yaml_docs(K8S / "podmonitor.yaml")[0]
    pm["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="intervall"):
        _validate(pm, crd_validators)
    sidecar_job = yaml_docs(K8S / "sidecar" / "job.yaml")[0]
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(sidecar_job, "1.27.0", strict=True)


# ---------------------------------------------------------------- Kubernetes: what schemas cannot see


def _pod(job: dict) -> dict:
    return job["spec"]["template"]


def _containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def _env(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _field(env: dict, name: str) -> str | None:
    v = env.get(name)
    return v.get("fieldRef", {}).get("fieldPath") if isinstance(v, dict) else None


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("variant", ["in-process", "overlay (sidecar)"])
def test_podmonitor_and_networkpolicy_find_the_metrics_port(variants, variant):
    k = _kinds(variants[variant])
    (job,), (pm,), (np,) = k["Job"], k["PodMonitor"], k["NetworkPolicy"]
    pod = _pod(job)
    labels = pod["metadata"]["labels"]
    assert _selects(pm["spec"]["selector"], labels), "the PodMonitor does not select the Job's pods"
    assert _selects(np["spec"]["podSelector"], labels), "the NetworkPolicy does not cover the Job's pods"
    ports = {p["name"]: p["containerPort"] for c in _containers(pod["spec"]) for p in c.get("ports", [])}
    endpoint = pm["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "metrics" and ports.get("metrics") == config.DEFAULT_PORT
    assert endpoint["path"] == "/metrics"
    # the plain-Prometheus annotations agree with the port
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == ports["metrics"]
    # the PodMonitor's relabelling: job="vramwatch", node from the pod
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["job"]["replacement"] == "vramwatch"
    assert relabel["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    # NetworkPolicy: the metrics port only from the monitoring namespace; the job's own traffic elsewhere
    scrape_rule, peers_rule = np["spec"]["ingress"]
    assert scrape_rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert [p["port"] for p in scrape_rule["ports"]] == ["metrics"]
    tcp = [(p["port"], p.get("endPort", p["port"])) for p in peers_rule["ports"] if p["protocol"] == "TCP"]
    assert not any(lo <= ports["metrics"] <= hi for lo, hi in tcp), "peers may reach the metrics port"
    assert sorted(tcp) == [(1, ports["metrics"] - 1), (ports["metrics"] + 1, 65535)]


def _settings_of(container: dict, pod_fields: dict[str, str]) -> config.Settings:
    """What vramwatch makes of the container's VRAMWATCH_* environment (Downward API values filled in)."""
    env = {}
    for name, v in _env(container).items():
        if name.startswith(config.ENV_PREFIX):
            env[name] = pod_fields[v["fieldRef"]["fieldPath"]] if isinstance(v, dict) else str(v)
    settings, _ = config.load({}, env=env)  # raises ConfigError for an unknown key or a bad value
    return settings


JOB_NAME_LABEL = "metadata.labels['batch.kubernetes.io/job-name']"
POD_FIELDS = {
    "metadata.name": "vramwatch-example-x7k2p",
    "metadata.namespace": "training",
    "spec.nodeName": "gpu-node-0001",
    JOB_NAME_LABEL: "vramwatch-example",  # what the Job controller labels its pods with: the Job's name
}


@pytest.mark.parametrize("path", [K8S / "job.yaml", K8S / "sidecar" / "job.yaml"], ids=["in-process", "sidecar"])
def test_jobs_configure_vramwatch(path):
    job = yaml_docs(path)[0]
    spec = _pod(job)["spec"]
    trainer = next(c for c in spec["containers"] if c["name"] == "trainer")
    tenv = _env(trainer)
    for name, field in (
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
        ("NODE_NAME", "spec.nodeName"),
        ("VRAMWATCH_HOSTNAME", "spec.nodeName"),
        ("VRAMWATCH_JOB_ID", JOB_NAME_LABEL),  # no variable holds the Job's name but this one
    ):
        assert _field(tenv, name) == field, f"{name} should come from the Downward API's {field}"
    assert trainer["command"][-1] == "/opt/vramwatch-example/train.py"
    mounts = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["script"] == "/opt/vramwatch-example"
    assert volumes["script"]["configMap"]["name"] == "vramwatch-example-script"
    gpus = trainer["resources"]["limits"]["nvidia.com/gpu"]
    assert int(tenv["NPROC_PER_NODE"]) == gpus, "one rank per GPU"
    server = next(c for c in _containers(spec) if any(p["name"] == "metrics" for p in c.get("ports", [])))
    served = _settings_of(server, POD_FIELDS)
    assert served.host == "0.0.0.0" and served.port == config.DEFAULT_PORT
    assert served.resolved_hostname() == "gpu-node-0001"
    ranks = _settings_of(trainer, POD_FIELDS)
    if server is trainer:  # in process: a rank starts the pod's server
        assert ranks.serve == "auto" and not spec.get("initContainers")
        return
    # sidecar: `vramwatch serve` as a native sidecar, the ranks only publish, one spool in memory
    assert spec["initContainers"] == [server] and server["restartPolicy"] == "Always"
    assert server["command"] == ["vramwatch", "serve"]
    assert server["startupProbe"]["httpGet"] == {"path": "/-/healthy", "port": "metrics"}
    assert ranks.serve == "external"
    assert not any(p for p in trainer.get("ports", [])), "the trainer serves nothing"
    assert ranks.resolved_spool_dir() == served.resolved_spool_dir()
    spool = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}[served.resolved_spool_dir()]
    assert mounts[spool] == served.resolved_spool_dir(), "the spool must be mounted at one path in both"
    assert volumes[spool]["emptyDir"]["medium"] == "Memory"
    assert spec["securityContext"]["runAsUser"], "one user for both containers (the spool is 0600)"


def test_example_train_script_runs_with_the_jobs_settings(tmp_path):
    """train.py, under the Job's own environment (loopback, simulated GPU and a short run swapped in),
    publishes steps that its rank-started server serves."""
    job = yaml_docs(K8S / "job.yaml")[0]
    trainer = _pod(job)["spec"]["containers"][0]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    for name, v in _env(trainer).items():
        env[name] = POD_FIELDS[v["fieldRef"]["fieldPath"]] if isinstance(v, dict) else str(v)
    env.update(
        VRAMWATCH_HOST="127.0.0.1",
        VRAMWATCH_PORT=str(port),
        VRAMWATCH_SPOOL_DIR=str(tmp_path / "spool"),
        VRAMWATCH_SIMULATE="true",
        VRAMWATCH_LINGER="0",
        VRAMWATCH_DEAD_RANK_GRACE_SECONDS="1",  # the final sample's window, which the server serves before leaving
        VRAMWATCH_INTERVAL="0.2",
        TRAIN_STEPS="0",
        TRAIN_SECONDS="60",
        HIDDEN="32",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        PYTHONPATH=str(ROOT),
    )
    log = open(tmp_path / "train.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, str(K8S / "train.py")], env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    try:

        def steps() -> float:
            code, body = http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            m = parse_metrics(body.decode()) if code == 200 else {}
            return sum(v for labels, v in m.get("vramwatch_training_steps_total", []))

        wait_until(lambda: steps() > 10, 60, "train.py's steps on /metrics")
        m = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
        assert 'hostname="gpu-node-0001"' in m, "VRAMWATCH_HOSTNAME from spec.nodeName labels the series"
        assert 'job_id="vramwatch-example"' in m, "VRAMWATCH_JOB_ID from the Job's name labels the rank series"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
    wait_port_closed(port, 30)  # the rank-started server leaves once the rank is gone (linger 0)
    assert (
        "vramwatch example: pod vramwatch-example-x7k2p in training on node gpu-node-0001"
        in (tmp_path / "train.log").read_text()
    )


# --- a monitoring config through kustomize: the README's overlay with every key changed ---


def _every_key_changed():
    """A config with a non-default value for every MonitoringConfig key."""
    import dataclasses

    from vramwatch.monitoring.config import DEFAULT, GIB

    changes: dict[str, Any] = {}
    for f in dataclasses.fields(DEFAULT):
        v = getattr(DEFAULT, f.name)
        if isinstance(v, bool):
            changes[f.name] = not v
        elif isinstance(v, float):
            changes[f.name] = float(8 * GIB) if f.name == "rank_skew_min_bytes" else round(v * 0.9 + 0.0125, 4)
        elif f.name.endswith(("_for", "_window")):
            changes[f.name] = "7m" if v != "7m" else "9m"
    return dataclasses.replace(
        DEFAULT,
        **changes,
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
        node_label="host",
        dashboard_tags=("gpu", "team-ml"),
        gpu_peak_flops=(("NVIDIA H200.*", 900e12), ("NVIDIA L4", 121e12)),
    )


def test_every_monitoring_config_key_reaches_the_kustomize_overlay(tmp_path, crd_validators):
    """deploy/kubernetes/README.md's overlay commands with a config file that changes every key: the
    rendered PrometheusRule is the Python rules of that config, the dashboards ConfigMap its dashboards,
    and every object still validates."""
    import dataclasses
    import json as json_

    pytest.importorskip("grafana_foundation_sdk")
    from vramwatch.monitoring import config_file, promql
    from vramwatch.monitoring.alerts.render import rule_file
    from vramwatch.monitoring.config import DEFAULT
    from vramwatch.monitoring.dashboards import build_all
    from vramwatch.monitoring.dashboards.render import dashboard_json

    cfg = _every_key_changed()
    changed = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) == getattr(DEFAULT, f.name)]
    assert not changed, f"keys left at their defaults: {changed}"
    text = (K8S / "README.md").read_text()
    block = re.search(r"<!-- config overlay[^\n]*-->\n```sh\n(.*?)```", text, re.S)
    patches = re.search(r"```yaml\n(patches:\n.*?)```", text[block.end() :], re.S) if block else None
    assert block and patches, "deploy/kubernetes/README.md lost its config overlay"
    (tmp_path / "vramwatch").symlink_to(ROOT)
    overlay = tmp_path / "my-gpu-monitoring"
    overlay.mkdir()
    cwd = tmp_path
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for line in block.group(1).splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[0] == "cd":
            cwd = cwd / argv[1]
        elif argv[0] == "cp":  # the example, then every key changed
            (cwd / argv[2]).write_text(config_file.example_yaml(cfg))
        else:
            out = argv.index(">") if ">" in argv else None
            r = subprocess.run(
                [sys.executable, "-m", *argv[:out]], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
            )
            assert r.returncode == 0, f"{line}: {r.stderr}"
            if out is not None:
                (cwd / argv[out + 1]).write_text(r.stdout)
    assert config_file.load(str(overlay / "monitoring.yaml")) == cfg
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../vramwatch/deploy/kubernetes\n" + patches.group(1)
    )
    objs = render(overlay)
    for obj in objs:
        validate_object(obj, crd_validators)
    k = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    assert k[("PrometheusRule", "vramwatch")]["spec"] == rule_file(cfg)
    data = k[("ConfigMap", "vramwatch-dashboards")]["data"]
    want = {f"{d.uid}.json": dashboard_json(d) for d in build_all(cfg)}
    assert data == want and data != {f"{d.uid}.json": dashboard_json(d) for d in build_all(DEFAULT)}
    memory = json_.loads(data["vramwatch-training-memory.json"])
    assert memory["tags"] == ["gpu", "team-ml"]
    assert any(v.get("name") == "node" and "host" in json_.dumps(v) for v in memory["templating"]["list"])
    exprs = [t.get("expr", "") for p in memory["panels"] for t in p.get("targets", [])]
    assert any(promql.PEAK_FLOPS_RECORD in e for e in exprs), "the MFU panel reads the rules' record"
    records = {r["record"]: r["expr"] for g in rule_file(cfg)["groups"] for r in g["rules"] if "record" in r}
    peak = records[promql.PEAK_FLOPS_RECORD]
    assert 'name=~"NVIDIA L4"' in peak and "121000000000000" in peak, "gpu_peak_flops"
