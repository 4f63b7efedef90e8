"""The sampler thread's schedule under a clock the test moves: ticks keep their grid however long each
takes, a wedged tick is not followed by a burst, a regular tick that fell due during a woken one runs at
once; and the thread itself (a daemon, by name; stop() before start())."""

from __future__ import annotations

import itertools
import threading
import time
import types

import pytest

from vramwatch.rank import sampler
from vramwatch.rank.sampler import SamplerThread


class Clock:
    """Real time plus an offset: a tick "takes" ``cost`` seconds without sleeping them; ``jump`` moves the
    clock on right after its next read (time passing between two reads of the sampler)."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.jump = 0.0

    def __call__(self) -> float:
        v = time.monotonic() + self.offset
        if self.jump:
            self.offset += self.jump
            self.jump = 0.0
        return v


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(sampler, "time", types.SimpleNamespace(monotonic=c))
    return c


def _until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _stop(t: SamplerThread) -> None:
    t.interval = 0.5  # stop() joins for at most 2 s should the thread not wake
    t.stop()


def test_ticks_keep_the_grid_of_the_interval_whatever_each_one_costs(clock):
    starts: list[float] = []

    def tick() -> None:
        starts.append(clock())
        clock.offset += 0.15  # three quarters of the interval

    t = SamplerThread(0.2, tick)
    t.start()
    try:
        _until(lambda: len(starts) >= 4)
    finally:
        _stop(t)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(0.15 < g < 0.3 for g in gaps), gaps  # 0.2 apart, not 0.2 after the last one ended (0.35)


def test_a_wedged_tick_is_followed_by_one_tick_an_interval_later_not_a_burst(clock):
    starts: list[float] = []
    ends: list[float] = []

    def tick() -> None:
        starts.append(clock())
        if len(starts) == 1:
            clock.offset += 0.35  # wedged for three and a half intervals
        ends.append(clock())

    t = SamplerThread(0.1, tick)
    t.start()
    try:
        _until(lambda: len(starts) >= 3)
    finally:
        _stop(t)
    assert starts[1] - ends[0] > 0.07, "the missed ticks are not caught up"
    assert 0.07 < starts[2] - starts[1] < 0.2


def test_a_regular_tick_due_during_a_woken_one_runs_at_once(clock):
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(time.monotonic())
        if len(ticks) == 1:
            clock.jump = 1.0  # the interval ends between the sampler's two reads of the clock

    t = SamplerThread(1.0, tick)
    t.wake()  # an OOM's wake-up before the first interval ends
    t.start()
    try:
        _until(lambda: len(ticks) >= 2, timeout=0.9)
    finally:
        _stop(t)


def test_the_thread_is_a_named_daemon_and_stop_before_start_is_harmless():
    t = SamplerThread(3600.0, lambda: None)
    t.stop()  # a start() that failed before the thread began still stops
    t = SamplerThread(3600.0, lambda: None)
    before = set(threading.enumerate())
    t.start()
    try:
        (th,) = set(threading.enumerate()) - before
        assert th.name == "vramwatch-sampler", "as thread dumps (py-spy) show it"
        assert th.daemon, "never keeps a job that forgot stop() alive"
    finally:
        _stop(t)
    assert not th.is_alive()


def test_stop_waits_for_a_wedged_tick_two_intervals_and_no_longer():
    release = threading.Event()
    inside = threading.Event()

    def tick() -> None:
        inside.set()
        release.wait(10)  # a tick stuck (a hung NVML or file system call)

    t = SamplerThread(1.5, tick)
    t.start()
    try:
        t.wake()
        assert inside.wait(5)
        t0 = time.monotonic()
        t.stop()  # joins max(2 s, 2 intervals) = 3 s, then returns: the job's exit is never held longer
        took = time.monotonic() - t0
    finally:
        release.set()
    assert 2.9 <= took < 4.4, took
