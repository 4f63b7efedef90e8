"""Xid events: a watcher thread on NVML's event set feeding a ledger the collector only reads.

The watcher registers ``nvmlEventTypeXidCriticalError`` on every GPU that
supports it, then waits on the event set in 2 s slices (``EventSetWait``
returns early on an event and raises TIMEOUT otherwise), checking its stop flag
between waits. Errors back off 1 s to 60 s; after NVML re-initialises the set is
built again ("events that occurred before registration are not recorded").

The ledger counts events per (GPU, Xid) since the exporter started, so
``increase()`` and ``rate()`` work and repeats are visible; never a last-value
gauge. Each row carries its ``action``, the resolution bucket of NVIDIA's Xid
catalogue for the code (``contract.XID_CATALOGUE``; ``unknown`` for a code it
lacks), which is what the alerts split pages from warnings by. The Xids training
jobs meet (``contract.XID_PREINIT``, a short list) are pre-initialised at 0, so
the first event is an increase. Each event is also logged with its meaning, its
action, and the ranks on that GPU with their last step. A GPU that falls off the
bus shows up as GPU_IS_LOST rather than as an event (NVML cannot deliver Xid 79; NVIDIA/DCGM#162): when the NVML
collector marks a GPU lost, the watcher records one Xid 79 per loss.

The watcher is the collector's :class:`~vramwatch.server.collectors.Watch`: the
framework loops it on its own thread and takes the collector's ``up`` and
``errors`` from it; the collector only copies the ledger.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client.core import Metric

from vramwatch.config import Settings
from vramwatch.monitoring import contract, xid_catalogue
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import Collector, Health, ScrapeContext, Tick, register

log = logging.getLogger("vramwatch")

XID_EVENT = 0x0000000000000008  # nvmlEventTypeXidCriticalError
WAIT_MS = 500  # one wait on the event set; stopping the server waits for the current one
MAX_XIDS_PER_GPU = 64  # beyond this many distinct Xids on one GPU, the rest count as xid="other"
PREINIT = contract.XID_PREINIT
LOST_XID = 79  # GPU_IS_LOST is what "fallen off the bus" looks like through NVML
LOST_REPEAT_S = 60.0  # a loss right after a real Xid 79 event is that event, not a second one


class XidCount(NamedTuple):
    """One (GPU, Xid) row of the ledger."""

    gpu: int  # NVML index, -1 when unknown
    uuid: str
    xid: str  # the code, or "other" past the per-GPU bound
    events: float
    last: float  # when the newest event came (Unix time), 0 before the first


@dataclass
class _Tally:
    count: float = 0.0
    last: float = 0.0


class XidLedger:
    """Xid counts and newest-event times per GPU; thread-safe, survives failed collections."""

    def __init__(self, max_per_gpu: int = MAX_XIDS_PER_GPU) -> None:
        self._lock = threading.Lock()
        self._max = max_per_gpu
        self._gpus: dict[str, int] = {}  # uuid -> NVML index
        self._tallies: dict[str, dict[str, _Tally]] = {}  # uuid -> xid label -> tally

    def preinit(self, index: int, uuid: str, xids: Iterable[int] = PREINIT) -> None:
        with self._lock:
            self._gpus[uuid] = index
            per = self._tallies.setdefault(uuid, {})
            for x in xids:
                if len(per) < self._max:
                    per.setdefault(str(int(x)), _Tally())

    def record(self, index: int, uuid: str, xid: int, when: float | None = None) -> float:
        """Count one event; returns the new count."""
        when = time.time() if when is None else when
        with self._lock:
            self._gpus.setdefault(uuid, index)
            per = self._tallies.setdefault(uuid, {})
            label = str(int(xid))
            if label not in per and len(per) >= self._max:
                label = "other"
            tally = per.setdefault(label, _Tally())
            tally.count += 1
            tally.last = when
            return tally.count

    def last(self, uuid: str, xid: int) -> float:
        """When the newest event of ``xid`` came on ``uuid`` (0: never)."""
        with self._lock:
            tally = self._tallies.get(uuid, {}).get(str(int(xid)))
            return tally.last if tally else 0.0

    def counts(self) -> tuple[XidCount, ...]:
        """Every row, a copy."""
        with self._lock:
            return tuple(
                XidCount(self._gpus.get(u, -1), u, x, t.count, t.last)
                for u, per in self._tallies.items()
                for x, t in per.items()
            )


def ranks_on(spool_dir: str, max_ranks: int, uuid: str) -> list[tuple[str, int]]:
    """(rank, last step count) of the ranks with a device on ``uuid``, from the spool."""
    from vramwatch.spool import read_samples

    out = []
    for s in read_samples(spool_dir, max_ranks, reap=False):
        if any(d.uuid == uuid for d in s.devices):
            out.append((str(s.rank), s.heartbeat.steps))
    return out


def describe_event(index: int, uuid: str, xid: int, ranks: list[tuple[str, int]], source: str = "") -> str:
    what = "; ".join(x for x in (xid_catalogue.meaning(xid), f"action {xid_catalogue.action(xid)}") if x)
    who = ", ".join(f"rank {r} (last step {s})" for r, s in ranks) or "no rank of this job"
    return f"vramwatch: Xid {xid} ({what}) on GPU {index} {uuid}{f' [{source}]' if source else ''}: {who}"


def log_event(settings: Settings, index: int, uuid: str, xid: int, source: str = "") -> None:
    try:
        ranks = ranks_on(settings.resolved_spool_dir(), settings.max_ranks, uuid)
    except Exception:  # noqa: BLE001 - the log line never costs the event
        ranks = []
    level = logging.ERROR if xid_catalogue.action(xid) in contract.XID_PAGE_ACTIONS else logging.WARNING
    log.log(level, "%s", describe_event(index, uuid, xid, ranks, source))


class XidWatcher:
    """Waits on NVML's event set in bounded steps, filling the ledger it owns; keeps the collector's health."""

    def __init__(self, session: nb.NvmlSession, ledger: XidLedger, settings: Settings, wait_ms: int = WAIT_MS) -> None:
        self.session = session
        self.ledger = ledger
        self.settings = settings
        self.wait_ms = wait_ms
        self.max_wait = wait_ms / 1000.0
        self.health = Health()
        self.events = 0
        self.registered: dict[str, int] = {}  # uuid -> index
        self._es: Any = None
        self._key: Any = None
        self._backoff = nb.BACKOFF_FIRST
        session.on_lost(self._gpu_lost)

    def step(self) -> float:
        """One wait (or one recovery attempt); returns how long to pause before the next."""
        s = self.session
        if not s.ensure():
            if s.absent_reason():
                self.health.ok()  # no NVML on this node: no events to watch, nothing wrong
            else:
                self.health.down()
            return max(0.5, min(s.next_try_in(), 5.0))
        if self._es is None or self._key != s.watch_key():
            try:
                self._register()
            except Exception as e:  # noqa: BLE001
                return self._failed("register", e)
        if not self.registered:
            self.health.ok()  # no GPU offers Xid events: unsupported is not trouble
            return 5.0
        try:
            data = s.nv.nvmlEventSetWait(self._es, self.wait_ms)
        except Exception as e:  # noqa: BLE001
            if nb.error_code(e) == nb.TIMEOUT:
                self.health.ok()
                self._backoff = nb.BACKOFF_FIRST
                return 0.0
            return self._failed("wait", e)
        self.health.ok()
        self._backoff = nb.BACKOFF_FIRST
        if int(getattr(data, "eventType", 0)) & XID_EVENT:
            self._event(data)
        return 0.0

    def close(self) -> None:
        self.session.off_lost(self._gpu_lost)
        self._free()

    # --- pieces ---
    def _register(self) -> None:
        s, nv = self.session, self.session.nv
        self._free()
        self.registered = {}
        self._key = s.watch_key()
        self._es = nv.nvmlEventSetCreate()
        lost = s.lost
        for d in s.devices:
            if d.uuid in lost:
                continue
            try:
                mask = XID_EVENT & int(nv.nvmlDeviceGetSupportedEventTypes(d.handle))
                if mask:
                    nv.nvmlDeviceRegisterEvents(d.handle, mask, self._es)
            except Exception as e:
                kind = nb.classify(e)
                if kind in ("unsupported", "lost"):
                    s.once(
                        ("xid-register", d.uuid, nb.error_name(e)),
                        "vramwatch: Xid events on GPU %d %s: %s; not watched",
                        d.index,
                        d.uuid,
                        nb.error_name(e),
                        level=logging.INFO,
                    )
                    continue
                raise  # session trouble, UNKNOWN, ...: free the set and back off
            if not mask:
                s.once(
                    ("xid-unsupported", d.uuid),
                    "vramwatch: GPU %d %s offers no Xid events; not watched",
                    d.index,
                    d.uuid,
                    level=logging.INFO,
                )
                continue
            self.registered[d.uuid] = d.index
            self.ledger.preinit(d.index, d.uuid)
        if self.registered:
            log.info("vramwatch: watching Xid events on %d GPU(s)", len(self.registered))

    def _event(self, data: Any) -> None:
        xid = int(getattr(data, "eventData", 999))
        uuid, index = self._which(data.device)
        self.events += 1
        if not uuid:
            log.error("vramwatch: Xid %d on a GPU NVML could not name", xid)
            return
        self.ledger.record(index, uuid, xid)
        log_event(self.settings, index, uuid, xid)

    def _which(self, handle: Any) -> tuple[str, int]:
        nv = self.session.nv
        try:
            uuid = nb.text(nv.nvmlDeviceGetUUID(handle))
            if uuid in self.registered:
                return uuid, self.registered[uuid]
            d = self.session.device(uuid)
            return uuid, d.index if d else -1
        except Exception:  # noqa: BLE001 - a lost GPU may not answer: fall back on what we registered
            if len(self.registered) == 1:
                return next(iter(self.registered.items()))
            return "", -1

    def _gpu_lost(self, d: nb.Device) -> None:
        """The NVML collector found ``d`` lost: one Xid 79 per loss, unless the event itself just came."""
        if time.time() - self.ledger.last(d.uuid, LOST_XID) > LOST_REPEAT_S:
            self.ledger.record(d.index, d.uuid, LOST_XID)
            log_event(self.settings, d.index, d.uuid, LOST_XID, source="GPU_IS_LOST")

    def _failed(self, where: str, e: BaseException) -> float:
        self.health.failed()
        kind = nb.classify(e)
        if kind == "session":
            self.session.mark_down(e)
        self.session.once(
            ("xid", where, nb.error_name(e)),
            "vramwatch: Xid watcher %s failed (%s: %s); retrying with back-off",
            where,
            nb.error_name(e),
            e,
            level=logging.WARNING,
        )
        self._free()
        pause = self._backoff
        self._backoff = min(self._backoff * 2, nb.BACKOFF_MAX)
        return pause

    def _free(self) -> None:
        es, self._es = self._es, None
        if es is not None:
            try:
                self.session.nv.nvmlEventSetFree(es)
            except Exception:  # noqa: BLE001
                pass


@register("xid", lambda s: s.xid, "Xid events from NVML's event set (a watcher thread per server).")
class XidCollector(Collector[tuple[XidCount, ...]]):
    def __init__(self, settings: Settings, session: nb.NvmlSession | None = None, wait_ms: int = WAIT_MS) -> None:
        self.settings = settings
        self.session = session or nb.session_for(settings)
        self.watcher = XidWatcher(self.session, XidLedger(), settings, wait_ms)
        self.watch = self.watcher

    def read(self, tick: Tick) -> tuple[XidCount, ...]:
        return self.watcher.ledger.counts()

    def families(self, snapshot: tuple[XidCount, ...], ctx: ScrapeContext) -> Iterable[Metric]:
        return xid_families(snapshot, ctx, self.settings.gpus == "job")


def xid_families(rows: Iterable[XidCount], ctx: ScrapeContext, job_only: bool = False) -> Iterable[Metric]:
    total = contract.family("gpu_xid_errors_total")
    last = contract.family("gpu_last_xid_timestamp_seconds")
    job = job_uuids(ctx) if job_only else None
    for index, uuid, xid, events, when in rows:
        if job is not None and uuid not in job:
            continue
        labels = [str(index), uuid, xid, xid_catalogue.action(xid)]  # "other" (past the bound): unknown
        total.add_metric(labels, events)
        if when > 0:
            last.add_metric(labels, when)
    return (total, last)


def job_uuids(ctx: ScrapeContext) -> set[str]:
    """GPUs the job's ranks use, from their samples."""
    return {d.uuid for s in ctx.samples for d in s.devices if d.uuid}
