"""The demo's story, on the simulated GPU: a fine-tuning job running short of memory, then hanging, in two minutes.

One cycle of ``CYCLE`` seconds, the same clock for every rank and the node:
warm-up fills memory; fine-tuning fragments the cache (reserved climbs above
allocated); pressure near the budget brings cudaMalloc retries and a caught
OOM; then the last rank stalls with utilisation pinned and power falling (the
busy-looking hang); then it recovers.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import vramwatch
from vramwatch.sim.allocator import SimAllocator, SimOutOfMemoryError
from vramwatch.sim.state import SimNode

GIB = 1 << 30
CYCLE = 120.0
BUDGET_FRACTION = 0.5  # of the simulated card: 60 GiB held leaves room for fragmentation, not for much more
PHASES = ((0.0, "warmup"), (20.0, "finetune"), (70.0, "pressure"), (80.0, "stall"), (95.0, "recover"))


def phase(t: float) -> str:
    t = t % CYCLE
    name = PHASES[0][1]
    for start, n in PHASES:
        if t >= start:
            name = n
    return name


def drive_node(node: SimNode, t: float, stalled_gpus: set[int]) -> None:
    """Device readings for time ``t``: busy GPUs draw power; a stalled one reads 100% at low power."""
    p = phase(t)
    for g in node.gpus:
        wobble = 0.03 * math.sin(t / 3.0 + g.index)
        if g.index in stalled_gpus and p == "stall":
            g.utilization, g.power_w, g.sm_clock_mhz = 1.0, max(95.0, g.power_w * 0.85), 1980.0
        else:
            g.utilization = min(1.0, 0.93 + wobble)
            g.power_w = 540.0 + 60.0 * wobble
        g.memory_utilization = 0.6 * g.utilization
        g.temperature_c = min(78.0, g.temperature_c + 0.2) if g.utilization > 0.5 else max(35.0, g.temperature_c - 0.5)
        g.energy_mj += g.power_w * 1000.0  # one second of draw
        g.throttle_mask = 0x4 if g.power_w > 590 else 0


class RankStory:
    """One rank's allocator through the cycle; ``step(t)`` is one training step at scenario time t."""

    def __init__(self, sim: SimAllocator, fill_gib: float, steps_per_second: float) -> None:
        self.sim = sim
        sim.init(0)
        sim.set_memory_fraction(BUDGET_FRACTION)  # a capped job, as on a shared card
        self.limit = sim.limit_bytes(0)
        self.fill = int(fill_gib * GIB)
        self.chunk = int(fill_gib * GIB / (20 * steps_per_second))  # filled over the 20 s warm-up
        self.held = 0
        self.steps = 0
        self._oom_cycle = -1

    def step(self, t: float) -> None:
        sim, p = self.sim, phase(t)
        if p == "warmup" and self.held < self.fill:
            sim.allocate(self.chunk)
            self.held += self.chunk
        try:
            sim.allocate(int(0.5 * GIB))  # activations
            if p == "pressure":
                # variable-length sequences near the budget: a longer one finds no cached block that
                # fits, and cudaMalloc succeeds only after the cache is flushed (a retry) ...
                sim.allocate(int(self.limit * (0.06 + 0.02 * (self.steps % 3))))
                if self._oom_cycle != int(t // CYCLE):
                    self._oom_cycle = int(t // CYCLE)
                    sim.allocate(int(self.limit * 0.2))  # ... and once a cycle one that cannot fit at all
        except SimOutOfMemoryError:
            pass  # the job catches it and retries the step, as training loops that survive OOMs do
        sim.free(sim.allocated() - self.held)
        if p == "finetune" and self.steps % 10 == 0:
            sim.fragment(int(0.05 * GIB))  # scattered pieces left in split segments
            sim.allocate(int(0.05 * GIB))  # ... and the allocator grows the cache for the next request
            self.held = sim.allocated()
        if p == "recover" and self.steps % 50 == 0:
            sim.empty_cache()
        self.steps += 1


def run_rank(
    t0: float, duration: float, stall_me: bool, fill_gib: float, steps_per_second: float, parent: int = 0
) -> None:
    h = vramwatch.start(simulate=True)
    assert h.sim is not None
    story = RankStory(h.sim, fill_gib, steps_per_second)
    period = 1.0 / steps_per_second
    end = time.time() + duration if duration > 0 else float("inf")
    while time.time() < end:
        if parent and os.getppid() != parent:
            break  # the demo that started us is gone: so are we
        t = time.time() - t0
        if phase(t) == "stall" and stall_me:
            time.sleep(0.2)  # no steps: the heartbeat ages
            continue
        story.step(t)
        vramwatch.step(loss=0.7 + 1.5 * math.exp(-story.steps / 500.0))
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
    a = ap.parse_args(argv)
    try:
        run_rank(a.t0, a.duration, a.stall, a.fill_gib, a.steps_per_second, a.parent)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: leave quietly
        vramwatch.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
