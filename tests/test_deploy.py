"""The deploy files, each checked by the tool that will read it (or its schema), and the loopback stack.

- Prometheus: `promtool check config` on deploy/prometheus/prometheus.yml, its loopback rewrite, and every
  configuration in docs/scale.md; `promtool check rules`; Alertmanager: `amtool check-config`.
- Kubernetes: every manifest, as written and as kustomize renders it (base, sidecar component, the README's
  overlay), against the Kubernetes 1.29 and 1.33 schemas (kubernetes-validate, strict: unknown fields fail) and the
  Prometheus Operator CRDs' openAPIV3Schema (jsonschema, made strict the same way), plus what the schemas
  cannot see: selectors that match the pods, named ports that exist, settings vramwatch accepts.
- Compose: parsed, every mounted path exists, and the paths the containers read resolve to repo files.
- Generated files in sync; docs/scale.md in sync with benchmarks/results/series.json.
- `scripts/demo_stack.py` (make demo): Prometheus scrapes the demo (up == 1), Alertmanager is ready, and
  Ctrl-C leaves nothing running.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from harness import ROOT, free_port, http_get, loopback_prometheus_config, tool, wait_until
from vramwatch import config
from vramwatch.monitoring import contract

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "rules" / "vramwatch.rules.yml"
ALERTMANAGER_YML = DEPLOY / "alertmanager" / "alertmanager.yml"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
CRDS = ROOT / "tests" / "data" / "schemas" / "prometheus-operator"
SCALE_MD = ROOT / "docs" / "scale.md"
# the oldest Kubernetes with native sidecars on by default (beta in 1.29; 1.27 predates the field), and the
# release where they went GA
K8S_VERSIONS = ("1.29.0", "1.33.0")


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


series_count = _load_module(ROOT / "benchmarks" / "series_count.py", "series_count")


def _run(*cmd: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- Prometheus, Alertmanager


def _promtool_has_kubernetes_sd() -> bool:
    probe = "scrape_configs:\n- job_name: x\n  kubernetes_sd_configs: [{role: pod}]\n"
    r = subprocess.run(
        [tool("promtool"), "check", "config", "/dev/stdin"], input=probe, capture_output=True, text=True, timeout=60
    )
    return r.returncode == 0


# kubernetes_sd_configs fields of upstream Prometheus 2.42 (discovery/kubernetes/kubernetes.go SDConfig)
_K8S_SD_KEYS = {
    "role",
    "api_server",
    "kubeconfig_file",
    "namespaces",
    "selectors",
    "attach_metadata",
    "basic_auth",
    "authorization",
    "oauth2",
    "bearer_token",
    "bearer_token_file",
    "proxy_url",
    "tls_config",
    "follow_redirects",
    "enable_http2",
    "no_proxy",
    "proxy_from_environment",
}
_K8S_SD_ROLES = {"pod", "node", "service", "endpoints", "endpointslice", "ingress"}


def test_prometheus_yml_passes_promtool(tmp_path):
    """Debian's Prometheus is built without Kubernetes discovery: there, the kubernetes-pods job is checked
    by promtool with its discovery block removed (relabelling and everything else stays), and the block
    itself against upstream's field list. A promtool that knows kubernetes_sd_configs checks the file as is."""
    if _promtool_has_kubernetes_sd():
        r = _run(tool("promtool"), "check", "config", str(PROMETHEUS_YML))
        assert r.returncode == 0, r.stdout + r.stderr
        return
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    k8s_jobs = [j for j in cfg["scrape_configs"] if "kubernetes_sd_configs" in j]
    assert [j["job_name"] for j in k8s_jobs] == ["kubernetes-pods"]
    for job in k8s_jobs:
        for sd in job.pop("kubernetes_sd_configs"):
            assert set(sd) <= _K8S_SD_KEYS and sd["role"] in _K8S_SD_ROLES, sd
    cfg["rule_files"] = [str(PROMETHEUS_YML.parent / r) for r in cfg["rule_files"]]
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(cfg))
    r = _run(tool("promtool"), "check", "config", str(checked))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout, r.stdout  # the generated rules are where it points


def test_prometheus_yml_discovers_annotated_pods_and_reaches_alertmanager():
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert cfg["rule_files"] == ["rules/vramwatch.rules.yml"]
    assert (PROMETHEUS_YML.parent / cfg["rule_files"][0]).exists()
    assert cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["vramwatch"]["static_configs"][0]["targets"] == ["host.docker.internal:9488"]
    relabel = jobs["kubernetes-pods"]["relabel_configs"]
    keep = relabel[0]
    assert keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    assert keep["action"] == "keep" and keep["regex"] == "true"
    sources = {tuple(r.get("source_labels", [])): r for r in relabel}
    port_rule = sources[("__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port")]
    assert port_rule["target_label"] == "__address__"
    # the IPv4 rewrite, run with Python's re (the same syntax here as RE2): pod IP + annotated port
    m = re.fullmatch(port_rule["regex"], "10.1.2.3:8080;9488")
    assert m and m.expand(port_rule["replacement"].replace("$", "\\")) == "10.1.2.3:9488"
    assert re.fullmatch(port_rule["regex"], "10.1.2.3;9488")  # a pod that declares no port
    targets = {r.get("target_label") for r in relabel}
    assert {"namespace", "pod", "node", "__metrics_path__"} <= targets


def test_loopback_config_passes_promtool(tmp_path):
    exporter, am = "127.0.0.1:19488", "127.0.0.1:19093"
    cfg = loopback_prometheus_config(yaml.safe_load(PROMETHEUS_YML.read_text()), PROMETHEUS_YML.parent, exporter, am)
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    r = _run(tool("promtool"), "check", "config", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout, r.stdout
    # only what must differ on loopback differs
    src = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert [j["job_name"] for j in cfg["scrape_configs"]] == ["vramwatch"]
    assert cfg["scrape_configs"][0]["static_configs"] == [{"targets": [exporter]}]
    assert cfg["alerting"]["alertmanagers"][0]["static_configs"] == [{"targets": [am]}]
    assert cfg["rule_files"] == [str(RULES)]
    assert cfg["global"] == src["global"]
    assert src["scrape_configs"][0]["static_configs"][0]["targets"] == ["host.docker.internal:9488"]  # untouched


def test_rule_file_passes_promtool():
    r = _run(tool("promtool"), "check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"SUCCESS: [1-9]\d* rules found", r.stdout), r.stdout


def test_alertmanager_yml_passes_amtool():
    r = _run(tool("amtool"), "check-config", str(ALERTMANAGER_YML))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_generated_files_are_in_sync():
    for generator in ("alerts", "dashboards"):
        r = _run(sys.executable, "-m", "vramwatch", generator, "--check", "deploy", cwd=ROOT)
        assert r.returncode == 0, f"vramwatch {generator} --check deploy: {r.stdout}{r.stderr}"


# ---------------------------------------------------------------- Kubernetes: a small kustomize

_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "components", "configMapGenerator", "patches"}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _matches(obj: dict, target: dict) -> bool:
    group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
    return all(
        [
            target.get("group", group) == group,
            target.get("kind", obj["kind"]) == obj["kind"],
            target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"],
        ]
    )


def _merge(dst: Any, patch: Any) -> Any:
    if isinstance(dst, dict) and isinstance(patch, dict):
        out = dict(dst)
        for k, v in patch.items():
            out[k] = _merge(dst.get(k), v) if k in dst else copy.deepcopy(v)
        return out
    return copy.deepcopy(patch)


def _json_patch(obj: dict, ops: list[dict]) -> None:
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node = obj
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if op["op"] in ("add", "replace"):
            assert op["op"] == "add" or last in node, f"replace of a missing {op['path']}"
            node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[last]
        else:
            raise AssertionError(f"unsupported JSON patch op {op['op']}")


def _apply_patch(resources: list[dict], entry: dict, base: Path) -> list[dict]:
    assert set(entry) <= {"patch", "path", "target"}, entry
    text = entry["patch"] if "patch" in entry else (base / entry["path"]).read_text()
    patch = yaml.safe_load(text)
    target = entry.get("target")
    if isinstance(patch, list):  # JSON 6902
        assert target, "a JSON patch needs a target"
        hits = [r for r in resources if _matches(r, target)]
        assert hits, f"patch target {target} matches nothing"
        for r in hits:
            _json_patch(r, patch)
        return resources
    if target is None:  # a strategic-merge patch names its target
        target = {"kind": patch["kind"], "name": patch["metadata"]["name"]}
    hits = [r for r in resources if _matches(r, target)]
    assert hits, f"patch target {target} matches nothing"
    if patch.get("$patch") == "delete":
        return [r for r in resources if not _matches(r, target)]
    merge = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind", "metadata")}
    merge["metadata"] = {k: v for k, v in patch.get("metadata", {}).items() if k not in ("name", "namespace")}
    return [_merge(r, merge) if _matches(r, target) else r for r in resources]


def render(directory: Path, _component: bool = False) -> list[dict]:
    """What `kubectl kustomize DIR` renders, for the features these files use; anything else fails, so a
    new feature in a kustomization must be taught here (never ignored). Name hashes are left out."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(k) <= _KUSTOMIZATION_KEYS, f"{directory}: teach render() {set(k) - _KUSTOMIZATION_KEYS}"
    assert k["kind"] == ("Component" if _component else "Kustomization"), directory
    out: list[dict] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        assert path.exists(), f"{directory}/kustomization.yaml: resource {res} does not exist"
        if path.is_dir():
            out += render(path)
        else:
            assert path.is_relative_to(directory.resolve()), f"{res}: kustomize loads files only below the root"
            out += _docs(path)
    for gen in k.get("configMapGenerator", []):
        data = {}
        for f in gen["files"]:
            assert (directory / f).is_file(), f"configMapGenerator file {f} does not exist"
            data[Path(f).name] = (directory / f).read_text()
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for comp in k.get("components", []):
        path = (directory / comp).resolve()
        assert (path / "kustomization.yaml").exists(), f"component {comp} does not exist"
        parts = render(path, _component=True)  # a component's resources join, its patches act on all
        comp_k = yaml.safe_load((path / "kustomization.yaml").read_text())
        out += parts
        for p in comp_k.get("patches", []):
            out = _apply_patch(out, p, path)
    if not _component:
        for p in k.get("patches", []):
            out = _apply_patch(out, p, directory)
        if k.get("namespace"):
            for r in out:
                r["metadata"]["namespace"] = k["namespace"]
    names = [(r["kind"], r["metadata"]["name"]) for r in out]
    assert len(names) == len(set(names)), f"duplicate resources in {directory}: {names}"
    return out


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


def test_readme_overlay_swaps_the_job_and_relabels(variants):
    k = _kinds(variants["overlay (sidecar)"])
    assert [j["metadata"]["name"] for j in k["Job"]] == ["vramwatch-example-sidecar"]
    assert {o["metadata"]["namespace"] for objs in k.values() for o in objs} == {"ml-team"}
    for kind in ("PodMonitor", "PrometheusRule"):
        assert k[kind][0]["metadata"]["labels"]["release"] == "prometheus"


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


def _strict(schema: Any) -> Any:
    """Reject unknown fields, as `kubectl apply --validate=strict` does: CRD schemas only prune them."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    return schema


@pytest.fixture(scope="module")
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    out = {}
    for f in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(f.read_text())
        for v in crd["spec"]["versions"]:
            schema = _strict(v["schema"]["openAPIV3Schema"])
            # metadata is the apiserver's ObjectMeta, not described by the CRD
            schema["properties"]["metadata"] = {"type": "object"}
            cls = jsonschema.validators.validator_for(schema)
            out[(f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"])] = cls(schema)
    assert len(out) == 3
    return out


def _validate(obj: dict, crd_validators) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in crd_validators:
        errors = sorted(crd_validators[key].iter_errors(obj), key=lambda e: list(e.path))
        assert not errors, "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
    else:
        assert obj["apiVersion"].split("/")[0] != "monitoring.coreos.com", f"no CRD schema for {key}"
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_file_validates(path, crd_validators):
    for doc in _docs(path):
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
    pm = _docs(K8S / "podmonitor.yaml")[0]
    pm["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="intervall"):
        _validate(pm, crd_validators)
    sidecar_job = _docs(K8S / "sidecar" / "job.yaml")[0]
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


POD_FIELDS = {
    "metadata.name": "vramwatch-example-x7k2p",
    "metadata.namespace": "training",
    "spec.nodeName": "gpu-node-0001",
}


@pytest.mark.parametrize("path", [K8S / "job.yaml", K8S / "sidecar" / "job.yaml"], ids=["in-process", "sidecar"])
def test_jobs_configure_vramwatch(path):
    job = _docs(path)[0]
    spec = _pod(job)["spec"]
    trainer = next(c for c in spec["containers"] if c["name"] == "trainer")
    tenv = _env(trainer)
    for name, field in (
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
        ("NODE_NAME", "spec.nodeName"),
        ("VRAMWATCH_HOSTNAME", "spec.nodeName"),
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
    job = _docs(K8S / "job.yaml")[0]
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
            from harness import parse_metrics

            m = parse_metrics(body.decode()) if code == 200 else {}
            return sum(v for labels, v in m.get("vramwatch_training_steps_total", []))

        wait_until(lambda: steps() > 10, 60, "train.py's steps on /metrics")
        m = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
        assert 'hostname="gpu-node-0001"' in m, "VRAMWATCH_HOSTNAME from spec.nodeName labels the series"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
    _wait_port_closed(port, 30)  # the rank-started server leaves once the rank is gone (linger 0)
    assert (
        "vramwatch example: pod vramwatch-example-x7k2p in training on node gpu-node-0001"
        in (tmp_path / "train.log").read_text()
    )


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_port_closed(port: int, timeout: float) -> None:
    wait_until(lambda: not _port_open(port), timeout, f"port {port} to close")


# ---------------------------------------------------------------- compose

_SERVICE_KEYS = {"image", "command", "volumes", "ports", "extra_hosts", "restart", "environment", "depends_on"}


def _bind_mounts(service: dict) -> dict[str, Path]:
    """container path -> host path, for the service's bind mounts (named volumes left out)."""
    out = {}
    for v in service.get("volumes", []):
        src, dst, *_ = v.split(":")
        if src.startswith((".", "/")):
            out[dst] = (COMPOSE.parent / src).resolve()
    return out


def _host_path(mounts: dict[str, Path], container_path: str) -> Path:
    for dst, src in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if container_path == dst or container_path.startswith(dst.rstrip("/") + "/"):
            return src / os.path.relpath(container_path, dst)
    raise AssertionError(f"{container_path} is not mounted")


def _flag(command: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in command if a.startswith(f"--{name}="))


def test_compose_file_mounts_the_repos_files():
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert set(services) == {"prometheus", "alertmanager", "grafana"}
    for name, s in services.items():
        assert set(s) <= _SERVICE_KEYS, f"{name}: {set(s) - _SERVICE_KEYS}"
        image, _, tag = s["image"].rpartition(":")
        assert image and tag and tag != "latest", f"{name}: pin the image"
        for port in s.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for dst, src in _bind_mounts(s).items():
            assert src.exists(), f"{name}: {src} (mounted at {dst}) does not exist"
        for vol in s.get("volumes", []):
            src = vol.split(":")[0]
            assert src.startswith((".", "/")) or src in doc["volumes"], f"{name}: undeclared volume {src}"
    # Prometheus reads deploy/prometheus/prometheus.yml, and its rule_files resolve to the generated rules
    prom = services["prometheus"]
    mounts = _bind_mounts(prom)
    cfg_path = _flag(prom["command"], "config.file")
    assert _host_path(mounts, cfg_path) == PROMETHEUS_YML
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    for rf in cfg["rule_files"]:
        assert _host_path(mounts, os.path.join(os.path.dirname(cfg_path), rf)) == RULES
    assert "host.docker.internal:host-gateway" in prom["extra_hosts"]
    am_target = cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"][0]
    assert am_target.split(":")[0] in services
    assert cfg["scrape_configs"][0]["static_configs"][0]["targets"] == ["host.docker.internal:9488"]
    # Alertmanager reads deploy/alertmanager/alertmanager.yml
    am = services["alertmanager"]
    assert _host_path(_bind_mounts(am), _flag(am["command"], "config.file")) == ALERTMANAGER_YML
    # Grafana: provisioned datasource and the dashboards directory
    gf = services["grafana"]
    gmounts = _bind_mounts(gf)
    ds_dir = _host_path(gmounts, "/etc/grafana/provisioning/datasources")
    (ds_doc,) = [yaml.safe_load(p.read_text()) for p in ds_dir.glob("*.yml")]
    prom_ds = [d for d in ds_doc["datasources"] if d["type"] == "prometheus"]
    assert len(prom_ds) == 1 and prom_ds[0]["isDefault"] and prom_ds[0]["url"] == "http://prometheus:9090"
    db_dir = _host_path(gmounts, "/etc/grafana/provisioning/dashboards")
    (db_doc,) = [yaml.safe_load(p.read_text()) for p in db_dir.glob("*.yml")]
    dash_dir = _host_path(gmounts, db_doc["providers"][0]["options"]["path"])
    assert dash_dir == DEPLOY / "grafana" / "dashboards"
    assert sorted(dash_dir.glob("*.json")), "no dashboards to provision"
    home = gf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _host_path(gmounts, home).is_file()


# ---------------------------------------------------------------- docs/scale.md


def _scale_configs() -> list[dict]:
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", SCALE_MD.read_text(), re.S)]
    return [b for b in blocks if isinstance(b, dict)]


def test_scale_md_configs_pass_promtool(tmp_path):
    configs = _scale_configs()
    assert len(configs) >= 4, "relabelling, sharding, federation and remote-write examples"
    for i, cfg in enumerate(configs):
        path = tmp_path / f"scale-{i}.yml"
        path.write_text(yaml.safe_dump(cfg))
        r = _run(tool("promtool"), "check", "config", str(path))
        assert r.returncode == 0, f"docs/scale.md block {i}: {r.stdout}{r.stderr}"


def _families_in(text: str) -> set[str]:
    names = {m.name for m in contract.METRICS}
    found = set()
    for word in set(re.findall(r"[a-z_][a-z0-9_]*", text)):
        for suffix in ("", "_bucket", "_sum", "_count"):
            if word.endswith(suffix) and word[: len(word) - len(suffix)] in names:
                found.add(word)
    return found


def _dropped(relabel: list[dict], labels: dict[str, str]) -> bool:
    for r in relabel:
        assert r["action"] in ("drop", "keep"), r
        value = r.get("separator", ";").join(labels.get(s, "") for s in r["source_labels"])
        hit = re.fullmatch(r["regex"], value) is not None
        if (r["action"] == "drop") == hit:
            return True
    return False


def test_fleet_relabelling_keeps_what_alerts_and_the_fleet_dashboard_read():
    relabel = series_count.fleet_relabel_configs()
    assert relabel, "docs/scale.md lost its metric_relabel_configs"
    rules = _families_in(RULES.read_text())
    fleet_dash = _families_in((DEPLOY / "grafana" / "dashboards" / "vramwatch-fleet.json").read_text())
    assert len(rules) > 10
    for name in sorted(rules | fleet_dash):
        assert not _dropped(relabel, {"__name__": name}), f"the fleet relabelling drops {name}, which is read"
    # throttle reasons the alerts name survive; the dropped ones are the ones that cost no speed
    for reason in re.findall(r'reason=~"([^"]+)"', RULES.read_text())[0].split("|"):
        assert not _dropped(relabel, {"__name__": "gpu_clock_throttle", "reason": reason}), reason
    assert _dropped(relabel, {"__name__": "gpu_clock_throttle", "reason": "gpu_idle"})
    assert _dropped(relabel, {"__name__": "vramwatch_training_step_duration_seconds_bucket", "le": "1"})
    assert not _dropped(relabel, {"__name__": "vramwatch_training_step_duration_seconds_count"})


def test_scale_md_agrees_with_the_measurement():
    result = json.loads((ROOT / "benchmarks" / "results" / "series.json").read_text())
    assert result["ranks"] == 8 and result["gpus"] == 8
    assert result["prometheus"], "series.json was recorded without the real Prometheus scrape"
    assert result["prometheus"]["scrape_samples_scraped"] == result["steady"]["series"]
    expected = series_count.render_doc_blocks(result)
    assert series_count.doc_blocks() == expected, (
        "docs/scale.md is stale: python3 benchmarks/series_count.py --doc-from benchmarks/results/series.json"
    )
    # the measurement is of contract families only, and of every fixed-cardinality one an 8-GPU node has
    measured = contract.exposed_names(result["steady"]["families"])
    assert measured <= set(contract.BY_NAME), measured - set(contract.BY_NAME)
    for name in (
        "torch_cuda_memory_reserved_bytes",
        "gpu_memory_used_bytes",
        "gpu_xid_errors_total",
        "vramwatch_training_step_duration_seconds",
        "vramwatch_build_info",
    ):
        assert name in measured, name


@pytest.mark.e2e
def test_recorded_series_count_matches_the_exporter_today():
    """A small live node (2 ranks, 2 GPUs) predicts the 8 x 8 count: per-rank and per-GPU series scale, the
    rest stays. A family added or dropped since the recording shows here, naming it."""
    result = json.loads((ROOT / "benchmarks" / "results" / "series.json").read_text())
    with series_count.SimulatedNode(2, 2, nvml_slow_interval="1", largest_block_interval="1") as node:
        node.wait_complete(timeout=90)
        time.sleep(3)  # one slow NVML read and one largest-block snapshot
        small = series_count.by_family_and_kind(http_get(node.url)[1].decode())
    predicted = series_count.predict(small, (2, 2), (result["ranks"], result["gpus"]))
    recorded = result["steady"]["families"]
    diff = {
        f: (recorded.get(f), predicted.get(f))
        for f in set(recorded) | set(predicted)
        if recorded.get(f) != predicted.get(f)
    }
    assert not diff, (
        "benchmarks/results/series.json is stale (family: recorded, now); re-run "
        f"python3 benchmarks/series_count.py --update-doc: {dict(sorted(diff.items()))}"
    )


# ---------------------------------------------------------------- make demo: the loopback stack


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{d.name}: {cmd}")
    return found


@pytest.mark.e2e
def test_demo_stack_scrapes_the_demo_and_cleans_up(tmp_path):
    prom_port, am_port, exp_port = free_port(), free_port(), free_port()
    out = open(tmp_path / "stack.out", "w+b")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "scripts" / "demo_stack.py"),
            "--prometheus-port",
            str(prom_port),
            "--alertmanager-port",
            str(am_port),
            "--port",
            str(exp_port),
            "--scrape-interval",
            "1s",
            "--ranks",
            "1",
            "--linger",
            "1",
            "--spool-dir",
            str(tmp_path / "spool"),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")},
    )
    prom = f"http://127.0.0.1:{prom_port}"

    def output() -> str:
        return (tmp_path / "stack.out").read_text(errors="replace")

    try:
        wait_until(
            lambda: proc.poll() is None and "vramwatch demo:" in output(), 90, "the stack to start and the demo to run"
        )
        assert f"Prometheus   {prom}" in output() and f"Alertmanager http://127.0.0.1:{am_port}" in output()
        work = re.search(r"files and logs in (\S+)", output()).group(1)

        def up() -> bool:
            q = urllib.parse.urlencode({"query": 'up{job="vramwatch"}'})
            res = json.loads(http_get(f"{prom}/api/v1/query?{q}")[1])["data"]["result"]
            return bool(res) and res[0]["value"][1] == "1" and res[0]["metric"]["instance"] == f"127.0.0.1:{exp_port}"

        wait_until(up, 60, "Prometheus to scrape the demo (up == 1)", interval=0.5)

        def steps() -> bool:
            q = urllib.parse.urlencode({"query": 'vramwatch_training_steps_total{job="vramwatch"} > 0'})
            return bool(json.loads(http_get(f"{prom}/api/v1/query?{q}")[1])["data"]["result"])

        wait_until(steps, 60, "the demo rank's steps in Prometheus", interval=0.5)
        assert http_get(f"http://127.0.0.1:{am_port}/-/ready")[0] == 200
        rules = json.loads(http_get(f"{prom}/api/v1/rules")[1])["data"]["groups"]
        assert rules and all(g["file"] == str(RULES) for g in rules), "the generated rules are loaded"
        ams = json.loads(http_get(f"{prom}/api/v1/alertmanagers")[1])["data"]["activeAlertmanagers"]
        assert [a["url"] for a in ams] == [f"http://127.0.0.1:{am_port}/api/v2/alerts"]
        assert _processes_mentioning(work), "Prometheus and Alertmanager run with the stack's directory"
        time.sleep(2.5)  # the rank-started server polls its ranks each second: let it see one before Ctrl-C
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it to the foreground group
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        out.close()
    assert "vramwatch stack: stopped Prometheus and Alertmanager" in output()
    for port in (prom_port, am_port):
        assert not _port_open(port), f"port {port} still open after the stack stopped"
    assert not Path(work).exists(), "the stack's directory is left behind"
    assert not _processes_mentioning(work), "a server outlived the stack"
    assert not _processes_mentioning(f"--port {exp_port}"), "the demo outlived the stack"
    try:
        _wait_port_closed(exp_port, 20)  # the rank-started exporter leaves after its linger (1 s)
    except AssertionError:
        spool = tmp_path / "spool"
        raise AssertionError(
            f"exporter still up; spool: {sorted(p.name for p in spool.iterdir())}; "
            f"server.log: {(spool / 'server.log').read_text()[-3000:]}; "
            f"servers: {_processes_mentioning('vramwatch serve')}"
        ) from None
