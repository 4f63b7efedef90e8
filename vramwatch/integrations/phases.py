"""What the callbacks declare for the framework: its evaluation / checkpoint phases and its data wait.

The frameworks call hooks at the edges of these (some only at one edge: the Hugging Face Trainer has no
hook before an evaluation or a save, only flags set before them and hooks after), so a callback opens a
phase where the start is known and closes it where the end is. The data wait is the time between the end
of one step and the start of the next, counted only when no phase opened in between (that time was the
evaluation's or the save's, not the loader's). Nothing here raises into training.
"""

from __future__ import annotations

import time

import vramwatch
from vramwatch.rank.phase import Phase


class CallbackPhases:
    def __init__(self) -> None:
        self._open: dict[str, Phase] = {}
        self._opened = 0  # phases opened so far: a step gap that saw one is not a data wait
        self._step_end: float | None = None
        self._opened_at_end = 0

    def open(self, name: str) -> None:
        try:
            if name in self._open:
                return
            p = vramwatch.phase(name)
            p.__enter__()
            self._open[name] = p
            self._opened += 1
        except Exception:  # noqa: BLE001
            pass

    def close(self, *names: str) -> None:
        """Close ``names`` (all open ones when none is given)."""
        for name in names or tuple(self._open):
            p = self._open.pop(name, None)
            if p is not None:
                try:
                    p.__exit__(None, None, None)
                except Exception:  # noqa: BLE001
                    pass

    def step_ended(self) -> None:
        self._step_end = time.perf_counter()
        self._opened_at_end = self._opened

    def step_began(self) -> None:
        """The next step starts: the gap since the last one ended was the wait for its batch."""
        end, self._step_end = self._step_end, None
        if end is None or self._opened != self._opened_at_end or self._open:
            return
        h = vramwatch.current()
        if h is not None:
            hb = h.heartbeat
            hb.data_wait += time.perf_counter() - end
            hb.data_tracked = True
