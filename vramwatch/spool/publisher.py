"""The rank's side of the spool: one sample file, rewritten in place, and the lock beside it.

The spool may vanish under a running job (systemd-logind's RemoveIPC empties /dev/shm of a user who
logs out; a clean-up script; a hand): the rank would go on writing into a deleted file, and the server
would serve no rank at all, with no alert. So each publish asks the kernel whether the open sample file
still has a name (one ``fstat``, well under a microsecond) and, when it has none, makes the directory
again with the checks of the start, takes a new lock, and publishes into a new file.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os

from vramwatch.spool import files, node
from vramwatch.spool.codec import encode_sample
from vramwatch.spool.schema import RankSample

log = logging.getLogger("vramwatch")

# sample files this process left behind (stop() then start() in one process): its own to write over, as
# torch's counters go on in it
_LEFT_BEHIND: set[str] = set()
# a new file's room beyond its first record: in-place writes of a larger record (an OOM's adds its values)
# then need no new page of a full tmpfs
_SLACK = 4096
# errors that leave the open sample file writable in place: a full tmpfs (no new file), no descriptor left
_IN_PLACE_STILL_WORKS = frozenset({errno.ENOSPC, errno.EMFILE, errno.ENFILE, errno.EDQUOT, errno.ENOMEM})


class RankPublisher:
    """Writes one rank's samples; only ever called from the rank's sampler thread."""

    def __init__(self, spool_dir: str, rank: int, job_id: str = "", shared: bool = False) -> None:
        # shared: ``spool_dir`` is this user's directory in a node daemon's root (:mod:`.node`), whose
        # files the daemon reads through its group; else a private spool (0700)
        self.shared = shared
        self.dir = spool_dir  # made again should it vanish (_recreate)
        self._ensure_dir()
        # keyed by the job too: rank 0 of another job on this node has a file of its own
        self.instance = _instance(spool_dir, rank, os.getpid(), job_id)
        self.path = files.sample_path(spool_dir, files.rank_stem(rank, self.instance, job_id))
        self.lock_path = files.lock_path_of(self.path)
        self._tmp = self.path + ".tmp"
        self._fd: int | None = None
        self._lock_fd = self._hold_lock()
        # a forked child (a DataLoader worker) must not keep the parent's lock alive after the
        # parent dies: flock is shared by every copy of the descriptor, so the child drops its copy
        os.register_at_fork(after_in_child=self._drop_in_child)

    def _ensure_dir(self) -> None:
        if not self.shared:
            files.ensure_dir(self.dir)
            return
        why = node.claim(self.dir, os.geteuid())
        if why:
            raise PermissionError(f"refused {self.dir}: {why}")

    def _hold_lock(self) -> int | None:
        fd = files.hold_lock(self.lock_path)
        if fd is not None and self.shared:
            node.share(fd)
        return fd

    def _drop_in_child(self) -> None:
        for fd in (self._lock_fd, self._fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._lock_fd = self._fd = None
        self.path = self.lock_path = self._tmp = os.devnull  # the child publishes nothing

    def publish(self, sample: RankSample, replace: bool = False) -> None:
        """Write ``sample``; with ``replace`` into a new file renamed over the old one (an OOM's sample).

        Either way the record is in the kernel's page cache when this returns, so the server reads it
        even if the process dies the next instant (SIGKILL included). In place, a process killed in the
        middle of the write would leave a torn record; a rename never does, and costs ~0.4 ms on some
        filesystems: that is paid for an OOM, not on every interval. Raises OSError when the spool is
        unusable (the caller logs it once and calls again).
        """
        if self._lock_fd is None:
            return
        if self.instance != sample.pid:  # a dead process of this pid left its file here: another identity
            sample = dataclasses.replace(sample, pid=self.instance)
        record = files.frame(encode_sample(sample))
        if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
            self._recreate()  # the file, and most likely the whole spool, was removed
        # one pwrite into a file kept open: no open/rename per sample. A reader may catch a write
        # half-done, so the header carries the length and a CRC, and the reader retries on a mismatch.
        if self._fd is None or replace:
            try:
                self._create(record)
            except FileNotFoundError:  # removed before the first publish, or while it failed to come back
                self._recreate()
                self._create(record)
            except OSError as e:
                # a full tmpfs (Docker's 64 MB /dev/shm filled by DataLoader workers) or no descriptor left:
                # no new file, but the open one takes the record in place (its pages are there already)
                if self._fd is None or e.errno not in _IN_PLACE_STILL_WORKS:
                    raise
                os.pwrite(self._fd, record, 0)
        else:
            os.pwrite(self._fd, record, 0)

    def _create(self, record: bytes) -> None:
        fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            if self.shared:
                node.share(fd)
            os.pwrite(fd, record, 0)
            _reserve(fd, len(record) + _SLACK)
            os.replace(self._tmp, self.path)  # appears complete, at once
        except BaseException:
            os.close(fd)
            files.remove_quietly(self._tmp)
            raise
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd

    def _recreate(self) -> None:
        """Make the spool again (0700, refused if another user owns it) and take a new lock before the sample
        file reappears, so the server never takes this rank for dead and reaps it."""
        self._ensure_dir()
        lock_fd = self._hold_lock()
        if lock_fd is None:
            raise BlockingIOError(f"{self.lock_path} is held by another process")
        for fd in (self._lock_fd, self._fd):
            if fd is not None:
                os.close(fd)
        self._lock_fd, self._fd = lock_fd, None
        log.warning(
            "vramwatch: the spool %s vanished under this rank (removed at logout by RemoveIPC, or by hand); "
            "made it again and publishing there",
            self.dir,
        )

    def close(self) -> None:
        """Stop publishing. The last sample stays behind as this rank's final one: the server serves it
        for ``dead_rank_grace_seconds`` once the lock is gone, then removes it."""
        if self._lock_fd is None:
            return
        _LEFT_BEHIND.add(self.path)
        files.remove_quietly(self._tmp, self.lock_path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        os.close(self._lock_fd)
        self._lock_fd = None


def _instance(spool_dir: str, rank: int, pid: int, job_id: str) -> int:
    """The number this process's files are named by (and its samples say): its pid, unless a process of the
    same pid, rank and job left its files here and died (a container restarted beside a surviving spool:
    PID 1 again). Its final sample must not be written over, so this one takes ``pid + n * 2**22``, which
    no pid reaches (the kernel's pid_max is at most 2**22), and which the server tells apart from it."""
    for n in range(512):
        instance = pid + n * files.PID_SPAN
        path = files.sample_path(spool_dir, files.rank_stem(rank, instance, job_id))
        if path in _LEFT_BEHIND or not (os.path.lexists(path) or os.path.lexists(files.lock_path_of(path))):
            _LEFT_BEHIND.discard(path)  # this process's again, until it closes it
            return instance
    return pid


def _reserve(fd: int, size: int) -> None:
    """Give the file its pages up to ``size`` now (in-place writes then need none); the reader ignores
    what follows the record. Not every filesystem can: then nothing is reserved."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        pass
