"""Stalls: a rank's heartbeat older than a bound derived from its own recent step times.

The bound is ``max(floor, stall_factor x mean step time over stall_window)``. When no step has
completed for a whole ``stall_window`` the mean is undefined (0/0) and the bound falls back to the
floor: a heartbeat older than the window is a stall whatever the step time was.

Split by what the rank's GPU does (rank series join GPU series on ``uuid`` through the allocator's
series, which carry both the rank and the GPU):

- busy stall (critical): utilisation high and power low, the signature of a hang (a deadlocked
  collective spins at 100% "utilisation" drawing little power). The signature is the evidence, so
  its floor (``busy_stall_min_seconds``) and ``for`` (``busy_stall_for``) are short: the page comes
  within floor + for + one evaluation interval of the last step (docs/runbooks.md#trainingstalled);
- idle stall (warning): anything else, including ranks without an NVML reading, on the longer
  ``stall_min_seconds`` and ``stall_for`` (input pipeline, evaluation, checkpointing).

Neither fires for one slow step of up to ``stall_factor`` x the mean: the bound is at least that.
"""

from __future__ import annotations

from vramwatch.monitoring import contract
from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.promql import (
    CRITICAL,
    RANK_WHERE,
    STEP_MEAN_RECORD,
    STEP_SKEW_RECORD,
    VALUE_DURATION,
    VALUE_RATIO,
    WARNING,
    alert,
    label,
    metric,
    num,
    percent,
    stall_bound,
    step_mean,
    step_skew,
)

_PER_GPU_ONLY = ",".join(x for x in contract.RANK_DEVICE if x not in contract.RANK)  # uuid,device
_GPU_JOIN = "gpu," + ",".join(x for x in contract.RANK_DEVICE if x != "uuid")  # gpu,device,rank,local_rank


def stalled_ranks(cfg: MonitoringConfig, floor: float | None = None) -> str:
    """Per rank: the heartbeat's age in seconds, where it exceeds the rank's bound (with ``floor``)."""
    hb = metric(cfg, "vramwatch_training_last_step_timestamp_seconds")
    bound = stall_bound(cfg, lambda name: metric(cfg, name), floor)
    return f"(time() - {hb})\n> (\n  {bound}\n)"


def busy_stalls(cfg: MonitoringConfig) -> str:
    """Per rank and GPU: ranks stalled past the busy floor whose GPU reads busy at low power."""
    alloc = metric(cfg, "torch_cuda_memory_allocated_bytes")
    util = metric(cfg, "gpu_utilization_ratio")
    power = metric(cfg, "gpu_power_watts")
    plimit = metric(cfg, "gpu_power_limit_watts")
    return (
        f"(\n{_indent(stalled_ranks(cfg, cfg.busy_stall_min_seconds))}\n)\n"
        f"* ignoring({_PER_GPU_ONLY}) group_right()\n({alloc} * 0 + 1)\n"
        f"and ignoring({_GPU_JOIN}) {util} >= {num(cfg.busy_utilization_ratio)}\n"
        f"and ignoring({_GPU_JOIN}) {power} / {plimit} <= {num(cfg.busy_power_ratio)}"
    )


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _why(cfg: MonitoringConfig, floor: float) -> str:
    return f"(bound: {cfg.stall_factor:g}x its mean step time over {cfg.stall_window}, at least {floor:g}s)"


def first_stopped(cfg: MonitoringConfig) -> str:
    """An annotation naming the rank of the alert's job whose newest step is the oldest: the one that
    stopped first (in a hung collective the others wait for it). Empty when the query finds none."""
    hb = "vramwatch_training_last_step_timestamp_seconds"
    matchers = [m for m in (cfg.selector,) if m] + [f"{name}=%q" for name in cfg.peer_labels]
    query = f"bottomk(1, {hb}{{{', '.join(matchers)}}})"
    args = " ".join(f"$labels.{name}" for name in cfg.peer_labels)
    return (
        f"{{{{ with printf {_go_string(query)} {args} | query }}}}{{{{ with first . }}}}"
        " The first of its job's ranks to stop: rank {{ .Labels.rank }}"
        "{{ if .Labels.job_id }} of job {{ .Labels.job_id }}{{ end }} on {{ .Labels.instance }}."
        "{{ end }}{{ end }}"
    )


def _go_string(text: str) -> str:
    """``text`` as a Go template string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def stragglers(cfg: MonitoringConfig) -> list[dict]:
    """The recording rules of step-time skew and the warning on them."""
    mean = step_mean(cfg, lambda name: metric(cfg, name))
    return [
        {"record": STEP_MEAN_RECORD, "expr": mean},
        {"record": STEP_SKEW_RECORD, "expr": step_skew(cfg, STEP_MEAN_RECORD)},
        alert(
            "TrainingRankStraggler",
            f"{STEP_SKEW_RECORD} > {num(cfg.straggler_ratio)}",
            WARNING,
            "One rank's steps are slower than its job's.",
            f"{RANK_WHERE} takes {VALUE_RATIO}x the median step time of its job's ranks (mean over "
            f"{cfg.straggler_window}; warns above {num(cfg.straggler_ratio)}x for {cfg.straggler_for}): a slow or "
            "throttled GPU, a contended host, a slower input pipeline on that rank, or uneven work.",
            cfg.straggler_for,
        ),
    ]


def rules(cfg: MonitoringConfig) -> list[dict]:
    return [
        alert(
            "TrainingStalled",
            busy_stalls(cfg),
            CRITICAL,
            "A rank stopped making progress while its GPU reads busy at low power (a hang).",
            f"{RANK_WHERE} has not completed a step for {VALUE_DURATION} "
            f"{_why(cfg, cfg.busy_stall_min_seconds)}, while its GPU "
            f"{label('uuid')} reads at least {percent(cfg.busy_utilization_ratio)} utilisation at no more "
            f"than {percent(cfg.busy_power_ratio)} of its power limit: the hang signature. "
            "Checkpoint-less work is being lost." + first_stopped(cfg),
            cfg.busy_stall_for,
        ),
        alert(
            "TrainingStalled",
            f"(\n{_indent(stalled_ranks(cfg))}\n)\nunless ignoring({_PER_GPU_ONLY})\n(\n{_indent(busy_stalls(cfg))}\n)",
            WARNING,
            "A rank stopped making progress.",
            f"{RANK_WHERE} has not completed a step for {VALUE_DURATION} {_why(cfg, cfg.stall_min_seconds)}; "
            "its GPU does not show the "
            "busy-at-low-power hang signature (idle, input pipeline, evaluation, checkpointing, or no "
            "NVML reading)." + first_stopped(cfg),
            cfg.stall_for,
        ),
        *stragglers(cfg),
    ]
