"""Opt-in allocator hygiene: reclaim between steps above the threshold, counted, off by default."""

from __future__ import annotations

import threading
import time

import vramwatch
from harness import wait_until
from vramwatch.rank.hygiene import RECLAIMS, Hygiene
from vramwatch.spool import DeviceSample, read_samples

GIB = 1 << 30


def _values(h):
    (s,) = read_samples(h.spool_dir, 64)
    (d,) = s.devices
    return d.values


def _fill_cache(sim, limit_fraction, keep_gib, cached_gib):
    """Reserve keep + cached GiB of a small budget, then free the cached part (it stays reserved)."""
    sim.init(0)
    sim.set_memory_fraction(limit_fraction)
    sim.allocate(keep_gib * GIB)
    sim.allocate(cached_gib * GIB)
    sim.free(cached_gib * GIB)


def test_reclaims_between_steps_above_the_threshold_and_counts_them(start_rank, exporter):
    exp = exporter().start()
    h = start_rank(reclaim_threshold=0.8, spool_dir=exp.spool, port=exp.port)
    sim = h.sim
    limit = 16 * GIB
    _fill_cache(sim, limit / sim._dev(0).total, keep_gib=4, cached_gib=10)  # reserved 14 of 16 GiB: 87%
    reserved_before = sim.reserved()
    assert reserved_before > 0.8 * limit
    wait_until(lambda: h.hygiene.pending == (0,), 5, "the sampler to mark the device")
    assert sim.reserved() == reserved_before  # nothing happens off the step path
    vramwatch.step()
    assert sim.reserved() < 0.8 * limit and sim.allocated() == 4 * GIB  # the cache went back, tensors stayed
    assert h.hygiene.pending == ()
    vramwatch.step()  # nothing due any more
    wait_until(lambda: _values(h).get(RECLAIMS) == 1.0, 5, "one reclaim in the sample")

    def scraped():
        return [v for lab, v in exp.metrics().get("torch_cuda_memory_cache_reclaims_total", []) if lab["device"] == "0"]

    wait_until(lambda: scraped() == [1.0], 10, "the reclaim counter in a scrape")
    time.sleep(0.3)
    vramwatch.step()
    assert h.hygiene.reclaims == 1  # below the threshold now: no second reclaim


def test_no_reclaim_when_the_cache_holds_little_to_give_back(start_rank):
    h = start_rank(reclaim_threshold=0.5)
    sim = h.sim
    _fill_cache(sim, 16 * GIB / sim._dev(0).total, keep_gib=12, cached_gib=0)  # tensors, not cache, fill it
    wait_until(lambda: _values(h).get(RECLAIMS) == 0.0, 5, "the counter, at 0 from the start")
    for _ in range(5):
        vramwatch.step()
        time.sleep(0.06)
    assert h.hygiene.reclaims == 0 and h.hygiene.pending == ()


def test_off_by_default(start_rank):
    h = start_rank()
    sim = h.sim
    _fill_cache(sim, 16 * GIB / sim._dev(0).total, keep_gib=4, cached_gib=10)
    reserved = sim.reserved()
    time.sleep(0.2)
    vramwatch.step()
    assert h.hygiene is None and sim.reserved() == reserved
    assert RECLAIMS not in _values(h)  # absent, as the contract says, when hygiene is off


def test_step_never_reads_allocator_stats(start_rank):
    h = start_rank(reclaim_threshold=0.8)
    sim = h.sim
    _fill_cache(sim, 16 * GIB / sim._dev(0).total, keep_gib=4, cached_gib=10)
    callers = []
    real = sim.stats

    def recording(dev):
        callers.append(threading.current_thread())
        return real(dev)

    sim.stats = recording
    main = threading.current_thread()
    wait_until(lambda: h.hygiene.pending, 5, "a reclaim to be due")
    n_before = sum(t is main for t in callers)
    for _ in range(100):
        vramwatch.step()
    assert sum(t is main for t in callers) == n_before == 0
    assert h.hygiene.reclaims == 1


def test_a_failing_empty_cache_turns_hygiene_off_without_raising():
    calls = []

    def broken(devices):
        calls.append(devices)
        raise RuntimeError("CUDA error: an illegal memory access")

    hy = Hygiene(0.5, broken)
    values = {
        "torch_cuda_memory_limit_bytes": 10.0 * GIB,
        "torch_cuda_memory_reserved_bytes": 8.0 * GIB,
        "torch_cuda_memory_allocated_bytes": 1.0 * GIB,
    }
    dev = DeviceSample(0, "GPU-0", values)
    hy.on_sample([dev])
    hy.on_step()
    hy.on_sample([dev])
    hy.on_step()
    assert calls == [(0,)] and hy.reclaims == 0 and hy.counts[0] == 0.0
