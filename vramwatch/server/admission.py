"""Who gets one of the ``max_connections`` worker slots when there are more requests than slots.

Two classes of request: *scrapes* (``GET /metrics`` that passed auth and carries Prometheus'
scrape headers) and everything else. Under overload the others are shed first:

- others may hold at most ``total - reserved`` slots, so ``reserved`` slots (a quarter, at least
  one when there are two or more) are always there for scrapes;
- a scrape that finds every slot busy waits (briefly, FIFO, at most ``queue_limit`` of them) for
  the next slot to free up, where anything else gets its 503 at once;
- a freed slot goes to a waiting scrape before anything new.

The scrape headers are a priority hint, not a credential: without basic auth anyone can send
them. With basic auth only requests that passed it are ever scrapes.

Not thread-safe: one thread (the server's event loop) owns it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from enum import Enum
from typing import Generic, TypeVar

T = TypeVar("T")
Headers = Mapping[str, str]  # a request's fields (:class:`.request.Headers` looks names up in any case)

__all__ = ["Admission", "Decision", "is_scrape", "scrape_wait"]

# What the scrape header tells about the scraper's patience; a scrape never waits longer than this.
MAX_WAIT = 1.0


class Decision(Enum):
    START = "start"
    QUEUED = "queued"
    REFUSE = "refuse"


def is_scrape(method: str, path: str, headers: Headers) -> bool:
    """A Prometheus-style scrape: GET /metrics with the scrape-timeout header or an OpenMetrics Accept."""
    if method != "GET" or path.split("?", 1)[0] != "/metrics":
        return False
    return bool(headers.get("X-Prometheus-Scrape-Timeout-Seconds")) or (
        "application/openmetrics-text" in (headers.get("Accept") or "")
    )


def scrape_wait(headers: Headers) -> float:
    """How long a scrape may wait for a slot: a quarter of its scrape timeout, at most ``MAX_WAIT``."""
    try:
        timeout = float(headers.get("X-Prometheus-Scrape-Timeout-Seconds") or "nan")
    except ValueError:
        timeout = float("nan")
    if not timeout > 0:  # also NaN
        return MAX_WAIT
    return min(MAX_WAIT, timeout / 4)


class Admission(Generic[T]):
    def __init__(self, total: int, queue_limit: int | None = None) -> None:
        if total < 1:
            raise ValueError(f"total={total!r}: need at least one slot")
        self.total = total
        self.reserved = max(1, total // 4) if total >= 2 else 0
        self.queue_limit = total if queue_limit is None else queue_limit
        self.in_use = 0
        self.others_in_use = 0
        self._waiting: deque[tuple[T, float]] = deque()  # (item, deadline), scrapes only

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def offer(self, item: T, scrape: bool, deadline: float) -> Decision:
        """START: the caller runs it now (a slot is taken); QUEUED: :meth:`release` hands it out later."""
        if self.in_use < self.total and (scrape or (self.others_in_use < self.total - self.reserved)):
            self._take(scrape)
            return Decision.START
        if scrape and len(self._waiting) < self.queue_limit:
            self._waiting.append((item, deadline))
            return Decision.QUEUED
        return Decision.REFUSE

    def _take(self, scrape: bool) -> None:
        self.in_use += 1
        if not scrape:
            self.others_in_use += 1

    def release(self, scrape: bool) -> list[T]:
        """A request finished; returns the waiting scrapes that take the freed slot (their slot is taken)."""
        self.in_use -= 1
        if not scrape:
            self.others_in_use -= 1
        started = []
        while self._waiting and self.in_use < self.total:
            item, _ = self._waiting.popleft()
            self._take(True)
            started.append(item)
        return started

    def expire(self, now: float) -> list[T]:
        """Waiting scrapes past their deadline, removed (the caller answers them 503)."""
        out = [item for item, deadline in self._waiting if deadline <= now]
        if out:
            self._waiting = deque((i, d) for i, d in self._waiting if d > now)
        return out

    def drop_all(self) -> list[T]:
        out = [item for item, _ in self._waiting]
        self._waiting.clear()
        return out
