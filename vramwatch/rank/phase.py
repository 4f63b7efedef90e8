"""Declared non-training phases: ``with vramwatch.phase("eval"):`` (and save, load, compile).

While one is open the rank publishes ``vramwatch_training_phase_start_timestamp_seconds{phase}`` (when it
began), so the stall rules can tell an evaluation from a hang, up to their limit. Names are a closed set
(:data:`~vramwatch.spool.schema.PHASES`): any other is published as ``other`` (logged once). Phases nest:
the innermost open one is published; when it closes, the one around it is published again with its own
start. Entering and leaving cost two attribute writes; nothing here raises into the job.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import Any

from vramwatch.spool.schema import PHASES

log = logging.getLogger("vramwatch")
_warned_names = False


def phase_name(name: Any) -> str:
    """The published name: one of PHASES, else ``other`` (the first such name is logged)."""
    global _warned_names
    if isinstance(name, str) and name in PHASES:
        return name
    if not _warned_names:
        _warned_names = True  # one line for the process, whatever names follow: the log stays bounded
        log.warning("vramwatch: phase %r is not one of %s; published as 'other'", str(name)[:64], ", ".join(PHASES))
    return "other"


class PhaseStack:
    """The open phases of one rank, innermost last: (name, unix start) pairs, replaced whole on change so
    the sampler thread reads a consistent tuple without a lock."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open: tuple[tuple[str, float], ...] = ()

    def current(self) -> tuple[str, float] | None:
        o = self.open
        return o[-1] if o else None


class Phase:
    """The context manager ``vramwatch.phase(name)`` returns; also usable as ``enter()`` / ``exit()``."""

    __slots__ = ("_stack", "_entry")

    def __init__(self, stack: PhaseStack | None, name: Any) -> None:
        self._stack = stack
        self._entry: tuple[str, float] | None = None
        if stack is not None:
            try:
                self._entry = (phase_name(name), time.time())
            except Exception:  # noqa: BLE001 - never into the job
                self._stack = None

    def __enter__(self) -> Phase:
        s, e = self._stack, self._entry
        if s is not None and e is not None:
            s.open = (*s.open, e)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        s, e = self._stack, self._entry
        if s is not None and e is not None:
            # this entry, wherever it is (a phase closed out of order leaves the others open)
            o = s.open
            for i in range(len(o) - 1, -1, -1):
                if o[i] is e:
                    s.open = o[:i] + o[i + 1 :]
                    break
        return None  # never swallows the job's exception
