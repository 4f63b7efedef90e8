"""OOM forensics: what the allocator saw when it ran out, and optionally a memory snapshot.

The caching allocator calls its out-of-memory observers (``torch._C._cuda_attach_out_of_memory_observer``,
private, torch 2.5-2.13; the simulated allocator's ``oom_observers``) on the allocating thread,
after counting the OOM and before raising it. The observer here:

- remembers the request size, the free memory the driver reported and the time in the device's
  values (``torch_cuda_memory_last_oom_*``; the count itself is the allocator's ``num_ooms``);
- when ``oom_snapshot_dir`` is set, writes a pickle of ``torch.cuda.memory._snapshot()`` (what
  ``_dump_snapshot`` writes, which pytorch.org/memory_viz opens), at most once per
  ``min_interval`` seconds, keeping at most ``oom_snapshot_max_files`` files and
  ``oom_snapshot_max_bytes`` bytes in the directory (oldest deleted first) and never writing
  into the last few percent of the file system;
- wakes the sampler so the OOM is published at once, and logs it.

It never raises: the allocator then raises its own ``OutOfMemoryError`` to the job, unchanged.
With ``oom_history_entries`` > 0 the allocator also records a bounded history of alloc/free events
(``_record_memory_history(max_entries=...)``, Python stacks only) so the snapshot shows what led up
to the OOM; that costs about 2 us per allocation and is off by default.

The torch observer is attached only once the job has initialised CUDA itself (attaching
initialises CUDA), from the sampler thread; an OOM before that first sample goes unobserved
here but is still counted by the allocator.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vramwatch.spool import OomSnapshot

if TYPE_CHECKING:
    from vramwatch.rank.handle import Handle

log = logging.getLogger("vramwatch")

LAST_REQUESTED = "torch_cuda_memory_last_oom_requested_bytes"
LAST_FREE = "torch_cuda_memory_last_oom_free_bytes"
LAST_TIME = "torch_cuda_memory_last_oom_timestamp_seconds"

PREFIX = "vramwatch-oom-"
SUFFIX = ".pickle"
# Never write into the last share of the file system holding the snapshots.
DISK_RESERVE_RATIO = 0.05
DISK_RESERVE_MIN = 256 << 20
_LOG_EVERY = 10.0


class _CapExceeded(Exception):
    pass


class _CappedFile:
    """A write-only file that refuses to grow past ``cap`` bytes (so pickling stops early)."""

    def __init__(self, fh: Any, cap: int) -> None:
        self.fh = fh
        self.cap = cap
        self.written = 0

    def write(self, data: bytes) -> int:
        n = len(data)
        if self.written + n > self.cap:
            raise _CapExceeded
        self.written += n
        return self.fh.write(data)


def snapshot_files(directory: str) -> list[tuple[float, int, str]]:
    """(mtime, size, path) of the OOM snapshots in ``directory``, oldest first."""
    out = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if name.startswith(PREFIX) and name.endswith(SUFFIX):
            path = os.path.join(directory, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            out.append((st.st_mtime, st.st_size, path))
    out.sort()
    return out


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class OomWatcher:
    """The OOM observer of one process. ``sampler.extra`` receives the per-device values."""

    def __init__(
        self,
        extra: dict[int, dict[str, float]],
        *,
        snapshot_dir: str = "",
        max_files: int = 5,
        max_bytes: int = 1 << 30,
        history_entries: int = 0,
        rank: int = 0,
        dump: Callable[[], Any] | None = None,
        on_snapshot: Callable[[str, float], None] | None = None,
        wake: Callable[[], None] | None = None,
        min_interval: float = 30.0,
        disk_usage: Callable[[str], Any] = shutil.disk_usage,
    ) -> None:
        self.extra = extra
        self.snapshot_dir = snapshot_dir
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.history_entries = history_entries
        self.rank = rank
        self.dump = dump
        self.on_snapshot = on_snapshot
        self.wake = wake
        self.min_interval = min_interval
        self.disk_usage = disk_usage
        self.count = 0  # OOMs this observer saw
        self.snapshots = 0
        self.last_path: str | None = None
        self.active = True
        self.attached = False
        self._attach_given_up = False
        self._history_on = False
        self._last_write = float("-inf")
        self._last_log = float("-inf")
        self._unlogged = 0
        self._logged: set[str] = set()
        self._seq = 0
        self._sim: Any = None

    @classmethod
    def for_handle(cls, handle: Handle) -> OomWatcher:
        s = handle.settings

        def on_snapshot(path: str, when: float) -> None:
            handle.extra["oom_snapshot"] = OomSnapshot(path, when)

        w = cls(
            handle.sampler.extra,
            snapshot_dir=s.oom_snapshot_dir,
            max_files=s.oom_snapshot_max_files,
            max_bytes=s.oom_snapshot_max_bytes,
            history_entries=s.oom_history_entries,
            rank=handle.identity.rank,
            on_snapshot=on_snapshot,
            wake=getattr(handle, "wake", None),
        )
        if handle.sim is not None:
            w.attach_sim(handle.sim)
        else:
            w.on_sample(())  # CUDA may already be initialised (a Trainer's model on the GPU)
        return w

    # --- attaching ---
    def attach_sim(self, sim: Any) -> None:
        self._sim = sim
        if self.dump is None:
            self.dump = lambda: _sim_snapshot(sim)
        sim.oom_observers.append(self)
        self.attached = True

    def on_sample(self, devices: Any = ()) -> None:
        """Sampler thread: attach to torch's allocator once the job has initialised CUDA."""
        if self.attached or self._attach_given_up:
            return
        torch = sys.modules.get("torch")
        if torch is None:
            return
        try:
            if not torch.cuda.is_initialized():
                return
            if torch.cuda.get_allocator_backend() != "native":
                self._attach_given_up = True  # cudaMallocAsync has no observers nor snapshots
                log.info("vramwatch: allocator backend is not native; OOM observer and snapshots are off")
                return
            attach = torch._C._cuda_attach_out_of_memory_observer
        except Exception as e:  # noqa: BLE001
            self._attach_given_up = True
            log.info("vramwatch: no OOM observer in this torch (%r)", e)
            return
        try:
            attach(self)
            self.attached = True
            if self.dump is None:
                self.dump = torch.cuda.memory._snapshot
            if self.snapshot_dir and self.history_entries > 0:
                torch.cuda.memory._record_memory_history(
                    enabled="all", context="all", stacks="python", max_entries=self.history_entries
                )
                self._history_on = True
        except Exception as e:  # noqa: BLE001
            self._attach_given_up = True
            self._log_once("attach", "vramwatch: could not attach the OOM observer: %r", e)

    def close(self) -> None:
        """Stop observing (torch observers cannot be detached: they turn inert)."""
        self.active = False
        if self._sim is not None:
            try:
                self._sim.oom_observers.remove(self)
            except ValueError:
                pass
        if self._history_on:
            self._history_on = False
            torch = sys.modules.get("torch")
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception as e:  # noqa: BLE001
                log.debug("vramwatch: stopping the memory history failed: %r", e)

    # --- the observer: on the allocating thread, must never raise ---
    def __call__(self, device: int, alloc: int, device_total: int, device_free: int) -> None:
        if not self.active:
            return
        try:
            now = time.time()
            self.count += 1
            values = self.extra.setdefault(int(device), {})
            values[LAST_REQUESTED] = float(alloc)
            values[LAST_FREE] = float(max(device_free, 0))
            values[LAST_TIME] = now
            path = None
            if self.snapshot_dir and time.monotonic() - self._last_write >= self.min_interval:
                self._last_write = time.monotonic()
                path = self.write_snapshot(now)
            self._log_oom(now, device, alloc, device_free, path)
            if self.wake is not None:
                self.wake()
        except Exception as e:  # noqa: BLE001 - an observer that raises would replace the job's OOM
            self._log_once("observer:" + type(e).__name__, "vramwatch: OOM observer failed: %r", e)

    def _log_oom(self, now: float, device: int, alloc: int, free: int, path: str | None) -> None:
        if path is None and now - self._last_log < _LOG_EVERY:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last report)" if self._unlogged else ""
        self._unlogged = 0
        self._last_log = now
        where = f"; memory snapshot: {path}" if path else ""
        log.warning(
            "vramwatch: CUDA out of memory on device %d: tried to allocate %s with %s free%s%s",
            device,
            _fmt(alloc),
            _fmt(free),
            where,
            more,
        )

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)

    # --- snapshots ---
    def write_snapshot(self, now: float | None = None) -> str | None:
        """Write one snapshot under the caps; the path, or None (logged once per reason)."""
        now = time.time() if now is None else now
        d = self.snapshot_dir
        if not d or self.dump is None:
            return None
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)  # snapshots hold stack frames and paths
            usage = self.disk_usage(d)
        except OSError as e:
            self._log_once("dir:" + type(e).__name__, "vramwatch: cannot write OOM snapshots into %s: %s", d, e)
            return None
        room = int(usage.free - max(DISK_RESERVE_MIN, DISK_RESERVE_RATIO * usage.total))
        cap = min(self.max_bytes, room)
        if cap <= 0:
            self._log_once("full", "vramwatch: %s is nearly full; no OOM snapshot written", d)
            return None
        try:
            data = self.dump()
        except Exception as e:  # noqa: BLE001
            self._log_once("dump:" + type(e).__name__, "vramwatch: taking the memory snapshot failed: %r", e)
            return None
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
        name = f"{PREFIX}rank{self.rank}-{stamp}-{os.getpid()}-{self._seq}{SUFFIX}"
        path = os.path.join(d, name)
        tmp = os.path.join(d, "." + name + ".tmp")
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:
                capped = _CappedFile(fh, cap)
                pickle.dump(data, capped)
            size = capped.written
        except _CapExceeded:
            _remove(tmp)
            self._log_once(
                "cap",
                "vramwatch: OOM snapshot larger than %s (oom_snapshot_max_bytes or free disk); not written",
                _fmt(cap),
            )
            return None
        except Exception as e:  # noqa: BLE001 - disk full, permissions, an unpicklable object
            _remove(tmp)
            self._log_once("write:" + type(e).__name__, "vramwatch: writing the OOM snapshot failed: %r", e)
            return None
        # caps: delete the oldest until the new one fits (count, then bytes)
        existing = snapshot_files(d)
        while existing and len(existing) >= self.max_files:
            _remove(existing.pop(0)[2])
        total = sum(sz for _, sz, _ in existing)
        while existing and total + size > self.max_bytes:
            _, sz, old = existing.pop(0)
            _remove(old)
            total -= sz
        try:
            os.replace(tmp, path)
        except OSError as e:
            _remove(tmp)
            self._log_once("rename", "vramwatch: writing the OOM snapshot failed: %r", e)
            return None
        self.snapshots += 1
        self.last_path = path
        if self.on_snapshot is not None:
            self.on_snapshot(path, now)
        return path


def _sim_snapshot(sim: Any) -> dict[str, Any]:
    """The simulated allocator's state in the shape of torch.cuda.memory._snapshot()."""
    segments = []
    addr = 0x7F0000000000
    for seg in sim.snapshot():
        blocks = []
        base = addr
        for b in seg.get("blocks", ()):
            size = int(b.get("size", 0))
            blocks.append(
                {
                    "address": addr,
                    "size": size,
                    "requested_size": size,
                    "state": b.get("state", "inactive"),
                    "frames": [],
                }
            )
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
        "device_traces": [[] for _ in sim.devices()],
        "allocator_settings": {},
        "external_annotations": [],
    }


def _fmt(n: float) -> str:
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.2f} {unit}"
    return f"{n / 1024:.2f} GiB"
