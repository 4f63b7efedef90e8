"""The collector framework: one runner times each read, keeps health and cadence; collectors only read."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

from vramwatch.config import Settings
from vramwatch.server.collectors import Cadence, Collector, ReadFailed, Runner, ScrapeContext, Tick, enabled_collectors


class Scripted(Collector[int]):
    """Reads whatever the test queues: a number, a ReadFailed, or any exception."""

    name = "scripted"

    def __init__(self, *results: object) -> None:
        self.results = list(results)
        self.ticks: list[Tick] = []

    def read(self, tick: Tick) -> int | None:
        self.ticks.append(tick)
        r = self.results.pop(0)
        if isinstance(r, BaseException):
            raise r
        assert r is None or isinstance(r, int)
        return r

    def families(self, snapshot: int, ctx: ScrapeContext) -> Iterable[Metric]:
        if snapshot < 0:
            raise ValueError("a snapshot the families cannot render")
        g = GaugeMetricFamily("scripted_value", "The scripted value.")
        g.add_metric([], float(snapshot))
        return (g,)


class Slow(Scripted):
    cadence = Cadence.SLOW


def ctx() -> ScrapeContext:
    return ScrapeContext((), time.time(), "h")


def runner(c: Collector, clock: list[float]) -> Runner:
    return Runner(c, Settings(nvml_interval=1.0, nvml_slow_interval=10.0), clock=lambda: clock[0])


def test_read_outcomes_set_up_and_errors_and_keep_the_right_snapshot(caplog):
    caplog.set_level(logging.WARNING, "vramwatch")
    t = [0.0]
    r = runner(Scripted(1, ReadFailed(2), OSError("x"), OSError("y"), 5), t)
    r.poll_once()
    assert (r.snapshot, r.health.up, r.health.errors) == (1, 1, 0)
    r.poll_once()  # trouble, but the collector's partial snapshot is served
    assert (r.snapshot, r.health.up, r.health.errors) == (2, 0, 1)
    r.poll_once()  # a crash keeps the previous snapshot
    r.poll_once()
    assert (r.snapshot, r.health.up, r.health.errors) == (2, 0, 3)
    assert len([x for x in caplog.records if "scripted collector failed" in x.getMessage()]) == 1  # logged once
    r.poll_once()
    assert (r.snapshot, r.health.up, r.health.errors) == (5, 1, 3)
    assert r.health.duration >= 0.0
    assert [s.value for m in r.collect(ctx()) for s in m.samples] == [5.0]


def test_families_that_fail_drop_their_families_and_count_an_error():
    r = runner(Scripted(-1), [0.0])
    r.poll_once()
    assert r.collect(ctx()) == () and r.health.up == 0 and r.health.errors == 1


def test_nothing_read_yet_renders_nothing():
    r = runner(Scripted(None), [0.0])
    r.poll_once()
    assert r.collect(ctx()) == () and r.health.up == 1


def test_fast_reads_are_told_when_slow_fields_are_due_and_slow_reads_always_are():
    t = [100.0]
    fast, slow = Scripted(*range(25)), Slow(*range(25))
    rf, rs = runner(fast, t), runner(slow, t)
    assert (rf.interval, rs.interval) == (1.0, 10.0)
    for _ in range(21):
        rf.poll_once()
        rs.poll_once()
        t[0] += 1.0
    assert [tick.now for tick in fast.ticks if tick.slow] == [100.0, 110.0, 120.0]
    assert all(tick.slow for tick in slow.ticks)


def test_builtin_collectors_follow_their_flags_in_exposition_order(tmp_path):
    s = Settings(simulate=True, spool_dir=str(tmp_path))
    assert [r.name for r in enabled_collectors(s)] == ["processes", "xid", "nvml", "gpm", "nvlink"]
    off = Settings(simulate=True, spool_dir=str(tmp_path), xid=False, processes=False, gpm=False, nvlink=False)
    assert [r.name for r in enabled_collectors(off)] == ["nvml"]


def test_config_does_not_import_the_server_and_the_server_not_the_alerts_config():
    code = (
        "import sys, vramwatch.config; assert not [m for m in sys.modules if m.startswith('vramwatch.server')]; "
        "import vramwatch.server.main, vramwatch.server.collectors.xid; "
        "assert 'vramwatch.monitoring.config' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
