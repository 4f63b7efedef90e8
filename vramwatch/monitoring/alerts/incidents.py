"""Causes of a job's incident: a rank that ended abnormally, a node whose ranks vanished, a loss gone
non-finite; and the job identity that a GPU's cause alerts (GPULost, a critical Xid) carry.

A cause pages once for its job; Alertmanager (deploy/alertmanager/alertmanager.yml) groups a job's pages
by its identity (``MonitoringConfig.peer_labels``) and lets a cause mute the job's symptom pages
(TrainingStalled and the rest), so one incident is at most two pages whatever the job's size.

A rank's series live on the target that serves its node: when a node dies (its target fails its scrapes,
or leaves Kubernetes' service discovery), Prometheus marks its series stale at once, so "the job had ranks
on this node within ``incident_window`` and has none now, while its other ranks still run" covers both,
the node daemon and a rank-started server alike. A node whose ranks said how they ended (the exits
counter, finished or not) was not lost: its job finished there, or TrainingRankExited names the rank.
"""

from __future__ import annotations

from vramwatch.monitoring.alerts.progress import peers
from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.promql import (
    CRITICAL,
    GPU_JOB_RECORD,
    RANK_WHERE,
    alert,
    duration,
    label,
    metric,
)

# Cause alerts from the device (their rules live in health.py): they carry the job of the GPU's ranks
GPU_CAUSES = ("GPULost", "GPUXidError", "GPURecoveryAction")


def gpu_jobs(cfg: MonitoringConfig) -> str:
    """Per GPU (``uuid``): the job identity of the ranks that used it within ``incident_window``, the newest
    where two did (1: a rank uses it now, 0: one did within the window). Recorded once per evaluation as
    GPU_JOB_RECORD by the health group, whose cause alerts read it (:func:`with_job`).

    A GPU that falls off the bus takes its rank with it: the rank's series are gone by the time the GPU
    alert fires, so the GPU's job is read back over the window."""
    alloc = metric(cfg, "torch_cuda_memory_allocated_bytes")
    w = duration(cfg.incident_window)
    by = f"uuid, {peers(cfg)}"
    jobs = f"max by ({by}) ({alloc} * 0 + 1)\nor max by ({by}) (last_over_time({alloc}[{w}]) * 0)"
    return f"topk by (uuid) (1, {' '.join(jobs.splitlines())})"


def with_job(cfg: MonitoringConfig, expr: str) -> str:
    """A per-GPU expression (labelled ``uuid``) with the job identity of :func:`gpu_jobs`; a GPU no rank used
    keeps its labels alone (``or on(uuid)``: the record is read once)."""
    newest = metric(cfg, GPU_JOB_RECORD)
    return f"(\n{expr}\n) * on(uuid) group_left({peers(cfg)}) ({newest} * 0 + 1)\nor on(uuid) (\n{expr}\n)"


def rank_exited(cfg: MonitoringConfig) -> str:
    """Ranks that ended other than ``finished`` within ``incident_window`` while a rank of their job still
    reports steps."""
    w = duration(cfg.incident_window)
    exits = metric(cfg, "vramwatch_rank_exits_total", 'reason!="finished"')
    hb = metric(cfg, "vramwatch_training_last_step_timestamp_seconds")
    every_exit = metric(cfg, "vramwatch_rank_exits_total")
    others = f"count by ({peers(cfg)}) ({hb} unless on({peers(cfg)}, instance, rank) {every_exit})"
    return f"last_over_time({exits}[{w}]) > 0\nand on({peers(cfg)}) {others}"


def node_lost(cfg: MonitoringConfig) -> str:
    """Per job and node: the job had ranks there within ``incident_window``, has none now, none of them
    said how it ended, and the job's other ranks still run."""
    w = duration(cfg.incident_window)
    info = metric(cfg, "vramwatch_rank_info")
    exits = metric(cfg, "vramwatch_rank_exits_total")
    by = f"{peers(cfg)}, instance"
    was = f"group by ({by}, hostname) (last_over_time({info}[{w}]))"
    now = f"group by ({by}) ({info})"
    ended = f"group by ({by}) (last_over_time({exits}[{w}]))"
    running = f"group by ({peers(cfg)}) ({info})"
    return f"{was}\nunless on({by}) {now}\nunless on({by}) {ended}\nand on({peers(cfg)}) {running}"


def loss_nonfinite(cfg: MonitoringConfig) -> str:
    """Ranks whose newest loss is NaN or +-Inf (less itself: NaN, where a finite loss gives 0)."""
    loss = metric(cfg, "vramwatch_training_loss")
    return f"{loss}\nunless {loss} - {loss} == 0"


def _gpu_of(cfg: MonitoringConfig) -> str:
    """An annotation naming the GPU the alert's rank used (read back over the window: it may be gone)."""
    alloc = "torch_cuda_memory_allocated_bytes{instance=%q, rank=%q, job_id=%q}"
    query = f"last_over_time({alloc}[{duration(cfg.incident_window)}])"
    return (
        f'{{{{ with printf "{query}" $labels.instance $labels.rank $labels.job_id | query }}}}'
        "{{ with first . }}, GPU {{ .Labels.uuid }} (cuda:{{ .Labels.device }}){{ end }}{{ end }}"
    )


def rules(cfg: MonitoringConfig) -> list[dict]:
    return [
        alert(
            "TrainingRankExited",
            rank_exited(cfg),
            CRITICAL,
            "A rank of a running job ended abnormally.",
            f"{RANK_WHERE}{_gpu_of(cfg)} ended: {label('reason')}"
            "{{ if $labels.detail }} ({{ $labels.detail }}){{ end }}, and other ranks of its job still run "
            f"{cfg.rank_exit_for} later: "
            "they will wait for it in their next collective until the job's collective timeout ends them. "
            "What to do: read that rank's log for the error (reason exception or oom: the traceback; signal: "
            "who sent it, e.g. the OOM killer or the scheduler; killed: the process vanished without a last "
            "word, look at the host's kernel log), then restart the job from its last checkpoint. "
            "The job's hang pages are muted while this fires.",
            cfg.rank_exit_for,
        ),
        alert(
            "TrainingNodeLost",
            node_lost(cfg),
            CRITICAL,
            "A node of a running job was lost.",
            f"Job {label('job_id')} ({label('job')}) had ranks on {label('hostname')} ({label('instance')}) "
            f"within the last {cfg.incident_window}; for more than {cfg.node_lost_for} none is there, none of "
            "them said how it ended, and the job's other ranks still run"
            '{{ with printf "up{instance=%q}" $labels.instance | query }}{{ with first . }}'
            "{{ if not .Value }} (its target fails its scrapes){{ end }}{{ end }}"
            "{{ else }} (its target left service discovery: the pod or node is gone){{ end }}. "
            "The node died, rebooted, or its vramwatch server did. What to do: check the node (reachable? "
            "kernel log, `kubectl describe node`), cordon it, and restart the job from its last checkpoint "
            "without it. The job's hang pages are muted while this fires.",
            cfg.node_lost_for,
        ),
        alert(
            "TrainingLossNonFinite",
            loss_nonfinite(cfg),
            CRITICAL,
            "A rank's training loss is NaN or infinite.",
            f"The loss {RANK_WHERE} reported is {{{{ $value }}}} for more than {cfg.loss_nonfinite_for}: the "
            "job trains on garbage from here on (non-finite grad norms alone do not page: fp16 loss scaling "
            "skips those steps). What to do: stop the job before it overwrites good "
            "checkpoints, restart from the last checkpoint whose loss was finite (lower the learning rate or "
            "skip the batch if it recurs); on a rank alone, suspect its GPU (silent data corruption): run "
            "`dcgmi diag` on it.",
            cfg.loss_nonfinite_for,
        ),
    ]
