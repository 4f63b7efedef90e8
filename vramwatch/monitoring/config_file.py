"""The monitoring config as a YAML file: the keys of ``MonitoringConfig``, any subset.

``load(path)`` reads it bounded (:mod:`vramwatch.yaml_bounded`: size cap, no aliases), coerces each
value to its field's type, runs every check and names the first bad key (ConfigError; the CLIs exit 2).
``example_yaml()`` renders a config as a commented file: ``deploy/monitoring.example.yaml`` is the
defaults, written by ``vramwatch alerts --write deploy``.
"""

from __future__ import annotations

import dataclasses
import difflib
import textwrap
import typing
from typing import Any

import yaml

from vramwatch.errors import ConfigError
from vramwatch.monitoring.alerts.rules import check_disabled_alerts
from vramwatch.monitoring.config import DEFAULT, EXAMPLE_PATH, MonitoringConfig, shown, validate
from vramwatch.yaml_bounded import UnsafeYaml, load_bounded_yaml

__all__ = ["EXAMPLE_PATH", "example_yaml", "from_mapping", "load"]

FIELDS = {f.name: f for f in dataclasses.fields(MonitoringConfig)}
_TYPES = typing.get_type_hints(MonitoringConfig)


def _fail(key: str, raw: Any, source: str, why: str) -> ConfigError:
    return ConfigError(f"invalid monitoring setting {key}={shown(raw)} (from {source}): {why}")


def _coerce(key: str, raw: Any, source: str) -> Any:
    """``raw`` (as YAML parsed it) as the field's type, or ConfigError."""
    kind = _TYPES[key]
    if kind is bool:
        if not isinstance(raw, bool):
            raise _fail(key, raw, source, "must be true or false")
        return raw
    if kind is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise _fail(key, raw, source, "must be a number")
        return float(raw)
    if kind is str:
        if not isinstance(raw, str):
            why = "must be a string" + (" such as '5m' (quote it)" if key.endswith(("_for", "_window")) else "")
            raise _fail(key, raw, source, why)
        return raw
    if key == "extra_labels":
        if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
            raise _fail(key, raw, source, "must be a mapping of label names to strings, e.g. {team: ml-infra}")
        return tuple((str(k), v) for k, v in raw.items())
    if key == "gpu_peak_flops":
        # a mapping, or a list of one-entry mappings (the Helm chart's form: Helm loses a mapping's order)
        entries = raw if isinstance(raw, list) else [raw]
        ok = all(isinstance(e, dict) for e in entries) and (isinstance(raw, dict) or all(len(e) == 1 for e in entries))
        pairs = [(k, v) for e in entries if isinstance(e, dict) for k, v in e.items()]
        if not ok or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for _, v in pairs):
            raise _fail(
                key,
                raw,
                source,
                "must be a mapping of GPU name regexes to FLOP/s, e.g. {'NVIDIA H200.*': 989e12}, or a list of "
                "one-entry mappings",
            )
        return tuple((str(k), float(v)) for k, v in pairs)
    (item,) = {a for a in typing.get_args(kind) if a is not Ellipsis}
    if not isinstance(raw, list):
        raise _fail(key, raw, source, "must be a list")
    if item is int:
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
            raise _fail(key, raw, source, "must be a list of whole numbers")
    elif not all(isinstance(x, str) for x in raw):
        raise _fail(key, raw, source, "must be a list of strings")
    return tuple(raw)


def from_mapping(data: Any, source: str, base: MonitoringConfig = DEFAULT) -> MonitoringConfig:
    """``base`` with the keys of ``data`` replaced, checked."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid monitoring config {source}: must hold a mapping of settings")
    changes = {}
    for key, raw in data.items():
        if key not in FIELDS:
            near = difflib.get_close_matches(str(key), FIELDS, n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise ConfigError(f"unknown monitoring setting {shown(key)} (from {source}){hint}")
        changes[key] = _coerce(key, raw, source)
    cfg = validate(dataclasses.replace(base, **changes), source)
    check_disabled_alerts(cfg, source)
    return cfg


def load(path: str, base: MonitoringConfig = DEFAULT) -> MonitoringConfig:
    """The config in the YAML file ``path`` (keys it leaves out keep ``base``'s values)."""
    try:
        data = load_bounded_yaml(path)
    except OSError as e:
        raise ConfigError(f"invalid monitoring config {path}: {e.strerror or e}") from None
    except UnsafeYaml as e:
        raise ConfigError(f"invalid monitoring config {path}: {e}") from None
    return from_mapping(data, path, base)


def _plain(v: Any) -> Any:
    """A field's value as YAML writes it (tuples as lists, label pairs as a mapping, whole floats as ints)."""
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1 << 20:
        return int(v)
    if isinstance(v, tuple) and v and all(isinstance(x, tuple) for x in v):
        return {k: _plain(x) for k, x in v}
    if isinstance(v, tuple):
        return list(v) if v else []
    return v


def _value_yaml(key: str, v: Any) -> str:
    plain = _plain(v)
    if key == "extra_labels" and not plain:
        plain = {}
    text = yaml.safe_dump({key: plain}, default_flow_style=True, width=1 << 16, sort_keys=False).strip()
    return text[1:-1] if text.startswith("{") else text  # flow style wraps the pair in braces


def example_yaml(cfg: MonitoringConfig = DEFAULT) -> str:
    """Every key of ``cfg`` with its value, each under its documentation as a comment."""
    out = [
        "# vramwatch monitoring config: every key of MonitoringConfig (vramwatch/monitoring/config.py)",
        "# with its default. Generated by `vramwatch alerts --write deploy`. Copy it, keep the keys you",
        "# change, and render with `vramwatch alerts --config F` and `vramwatch dashboards --config F`",
        "# (docs/monitoring-config.md).",
    ]
    for name, f in FIELDS.items():
        out.append("")
        out += ["# " + line for line in textwrap.wrap(f.metadata["doc"], 100)]
        out.append(_value_yaml(name, getattr(cfg, name)))
    return "\n".join(out) + "\n"
