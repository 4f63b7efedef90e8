"""The server's connections as its policies see them: who they are, what each waits for, what a refusal logs.

Connections wait in three rooms (handshake or head, an answer not taken yet, idle between requests), each
bounded: a newer connection closes the oldest, so slow clients cost sockets and buffers, never memory
without bound. Refusals are logged once a minute per kind, the ones in between counted into the next line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vramwatch")


class AbuseLog:
    """One WARNING per kind of refusal a minute; the ones in between are counted into the next line."""

    WINDOW = 60.0

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._quiet: Counter[str] = Counter()

    def __call__(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.WINDOW:
            self._quiet[kind] += 1
            return
        self._last[kind] = now
        more = self._quiet.pop(kind, 0)
        suffix = f" ({more} more like it in the last {self.WINDOW:.0f} s)" if more else ""
        log.warning("vramwatch http: " + msg + suffix, *args)


class Conn:
    """One client connection: who, which room it is in, and its task (closing a room's oldest cancels it)."""

    def __init__(self, addr: Any, task: asyncio.Task[None]) -> None:
        self.addr, self.task = addr, task
        self.room: dict[Conn, None] | None = None
        self.first = b""  # the request line of the request in hand, for log lines

    @property
    def source(self) -> str:
        return str(self.addr[0]) if isinstance(self.addr, tuple) and self.addr else "?"

    @property
    def peer(self) -> str:
        return f"{self.addr[0]}:{self.addr[1]}" if isinstance(self.addr, tuple) and len(self.addr) >= 2 else "?"


class Rooms:
    """Connections by what they wait for, oldest first; a full room closes its oldest for a newer one."""

    def __init__(self, note: Callable[..., None]) -> None:
        self.head: dict[Conn, None] = {}  # handshake or request head
        self.write: dict[Conn, None] = {}  # an answer the client is not taking yet
        self.idle: dict[Conn, None] = {}  # kept alive between requests
        self._note = note

    def enter(self, conn: Conn, room: dict[Conn, None] | None, limit: int) -> None:
        self.leave(conn)
        if room is None:
            return
        if len(room) >= limit:
            oldest = next(iter(room))
            self.leave(oldest)
            oldest.task.cancel()
            if room is self.head:
                what = "were still sending their request heads; closed the oldest, from %s (a flood of slow clients?)"
                self._note("evicted", "%d connections " + what, limit, oldest.peer)
            elif room is self.write:
                self._note("slow-reader", "%d connections were not reading their answers; closed the oldest, from %s",
                           limit, oldest.peer)  # fmt: skip
        room[conn] = None
        conn.room = room

    def leave(self, conn: Conn) -> None:
        if conn.room is not None:
            conn.room.pop(conn, None)
            conn.room = None
