"""Device health: Xid events, NVML's recovery action, a lost GPU, ECC errors, remapped rows, throttling.

Xid alerts read ``gpu_last_xid_timestamp_seconds``, which exists only for the Xids a GPU has had: a few
series in a fleet, where the pre-initialised counters are 20 a GPU for every evaluation to read.

Which Xids page follows their ``action`` label, the bucket of NVIDIA's Xid catalogue
(:mod:`vramwatch.monitoring.xid_catalogue`): a reset, a reboot or support pages, restart_app and the
other actionable buckets (and a code the catalogue lacks) warn, ``ignore`` never alerts, and Xid 45
(cleanup after another error) warns only when no other Xid came on the node in the window, so a flood
of it never pages. ``xid_critical`` / ``xid_warning`` move single codes whatever their action.
"""

from __future__ import annotations

from vramwatch.monitoring import xid_catalogue
from vramwatch.monitoring.alerts import incidents, progress
from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.promql import (
    CRITICAL,
    GPU_JOB_RECORD,
    GPU_WHERE,
    HANG_SIGNATURE_RECORD,
    RECOVERY_ACTION_RECORD,
    VALUE,
    VALUE_INT,
    WARNING,
    XID_EVENTS_RECORD,
    alert,
    duration,
    events_since,
    job_gpus,
    label,
    metric,
    num,
    parse_duration,
    regex,
)


def recent_xids(cfg: MonitoringConfig) -> str:
    """Per GPU and Xid: about how many events came in the last ``xid_window``, where any did. Recorded once
    as XID_EVENTS_RECORD for the alerts below."""
    seconds = num(parse_duration(cfg.xid_window))
    last = metric(cfg, "gpu_last_xid_timestamp_seconds")
    return f"{events_since(last, duration(cfg.xid_window), f'time() - {seconds}')}\nand time() - {last} < {seconds}"


def xid_events(cfg: MonitoringConfig, *matchers: str) -> str:
    return metric(cfg, XID_EVENTS_RECORD, *matchers)


def _either(*exprs: str) -> str:
    return "\nor\n".join(f"(\n{e}\n)" for e in exprs)


def _advice(label_name: str, advice: dict[str, str]) -> str:
    """A template naming what to do for the alert's ``label_name`` value (one branch per known value)."""
    branches = "".join(
        ("{{ if " if i == 0 else "{{ else if ") + f'eq $labels.{label_name} "{value}" }}}}{text}'
        for i, (value, text) in enumerate(advice.items())
    )
    return branches + "{{ else }}see the runbook{{ end }}"


def xid_rules(cfg: MonitoringConfig) -> list[dict]:
    critical, warning = regex(cfg.xid_critical), regex(cfg.xid_warning)
    page = _either(
        xid_events(cfg, f'action=~"{regex(xid_catalogue.PAGE_ACTIONS)}"', f'xid!~"{warning}"'),
        xid_events(cfg, f'xid=~"{critical}"'),
    )
    # Xid 45 alone: "unless" binds tighter than "or", so both sides are bracketed
    solo = xid_events(cfg, f'action="{xid_catalogue.SOLO_ACTION}"', f'xid!~"{critical}"', f'xid!~"{warning}"')
    others = xid_events(cfg, f'action!="{xid_catalogue.SOLO_ACTION}"')
    alone = f"(\n{solo}\n)\nunless on(instance)\n(\n{others}\n)"
    warn = _either(
        # action "" too: the series of an exporter from before the action label warn as they did
        xid_events(cfg, f'action=~"{regex((*xid_catalogue.WARN_ACTIONS, ""))}"', f'xid!~"{critical}"'),
        xid_events(cfg, f'xid=~"{warning}"'),
        alone,
    )
    what = f"{GPU_WHERE} reported Xid {label('xid')}, action {label('action')} in NVIDIA's Xid catalogue"
    events = f"(about {VALUE_INT} event(s) in the last {cfg.xid_window})"
    todo = _advice("action", xid_catalogue.ADVICE)
    return [
        # first: the alerts below read it in the same evaluation
        {"record": XID_EVENTS_RECORD, "expr": recent_xids(cfg)},
        alert(
            "GPUXidError",
            page,
            CRITICAL,
            "A GPU reported an Xid error that needs a GPU reset, a node reboot or NVIDIA support.",
            f"{what} {events}: {todo}. Where the driver reports a recovery action, GPURecoveryAction names it; "
            "the runbook's Xid table gives the code's meaning.",
        ),
        alert(
            "GPUXidError",
            warn,
            WARNING,
            "A GPU reported an Xid error that does not page.",
            f"{what} {events}: {todo}. The runbook's Xid table gives the code's meaning.",
        ),
    ]


def recovery_rules(cfg: MonitoringConfig) -> list[dict]:
    """NVML's recovery action: a group of its own, as the one-hot family is 7 series a GPU besides "none",
    as many as the rest of the health group reads; recorded once, as the alert reads it twice
    (incidents.with_job)."""
    return [
        {"record": RECOVERY_ACTION_RECORD, "expr": metric(cfg, "gpu_recovery_action", 'action!="none"') + " == 1"},
        alert(
            "GPURecoveryAction",
            metric(cfg, RECOVERY_ACTION_RECORD),
            CRITICAL,
            "A GPU's driver asks for a recovery action (reset, reboot or drain).",
            f"{GPU_WHERE}: NVML's GPU recovery action is {label('action')}: "
            f"{_advice('action', xid_catalogue.RECOVERY_ADVICE)}. It follows a fatal Xid (an Xid event says it "
            "changed) and clears once done.",
        ),
    ]


def rules(cfg: MonitoringConfig) -> list[dict]:
    """What ends a GPU's job: Xid events, a lost GPU (incidents.GPU_CAUSES; the recovery action has a group of
    its own), and the job of each GPU that all their alerts carry."""
    return [
        # first: the cause alerts read it in the same evaluation
        {"record": GPU_JOB_RECORD, "expr": incidents.gpu_jobs(cfg)},
        *xid_rules(cfg),
        alert(
            "GPULost",
            f"{metric(cfg, 'gpu_up')} == 0",
            CRITICAL,
            "NVML lost a GPU.",
            f"{GPU_WHERE} stopped answering NVML (GPU_IS_LOST: fallen off the bus). "
            "The node needs a reboot; the job on it is lost.",
            cfg.gpu_lost_for,
        ),
    ]


def device_rules(cfg: MonitoringConfig) -> list[dict]:
    """What wears or slows a GPU without ending its job: ECC errors, remapped rows, throttling; and the
    per-GPU hang signature the stall group reads."""
    ecc = metric(cfg, "gpu_ecc_errors_total", 'type="uncorrected"')
    remapped = metric(cfg, "gpu_remapped_rows", 'kind=~"pending|failure"')
    throttle = metric(cfg, "gpu_clock_throttle", f'reason=~"{regex(cfg.throttle_reasons)}"')
    return [
        {"record": HANG_SIGNATURE_RECORD, "expr": progress.hang_signature(cfg)},
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
