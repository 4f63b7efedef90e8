"""The rank's side of the spool: one sample file, rewritten in place, and the lock beside it."""

from __future__ import annotations

import os

from vramwatch.spool import files
from vramwatch.spool.codec import encode_sample
from vramwatch.spool.schema import RankSample


class RankPublisher:
    """Writes one rank's samples; only ever called from the rank's sampler thread."""

    def __init__(self, spool_dir: str, rank: int) -> None:
        files.ensure_dir(spool_dir)
        self.path = files.sample_path(spool_dir, files.rank_stem(rank, os.getpid()))
        self.lock_path = files.lock_path_of(self.path)
        self._tmp = self.path + ".tmp"
        self._fd: int | None = None
        self._lock_fd = files.hold_lock(self.lock_path)
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

    def publish(self, sample: RankSample) -> None:
        if self._lock_fd is None:
            return
        record = files.frame(encode_sample(sample))
        # one pwrite into a file kept open: no open/rename per sample (a rename costs ~0.4 ms on
        # some filesystems). A reader may catch a write half-done, so the header carries the
        # length and a CRC, and the reader retries on a mismatch.
        if self._fd is None:
            self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.pwrite(self._fd, record, 0)
            os.replace(self._tmp, self.path)  # appears complete, once
        else:
            os.pwrite(self._fd, record, 0)

    def close(self) -> None:
        if self._lock_fd is None:
            return
        files.remove_quietly(self.path, self._tmp, self.lock_path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
