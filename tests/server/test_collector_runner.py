"""The runner's threads, timing and health, and registration: what every collector gets from the framework."""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Iterable

import pytest
from prometheus_client.core import GaugeMetricFamily, Metric

from vramwatch.config import Settings
from vramwatch.server.collectors import (
    REGISTRY,
    Cadence,
    Collector,
    Health,
    ReadFailed,
    Runner,
    ScrapeContext,
    Tick,
    enabled_collectors,
    framework,
    register,
)


def ctx() -> ScrapeContext:
    return ScrapeContext((), time.time(), "h")


class Counter(Collector[int]):
    """Counts its reads; optionally sleeps in each; records close()."""

    name = "counter"

    def __init__(self, sleep: float = 0.0) -> None:
        self.reads = 0
        self.closed = 0
        self.sleep = sleep
        self.read_threads: set[str] = set()

    def read(self, tick: Tick) -> int:
        self.read_threads.add(threading.current_thread().name)
        if self.sleep:
            time.sleep(self.sleep)
        self.reads += 1
        return self.reads

    def families(self, snapshot: int, ctx: ScrapeContext) -> Iterable[Metric]:
        g = GaugeMetricFamily("counter_reads", "Reads.")
        g.add_metric([], float(snapshot))
        return (g,)

    def close(self) -> None:
        self.closed += 1


class FakeWatch:
    """A watch that counts its steps; its health is the collector's."""

    def __init__(self, pause: float = 0.0, max_wait: float = 0.05) -> None:
        self.health = Health()
        self.max_wait = max_wait
        self.pause = pause
        self.steps = 0
        self.closed = 0
        self.threads: set[str] = set()

    def step(self) -> float:
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        time.sleep(0.005)
        return self.pause

    def close(self) -> None:
        self.closed += 1


class Watched(Counter):
    name = "watched"

    def __init__(self, watch: FakeWatch, fail: bool = False) -> None:
        super().__init__()
        self.watch = watch
        self.fail = fail

    def read(self, tick: Tick) -> int:
        if self.fail:
            raise ReadFailed(-5)
        return super().read(tick)


def settings(interval: float = 0.02, slow: float = 10.0) -> Settings:
    return Settings(nvml_interval=interval, nvml_slow_interval=slow)


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_start_reads_at_once_then_on_the_interval_on_a_named_thread_and_stop_closes():
    c = Counter()
    r = Runner(c, settings(interval=0.02))
    r.start()
    try:
        assert c.reads >= 1 and r.snapshot is not None  # the first read is done by start() itself
        wait_for(lambda: c.reads >= 4)
        assert r.running
        assert "vramwatch-counter" in c.read_threads
        threads = [t for t in threading.enumerate() if t.name == "vramwatch-counter"]
        assert threads and all(t.daemon for t in threads), "a hung read never keeps the process alive"
    finally:
        r.stop()
    assert not r.running and c.closed == 1
    n = c.reads
    time.sleep(0.1)
    assert c.reads == n, "no read after stop()"


def test_a_slow_collector_polls_on_the_slow_interval():
    class SlowCounter(Counter):
        cadence = Cadence.SLOW

    r = Runner(SlowCounter(), Settings(nvml_interval=0.01, nvml_slow_interval=30.0))
    assert r.interval == 30.0
    r.start()
    try:
        time.sleep(0.15)
        assert r.collector.reads == 1  # only start()'s read: the next is 30 s away
    finally:
        r.stop()


def test_the_watch_runs_on_its_own_thread_and_owns_up_and_errors():
    w = FakeWatch()
    c = Watched(w)
    r = Runner(c, settings(interval=0.02))
    assert r.health is w.health
    w.health.down()  # e.g. NVML not answering yet: a successful read of the ledger must not hide it
    r.start()
    try:
        wait_for(lambda: w.steps >= 3 and c.reads >= 2)
        assert w.threads == {"vramwatch-watched-watch"}
        assert r.health.up == 0, "a read never turns a watched collector's up back to 1"
    finally:
        r.stop()
    assert w.closed == 1 and c.closed == 1 and not r.running


def test_a_read_failed_is_counted_without_a_line_of_the_frameworks(caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")

    class Partial(Counter):
        def read(self, tick: Tick) -> int:
            raise ReadFailed(7)  # the collector logged what went wrong, once

    r = Runner(Partial(), settings())
    r.poll_once()
    r.poll_once()
    assert (r.snapshot, r.health.up, r.health.errors) == (7, 0, 2) and caplog.records == []


def test_stop_waits_for_a_hung_watch_only_a_bounded_time():
    release = threading.Event()

    class Hung(FakeWatch):
        def step(self) -> float:
            release.wait(30.0)  # a driver that never returns from the wait
            return 0.0

    w = Hung(max_wait=0.05)
    r = Runner(Watched(w), settings(interval=10.0))
    r.start()
    try:
        t0 = time.monotonic()
        r.stop()
        assert time.monotonic() - t0 < 10.0
    finally:
        release.set()


def test_a_failed_read_of_a_watched_collector_still_counts():
    w = FakeWatch()
    r = Runner(Watched(w, fail=True), settings())
    r.poll_once()
    assert (r.snapshot, w.health.up, w.health.errors) == (-5, 0, 1)


def test_the_watch_loop_pauses_as_the_watch_asks():
    w = FakeWatch(pause=0.05)
    r = Runner(Watched(w), settings(interval=10.0))
    r.start()
    time.sleep(0.6)
    threads = [t for t in threading.enumerate() if t.name == "vramwatch-watched-watch"]
    r.stop()
    assert threads and all(t.daemon for t in threads)
    assert 3 <= w.steps <= 30, w.steps  # ~11 at 55 ms a step; without the pause ~120, waiting for ever 1


def test_a_runner_never_started_closes_its_watch_on_stop():
    w = FakeWatch()
    c = Watched(w)
    r = Runner(c, settings())
    r.stop()
    assert w.closed == 1 and c.closed == 1 and not r.running


def test_stop_does_not_close_while_a_read_may_still_run():
    # a read that hangs (a wedged driver) past stop()'s 5 s join: its buffers must stay allocated
    release = threading.Event()
    entered = threading.Event()

    class Hanging(Counter):
        def read(self, tick: Tick) -> int:
            if threading.current_thread().name == "vramwatch-counter":
                entered.set()
                release.wait(30.0)
            return super().read(tick)

    c = Hanging()
    r = Runner(c, settings(interval=0.01))
    r.start()
    try:
        assert entered.wait(5.0)
        r.stop()
        assert c.closed == 0, "closing buffers a read still uses"
        assert r.running
    finally:
        release.set()


def test_the_duration_is_the_reads_own_time():
    r = Runner(Counter(sleep=0.05), settings())
    r.poll_once()
    slow = r.health.duration
    assert 0.05 <= slow < 2.0
    r.collector.sleep = 0.0
    r.poll_once()
    assert r.health.duration < slow, "each read's own time, not a running total"


def test_a_crashing_read_is_logged_once_per_kind_with_the_error(caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")

    class Crashing(Counter):
        name = "crashing"

        def __init__(self) -> None:
            super().__init__()
            self.errors = [OSError("disk"), OSError("again"), KeyError("k"), OSError("third")]

        def read(self, tick: Tick) -> int:
            raise self.errors.pop(0)

    r = Runner(Crashing(), settings())
    for _ in range(4):
        r.poll_once()
    msgs = [rec for rec in caplog.records if "crashing collector failed" in rec.getMessage()]
    assert [m.getMessage() for m in msgs] == [
        "vramwatch: crashing collector failed: OSError('disk')",
        "vramwatch: crashing collector failed: KeyError('k')",
    ]
    assert all(m.levelno == logging.WARNING for m in msgs)
    assert r.health.errors == 4 and r.health.up == 0
    assert r.collect(ctx()) == () and r.health.errors == 4, "nothing read yet: nothing to render, no error more"


def test_failing_families_are_logged_once_and_counted_each_time(caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")

    class BadFamilies(Counter):
        name = "badfam"

        def families(self, snapshot: int, ctx: ScrapeContext) -> Iterable[Metric]:
            raise ValueError(f"bad {snapshot}")

    r = Runner(BadFamilies(), settings())
    r.poll_once()
    assert r.collect(ctx()) == () and r.collect(ctx()) == ()
    assert r.health.errors == 2 and r.health.up == 0
    msgs = [rec.getMessage() for rec in caplog.records if "families failed" in rec.getMessage()]
    assert msgs == ["vramwatch: badfam families failed: ValueError('bad 1')"]


def test_collect_renders_the_latest_snapshot_as_a_tuple():
    r = Runner(Counter(), settings())
    r.poll_once()
    r.poll_once()
    out = r.collect(ctx())
    assert isinstance(out, tuple) and [s.value for m in out for s in m.samples] == [2.0]


def test_health_down_ok_and_failed():
    h = Health()
    assert (h.up, h.errors, h.duration) == (1, 0, 0.0)
    h.down()
    assert (h.up, h.errors) == (0, 0), "down is not an error"
    h.ok()
    h.failed()
    assert (h.up, h.errors) == (0, 1)


def test_a_registered_collector_runs_after_the_builtin_ones_when_enabled(tmp_path):
    @register("extra_test", lambda s: s.nvml_interval == 0.5, "A test collector.")
    class Extra(Counter):
        def __init__(self, settings: Settings) -> None:
            super().__init__()
            self.settings = settings

    try:
        reg = REGISTRY["extra_test"]
        assert Extra.name == reg.name == "extra_test" and reg.doc == "A test collector." and reg.factory is Extra
        s = Settings(simulate=True, spool_dir=str(tmp_path), nvml_interval=0.5)
        runners = enabled_collectors(s)
        assert [r.name for r in runners] == ["processes", "xid", "nvml", "gpm", "nvlink", "extra_test"]
        assert runners[-1].collector.settings is s
        assert "extra_test" not in [
            r.name for r in enabled_collectors(Settings(simulate=True, spool_dir=str(tmp_path)))
        ]
    finally:
        del REGISTRY["extra_test"]


def test_a_builtin_that_cannot_import_its_dependency_is_skipped_with_a_warning(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    real = importlib.import_module

    def fake_import(name: str, *a, **k):
        if name == "vramwatch.server.collectors.gpm":
            raise ImportError("No module named 'somelib'", name="somelib")
        if name == "vramwatch.server.collectors.nvlink":
            raise ImportError("gone", name=name)  # the module itself missing: skipped quietly
        return real(name, *a, **k)

    monkeypatch.setattr(framework.importlib, "import_module", fake_import)
    framework._load_builtin()
    msgs = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].startswith("vramwatch: collector gpm unavailable: ImportError(")
    assert caplog.records[-1].levelno == logging.WARNING


def test_a_read_failed_carries_its_snapshot():
    f = ReadFailed({"partial": 1})
    assert f.snapshot == {"partial": 1} and str(f) == "read failed"


@pytest.mark.parametrize("cadence, expected", [(Cadence.FAST, 0.02), (Cadence.SLOW, 10.0)])
def test_the_interval_follows_the_cadence(cadence, expected):
    class C(Counter):
        pass

    C.cadence = cadence
    assert Runner(C(), settings(interval=0.02, slow=10.0)).interval == expected
