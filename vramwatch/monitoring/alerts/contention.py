"""Contention: someone else on the job's GPU, and one rank far above its peers."""

from __future__ import annotations

from vramwatch.monitoring.config import GIB, MonitoringConfig
from vramwatch.monitoring.promql import (
    DEVICE_WHERE,
    GPU_WHERE,
    VALUE_INT,
    VALUE_RATIO,
    WARNING,
    alert,
    job_gpus,
    metric,
    num,
)


def rules(cfg: MonitoringConfig) -> list[dict]:
    name = "torch_cuda_memory_reserved_bytes"
    reserved = metric(cfg, name)
    by = ", ".join(cfg.peer_labels)
    median = f"quantile by ({by}) (0.5, {reserved})"
    # exempt ranks still count in the median (it is robust to a few large ranks), they are never flagged
    exempt = " or ".join(metric(cfg, name, m) for m in cfg.rank_skew_exempt)
    flagged = f"({reserved} unless ({exempt}))" if exempt else reserved
    return [
        alert(
            "GPUForeignProcess",
            job_gpus(cfg, f"{metric(cfg, 'gpu_foreign_processes')} > 0"),
            WARNING,
            "A process that is not part of the job runs on one of its GPUs.",
            f"{GPU_WHERE} runs {VALUE_INT} compute process(es) that are not ranks of this job; they compete "
            "for its memory (gpu_foreign_process_memory_bytes) and time, a known cause of stalls.",
            cfg.foreign_process_for,
        ),
        alert(
            "TrainingRankMemorySkew",
            f"{flagged} / on({by}) group_left() {median} > {num(cfg.rank_skew_ratio)}\n"
            f"and {flagged} - on({by}) group_left() {median} > {num(cfg.rank_skew_min_bytes)}",
            WARNING,
            "One rank holds far more GPU memory than the median of its peers.",
            f"{DEVICE_WHERE} has reserved {VALUE_RATIO}x the median of its job's ranks for more than "
            f"{cfg.rank_skew_for} (flagged above {num(cfg.rank_skew_ratio)}x and "
            f"{num(cfg.rank_skew_min_bytes / GIB)} GiB more): uneven batches, a rank doing extra work "
            "(evaluation, logging), or a leak on one rank. A pipeline-parallel job's first and last stages "
            "are larger by design: exempt them (rank_skew_exempt).",
            cfg.rank_skew_for,
        ),
    ]
