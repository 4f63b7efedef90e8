"""The server's one prometheus_client collector: reads the spool, asks each collector (cached: exposition_cache)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client.core import Metric

from vramwatch import spool
from vramwatch._version import __version__
from vramwatch.config import Settings
from vramwatch.monitoring import contract
from vramwatch.server.collectors import Health, Runner, ScrapeContext, ranks


class ExporterCollector:
    def __init__(self, settings: Settings, spool_dir: str, collectors: list[Runner]) -> None:
        self.settings = settings
        self.spool_dir = spool_dir
        self.collectors = collectors
        self.hostname = settings.resolved_hostname()
        self.spool_health = Health()
        self._served_at: float | None = None
        # what a cache must know of the last read: whether it served dead ranks' last samples (those
        # go to one scrape only), and whether it read at all (a failed read is tried again)
        self.last_read_reaped = False
        self.last_read_ok = False

    def served_ranks_since(self, t: float) -> bool:
        """Whether a scrape after monotonic time ``t`` carried any rank."""
        return self._served_at is not None and self._served_at >= t

    def describe(self) -> list[Metric]:
        return []  # keeps registration from running a collection

    def context(self) -> ScrapeContext:
        t0 = time.perf_counter()
        ok = reaped_any = False
        try:
            reaped: list[spool.RankSample] = []
            rejected: list[spool.Rejected] = []
            samples = spool.read_samples(self.spool_dir, self.settings.max_ranks, reaped, rejected=rejected)
            # a rank that died since the last scrape is served by this scrape, then never again:
            # its last counters (an OOM that killed it) reach Prometheus, and its series are
            # gone by the second scrape after its death
            live = {s.rank for s in samples}
            samples += [s for s in reaped if s.rank not in live]
            self.spool_health.up = 1
            for r in rejected:  # a rank whose series are missing: up 0 while it lasts, logged once per file
                self.spool_health.failed(f"rejected:{r.file}:{r.reason}:{r.version}", "vramwatch: %s", r.describe())
            ok, reaped_any = True, bool(reaped)
        except Exception as e:  # noqa: BLE001
            samples = []
            self.spool_health.failed("spool", "vramwatch: reading the spool failed: %r", e)
        self.spool_health.duration = time.perf_counter() - t0
        self.last_read_ok, self.last_read_reaped = ok, reaped_any
        if samples:
            self._served_at = time.monotonic()
        return ScrapeContext(tuple(samples), time.time(), self.hostname)

    def mark_served(self, ctx: ScrapeContext) -> None:
        """A scrape served ``ctx`` again from a cache."""
        if ctx.samples:
            self._served_at = time.monotonic()

    def collect(self) -> Iterable[Metric]:
        return self.families(self.context())

    def families(self, ctx: ScrapeContext) -> Iterable[Metric]:
        yield from ranks.families(ctx)
        for c in self.collectors:
            yield from c.collect(ctx)  # a bad snapshot drops its families, never the scrape
        yield from self._self_health(ctx)

    def _self_health(self, ctx: ScrapeContext) -> Iterable[Metric]:
        up = contract.family("vramwatch_collector_up")
        err = contract.family("vramwatch_collector_errors_total")
        dur = contract.family("vramwatch_collector_duration_seconds")
        rows: list[tuple[str, str, Health | spool.CollectorHealth]] = [("spool", "", self.spool_health)]
        rows += [(c.name, "", c.health) for c in self.collectors]
        rows += ranks.rank_collector_health(ctx)
        for name, rank, h in rows:
            up.add_metric([name, rank], float(h.up))
            err.add_metric([name, rank], float(h.errors))
            dur.add_metric([name, rank], float(h.duration))
        n = contract.family("vramwatch_ranks")
        n.add_metric([], float(len(ctx.samples)))
        build = contract.family("vramwatch_build_info")
        build.add_metric([__version__, self.hostname], 1.0)
        yield from (up, err, dur, n, build)
