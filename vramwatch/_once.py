"""Log each distinct problem once: the first time it happens, never again for the same key.

Neutral ground: the rank side and the server both use it (a problem that repeats every sample or
every poll would otherwise flood the job's log; its repeats are counted in metrics instead).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable


class OnceLog:
    """``log_once(key, msg, *args)`` logs at ``level`` the first time ``key`` is seen; later calls are silent.

    Thread-safe: the sampler, the training thread and the server's pollers may share one.
    """

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING) -> None:
        self.logger = logger
        self.level = level
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def __call__(self, key: Hashable, msg: str, *args: object, level: int | None = None) -> bool:
        """Whether it logged (False: already logged once)."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        self.logger.log(self.level if level is None else level, msg, *args)
        return True
