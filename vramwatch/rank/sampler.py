"""The sampler thread: one ``tick`` every ``interval`` seconds, or sooner when woken (an OOM)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class SamplerThread:
    def __init__(self, interval: float, tick: Callable[[], None]) -> None:
        self.interval = interval
        self.tick = tick
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vramwatch-sampler", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Tick now rather than at the next interval (safe from any thread)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=max(2.0, self.interval * 2))

    def _run(self) -> None:
        interval = self.interval
        next_t = time.monotonic() + interval
        while True:
            self._wake.wait(max(0.0, next_t - time.monotonic()))
            if self._stop.is_set():
                return
            self._wake.clear()
            self.tick()
            now = time.monotonic()
            if now >= next_t:  # a regular tick (a wake-up publishes early and keeps the cadence)
                next_t += interval
                if next_t < now:  # we were wedged: don't burst to catch up
                    next_t = now + interval
