"""PromQL helpers the alert rules, the dashboards and the Helm chart share: selectors from the contract,
templates, rule dicts. A leaf below all three (it imports only the contract and the config)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vramwatch.monitoring import contract
from vramwatch.monitoring.config import MonitoringConfig, format_duration, parse_duration

CRITICAL = "critical"  # pages
WARNING = "warning"  # a ticket, not a page

# the labels a rank's allocator series carry beyond the target's own (contract.RANK_DEVICE)
RANK_DEVICE = ",".join(contract.RANK_DEVICE)
_HISTOGRAM_SUFFIXES = ("_sum", "_count", "_bucket")


def metric(cfg: MonitoringConfig, name: str, *matchers: str) -> str:
    """``name{selector,matchers}`` for a family of the contract (histogram series included) or a recorded
    series of :data:`RECORDS` (which keeps its sources' labels, so the selector matches it too)."""
    base = name
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in contract.BY_NAME:
            base = name[: -len(suffix)]
    if base not in RECORDS:
        contract.spec(base)  # KeyError: not in the contract
    parts = [m for m in (cfg.selector, *matchers) if m]
    return name + ("{" + ", ".join(parts) + "}" if parts else "")


def up(cfg: MonitoringConfig) -> str:
    return "up{" + cfg.target_selector + "}"


def regex(values: tuple[Any, ...]) -> str:
    return "|".join(str(v) for v in values)


def duration(text: str) -> str:
    """A config duration as PromQL writes it (normalised, so scaled configs stay valid)."""
    return format_duration(parse_duration(text))


def num(value: float) -> str:
    """A threshold as PromQL text: 0.85, 120, 4294967296."""
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


def percent(ratio: float) -> str:
    """0.85 -> '85%', 0.355 -> '35.5%'."""
    text = f"{ratio:.4%}"[:-1]
    return (text.rstrip("0").rstrip(".") if "." in text else text) + "%"


def label(name: str) -> str:
    return "{{ $labels." + name + " }}"


VALUE = "{{ $value }}"
VALUE_PERCENT = "{{ $value | humanizePercentage }}"
VALUE_BYTES = "{{ $value | humanize1024 }}B"
VALUE_DURATION = "{{ $value | humanizeDuration }}"
VALUE_RATIO = '{{ $value | printf "%.1f" }}'
VALUE_INT = '{{ $value | printf "%.0f" }}'

# who a rank alert is about, and where the GPU is; the job only where the rank has one (a rank of a
# version before job ids has none)
_OF_JOB = "{{ if $labels.job_id }} of job " + label("job_id") + "{{ end }}"
RANK_WHERE = f"rank {label('rank')} (local rank {label('local_rank')}){_OF_JOB} on {label('instance')}"
GPU_WHERE = "GPU " + label("gpu") + " (" + label("uuid") + ") on " + label("instance")
DEVICE_WHERE = RANK_WHERE + ", cuda:" + label("device") + " (" + label("uuid") + ")"


def job_gpus(cfg: MonitoringConfig, expr: str, *labels: str) -> str:
    """Keep a per-GPU expression only for GPUs a rank of the job holds (if the config says so).

    ``labels``: the expression's labels beyond the GPU's own (e.g. ``reason``)."""
    if not cfg.job_gpus_only:
        return expr
    ignore = ",".join(("gpu", *labels, *(x for x in contract.RANK_DEVICE if x != "uuid")))
    return f"{expr}\nand ignoring({ignore})\n{metric(cfg, 'torch_cuda_memory_allocated_bytes')}"


def alert(
    name: str,
    expr: str,
    severity: str,
    summary: str,
    description: str,
    for_: str = "",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": name, "expr": expr}
    if for_ and parse_duration(for_) > 0:
        rule["for"] = duration(for_)
    rule["labels"] = {"severity": severity, **(labels or {})}
    rule["annotations"] = {"summary": summary, "description": description}
    return rule


def stall_bound(cfg: MonitoringConfig, series: Callable[[str], str], floor: float | None = None) -> str:
    """How old a rank's heartbeat may get before it counts as stalled; alerts and dashboards share it.

    ``stall_factor`` x the rank's mean step time over ``stall_window``, at least ``floor`` (default
    ``stall_min_seconds``, the idle stall's; the busy stall passes ``busy_stall_min_seconds``); when
    no step completed in the whole window the recorded mean is 0 (:func:`stall_mean`) and the bound is
    the floor. ``series(name)`` renders a family with its label matchers.
    """
    low = num(cfg.stall_min_seconds if floor is None else floor)
    return f"clamp_min({num(cfg.stall_factor)} * {series(STALL_MEAN_RECORD)}, {low})"


def stall_mean(cfg: MonitoringConfig) -> str:
    """Per rank with a heartbeat: the mean step time over ``stall_window``, 0 where no step completed in it
    (0/0), recorded as :data:`STALL_MEAN_RECORD` for :func:`stall_bound`. The fallback lives here, read once
    per evaluation, rather than beside every bound that reads the record."""
    w = duration(cfg.stall_window)
    h = "vramwatch_training_step_duration_seconds"
    last = metric(cfg, "vramwatch_training_last_step_timestamp_seconds")
    return f"rate({metric(cfg, h + '_sum')}[{w}]) / rate({metric(cfg, h + '_count')}[{w}]) > 0\nor {last} * 0"


# Recorded series that rules and dashboards share (level:metric:operations). Each is computed once per
# evaluation, so that alerts and panels over long ranges read one small series instead of the raw families.
# Per rank: pace group: the mean step time over straggler_window, own work per step (step time less collective
# waits) and data wait per step; stragglers group: the last two over their job's median; panels group: the
# step time over its job's median; stall-window group: the mean step time over stall_window (the stall
# bound's); progress group: the heartbeat's age where the rank is stalled past the busy floor with the hang
# signature. Per GPU: device group: the hang signature (busy at low power), only where it shows.
STEP_MEAN_RECORD = "vramwatch:training_step_duration_seconds:mean"
STEP_SKEW_RECORD = "vramwatch:training_step_duration_seconds:skew_ratio"
STALL_MEAN_RECORD = "vramwatch:training_step_duration_seconds:stall_window_mean"
BUSY_STALL_RECORD = "vramwatch:training_busy_stall:age_seconds"
HANG_SIGNATURE_RECORD = "vramwatch:gpu_hang_signature:utilization_ratio"
OWN_MEAN_RECORD = "vramwatch:training_own_seconds_per_step:mean"
OWN_SKEW_RECORD = "vramwatch:training_own_seconds_per_step:skew_ratio"
INPUT_WAIT_MEAN_RECORD = "vramwatch:training_data_wait_seconds_per_step:mean"
INPUT_WAIT_SKEW_RECORD = "vramwatch:training_data_wait_seconds_per_step:skew_ratio"
# panels group: per rank, the peak dense BF16 FLOP/s of the GPU(s) it allocates on (the MFU panel's divisor)
PEAK_FLOPS_RECORD = "vramwatch:gpu_peak_flops:per_rank"
# leak group: per rank, the step peak extrapolated over leak_window to leak_horizon_hours ahead
LEAK_PROJECTION_RECORD = "vramwatch:torch_cuda_memory_step_peak_allocated_bytes:predict_linear"
# health group: per GPU and Xid, the events of the last xid_window (only where there were any)
XID_EVENTS_RECORD = "vramwatch:gpu_xid_errors:recent"
# health group: per GPU, the job identity of the ranks that used it lately (incidents.gpu_jobs)
GPU_JOB_RECORD = "vramwatch:gpu_job:newest"
# recovery group: per GPU, the recovery action NVML asks for (only where it asks for one)
RECOVERY_ACTION_RECORD = "vramwatch:gpu_recovery_action:pending"
# memory group: per card or MIG instance, NVML used / total; per rank and device, reserved / its budget
MEMORY_RATIO_RECORD = "vramwatch:gpu_memory_used_bytes:ratio"
BUDGET_RATIO_RECORD = "vramwatch:torch_cuda_memory_reserved_bytes:limit_ratio"
RECORDS = (
    STEP_MEAN_RECORD,
    STEP_SKEW_RECORD,
    STALL_MEAN_RECORD,
    BUSY_STALL_RECORD,
    HANG_SIGNATURE_RECORD,
    OWN_MEAN_RECORD,
    OWN_SKEW_RECORD,
    INPUT_WAIT_MEAN_RECORD,
    INPUT_WAIT_SKEW_RECORD,
    PEAK_FLOPS_RECORD,
    LEAK_PROJECTION_RECORD,
    XID_EVENTS_RECORD,
    GPU_JOB_RECORD,
    RECOVERY_ACTION_RECORD,
    MEMORY_RATIO_RECORD,
    BUDGET_RATIO_RECORD,
)


def events_since(last: str, window: str, since: str) -> str:
    """Per series of a newest-event timestamp (``gpu_last_xid_timestamp_seconds``): about how many events came
    in the last ``window``, which began at ``since`` (a PromQL scalar). The timestamp changes with each event:
    its changes in the window, plus its oldest value there if that came inside the window. Events between
    two scrapes count as one. It reads only the series of events that happened, where the pre-initialised
    counters would be read for every GPU and Xid."""
    return f"changes({last}[{window}]) + (min_over_time({last}[{window}]) > bool {since})"


def step_mean(cfg: MonitoringConfig, series: Callable[[str], str]) -> str:
    """Per rank: the mean step time over ``straggler_window`` (absent while the rank makes no steps)."""
    w = duration(cfg.straggler_window)
    h = "vramwatch_training_step_duration_seconds"
    return f"(rate({series(h + '_sum')}[{w}]) / rate({series(h + '_count')}[{w}]) > 0)"


def step_skew(cfg: MonitoringConfig, mean: str) -> str:
    """Per rank: its mean step time over the median of its job's ranks (1: in step with them)."""
    by = ", ".join(cfg.peer_labels)
    return f"{mean}\n/ on({by}) group_left()\nquantile by ({by}) (0.5, {mean})"


def go_string(text: str) -> str:
    """``text`` as a Go template string literal (an annotation's ``printf "..." | query``)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
