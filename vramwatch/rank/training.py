"""The rank's :class:`~vramwatch.spool.schema.TrainingState`: how it ended, its collectives, its waits, its
phase and its non-finite values, put together on the sampler thread for each sample."""

from __future__ import annotations

import math

from vramwatch.rank.collectives import CollectiveProgress
from vramwatch.rank.heartbeat import Heartbeat
from vramwatch.rank.waits import BlockedClock
from vramwatch.spool.schema import TrainingState


def _kind(v: float | None) -> str:
    if v is None or math.isfinite(v):
        return ""
    return "nan" if v != v else ("inf" if v > 0 else "-inf")


def _blocking_backend(backend: str) -> bool:
    """Whether the default group's collectives block the calling thread (gloo's do; NCCL's run on the GPU)."""
    return "gloo" in backend and "nccl" not in backend


class TrainingReader:
    """Reads what the training thread left in the heartbeat, plus the process group; never raises."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        self.heartbeat = heartbeat
        self.progress = CollectiveProgress()
        self.blocked = BlockedClock()
        self.exit_reason = ""  # set by Handle.ended
        self.exit_detail = ""

    def read(self) -> TrainingState | None:
        hb = self.heartbeat
        collectives = self.progress.read()
        waits: dict[str, float] = {}
        if hb.data_tracked:
            waits["data"] = hb.data_wait
        if collectives is not None and _blocking_backend(self.progress.backend):
            blocked = self.blocked.read(hb.thread_id, hb.data_wait)
            if blocked is not None:
                waits["collective"] = blocked
        phase = hb.phases.current()
        nonfinite: dict[str, int] = {}
        lr, gr = hb.loss_read, hb.grad_norm_read
        if hb.loss is not None:  # present, at 0, once the job passes any
            nonfinite["loss"] = hb.nonfinite_loss + lr.nonfinite
        if hb.grad_norm is not None:
            nonfinite["grad_norm"] = hb.nonfinite_grad_norm + gr.nonfinite
        state = TrainingState(
            exit_reason=self.exit_reason,
            exit_detail=self.exit_detail,
            collectives=collectives,
            waits=waits,
            phase=phase[0] if phase else "",
            phase_start=phase[1] if phase else 0.0,
            nonfinite=nonfinite,
            loss=_kind(lr.raw) if hb.loss is not None else "",
            grad_norm=_kind(gr.raw) if hb.grad_norm is not None else "",
        )
        return state if state else None

    def close(self) -> None:
        self.blocked.close()
