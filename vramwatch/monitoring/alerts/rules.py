"""Assemble the rule groups: one group per area, runbook links and extra labels added in one pass."""

from __future__ import annotations

import copy
from typing import Any

from vramwatch.monitoring.alerts import allocator, contention, exporter, health, memory, progress
from vramwatch.monitoring.config import DEFAULT, MonitoringConfig

# (group name, module): the order of the rule file
AREAS = (
    ("vramwatch-memory", memory),
    ("vramwatch-allocator", allocator),
    ("vramwatch-progress", progress),
    ("vramwatch-health", health),
    ("vramwatch-contention", contention),
    ("vramwatch-exporter", exporter),
)


def anchor(alertname: str) -> str:
    """The runbook section's anchor: GitHub's slug of a ``## AlertName`` heading."""
    return alertname.lower()


def add_runbook_links(groups: list[dict[str, Any]], cfg: MonitoringConfig) -> list[dict[str, Any]]:
    out = copy.deepcopy(groups)
    for g in out:
        for r in g["rules"]:
            if "alert" in r:
                r["annotations"]["runbook_url"] = cfg.runbook_url.format(anchor=anchor(r["alert"]))
    return out


def add_extra_labels(groups: list[dict[str, Any]], cfg: MonitoringConfig) -> list[dict[str, Any]]:
    out = copy.deepcopy(groups)
    for g in out:
        for r in g["rules"]:
            if "alert" in r:
                r["labels"] = {**r.get("labels", {}), **dict(cfg.extra_labels)}
    return out


def groups(cfg: MonitoringConfig = DEFAULT) -> list[dict[str, Any]]:
    """The rule groups, as the ``groups:`` list of a Prometheus rule file."""
    raw = [{"name": name, "rules": module.rules(cfg)} for name, module in AREAS]
    return add_extra_labels(add_runbook_links(raw, cfg), cfg)


def alerts(cfg: MonitoringConfig = DEFAULT) -> list[dict[str, Any]]:
    """Every alerting rule, flat."""
    return [r for g in groups(cfg) for r in g["rules"] if "alert" in r]


def alert_names(cfg: MonitoringConfig = DEFAULT) -> list[str]:
    return sorted({r["alert"] for r in alerts(cfg)})
