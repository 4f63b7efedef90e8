"""What every NVML-reading collector does before and around its own reads.

The ``nvml``, ``gpm``, ``nvlink`` and ``processes`` collectors share one
:class:`~vramwatch.server.nvml_backend.NvmlSession`. Each read starts the same way: make sure the session is
up (a node without NVML is a state, ``up`` 1, not a failure), forget what was remembered about the GPUs when
NVML re-initialised, then read. A session-wide NVML error marks the session down for all of them, and a
read that saw trouble keeps its data and turns ``up`` 0 through :class:`ReadFailed`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TypeVar

from vramwatch.config import Settings
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors.framework import Collector, ReadFailed, Tick

S = TypeVar("S")


class SessionDown(Exception):
    """NVML answered one GPU's read with a session-wide error; the session is already marked down."""


class NvmlSessionCollector(Collector[S]):
    """A collector reading through the shared NVML session: the prelude, the re-init and the failure sort."""

    def __init__(self, settings: Settings, session: nb.NvmlSession | None = None) -> None:
        self.settings = settings
        self.session = session or nb.session_for(settings)
        self._generation = -1  # the session generation our remembered state belongs to

    def read(self, tick: Tick) -> S | None:
        snap, ok = self._read(tick)
        if not ok:
            raise ReadFailed(snap)
        return snap

    def _read(self, tick: Tick) -> tuple[S | None, bool]:
        s = self.session
        if not s.ensure():
            return self._unavailable(s.absent_reason())
        reinit = self._generation != s.generation
        if reinit:  # (re)initialised: what we remembered belongs to the old session
            self._generation = s.generation
            self._forget()
        try:
            return self._read_gpus(tick, reinit)
        except SessionDown:
            return self._down(), False

    def _unavailable(self, absent: str) -> tuple[S | None, bool]:
        """NVML is not up: no NVML on this node (``absent`` says why) is a state, anything else a failure."""
        return None, bool(absent)

    def _forget(self) -> None:
        """Drop what was remembered per GPU (handles, verdicts, buffers): NVML re-initialised."""

    def _down(self) -> S | None:
        """The snapshot once a read found the session down."""
        return None

    @abstractmethod
    def _read_gpus(self, tick: Tick, reinit: bool) -> tuple[S | None, bool]:
        """(snapshot, ok) with the session up; ``reinit``: the first read since NVML (re)initialised."""

    def _failed(self, d: nb.Device, e: BaseException, what: str, detail: str = "") -> bool:
        """Sort an NVML error from reading one GPU: whether the read is still ok (no data yet is).

        A session-wide error marks the session down and raises :class:`SessionDown`; any other is
        logged once as this collector's failed read.
        """
        kind = nb.classify(e)
        if kind == "session":
            self.session.mark_down(e)
            raise SessionDown() from e
        if kind == "quiet":
            return True
        self.session.read_failed(d, self.name, what, e, detail=detail)
        return False
