"""The plain-Prometheus deploy files, each checked by the tool that reads it: `promtool check config` on
deploy/prometheus/prometheus.yml, its loopback rewrite (make demo) and every configuration in docs/scale.md;
`promtool check rules`; `amtool check-config`; and the generated files in sync with their definitions."""

from __future__ import annotations

import re
import subprocess
import sys

import yaml
from deploy_files import ALERTMANAGER_YML, PROMETHEUS_YML, RULES, SCALE_MD, run

from harness import ROOT, loopback_prometheus_config, tool


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
        r = run(tool("promtool"), "check", "config", str(PROMETHEUS_YML))
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
    r = run(tool("promtool"), "check", "config", str(checked))
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
    r = run(tool("promtool"), "check", "config", str(path))
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
    r = run(tool("promtool"), "check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"SUCCESS: [1-9]\d* rules found", r.stdout), r.stdout


def test_alertmanager_yml_passes_amtool():
    r = run(tool("amtool"), "check-config", str(ALERTMANAGER_YML))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_generated_files_are_in_sync():
    for generator in ("alerts", "dashboards"):
        r = run(sys.executable, "-m", "vramwatch", generator, "--check", "deploy", cwd=ROOT)
        assert r.returncode == 0, f"vramwatch {generator} --check deploy: {r.stdout}{r.stderr}"


def _scale_configs() -> list[dict]:
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", SCALE_MD.read_text(), re.S)]
    return [b for b in blocks if isinstance(b, dict)]


def test_scale_md_configs_pass_promtool(tmp_path):
    configs = _scale_configs()
    assert len(configs) >= 4, "relabelling, sharding, federation and remote-write examples"
    for i, cfg in enumerate(configs):
        path = tmp_path / f"scale-{i}.yml"
        path.write_text(yaml.safe_dump(cfg))
        r = run(tool("promtool"), "check", "config", str(path))
        assert r.returncode == 0, f"docs/scale.md block {i}: {r.stdout}{r.stderr}"
