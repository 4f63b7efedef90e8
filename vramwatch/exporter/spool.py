"""The spool: how ranks hand samples to the node's server without sharing its GIL.

Each rank owns two files in the spool directory (a tmpfs by default):
``rank-<rank>-<pid>.json``, replaced atomically on every publish, and
``rank-<rank>-<pid>.lock``, which the rank holds with ``flock`` for its whole
life. The kernel drops the lock when the process dies, however it dies
(SIGKILL included), so the reader can tell a wedged rank (lock held, sample
ageing) from a dead one (lock free: its files are reaped). The server holds
``server.lock`` the same way, so ranks can tell whether one is running.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

SERVER_LOCK = "server.lock"
_RANK_FILE = re.compile(r"^rank-(\d+)-(\d+)\.json$")


def ensure_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)


def _try_lock(path: str) -> bool:
    """True if nobody holds ``path``'s flock (we take and drop it at once)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing releases the lock if we took it
    return True


def hold_lock(path: str) -> int | None:
    """Open and lock ``path`` for the life of the process; None if another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def server_running(spool_dir: str) -> bool:
    return not _try_lock(os.path.join(spool_dir, SERVER_LOCK))


class RankPublisher:
    """Writes one rank's samples; only ever called from the rank's sampler thread."""

    def __init__(self, spool_dir: str, rank: int) -> None:
        ensure_dir(spool_dir)
        self.dir = spool_dir
        stem = f"rank-{rank}-{os.getpid()}"
        self.path = os.path.join(spool_dir, stem + ".json")
        self.lock_path = os.path.join(spool_dir, stem + ".lock")
        self._tmp = self.path + ".tmp"
        self._lock_fd = hold_lock(self.lock_path)
        # a forked child (a DataLoader worker) must not keep the parent's lock alive after the
        # parent dies: flock is shared by every copy of the descriptor, so the child drops its copy
        os.register_at_fork(after_in_child=self._drop_in_child)

    def _drop_in_child(self) -> None:
        if self._lock_fd is not None:
            try:
                os.close(self._lock_fd)
            except OSError:
                pass
            self._lock_fd = None
        self.path = self.lock_path = self._tmp = os.devnull  # the child publishes nothing

    def publish(self, sample: dict[str, Any]) -> None:
        if self._lock_fd is None:
            return
        data = json.dumps(sample, separators=(",", ":"), allow_nan=False).encode()
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(self._tmp, self.path)  # readers see the old or the new sample, never half

    def close(self) -> None:
        if self._lock_fd is None:
            return
        for p in (self.path, self._tmp, self.lock_path):
            try:
                os.unlink(p)
            except OSError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


@dataclass(frozen=True)
class RankSample:
    rank: int
    pid: int
    data: dict[str, Any]
    mtime: float


def read_samples(spool_dir: str, max_ranks: int) -> list[RankSample]:
    """Live ranks' newest samples, one per rank; dead ranks' files are removed."""
    try:
        names = os.listdir(spool_dir)
    except OSError:
        return []
    best: dict[int, RankSample] = {}
    for name in names:
        m = _RANK_FILE.match(name)
        if not m:
            continue
        path = os.path.join(spool_dir, name)
        lock = path[: -len(".json")] + ".lock"
        if _try_lock(lock):  # owner gone: reap
            for p in (path, lock, path + ".tmp"):
                try:
                    os.unlink(p)
                except OSError:
                    pass
            continue
        try:
            with open(path, "rb") as fh:
                data = json.loads(fh.read())
            mtime = os.stat(path).st_mtime
        except (OSError, ValueError):
            continue
        rank = int(m.group(1))
        s = RankSample(rank, int(m.group(2)), data, mtime)
        if rank not in best or s.data.get("time", 0) > best[rank].data.get("time", 0):
            best[rank] = s
    return [best[r] for r in sorted(best)[:max_ranks]]


def sample_age(sample: RankSample, now: float | None = None) -> float:
    now = time.time() if now is None else now
    return max(0.0, now - float(sample.data.get("time", sample.mtime)))
