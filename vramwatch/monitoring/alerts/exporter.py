"""The exporter's own health: target down, stale samples, a failing collector."""

from __future__ import annotations

from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.promql import (
    RANK_WHERE,
    VALUE_DURATION,
    WARNING,
    alert,
    duration,
    label,
    metric,
    num,
    up,
)


def target_down(cfg: MonitoringConfig) -> str:
    """vramwatch targets failing their scrape: by job name, or by having served vramwatch recently; except a
    server a rank started (``vramwatch_server_mode{mode="job"}``) that had no live rank at its last scrape.

    Such a server exits on purpose once its ranks are gone (``linger`` after the last rank, and only after
    the dead ranks' final samples were served for their grace window: at least ~100 s of
    ``vramwatch_ranks == 0`` scrapes by default), so its target going down then is its job ending, and a
    static config listing the node sees it between jobs. Gone while ranks were live, it is a fault: the
    job's server, the job or the node died. A node daemon (``mode="node"``) runs for the node's life:
    down is always a fault, idle or not (an idle daemon answers, ``up == 1``). A target that never said
    its mode (an older vramwatch) is taken as before: down is a fault."""
    seen = metric(cfg, "vramwatch_build_info")
    window = duration(cfg.target_seen_window)
    recent = f"up == 0 and on(job, instance) max_over_time({seen}[{window}])"
    down = f"{up(cfg)} == 0\nor {recent}" if cfg.target_selector else recent
    job_mode = metric(cfg, "vramwatch_server_mode", 'mode="job"')
    node_mode = metric(cfg, "vramwatch_server_mode", 'mode="node"')
    ended = (
        f"last_over_time({job_mode}[{window}])\n"
        f"and on(job, instance) last_over_time({metric(cfg, 'vramwatch_ranks')}[{window}]) == 0\n"
        f"unless on(job, instance) last_over_time({node_mode}[{window}])"
    )
    return f"(\n{down}\n)\nunless on(job, instance) (\n{ended}\n)"


def impostor(cfg: MonitoringConfig) -> str:
    """Targets answering their scrapes without vramwatch_build_info although they served it recently:
    another process holds the port (a squatter serves Prometheus its own metrics, and this job's go
    unseen while every alert of the job stays silent)."""
    seen = metric(cfg, "vramwatch_build_info")
    answering = f"{up(cfg)} == 1" if cfg.target_selector else "up == 1"
    return (
        f"{answering}\nunless on(job, instance) {seen}\n"
        f"and on(job, instance) max_over_time({seen}[{duration(cfg.target_seen_window)}])"
    )


def nvml_absent_for_gpu_job(cfg: MonitoringConfig) -> dict:
    """No NVML is a state (a CPU-only target stays quiet) unless ranks of that target use CUDA devices:
    then the device readings and every alert on them are missing, and the collectors cannot say so."""
    return alert(
        "VramwatchNvmlAbsent",
        f"{metric(cfg, 'vramwatch_nvml_available')} == 0\n"
        f"and on(job, instance)\ncount by(job, instance) ({metric(cfg, 'torch_cuda_memory_reserved_bytes')})",
        WARNING,
        "A GPU job's exporter has no NVML: no device readings.",
        f"The ranks on {label('instance')} use CUDA devices, but its exporter has no NVML "
        f"({label('reason')}) for more than {cfg.collector_down_for}: GPU memory, power, throttling and Xid "
        "series are missing and none of their alerts can fire.",
        cfg.collector_down_for,
    )


def rules(cfg: MonitoringConfig) -> list[dict]:
    out = [
        alert(
            "VramwatchTargetDown",
            target_down(cfg),
            WARNING,
            "Prometheus cannot scrape a vramwatch target.",
            f"Prometheus has failed to scrape {label('instance')} (job {label('job')}) for more than "
            f"{cfg.target_down_for}: the node or its vramwatch node daemon is down, or a job's own server "
            "vanished while its ranks were running (the job or the node died); none of its alerts can fire. "
            "A job's server that exits after its ranks left does not fire this.",
            cfg.target_down_for,
        ),
        alert(
            "VramwatchTargetImpostor",
            impostor(cfg),
            WARNING,
            "A vramwatch target answers, but not with vramwatch's metrics.",
            f"{label('instance')} (job {label('job')}) served vramwatch_build_info within the last "
            f"{cfg.target_seen_window} and now answers its scrapes without it, for more than "
            f"{cfg.target_down_for}: another process holds the port (the job's own server could not bind: its "
            "log names the port's owner), and the job's series and alerts are missing.",
            cfg.target_down_for,
        ),
        alert(
            "VramwatchSamplesStale",
            f"{metric(cfg, 'vramwatch_sample_age_seconds')} > {num(cfg.sample_stale_seconds)}",
            WARNING,
            "A rank stopped publishing samples: it is wedged.",
            f"The newest sample of {RANK_WHERE} is {VALUE_DURATION} old: the rank's process is alive "
            "(it holds its lock) but its sampler thread cannot run, e.g. the rank is blocked in a C "
            "call holding the GIL. Its allocator readings are that old.",
            cfg.sample_stale_for,
        ),
        alert(
            "VramwatchCollectorDown",
            f"{metric(cfg, 'vramwatch_collector_up')} == 0",
            WARNING,
            "A vramwatch collector is failing.",
            f"The {label('collector')} collector on {label('instance')} (rank '{label('rank')}' of job "
            f"'{label('job_id')}', both empty for the server's own) has failed for more than "
            f"{cfg.collector_down_for}; its families are missing or old. The exporter's log says why "
            "(logged once).",
            cfg.collector_down_for,
        ),
    ]
    out.append(nvml_absent_for_gpu_job(cfg))
    if cfg.target_absent_for:
        out.append(
            alert(
                "VramwatchTargetAbsent",
                f"absent({up(cfg)})",
                WARNING,
                "No vramwatch target is known to Prometheus.",
                f"Prometheus has had no target matching {cfg.target_selector} for more than "
                f"{cfg.target_absent_for}: service discovery lost the jobs, or none runs.",
                cfg.target_absent_for,
            )
        )
    return out
