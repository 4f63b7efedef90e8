"""What the training thread waited for: its peers (``collective``) and its next batch (``data``).

``data``: the time ``vramwatch.track()`` spends in the loader's ``next()``, or a callback between the end
of one step and the start of the next (outside a declared phase), added up on the training thread by
:class:`~vramwatch.rank.heartbeat.Heartbeat` (two clock reads a step).

``collective``: read on the sampler thread, nothing on the training thread. The kernel keeps, per
thread, the time it ran and the time it waited runnable for a CPU (``/proc/self/task/<tid>/schedstat``,
one ``pread`` of a file kept open, ~5 us a sample). The rest of the wall-clock time the thread was
asleep: blocked. Less its data wait, that is its wait for peers in a job whose collectives block the
calling thread, which is what gloo does (``Work.wait`` sleeps on a condition variable). So it is
published for a gloo default group only. With NCCL the wait happens on the GPU while the thread spins
in a CUDA synchronisation or runs ahead, and the thread's sleep says nothing about it: absent there.
Other sleeps of the training thread (``time.sleep``, file I/O, a lock) count as collective wait too.
A thread descheduled by CPU contention is not counted (that is run-queue time, not sleep).
"""

from __future__ import annotations

import os
import time


class BlockedClock:
    """The training thread's blocked seconds so far; None until it is known (never raises)."""

    __slots__ = ("_fd", "_tid", "_last", "total", "_failed")

    def __init__(self) -> None:
        self._fd: int | None = None
        self._tid = 0
        self._last: tuple[float, float, float] | None = None  # wall, ran + runnable (s), data wait (s)
        self.total = 0.0
        self._failed = False

    def read(self, tid: int, data_wait: float) -> float | None:
        if self._failed or not tid:
            return None
        if tid != self._tid:
            self._close()
            try:
                self._fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._failed = True  # no schedstat (CONFIG_SCHED_INFO off, /proc hidden): absent
                return None
            self._tid, self._last = tid, None
        try:
            ran_ns, runnable_ns = os.pread(self._fd, 128, 0).split()[:2]  # type: ignore[arg-type]
            busy = (int(ran_ns) + int(runnable_ns)) / 1e9
        except (OSError, ValueError):
            self._close()  # the thread ended: a new one is opened if another steps
            return self.total if self._last is not None else None
        now = time.monotonic()
        last = self._last
        self._last = (now, busy, data_wait)
        if last is not None:
            blocked = (now - last[0]) - (busy - last[1]) - (data_wait - last[2])
            if blocked > 0:
                self.total += blocked
        return self.total

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self._tid = None, 0

    def close(self) -> None:
        self._close()
