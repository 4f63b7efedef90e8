"""What one sample costs the rank's sampler thread, part by part (the simulated GPU; no GPU needed).

    python3 benchmarks/rank_tick.py [--calls 2000] [--sweep-mb 16] [--out rank_tick.json]

The in-process direct cost (design.md guarantee 1) is the CPU of vramwatch's threads in the training
process over wall time. On a GPU node nearly all of it is the sampler thread's tick, once per interval (2 s), on
a core that idles in between: cold caches. This script drives the same code a running rank does
(``Handle.tick`` with the simulated allocator: one device, ``watch()`` on a model of CPU tensors walked
as if they were a device's, ``step(loss=, tokens=)`` between samples) and times each part of a sample
with the sampler's own clock (``time.thread_time``), two ways:

- ``hot``: the calls back to back (the code and data in cache: a lower bound);
- ``swept``: before each call, ``--sweep-mb`` of memory is read through and some unrelated Python runs, so
  the call starts with its data and code evicted, as after a second of idle or of the job's own work.

What the simulator does not reproduce: torch's ``_cuda_memoryStats`` (C++, builds the nested dict, about
11 us warm on an H200 host) is replaced by the simulator's Python-built dict of the same shape (timed
as ``stats_call``, reported apart so a reader can swap in the GPU figure), and the loss read's CUDA
calls (a host number here). Each part is timed alone and inside the whole tick; the parts overlap
(``sample_build`` contains ``allocator_read``), so only ``tick`` is a total.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sweeper(mb: int) -> Callable[[], None]:
    buf = bytearray(mb << 20)
    junk = [{"k": i, "v": str(i)} for i in range(20000)]

    def sweep() -> None:
        # touch every cache line of the buffer (a slice copy reads it all), then unrelated dict/str work
        bytes(buf)
        sum(len(d["v"]) for d in junk[::7])

    return sweep


def _time(fn: Callable[[], Any], calls: int, before: Callable[[], None] | None) -> dict[str, float]:
    clock = time.thread_time
    xs = []
    for _ in range(calls):
        if before is not None:
            before()
        t0 = clock()
        fn()
        xs.append(clock() - t0)
    xs.sort()
    return {
        "median_us": statistics.median(xs) * 1e6,
        "p10_us": xs[len(xs) // 10] * 1e6,
        "p90_us": xs[len(xs) * 9 // 10] * 1e6,
    }


def _clock_overhead(calls: int) -> float:
    clock = time.thread_time
    xs = []
    for _ in range(calls):
        t0 = clock()
        xs.append(clock() - t0)
    return statistics.median(xs) * 1e6


def setup(params: int = 150) -> tuple[Any, dict[str, Callable[[], Any]]]:
    import torch

    import vramwatch
    from vramwatch.rank.roles import RoleWalker
    from vramwatch.spool.codec import encode_sample
    from vramwatch.spool.files import frame

    spool = tempfile.mkdtemp(prefix="vw-tick-")
    h = vramwatch.start(simulate=True, serve="external", spool_dir=spool, interval=3600.0, port=1)
    h.sim.init(0)
    h.sim.allocate(3 << 30)
    h.sim.free(1 << 30)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(64)) for _ in range(params)])
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros(64)
    opt.step()
    vramwatch.watch(model, opt, flops_per_token=6.0 * params * 64)
    s = h.settings
    # the model's CPU tensors counted as a device's, so the walk reads every storage as on a GPU
    h._assembler.roles = RoleWalker(model, opt, s.role_interval, s.role_max_tensors, device_types=("cpu",))
    loss = 1.25  # on a GPU the loss is a CUDA tensor read every 5 s (device_scalar); a sample in between costs
    # about what a host number's does
    for _ in range(3):
        vramwatch.step(loss=loss, tokens=256)
        h.tick()
    asm = h._assembler
    pub = h._publisher
    sample = asm.assemble()
    payload = encode_sample(sample)
    record = frame(payload)
    fd = pub._fd
    import os

    def walk() -> None:
        w = RoleWalker(model, opt, s.role_interval, s.role_max_tensors, device_types=("cpu",))
        w.poll(0.0)
        while w._walk is not None:
            w.poll(0.0)

    parts: dict[str, Callable[[], Any]] = {
        "tick": h.tick,
        "sample_build": asm.assemble,
        "allocator_read": h.sampler.read,
        "stats_call": lambda: h.source.stats(0),
        "heartbeat_snapshot": h.heartbeat.snapshot,
        "plugins_on_sample": lambda: asm.plugins.on_sample(sample.devices),
        "roles_poll_idle": lambda: asm.roles.poll(time.monotonic()),  # type: ignore[union-attr]
        "roles_apply": lambda: asm.roles.apply(sample.devices),  # type: ignore[union-attr]
        "encode": lambda: encode_sample(sample),
        "frame_crc": lambda: frame(payload),
        "fstat": lambda: os.fstat(fd),
        "pwrite": lambda: os.pwrite(fd, record, 0),
        "publish": lambda: pub.publish(sample),
        "spawner_ensure": h._spawner.ensure,
        "roles_walk_whole": walk,
    }
    info = {"params": params, "payload_bytes": len(payload), "role_interval_s": s.role_interval}
    return (h, info), parts


def main() -> int:
    from vramwatch.config import Settings

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--sweep-mb", type=int, default=16)
    ap.add_argument("--parts", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    (h, info), parts = setup()
    wanted = [p for p in a.parts.split(",") if p] or list(parts)
    sweep = _sweeper(a.sweep_mb)
    gc.disable()  # a collection inside one timed call would land on a random part
    res: dict[str, Any] = {"info": info, "clock_overhead_us": _clock_overhead(a.calls), "hot": {}, "swept": {}}
    for name in wanted:
        fn = parts[name]
        n = a.calls if name != "roles_walk_whole" else max(20, a.calls // 20)
        res["hot"][name] = _time(fn, n, None)
        res["swept"][name] = _time(fn, max(50, n // 4), sweep)
    gc.enable()
    import vramwatch

    vramwatch.stop()
    w = res["swept"].get("roles_walk_whole")
    if w:
        res["roles_walk_share_of_core"] = w["median_us"] * 1e-6 / info["role_interval_s"]
    t = res["swept"].get("tick")
    if t:  # what the guarantee counts: a cold tick once per interval at defaults (this run ticks by hand)
        res["default_interval_s"] = Settings().interval
        res["tick_share_of_core_at_defaults"] = t["median_us"] * 1e-6 / Settings().interval
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    del h
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
