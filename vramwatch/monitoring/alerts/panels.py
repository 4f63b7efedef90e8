"""Recorded series only the dashboards read: what a panel would otherwise compute from raw families at
every step of a long range (the step-time quantiles read every bucket of every rank's histogram; the
peak FLOP/s per rank read every GPU of the fleet once per name pattern, whatever job was chosen).

A group of their own, so that their cost never delays an alert's group."""

from __future__ import annotations

from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.promql import PEAK_FLOPS_RECORD, STEP_QUANTILE_RECORDS, duration, go_string, metric, num


def step_quantile(cfg: MonitoringConfig, quantile: float) -> str:
    """Per rank: the ``quantile`` of its step times over ``step_quantile_window`` (NaN while it makes no
    steps)."""
    buckets = metric(cfg, "vramwatch_training_step_duration_seconds_bucket")
    return f"histogram_quantile({quantile:g}, rate({buckets}[{duration(cfg.step_quantile_window)}]))"


def rank_peak_flops(cfg: MonitoringConfig) -> str:
    """Per rank: the peak FLOP/s of the GPUs it allocates on, each GPU's from the first
    ``gpu_peak_flops`` pattern its name matches (absent for a GPU no pattern matches)."""
    peaks = " or ".join(
        f"({metric(cfg, 'gpu_info', f'name=~{go_string(p)}')} * 0 + {num(f)})" for p, f in cfg.gpu_peak_flops
    )
    alloc = metric(cfg, "torch_cuda_memory_allocated_bytes")
    return f"sum without(uuid, device) (\n  ({peaks})\n  * on(job, instance, uuid) group_right() ({alloc} * 0 + 1)\n)"


def rules(cfg: MonitoringConfig) -> list[dict]:
    quantiles = [{"record": name, "expr": step_quantile(cfg, q)} for q, name in STEP_QUANTILE_RECORDS.items()]
    return [*quantiles, {"record": PEAK_FLOPS_RECORD, "expr": rank_peak_flops(cfg)}]
