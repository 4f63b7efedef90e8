"""deploy/compose: parsed, every mounted path exists, and the paths the containers read resolve to repo files."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from deploy_files import ALERTMANAGER_YML, COMPOSE, DEPLOY, PROMETHEUS_YML, RULES

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
