"""Which ranks a scrape exports: the live ones, the final samples of dead ones, counters carried on.

A rank that dies (an OOM, a crash, a restart) leaves its final sample in the spool; the reader
serves it for ``dead_rank_grace_seconds`` (:func:`vramwatch.spool.read_spool`). That alone would not
get its OOM to Prometheus when the job restarts at once: the new process exports the same label set
(rank numbers, GPUs and the job id are reused; a pid is no label), and its counters start again at 0.
Another job's rank of the same number is another label set (its ``job_id``): nothing carries between jobs.

So the counters of a label set go on across the processes that export it, for as long as this
server runs and the label set stays exported: a dead process's final counters are added to the
series of its successor (and of the dead process itself, while only its final sample is left).
``increase(torch_cuda_memory_ooms_total[...])`` then sees 0 -> 1 for a job that OOMs and restarts
within one scrape interval, however the scrapes fall. A server restart starts them from the
processes' own values again, which Prometheus reads as a counter reset.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping

from vramwatch import spool
from vramwatch.monitoring import contract
from vramwatch.spool.limits import DROP_REASONS

DeviceKey = tuple[str, int, int, int, str]  # uuid, device, rank, local_rank, job_id: contract.RANK_DEVICE
RankKey = tuple[str, int, int]  # job_id, rank, local_rank: one rank of one job (its label set is contract.RANK)

# the device counters carried across a label set's processes
CARRIED = frozenset(m.name for m in contract.METRICS if m.labels == contract.RANK_DEVICE and m.type == "counter")


def device_key(s: spool.RankSample, d: spool.DeviceSample) -> DeviceKey:
    return (d.uuid, d.device, s.rank, s.local_rank, s.job_id)


def rank_key(s: spool.RankSample) -> RankKey:
    return (s.job_id, s.rank, s.local_rank)


class RankView:
    """The scrape path's view of the spool; one per server, called from concurrent scrapes in turn."""

    def __init__(self, spool_dir: str, max_ranks: int, grace: float) -> None:
        self.spool_dir = spool_dir
        self.max_ranks = max_ranks
        self.grace = grace
        self.dropped: Counter[str] = Counter(dict.fromkeys(DROP_REASONS, 0))
        self._reader = spool.SpoolReader(spool_dir, max_ranks, grace)  # remembers windows and job owners
        self._carried: dict[DeviceKey, dict[str, float]] = {}
        # what each dead process added to _carried, by (job_id, rank, pid): counted once, and taken back if
        # that process publishes again (stop() then start() in one process: its own counters go on by themselves)
        self._counted: dict[tuple[str, int, int], dict[DeviceKey, dict[str, float]]] = {}
        self._lock = threading.Lock()  # concurrent scrapes read in turn: a dead process is counted once

    def read(
        self, now: float | None = None, mono: float | None = None
    ) -> tuple[spool.SpoolRead, Mapping[DeviceKey, Mapping[str, float]]]:
        """One read of the spool, and the carried counters for it (a copy: the next read changes them).
        ``now`` is the wall clock, ``mono`` the monotonic one (:meth:`vramwatch.spool.SpoolReader.read`)."""
        with self._lock:
            return self._read(now, mono)

    def _read(
        self, now: float | None, mono: float | None
    ) -> tuple[spool.SpoolRead, Mapping[DeviceKey, Mapping[str, float]]]:
        read = self._reader.read(now, mono)
        self.dropped.update(read.dropped)
        for s in read.live:
            self._add(self._counted.pop((s.job_id, s.rank, s.pid), {}), -1.0)
        for s in (*read.final, *read.evicted):
            ident = (s.job_id, s.rank, s.pid)
            if ident not in self._counted:
                contribution = {
                    device_key(s, d): {n: v for n, v in d.values.items() if n in CARRIED} for d in s.devices
                }
                self._counted[ident] = contribution
                self._add(contribution, 1.0)
        exported = {device_key(s, d) for s in (*read.live, *read.final) for d in s.devices}
        # a label set nobody exports any more ends its series: what was carried for it goes too
        self._carried = {k: v for k, v in self._carried.items() if k in exported}
        self._counted = {i: c for i, c in self._counted.items() if any(k in self._carried for k in c)}
        return read, {k: dict(v) for k, v in self._carried.items()}

    def _add(self, contribution: Mapping[DeviceKey, Mapping[str, float]], sign: float) -> None:
        for key, values in contribution.items():
            base = self._carried.setdefault(key, {})
            for name, value in values.items():
                base[name] = base.get(name, 0.0) + sign * value
