"""Opt-in allocator hygiene: give the cache back between steps once reserved passes a threshold.

The usual cure for fragmentation-driven OOMs is ``empty_cache()`` between steps, or
``garbage_collection_threshold:0.8`` in ``PYTORCH_CUDA_ALLOC_CONF``. This does the same from outside
the allocator and counts it (``torch_cuda_memory_cache_reclaims_total``), so a reclaim that makes
every step slow is visible on the dashboard and the status line.

Off unless ``reclaim_threshold`` > 0. The decision is made on the sampler thread from the values it
just read (reserved above ``reclaim_threshold`` x the limit, and at least ``MIN_RELEASABLE_RATIO``
of the limit held as releasable cache); the training thread only checks one attribute in
``vramwatch.step()`` and, when a reclaim is due, calls ``torch.cuda.empty_cache()`` there, between
steps, where the implied synchronisation costs the least. At most one reclaim per sample interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from vramwatch.rank.plugin_api import RankContext, SampleExtras
from vramwatch.spool import DeviceSample

log = logging.getLogger("vramwatch")

RECLAIMS = "torch_cuda_memory_cache_reclaims_total"
# Reclaim only when the cache holds this share of the limit that empty_cache() can give back:
# emptying a nearly empty cache costs a device sync for nothing.
MIN_RELEASABLE_RATIO = 0.01


class Hygiene:
    def __init__(
        self,
        threshold: float,
        release: Callable[[tuple[int, ...]], None],
        min_gap: float = 0.0,
    ) -> None:
        self.threshold = threshold
        self.release = release
        # a sample read before the last reclaim must not ask for another: at most one per sample interval
        self.min_gap = min_gap
        self._last_reclaim = float("-inf")
        self.pending: tuple[int, ...] = ()  # written by the sampler thread, cleared by the training thread
        self.counts: dict[int, float] = {}  # device -> reclaims; the training thread counts, the sampler reads
        self.reclaims = 0
        self._failed = False

    @classmethod
    def for_rank(cls, ctx: RankContext) -> Hygiene:
        return cls(ctx.settings.reclaim_threshold, ctx.source.release_cache, min_gap=ctx.settings.interval)

    def on_sample(self, devices: Sequence[DeviceSample]) -> SampleExtras:
        """Sampler thread: decide which devices need a reclaim at the next step; the reclaim counters."""
        due = []
        for dev in devices:
            v = dev.values
            idx = dev.device
            self.counts.setdefault(idx, 0.0)  # the counter exists from the start
            limit = v.get("torch_cuda_memory_limit_bytes", 0.0)
            reserved = v.get("torch_cuda_memory_reserved_bytes", 0.0)
            if limit <= 0 or reserved <= self.threshold * limit:
                continue
            releasable = (
                reserved
                - v.get("torch_cuda_memory_allocated_bytes", 0.0)
                - v.get("torch_cuda_memory_inactive_split_bytes", 0.0)
            )
            if releasable >= MIN_RELEASABLE_RATIO * limit:
                due.append(idx)
        if due and time.monotonic() - self._last_reclaim < self.min_gap:
            due = []  # these values may predate the last reclaim
        self.pending = tuple(due)
        return SampleExtras({dev: {RECLAIMS: n} for dev, n in list(self.counts.items())})

    def on_step(self) -> None:
        """Training thread, between steps: one attribute read unless a reclaim is due."""
        if not self.pending or self._failed:
            return
        devices, self.pending = self.pending, ()
        self._last_reclaim = time.monotonic()
        try:
            self.release(devices)
        except Exception as e:  # noqa: BLE001
            self._failed = True
            log.warning("vramwatch: empty_cache failed (%r); allocator hygiene is off", e)
            return
        for dev in devices:
            self.counts[dev] = self.counts.get(dev, 0.0) + 1.0
        self.reclaims += 1

    def close(self) -> None:
        pass
