"""Self-health of a collector and the one "log once" of the server."""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

log = logging.getLogger("vramwatch")


class OnceLog:
    """Logs each distinct key once; repeats are only counted (in :class:`Health`), never logged again."""

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def __call__(self, key: Hashable, level: int, msg: str, *args: object) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        log.log(level, msg, *args)
        return True


class Health:
    """``vramwatch_collector_up``, ``_errors_total`` and ``_duration_seconds`` of one collector.

    Written by the thread that reads, read at scrape: plain attributes, each
    written whole, so a scrape never waits on a lock.
    """

    def __init__(self) -> None:
        self.up = 1
        self.errors = 0
        self.duration = 0.0
        self._once = OnceLog()

    def ok(self) -> None:
        self.up = 1

    def down(self) -> None:
        """Not answering yet (e.g. NVML missing), which is not a failed read of its own."""
        self.up = 0

    def failed(self, key: str = "", msg: str = "", *args: object) -> None:
        """A failed read: ``up`` 0, one more error; ``msg`` is logged the first time ``key`` fails."""
        self.up = 0
        self.errors += 1
        if key:
            self._once(key, logging.WARNING, msg, *args)
