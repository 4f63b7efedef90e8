"""One frozen monitoring config feeds the alert rules and the dashboards (the mixin pattern).

Thresholds, windows, selectors and severities live here and nowhere else: the
dashboards draw their threshold lines from the same object, and a test rejects
threshold literals elsewhere. Override by constructing your own
``MonitoringConfig(...)`` (or ``dataclasses.replace(DEFAULT, ...)``).

Every time quantity (``*_for``, ``*_window``, ``*_seconds``, ``leak_horizon_hours``) scales
together through :meth:`MonitoringConfig.scaled`: the end-to-end test runs the shipped rules
with ``DEFAULT.scaled(1 / 60)`` (a 5m ``for`` becomes 5s).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from vramwatch.monitoring import contract

GIB = 1 << 30


@dataclass(frozen=True)
class MonitoringConfig:
    # PromQL label matchers selecting vramwatch's series, e.g. 'job="vramwatch"'. Empty: all.
    selector: str = ""
    # GPU memory share of the card (NVML used / total) or of the per-process budget (reserved / limit).
    memory_warning_ratio: float = 0.85  # above it a step's peak has little room left: someone should look
    memory_critical_ratio: float = 0.95  # above it the next peak is likely an OOM: page
    memory_warning_for: str = "5m"
    memory_critical_for: str = "1m"
    # fragmentation worth a warning once memory is also high
    fragmentation_ratio: float = 0.3
    # a rank stalls when its heartbeat is older than this many times its recent mean step time ...
    stall_factor: float = 10.0
    # ... and never sooner than this (seconds), so 2 ms steps do not page on a GC pause
    stall_min_seconds: float = 120.0
    stall_for: str = "2m"
    # "busy stall": utilisation at least this while power is at most this share of the limit
    busy_utilization_ratio: float = 0.9
    busy_power_ratio: float = 0.35
    # leak: memory projected to run out within this many hours
    leak_horizon_hours: float = 4.0
    # exporter self-health
    sample_stale_seconds: float = 60.0
    # Xids that page (NVIDIA's catalogue: reset / reboot / RMA), and the app faults that only warn;
    # the server pre-initialises the defaults' counters, so they are defined in the contract
    xid_critical: tuple[int, ...] = contract.XID_CRITICAL
    xid_warning: tuple[int, ...] = contract.XID_WARNING
    runbook_url: str = "https://github.com/vramwatch/vramwatch/blob/main/docs/runbooks.md#{anchor}"
    dashboard_tags: tuple[str, ...] = ("vramwatch", "gpu", "pytorch")
    # extra labels put on every alert (e.g. team="ml-infra")
    extra_labels: tuple[tuple[str, str], ...] = ()

    # matchers selecting vramwatch's scrape targets in `up` (`up` exists for every target, so it needs
    # one). Matches job="vramwatch" (static, compose, deploy/kubernetes' PodMonitor) and
    # "<namespace>/vramwatch" (a PodMonitor without a job relabeling). Targets of other jobs count too
    # once they served vramwatch_build_info within target_seen_window (e.g. annotation discovery).
    target_selector: str = 'job=~".*vramwatch.*"'
    target_seen_window: str = "1h"
    # labels that tell one training job apart across its nodes (the peers in the rank-skew rule). A
    # label a setup lacks is empty on every series, so the default covers static configs (job), the
    # shipped PodMonitor (namespace + the pod's job-name labels) and annotation discovery (job_name).
    job_labels: tuple[str, ...] = (
        "job",
        "namespace",
        "batch_kubernetes_io_job_name",
        "training_kubeflow_org_job_name",
        "job_name",
    )
    # device alerts about memory, throttling and foreign processes only for GPUs a rank of the job uses
    # (with `gpus: all` the server also reports the node's other GPUs). Xid and lost GPUs: every GPU.
    job_gpus_only: bool = True
    # allocator: more than this many cudaMalloc retries (cache flushes) within the window warn
    alloc_retries_max: float = 2.0
    alloc_retry_window: str = "15m"
    # an out-of-memory error raised by the allocator within the window warns
    oom_window: str = "15m"
    fragmentation_for: str = "15m"
    # leak: predict_linear over this window; the series must be at least this old, and the
    # projection must hold for leak_for (so the warm-up ramp does not count as a leak)
    leak_window: str = "1h"
    leak_for: str = "30m"
    # mean step time over this window (a stall longer than the window falls back to stall_min_seconds)
    stall_window: str = "30m"
    # Xid events within this window alert (resolves when the window has passed)
    xid_window: str = "15m"
    gpu_lost_for: str = "1m"
    ecc_window: str = "15m"
    remapped_rows_for: str = "5m"
    # throttle reasons (gpu_clock_throttle{reason}, names from the NVML collector's THROTTLE_REASONS)
    # worth a warning; sw_power_cap is normal under full load, gpu_idle is no trouble
    throttle_reasons: tuple[str, ...] = (
        "hw_slowdown",
        "hw_thermal_slowdown",
        "sw_thermal_slowdown",
        "hw_power_brake_slowdown",
    )
    throttle_for: str = "10m"
    foreign_process_for: str = "5m"
    # rank skew: a rank's reserved bytes above this many times the median of its job's ranks,
    # and at least this many bytes above it
    rank_skew_ratio: float = 1.5
    rank_skew_min_bytes: float = float(4 * GIB)
    rank_skew_for: str = "15m"
    target_down_for: str = "5m"
    # `absent(up{target_selector})` for this long alerts; empty: no such rule (between jobs no target
    # is the normal state of a per-job exporter)
    target_absent_for: str = ""
    sample_stale_for: str = "1m"
    collector_down_for: str = "5m"

    def scaled(self, factor: float) -> MonitoringConfig:
        """The same rules on a faster (factor < 1) or slower clock: every time quantity times factor."""
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.endswith(("_for", "_window")) and v:
                changes[f.name] = format_duration(parse_duration(v) * factor)
            elif f.name.endswith(("_seconds", "_hours")):
                changes[f.name] = v * factor
        return dataclasses.replace(self, **changes)

    @property
    def leak_horizon_seconds(self) -> float:
        return self.leak_horizon_hours * 3600.0


DEFAULT = MonitoringConfig()
# the PrometheusRule's `release` label: kube-prometheus-stack selects rules by it
DEFAULT_RELEASE = "kube-prometheus-stack"

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration such as ``1h30m`` or ``500ms``."""
    parts = _DURATION.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    """The shortest Prometheus duration for ``seconds`` (rounded to milliseconds)."""
    ms = round(seconds * 1000)
    if ms <= 0:
        return "0s"
    out = ""
    for unit in ("d", "h", "m", "s", "ms"):
        size = round(_UNITS[unit] * 1000)
        n, ms = divmod(ms, size)
        if n:
            out += f"{n}{unit}"
    return out
