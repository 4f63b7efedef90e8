"""Read the job's loss (a one-element CUDA tensor) on the sampler thread without waiting on the GPU.

``float(tensor)`` on a CUDA tensor waits until the GPU has run everything queued before it: in a
GPU-bound job that is up to a whole step, spent spinning a core (CUDA's default wait spins), and
while a collective hangs it never returns, which would stop the sampler publishing memory exactly
when a stall needs it. Instead a sample that sees a new loss queues a copy into a pinned host buffer
behind that work, with an event after it, and a later sample reads the copy once the event has
completed (``Event.query()`` never blocks). The published loss is therefore one read older than the
step counter; until the GPU gets there, the last value read stands.

A read of a GPU value costs more CPU than the rest of a sample (~0.27 ms on an H200 host whose sampler
core is idle between samples: cold caches, three CUDA calls), so reads are spaced by
their own measured cost to keep them at or below ``READ_MAX_SHARE`` of a core, and at most
``READ_MAX_GAP`` apart: on that host, one read every 6 s (every third sample at the default 2 s
interval) instead of every sample. Host numbers are read every sample (they cost nothing).

The copy runs on the default stream of the tensor's device, where the job's own ``loss.item()``
would read it; it touches only that device, which already has a context since the tensor lives there.
"""

from __future__ import annotations

import math
import time
from typing import Any

from vramwatch.monitoring.cadence import READ_MAX_GAP  # the help texts promise it: one definition

READ_MAX_SHARE = 5e-5  # of one core, per value read from a GPU (loss, grad norm): 0.005%


def finite(v: Any) -> float | None:
    """A plain number as a finite float, else None (NaN and infinities are not published)."""
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None


def raw_scalar(v: Any) -> float | None:
    """A number or a one-element host tensor as a float, NaN and infinities included; never raises."""
    if v is None:
        return None
    try:
        return float(v.item() if hasattr(v, "item") else v)
    except BaseException:  # noqa: BLE001 - whatever the job passed: its .item() may raise anything (sampler thread)
        return None


def scalar(v: Any) -> float | None:
    """A number or a one-element host tensor as a finite float; never raises."""
    f = raw_scalar(v)
    return f if f is not None and math.isfinite(f) else None


class DeviceScalar:
    """The last value of a series of scalars the job hands over, read without blocking."""

    __slots__ = (
        "value",
        "raw",
        "nonfinite",
        "_pending",
        "_copied_at",
        "_slots",
        "_next_read",
        "sample_interval",
        "copy_behind",
        "clock",
        "cpu_clock",
    )

    def __init__(self, sample_interval: float = 0.0) -> None:
        self.value: float | None = None  # the newest finite value read
        self.raw: float | None = None  # the newest value read, NaN or an infinity included
        self.nonfinite = 0  # tensor reads that were NaN or infinite (a host number is counted by step())
        self._pending: Any = None  # (pinned host tensor, event) of the copy in flight
        self._copied_at: Any = None  # the step count the newest copy was taken at
        self._slots: dict[Any, Any] = {}  # (device, dtype) -> reused pinned buffer, event, stream
        self._next_read = 0.0  # monotonic time before which a GPU value is not looked at again
        # seconds between the samples that call read() (0: unknown): reads land on samples, so the gap is
        # a whole number of intervals, else a read due just after a sample would wait for the next one,
        # past READ_MAX_GAP
        self.sample_interval = sample_interval
        self.copy_behind = queue_copy  # seams for tests without a GPU
        self.clock = time.monotonic
        self.cpu_clock = time.thread_time  # this thread's CPU: what the read costs the job's process

    def read(self, v: Any, step: int | None = None) -> float | None:
        """The newest value the GPU has finished; ``step`` (the job's step count) spares a copy when no
        step came since the last one. Not the tensor's identity: a job may pass one tensor it updates
        in place."""
        if v is None:
            return self.value
        if type(v) is float or type(v) is int:  # a host number, the common case: no attribute lookups that fail
            self._pending = self._copied_at = None
            self._set(raw_scalar(v))
            return self.value
        try:
            on_gpu = getattr(v, "is_cuda", False) is True
        except BaseException:  # noqa: BLE001 - a hostile object's attribute
            on_gpu = False
        if not on_gpu:
            self._pending = None
            if step is None or step != self._copied_at:  # a new value: read (and count) it once
                self._copied_at = step
                self._set(raw_scalar(v), count=True)
            return self.value
        now = self.clock()
        if now < self._next_read:
            return self.value
        t0 = self.cpu_clock()
        try:
            return self._read_gpu(v, step)
        finally:
            gap = (self.cpu_clock() - t0) / READ_MAX_SHARE  # the spacing that keeps reads to their share
            tick = self.sample_interval
            if tick > 0:  # the first sample past that gap, unless it lies past the cap: then the last inside
                n = math.ceil(gap / tick)
                if n * tick > READ_MAX_GAP:
                    n = int(READ_MAX_GAP // tick)
                gap = max(n, 1) * tick - tick / 2  # half an interval of slack for a sample's jitter
            else:
                gap = min(gap, READ_MAX_GAP)
            self._next_read = now + gap

    def _read_gpu(self, v: Any, step: int | None) -> float | None:
        pending = self._pending
        if pending is not None:
            buf, event = pending
            try:
                done = event.query()
            except Exception:  # noqa: BLE001 - a broken context: drop this copy, queue another
                done, buf, self._copied_at = True, None, None
            if not done:
                return self.value  # the GPU has not got there yet (or is stuck): keep the last value
            self._pending = None
            if buf is not None:
                self._set(raw_scalar(buf), count=True)  # read before the buffer is reused below
        if step is not None and step == self._copied_at:
            return self.value  # no step since the last copy: nothing new to read
        try:
            self._pending = self.copy_behind(v, self._slots)
            self._copied_at = step
        except Exception:  # noqa: BLE001 - never raise into the sampler
            self._pending = self._copied_at = None
        return self.value

    def _set(self, f: float | None, count: bool = False) -> None:
        self.raw = f
        if f is not None and not math.isfinite(f):
            self.value = None
            if count:
                self.nonfinite += 1
        else:
            self.value = f


def queue_copy(t: Any, slots: dict[Any, Any]) -> tuple[Any, Any]:
    """Queue ``t`` (one element, on a CUDA device) into pinned host memory; return (buffer, event).

    The buffer, event and stream are made once per device and dtype and reused: one copy is in flight
    at a time and its value is read before the next is queued. A fresh pinned tensor and event per
    sample cost ~0.4 ms of the sampler's CPU a second on an H200 host."""
    import torch  # the job's own; only reached with a CUDA tensor in hand

    key = (t.device, t.dtype)
    slot = slots.get(key)
    if slot is None:
        stream = torch.cuda.default_stream(t.device)
        buf = torch.empty((), dtype=t.dtype, pin_memory=True)  # pinned: a truly asynchronous copy
        slot = slots[key] = (buf, torch.cuda.Event(), stream)
    buf, event, stream = slot
    buf.copy_(t.detach().reshape(()), non_blocking=True)  # on this thread's current stream of t's device: its default
    event.record(stream)
    return buf, event
