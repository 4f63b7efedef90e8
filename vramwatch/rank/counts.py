"""The token and sample totals a job passes to ``step(tokens=, samples=)``, kept publishable whatever it passes.

A Python number is added on the training thread when it is a count (0 to :data:`MAX_STEP_COUNT`): NaN,
an infinity, a negative number or ``10**400`` is dropped there (one comparison), so the total never goes
backwards, never turns NaN and always converts to a float. Anything else (a tensor: the natural
``mask.sum()``; a NumPy scalar) is set aside as it is and counted later on the sampler thread: a host
value read there, a CUDA tensor summed there and copied to the host without waiting for the GPU (read at
a later sample, as the loss is: :mod:`.device_scalar`). So the training thread never runs a torch op or
waits for the GPU for it. At most :data:`MAX_PENDING` values wait between two samples; beyond that they
are dropped (counted in ``dropped``, logged once by the caller).
"""

from __future__ import annotations

import math
from typing import Any

from vramwatch.rank.device_scalar import queue_copy, scalar

MAX_STEP_COUNT = 1e15  # tokens in one step of one rank: far beyond any batch, far below float's exact range
MAX_PENDING = 100_000


class Total:
    """One total (tokens or samples); ``add`` on the training thread, ``drain`` on the sampler thread."""

    __slots__ = ("value", "pending", "dropped", "_in_flight", "_slots")

    def __init__(self) -> None:
        self.value: float | None = None  # None until the job passes any: the counter stays absent
        self.pending: list[Any] = []
        self.dropped = 0
        self._in_flight: Any = None  # (pinned buffer, event) of a device sum copied behind the GPU's work
        self._slots: dict[Any, Any] = {}

    def add(self, v: Any) -> None:
        """On the training thread: a few comparisons, or one list append."""
        if type(v) is int or type(v) is float:
            if 0 <= v <= MAX_STEP_COUNT:
                t = self.value
                self.value = v if t is None else t + v
            else:
                self.dropped += 1
        elif len(self.pending) < MAX_PENDING:
            self.pending.append(v)
        else:
            self.dropped += 1

    def drain(self) -> float | None:
        """On the sampler thread: count what was set aside; the total as published. Never raises."""
        self._collect()
        if not self.pending:
            return self.published()
        items, self.pending = self.pending, []  # the training thread appends to the new list from now on
        device: list[Any] = []
        for v in items:
            try:
                on_gpu = getattr(v, "is_cuda", False) is True
                number = not isinstance(v, (bool, str, bytes)) and (hasattr(v, "item") or isinstance(v, (int, float)))
            except BaseException:  # noqa: BLE001 - a hostile object's attribute
                on_gpu = number = False
            if on_gpu:
                device.append(v)
            else:
                self._add_host(scalar(v) if number else None)
        if device:
            self._queue(device)
        return self.published()

    def published(self) -> float | None:
        v = self.value
        if v is None:
            return None
        try:
            f = float(v)
        except (OverflowError, TypeError, ValueError):
            return None
        return f if math.isfinite(f) and f >= 0 else None

    def _add_host(self, f: float | None, most: float = MAX_STEP_COUNT) -> None:
        if f is not None and 0 <= f <= most:
            self.value = f if self.value is None else self.value + f
        else:
            self.dropped += 1

    def _queue(self, tensors: list[Any]) -> None:
        if self._in_flight is not None:  # one copy in flight: the rest waits for the next sample
            self.pending = tensors + self.pending
            return
        try:
            total = None
            for t in tensors:  # on this thread's streams of their devices: after the job's own work on them
                s = t.detach().double().sum()
                total = s if total is None else total + s.to(total.device)
            if total is not None:
                self._in_flight = queue_copy(total, self._slots)
        except BaseException:  # noqa: BLE001 - whatever the job's object does, the sampler goes on
            self.dropped += len(tensors)

    def _collect(self) -> None:
        flight = self._in_flight
        if flight is None:
            return
        buf, event = flight
        try:
            if not event.query():
                return
        except BaseException:  # noqa: BLE001 - a broken context: the value is lost
            self._in_flight = None
            self.dropped += 1
            return
        self._in_flight = None
        self._add_host(scalar(buf), MAX_STEP_COUNT * MAX_PENDING)  # the sum of up to MAX_PENDING steps
