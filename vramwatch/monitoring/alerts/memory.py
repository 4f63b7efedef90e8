"""GPU memory: a warning at 85% and a page at 95%, on the two ratios that matter.

- ``GPUMemoryUsageHigh``: NVML used / total of the card. It counts every process on the card
  (other jobs, CUDA contexts, NCCL buffers), so it is the one that sees a neighbour filling the card.
  On a MIG instance it is the instance's used / the instance's own total (``gpu_mig_memory_*``, labelled
  with the instance's uuid like the ranks on it): a full 3g.71gb slice of a 141 GB card is full, not half.
- ``TorchMemoryBudgetHigh``: the allocator's reserved bytes / the rank's budget
  (``torch_cuda_memory_limit_bytes`` = memory fraction x total). It is the one that sees a capped
  job (``set_per_process_memory_fraction``, several ranks sharing a card) run out while the card
  still has room.

Each name is a warning/critical pair, so Alertmanager can inhibit the warning under the page.
"""

from __future__ import annotations

from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.mig import memory_ratio
from vramwatch.monitoring.promql import (
    BUDGET_RATIO_RECORD,
    CRITICAL,
    DEVICE_WHERE,
    GPU_WHERE,
    MEMORY_RATIO_RECORD,
    VALUE_PERCENT,
    WARNING,
    alert,
    job_gpus,
    metric,
    num,
    percent,
)


def _levels(cfg: MonitoringConfig) -> tuple[tuple[str, float, str], ...]:
    return (
        (WARNING, cfg.memory_warning_ratio, cfg.memory_warning_for),
        (CRITICAL, cfg.memory_critical_ratio, cfg.memory_critical_for),
    )


def rules(cfg: MonitoringConfig) -> list[dict]:
    used = metric(cfg, "gpu_memory_used_bytes")
    total = metric(cfg, "gpu_memory_total_bytes")
    reserved = metric(cfg, "torch_cuda_memory_reserved_bytes")
    limit = metric(cfg, "torch_cuda_memory_limit_bytes")
    ratio_expr = memory_ratio(
        used, total, metric(cfg, "gpu_mig_memory_used_bytes"), metric(cfg, "gpu_mig_memory_total_bytes")
    )
    # first: the alerts read it in the same evaluation; the fleet dashboard reads it over long ranges
    out: list[dict] = [{"record": MEMORY_RATIO_RECORD, "expr": ratio_expr}]
    for severity, ratio, for_ in _levels(cfg):
        out.append(
            alert(
                "GPUMemoryUsageHigh",
                job_gpus(cfg, f"{metric(cfg, MEMORY_RATIO_RECORD)} > {num(ratio)}"),
                severity,
                f"GPU memory is above {percent(ratio)} of the card.",
                f"{GPU_WHERE} has {VALUE_PERCENT} of its memory in use (NVML used / total, every process "
                f"on the card; on a MIG instance, of the instance) for more than {for_}.",
                for_,
            )
        )
    # before the budget alerts: both levels read it, where each read both families before
    out.append({"record": BUDGET_RATIO_RECORD, "expr": f"{reserved} / {limit}"})
    for severity, ratio, for_ in _levels(cfg):
        out.append(
            alert(
                "TorchMemoryBudgetHigh",
                f"{metric(cfg, BUDGET_RATIO_RECORD)} > {num(ratio)}",
                severity,
                f"A rank's allocator holds more than {percent(ratio)} of its memory budget.",
                f"{DEVICE_WHERE}: the caching allocator reserves {VALUE_PERCENT} of the rank's budget "
                f"(reserved / torch_cuda_memory_limit_bytes) for more than {for_}.",
                for_,
            )
        )
    return out
