"""The demo's story on the simulated GPU, run on a compressed clock: each phase shows what it promises."""

from __future__ import annotations

import os

from vramwatch.rank.allocator import AllocatorSampler
from vramwatch.sim import SimAllocator, SimNode
from vramwatch.sim.scenario import (
    CYCLE,
    FOREIGN,
    FOREIGN_BYTES,
    FOREIGN_PID,
    HW_THERMAL,
    PHASES,
    SW_THERMAL,
    THERMAL,
    XID,
    XID_AT,
    RankStory,
    drive_node,
    phase,
)

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


def _run_node(node, cycle, seconds, stalled, dt=1.0):
    """Drive ``node`` as the demo does (once per dt); returns what each call left, by story time."""
    seen, prev, t = [], None, 0.0
    while t < seconds:
        drive_node(node, t, stalled, prev, cycle)
        g0 = node.gpus[0]
        seen.append((t, g0.throttle_mask, g0.temperature_c, [dict(f) for f in node.foreign], len(node.xids)))
        prev, t = t, t + dt
    return seen


def test_the_devices_throttle_host_a_foreign_process_and_report_an_xid_at_their_times():
    for cycle, dt in ((CYCLE, 1.0), (12.0, 0.25)):  # the demo's own clock and a compressed one
        node = SimNode.default(2)
        node.add_foreign(0, pid=777, used_bytes=1 << 30)  # someone else's: the story leaves it alone
        seen = _run_node(node, cycle, 2 * cycle, stalled={1}, dt=dt)
        scale = cycle / CYCLE
        for t, mask, temp, foreign, _ in seen:
            story = (t % cycle) / scale
            hot = THERMAL[0] <= story < THERMAL[1]
            assert bool(mask & SW_THERMAL) == hot, (cycle, t)
            assert (temp >= 85) == hot, (cycle, t)
            ours = [f for f in foreign if f["pid"] == FOREIGN_PID]
            inside = FOREIGN[0] <= story < FOREIGN[1]
            assert ours == ([{"gpu": 1, "pid": FOREIGN_PID, "used_bytes": FOREIGN_BYTES}] if inside else []), t
            assert {"gpu": 0, "pid": 777, "used_bytes": 1 << 30} in foreign
        assert any(mask & HW_THERMAL for _, mask, *_ in seen)  # at the height of it, hardware slowdown too
        # one Xid per cycle, on the stalled GPU, during the stall
        assert [(x["gpu"], x["xid"]) for x in node.xids] == [(1, XID), (1, XID)]
        first = next(t for t, *_, n in seen if n)
        assert phase(first, cycle) == "stall" and abs(first - XID_AT[0] * scale) <= dt


def test_a_short_demo_shows_an_xid_a_foreign_process_and_throttling(tmp_path):
    """`vramwatch demo` on a compressed story: the exposition shows each event while it lasts."""
    import re
    import signal
    import subprocess
    import sys
    import time

    from harness import free_port, http_get

    port, cycle = free_port(), 16.0
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "vramwatch", "demo", "--real", "no", "--ranks", "2", "--duration", "90",
            "--cycle", str(cycle), "--port", str(port), "--spool-dir", str(tmp_path / "s"),
            "--nvml-slow-interval", "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")},
    )  # fmt: skip
    wanted = {
        "xid": re.compile(rf'^gpu_xid_errors_total{{[^}}]*xid="{XID}"[^}}]*}} [1-9]', re.M),
        "foreign": re.compile(r"^gpu_foreign_processes{[^}]*} [1-9]", re.M),
        "throttle": re.compile(r'^gpu_clock_throttle{[^}]*reason="sw_thermal_slowdown"[^}]*} 1', re.M),
    }
    seen: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 80  # the server starts, then 2 cycles of the story at most
        while time.monotonic() < deadline and len(seen) < len(wanted):
            try:
                code, body = http_get(f"http://127.0.0.1:{port}/metrics", 2)
            except OSError:
                code, body = 0, b""
            text = body.decode() if code == 200 else ""
            for name, rx in wanted.items():
                if name not in seen and rx.search(text):
                    seen[name] = time.monotonic()
            time.sleep(0.25)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert set(seen) == set(wanted), (seen, out[-3000:])
    assert proc.returncode == 0, out
    assert "a foreign process on the last GPU at 8s" in out  # the demo says when, on its clock
