"""GPU health: what NVML says about each card, with the stall signature on one panel."""

from __future__ import annotations

from vramwatch.monitoring import dashboard_ids
from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.dashboards.common import (
    Scope,
    base_dashboard,
    dashboard,
    m,
    q,
    qt,
    right_axis,
    table_panel,
    thresholds,
    timeseries,
    ts,
    units,
    xid_annotation,
)
from vramwatch.monitoring.promql import num

UID = dashboard_ids.GPU_HEALTH_UID
TITLE = "vramwatch / GPU health"
GPU = "gpu{{gpu}} {{instance}}"
SINCE_FROM = "${__from:date:seconds}"


def bound_panel(s: Scope, legend: str, span: int) -> timeseries.Panel:
    """SM and tensor activity against DRAM bandwidth: is the GPU compute- or memory-bound?"""
    return ts(
        "Compute- or memory-bound?",
        "NVML GPM over one slow interval: the share of SMs busy and of time on tensor cores (compute) against "
        "the share of peak DRAM bandwidth used (memory). Tensor activity near SM activity and high: bound by "
        "matmuls (good for training). DRAM bandwidth near its ceiling while SM activity is lower: memory-bound "
        "(small batches, elementwise or attention kernels without fusion). All of them low while utilisation "
        "(a kernel ran at all) is high: the kernels are too small for the chip, or the GPU waits on the host, "
        "input or communication. Empty on GPUs without GPM (before Hopper, MIG, some VMs).",
        units.PercentUnit,
        [
            q(f"{m('gpu_sm_activity_ratio')}{s.gpu}", f"SM activity {legend}", "A"),
            q(f"{m('gpu_tensor_activity_ratio')}{s.gpu}", f"tensor activity {legend}", "B"),
            q(f"{m('gpu_dram_bandwidth_utilization_ratio')}{s.gpu}", f"DRAM bandwidth {legend}", "C"),
            q(f"{m('gpu_sm_occupancy_ratio')}{s.gpu}", f"SM occupancy {legend}", "D"),
        ],
        span=span,
        max_=1,
    )


def build(cfg: MonitoringConfig) -> dashboard.Dashboard:
    s = Scope(cfg)
    d = base_dashboard(
        UID,
        TITLE,
        "NVML readings of each GPU: power against utilisation (the busy-stall "
        "signature), temperature, clocks and throttling, compute- or memory-bound (GPM), PCIe and NVLink traffic, "
        "Xid events, memory and link errors, "
        "processes that are not the job's.",
        cfg,
    )
    d = d.annotation(xid_annotation(s))

    d = d.with_row(dashboard.Row("Power and utilisation"))
    power, limit = m("gpu_power_watts"), m("gpu_power_limit_watts")
    stall_power = num(cfg.busy_power_ratio)
    p = ts(
        "Power against utilisation",
        f"Power draw (left axis) and utilisation (right axis) of each GPU. A stalled job looks busy: "
        f"utilisation stays pinned above {num(cfg.busy_utilization_ratio)} (dashed, right) while power falls "
        f"under {stall_power} x the power limit (the dashed stall level) and steps stop. Utilisation alone "
        f"hides a hang; power plus step progress reveals it. The busy-stall alert uses these two lines.",
        units.Watt,
        [
            q(f"{power}{s.gpu}", f"power {GPU}", "A"),
            q(f"{stall_power} * {limit}{s.gpu}", f"stall level {GPU}", "B"),
            q(f"{m('gpu_utilization_ratio')}{s.gpu}", f"utilisation {GPU}", "C"),
        ],
        span=24,
        height=9,
        dashed={"B": "orange"},
    )
    p = right_axis(p, "C", units.PercentUnit, min_=0, max_=1, limits=thresholds((cfg.busy_utilization_ratio, "orange")))
    d = d.with_panel(p)
    d = d.with_panel(
        ts(
            "Temperature",
            "GPU core temperature.",
            units.Celsius,
            [q(f"{m('gpu_temperature_celsius')}{s.gpu}", GPU)],
            min_=None,
        )
    )
    d = d.with_panel(
        ts(
            "Clocks",
            "SM and memory clocks. A clock held down shows with a throttle reason below.",
            units.Hertz,
            [
                q(f"{m('gpu_sm_clock_hertz')}{s.gpu}", f"SM {GPU}", "A"),
                q(f"{m('gpu_memory_clock_hertz')}{s.gpu}", f"memory {GPU}", "B"),
            ],
        )
    )
    d = d.with_panel(
        ts(
            "Clock throttle reasons",
            "How many of the selected GPUs have their clocks held down, by reason (NVML clocks event reasons). "
            "gpu_idle and applications_clocks_setting are normal; thermal and power reasons cost speed.",
            units.Short,
            [q(f"sum by (reason) ({m('gpu_clock_throttle')}{s.gpu})", "{{reason}}")],
            stepped=True,
        )
    )
    d = d.with_panel(
        ts(
            "GPU memory utilisation",
            "Share of time device memory was read or written.",
            units.PercentUnit,
            [q(f"{m('gpu_memory_utilization_ratio')}{s.gpu}", GPU)],
            max_=1,
        )
    )

    d = d.with_row(dashboard.Row("Activity (NVML GPM, Hopper and newer)"))
    d = d.with_panel(bound_panel(s, GPU, span=12))
    p = ts(
        "PCIe and NVLink throughput",
        "Bytes per second over PCIe (host copies, data loading, offload) and over all NVLinks together "
        "(collectives between GPUs), each averaged over one slow interval (NVML GPM). Empty on GPUs "
        "without GPM; NVLink lines are absent on GPUs without NVLink.",
        units.BytesPerSecondIEC,
        [
            q(f"{m('gpu_pcie_rx_bytes_per_second')}{s.gpu}", f"PCIe in {GPU}", "A"),
            q(f"{m('gpu_pcie_tx_bytes_per_second')}{s.gpu}", f"PCIe out {GPU}", "B"),
            q(f"{m('gpu_nvlink_rx_bytes_per_second')}{s.gpu}", f"NVLink in {GPU}", "C"),
            q(f"{m('gpu_nvlink_tx_bytes_per_second')}{s.gpu}", f"NVLink out {GPU}", "D"),
        ],
        span=12,
    )
    d = d.with_panel(p)

    d = d.with_row(dashboard.Row("Errors and other processes"))
    last_xid = f"{m('gpu_last_xid_timestamp_seconds')}{s.gpu}"
    d = d.with_panel(
        table_panel(
            "Xid events",
            "Xid errors the driver reported during the selected time range (also drawn as annotations): the "
            "newest event of each Xid on each GPU and the events counted since the exporter started. 79: the GPU "
            "fell off the bus (needs a reboot); 13 and 31: a process's CUDA context is corrupt (others may go on). "
            f"Xids that page: {', '.join(map(str, cfg.xid_critical))}; that warn: "
            f"{', '.join(map(str, cfg.xid_warning))}.",
            [
                qt(f"1000 * ({last_xid} > {SINCE_FROM})", ref="A"),
                qt(
                    f"{m('gpu_xid_errors_total')}{s.gpu} and on (job, instance, uuid, xid) ({last_xid} > {SINCE_FROM})",
                    ref="B",
                ),
            ],
            columns={"A": "newest event", "B": "events"},
            column_units={"newest event": units.DatetimeISO},
            sort_by="newest event",
            no_value="no Xid events in this range",
        )
    )
    d = d.with_panel(
        ts(
            "ECC errors, remapped rows, PCIe replays, NVLink errors",
            "Volatile ECC error counters (since the driver loaded), remapped memory rows (pending: the GPU needs a "
            "reset; failure: it needs service), the PCIe replay counter and the NVLink replay, recovery and CRC "
            "errors of the GPU's links together (which link: nvidia-smi nvlink -e). Any step up is worth a look.",
            units.Short,
            [
                q(f"{m('gpu_ecc_errors_total')}{s.gpu}", f"ECC {{{{type}}}} {GPU}", "A"),
                q(f"{m('gpu_remapped_rows')}{s.gpu}", f"remapped rows {{{{kind}}}} {GPU}", "B"),
                q(f"{m('gpu_pcie_replays_total')}{s.gpu}", f"PCIe replays {GPU}", "C"),
                q(f"{m('gpu_nvlink_errors_total')}{s.gpu}", f"NVLink {{{{type}}}} {GPU}", "D"),
            ],
            stepped=True,
        )
    )
    p = ts(
        "Foreign processes",
        "Compute processes on the GPU that are not ranks of this job (left) and the memory they hold "
        "(right). A second process competing for the card has caused stalls; exclusive use fixes them.",
        units.Short,
        [
            q(f"{m('gpu_foreign_processes')}{s.gpu}", f"processes {GPU}", "A"),
            q(f"{m('gpu_foreign_process_memory_bytes')}{s.gpu}", f"memory {GPU}", "B"),
        ],
        stepped=True,
    )
    d = d.with_panel(right_axis(p, "B", units.BytesIEC, min_=0))
    d = d.with_panel(
        ts(
            "GPU answering",
            "1 while NVML answers for the GPU, 0 once it is lost (GPU_IS_LOST) or stops answering.",
            units.Short,
            [q(f"{m('gpu_up')}{s.gpu}", GPU)],
            max_=1,
            stepped=True,
            limits=thresholds((1, "green"), base="red"),
        )
    )
    d = d.with_panel(
        table_panel(
            "GPUs",
            "Identity of each GPU: name, driver, PCI bus id, MIG mode.",
            [qt(f"{m('gpu_info')}{s.gpu}")],
            hide=("Value",),
        )
    )
    return d
