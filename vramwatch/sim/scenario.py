"""The demo's story, on the simulated GPU: a fine-tuning job running short of memory, then hanging, in two minutes.

One cycle of ``CYCLE`` seconds (``cycle`` compresses it: every time scales), the same clock for every
rank and the node. The ranks' allocators: warm-up fills memory; fine-tuning fragments the cache
(reserved climbs above allocated); pressure near the budget brings cudaMalloc retries and a caught OOM;
then the last rank stalls with utilisation pinned and power falling (the busy-looking hang); then it
recovers (the fragments are given back with the tensors beside them, and the cache emptied), and the
next cycle starts as a restart from a checkpoint would: memory given back and filled again, so every
cycle is the first one again (one OOM per rank and cycle). The node's devices (``EVENTS``): the first
GPU runs hot and throttles its clocks during fine-tuning; an inference server starts on the last GPU
before the pressure and leaves after the stall (a second process on the card has caused such stalls);
the stalled GPU reports an Xid. So every dashboard moves: memory, GPU health (throttling, Xid, foreign
process), fleet.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import vramwatch
from vramwatch.sim.allocator import SimAllocator, SimOutOfMemoryError
from vramwatch.sim.model import SimAdam, SimModel
from vramwatch.sim.state import SimGpu, SimNode

GIB = 1 << 30
CYCLE = 120.0
# one sequence of 2048 tokens per step and rank: with the model below (3.2e9 parameters, 6 FLOPs per parameter
# and token) at ~10 steps/s that is ~3.9e14 FLOP/s, about 40% of an H200's dense BF16 peak (989e12): an MFU
# a good fine-tuning run reaches
SAMPLES_PER_STEP = 1
TOKENS_PER_STEP = SAMPLES_PER_STEP * 2048
BUDGET_FRACTION = 0.5  # of the simulated card: 60 GiB held leaves room for fragmentation, not for much more
PHASES = ((0.0, "warmup"), (20.0, "finetune"), (70.0, "pressure"), (80.0, "stall"), (95.0, "recover"))
# device events of one cycle: name -> (start, end) in seconds of the CYCLE-long story (an Xid is one instant)
EVENTS = {
    "thermal throttling on the first GPU": (35.0, 55.0),
    "a foreign process on the last GPU": (60.0, 95.0),
    "an Xid on the stalled GPU": (82.0, 82.0),
}
THERMAL, FOREIGN, XID_AT = EVENTS.values()
# graphics engine exception, action restart_app: a pre-initialised Xid whose warning says "restart the application"
XID = 13
FOREIGN_PID = 4242  # the inference server's pid
FOREIGN_BYTES = 12 * GIB
HOT_C = 88.0
SW_POWER_CAP, SW_THERMAL, HW_THERMAL = 0x4, 0x20, 0x40  # NVML clocks-event reason bits


def _story_time(t: float, cycle: float) -> float:
    """Seconds into the CYCLE-long story at time ``t`` of a ``cycle``-long one."""
    return (t % cycle) * CYCLE / cycle


def phase(t: float, cycle: float = CYCLE) -> str:
    t = _story_time(t, cycle)
    name = PHASES[0][1]
    for start, n in PHASES:
        if t >= start:
            name = n
    return name


def _within(t: float, span: tuple[float, float], cycle: float) -> bool:
    return span[0] <= _story_time(t, cycle) < span[1]


def _crossed(prev: float | None, t: float, at: float, cycle: float) -> bool:
    """Whether story time ``at`` of some cycle lies in (prev, t]."""
    if prev is None or t <= prev:
        return False
    when = at * cycle / CYCLE
    first = math.floor((prev - when) / cycle) + 1  # the first cycle whose event is after prev
    return first * cycle + when <= t


def drive_node(
    node: SimNode, t: float, stalled_gpus: set[int], prev_t: float | None = None, cycle: float = CYCLE
) -> None:
    """Device readings for time ``t``: busy GPUs draw power; a stalled one reads 100% at low power.

    ``prev_t``, the time of the call before, places the one-off events (the Xid) once per cycle.
    """
    p = phase(t, cycle)
    hot = _within(t, THERMAL, cycle)
    for g in node.gpus:
        wobble = 0.03 * math.sin(t / 3.0 + g.index)
        if g.index in stalled_gpus and p == "stall":
            g.utilization, g.power_w, g.sm_clock_mhz = 1.0, max(95.0, g.power_w * 0.85), 1980.0
        else:
            g.utilization = min(1.0, 0.93 + wobble)
            g.power_w = 540.0 + 60.0 * wobble
            g.sm_clock_mhz = 1980.0
        g.memory_utilization = 0.6 * g.utilization
        _gpm(g, stalled=g.index in stalled_gpus and p == "stall")
        g.temperature_c = min(78.0, g.temperature_c + 0.2) if g.utilization > 0.5 else max(35.0, g.temperature_c - 0.5)
        g.energy_mj += g.power_w * 1000.0  # one second of draw
        g.throttle_mask = SW_POWER_CAP if g.power_w > 590 else 0
        if g.index == 0 and hot:  # the card runs hot: the driver holds its clocks down
            middle = _within(t, ((THERMAL[0] * 2 + THERMAL[1]) / 3, (THERMAL[0] + THERMAL[1] * 2) / 3), cycle)
            g.temperature_c = HOT_C + (3.0 if middle else 0.0)
            g.throttle_mask = SW_THERMAL | (HW_THERMAL if middle else 0)
            g.sm_clock_mhz = 1200.0 if middle else 1500.0
            g.power_w *= 0.8
    last = node.gpus[-1].index
    node.foreign = [f for f in node.foreign if f.get("pid") != FOREIGN_PID]  # others' processes stay
    if _within(t, FOREIGN, cycle):
        node.add_foreign(last, pid=FOREIGN_PID, used_bytes=FOREIGN_BYTES)
    if _crossed(prev_t, t, XID_AT[0], cycle):
        for i in sorted(stalled_gpus) or [last]:
            node.inject_xid(i, XID)


def _gpm(g: SimGpu, stalled: bool) -> None:
    """GPM's view of the same work: a bf16 fine-tuning step keeps the SMs busy and the tensor cores at about
    the MFU (40%), reads HBM hard and all-reduces over NVLink; a hung collective spins on a few SMs with
    no tensor work or traffic, which is how GPM tells the hang from work while utilisation reads 100%."""
    if stalled:
        g.sm_activity, g.sm_occupancy, g.tensor_activity, g.dram_bandwidth_utilization = 0.04, 0.02, 0.0, 0.01
        g.nvlink_rx_bytes_per_second = g.nvlink_tx_bytes_per_second = 0.0
        g.pcie_rx_bytes_per_second = g.pcie_tx_bytes_per_second = 0.0
        return
    busy = g.utilization * g.sm_clock_mhz / 1980.0  # throttled clocks do less
    g.sm_activity, g.sm_occupancy = 0.85 * busy, 0.45 * busy
    g.tensor_activity, g.dram_bandwidth_utilization = 0.42 * busy, 0.55 * busy
    g.nvlink_rx_bytes_per_second = g.nvlink_tx_bytes_per_second = 60e9 * busy  # the gradients' all-reduce
    g.pcie_rx_bytes_per_second, g.pcie_tx_bytes_per_second = 1.5e9 * busy, 0.2e9 * busy  # batches in, logs out


class RankStory:
    """One rank's allocator through the cycle; ``step(t)`` is one training step at scenario time t."""

    def __init__(self, sim: SimAllocator, fill_gib: float, steps_per_second: float, cycle: float = CYCLE) -> None:
        self.sim = sim
        sim.init(0)
        sim.set_memory_fraction(BUDGET_FRACTION)  # a capped job, as on a shared card
        self.limit = sim.limit_bytes(0)
        self.fill = int(fill_gib * GIB)
        self.cycle = cycle
        warmup = PHASES[1][0] * cycle / CYCLE
        self.chunk = max(1, int(fill_gib * GIB / (warmup * steps_per_second)))  # filled over the warm-up
        self.held = 0
        self.steps = 0
        self._oom_cycle = -1
        self._cycle = 0  # the cycle of the last step
        self._coalesced = -1  # the cycle whose recovery gave the fragments back

    def step(self, t: float) -> None:
        sim, p, cycle = self.sim, phase(t, self.cycle), self.cycle
        n = int(t // cycle)
        if n != self._cycle:  # a new cycle: restarted from its checkpoint, the job refills in the warm-up
            self._cycle = n
            sim.free(sim.allocated())
            sim.coalesce()
            sim.empty_cache()
            self.held = 0
        if p == "warmup" and self.held < self.fill:
            sim.allocate(self.chunk)
            self.held += self.chunk
        try:
            sim.allocate(int(0.5 * GIB))  # activations
            if p == "pressure":
                # variable-length sequences near the budget: a longer one finds no cached block that
                # fits, and cudaMalloc succeeds only after the cache is flushed (a retry) ...
                sim.allocate(int(self.limit * (0.06 + 0.02 * (self.steps % 3))))
                if self._oom_cycle != int(t // cycle):
                    self._oom_cycle = int(t // cycle)
                    sim.allocate(int(self.limit * 0.2))  # ... and once a cycle one that cannot fit at all
        except SimOutOfMemoryError:
            pass  # the job catches it and retries the step, as training loops that survive OOMs do
        sim.free(sim.allocated() - self.held)
        if p == "finetune" and self.steps % 10 == 0:
            sim.fragment(int(0.05 * GIB))  # scattered pieces left in split segments
            sim.allocate(int(0.05 * GIB))  # ... and the allocator grows the cache for the next request
            self.held = sim.allocated()
        if p == "recover" and self._coalesced != n:  # the tensors beside the fragments are freed: they merge
            self._coalesced = n
            sim.coalesce()
            sim.empty_cache()
        if p == "recover" and self.steps % 50 == 0:
            sim.empty_cache()
        self.steps += 1


def run_rank(
    t0: float,
    duration: float,
    stall_me: bool,
    fill_gib: float,
    steps_per_second: float,
    parent: int = 0,
    cycle: float = CYCLE,
) -> None:
    h = vramwatch.start(simulate=True)
    assert h.sim is not None
    story = RankStory(h.sim, fill_gib, steps_per_second, cycle)
    # a bf16 model with Adam: parameters and gradients a tenth of the fill each, the moments 4/10
    model = SimModel(int(fill_gib * GIB / 10))
    optimizer = SimAdam(model)
    vramwatch.watch(model, optimizer, flops_per_token=6.0 * model.param_count)
    period = 1.0 / steps_per_second
    end = time.time() + duration if duration > 0 else float("inf")
    while time.time() < end:
        if parent and os.getppid() != parent:
            break  # the demo that started us is gone: so are we
        t = time.time() - t0
        if phase(t, cycle) == "stall" and stall_me:
            time.sleep(0.2)  # no steps: the heartbeat ages
            continue
        story.step(t)
        vramwatch.step(
            loss=0.7 + 1.5 * math.exp(-story.steps / 500.0), tokens=TOKENS_PER_STEP, samples=SAMPLES_PER_STEP
        )
        time.sleep(period)
    vramwatch.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vramwatch-sim-scenario")
    ap.add_argument("--t0", type=float, required=True)
    ap.add_argument("--duration", type=float, default=0.0)
    ap.add_argument("--stall", action="store_true")
    ap.add_argument("--fill-gib", type=float, default=60.0)
    ap.add_argument("--steps-per-second", type=float, default=10.0)
    ap.add_argument("--parent", type=int, default=0, help="exit when this process is no longer our parent")
    ap.add_argument("--cycle", type=float, default=CYCLE, help="seconds of one story cycle")
    a = ap.parse_args(argv)
    try:
        run_rank(a.t0, a.duration, a.stall, a.fill_gib, a.steps_per_second, a.parent, a.cycle)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: leave quietly
        vramwatch.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
