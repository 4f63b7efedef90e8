"""The server's one prometheus_client collector: reads the spool, asks each collector (rendered by exposition_cache)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from prometheus_client.core import Metric

from vramwatch import spool
from vramwatch._once import OnceLog
from vramwatch._version import __version__
from vramwatch.config import Settings
from vramwatch.monitoring import contract
from vramwatch.server.collectors import Health, Runner, ScrapeContext, ranks
from vramwatch.server.collectors.rank_view import DeviceKey, RankView


class ExporterCollector:
    def __init__(self, settings: Settings, spool_dir: str, collectors: list[Runner], mode: str = "job") -> None:
        self.settings = settings
        self.mode = mode  # node: the node's daemon; job: a server a rank started (vramwatch_server_mode)
        self._log_refused = OnceLog(logging.getLogger("vramwatch"))
        self.spool_dir = spool_dir
        self.collectors = collectors
        self.hostname = settings.resolved_hostname()
        self.spool_health = Health()
        self.spool_trouble = ""  # why the spool directory is unusable (it vanished and cannot be made again)
        self.spool_vanished = 0  # the guard's count of vanishings: a spool made again can read as the old one
        self.rank_view = RankView(spool_dir, settings.max_ranks, settings.dead_rank_grace_seconds)
        self.monotonic = time.monotonic  # the clock final samples' windows run on once seen (a wall step spares them)
        self._served_at: float | None = None
        # what a cache must know of the last read: whether it read at all (a failed read is tried again),
        # and when the first of the dead ranks' final samples it carried leaves (wall time; None: none)
        self.last_read_ok = False
        self.last_read_expires: float | None = None

    def served_ranks_since(self, t: float) -> bool:
        """Whether a scrape after monotonic time ``t`` carried any rank."""
        return self._served_at is not None and self._served_at >= t

    def describe(self) -> list[Metric]:
        return []  # keeps registration from running a collection

    def context(self) -> ScrapeContext:
        t0 = time.perf_counter()
        now = time.time()
        read = spool.SpoolRead()
        carried: Mapping[DeviceKey, Mapping[str, float]] = {}
        ok = False
        try:
            # live ranks, and dead ranks' final samples for their grace window (rank_view)
            read, carried = self.rank_view.read(now, self.monotonic())
            self.spool_health.up = 0 if self.spool_trouble else 1
            for f in read.refused:  # a local user's planted entry: logged, counted, never a collector failure
                self._log_refused((f.entry, f.why), "vramwatch: %s", f.describe())
            for r in read.rejected:  # a rank whose series are missing: up 0 while it lasts, logged once per file
                self.spool_health.failed(f"rejected:{r.file}:{r.reason}:{r.version}", "vramwatch: %s", r.describe())
            ok = True
        except Exception as e:  # noqa: BLE001
            self.spool_health.failed("spool", "vramwatch: reading the spool failed: %r", e)
        self.spool_health.duration = time.perf_counter() - t0
        self.last_read_ok = ok
        # a dead rank's final sample leaves the exposition when its window ends: a cache renders again then
        self.last_read_expires = read.expires
        if read.live or read.final:
            self._served_at = time.monotonic()
        return ScrapeContext(tuple(read.live), now, self.hostname, tuple(read.final), carried)

    def mark_served(self, ctx: ScrapeContext) -> None:
        """A scrape served ``ctx`` again from a cache."""
        if ctx.samples:
            self._served_at = time.monotonic()

    def collect(self) -> Iterable[Metric]:
        return self.families(self.context())

    def families(self, ctx: ScrapeContext) -> Iterable[Metric]:
        yield from ranks.families(ctx, self._rank_failed)
        for c in self.collectors:
            yield from c.collect(ctx)  # a bad snapshot drops its families, never the scrape
        yield from self._self_health(ctx)

    def _rank_failed(self, s: spool.RankSample, e: Exception) -> None:
        self.spool_health.failed(
            f"families:{s.job_id}:{s.rank}:{type(e).__name__}",
            "vramwatch: rank %d's sample cannot be rendered (%r); its series (job_id %r) are left out",
            s.rank,
            e,
            s.job_id,
        )

    def _self_health(self, ctx: ScrapeContext) -> Iterable[Metric]:
        up = contract.family("vramwatch_collector_up")
        err = contract.family("vramwatch_collector_errors_total")
        dur = contract.family("vramwatch_collector_duration_seconds")
        # the server's own collectors have no rank and no job: rank="" and job_id="" (absent in PromQL)
        rows: list[tuple[str, str, str, Health | spool.CollectorHealth]] = [("spool", "", "", self.spool_health)]
        rows += [(c.name, "", "", c.health) for c in self.collectors]
        rows += ranks.rank_collector_health(ctx)
        for name, rank, job_id, h in rows:
            labels = [name, rank, job_id]
            up.add_metric(labels, float(h.up))
            err.add_metric(labels, float(h.errors))
            dur.add_metric(labels, float(h.duration))
        n = contract.family("vramwatch_ranks")
        n.add_metric([], float(len(ctx.samples)))
        dropped = contract.family("vramwatch_spool_dropped_total")
        for reason, count in self.rank_view.dropped.items():
            dropped.add_metric([reason], float(count))
        build = contract.family("vramwatch_build_info")
        build.add_metric([__version__, self.hostname], 1.0)
        mode = contract.family("vramwatch_server_mode")
        mode.add_metric([self.mode], 1.0)
        yield from (up, err, dur, n, dropped, build, mode)
