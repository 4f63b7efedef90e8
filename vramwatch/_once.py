"""Log each distinct problem once: the first time it happens, never again for the same key."""

from __future__ import annotations

import logging
from typing import Any


class OnceLog:
    """``log_once(key, msg, *args)`` logs at ``level`` the first time ``key`` is seen; later calls are silent."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING) -> None:
        self.logger = logger
        self.level = level
        self.seen: set[str] = set()

    def __call__(self, key: str, msg: str, *args: Any, level: int | None = None) -> bool:
        """Whether it logged (False: already logged once)."""
        if key in self.seen:
            return False
        self.seen.add(key)
        self.logger.log(self.level if level is None else level, msg, *args)
        return True
