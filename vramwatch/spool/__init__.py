"""The spool: how ranks hand samples to the node's server without sharing its GIL.

Each rank owns two files in the spool directory (a tmpfs by default):
``rank-<rank>-<pid>.json``, rewritten in place on every publish (a length +
CRC header lets readers detect a write in progress), and
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
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any

SERVER_LOCK = "server.lock"
_MAGIC = b"VWS1"
_HEADER = struct.Struct("<4sII")  # magic, payload length, CRC32 of the payload
_RANK_FILE = re.compile(r"^rank-(\d+)-(\d+)\.json$")


def ensure_dir(path: str) -> None:
    """Make the spool private (0700). In a world-writable parent such as /dev/shm anyone could have made the
    directory first, to read the samples or plant fake ones: one owned by another user there is refused."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    uid = os.getuid()
    st, lst = os.stat(path), os.lstat(path)
    if uid not in (st.st_uid, lst.st_uid) or st.st_uid != lst.st_uid:
        parent = os.stat(os.path.dirname(os.path.abspath(path)) or "/")
        if parent.st_mode & 0o002:
            raise PermissionError(
                f"spool {path} belongs to uid {st.st_uid}, in a world-writable directory; remove it or set spool_dir"
            )
    elif st.st_mode & 0o077:
        os.chmod(path, 0o700)


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
        self._fd: int | None = None
        self._lock_fd = hold_lock(self.lock_path)
        # a forked child (a DataLoader worker) must not keep the parent's lock alive after the
        # parent dies: flock is shared by every copy of the descriptor, so the child drops its copy
        os.register_at_fork(after_in_child=self._drop_in_child)

    def _drop_in_child(self) -> None:
        for fd in (self._lock_fd, self._fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._lock_fd = self._fd = None
        self.path = self.lock_path = self._tmp = os.devnull  # the child publishes nothing

    def publish(self, sample: dict[str, Any]) -> None:
        if self._lock_fd is None:
            return
        payload = json.dumps(sample, separators=(",", ":"), allow_nan=False).encode()
        # one pwrite into a file kept open: no open/rename per sample (a rename costs ~0.4 ms on
        # some filesystems). A reader may catch a write half-done, so the header carries the
        # length and a CRC, and the reader retries on a mismatch.
        record = _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload
        if self._fd is None:
            self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.pwrite(self._fd, record, 0)
            os.replace(self._tmp, self.path)  # appears complete, once
        else:
            os.pwrite(self._fd, record, 0)

    def close(self) -> None:
        if self._lock_fd is None:
            return
        for p in (self.path, self._tmp, self.lock_path):
            try:
                os.unlink(p)
            except OSError:
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


@dataclass(frozen=True)
class RankSample:
    rank: int
    pid: int
    data: dict[str, Any]
    mtime: float


def read_samples(
    spool_dir: str, max_ranks: int, reaped: list[RankSample] | None = None, reap: bool = True
) -> list[RankSample]:
    """Live ranks' newest samples, one per rank; dead ranks' files are removed.

    A dead rank's final sample is appended to ``reaped`` when given, so the server can
    serve it once more (a rank killed by an OOM still gets its last OOM count scraped).
    Only the scrape path reaps; other readers pass ``reap=False`` and just skip the dead.
    """
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
            if not reap:
                continue
            if reaped is not None:
                last = _read_record(path, tries=1)
                if last is not None:
                    reaped.append(RankSample(int(m.group(1)), int(m.group(2)), last, 0.0))
            for p in (path, lock, path + ".tmp"):
                try:
                    os.unlink(p)
                except OSError:
                    pass
            continue
        data = _read_record(path)
        if data is None:
            continue
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            continue
        rank = int(m.group(1))
        s = RankSample(rank, int(m.group(2)), data, mtime)
        if rank not in best or s.data.get("time", 0) > best[rank].data.get("time", 0):
            best[rank] = s
    return [best[r] for r in sorted(best)[:max_ranks]]


def _read_record(path: str, tries: int = 5) -> dict[str, Any] | None:
    for _ in range(tries):
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            return None
        if len(raw) >= _HEADER.size:
            magic, length, crc = _HEADER.unpack_from(raw)
            payload = raw[_HEADER.size : _HEADER.size + length]
            if magic == _MAGIC and len(payload) == length and zlib.crc32(payload) == crc:
                try:
                    return json.loads(payload)
                except ValueError:
                    return None
        time.sleep(0.0005)  # a write in progress: it takes microseconds
    return None


def any_rank_files(spool_dir: str) -> bool:
    """Whether any rank, alive or dead and not yet reaped, has published here."""
    try:
        return any(_RANK_FILE.match(n) for n in os.listdir(spool_dir))
    except OSError:
        return False


def sample_age(sample: RankSample, now: float | None = None) -> float:
    now = time.time() if now is None else now
    return max(0.0, now - float(sample.data.get("time", sample.mtime)))
