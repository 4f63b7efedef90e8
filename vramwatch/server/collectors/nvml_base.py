"""What every NVML-reading collector does before and around its own reads.

The ``nvml``, ``gpm``, ``nvlink`` and ``processes`` collectors share one
:class:`~vramwatch.server.nvml_backend.NvmlSession`. Each read starts the same way: make sure the session is
up (a node without NVML is a state, ``up`` 1, not a failure), forget what was remembered about the GPUs when
NVML re-initialised, then read. A session-wide NVML error marks the session down for all of them, and a
read that saw trouble keeps its data and turns ``up`` 0 through :class:`ReadFailed`.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from vramwatch.config import Settings
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors.framework import Collector, ReadFailed, Tick

S = TypeVar("S")


class SessionDown(Exception):
    """NVML answered one GPU's read with a session-wide error; the session is already marked down."""


class NvmlSessionCollector(Collector[S]):
    """A collector reading through the shared NVML session: the prelude, the re-init and the failure sort."""

    what = "reading"  # what a failed read of one GPU was doing, for its log line

    def __init__(self, settings: Settings, session: nb.NvmlSession | None = None) -> None:
        self.settings = settings
        self.session = session or nb.session_for(settings)
        self._generation = -1  # the session generation our remembered state belongs to
        self.unavailable: dict[str, str] = {}  # uuid -> why it is not read (the NVML call and code), until re-init

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
        self.unavailable.clear()

    def _down(self) -> S | None:
        """The snapshot once a read found the session down."""
        return None

    def _read_gpus(self, tick: Tick, reinit: bool) -> tuple[S | None, bool]:
        """(snapshot, ok) with the session up; ``reinit``: the first read since NVML (re)initialised.

        By default each GPU in turn through :meth:`_read_device`, skipping the :attr:`unavailable` ones; a lost
        GPU (the nvml collector probes it) or a failed read turns ``up`` 0.
        """
        ok = True
        out = []
        lost = self.session.lost
        for d in self.session.devices:
            if d.uuid in self.unavailable:
                continue
            if d.lost or d.uuid in lost:
                self._drop(d)
                ok = False
                continue
            try:
                reading = self._read_device(d)
            except Exception as e:  # noqa: BLE001 - an NVMLError of any kind, sorted by _failed
                self._drop(d)
                ok = self._read_failed(d, e) and ok
                continue
            if reading is not None:
                out.append(reading)
        return tuple(out), ok  # type: ignore[return-value]

    def _read_device(self, d: nb.Device) -> Any:
        """One GPU's reading (None: nothing to show)."""
        raise NotImplementedError

    def _drop(self, d: nb.Device) -> None:
        """Release what is held for a GPU that is lost or failed a read: the next read starts afresh."""

    def _read_failed(self, d: nb.Device, e: BaseException) -> bool:
        return self._failed(d, e, self.what)

    def _once_info(self, d: nb.Device, key: tuple[Any, ...], what: str, *args: Any) -> None:
        """Log ``vramwatch: GPU <index> <uuid>: <what % args>`` once per ``key``, at INFO."""
        self.session.once(
            ("unsupported", d.uuid, *key), "vramwatch: GPU %d %s: " + what, d.index, d.uuid, *args, level=logging.INFO
        )

    def _unavailable_gpu(self, d: nb.Device, why: str, what: str) -> None:
        """``d`` offers nothing here (``why``: the NVML call and code): skipped until NVML re-inits, said once."""
        self._drop(d)
        self.unavailable[d.uuid] = why
        self._once_info(d, (self.name,), what, why)

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
