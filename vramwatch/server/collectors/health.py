"""Self-health of a collector."""

from __future__ import annotations

import logging

from vramwatch._once import OnceLog

log = logging.getLogger("vramwatch")


class Health:
    """``vramwatch_collector_up``, ``_errors_total`` and ``_duration_seconds`` of one collector.

    Written by the thread that reads, read at scrape: plain attributes, each
    written whole, so a scrape never waits on a lock.
    """

    def __init__(self) -> None:
        self.up = 1
        self.errors = 0
        self.duration = 0.0
        self._once = OnceLog(log)

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
            self._once(key, msg, *args)
