"""Device health: Xid events, a lost GPU, ECC errors, remapped rows, clock throttling.

Xid alerts read both Xid families: ``increase()`` of the counter (pre-initialised at 0, so the
first event counts) or, for an Xid the watcher had not pre-initialised (its counter appears at 1,
which ``increase()`` misses), the age of ``gpu_last_xid_timestamp_seconds``.
"""

from __future__ import annotations

from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.promql import (
    CRITICAL,
    GPU_WHERE,
    VALUE,
    VALUE_INT,
    WARNING,
    alert,
    duration,
    job_gpus,
    label,
    metric,
    num,
    parse_duration,
    regex,
)


def xid_events(cfg: MonitoringConfig, xid_matcher: str) -> str:
    w = duration(cfg.xid_window)
    count = metric(cfg, "gpu_xid_errors_total", xid_matcher)
    last = metric(cfg, "gpu_last_xid_timestamp_seconds", xid_matcher)
    return f"increase({count}[{w}]) > 0\nor ((time() - {last}) < {num(parse_duration(cfg.xid_window))}) * 0 + 1"


def rules(cfg: MonitoringConfig) -> list[dict]:
    critical = regex(cfg.xid_critical)
    known = ", ".join(str(x) for x in cfg.xid_warning)
    xid_where = f"{GPU_WHERE} reported Xid {label('xid')}"
    events = f"(about {VALUE_INT} event(s) in the last {cfg.xid_window})"
    ecc = metric(cfg, "gpu_ecc_errors_total", 'type="uncorrected"')
    remapped = metric(cfg, "gpu_remapped_rows", 'kind=~"pending|failure"')
    throttle = metric(cfg, "gpu_clock_throttle", f'reason=~"{regex(cfg.throttle_reasons)}"')
    return [
        alert(
            "GPUXidError",
            xid_events(cfg, f'xid=~"{critical}"'),
            CRITICAL,
            "A GPU reported a critical Xid error (reset, reboot or RMA).",
            f"{xid_where} {events}: a fatal driver error; the GPU needs a reset or the node a reboot "
            "(see the runbook's Xid table).",
        ),
        alert(
            "GPUXidError",
            xid_events(cfg, f'xid!~"{critical}"'),
            WARNING,
            "A GPU reported an Xid error.",
            f"{xid_where} {events}, which does not page: the known ones ({known}) are application faults "
            "(the process that hit it must restart) or maintenance events (reset at the next drain).",
        ),
        alert(
            "GPULost",
            f"{metric(cfg, 'gpu_up')} == 0",
            CRITICAL,
            "NVML lost a GPU.",
            f"{GPU_WHERE} stopped answering NVML (GPU_IS_LOST: fallen off the bus). "
            "The node needs a reboot; the job on it is lost.",
            cfg.gpu_lost_for,
        ),
        alert(
            "GPUEccUncorrectedErrors",
            f"increase({ecc}[{duration(cfg.ecc_window)}]) > 0",
            WARNING,
            "A GPU reported uncorrected ECC errors.",
            f"{GPU_WHERE}: about {VALUE_INT} uncorrected (volatile) ECC error(s) in the last "
            f"{cfg.ecc_window}; the process whose memory was hit was killed or got corrupt data.",
        ),
        alert(
            "GPURemappedRows",
            f"{remapped} > 0",
            WARNING,
            "A GPU has memory rows waiting for a reset to be remapped, or failed to remap one.",
            f"{GPU_WHERE}: {VALUE} remapped row(s) of kind {label('kind')}; pending rows take effect "
            "only after a GPU reset, a failure means the GPU should be drained and replaced.",
            cfg.remapped_rows_for,
        ),
        alert(
            "GPUClockThrottled",
            job_gpus(cfg, f"{throttle} > 0", "reason"),
            WARNING,
            "A GPU's clocks are held down by a thermal or power limit.",
            f"{GPU_WHERE} has been throttled ({label('reason')}) for more than {cfg.throttle_for}: "
            "steps run slower than the hardware allows.",
            cfg.throttle_for,
        ),
    ]
