"""Recorded series only the dashboards read: what a panel would otherwise compute from raw families at
every step of a long range (the step-time quantiles read every bucket of every rank's histogram).

A group of their own, so that their cost never delays an alert's group."""

from __future__ import annotations

from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.promql import STEP_QUANTILE_RECORDS, duration, metric


def step_quantile(cfg: MonitoringConfig, quantile: float) -> str:
    """Per rank: the ``quantile`` of its step times over ``step_quantile_window`` (NaN while it makes no
    steps)."""
    buckets = metric(cfg, "vramwatch_training_step_duration_seconds_bucket")
    return f"histogram_quantile({quantile:g}, rate({buckets}[{duration(cfg.step_quantile_window)}]))"


def rules(cfg: MonitoringConfig) -> list[dict]:
    return [{"record": name, "expr": step_quantile(cfg, q)} for q, name in STEP_QUANTILE_RECORDS.items()]
