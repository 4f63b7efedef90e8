"""The job's heartbeat: step counter, last-step time, step-duration histogram.

``step()`` runs on the training thread on every step, so it does plain
attribute updates under the GIL: no locks shared with anything, no CUDA calls,
no allocation beyond a float or two. The sampler thread reads the fields.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any

from vramwatch.rank.device_scalar import DeviceScalar
from vramwatch.spool import HeartbeatSnapshot

# From 1 ms launch-bound steps to stalls of minutes (a hung collective) and beyond.
BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)


class Heartbeat:
    __slots__ = (
        "steps",
        "last_step_time",
        "_last_mono",
        "counts",
        "sum",
        "loss",
        "grad_norm",
        "tokens",
        "samples",
        "_reads",
    )

    def __init__(self, sample_interval: float = 0.0) -> None:
        self.steps = 0
        self.last_step_time = 0.0
        self._last_mono: float | None = None
        self.counts = [0] * (len(BUCKETS) + 1)  # last slot: +Inf
        self.sum = 0.0
        self.loss: Any = None
        self.grad_norm: Any = None
        self.tokens: int | float | None = None  # None until the job passes any: the counter stays absent
        self.samples: int | float | None = None
        # loss, grad norm: on the sampler thread only, which samples every sample_interval seconds
        self._reads = (DeviceScalar(sample_interval), DeviceScalar(sample_interval))

    def step(self, loss: Any = None, grad_norm: Any = None, tokens: Any = None, samples: Any = None) -> None:
        now = time.monotonic()
        last = self._last_mono
        if last is not None:
            d = now - last
            self.counts[bisect_left(BUCKETS, d)] += 1
            self.sum += d
        self._last_mono = now
        self.last_step_time = time.time()
        self.steps += 1
        if loss is not None:
            self.loss = _keep(loss)
        if grad_norm is not None:
            self.grad_norm = _keep(grad_norm)
        if tokens is not None:  # two adds: the counts are Python numbers (a tensor is dropped at the snapshot)
            self.tokens = tokens if self.tokens is None else self.tokens + tokens
        if samples is not None:
            self.samples = samples if self.samples is None else self.samples + samples

    def snapshot(self) -> HeartbeatSnapshot:
        steps = self.steps
        return HeartbeatSnapshot(  # positional, in field order: the sampler thread builds one per sample
            steps,
            self.last_step_time,
            BUCKETS,
            tuple(self.counts),
            self.sum,
            self._reads[0].read(self.loss, steps),
            self._reads[1].read(self.grad_norm, steps),
            _count(self.tokens),
            _count(self.samples),
        )


def _count(v: Any) -> float | None:
    """A token or sample total as published: a finite number 0 or more, else nothing (never a sync)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf"):
        return float(v)
    return None


def _keep(v: Any) -> Any:
    """Numbers as they are; a tensor that carries an autograd graph, detached.

    Holding the job's loss itself would keep its graph alive into the next step; the detached
    tensor shares the scalar's storage and nothing else (about a microsecond). Converting it here
    would synchronise CUDA: the sampler thread reads it later, without waiting (device_scalar).
    """
    if isinstance(v, (float, int)):
        return v
    if getattr(v, "requires_grad", False):
        try:
            return v.detach()
        except Exception:  # noqa: BLE001 - not a tensor after all
            return None
    return v
