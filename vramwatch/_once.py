"""Log each distinct problem once: the first time it happens, never again for the same key.

Neutral ground: the rank side and the server both use it (a problem that repeats every sample or
every poll would otherwise flood the job's log; its repeats are counted in metrics instead).

Bounded whatever the keys: a local user can make any number of distinct problems (100,000 junk names in
a node daemon's root are 100,000 refusals), so at most ``max_keys`` keys are remembered (the least
recently seen is forgotten first) and at most ``burst`` lines are written at once, then one every
``refill`` seconds; the lines left out are counted and said in the next line written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable


class OnceLog:
    """``log_once(key, msg, *args)`` logs at ``level`` the first time ``key`` is seen; later calls are silent.

    Thread-safe: the sampler, the training thread and the server's pollers may share one.
    """

    def __init__(
        self,
        logger: logging.Logger,
        level: int = logging.WARNING,
        max_keys: int = 4096,
        burst: int = 64,
        refill: float = 10.0,
    ) -> None:
        self.logger = logger
        self.level = level
        self.max_keys = max_keys
        self.burst = burst
        self.refill = refill
        self.suppressed = 0  # lines left out by the rate bound since the last one written
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, key: Hashable, msg: str, *args: object, level: int | None = None) -> bool:
        """Whether it logged (False: already logged once, or left out by the rate bound)."""
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)  # a problem that keeps happening stays remembered
                return False
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) / self.refill)
            self._last = now
            if self._tokens < 1.0:
                self.suppressed += 1  # not remembered: logged once the flood is over
                return False
            self._tokens -= 1.0
            self._seen[key] = None
            if len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)
            left_out, self.suppressed = self.suppressed, 0
        if left_out:
            self.logger.log(
                self.level, "vramwatch: %d more distinct problems were not logged (too many at once)", left_out
            )
        self.logger.log(self.level if level is None else level, msg, *args)
        return True
