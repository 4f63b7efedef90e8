"""Recorded series only the dashboards read: what a panel would otherwise compute from raw families at
every step of a long range (each rank's step-time skew against its job; the peak FLOP/s per rank read every
GPU of the fleet once per name pattern, whatever job was chosen).

A group of their own, so that their cost never delays an alert's group. The step-time quantiles are not
recorded: every bucket of every rank at every evaluation cost a fleet's Prometheus more than any alert
group, for a panel that reads one job's ranks when it is opened (docs/scale.md)."""

from __future__ import annotations

from vramwatch.monitoring.alerts import progress
from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.promql import PEAK_FLOPS_RECORD, go_string, metric, num


def rank_peak_flops(cfg: MonitoringConfig) -> str:
    """Per rank: the peak FLOP/s of the GPUs it allocates on, each GPU's from the first
    ``gpu_peak_flops`` pattern its name matches (absent for a GPU no pattern matches)."""
    peaks = " or ".join(
        f"({metric(cfg, 'gpu_info', f'name=~{go_string(p)}')} * 0 + {num(f)})" for p, f in cfg.gpu_peak_flops
    )
    alloc = metric(cfg, "torch_cuda_memory_allocated_bytes")
    return f"sum without(uuid, device) (\n  ({peaks})\n  * on(job, instance, uuid) group_right() ({alloc} * 0 + 1)\n)"


def rules(cfg: MonitoringConfig) -> list[dict]:
    return [progress.step_skew_record(cfg), {"record": PEAK_FLOPS_RECORD, "expr": rank_peak_flops(cfg)}]
