"""The deploy tree's paths, and reading them, for the tests in tests/deploy/."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

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
    # libyaml's safe loader: the same documents as the pure-Python one, which takes 0.13-0.17 s of CPU for the
    # chart's 200 KB of output (its dashboards' JSON in block scalars) to libyaml's 0.005; test_helm parses it 140 times
    return [d for d in yaml.load_all(text, Loader=yaml.CSafeLoader) if d]


# --- schema validation of Kubernetes objects (tests/deploy/test_kubernetes.py, test_helm.py) ---
CRDS = ROOT / "tests" / "data" / "schemas" / "prometheus-operator"
# the oldest Kubernetes with native sidecars on by default (beta in 1.29; 1.27 predates the field), and the
# release where they went GA
K8S_VERSIONS = ("1.29.0", "1.33.0")


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


def operator_validators() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> a strict jsonschema validator, for the Prometheus Operator's CRDs."""
    import jsonschema
    import yaml

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


def validate_object(obj: dict, crd_validators: dict[tuple[str, str], Any]) -> None:
    """A CRD object against its schema, anything else against Kubernetes' own (strict, every K8S_VERSIONS)."""
    import kubernetes_validate

    key = (obj["apiVersion"], obj["kind"])
    if key in crd_validators:
        errors = sorted(crd_validators[key].iter_errors(obj), key=lambda e: list(e.path))
        assert not errors, "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
    else:
        assert obj["apiVersion"].split("/")[0] != "monitoring.coreos.com", f"no CRD schema for {key}"
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
