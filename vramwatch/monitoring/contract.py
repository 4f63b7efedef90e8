"""The metric contract: every family vramwatch exposes, defined once.

Collectors build families only through :func:`family`, the README table and
``docs/METRICS.md`` are generated from :data:`METRICS`, and alerts and
dashboards take names from here. A test fails on any exposed family that is
not listed. Names never derive from ``memory_stats()`` keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from vramwatch.monitoring import xid_catalogue
from vramwatch.monitoring.cadence import READ_MAX_GAP

# the bounded label values of the rank's training families: the spool's schema checks them, so defined there
from vramwatch.spool.schema import EXIT_REASONS, NONFINITE_VALUES, PHASES, WAIT_KINDS  # noqa: F401 - re-exported

# job_id: the job a rank belongs to (vramwatch.rank.identity; bounded, at most 64 of [A-Za-z0-9_.-]), so
# the same rank of two jobs on one node is two series. Not `job`: Prometheus's target label owns that.
JOB_ID = "job_id"
RANK = ("rank", "local_rank", JOB_ID)
RANK_DEVICE = ("uuid", "device", "rank", "local_rank", JOB_ID)
GPU = ("gpu", "uuid")
# a MIG instance: gpu is its parent's index, uuid its own MIG-... uuid (what a rank on it labels its series with)
MIG = ("gpu", "uuid")
MIG_INFO = MIG + ("parent_uuid", "gpu_instance_id", "compute_instance_id", "profile")
COLLECTOR = ("collector", "rank", JOB_ID)

# NVIDIA's Xid catalogue (vramwatch.monitoring.xid_catalogue: source, version, advice): Xid -> (mnemonic,
# meaning, action). The action, the catalogue's immediate-action bucket, labels the Xid families
# (`unknown` for a code the catalogue lacks) and splits the Xid alerts: XID_PAGE_ACTIONS page,
# XID_WARN_ACTIONS warn, a lone Xid 45 warns, `ignore` never alerts.
XID_CATALOGUE: dict[int, tuple[str, str, str]] = xid_catalogue.CATALOGUE
XID_ACTIONS: tuple[str, ...] = xid_catalogue.ACTIONS
XID_PAGE_ACTIONS: tuple[str, ...] = xid_catalogue.PAGE_ACTIONS
XID_WARN_ACTIONS: tuple[str, ...] = xid_catalogue.WARN_ACTIONS
# The Xids whose counters the server pre-initialises at 0 (so a first event is an increase; any other
# code alerts through its last-event timestamp): the ones training jobs meet, a short list.
XID_PREINIT: tuple[int, ...] = (13, 31, 43, 45, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 46, 109, 140, 154)
# Of those, the ones that page and the ones that warn by their action: MonitoringConfig's defaults for
# xid_critical / xid_warning (codes that page / warn whatever their action), so the default split is the
# catalogue's and an override moves a code.
XID_CRITICAL: tuple[int, ...] = tuple(x for x in XID_PREINIT if xid_catalogue.action(x) in XID_PAGE_ACTIONS)
XID_WARNING: tuple[int, ...] = tuple(x for x in XID_PREINIT if xid_catalogue.action(x) in XID_WARN_ACTIONS)
# gpu_recovery_action's `action`: NVML's GPU recovery action states, by value
RECOVERY_ACTIONS: tuple[str, ...] = xid_catalogue.RECOVERY_ACTIONS

# Why a node has no NVML, the `reason` of vramwatch_nvml_available 0: no libnvidia-ml (a CPU-only pod or
# host), the library without its kernel driver, or NVML answering with no GPU. A state, not a failure.
NVML_ABSENT_REASONS: tuple[str, ...] = ("library_not_found", "driver_not_loaded", "no_devices")

# the `type` of gpu_nvlink_errors_total: NVML's data-link replay, recovery and CRC (flit + data) counters
NVLINK_ERROR_TYPES: tuple[str, ...] = ("replay", "recovery", "crc")


@dataclass(frozen=True)
class MetricSpec:
    name: str  # full exposed name (counters include _total)
    type: str  # gauge | counter | histogram | info
    unit: str  # Prometheus base unit, "" for dimensionless
    labels: tuple[str, ...]
    help: str
    collector: str  # which collector publishes it
    absent_when: str = ""


_UNITS = ("bytes", "seconds", "watts", "joules", "hertz", "celsius")


def _section(collector: str, labels: tuple[str, ...], absent_when: str = "") -> Callable[..., MetricSpec]:
    """The spec maker of one collector's rows: ``labels`` and ``absent_when`` are the rows' defaults.

    A row's type and unit follow from its name, as Prometheus names them: ``_total`` is a counter, ``_info``
    an info family, any other a gauge unless the row says otherwise; the unit is the base unit in the name.
    """

    def make(
        name: str, help_: str, absent: str = absent_when, *, labels: tuple[str, ...] = labels, type_: str = ""
    ) -> MetricSpec:
        kind = type_ or ("counter" if name.endswith("_total") else "info" if name.endswith("_info") else "gauge")
        unit = next((u for u in _UNITS if f"_{u}" in name), "")
        return MetricSpec(name, kind, unit, labels, help_, collector, absent)

    return make


_NOT_INIT = "the rank has not initialised CUDA on that device"
_ASYNC = _NOT_INIT + "; the backend is cudaMallocAsync (always reported as zero there)"
_NO_SNAPSHOT = _NOT_INIT + "; the backend is cudaMallocAsync (no snapshot); before the first slow sample"
_NO_OOM = "no OOM has happened in this rank"
_NO_SNAPSHOT_FILE = "OOM snapshots are off or none was written"
_NO_GPM = "GPM is not supported (before Hopper, MIG on, or a VM that hides it); before the second slow sample"
_NO_MIG = "no GPU of the node is in MIG mode (or NVML is unavailable, or does not enumerate MIG devices)"

_allocator = _section("allocator", RANK_DEVICE, _NOT_INIT)
_heartbeat = _section("heartbeat", RANK)
_nvml = _section("nvml", GPU, "NVML is unavailable")
_mig = _section("nvml", MIG, _NO_MIG)
_gpm = _section("gpm", GPU, _NO_GPM)
_nvlink = _section("nvlink", GPU)
_processes = _section("processes", GPU, "process attribution is off")
_xid = _section("xid", GPU + ("xid", "action"))
_self = _section("self", COLLECTOR)

METRICS: tuple[MetricSpec, ...] = (
    # --- allocator: one series per (rank, CUDA device) the rank initialised ---
    _allocator("torch_cuda_memory_allocated_bytes", "Bytes held by live tensors (allocated_bytes.all.current)."),
    _allocator(
        "torch_cuda_memory_reserved_bytes",
        "Bytes cached by the caching allocator, what the driver sees (reserved_bytes.all.current).",
    ),
    _allocator(
        "torch_cuda_memory_active_bytes",
        "Bytes in active blocks, allocated or awaiting stream events (active_bytes.all.current).",
    ),
    _allocator(
        "torch_cuda_memory_inactive_split_bytes",
        "Free pieces of split segments that empty_cache() cannot release (fragmentation).",
        _ASYNC,
    ),
    _allocator(
        "torch_cuda_memory_requested_bytes", "Bytes requested by tensors before the allocator's rounding.", _ASYNC
    ),
    _allocator(
        "torch_cuda_memory_fragmentation_ratio",
        "(reserved - allocated) / reserved: the share of the cache not holding tensors, 0 when nothing is reserved.",
    ),
    _allocator(
        "torch_cuda_memory_largest_free_block_bytes",
        "Largest free cached block, from the allocator snapshot on a slower cadence, spaced by its cost to at "
        "most 0.01% of a core: at 10,000 segments a snapshot costs ~50 ms on an H100, so the figure can be ~8 "
        "min old (its age: the _timestamp_seconds family).",
        _NO_SNAPSHOT,
    ),
    _allocator(
        "torch_cuda_memory_largest_free_block_timestamp_seconds",
        "When the snapshot behind the largest free block was taken (Unix time): snapshots are spaced by their "
        "cost, so on a job of many blocks the figure can be minutes old.",
        _NO_SNAPSHOT,
    ),
    _allocator(
        "torch_cuda_memory_peak_allocated_bytes",
        "Peak allocated bytes since start or the job's own reset_peak_memory_stats().",
    ),
    _allocator(
        "torch_cuda_memory_peak_reserved_bytes",
        "Peak reserved bytes since start or the job's own reset_peak_memory_stats().",
    ),
    _allocator(
        "torch_cuda_memory_step_peak_allocated_bytes",
        "High-water mark of allocated bytes over the last sample window, without resetting the "
        "job's peak statistics (a slow leak shows as a rising series).",
    ),
    _allocator(
        "torch_cuda_memory_limit_bytes",
        "Per-process budget: the memory fraction in force times the device's total memory.",
    ),
    _allocator(
        "torch_cuda_memory_alloc_retries_total",
        "cudaMalloc retries after the allocator flushed its cache (num_alloc_retries).",
        _ASYNC,
    ),
    _allocator("torch_cuda_memory_ooms_total", "Out-of-memory errors raised by the allocator (num_ooms)."),
    _allocator(
        "torch_cuda_memory_device_allocs_total", "cudaMalloc (or cuMemMap) calls made by the allocator.", _ASYNC
    ),
    _allocator("torch_cuda_memory_device_frees_total", "cudaFree (or cuMemUnmap) calls made by the allocator.", _ASYNC),
    _allocator(
        "torch_cuda_memory_segments",
        "Segments held by the allocator (from the snapshot under expandable segments).",
        _ASYNC,
    ),
    _allocator(
        "torch_cuda_memory_cache_reclaims_total",
        "Times the opt-in allocator hygiene emptied the cache between steps.",
        "allocator hygiene is off",
    ),
    _allocator(
        "torch_cuda_memory_last_oom_requested_bytes",
        "Size of the allocation that failed in the newest out-of-memory error.",
        _NO_OOM,
    ),
    _allocator(
        "torch_cuda_memory_last_oom_free_bytes",
        "Free device memory the driver reported at the newest out-of-memory error.",
        _NO_OOM,
    ),
    _allocator(
        "torch_cuda_memory_last_oom_timestamp_seconds",
        "When the newest out-of-memory error happened (Unix time).",
        _NO_OOM,
    ),
    _allocator(
        "vramwatch_memory_role_bytes",
        "Device memory of the watched model by role (vramwatch.watch()): parameters, gradients and "
        "optimizer_state (each storage once; a DTensor's local shard), and other = allocated minus those "
        "three (activations, autograd's saved tensors, workspaces). With the cache (reserved - allocated) "
        "they add up to reserved. Walked every role_interval seconds at most 0.01% of a core (~1 us a tensor on "
        "an H100), so the figures age with the model: up to ~7 min old at 8,000 parameters (40k tensors with "
        "AdamW's state), ~95 min at 100,000.",
        "the job did not call vramwatch.watch(), or its first walk has not completed; other: " + _NOT_INIT,
        labels=RANK_DEVICE + ("role",),
    ),
    _allocator(
        "torch_cuda_allocator_info",
        "Allocator settings in force (value 1).",
        "the rank has not initialised CUDA",
        labels=RANK + ("backend", "expandable_segments", "garbage_collection_threshold", "max_split_size_mb"),
    ),
    _allocator(
        "vramwatch_oom_snapshot_info",
        "The newest memory snapshot written on an OOM, openable at pytorch.org/memory_viz (value 1).",
        _NO_SNAPSHOT_FILE,
        labels=RANK + ("path",),
    ),
    _allocator(
        "vramwatch_oom_snapshot_timestamp_seconds",
        "When the newest OOM memory snapshot was written (Unix time).",
        _NO_SNAPSHOT_FILE,
        labels=RANK,
    ),
    # --- heartbeat: one series per rank ---
    _heartbeat("vramwatch_training_steps_total", "Training steps reported by the job (vramwatch.step())."),
    _heartbeat(
        "vramwatch_training_tokens_total",
        "Tokens the job reported processing on this rank (vramwatch.step(tokens=N)).",
        "the job passes no tokens",
    ),
    _heartbeat(
        "vramwatch_training_samples_total",
        "Samples the job reported processing on this rank (vramwatch.step(samples=N)).",
        "the job passes no samples",
    ),
    _heartbeat(
        "vramwatch_model_flops_per_token",
        "Training FLOPs per token of the watched model, as the job declared it (vramwatch.watch("
        "flops_per_token=...)): with the tokens rate and the GPU's peak, the MFU.",
        "the job declared no FLOPs per token",
    ),
    _heartbeat(
        "vramwatch_training_last_step_timestamp_seconds",
        "When the newest step was reported (Unix time): the heartbeat.",
        "no step has been reported yet",
    ),
    _heartbeat("vramwatch_training_step_duration_seconds", "Time between consecutive steps.", type_="histogram"),
    _heartbeat(
        "vramwatch_training_loss",
        f"Loss the job passed with its newest step (a GPU tensor: copied without waiting for the GPU, "
        f"at most {READ_MAX_GAP:g} s apart, so it may trail the step counter by two of those); NaN or +-Inf "
        f"when it read as such.",
        "the job passes no loss",
    ),
    _heartbeat(
        "vramwatch_training_grad_norm",
        f"Gradient norm the job passed with its newest step (a GPU tensor: read like the loss, at most "
        f"{READ_MAX_GAP:g} s apart).",
        "the job passes no grad norm",
    ),
    _heartbeat(
        "vramwatch_sample_age_seconds",
        "Age of the rank's newest published sample: grows while the rank is wedged. As of the server's last "
        "render, which may be one render gap (the shorter of interval and nvml_interval) older than the scrape.",
    ),
    _heartbeat(
        "vramwatch_rank_info", "A rank publishing into this target (value 1).", labels=RANK + ("world_size", "hostname")
    ),
    # --- how each rank ended, what it waits for, what it is doing (the rank side of incidents) ---
    _heartbeat(
        "vramwatch_rank_exits_total",
        "How the rank ended (value 1), served with its final sample: reason finished, exception, oom, signal, "
        "or killed (its process is gone and it left no final word); detail the exception's class or the "
        "signal's name, else empty.",
        "the rank is alive, or its final sample's grace window has passed",
        labels=RANK + ("reason", "detail"),
    ),
    _heartbeat(
        "vramwatch_collectives_total",
        "Collectives this rank has issued on its default process group (its collective sequence number). "
        "In a hang, the ranks lowest in their job are the ones the others wait for.",
        "torch.distributed is not initialised in the rank",
    ),
    _heartbeat(
        "vramwatch_training_wait_seconds_total",
        "Time the training thread spent waiting: kind collective (blocked off-CPU outside its data wait, "
        "in a gloo job: waiting for its peers) or data (for its next batch, in vramwatch.track() or a "
        "callback). In a synchronous job the slow rank is the one that waits least.",
        "collective: not a gloo (CPU-collective) job, or no schedstat; data: the loop is not tracked",
        labels=RANK + ("kind",),
    ),
    _heartbeat(
        "vramwatch_training_phase_start_timestamp_seconds",
        "When the rank's declared non-training phase began (Unix time): vramwatch.phase('eval'), the "
        "callbacks' evaluation and checkpoint save/load.",
        "the rank is training (in no declared phase)",
        labels=RANK + ("phase",),
    ),
    _heartbeat(
        "vramwatch_training_nonfinite_total",
        "Reads of the loss or grad norm the job passed that were NaN or +-Inf (where vramwatch reads it: "
        "a Python number at each step, a tensor at each of its reads on the sampler thread).",
        "the job has passed no such value",
        labels=RANK + ("value",),
    ),
    # --- NVML device readings: one series per GPU of the node ---
    _nvml(
        "gpu_info",
        "GPU identity (value 1).",
        labels=GPU + ("name", "driver_version", "pci_bus_id", "hostname", "mig_mode"),
    ),
    _nvml("gpu_up", "1 while NVML answers for the GPU, 0 when it is lost (GPU_IS_LOST) or stops answering."),
    _nvml("gpu_memory_total_bytes", "Device memory as NVML reports it."),
    _nvml("gpu_memory_used_bytes", "Device memory in use by all processes, as NVML reports it."),
    _nvml("gpu_memory_free_bytes", "Free device memory, as NVML reports it."),
    _nvml(
        "gpu_memory_reserved_bytes",
        "Device memory the driver reserves for itself (NVML memory info v2).",
        "the driver has no v2 memory call",
    ),
    _nvml(
        "gpu_non_torch_memory_bytes",
        "NVML used memory minus the reserved bytes of this job's ranks on the GPU (CUDA contexts, "
        "NCCL buffers, other libraries, other processes).",
    ),
    _nvml("gpu_power_watts", "Power draw (NVML averages over 1 s on Ampere and newer).", "not supported by the GPU"),
    _nvml("gpu_power_limit_watts", "Enforced power limit after all limiters.", "not supported by the GPU"),
    _nvml(
        "gpu_energy_joules_total",
        "Energy since the driver loaded (slow cadence); resets on driver reload.",
        "not supported by the GPU (pre-Volta)",
    ),
    _nvml("gpu_utilization_ratio", "Share of the sample period a kernel ran (0..1).", "not supported (MIG)"),
    _nvml(
        "gpu_memory_utilization_ratio",
        "Share of the sample period device memory was read or written (0..1).",
        "not supported (MIG)",
    ),
    _nvml("gpu_temperature_celsius", "GPU core temperature.", "not supported by the GPU"),
    _nvml("gpu_sm_clock_hertz", "Current SM clock.", "not supported"),
    _nvml("gpu_memory_clock_hertz", "Current memory clock.", "not supported"),
    _nvml(
        "gpu_clock_throttle",
        "1 while the clocks are held down for that reason, else 0.",
        "not supported",
        labels=GPU + ("reason",),
    ),
    _nvml(
        "gpu_ecc_errors_total",
        "ECC errors since the driver loaded (volatile), by type corrected/uncorrected.",
        "ECC is off or not supported",
        labels=GPU + ("type",),
    ),
    _nvml(
        "gpu_remapped_rows",
        "Remapped memory rows: correctable, uncorrectable, pending (reset needed), failure.",
        "not supported (pre-Ampere, MIG)",
        labels=GPU + ("kind",),
    ),
    _nvml("gpu_pcie_replays_total", "PCIe replay counter (slow cadence).", "not supported"),
    # --- MIG: one series per MIG instance (compute instance) of a GPU in MIG mode ---
    _mig(
        "gpu_mig_info",
        "A MIG instance of GPU gpu (value 1): uuid is the instance's MIG-... uuid (NVML's, the one a rank on "
        "the instance labels its series with), parent_uuid the card's GPU-... uuid (the uuid of its gpu_* "
        "series), gpu_instance_id and compute_instance_id NVML's ids (dcgm-exporter's GPU_I_ID is the first), "
        "profile the MIG profile from the instance's name (e.g. 3g.71gb; dcgm-exporter's GPU_I_PROFILE).",
        labels=MIG_INFO,
    ),
    _mig(
        "gpu_mig_memory_total_bytes",
        "Memory of the MIG instance as NVML reports it for the instance's handle (its own share, not the card's).",
    ),
    _mig("gpu_mig_memory_used_bytes", "Memory of the MIG instance in use by its processes, as NVML reports it."),
    _mig("gpu_mig_memory_free_bytes", "Free memory of the MIG instance, as NVML reports it."),
    # --- GPU activity: NVML GPM (Hopper and newer), a rate over one slow interval between two samples ---
    _gpm(
        "gpu_sm_activity_ratio",
        "Share of SMs busy over the last slow interval (NVML GPM SM_UTIL, 0..1); unlike gpu_utilization_ratio "
        "(a kernel ran at all) it shows how much of the chip the kernels used.",
    ),
    _gpm(
        "gpu_sm_occupancy_ratio",
        "Resident warps against the SMs' maximum over the last slow interval (NVML GPM SM_OCCUPANCY, 0..1).",
    ),
    _gpm(
        "gpu_tensor_activity_ratio",
        "Share of time the SMs ran any tensor-core work over the last slow interval (NVML GPM ANY_TENSOR_UTIL, 0..1).",
    ),
    _gpm(
        "gpu_dram_bandwidth_utilization_ratio",
        "Device-memory bandwidth used against the theoretical peak over the last slow interval (NVML GPM "
        "DRAM_BW_UTIL, 0..1).",
    ),
    _gpm(
        "gpu_pcie_rx_bytes_per_second",
        "PCIe traffic into the GPU over the last slow interval (NVML GPM PCIE_RX_PER_SEC).",
    ),
    _gpm(
        "gpu_pcie_tx_bytes_per_second",
        "PCIe traffic out of the GPU over the last slow interval (NVML GPM PCIE_TX_PER_SEC).",
    ),
    _gpm(
        "gpu_nvlink_rx_bytes_per_second",
        "NVLink traffic received over all links in the last slow interval (NVML GPM NVLINK_TOTAL_RX_PER_SEC).",
        _NO_GPM + "; no NVLink",
    ),
    _gpm(
        "gpu_nvlink_tx_bytes_per_second",
        "NVLink traffic sent over all links in the last slow interval (NVML GPM NVLINK_TOTAL_TX_PER_SEC).",
        _NO_GPM + "; no NVLink",
    ),
    _nvlink(
        "gpu_nvlink_errors_total",
        "NVLink data-link errors of the GPU's active links together since the driver loaded (slow cadence), by type: "
        + ", ".join(NVLINK_ERROR_TYPES)
        + " (crc: flit and data CRC errors together).",
        "NVLink is not supported or no link is active (also in VMs that hide the links)",
        labels=GPU + ("type",),
    ),
    _processes("gpu_foreign_processes", "Compute processes on the GPU that are not ranks of this job."),
    _processes("gpu_foreign_process_memory_bytes", "Device memory used by the foreign processes."),
    _xid(
        "gpu_xid_errors_total",
        "Xid events seen since the exporter started (pre-initialised at 0 for the Xids that matter); action: "
        "the resolution bucket of NVIDIA's Xid catalogue for that code (contract.XID_ACTIONS, unknown for a code "
        "it lacks).",
        "the Xid watcher is off or NVML has no events",
    ),
    _xid(
        "gpu_last_xid_timestamp_seconds",
        "When the newest event of that Xid came (Unix time).",
        "no event of that Xid yet",
    ),
    _nvml(
        "gpu_recovery_action",
        "NVML's GPU recovery action, 1 for the state in force and 0 for the others: "
        + ", ".join(RECOVERY_ACTIONS)
        + " (read on the NVML collector's cadence).",
        "the driver or GPU lacks the field (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, newer drivers), or the GPU is lost",
        labels=GPU + ("action",),
    ),
    # --- self-health ---
    _nvml(
        "vramwatch_nvml_available",
        "1 on a node with NVML and GPUs (reason empty); 0 on one without, reason one of "
        + ", ".join(NVML_ABSENT_REASONS)
        + ": a state, not a failure (the NVML collectors stay up).",
        "the NVML collector is off, or NVML's init fails for another reason (then its up is 0)",
        labels=("reason",),
    ),
    _self(
        "vramwatch_collector_up",
        "1 if the collector's last read worked (an unsupported field, or a node without NVML, keeps it 1), "
        "else 0. "
        "rank and job_id are empty for the server's own collectors.",
    ),
    _self("vramwatch_collector_errors_total", "Failed reads of the collector."),
    _self("vramwatch_collector_duration_seconds", "How long the collector's last read took."),
    _self(
        "vramwatch_ranks",
        "Live ranks publishing into this target, of all its jobs: the number of vramwatch_sample_age_seconds "
        "series. A dead rank's final sample, served for dead_rank_grace_seconds with its vramwatch_rank_info, is "
        "not counted (count(vramwatch_rank_info) is larger by the dead ranks in their window).",
        labels=(),
    ),
    _self(
        "vramwatch_spool_dropped_total",
        "What the server left out of the ranks' samples to bound cardinality, by reason: dead_rank (a dead "
        "rank's final sample beyond its owner's share of max_ranks final samples), rank (a live rank beyond its "
        "owner's share of max_ranks or of the series budget, per read), oversized "
        "(a sample file too large), device, collector, value (entries beyond the per-sample bounds), label "
        "(an entry whose label value is too long), refused (an entry of a node daemon's spool that is not its owner's "
        "own: a symlink, another user's file, a squatted directory, a sample under another user's job_id; per read, "
        "see docs/security.md).",
        labels=("reason",),
    ),
    _self("vramwatch_build_info", "vramwatch build (value 1).", labels=("version", "hostname")),
    _self(
        "vramwatch_server_mode",
        "What serves this target (value 1): node, the node's long-running daemon (`vramwatch serve --node`) for "
        "every user's ranks, whose absence is a fault; job, a server a rank started, which exits after its "
        "ranks (VramwatchTargetDown tells them apart).",
        labels=("mode",),
    ),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}


def spec(name: str) -> MetricSpec:
    return BY_NAME[name]


def family(name: str) -> Any:
    """A fresh metric family for ``name`` with the contract's help and labels.

    Typed ``Any``: which family class it is depends on the name's spec, and callers call the class's own
    ``add_metric``.
    """
    s = BY_NAME[name]
    labels = list(s.labels)
    if s.type == "counter":
        return CounterMetricFamily(s.name, s.help, labels=labels)  # it exposes name_total (and strips one)
    if s.type == "histogram":
        return HistogramMetricFamily(s.name, s.help, labels=labels)
    # info families are exposed as gauges of value 1 (the *_info convention), so
    # that PromQL joins and text format 0.0.4 treat them alike.
    return GaugeMetricFamily(s.name, s.help, labels=labels)


def exposed_names(text_names: Iterable[str]) -> set[str]:
    """Map sample names of an exposition to contract names (strip histogram suffixes)."""
    out = set()
    for n in text_names:
        for suffix in ("_bucket", "_sum", "_count", "_created"):
            if n.endswith(suffix) and n[: -len(suffix)] in BY_NAME:
                n = n[: -len(suffix)]
                break
        out.add(n)
    return out
