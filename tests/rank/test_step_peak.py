"""The per-window high-water mark: a leak is a rising series in Prometheus; the job's peaks stay its own."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from harness import ROOT, stop_proc, vramwatch_env
from vramwatch.rank.allocator import AllocatorSampler
from vramwatch.sim import SimAllocator, SimNode

GIB, MIB = 1 << 30, 1 << 20
STEP_PEAK = "torch_cuda_memory_step_peak_allocated_bytes"

# A rank: steady 4 GiB, 2 GiB of activations per step, and (rank 0 only) a leak of LEAK bytes per step.
RANK = """
import os, sys, time, vramwatch
leak = int(sys.argv[1])
h = vramwatch.start()
sim = h.sim
sim.init(0)
sim.allocate(4 << 30)
true_peak = 0
t0 = time.monotonic()
while not os.path.exists(sys.argv[2]) and time.monotonic() - t0 < 60:  # until the test is done
    if leak:
        sim.allocate(leak)
    sim.allocate(2 << 30)
    true_peak = max(true_peak, sim.allocated())
    sim.free(2 << 30)
    vramwatch.step()
    time.sleep(0.05)
assert sim.stats(0)["allocated_bytes"]["all"]["peak"] == true_peak  # the job's own peak, untouched
vramwatch.stop()
"""


def _values(sampler, dev=0):
    (d,) = [x for x in sampler.read() if x.device == dev]
    return d.values


def _reset_peaks(sim, dev=0):
    """What torch.cuda.reset_peak_memory_stats() does to the job's own statistics."""
    for stat in sim._dev(dev).stats.values():
        stat.peak = stat.current


@pytest.mark.e2e
def test_a_leak_is_a_rising_series_that_deriv_and_predict_linear_see(exporter, prometheus, tmp_path):
    leak = 32 * MIB
    done = tmp_path / "done"
    exp = exporter(gpus=2).start()
    ranks = []
    for rank, per_step in ((0, leak), (1, 0)):
        env = vramwatch_env(exp.spool, exp.port, simulate=True, serve="external", interval=0.2)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", CUDA_VISIBLE_DEVICES=str(rank), PYTHONPATH=str(ROOT)
        )
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(per_step), str(done)],
                env=env,
                stdout=exp.log,
                stderr=exp.log,
                stdin=subprocess.DEVNULL,
            )
        )
    try:
        prom = prometheus([f"127.0.0.1:{exp.port}"], scrape_interval="500ms", evaluation_interval="500ms")
        prom.wait_for(f"count_over_time({STEP_PEAK}[6s]) >= 10", timeout=30, check=lambda r: len(r) == 2)
        deriv = {r["metric"]["rank"]: float(r["value"][1]) for r in prom.query(f"deriv({STEP_PEAK}[6s])")}
        steps = {
            r["metric"]["rank"]: float(r["value"][1]) for r in prom.query("rate(vramwatch_training_steps_total[6s])")
        }
        expected = leak * steps["0"]  # bytes per second the leak adds
        assert expected > 0
        assert 0.5 * expected < deriv["0"] < 2 * expected, (deriv, steps)
        assert abs(deriv["1"]) < 0.01 * expected, deriv  # no leak: flat
        (ahead,) = prom.query(f'predict_linear({STEP_PEAK}{{rank="0"}}[6s], 60) - {STEP_PEAK}{{rank="0"}}')
        assert float(ahead["value"][1]) > 30 * expected  # a minute ahead: well above today
        (peak,) = prom.query(f'{STEP_PEAK}{{rank="0"}}')
        assert float(peak["value"][1]) > 6 * GIB  # the high-water mark includes the activations
    finally:
        done.touch()
        for p in ranks:
            try:
                p.wait(timeout=30)
            finally:
                stop_proc(p)
    assert [p.returncode for p in ranks] == [0, 0]  # the job's own peak statistics were never reset


def test_window_peak_is_exact_on_a_new_high_and_a_lower_bound_otherwise():
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    sampler = AllocatorSampler(sim, 0)
    sim.allocate(4 * GIB)
    sim.allocate(2 * GIB)
    sim.free(2 * GIB)
    assert _values(sampler)[STEP_PEAK] == 6 * GIB  # first window: the peak so far
    sim.allocate(1 * GIB)
    sim.free(1 * GIB)
    assert _values(sampler)[STEP_PEAK] == 4 * GIB  # below the old high: the current value bounds it
    sim.allocate(3 * GIB)
    sim.free(3 * GIB)
    assert _values(sampler)[STEP_PEAK] == 7 * GIB  # a new high: exact


def test_a_job_resetting_its_peak_every_step_gets_exact_step_peaks():
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    sampler = AllocatorSampler(sim, 0)
    sim.allocate(4 * GIB)
    sim.allocate(3 * GIB)
    sim.free(3 * GIB)
    assert _values(sampler)[STEP_PEAK] == 7 * GIB
    seen = []
    for act in (1, 2, 1):  # every step below the first one's high
        _reset_peaks(sim)  # the job's own per-step reset
        sim.allocate(act * GIB)
        sim.free(act * GIB)
        seen.append(_values(sampler)[STEP_PEAK])
    assert seen == [5 * GIB, 6 * GIB, 5 * GIB]  # the peak since the job's reset, not just "current"


def test_nothing_in_vramwatch_resets_the_jobs_peak_statistics():
    forbidden = {
        "reset_peak_memory_stats",
        "_cuda_resetPeakMemoryStats",
        "reset_max_memory_allocated",
        "reset_max_memory_cached",
        "reset_accumulated_memory_stats",
        "_cuda_resetAccumulatedMemoryStats",
    }
    offenders = []
    for path in pathlib.Path(ROOT, "vramwatch").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Attribute, ast.Name)):
                name = node.attr if isinstance(node, ast.Attribute) else node.id
                if name in forbidden:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert offenders == []
