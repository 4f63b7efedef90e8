"""Hygiene's decision, unit by unit: which values make a reclaim due, the gap between reclaims, the counts."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vramwatch.rank import hygiene as hygiene_mod
from vramwatch.rank.hygiene import RECLAIMS, Hygiene
from vramwatch.spool import DeviceSample

GIB = float(1 << 30)


def _dev(idx=0, **values):
    return DeviceSample(
        device=idx, uuid=f"GPU-{idx}", values={f"torch_cuda_memory_{k}_bytes": v for k, v in values.items()}
    )


class _Release:
    def __init__(self, fail=None):
        self.calls: list[tuple[int, ...]] = []
        self.fail = fail

    def __call__(self, devices):
        self.calls.append(devices)
        if self.fail is not None:
            raise self.fail


@pytest.fixture
def clock(monkeypatch):
    """A monotonic clock the test moves by hand."""
    now = [1000.0]
    monkeypatch.setattr(hygiene_mod.time, "monotonic", lambda: now[0])
    return now


def _due(threshold, *devices, min_gap=0.0):
    h = Hygiene(threshold, _Release(), min_gap=min_gap)
    h.on_sample(devices)
    return h.pending


def test_nothing_is_pending_before_the_first_sample():
    h = Hygiene(0.8, _Release())
    assert h.pending == ()
    h.on_step()
    assert h.release.calls == [] and h.reclaims == 0


def test_reserved_at_the_threshold_is_not_due_and_just_above_is():
    # reserved exactly threshold x limit: not above it
    assert _due(0.5, _dev(limit=100.0, reserved=50.0, allocated=0.0)) == ()
    assert _due(0.5, _dev(limit=100.0, reserved=50.5, allocated=0.0)) == (0,)


def test_below_the_threshold_is_not_due_however_much_cache_could_go_back():
    # 40% reserved, all of it releasable cache: still below 80%
    assert _due(0.8, _dev(limit=100 * GIB, reserved=40 * GIB, allocated=0.0)) == ()


def test_a_zero_or_missing_limit_is_never_due():
    assert _due(0.5, _dev(limit=0.0, reserved=5 * GIB, allocated=0.0)) == ()
    # no limit read at all: reserved alone says nothing
    assert _due(0.5, _dev(reserved=5 * GIB, allocated=0.0)) == ()


def test_a_one_byte_limit_still_counts():
    assert _due(0.5, _dev(limit=1.0, reserved=1.0, allocated=0.0)) == (0,)


def test_missing_reserved_reads_as_nothing_reserved():
    # a threshold x limit below one byte: a missing reserved must read as 0, not as any positive number
    assert _due(0.001, _dev(limit=100.0, allocated=0.0)) == ()


def test_releasable_exactly_one_percent_of_the_limit_is_due():
    # allocated and inactive split missing: they read as 0, so releasable is reserved (1 of 100 bytes)
    assert _due(0.001, _dev(limit=100.0, reserved=1.0)) == (0,)
    assert _due(0.001, _dev(limit=100.0, reserved=1.0, allocated=0.0, inactive_split=0.0)) == (0,)


def test_inactive_split_blocks_cannot_be_given_back():
    # 90 of 100 GiB reserved, 50 allocated, 39.5 in inactive split blocks: 0.5 GiB releasable, under 1%
    dev = _dev(limit=100 * GIB, reserved=90 * GIB, allocated=50 * GIB, inactive_split=39.5 * GIB)
    assert _due(0.8, dev) == ()
    # with fewer split blocks the same device is due
    dev = _dev(limit=100 * GIB, reserved=90 * GIB, allocated=50 * GIB, inactive_split=30 * GIB)
    assert _due(0.8, dev) == (0,)


def test_a_device_below_the_threshold_does_not_hide_the_next_one():
    low = _dev(0, limit=100 * GIB, reserved=10 * GIB, allocated=0.0)
    high = _dev(1, limit=100 * GIB, reserved=90 * GIB, allocated=10 * GIB)
    assert _due(0.8, low, high) == (1,)


def test_without_a_gap_a_sample_right_after_a_reclaim_may_ask_again(clock):
    h = Hygiene(0.5, _Release())  # the default gap: none
    full = _dev(limit=100.0, reserved=90.0, allocated=0.0)
    h.on_sample([full])
    h.on_step()
    h.on_sample([full])  # same clock reading as the reclaim
    assert h.pending == (0,)


def test_a_sample_within_the_gap_after_a_reclaim_asks_for_nothing(clock):
    h = Hygiene(0.5, _Release(), min_gap=1.0)
    full = _dev(limit=100.0, reserved=90.0, allocated=0.0)
    h.on_sample([full])
    h.on_step()
    clock[0] += 0.5
    extras = h.on_sample([full])
    assert h.pending == ()
    assert extras.device_values == {0: {RECLAIMS: 1.0}}
    clock[0] += 0.6
    h.on_sample([full])
    assert h.pending == (0,)


def test_for_rank_takes_the_threshold_the_release_and_the_interval_as_the_gap():
    release = _Release()
    ctx = SimpleNamespace(
        settings=SimpleNamespace(reclaim_threshold=0.7, interval=5.0), source=SimpleNamespace(release_cache=release)
    )
    h = Hygiene.for_rank(ctx)
    assert (h.threshold, h.release, h.min_gap) == (0.7, release, 5.0)


def test_counts_per_device_over_several_reclaims(clock):
    h = Hygiene(0.5, _Release())
    idle = _dev(0, limit=100.0, reserved=10.0, allocated=0.0)
    full = _dev(1, limit=100.0, reserved=90.0, allocated=0.0)
    for _ in range(3):
        h.on_sample([idle, full])
        h.on_step()
        clock[0] += 10
    assert h.release.calls == [(1,), (1,), (1,)]
    assert h.reclaims == 3
    assert h.on_sample([idle, full]).device_values == {0: {RECLAIMS: 0.0}, 1: {RECLAIMS: 3.0}}


def test_a_failing_release_is_logged_once_and_turns_hygiene_off(clock, caplog):
    h = Hygiene(0.5, _Release(fail=RuntimeError("boom")))
    full = _dev(limit=100.0, reserved=90.0, allocated=0.0)
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        h.on_sample([full])
        h.on_step()
        clock[0] += 10
        h.on_sample([full])
        h.on_step()
    assert h.release.calls == [(0,)]  # never tried again
    assert [r.getMessage() for r in caplog.records] == [
        "vramwatch: empty_cache failed (RuntimeError('boom')); allocator hygiene is off"
    ]
    assert h.reclaims == 0 and h.on_sample([full]).device_values == {0: {RECLAIMS: 0.0}}
