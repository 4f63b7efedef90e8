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
  ``stall_min_seconds`` and ``stall_for`` (input pipeline, evaluation, checkpointing). A job without
  GPUs (gloo on CPU) can only stall this way, so it names the culprit as the page does (:func:`culprit`).

Neither fires for one slow step of up to ``stall_factor`` x the mean: the bound is at least that.
"""

from __future__ import annotations

from vramwatch.monitoring import contract
from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.promql import (
    BUSY_STALL_RECORD,
    CRITICAL,
    HANG_SIGNATURE_RECORD,
    INPUT_WAIT_MEAN_RECORD,
    INPUT_WAIT_SKEW_RECORD,
    OWN_MEAN_RECORD,
    OWN_SKEW_RECORD,
    RANK_WHERE,
    STALL_MEAN_RECORD,
    STEP_MEAN_RECORD,
    STEP_SKEW_RECORD,
    VALUE_DURATION,
    VALUE_INT,
    VALUE_PERCENT,
    VALUE_RATIO,
    WARNING,
    alert,
    duration,
    go_string,
    label,
    metric,
    num,
    parse_duration,
    percent,
    regex,
    stall_bound,
    stall_mean,
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


def hang_signature(cfg: MonitoringConfig) -> str:
    """Per GPU: its utilisation, where it reads busy at low power (a deadlocked collective spins). Recorded as
    HANG_SIGNATURE_RECORD by the device group, among the per-GPU rules, so that the stall group reads only the
    few GPUs that show it."""
    util = metric(cfg, "gpu_utilization_ratio")
    power = metric(cfg, "gpu_power_watts")
    plimit = metric(cfg, "gpu_power_limit_watts")
    return f"{util} >= {num(cfg.busy_utilization_ratio)}\nand {power} / {plimit} <= {num(cfg.busy_power_ratio)}"


def busy_stalls(cfg: MonitoringConfig) -> str:
    """Per rank and GPU: ranks stalled past the busy floor whose GPU shows the hang signature."""
    alloc = metric(cfg, "torch_cuda_memory_allocated_bytes")
    return (
        f"(\n{_indent(stalled_ranks(cfg, cfg.busy_stall_min_seconds))}\n)\n"
        f"* ignoring({_PER_GPU_ONLY}) group_right()\n({alloc} * 0 + 1)\n"
        f"and ignoring({_GPU_JOIN}) {metric(cfg, HANG_SIGNATURE_RECORD)}"
    )


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _why(cfg: MonitoringConfig, floor: float) -> str:
    return f"(bound: {cfg.stall_factor:g}x its mean step time over {cfg.stall_window}, at least {floor:g}s)"


def job_query(cfg: MonitoringConfig, template: str) -> str:
    """A Go template pipeline ``printf "<query>" <the alert's job labels> | query``: each ``{JOB}`` in
    ``template`` becomes the selector and the alert's job labels (the Helm chart rewrites that form)."""
    matchers = [m for m in (cfg.selector,) if m] + [f"{name}=%q" for name in cfg.peer_labels]
    query = template.replace("{JOB}", "{" + ", ".join(matchers) + "}")
    args = " ".join(f"$labels.{name}" for name in cfg.peer_labels)
    return f"printf {go_string(query)}" + f" {args}" * template.count("{JOB}") + " | query"


def first_stopped(cfg: MonitoringConfig) -> str:
    """An annotation naming the rank of the alert's job whose newest step is the oldest: the one that
    stopped first (in a hung collective the others wait for it). Empty when the query finds none."""
    hb = "vramwatch_training_last_step_timestamp_seconds"
    return (
        f"{{{{ with {job_query(cfg, f'bottomk(1, {hb}{{JOB}})')} }}}}{{{{ with first . }}}}"
        " The first of its job's ranks to stop: rank {{ .Labels.rank }}"
        "{{ if .Labels.job_id }} of job {{ .Labels.job_id }}{{ end }} on {{ .Labels.instance }}."
        "{{ end }}{{ end }}"
    )


def culprit(cfg: MonitoringConfig) -> str:
    """An annotation naming the rank(s) the hang waits for: those behind the rest of the job in collectives
    issued (a rank that never reached the collective the others wait in); where no rank is behind (every
    rank inside the same collective, e.g. a broken link), the first rank to stop (:func:`first_stopped`)."""
    c = "vramwatch_collectives_total"
    behind = f"{c}{{JOB}} == on() group_left() (min({c}{{JOB}}) < max({c}{{JOB}}))"
    return (
        f"{{{{ with {job_query(cfg, behind)} }}}} The others wait for"
        "{{ range . }} rank {{ .Labels.rank }} on {{ .Labels.instance }}"
        ' (collective {{ .Value | printf "%.0f" }}){{ end }}:'
        " behind the rest of its job in collectives issued, it never reached the one they wait in."
        f"{{{{ else }}}}{first_stopped(cfg)}{{{{ end }}}}"
    )


def peers(cfg: MonitoringConfig) -> str:
    """The labels that make ranks one job (the job's identity in alerts and Alertmanager's grouping)."""
    return ", ".join(cfg.peer_labels)


def in_phase(cfg: MonitoringConfig) -> str:
    """Per job: a rank of it declared a non-training phase (evaluation, checkpoint, compile) younger than
    ``phase_quiet_window``. Per job, not per rank: while rank 0 evaluates, the others wait for it."""
    start = metric(cfg, "vramwatch_training_phase_start_timestamp_seconds")
    return f"group by ({peers(cfg)}) (time() - {start} < {num(parse_duration(cfg.phase_quiet_window))})"


def unless_in_phase(cfg: MonitoringConfig, expr: str) -> str:
    return f"(\n{_indent(expr)}\n)\nunless on({peers(cfg)}) {in_phase(cfg)}"


def ranks_of_job(cfg: MonitoringConfig) -> str:
    """Per job: its ranks that have reported a step."""
    return f"count by ({peers(cfg)}) ({metric(cfg, 'vramwatch_training_last_step_timestamp_seconds')})"


def job_hangs(cfg: MonitoringConfig) -> str:
    """The hang page: per job, the number of its ranks busy-stalled (one alert per job, whatever its size);
    a job of one rank keeps that rank's and GPU's labels (one page either way: ``or on(job)`` adds the
    record's series only for jobs the count left out)."""
    by = f"{peers(cfg)}, instance, rank, local_rank"
    several = (
        f"count by ({peers(cfg)}) (group by ({by}) ({BUSY_STALL_RECORD}))\nand on({peers(cfg)}) {ranks_of_job(cfg)} > 1"
    )
    return unless_in_phase(cfg, f"{several}\nor on({peers(cfg)})\n{BUSY_STALL_RECORD}")


_WHAT_TO_DO = (
    " What to do: dump the stacks of the named rank first (`py-spy dump --pid` on that host, or PyTorch's "
    "Flight Recorder); if no rank is behind, every rank is inside one collective: check the NCCL log and "
    "the network links of the job's hosts. Then restart the job from its last checkpoint."
)


def hang_page(cfg: MonitoringConfig) -> dict:
    job_bound = _why(cfg, cfg.busy_stall_min_seconds).replace("(bound: ", "(")
    return alert(
        "TrainingStalled",
        job_hangs(cfg),
        CRITICAL,
        "A training job is hung: its ranks make no progress while their GPUs read busy at low power.",
        "{{ if $labels.rank }}"
        f"{RANK_WHERE} has not completed a step for {VALUE_DURATION} {_why(cfg, cfg.busy_stall_min_seconds)}, "
        f"while its GPU {label('uuid')} reads"
        "{{ else }}"
        f"{VALUE_INT} rank(s) of job {label('job_id')} ({label('job')}) have not completed a step for longer "
        f"than their stall bound {job_bound}, while their GPUs read"
        "{{ end }}"
        f" at least {percent(cfg.busy_utilization_ratio)} utilisation at no more than "
        f"{percent(cfg.busy_power_ratio)} of the power limit: the hang signature. Work since the last "
        "checkpoint is being lost." + culprit(cfg) + _WHAT_TO_DO,
        cfg.busy_stall_for,
    )


def idle_stall(cfg: MonitoringConfig) -> dict:
    return alert(
        "TrainingStalled",
        unless_in_phase(cfg, f"{stalled_ranks(cfg)}\nunless ignoring({_PER_GPU_ONLY}) {BUSY_STALL_RECORD}"),
        WARNING,
        "A rank stopped making progress.",
        f"{RANK_WHERE} has not completed a step for {VALUE_DURATION} {_why(cfg, cfg.stall_min_seconds)}; "
        "its GPU does not show the busy-at-low-power hang signature (idle, input pipeline, an undeclared "
        "evaluation or checkpoint, or no NVML reading)." + culprit(cfg) + " Declared phases "
        f"(`vramwatch.phase(...)`) keep this quiet for {cfg.phase_quiet_window}.",
        cfg.stall_for,
    )


def own_work(cfg: MonitoringConfig) -> str:
    """Per rank: its own work per step over ``straggler_window``: step time less the time it waited for its
    peers in collectives (a rank that measures no waits: its step time)."""
    w = duration(cfg.straggler_window)
    h = "vramwatch_training_step_duration_seconds"
    waits = metric(cfg, "vramwatch_training_wait_seconds_total", 'kind="collective"')
    return (
        f"(rate({metric(cfg, h + '_sum')}[{w}]) - sum without(kind) (rate({waits}[{w}])))\n"
        f"/ rate({metric(cfg, h + '_count')}[{w}]) > 0\n"
        f"or {STEP_MEAN_RECORD}"
    )


def input_wait(cfg: MonitoringConfig) -> str:
    """Per rank: its data wait per step over ``straggler_window`` (the straggler's co-signal, against the
    median of its job's ranks' in INPUT_WAIT_SKEW_RECORD)."""
    w = duration(cfg.straggler_window)
    data = metric(cfg, "vramwatch_training_wait_seconds_total", 'kind="data"')
    count = metric(cfg, "vramwatch_training_step_duration_seconds_count")
    return f"sum without(kind) (rate({data}[{w}])) / rate({count}[{w}])"


def _gpu_of_rank(cfg: MonitoringConfig) -> str:
    """Per rank: one GPU it uses (uuid), value 1."""
    alloc = metric(cfg, "torch_cuda_memory_allocated_bytes")
    return f"topk without(uuid) (1, group without(device) ({alloc}))"


def _straggler_cause(cfg: MonitoringConfig) -> str:
    reasons = regex(cfg.throttle_reasons)
    throttle = f'gpu_clock_throttle{{uuid=%q, reason=~"{reasons}"}} == 1'
    own_rank = "{instance=%q, rank=%q, job_id=%q}"
    rank_args = "$labels.instance $labels.rank $labels.job_id"
    return (
        "{{ if $labels.uuid }}"
        f"{{{{ with printf {go_string(throttle)} $labels.uuid | query }}}} Cause: its GPU is throttled"
        "{{ range . }} ({{ .Labels.reason }}){{ end }}: check its cooling and power (thermal, power brake, "
        "hardware slowdown).{{ end }}"
        f"{{{{ with printf {go_string('gpu_sm_clock_hertz{uuid=%q}')} $labels.uuid | query }}}}"
        "{{ with first . }} Its SM clock: {{ .Value | humanize }}Hz.{{ end }}{{ end }}"
        "{{ end }}"
        f"{{{{ with printf {go_string(INPUT_WAIT_SKEW_RECORD + own_rank + ' > ' + num(cfg.straggler_ratio))} "
        f'{rank_args} | query }}}}{{{{ with first . }}}} Cause: input wait: it waits {{{{ .Value | printf "%.1f" }}}}x '
        "its job's median for its next batch (its data loader or storage).{{ end }}{{ end }}"
    )


def pace_rules(cfg: MonitoringConfig) -> list[dict]:
    """Per rank, over ``straggler_window``: the mean step time, own work and data wait per step. The
    straggler group reads them (a group apart: each group's rules run one after another, the groups at once;
    one evaluation's lag is nothing against a 10-minute mean)."""
    return [
        {"record": STEP_MEAN_RECORD, "expr": step_mean(cfg, lambda name: metric(cfg, name))},
        {"record": OWN_MEAN_RECORD, "expr": own_work(cfg)},
        {"record": INPUT_WAIT_MEAN_RECORD, "expr": input_wait(cfg)},
    ]


def step_skew_record(cfg: MonitoringConfig) -> dict:
    """Per rank: its mean step time over its job's median, for the dashboard's skew panel."""
    return {"record": STEP_SKEW_RECORD, "expr": step_skew(cfg, STEP_MEAN_RECORD)}


def straggler_rules(cfg: MonitoringConfig) -> list[dict]:
    """A rank slower than its job (the skew records that find it, and the warning), a job slower than
    itself."""
    skewed = f"{OWN_SKEW_RECORD} > {num(cfg.straggler_ratio)}"
    return [
        {"record": OWN_SKEW_RECORD, "expr": step_skew(cfg, OWN_MEAN_RECORD)},
        {"record": INPUT_WAIT_SKEW_RECORD, "expr": step_skew(cfg, INPUT_WAIT_MEAN_RECORD)},
        alert(
            "TrainingRankStraggler",
            # a rank without a GPU keeps its labels alone (or ignoring(uuid): the record is read once)
            f"({skewed})\n* ignoring(uuid) group_left(uuid) {_gpu_of_rank(cfg)}\nor ignoring(uuid) ({skewed})",
            WARNING,
            "One rank is slower than the rest of its job.",
            f"{RANK_WHERE}{{{{ if $labels.uuid }}}} (GPU {label('uuid')}){{{{ end }}}} does {VALUE_RATIO}x the "
            "median own work per step of its job's ranks (its step time less its waits for peers in "
            f"collectives, mean over {cfg.straggler_window}; warns above {num(cfg.straggler_ratio)}x for "
            f"{cfg.straggler_for}). In a synchronous job every rank's step takes as long as this one's: the "
            "others wait for it." + _straggler_cause(cfg) + " What to do: find why this rank is slow (its "
            "GPU's clocks and temperature, its host's load, its input pipeline, uneven work); drain the node "
            "if its hardware is at fault.",
            cfg.straggler_for,
        ),
        throughput_drop(cfg),
    ]


def job_rate(cfg: MonitoringConfig, window: str, offset: str = "") -> str:
    """Per job: the median rank's step rate over ``window`` (ending ``offset`` ago)."""
    steps = metric(cfg, "vramwatch_training_steps_total")
    off = f" offset {duration(offset)}" if offset else ""
    return f"quantile by ({peers(cfg)}) (0.5, rate({steps}[{duration(window)}]{off}))"


def throughput_drop(cfg: MonitoringConfig) -> dict:
    now = job_rate(cfg, cfg.throughput_window)
    before = job_rate(cfg, cfg.throughput_baseline_window, cfg.throughput_window)
    return alert(
        "TrainingJobThroughputDrop",
        unless_in_phase(cfg, f"({now} > 0)\n/ ({before} > 0)\n< {num(cfg.throughput_drop_ratio)}"),
        WARNING,
        "A training job runs slower than it did.",
        f"Job {label('job_id')} ({label('job')}) makes {VALUE_PERCENT} of the steps per second it made over "
        f"the {cfg.throughput_baseline_window} before (median rank, over {cfg.throughput_window}; warns below "
        f"{percent(cfg.throughput_drop_ratio)} for {cfg.throughput_for}). No rank is slower than the others "
        "(TrainingRankStraggler would name it): the whole job slowed. What to do: look for what the job's "
        "ranks share: the network between its hosts (a degraded link or switch), shared storage, a change "
        "in the job's work per step, or every GPU throttled.",
        cfg.throughput_for,
    )


def stall_window_rules(cfg: MonitoringConfig) -> list[dict]:
    """Each rank's mean step time over ``stall_window``, which the stall bounds read: a group apart, as its
    half-hour rates of two series a rank cost as much as the stall rules together."""
    return [{"record": STALL_MEAN_RECORD, "expr": stall_mean(cfg)}]


def rules(cfg: MonitoringConfig) -> list[dict]:
    """The stalls: a group of their own, so that the hang page never waits behind the pace records."""
    return [
        # first: the alerts below read it in the same evaluation
        {"record": BUSY_STALL_RECORD, "expr": busy_stalls(cfg)},
        hang_page(cfg),
        idle_stall(cfg),
    ]
