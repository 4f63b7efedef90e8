"""The demo's story on the simulated GPU, run on a compressed clock: each phase shows what it promises."""

from __future__ import annotations

from vramwatch.rank.allocator import AllocatorSampler
from vramwatch.sim import SimAllocator, SimNode
from vramwatch.sim.scenario import CYCLE, PHASES, RankStory, drive_node, phase

SPS = 10.0


def test_each_phase_shows_what_the_demo_promises():
    sim = SimAllocator(SimNode.default(1), visible="0")
    story = RankStory(sim, fill_gib=60, steps_per_second=SPS)
    sampler = AllocatorSampler(sim, largest_block_interval=0)
    seen: dict[str, dict[str, float]] = {}
    t = 0.0
    while t < CYCLE:  # one full cycle
        story.step(t)
        (dev,) = sampler.read()
        v = dev.values
        assert v["torch_cuda_memory_reserved_bytes"] <= v["torch_cuda_memory_limit_bytes"]
        seen[phase(t)] = v
        t += 1.0 / SPS
    assert set(seen) == {name for _, name in PHASES}
    warm, tune, press = seen["warmup"], seen["finetune"], seen["pressure"]
    assert warm["torch_cuda_memory_allocated_bytes"] >= 59 * 2**30  # memory filled
    assert tune["torch_cuda_memory_inactive_split_bytes"] > 0  # fragments left in split segments
    assert tune["torch_cuda_memory_fragmentation_ratio"] > warm["torch_cuda_memory_fragmentation_ratio"]
    assert press["torch_cuda_memory_alloc_retries_total"] > tune["torch_cuda_memory_alloc_retries_total"]
    assert press["torch_cuda_memory_ooms_total"] == 1  # one caught OOM per cycle
    assert press["torch_cuda_memory_reserved_bytes"] > 0.95 * press["torch_cuda_memory_limit_bytes"]
    rec = seen["recover"]
    assert rec["torch_cuda_memory_ooms_total"] == 1
    assert rec["torch_cuda_memory_reserved_bytes"] < press["torch_cuda_memory_reserved_bytes"]  # cache emptied


def test_the_stalled_gpu_reads_busy_while_its_power_falls():
    node = SimNode.default(2)
    powers = []
    for t in range(0, int(CYCLE)):
        drive_node(node, float(t), stalled_gpus={1})
        if phase(t) == "stall":
            powers.append(node.gpus[1].power_w)
            assert node.gpus[1].utilization == 1.0  # pinned: utilisation alone hides the hang
            assert node.gpus[0].power_w > 400  # the healthy rank's GPU draws power
    assert powers == sorted(powers, reverse=True) and powers[-1] < 0.5 * powers[0]
