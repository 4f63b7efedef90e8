"""Fleet overview: every GPU of every job, worst first; stalled ranks; Xids; firing alerts."""

from __future__ import annotations

from vramwatch.monitoring import dashboard_ids, promql
from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.dashboards.common import (
    Scope,
    bar_panel,
    base_dashboard,
    dashboard,
    heartbeat_age,
    m,
    memory_limits,
    memory_pressure,
    q,
    qt,
    stall_bound,
    stat_panel,
    table_panel,
    thresholds,
    ts,
    units,
    xid_annotation,
)
from vramwatch.monitoring.promql import num

UID = dashboard_ids.FLEET_UID
TITLE = "vramwatch / Fleet overview"
# Prometheus's own series of the alerts it evaluates (not a vramwatch family)
ALERTS = "ALERTS"


def xid_events_in_range(s: Scope) -> str:
    """Per GPU and Xid: about how many events came in the selected time range, from the newest event's
    timestamp (only GPUs that had an Xid have one; the counters are 20 series a GPU)."""
    return promql.events_since(f"{m('gpu_last_xid_timestamp_seconds')}{s.gpu}", "$__range", "${__from:date:seconds}")


def build(cfg: MonitoringConfig) -> dashboard.Dashboard:
    s = Scope(cfg)
    # every card and every MIG instance, each against its own total
    pressure = memory_pressure(s)
    reserved, limit = m("torch_cuda_memory_reserved_bytes"), m("torch_cuda_memory_limit_bytes")
    stalled = f"({heartbeat_age(s)}) > ({stall_bound(cfg, s)})"
    firing = f'{ALERTS}{{alertstate="firing", {s.alerts}}}'
    d = base_dashboard(
        UID,
        TITLE,
        "Every GPU of every job ranked by memory pressure, stalled ranks, Xid "
        "events by host and the alerts firing now.",
        cfg,
    )
    d = d.annotation(xid_annotation(s))

    d = d.with_row(dashboard.Row("Now"))
    d = d.with_panel(stat_panel("GPUs", "GPUs reporting through NVML.", qt(f"count({m('gpu_info')}{s.gpu})")))
    d = d.with_panel(
        stat_panel("Ranks", "Training ranks publishing samples.", qt(f"count({m('vramwatch_rank_info')}{s.rank})"))
    )
    d = d.with_panel(
        stat_panel(
            "Stalled ranks",
            "Ranks whose heartbeat is older than their stall bound (see Training memory).",
            qt(f"count({stalled}) or vector(0)"),
            limits=thresholds((1, "red")),
        )
    )
    d = d.with_panel(
        stat_panel(
            "Firing alerts",
            "Alerts firing now in this Prometheus, for the selected jobs, namespaces and nodes "
            "(an alert without one of those labels counts).",
            qt(f"count({firing}) or vector(0)"),
            limits=thresholds((1, "red")),
        )
    )

    d = d.with_row(dashboard.Row("Memory pressure"))
    d = d.with_panel(
        table_panel(
            "GPUs by memory pressure",
            f"Every GPU of every selected job, the fullest first. NVML used / total covers every process on the "
            f"card (a MIG instance has a row of its own, against its own memory); reserved / limit is the highest "
            f"of the job's ranks on the GPU (a capped job). Orange above "
            f"{num(cfg.memory_warning_ratio)}, red above {num(cfg.memory_critical_ratio)}: the alert thresholds.",
            [
                qt(f"sort_desc({pressure})", ref="A"),
                qt(
                    f"max by (job, instance, uuid) ({reserved}{s.device} / {limit}{s.device})"
                    f" * on (job, instance, uuid) group_left (gpu)"
                    f" ({m('gpu_info')}{s.gpu} or {m('gpu_mig_info')}{s.gpu})",  # a MIG instance's ranks too
                    ref="B",
                ),
            ],
            columns={"A": "used / total", "B": "reserved / limit"},
            unit=units.PercentUnit,
            sort_by="used / total",
            limits=memory_limits(cfg),
            span=24,
            height=9,
        )
    )
    d = d.with_panel(
        ts(
            "Memory pressure, the ten fullest GPUs",
            "NVML used / total over time, the ten fullest at each step (at most 360 steps, a minute apart over "
            "6 h: every step ranks every GPU of the selection); dashed: the alert thresholds.",
            units.PercentUnit,
            [q(f"topk(10, {pressure})", "{{instance}} gpu{{gpu}}")],
            max_points=360,
            max_=1,
            limits=memory_limits(cfg),
            span=24,
        )
    )

    d = d.with_row(dashboard.Row("Progress, errors and alerts"))
    d = d.with_panel(
        table_panel(
            "Ranks by heartbeat age",
            f"Every rank, the oldest heartbeat first, with its mean step time over the last {cfg.stall_window} "
            f"and its stall bound ({num(cfg.stall_factor)} x the mean, at least {num(cfg.stall_min_seconds)} s). "
            f"A rank above its bound is stalled.",
            [
                qt(f"sort_desc({heartbeat_age(s)})", ref="A"),
                qt(f"{m(promql.STALL_MEAN_RECORD)}{s.rank} > 0", ref="B"),  # the record's 0: no step in the window
                qt(stall_bound(cfg, s), ref="C"),
            ],
            columns={"A": "heartbeat age", "B": "mean step", "C": "stall bound"},
            unit=units.Seconds,
            sort_by="heartbeat age",
            limits=thresholds((cfg.stall_min_seconds, "red")),
            color_columns=("heartbeat age",),
            hide=("local_rank",),
        )
    )
    d = d.with_panel(
        bar_panel(
            "Xid events by host",
            "Xid events in the selected time range on each host that had one (events between two scrapes "
            "count as one; the GPU health dashboard lists every event).",
            qt(f"sum by (instance) ({xid_events_in_range(s)})", "{{instance}}"),
            limits=thresholds((1, "red")),
        )
    )
    d = d.with_panel(
        table_panel(
            "Firing alerts",
            'ALERTS{alertstate="firing"}: the alerts firing now, for the selected jobs, namespaces and nodes '
            "(an alert without one of those labels shows).",
            [qt(firing)],
            hide=("Value", "alertstate"),
            sort_by="severity",
            sort_desc=False,
            span=24,
            no_value="no alert is firing",
        )
    )
    return d
