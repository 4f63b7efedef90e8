"""A simulated caching allocator that reports the real ``memory_stats()`` shape of a torch version.

tests/data/memory_stats_keys/ holds each version's flattened key list; the tests compare this shape to it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from vramwatch.rank.device_uuid import device_uuid
from vramwatch.sim.state import SimNode

MIB = 1 << 20
_POOLS = ("all", "large_pool", "small_pool")
_STATS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)

# Counters each torch version adds to 2.11's (122 keys): num_oom_rejections counts the allocations that
# throw_on_cudamalloc_oom refused (0 here: the simulator never refuses early).
EXTRA_COUNTERS: dict[str, tuple[str, ...]] = {"2.11": (), "2.13": ("num_oom_rejections",)}
TORCH_SHAPES = tuple(EXTRA_COUNTERS)
DEFAULT_SHAPE = "2.13"  # the torch the tests install


class SimOutOfMemoryError(RuntimeError):
    """What torch.cuda.OutOfMemoryError is to the real allocator."""


class _Stat:
    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, n: int) -> None:
        if n >= 0:
            self.current += n
            self.allocated += n
            self.peak = max(self.peak, self.current)
        else:
            self.current += n
            self.freed -= n

    def as_dict(self) -> dict[str, int]:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


class _Device:
    def __init__(self, total: int, extra_counters: tuple[str, ...]) -> None:
        self.total = total
        self.fraction = 1.0
        self.stats = {name: _Stat() for name in _STATS}
        self.counters = {
            "num_alloc_retries": 0,
            "num_ooms": 0,
            "num_sync_all_streams": 0,
            "num_device_alloc": 0,
            "num_device_free": 0,
        }
        self.counters.update(dict.fromkeys(extra_counters, 0))

    def v(self, name: str) -> int:
        return self.stats[name].current


class SimAllocator:
    """One rank's allocator over the simulated node's GPUs, addressed by CUDA index.

    The model is byte-level, not block-level: allocated, reserved and
    inactive-split bytes move as a caching allocator's would, with a retry
    (cache flush) before an OOM.
    """

    def __init__(self, node: SimNode, visible: str | None = None, torch_version: str = DEFAULT_SHAPE) -> None:
        if torch_version not in EXTRA_COUNTERS:
            raise ValueError(f"no memory_stats() shape for torch {torch_version!r}; known: {', '.join(TORCH_SHAPES)}")
        self.torch_version = torch_version
        self.node = node
        self.visible_env = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
        # CUDA index -> (node GPU index, MIG instance index or -1 for the whole GPU)
        self.placement = _visible(node, self.visible_env)
        self.physical = [gpu for gpu, _ in self.placement]
        self._devices: dict[int, _Device] = {}
        self.oom_observers: list[Callable[[int, int, int, int], None]] = []
        self.backend_name = "native"  # or "cudaMallocAsync", to simulate that backend
        # names of AllocatorSource methods that raise, to inject faults into the sampler
        self.faults: set[str] = set()

    def _fault(self, name: str) -> None:
        if name in self.faults or "*" in self.faults:
            raise RuntimeError(f"injected allocator fault in {name}()")

    # --- the AllocatorSource protocol, as the sampler reads it ---
    def devices(self) -> list[int]:
        self._fault("devices")
        return sorted(self._devices)

    def stats(self, device: int) -> dict[str, Any]:
        self._fault("stats")
        d = self._devices.get(device)
        if d is None:
            return {}
        out: dict[str, Any] = {}
        for name, stat in d.stats.items():
            pools = {p: {"current": 0, "peak": 0, "allocated": 0, "freed": 0} for p in _POOLS}
            pools["all"] = stat.as_dict()
            pools["large_pool"] = stat.as_dict()
            out[name] = pools
        out.update(d.counters)
        out["max_split_size"] = -1
        for name in ("oversize_allocations", "oversize_segments"):
            out[name] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
        return out

    def backend(self) -> str:
        self._fault("backend")
        return self.backend_name

    def uuid(self, device: int) -> str:
        """What the rank's uuid rule makes of what CUDA would report: torch's bare uuid (a MIG instance's own
        bytes, cuDeviceGetUuid_v2's) and the device name (``... MIG <profile>`` on an instance)."""
        self._fault("uuid")
        gpu_index, mig = self.placement[device]
        g = self.node.gpus[gpu_index]
        uuid, name = g.uuid, g.name
        if mig >= 0:
            uuid, name = g.mig_instances[mig].uuid, f"{g.name} MIG {g.mig_instances[mig].profile}"
        return device_uuid(uuid.split("-", 1)[1], name, device, self.visible_env)

    def limit_bytes(self, device: int) -> int:
        self._fault("limit_bytes")
        d = self._dev(device)
        return int(d.total * d.fraction)

    def snapshot(self) -> list[dict[str, Any]]:
        self._fault("snapshot")
        segs = []
        for idx, d in self._devices.items():
            pending = d.v("active_bytes") - d.v("allocated_bytes")
            free = d.v("reserved_bytes") - d.v("active_bytes")
            split = min(d.v("inactive_split_bytes"), free)
            blocks = [{"size": d.v("allocated_bytes"), "state": "active_allocated"}]
            if pending:
                blocks.append({"size": pending, "state": "active_pending_free"})  # freed, awaiting its stream
            if split:
                blocks.append({"size": split, "state": "inactive"})  # the largest of the split pieces
            if free - split:
                segs.append(
                    {"device": idx, "total_size": free - split, "blocks": [{"size": free - split, "state": "inactive"}]}
                )
            segs.append({"device": idx, "total_size": d.v("active_bytes") + split, "blocks": blocks})
        return segs

    # --- the rest of the protocol: OOM forensics and hygiene ---
    def attach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> bool:
        self.oom_observers.append(observer)
        return True

    def detach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> None:
        try:
            self.oom_observers.remove(observer)
        except ValueError:
            pass

    def memory_snapshot(self) -> dict[str, Any]:
        """The state in the shape of torch.cuda.memory._snapshot()."""
        segments = []
        addr = 0x7F0000000000
        for seg in self.snapshot():
            blocks = []
            base = addr
            for b in seg.get("blocks", ()):
                size = int(b.get("size", 0))
                state = b.get("state", "inactive")
                blocks.append({"address": addr, "size": size, "requested_size": size, "state": state, "frames": []})
                addr += size
            total = int(seg.get("total_size", addr - base))
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            segments.append(
                {
                    "device": int(seg.get("device", 0)),
                    "address": base,
                    "total_size": total,
                    "allocated_size": allocated,
                    "active_size": allocated,
                    "requested_size": allocated,
                    "stream": 0,
                    "segment_type": "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": blocks,
                }
            )
            addr = base + total + (2 << 20)
        return {
            "segments": segments,
            "device_traces": [[] for _ in self.devices()],
            "allocator_settings": {},
            "external_annotations": [],
        }

    def record_memory_history(self, max_entries: int) -> None:
        pass  # the simulated allocator keeps no history

    def release_cache(self, devices: tuple[int, ...]) -> None:
        for dev in devices:
            self.empty_cache(dev)

    # --- driving it ---
    def init(self, device: int = 0) -> None:
        """What creating the first tensor on a device does: the device becomes visible to the sampler."""
        self._dev(device)

    def set_memory_fraction(self, fraction: float, device: int = 0) -> None:
        self._dev(device).fraction = fraction

    def allocate(self, nbytes: int, device: int = 0) -> None:
        d = self._dev(device)
        nbytes = int(nbytes)
        cached_free = d.v("reserved_bytes") - d.v("active_bytes") - d.v("inactive_split_bytes")
        if cached_free < nbytes:
            # no cached block fits: the allocator asks the driver for a new segment of the full size
            grow = _round_segment(nbytes)
            limit = d.total * d.fraction
            if d.v("reserved_bytes") + grow > limit:
                # cudaMalloc would fail: free the cache and retry, as the real allocator does
                d.counters["num_alloc_retries"] += 1
                d.counters["num_sync_all_streams"] += 1
                self._release_cache(d)
                if d.v("reserved_bytes") + grow > limit:
                    d.counters["num_ooms"] += 1
                    free = int(limit - d.v("reserved_bytes"))
                    for obs in list(self.oom_observers):
                        obs(device, nbytes, int(limit), free)
                    raise SimOutOfMemoryError(
                        f"CUDA out of memory (simulated). Tried to allocate {nbytes / MIB:.2f} MiB"
                    )
            d.stats["reserved_bytes"].add(grow)
            d.stats["segment"].add(1)
            d.counters["num_device_alloc"] += 1
        d.stats["allocated_bytes"].add(nbytes)
        d.stats["active_bytes"].add(nbytes)
        d.stats["requested_bytes"].add(nbytes)
        d.stats["allocation"].add(1)
        d.stats["active"].add(1)

    def free(self, nbytes: int, device: int = 0) -> None:
        d = self._dev(device)
        nbytes = min(int(nbytes), d.v("allocated_bytes"))
        for name in ("allocated_bytes", "active_bytes", "requested_bytes"):
            d.stats[name].add(-nbytes)
        if d.v("allocation") > 0:
            d.stats["allocation"].add(-1)
            d.stats["active"].add(-1)

    def free_pending(self, nbytes: int, device: int = 0) -> None:
        """Free a tensor another stream still uses (``record_stream``): it stops counting as allocated now,
        but its block stays active, neither reusable nor releasable, until :meth:`process_events`."""
        d = self._dev(device)
        nbytes = min(int(nbytes), d.v("allocated_bytes"))
        d.stats["allocated_bytes"].add(-nbytes)
        d.stats["requested_bytes"].add(-nbytes)
        if d.v("allocation") > 0:
            d.stats["allocation"].add(-1)

    def process_events(self, device: int = 0) -> None:
        """The other streams caught up: blocks freed while in use become cached free blocks."""
        d = self._dev(device)
        pending = d.v("active_bytes") - d.v("allocated_bytes")
        if pending > 0:
            d.stats["active_bytes"].add(-pending)
            if d.v("active") > d.v("allocation"):
                d.stats["active"].add(d.v("allocation") - d.v("active"))

    def fragment(self, nbytes: int, device: int = 0) -> None:
        """Free ``nbytes`` as scattered pieces of split segments: cached but unusable for big requests."""
        d = self._dev(device)
        nbytes = min(int(nbytes), d.v("allocated_bytes"))
        self.free(nbytes, device)
        d.stats["inactive_split_bytes"].add(nbytes)
        d.stats["inactive_split"].add(1)

    def coalesce(self, device: int = 0) -> None:
        """The tensors beside the split pieces were freed: the pieces merge into whole free blocks, which a
        request can use and empty_cache() can release (the real allocator merges a freed block with its free
        neighbours)."""
        d = self._dev(device)
        d.stats["inactive_split_bytes"].add(-d.v("inactive_split_bytes"))
        d.stats["inactive_split"].add(-d.v("inactive_split"))

    def empty_cache(self, device: int = 0) -> None:
        self._release_cache(self._dev(device))

    def _release_cache(self, d: _Device) -> None:
        # split pieces cannot be released, nor blocks still awaiting another stream
        keep = d.v("active_bytes") + d.v("inactive_split_bytes")
        release = d.v("reserved_bytes") - keep
        if release > 0:
            d.stats["reserved_bytes"].add(-release)
            d.counters["num_device_free"] += 1
            if d.v("segment") > 1:
                d.stats["segment"].add(-1)

    def reserved(self, device: int = 0) -> int:
        return self._dev(device).v("reserved_bytes")

    def allocated(self, device: int = 0) -> int:
        return self._dev(device).v("allocated_bytes")

    def _dev(self, device: int) -> _Device:
        d = self._devices.get(device)
        if d is None:
            if not 0 <= device < len(self.physical):
                raise ValueError(f"CUDA device {device} is not visible (simulated)")
            gpu_index, mig = self.placement[device]
            g = self.node.gpus[gpu_index]
            total = g.mig_instances[mig].total_bytes if mig >= 0 else g.total_bytes  # torch: the instance's memory
            d = self._devices[device] = _Device(total, EXTRA_COUNTERS[self.torch_version])
        return d


def _round_segment(n: int) -> int:
    # large-pool segments come in 2 MiB multiples (kRoundLarge), at least 20 MiB (kLargeBuffer)
    n = max(n, 20 * MIB)
    return (n + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)


def _visible(node: SimNode, cvd: str | None) -> list[tuple[int, int]]:
    """CUDA index -> (node GPU index, MIG instance or -1), as CUDA_VISIBLE_DEVICES maps them (ints, GPU- UUIDs,
    or a MIG- UUID: then CUDA enumerates that one instance only)."""
    if cvd is None or cvd.strip() == "":
        return [(i, -1) for i in range(len(node.gpus))] if cvd is None else []
    parts = [p.strip() for p in cvd.split(",")]
    for part in parts:
        if part.startswith("MIG-"):  # "Only single MIG instance enumeration is supported"
            for g in node.gpus:
                for i, m in enumerate(g.mig_instances if g.mig else ()):
                    if m.uuid.startswith(part):
                        return [(g.index, i)]
            return []
    out = []
    for part in parts:
        if part.isdigit():
            i = int(part)
            if i >= len(node.gpus):
                break  # CUDA stops at the first invalid entry
            out.append((i, -1))
        else:
            match = [g.index for g in node.gpus if g.uuid.startswith(part)]
            if not match:
                break
            out.append((match[0], -1))
    return out
