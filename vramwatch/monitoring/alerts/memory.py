"""GPU memory: a warning at 85% and a page at 95%, on the two ratios that matter.

- ``GPUMemoryUsageHigh``: NVML used / total of the card. It counts every process on the card
  (other jobs, CUDA contexts, NCCL buffers), so it is the one that sees a neighbour filling the card.
- ``TorchMemoryBudgetHigh``: the allocator's reserved bytes / the rank's budget
  (``torch_cuda_memory_limit_bytes`` = memory fraction x total). It is the one that sees a capped
  job (``set_per_process_memory_fraction``, several ranks sharing a card) run out while the card
  still has room.

Each name is a warning/critical pair, so Alertmanager can inhibit the warning under the page.
"""

from __future__ import annotations

from vramwatch.monitoring.alerts.promql import (
    CRITICAL,
    DEVICE_WHERE,
    GPU_WHERE,
    VALUE_PERCENT,
    WARNING,
    alert,
    job_gpus,
    metric,
    num,
    percent,
)
from vramwatch.monitoring.config import MonitoringConfig


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
    out = []
    for severity, ratio, for_ in _levels(cfg):
        out.append(
            alert(
                "GPUMemoryUsageHigh",
                job_gpus(cfg, f"{used} / {total} > {num(ratio)}"),
                severity,
                f"GPU memory is above {percent(ratio)} of the card.",
                f"{GPU_WHERE} has {VALUE_PERCENT} of its memory in use (NVML used / total, every process "
                f"on the card) for more than {for_}.",
                for_,
            )
        )
    for severity, ratio, for_ in _levels(cfg):
        out.append(
            alert(
                "TorchMemoryBudgetHigh",
                f"{reserved} / {limit} > {num(ratio)}",
                severity,
                f"A rank's allocator holds more than {percent(ratio)} of its memory budget.",
                f"{DEVICE_WHERE}: the caching allocator reserves {VALUE_PERCENT} of the rank's budget "
                f"(reserved / torch_cuda_memory_limit_bytes) for more than {for_}.",
                for_,
            )
        )
    return out
