"""The deploy tree's paths, and reading them, for the tests in tests/deploy/."""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness import ROOT

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "rules" / "vramwatch.rules.yml"
ALERTMANAGER_YML = DEPLOY / "alertmanager" / "alertmanager.yml"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
SCALE_MD = ROOT / "docs" / "scale.md"


def run(*cmd: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def yaml_docs(source: Path | str) -> list[dict]:
    """The documents of a YAML file (a Path) or text, empty ones left out."""
    import yaml

    text = source.read_text() if isinstance(source, Path) else source
    return [d for d in yaml.safe_load_all(text) if d]
