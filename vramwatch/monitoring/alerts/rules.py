"""Assemble the rule groups: one group per area; runbook and dashboard links, extra labels and the
disabled alerts applied in one pass."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from vramwatch.errors import ConfigError
from vramwatch.monitoring import dashboard_ids
from vramwatch.monitoring.alerts import allocator, contention, exporter, health, incidents, memory, panels, progress
from vramwatch.monitoring.config import DEFAULT, MonitoringConfig, shown

# (group name, its rules, the dashboard its alerts link to): the order of the rule file. Prometheus evaluates
# the groups concurrently and a group's rules one after another, so a group's time is the sum of its rules':
# groups are cut so that none grows past a second at 1,000 nodes (docs/scale.md). A record read by another
# group is read as of that group's last evaluation.
AREAS = (
    ("vramwatch-memory", memory.rules, dashboard_ids.TRAINING_MEMORY_UID),
    ("vramwatch-allocator", allocator.rules, dashboard_ids.TRAINING_MEMORY_UID),
    ("vramwatch-leak", allocator.leak_rules, dashboard_ids.TRAINING_MEMORY_UID),
    ("vramwatch-stall-window", progress.stall_window_rules, dashboard_ids.TRAINING_MEMORY_UID),  # records only
    ("vramwatch-progress", progress.rules, dashboard_ids.TRAINING_MEMORY_UID),
    ("vramwatch-pace", progress.pace_rules, dashboard_ids.TRAINING_MEMORY_UID),  # recorded series only
    ("vramwatch-stragglers", progress.straggler_rules, dashboard_ids.TRAINING_MEMORY_UID),
    ("vramwatch-incidents", incidents.rules, dashboard_ids.TRAINING_MEMORY_UID),
    ("vramwatch-health", health.rules, dashboard_ids.GPU_HEALTH_UID),
    ("vramwatch-recovery", health.recovery_rules, dashboard_ids.GPU_HEALTH_UID),
    ("vramwatch-device", health.device_rules, dashboard_ids.GPU_HEALTH_UID),
    ("vramwatch-contention", contention.rules, dashboard_ids.TRAINING_MEMORY_UID),
    ("vramwatch-exporter", exporter.rules, dashboard_ids.FLEET_UID),
    ("vramwatch-panels", panels.rules, dashboard_ids.TRAINING_MEMORY_UID),  # recorded series only
)
# alerts whose dashboard is not their area's
DASHBOARD_OF = {"GPUForeignProcess": dashboard_ids.GPU_HEALTH_UID}


def anchor(alertname: str) -> str:
    """The runbook section's anchor: GitHub's slug of a ``## AlertName`` heading."""
    return alertname.lower()


def dashboard_link(cfg: MonitoringConfig, uid: str) -> str:
    """``<dashboard_url>/d/<uid>``, scoped by the alert's labels (each only where the alert has it)."""
    params = "".join(
        f"{{{{ if $labels.{label} }}}}&var-{var}={{{{ $labels.{label} }}}}{{{{ end }}}}"
        for label, var in dashboard_ids.LINK_VARIABLES
    )
    return f"{cfg.dashboard_url}/d/{uid}?orgId=1{params}"


def _annotate(rule: dict[str, Any], cfg: MonitoringConfig, uid: str) -> None:
    name = rule["alert"]
    rule["annotations"]["runbook_url"] = cfg.runbook_url.format(anchor=anchor(name), alertname=name)
    if cfg.dashboard_url:
        rule["annotations"]["dashboard_url"] = dashboard_link(cfg, DASHBOARD_OF.get(name, uid))
    rule["labels"] = {**rule.get("labels", {}), **dict(cfg.extra_labels)}


def _of_job(cfg: MonitoringConfig, rule: dict[str, Any]) -> dict[str, Any]:
    """A GPU's cause alert carries the job identity of the GPU's ranks, so that Alertmanager groups it with
    the job's pages and lets it mute the job's symptoms (incidents.with_job)."""
    if rule.get("alert") in incidents.GPU_CAUSES:
        return {**rule, "expr": incidents.with_job(cfg, rule["expr"])}
    return rule


def _raw(cfg: MonitoringConfig) -> list[tuple[str, list[dict[str, Any]], str]]:
    return [(name, [_of_job(cfg, r) for r in rules(cfg)], uid) for name, rules, uid in AREAS]


def all_alert_names() -> set[str]:
    """Every alert the rules can hold, the opt-in ones included."""
    every = dataclasses.replace(DEFAULT, target_absent_for=DEFAULT.target_down_for)
    return {r["alert"] for _, rules, _ in _raw(every) for r in rules if "alert" in r}


def check_disabled_alerts(cfg: MonitoringConfig, source: str = "MonitoringConfig") -> None:
    unknown = sorted(set(cfg.disabled_alerts) - all_alert_names())
    if unknown:
        raise ConfigError(
            f"invalid monitoring setting disabled_alerts={shown(cfg.disabled_alerts)} (from {source}): "
            f"no alert named {', '.join(unknown)}; known: {', '.join(sorted(all_alert_names()))}"
        )


def groups(cfg: MonitoringConfig = DEFAULT) -> list[dict[str, Any]]:
    """The rule groups, as the ``groups:`` list of a Prometheus rule file."""
    check_disabled_alerts(cfg)
    out = []
    for name, rules, uid in _raw(cfg):
        kept = [copy.deepcopy(r) for r in rules if r.get("alert") not in cfg.disabled_alerts]
        for r in kept:
            if "alert" in r:
                _annotate(r, cfg, uid)
        if kept:
            out.append({"name": name, "rules": kept})
    return out


def alerts(cfg: MonitoringConfig = DEFAULT) -> list[dict[str, Any]]:
    """Every alerting rule, flat."""
    return [r for g in groups(cfg) for r in g["rules"] if "alert" in r]


def alert_names(cfg: MonitoringConfig = DEFAULT) -> list[str]:
    return sorted({r["alert"] for r in alerts(cfg)})
