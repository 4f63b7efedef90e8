"""The sampler thread's cadence: a tick every interval, one more as soon as it is woken, none after stop."""

from __future__ import annotations

import itertools
import threading
import time

from vramwatch.rank.sampler import SamplerThread


def _until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _stop(t: SamplerThread) -> None:
    t.interval = 0.5  # stop() joins for at most 2 s (not 2 hours) should the thread not wake
    t.stop()


def test_ticks_at_the_interval_and_at_once_when_woken():
    ticks: list[float] = []
    t = SamplerThread(3600.0, lambda: ticks.append(time.monotonic()))
    t.start()
    try:
        time.sleep(0.05)
        assert ticks == []  # the first regular tick is an hour away
        t.wake()
        _until(lambda: len(ticks) == 1)
        t.wake()
        t.wake()  # two wake-ups before the thread runs: one tick (a wake-up is pending or not)
        _until(lambda: len(ticks) >= 2)
        time.sleep(0.05)
        assert len(ticks) == 2
    finally:
        _stop(t)
    assert t._thread is not None and not t._thread.is_alive(), "stop() woke the thread and it ended"


def test_a_wake_up_during_a_tick_gets_a_tick_of_its_own():
    inside = threading.Event()
    release = threading.Event()
    count = [0]

    def tick():
        count[0] += 1
        if count[0] == 1:
            inside.set()
            release.wait(5)

    t = SamplerThread(3600.0, tick)
    t.start()
    try:
        t.wake()
        assert inside.wait(5)
        t.wake()  # the OOM's publish, arriving while a tick runs
        release.set()
        _until(lambda: count[0] == 2)
    finally:
        _stop(t)


def test_regular_ticks_keep_their_cadence():
    ticks: list[float] = []
    t = SamplerThread(0.05, lambda: ticks.append(time.monotonic()))
    t.start()
    try:
        _until(lambda: len(ticks) >= 6)
    finally:
        t.stop()
    n = len(ticks)
    time.sleep(0.12)
    assert len(ticks) == n, "no tick after stop"
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert min(gaps) > 0.02  # not a burst: one tick per interval
