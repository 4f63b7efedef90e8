"""OOM forensics: what the allocator saw when it ran out, and optionally a memory snapshot.

The caching allocator calls its out-of-memory observers (attached through the allocator source:
``torch._C._cuda_attach_out_of_memory_observer``, private, torch 2.5-2.13, or the simulated
allocator's list) on the allocating thread, after counting the OOM and before raising it. The
observer here:

- remembers the request size, the free memory the driver reported and the time, which the next
  sample carries in the device's values (``torch_cuda_memory_last_oom_*``; the count itself is the
  allocator's ``num_ooms``);
- publishes a sample at once, on the allocating thread, renamed into the spool before the
  exception reaches the job: a job that then exits, calls ``os._exit`` or is SIGKILLed still has
  its OOM served (docs/nothing-lost.md);
- when ``oom_snapshot_dir`` is set, writes a pickle of ``torch.cuda.memory._snapshot()`` (what
  ``_dump_snapshot`` writes, which pytorch.org/memory_viz opens), at most once per
  ``min_interval`` seconds, keeping at most ``oom_snapshot_max_files`` files and
  ``oom_snapshot_max_bytes`` bytes in the directory (oldest deleted first) and never writing
  into the last few percent of the file system; then publishes again, with the snapshot's path;
- logs it.

Snapshots go only into a directory this user owns and nobody else may write (made 0700 when
missing), opened once: each snapshot is created under a random name, exclusively and never
through a link (``O_EXCL | O_NOFOLLOW``), checked to be in that very directory, and renamed into
place through its descriptor, so neither a planted link nor a swapped directory redirects the
write (docs/security.md).

It never raises: the allocator then raises its own ``OutOfMemoryError`` to the job, unchanged.
With ``oom_history_entries`` > 0 the allocator also records a bounded history of alloc/free events
(``_record_memory_history(max_entries=...)``, Python stacks only) so the snapshot shows what led up
to the OOM; that costs about 2 us per allocation and is off by default.

The torch observer is attached only once the job has initialised CUDA itself (attaching
initialises CUDA), from the sampler thread; an OOM before that first sample goes unobserved
here but is still counted by the allocator.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from typing import Any

from vramwatch._once import OnceLog
from vramwatch.rank.allocator import AllocatorSource, ObserverUnavailable, TorchSource
from vramwatch.rank.plugin_api import RankContext, SampleExtras
from vramwatch.spool import DeviceSample, OomSnapshot

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


class _UnsafeDirectory(Exception):
    pass


class _CappedFile:
    """A write-only file descriptor that refuses to grow past ``cap`` bytes (so pickling stops early)."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd = fd
        self.cap = cap
        self.written = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if self.written + n > self.cap:
            raise _CapExceeded
        while view:
            view = view[os.write(self.fd, view) :]
        self.written += n
        return n


def open_owned_dir(path: str) -> int:
    """A descriptor of ``path``, made 0700 when missing; raises _UnsafeDirectory unless this user owns
    it and nobody else may write into it (anyone who can could plant links or swap files in it)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    lst = os.lstat(path)
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (os.geteuid(), 0):
        raise _UnsafeDirectory(f"{path} is a link owned by uid {lst.st_uid}")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not {os.geteuid()}")
        if st.st_mode & 0o022:
            raise _UnsafeDirectory(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _create_in(dir_fd: int, d: str, name: str) -> int:
    """Create ``name`` exclusively in the directory open as ``dir_fd``, never through a link.

    Opened by its full path (so audit hooks see where it goes), then checked to be the very file the
    descriptor's directory holds: a directory swapped for another since it was checked fails here."""
    fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        mine, there = os.fstat(fd), os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (mine.st_dev, mine.st_ino) != (there.st_dev, there.st_ino):
            raise OSError(errno.EXDEV, f"{d} was replaced while the snapshot was created")
    except BaseException:
        os.close(fd)
        raise
    return fd


def snapshot_files(directory: str | int) -> list[tuple[float, int, str]]:
    """(mtime, size, name) of the OOM snapshots (regular files) in ``directory``, oldest first: a path (the
    names are paths then) or a descriptor (the names are relative to it)."""
    dir_fd = directory if isinstance(directory, int) else None
    base = "" if dir_fd is not None else str(directory)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for name in names:
        if name.startswith(PREFIX) and name.endswith(SUFFIX):
            path = os.path.join(base, name)
            try:
                st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((st.st_mtime, st.st_size, path))
    return sorted(out)


def _remove(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


class OomWatcher:
    """The OOM observer of one process; its ``on_sample`` returns the per-device values and snapshot."""

    def __init__(
        self,
        source: AllocatorSource | None = None,
        *,
        snapshot_dir: str = "",
        max_files: int = 5,
        max_bytes: int = 1 << 30,
        history_entries: int = 0,
        rank: int = 0,
        dump: Callable[[], Any] | None = None,
        publish: Callable[[], object] | None = None,
        min_interval: float = 30.0,
        disk_usage: Callable[[str], Any] = shutil.disk_usage,
    ) -> None:
        self.source: AllocatorSource = TorchSource() if source is None else source
        self.snapshot_dir = snapshot_dir
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.history_entries = history_entries
        self.rank = rank
        self.dump = dump
        self.publish = publish  # publishes a sample before returning (Handle.publish_now)
        self.min_interval = min_interval
        self.disk_usage = disk_usage
        self.values: dict[int, dict[str, float]] = {}  # device -> last OOM's values; the allocating thread writes
        self.count = 0  # OOMs this observer saw
        self.snapshots = 0
        self.last_path: str | None = None
        self.last_snapshot: OomSnapshot | None = None
        self.active = True
        self.attached = False
        self._attach_given_up = False
        self._history_on = False
        self._last_write = float("-inf")
        self._last_log = float("-inf")
        self._unlogged = 0
        self._log_once = OnceLog(log)
        self._seq = 0

    @classmethod
    def for_rank(cls, ctx: RankContext) -> OomWatcher:
        s = ctx.settings
        w = cls(
            ctx.source,
            snapshot_dir=s.oom_snapshot_dir,
            max_files=s.oom_snapshot_max_files,
            max_bytes=s.oom_snapshot_max_bytes,
            history_entries=s.oom_history_entries,
            rank=ctx.identity.rank,
            publish=ctx.publish_now,
        )
        w.try_attach()  # CUDA may already be initialised (a Trainer's model on the GPU)
        return w

    # --- attaching ---
    def on_sample(self, devices: Sequence[DeviceSample] = ()) -> SampleExtras | None:
        """Sampler thread: attach once the job has initialised CUDA; the values of the OOMs seen."""
        self.try_attach()
        if not self.values and self.last_snapshot is None:
            return None
        # copied: the allocating thread may add a device meanwhile
        return SampleExtras({dev: dict(v) for dev, v in list(self.values.items())}, self.last_snapshot)

    def try_attach(self) -> None:
        if self.attached or self._attach_given_up:
            return
        try:
            if not self.source.attach_oom_observer(self):
                return  # attaching would initialise CUDA for the job: later
        except ObserverUnavailable as e:
            self._attach_given_up = True
            log.info("vramwatch: %s; OOM observer and snapshots are off", e)
            return
        except Exception as e:  # noqa: BLE001
            self._attach_given_up = True
            self._log_once("attach", "vramwatch: could not attach the OOM observer: %r", e)
            return
        self.attached = True
        if self.dump is None:
            self.dump = self.source.memory_snapshot
        if self.snapshot_dir and self.history_entries > 0:
            try:
                self.source.record_memory_history(self.history_entries)
                self._history_on = True
            except Exception as e:  # noqa: BLE001
                self._log_once("history", "vramwatch: could not record the memory history: %r", e)

    def close(self) -> None:
        """Stop observing (torch observers cannot be detached: they turn inert)."""
        self.active = False
        self.source.detach_oom_observer(self)
        if self._history_on:
            self._history_on = False
            try:
                self.source.record_memory_history(0)
            except Exception as e:  # noqa: BLE001
                log.debug("vramwatch: stopping the memory history failed: %r", e)

    # --- the observer: on the allocating thread, must never raise ---
    def __call__(self, device: int, alloc: int, device_total: int, device_free: int) -> None:
        if not self.active:
            return
        try:
            now = time.time()
            self.count += 1
            values = self.values.setdefault(int(device), {})
            values[LAST_REQUESTED] = float(alloc)
            free = max(device_free, 0)  # the metric and the log line say 0 where a count below 0 comes
            values[LAST_FREE] = float(free)
            values[LAST_TIME] = now
            if self.publish is not None:
                self.publish()  # the count and these values are in the spool before the job sees the error
            path = None
            if self.snapshot_dir and time.monotonic() - self._last_write >= self.min_interval:
                self._last_write = time.monotonic()
                path = self.write_snapshot(now)
                if path is not None and self.publish is not None:
                    self.publish()  # and where the snapshot is
            self._log_oom(now, device, alloc, free, path)
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

    # --- snapshots ---
    def write_snapshot(self, now: float | None = None) -> str | None:
        """Write one snapshot under the caps; the path, or None (logged once per reason)."""
        now = time.time() if now is None else now
        d = self.snapshot_dir
        if not d or self.dump is None:
            return None
        try:
            dir_fd = open_owned_dir(d)  # snapshots hold stack frames and paths
        except _UnsafeDirectory as e:
            self._log_once("unsafe", "vramwatch: no OOM snapshots: %s (it must be yours and not writable by others)", e)
            return None
        except OSError as e:
            self._log_once("dir:" + type(e).__name__, "vramwatch: cannot write OOM snapshots into %s: %s", d, e)
            return None
        try:
            return self._write_into(dir_fd, d, now)
        finally:
            os.close(dir_fd)

    def _write_into(self, dir_fd: int, d: str, now: float) -> str | None:
        assert self.dump is not None
        try:
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
        tmp = f".{PREFIX}{secrets.token_hex(8)}.tmp"  # unpredictable, created only if absent, never a link
        try:
            fd = _create_in(dir_fd, d, tmp)
        except OSError as e:
            self._log_once("create:" + type(e).__name__, "vramwatch: cannot create an OOM snapshot in %s: %s", d, e)
            return None
        try:
            capped = _CappedFile(fd, cap)
            pickle.dump(data, capped)
            size = capped.written
        except _CapExceeded:
            _remove(tmp, dir_fd)
            self._log_once(
                "cap",
                "vramwatch: OOM snapshot larger than %s (oom_snapshot_max_bytes or free disk); not written",
                _fmt(cap),
            )
            return None
        except OSError as e:
            _remove(tmp, dir_fd)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._log_once(
                    "nospace", "vramwatch: no OOM snapshot: %s is full (%s); the partial file is removed", d, e.strerror
                )
            else:
                self._log_once("write:" + str(e.errno), "vramwatch: writing the OOM snapshot into %s failed: %r", d, e)
            return None
        except Exception as e:  # noqa: BLE001 - an unpicklable object
            _remove(tmp, dir_fd)
            self._log_once("write:" + type(e).__name__, "vramwatch: writing the OOM snapshot failed: %r", e)
            return None
        finally:
            os.close(fd)
        # caps: delete the oldest until the new one fits (count, then bytes)
        existing = snapshot_files(dir_fd)
        while existing and len(existing) >= self.max_files:
            _remove(existing.pop(0)[2], dir_fd)
        total = sum(sz for _, sz, _ in existing)
        while existing and total + size > self.max_bytes:
            _, sz, old = existing.pop(0)
            _remove(old, dir_fd)
            total -= sz
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # replaces a planted link, never follows it
        except OSError as e:
            _remove(tmp, dir_fd)
            self._log_once("rename", "vramwatch: writing the OOM snapshot failed: %r", e)
            return None
        path = os.path.join(d, name)
        self.snapshots += 1
        self.last_path = path
        self.last_snapshot = OomSnapshot(path, now)
        return path


def _fmt(n: float) -> str:
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.2f} {unit}"
    return f"{n / 1024:.2f} GiB"
