"""The sampler thread: one ``tick`` every ``interval`` seconds, or sooner when woken (an OOM)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class SamplerThread:
    def __init__(self, interval: float, tick: Callable[[], None]) -> None:
        self.interval = interval
        self.tick = tick
        # A wake-up pending is this lock released. The thread waits by acquiring it with a timeout: one C
        # call a second, where Event.wait runs a Condition's ~30 lines of Python (and a new lock) each time,
        # on a core whose caches went cold since the last sample.
        self._wake_lock = threading.Lock()
        self._wake_lock.acquire()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vramwatch-sampler", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Tick now rather than at the next interval (safe from any thread)."""
        try:
            self._wake_lock.release()
        except RuntimeError:  # already released: a wake-up is pending
            pass

    def stop(self) -> None:
        self._stopping = True
        self.wake()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=max(2.0, self.interval * 2))

    def _run(self) -> None:
        interval = self.interval
        wait = self._wake_lock.acquire
        clock = time.monotonic
        next_t = clock() + interval
        while True:
            left = next_t - clock()
            if left > 0:
                wait(True, left)  # True: woken (the wake-up is taken with the lock), False: the interval ended
            else:
                wait(False)  # take a wake-up that came during the tick, if any
            if self._stopping:
                return
            try:
                self.tick()
            except BaseException:  # noqa: BLE001 - the job's objects may raise anything (a loss's .item()):
                pass  # the thread that publishes the job's OOMs and hangs must outlive it
            now = clock()
            if now >= next_t:  # a regular tick (a wake-up publishes early and keeps the cadence)
                next_t += interval
                if next_t < now:  # we were wedged: don't burst to catch up
                    next_t = now + interval
