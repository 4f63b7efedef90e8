"""The job's heartbeat: step counter, last-step time, step-duration histogram.

``step()`` runs on the training thread on every step, so it does plain
attribute updates under the GIL: no locks shared with anything, no CUDA calls,
no allocation beyond a float or two. The sampler thread reads the fields.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from typing import Any

from vramwatch.rank.counts import Total
from vramwatch.rank.device_scalar import DeviceScalar
from vramwatch.rank.phase import PhaseStack
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
        "token_total",
        "sample_total",
        "_reads",
        "thread_id",
        "data_wait",
        "data_tracked",
        "nonfinite_loss",
        "nonfinite_grad_norm",
        "phases",
    )

    def __init__(self, sample_interval: float = 0.0) -> None:
        self.steps = 0
        self.last_step_time = 0.0
        self._last_mono: float | None = None
        self.counts = [0] * (len(BUCKETS) + 1)  # last slot: +Inf
        self.sum = 0.0
        self.loss: Any = None
        self.grad_norm: Any = None
        self.token_total = Total()  # whatever step() is passed, the totals stay publishable (counts.py)
        self.sample_total = Total()
        # loss, grad norm: on the sampler thread only, which samples every sample_interval seconds
        self._reads = (DeviceScalar(sample_interval), DeviceScalar(sample_interval))
        self.thread_id = 0  # the training thread (the first to step): its blocked time is the collective wait
        self.data_wait = 0.0  # seconds waiting for the next batch (track(), the callbacks)
        self.data_tracked = False  # whether anything measures it: else the data wait is absent
        self.nonfinite_loss = 0  # Python numbers passed as NaN / +-Inf (tensors: counted where read)
        self.nonfinite_grad_norm = 0
        self.phases = PhaseStack()

    def step(self, loss: Any = None, grad_norm: Any = None, tokens: Any = None, samples: Any = None) -> None:
        now = time.monotonic()
        last = self._last_mono
        if last is not None:
            d = now - last
            self.counts[bisect_left(BUCKETS, d)] += 1
            self.sum += d
        else:
            self.thread_id = threading.get_native_id()
        self._last_mono = now
        self.last_step_time = time.time()
        self.steps += 1
        if loss is not None:
            if type(loss) is float and loss - loss != 0.0:  # NaN or an infinity (inf - inf is NaN)
                self.nonfinite_loss += 1
            self.loss = _keep(loss)
        if grad_norm is not None:
            if type(grad_norm) is float and grad_norm - grad_norm != 0.0:
                self.nonfinite_grad_norm += 1
            self.grad_norm = _keep(grad_norm)
        if tokens is not None:
            self.token_total.add(tokens)
        if samples is not None:
            self.sample_total.add(samples)

    def note(self, loss: Any = None, grad_norm: Any = None) -> None:
        """A loss / grad norm a callback read from the framework's logs (host numbers), counted as step() does."""
        if loss is not None:
            if isinstance(loss, float) and loss - loss != 0.0:
                self.nonfinite_loss += 1
            self.loss = _keep(loss)
        if grad_norm is not None:
            if isinstance(grad_norm, float) and grad_norm - grad_norm != 0.0:
                self.nonfinite_grad_norm += 1
            self.grad_norm = _keep(grad_norm)

    @property
    def tokens(self) -> float | None:
        """The token total counted so far (None: the job passed none)."""
        return self.token_total.value

    @property
    def samples(self) -> float | None:
        return self.sample_total.value

    @property
    def loss_read(self) -> DeviceScalar:
        return self._reads[0]

    @property
    def grad_norm_read(self) -> DeviceScalar:
        return self._reads[1]

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
            self.token_total.drain(),
            self.sample_total.drain(),
        )


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
