"""One frozen monitoring config feeds the alert rules and the dashboards (the mixin pattern).

Thresholds, windows, selectors and severities live here and nowhere else: the
dashboards draw their threshold lines from the same object, and a test rejects
threshold literals elsewhere. Override by constructing your own
``MonitoringConfig(...)`` (or ``dataclasses.replace(DEFAULT, ...)``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MonitoringConfig:
    # PromQL label matchers selecting vramwatch's series, e.g. 'job="vramwatch"'. Empty: all.
    selector: str = ""
    # GPU memory share of the card (NVML used / total) or of the per-process budget (reserved / limit).
    memory_warning_ratio: float = 0.85  # field notes: above 85% for 5 minutes is a warning
    memory_critical_ratio: float = 0.95  # ... above 95% is critical and pages
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
    # Xids that page (NVIDIA's catalogue: reset / reboot / RMA), and the app faults that only warn
    xid_critical: tuple[int, ...] = (48, 62, 64, 74, 79, 95, 119, 120, 46, 109, 140)
    xid_warning: tuple[int, ...] = (13, 31, 43, 45, 61, 63, 92, 94)
    runbook_url: str = "https://github.com/vramwatch/vramwatch/blob/main/docs/runbooks.md#{anchor}"
    dashboard_tags: tuple[str, ...] = ("vramwatch", "gpu", "pytorch")
    # extra labels put on every alert (e.g. team="ml-infra")
    extra_labels: tuple[tuple[str, str], ...] = ()


DEFAULT = MonitoringConfig()
