"""Training memory: the caching allocator's view of each rank, next to the card's."""

from __future__ import annotations

from vramwatch.monitoring import dashboard_ids, promql
from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.dashboards.common import (
    PROM,
    Scope,
    base_dashboard,
    dashboard,
    heartbeat_age,
    m,
    mean_step_seconds,
    memory_limits,
    memory_pressure,
    q,
    qt,
    rank_mfu,
    right_axis,
    stall_bound,
    step_skew,
    table_panel,
    thresholds,
    tokens_per_gpu,
    ts,
    units,
)
from vramwatch.monitoring.dashboards.health import bound_panel
from vramwatch.monitoring.promql import num

UID = dashboard_ids.TRAINING_MEMORY_UID
TITLE = "vramwatch / Training memory"
RANK = "rank {{rank}} ({{job_id}})"  # two jobs on one target have a rank 0 each
RANK_DEVICE_ON = "job, instance, uuid, device, rank, local_rank"


# A projection is drawn up to this multiple of the limit: beyond it the job runs out anyway, and an
# extrapolation tens of TiB out would stretch the axis until the real series is a flat line.
PROJECTION_CAP = 1.25


def capped_projection(projected: str, limit: str) -> str:
    """The leak alert's projection of the step peak (recorded by the allocator rules), held at PROJECTION_CAP
    x the limit; where a rank has no limit series the projection is drawn uncapped."""
    cap = f"({num(PROJECTION_CAP)} * {limit})"
    return f"({projected} < {cap}) or ({cap} and {projected}) or {projected}"


def build(cfg: MonitoringConfig) -> dashboard.Dashboard:
    s = Scope(cfg)
    alloc, reserved = m("torch_cuda_memory_allocated_bytes"), m("torch_cuda_memory_reserved_bytes")
    limit = m("torch_cuda_memory_limit_bytes")
    d = base_dashboard(
        UID,
        TITLE,
        "What the PyTorch caching allocator holds in each rank, against the card "
        "and the per-process budget; allocator events; training progress.",
        cfg,
    )
    d = d.annotation(
        dashboard.AnnotationQuery()
        .name("OOMs")
        .datasource(PROM)
        .enable(True)
        .icon_color("orange")
        .expr(f"increase({m('torch_cuda_memory_ooms_total')}{s.device}[1m]) > 0")
        .step("60s")
        .title_format("OOM in rank {{rank}}")
        .text_format("cuda:{{device}} {{uuid}} on {{instance}}")
        .tag_keys("rank,instance")
    )

    d = d.with_row(dashboard.Row("Memory"))
    d = d.with_panel(
        ts(
            "Allocated, reserved, card total and limit",
            "Allocated: bytes in live tensors. Reserved: what the allocator took from the driver and keeps "
            "cached (it is not given back on its own). Card total: the GPU's memory (NVML), for the GPUs the "
            "ranks use (a MIG instance's own, for a rank on one). Limit: the per-process budget (memory "
            "fraction x total). nvidia-smi's used memory is reserved plus what is outside PyTorch (see below).",
            units.BytesIEC,
            [
                q(f"{alloc}{s.device}", f"allocated {RANK} cuda:{{{{device}}}}", "A"),
                q(f"{reserved}{s.device}", f"reserved {RANK} cuda:{{{{device}}}}", "B"),
                q(
                    # a rank on a MIG instance: the instance's total (its uuid is the instance's)
                    f"({m('gpu_memory_total_bytes')}{s.gpu} or {m('gpu_mig_memory_total_bytes')}{s.gpu})"
                    f" and on (job, instance, uuid) {reserved}{s.device}",
                    "card total gpu{{gpu}}",
                    "C",
                ),
                q(f"{limit}{s.device}", f"limit {RANK}", "D"),
            ],
            dashed={"C": "red", "D": "orange"},
        )
    )
    roles = m("vramwatch_memory_role_bytes")
    d = d.with_panel(
        ts(
            "Memory by role",
            "What reserved holds, stacked (the top is reserved), summed over the selected ranks (pick a rank "
            "to see one): parameters, gradients and optimizer state of the model given to vramwatch.watch() "
            "(each storage once, a sharded tensor's local shard; walked every role_interval seconds), other = "
            "allocated minus those (activations, autograd's saved tensors, workspaces), and the allocator's "
            "cache = reserved - allocated. Empty until the job calls vramwatch.watch().",
            units.BytesIEC,
            [
                q(f"sum by (role) ({roles}{s.device})", "{{role}}", "A"),
                q(
                    f"sum(({reserved}{s.device} - {alloc}{s.device})\n"
                    f'  and on({RANK_DEVICE_ON}) {roles}{s.device[:-1]}, role="parameters"}})',
                    "cache (reserved - allocated)",
                    "B",
                ),
            ],
            stack=True,
        )
    )
    d = d.with_panel(
        ts(
            "Memory pressure",
            f"Reserved / per-process limit for each rank (covers a capped job) and NVML used / total for each "
            f"GPU (covers every process on the card). The alerts warn above {num(cfg.memory_warning_ratio)} for "
            f"{cfg.memory_warning_for} and page above {num(cfg.memory_critical_ratio)}: the dashed lines.",
            units.PercentUnit,
            [
                q(f"{reserved}{s.device} / {limit}{s.device}", f"{RANK} reserved / limit", "A"),
                q(memory_pressure(s), "gpu{{gpu}} used / total", "B"),
            ],
            max_=1,
            limits=memory_limits(cfg),
        )
    )
    d = d.with_panel(
        ts(
            "Memory outside PyTorch",
            "NVML used memory minus the reserved bytes of this job's ranks on the GPU: CUDA contexts, NCCL "
            "buffers, other libraries, other processes. It grows when something else takes the card.",
            units.BytesIEC,
            [q(f"{m('gpu_non_torch_memory_bytes')}{s.gpu}", "gpu{{gpu}} outside PyTorch")],
        )
    )
    d = d.with_panel(
        ts(
            "Fragmentation",
            f"(reserved - allocated) / reserved: the share of the cache not holding tensors. High fragmentation "
            f"with high memory means a large request can fail while memory looks free; the alert warns above "
            f"{num(cfg.fragmentation_ratio)} (dashed) once memory is also high.",
            units.PercentUnit,
            [q(f"{m('torch_cuda_memory_fragmentation_ratio')}{s.device}", RANK)],
            max_=1,
            limits=thresholds((cfg.fragmentation_ratio, "orange")),
        )
    )
    block_age = f"time() - {m('torch_cuda_memory_largest_free_block_timestamp_seconds')}{s.device}"
    blocks = ts(
        "Largest free block and split leftovers",
        "Largest free cached block (the biggest request the cache can serve without cudaMalloc; from an allocator "
        "snapshot, taken every largest_block_interval seconds or less often when a snapshot is costly: its age "
        "is on the right axis, dashed) and the free pieces of split segments that empty_cache() cannot release.",
        units.BytesIEC,
        [
            q(f"{m('torch_cuda_memory_largest_free_block_bytes')}{s.device}", f"largest free block {RANK}", "A"),
            q(f"{m('torch_cuda_memory_inactive_split_bytes')}{s.device}", f"inactive split {RANK}", "B"),
            q(block_age, f"age of the largest free block {RANK}", "C"),
        ],
    )
    d = d.with_panel(right_axis(blocks, "C", units.Seconds, min_=0, dashed=True))
    d = d.with_panel(
        table_panel(
            "Allocator settings in force",
            "The allocator backend and PYTORCH_CUDA_ALLOC_CONF settings each rank actually runs with "
            "(expandable_segments, garbage_collection_threshold, max_split_size_mb).",
            [qt(f"{m('torch_cuda_allocator_info')}{s.rank}")],
            hide=("Value",),
        )
    )
    d = d.with_panel(bound_panel(s, "gpu{{gpu}} {{instance}}", span=12))  # is the allocator's GPU busy well?

    d = d.with_row(dashboard.Row("Allocator events and leaks"))
    d = d.with_panel(
        ts(
            "cudaMalloc retries and OOMs",
            "Events per interval. A retry means the allocator had to flush its cache and call cudaMalloc "
            "again: memory is nearly exhausted or fragmented. OOMs are also drawn as annotations.",
            units.Short,
            [
                q(
                    f"increase({m('torch_cuda_memory_alloc_retries_total')}{s.device}[$__rate_interval])",
                    f"retries {RANK}",
                    "A",
                ),
                q(f"increase({m('torch_cuda_memory_ooms_total')}{s.device}[$__rate_interval])", f"OOMs {RANK}", "B"),
            ],
            bars=True,
        )
    )
    step_peak = f"{m('torch_cuda_memory_step_peak_allocated_bytes')}{s.device}"
    projected = f"{m(promql.LEAK_PROJECTION_RECORD)}{s.device}"
    hours = num(cfg.leak_horizon_hours)
    d = d.with_panel(
        ts(
            "Per-step peak and leak projection",
            f"High-water mark of allocated bytes per sample window; a peak that keeps rising is a leak. The "
            f"projection extends the last {cfg.leak_window}'s trend {hours} h ahead "
            f"(the leak alert's horizon): "
            f"when it crosses the limit, the job runs out within that time. It is drawn at most "
            f"{num(PROJECTION_CAP)}x the limit, so a steep trend does not flatten the peak.",
            units.BytesIEC,
            [
                q(step_peak, f"step peak {RANK}", "A"),
                q(capped_projection(projected, f"{limit}{s.device}"), f"in {hours} h {RANK}", "B"),
                q(f"{limit}{s.device}", f"limit {RANK}", "C"),
            ],
            dashed={"B": None, "C": "red"},
        )
    )

    d = d.with_row(dashboard.Row("Progress"))
    step_buckets = f"rate({m('vramwatch_training_step_duration_seconds')}_bucket{s.rank}[$__rate_interval])"
    peers = ", ".join(cfg.peer_labels)
    d = d.with_panel(
        ts(
            "Step time",
            "Each rank's mean step time, and the 99th percentile of its job's steps (the step-time histograms "
            "of the chosen ranks together; 'Step-time skew by rank' names a slow rank). A spike is a signal, "
            "not always a reason to kill: runs have spiked and recovered by themselves. At most 360 points: "
            "the percentile reads every bucket of every chosen rank at each.",
            units.Seconds,
            [
                q(mean_step_seconds(s, "$__rate_interval"), f"mean {RANK}", "A"),
                q(
                    f"histogram_quantile(0.99, sum by ({peers}, le) ({step_buckets}))",
                    "p99 of job {{job_id}} ({{job}})",
                    "B",
                ),
            ],
            max_points=360,
        )
    )
    d = d.with_panel(
        ts(
            "Steps per second",
            "Training steps the job reported (vramwatch.step()).",
            units.Short,
            [q(f"rate({m('vramwatch_training_steps_total')}{s.rank}[$__rate_interval])", RANK)],
        )
    )
    tokens = f"rate({m('vramwatch_training_tokens_total')}{s.rank}[$__rate_interval])"
    jobs = ", ".join(cfg.peer_labels)
    d = d.with_panel(
        ts(
            "Tokens per second",
            "Tokens the ranks reported with vramwatch.step(tokens=N), per rank and summed per job (the job_labels).",
            units.Short,
            [q(tokens, RANK, "A"), q(f"sum by ({jobs}) ({tokens})", "job total", "B")],
        )
    )
    energy = f"rate({m('gpu_energy_joules_total')}{s.gpu}[$__rate_interval])"
    d = d.with_panel(
        ts(
            "Energy per token",
            "Joules per token: each GPU's energy counter (NVML, the slow cadence) over the tokens of the ranks "
            "on it, and the job's GPUs together over the job's tokens. No extra sampling: both are counters "
            "already exported.",
            "joule",  # Grafana's unit id for J (the SDK's units module has no constant for it)
            [
                q(f"{energy}\n/ on(job, instance, uuid) {tokens_per_gpu(s)}", "gpu {{uuid}}", "A"),
                q(
                    f"sum({energy} and on(job, instance, uuid) {tokens_per_gpu(s)})\n/ sum({tokens})",
                    "all selected",
                    "B",
                ),
            ],
        )
    )
    d = d.with_panel(
        ts(
            "Model FLOPs utilisation",
            "Tokens/s x the FLOPs per token the job declared (vramwatch.watch(flops_per_token=...)) over the peak "
            "dense BF16 FLOP/s of the rank's GPUs (MonitoringConfig.gpu_peak_flops, from NVIDIA's datasheets). "
            "Empty when the job declares no FLOPs per token or the GPU is not in the table.",
            units.PercentUnit,
            [q(rank_mfu(s), RANK)],
        )
    )
    d = d.with_panel(
        ts(
            "Step-time skew by rank",
            f"Each rank's mean step time over {cfg.straggler_window} / the median of its job's ranks (the "
            f"job_labels); 1 is in step. The straggler alert warns above {num(cfg.straggler_ratio)} (dashed) "
            f"for {cfg.straggler_for}. Ranks in lock-step collectives share one step time: skew shows where "
            "they are not.",
            units.Short,
            [q(step_skew(cfg, s), RANK)],
            limits=thresholds((cfg.straggler_ratio, "orange")),
        )
    )
    d = d.with_panel(
        ts(
            "Heartbeat age",
            f"Seconds since each rank's newest step, against its stall bound (dashed): {num(cfg.stall_factor)} x "
            f"its mean step time over the last {cfg.stall_window}, at least {num(cfg.stall_min_seconds)} s. "
            f"A heartbeat "
            f"above its bound is a stalled rank; check the GPU health dashboard for the busy-stall signature.",
            units.Seconds,
            [
                q(heartbeat_age(s), f"age {RANK}", "A"),
                q(stall_bound(cfg, s), f"stall bound {RANK}", "B"),
            ],
            dashed={"B": "red"},
        )
    )
    d = d.with_panel(
        ts(
            "Sample age",
            f"Age of each rank's newest in-process sample. It grows while the rank is wedged (for example "
            f"holding the GIL in a C extension); the exporter alert fires above {num(cfg.sample_stale_seconds)} s.",
            units.Seconds,
            [q(f"{m('vramwatch_sample_age_seconds')}{s.rank}", RANK)],
            limits=thresholds((cfg.sample_stale_seconds, "red")),
        )
    )
    return d
