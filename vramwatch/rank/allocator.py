"""In-rank allocator sampler: the caching allocator's stats, read without touching CUDA state.

Rules (see the reference notes on torch and NVML): read nothing until
``torch.cuda.is_initialized()``; then only devices that hold a primary context;
always with an explicit index; never ``mem_get_info``, ``set_device``,
``synchronize`` or ``reset_peak_memory_stats``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Protocol

from vramwatch.rank.device_uuid import device_uuid
from vramwatch.spool import AllocatorInfo, DeviceSample

# Contract name -> path into the nested memory_stats dict. The one place the
# allocator's key names appear; metric names never derive from them.
GAUGE_KEYS: dict[str, tuple[str, ...]] = {
    "torch_cuda_memory_allocated_bytes": ("allocated_bytes", "all", "current"),
    "torch_cuda_memory_reserved_bytes": ("reserved_bytes", "all", "current"),
    "torch_cuda_memory_active_bytes": ("active_bytes", "all", "current"),
    "torch_cuda_memory_inactive_split_bytes": ("inactive_split_bytes", "all", "current"),
    "torch_cuda_memory_requested_bytes": ("requested_bytes", "all", "current"),
    "torch_cuda_memory_peak_allocated_bytes": ("allocated_bytes", "all", "peak"),
    "torch_cuda_memory_peak_reserved_bytes": ("reserved_bytes", "all", "peak"),
    "torch_cuda_memory_segments": ("segment", "all", "current"),
}
COUNTER_KEYS: dict[str, tuple[str, ...]] = {
    "torch_cuda_memory_alloc_retries_total": ("num_alloc_retries",),
    "torch_cuda_memory_ooms_total": ("num_ooms",),
    "torch_cuda_memory_device_allocs_total": ("num_device_alloc",),
    "torch_cuda_memory_device_frees_total": ("num_device_free",),
}


# The same paths, flattened for the sampler's loop (every gauge is three levels deep, every counter one).
_GAUGE_PATHS: tuple[tuple[str, str, str, str], ...] = tuple((n, *p) for n, p in GAUGE_KEYS.items())  # type: ignore[misc]
_COUNTER_PATHS: tuple[tuple[str, str], ...] = tuple((n, *p) for n, p in COUNTER_KEYS.items())  # type: ignore[misc]
assert all(len(p) == 4 for p in _GAUGE_PATHS) and all(len(p) == 2 for p in _COUNTER_PATHS)
# What cudaMallocAsync reports (allocated/active/reserved): its other stats are zeros, not readings.
_ASYNC_KEYS = frozenset(
    (
        "torch_cuda_memory_allocated_bytes",
        "torch_cuda_memory_reserved_bytes",
        "torch_cuda_memory_active_bytes",
        "torch_cuda_memory_peak_allocated_bytes",
        "torch_cuda_memory_peak_reserved_bytes",
    )
)
# Seconds between looks for a device that gained a context, once one has: a job that takes a second GPU
# later shows it within this; a rank of an 8-GPU node using one asks about the seven others this rarely.
DEVICE_PROBE_GAP = 5.0

# Most of one core the largest-free-block snapshots may use (0.01%): a 5 ms snapshot runs every 50 s.
SNAPSHOT_MAX_SHARE = 1e-4


# What the allocator calls on an OOM: (device, requested bytes, device total, device free).
OomObserver = Callable[[int, int, int, int], None]


class ObserverUnavailable(Exception):
    """This allocator will never call an OOM observer; the message says why."""


class AllocatorSource(Protocol):
    """What the rank needs from torch's caching allocator, or from the simulated GPU.

    The sampler reads the first six; OOM forensics and hygiene use the rest. The simulator differs
    from torch only here.
    """

    def devices(self) -> list[int]: ...
    def stats(self, device: int) -> dict[str, Any]: ...
    def uuid(self, device: int) -> str: ...
    def limit_bytes(self, device: int) -> int: ...
    def backend(self) -> str: ...
    def snapshot(self) -> list[dict[str, Any]]: ...

    def attach_oom_observer(self, observer: OomObserver) -> bool:
        """True once attached; False while it cannot be yet. Raises :class:`ObserverUnavailable`."""
        ...

    def detach_oom_observer(self, observer: OomObserver) -> None: ...
    def memory_snapshot(self) -> Any:
        """What ``torch.cuda.memory._snapshot()`` returns (pytorch.org/memory_viz opens its pickle)."""
        ...

    def record_memory_history(self, max_entries: int) -> None:
        """Record alloc/free events with Python stacks (0: stop)."""
        ...

    def release_cache(self, devices: tuple[int, ...]) -> None:
        """``empty_cache()`` for these devices."""
        ...


def _read_values(stats: dict[str, Any]) -> dict[str, float]:
    """The contract's values in one nested memory_stats dict, in GAUGE_KEYS then COUNTER_KEYS order; a
    path that is missing (or None) is left out. Unrolled per depth: this runs every sample."""
    values: dict[str, float] = {}
    for name, a, b, c in _GAUGE_PATHS:
        try:
            v = stats[a][b][c]
        except (KeyError, TypeError, IndexError):
            continue
        if v is not None:
            values[name] = float(v)
    for name, a in _COUNTER_PATHS:
        v = stats.get(a)
        if v is not None:
            values[name] = float(v)
    return values


def alloc_conf(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allocator settings a user can set, as bounded label values."""
    environ: Mapping[str, str] = os.environ if env is None else env
    raw = environ.get("PYTORCH_CUDA_ALLOC_CONF") or environ.get("PYTORCH_ALLOC_CONF") or ""
    conf: dict[str, str] = {}
    for part in raw.split(","):
        if ":" in part:
            k, v = part.split(":", 1)
            conf[k.strip()] = v.strip()
    expandable = conf.get("expandable_segments", "false").lower() in ("true", "1")
    return {  # config values are short numbers; anything else is cut so it cannot bloat a label
        "expandable_segments": "true" if expandable else "false",
        "garbage_collection_threshold": conf.get("garbage_collection_threshold", "")[:16],
        "max_split_size_mb": conf.get("max_split_size_mb", "")[:16],
    }


def segment_summary(segments: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
    """Per device: segment count and largest free block, from memory_snapshot()."""
    out: dict[int, dict[str, int]] = {}
    for seg in segments:
        d = out.setdefault(int(seg.get("device", 0)), {"segments": 0, "largest_free": 0})
        d["segments"] += 1
        for block in seg.get("blocks", ()):
            if block.get("state") == "inactive":
                d["largest_free"] = max(d["largest_free"], int(block.get("size", 0)))
    return out


class AllocatorSampler:
    """Turns one read of the allocator into per-device contract values.

    Keeps the small state a window high-water mark needs: the job's own peak
    is never reset, so the window peak is the allocator's peak when it rose in
    the window (exact), the peak since the job's own reset when the job reset it
    during the window (a lower bound, exact for a job resetting every step),
    else the current value (a lower bound).
    """

    def __init__(self, source: AllocatorSource, largest_block_interval: float) -> None:
        self.source = source
        self.largest_block_interval = largest_block_interval
        self._last_peak: dict[int, float] = {}
        self._uuids: dict[int, str] = {}
        self._segments: dict[int, dict[str, int]] = {}
        self._next_snapshot = 0.0
        self._snapshot_at = 0.0  # wall-clock time of the newest snapshot (its figure's age)
        self._backend: str | None = None
        self._info: AllocatorInfo | None = None

    def read(self, now: float | None = None) -> list[DeviceSample]:
        now = time.monotonic() if now is None else now
        devices = self.source.devices()
        if not devices:
            return []
        if self._backend is None:
            self._backend = self.source.backend()
        native = self._backend == "native"
        if native and self.largest_block_interval > 0 and now >= self._next_snapshot:
            t0 = time.perf_counter()
            self._segments = segment_summary(self.source.snapshot())
            self._snapshot_at = time.time()
            cost = time.perf_counter() - t0
            # the snapshot walks every block under the allocator's lock: however many blocks the
            # job has, keep its share of a core at or below SNAPSHOT_MAX_SHARE by spacing them out
            self._next_snapshot = now + max(self.largest_block_interval, cost / SNAPSHOT_MAX_SHARE)
        out = []
        source = self.source
        for dev in devices:
            stats = source.stats(dev)
            if not stats:
                continue
            values = _read_values(stats)
            if not native:
                values = {k: v for k, v in values.items() if k in _ASYNC_KEYS}
            allocated = values.get("torch_cuda_memory_allocated_bytes", 0.0)
            reserved = values.get("torch_cuda_memory_reserved_bytes", 0.0)
            values["torch_cuda_memory_fragmentation_ratio"] = (reserved - allocated) / reserved if reserved > 0 else 0.0
            values["torch_cuda_memory_step_peak_allocated_bytes"] = self._window_peak(
                dev, allocated, values.get("torch_cuda_memory_peak_allocated_bytes", allocated)
            )
            seg = self._segments.get(dev)
            if seg is not None:
                values["torch_cuda_memory_largest_free_block_bytes"] = float(seg["largest_free"])
                values["torch_cuda_memory_largest_free_block_timestamp_seconds"] = self._snapshot_at
                if values.get("torch_cuda_memory_segments", 0) == 0 and seg["segments"]:
                    values["torch_cuda_memory_segments"] = float(seg["segments"])  # expandable segments
            # read every time: set_per_process_memory_fraction may change it mid-run (a cheap C getter)
            values["torch_cuda_memory_limit_bytes"] = float(source.limit_bytes(dev))
            uuid = self._uuids.get(dev)
            if uuid is None:
                uuid = self._uuids[dev] = source.uuid(dev)
            out.append(DeviceSample(dev, uuid, values))
        return out

    def _window_peak(self, dev: int, current: float, peak: float) -> float:
        last = self._last_peak.get(dev)
        self._last_peak[dev] = peak
        if last is None or peak > last:
            return peak  # a new high inside the window: exact
        if peak < last:
            return max(peak, current)  # the job reset its peak in the window: the peak since then is in it
        return current  # the peak did not move: the window's high is between current and it

    def info(self) -> AllocatorInfo:
        # the allocator reads its config once, at CUDA init: so do we (once the backend is known)
        backend = self._backend or "unknown"
        if self._info is None or self._info.backend != backend:
            self._info = AllocatorInfo(backend=backend, **alloc_conf())
        return self._info


class TorchSource:
    """The real allocator. Imports torch lazily and only if the job already did."""

    def __init__(self) -> None:
        self._torch: ModuleType | None = sys.modules.get("torch")
        self._count: int | None = None
        self._totals: dict[int, int] = {}
        self._initialized = False
        self._active: list[int] = []  # devices seen with a primary context: they keep it
        self._next_probe = 0.0
        # resolved once torch is ready (private getters: each has a public fallback or a safe default)
        self._has_ctx: Callable[[int], bool] | None = None
        self._stats: Callable[[int], dict[str, Any]] | None = None
        self._fraction: Callable[[int], float] | None = None

    def _ready(self) -> bool:
        if self._initialized:  # CUDA, once initialised, stays so in this process (a forked child has no sampler)
            return True
        if self._torch is None:
            self._torch = sys.modules.get("torch")  # never import torch for the job
        if self._torch is None or not self._torch.cuda.is_initialized():
            return False
        self._initialized = True
        self._bind(self._torch)
        return True

    def _bind(self, torch: ModuleType) -> None:
        self._has_ctx = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        # the nested dict torch.cuda.memory_stats() flattens: the C getter itself where there is one (it is
        # private), else the public memory_stats_as_nested_dict (one Python call more, same dict)
        self._stats = getattr(torch._C, "_cuda_memoryStats", None) or torch.cuda.memory_stats_as_nested_dict
        self._fraction = getattr(torch._C, "_cuda_getMemoryFraction", None)

    @property
    def torch(self) -> ModuleType:
        """torch, for the reads below: they run only for devices that ``devices()`` found, so after ``_ready()``."""
        if self._torch is None:
            raise RuntimeError("vramwatch: torch is not imported")
        return self._torch

    def devices(self) -> list[int]:
        if not self._ready():
            return []
        has_ctx = self._has_ctx
        if has_ctx is None:
            return []
        if self._count is None:
            self._count = self.torch.cuda.device_count()
        active = self._active
        if len(active) < self._count:
            # a device with a context keeps it (torch never releases a primary context), so only the others
            # are asked about: every sample until one has a context, then every DEVICE_PROBE_GAP seconds
            now = time.monotonic()
            if not active or now >= self._next_probe:
                self._next_probe = now + DEVICE_PROBE_GAP
                found = [i for i in range(self._count) if i not in active and has_ctx(i)]
                if found:
                    self._active = active = sorted(active + found)
        return active

    def stats(self, device: int) -> dict[str, Any]:
        if self._stats is None:
            self._bind(self.torch)
        return self._stats(device)  # type: ignore[misc]

    def uuid(self, device: int) -> str:
        props = self.torch.cuda.get_device_properties(device)
        raw = str(getattr(props, "uuid", ""))
        # NVML's spelling (GPU-... or, on a MIG instance, MIG-...), so the series join the device series
        env = os.environ
        name = str(getattr(props, "name", ""))
        return device_uuid(raw, name, device, env.get("CUDA_VISIBLE_DEVICES"), env.get("NVIDIA_VISIBLE_DEVICES"))

    def limit_bytes(self, device: int) -> int:
        total = self._totals.get(device)
        if total is None:
            total = self._totals[device] = self.torch.cuda.get_device_properties(device).total_memory
            if self._stats is None:
                self._bind(self.torch)
        frac_fn = self._fraction
        frac = frac_fn(device) if frac_fn is not None else 1.0
        return int(total * frac)

    def backend(self) -> str:
        return self.torch.cuda.get_allocator_backend()

    def snapshot(self) -> list[dict[str, Any]]:
        try:
            return self.torch.cuda.memory_snapshot(include_traces=False)
        except TypeError:  # torch < 2.11 has no include_traces
            return self.torch.cuda.memory_snapshot()

    # --- OOM forensics and hygiene ---
    def attach_oom_observer(self, observer: OomObserver) -> bool:
        # attaching initialises CUDA: only once the job did; read sys.modules afresh (the job may import torch later)
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return False
        try:
            if torch.cuda.get_allocator_backend() != "native":
                raise ObserverUnavailable("allocator backend is not native")  # cudaMallocAsync has no observers
            attach = torch._C._cuda_attach_out_of_memory_observer  # private, torch 2.5-2.13
        except AttributeError as e:
            raise ObserverUnavailable(f"no OOM observer in this torch ({e!r})") from None
        attach(observer)
        return True

    def detach_oom_observer(self, observer: OomObserver) -> None:
        pass  # torch observers cannot be detached: the observer turns inert instead

    def memory_snapshot(self) -> Any:
        return sys.modules["torch"].cuda.memory._snapshot()

    def record_memory_history(self, max_entries: int) -> None:
        memory = sys.modules["torch"].cuda.memory
        if max_entries > 0:
            memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)
        else:
            memory._record_memory_history(enabled=None)

    def release_cache(self, devices: tuple[int, ...]) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # every device of the process; the job's devices are the ones pending
