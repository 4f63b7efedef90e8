"""Collective progress on a real backend: does the sequence number advance, and what does a sample's read cost?

    python benchmarks/collectives_gpu.py                 # NCCL on cuda:0 (world size 1), else gloo
    python benchmarks/collectives_gpu.py --backend gloo  # the CPU backend CI runs

One process, world size 1 (machines with several GPUs are not needed). It issues ``--collectives``
all-reduces (and a barrier) and checks that ``vramwatch_collectives_total``'s source
(:class:`vramwatch.rank.collectives.CollectiveProgress`) advanced by exactly that many; then it times the
read as the sampler thread does it, in this thread's CPU time (what it costs the job's process), and the
whole training-state read of a sample (:class:`vramwatch.rank.training.TrainingReader`: the sequence
number, the waits, the phase). Prints one JSON object; exits 1 if the count did not advance as it should.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu_us(fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Per-call CPU microseconds of this thread, in 20 batches of n // 20 (medians are what we report)."""
    out = []
    per = max(1, n // 20)
    for _ in range(20):
        t0 = time.thread_time_ns()
        for _ in range(per):
            fn()
        out.append((time.thread_time_ns() - t0) / per / 1e3)
    return out


def main() -> int:
    import torch
    import torch.distributed as dist

    from vramwatch.rank.collectives import CollectiveProgress
    from vramwatch.rank.heartbeat import Heartbeat
    from vramwatch.rank.training import TrainingReader

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--collectives", type=int, default=100)
    p.add_argument("--reads", type=int, default=20000)
    args = p.parse_args()

    store = tempfile.mktemp(prefix="vramwatch-collectives-")
    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"file://{store}", rank=0, world_size=1)
    progress = CollectiveProgress()
    t = torch.ones(1024, device=device)
    dist.all_reduce(t)  # NCCL makes its communicator at the first collective
    if device.type == "cuda":
        torch.cuda.synchronize()
    before = progress.read()
    for _ in range(args.collectives):
        dist.all_reduce(t)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    after = progress.read()
    # read from another thread, as the sampler does, while this one issues collectives
    seen: list[int | None] = []
    reader = threading.Thread(target=lambda: seen.extend(progress.read() for _ in range(200)))
    reader.start()
    for _ in range(50):
        dist.all_reduce(t)
    reader.join(timeout=30)
    if device.type == "cuda":
        torch.cuda.synchronize()

    read_us = _cpu_us(progress.read, args.reads)
    hb = Heartbeat()
    hb.step()
    training = TrainingReader(hb)
    sample_us = _cpu_us(training.read, max(200, args.reads // 10))
    advanced = None if before is None or after is None else after - before
    want = args.collectives + 1  # the all-reduces and the barrier
    result = {
        "backend": args.backend,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "sequence_before": before,
        "sequence_after": after,
        "advanced": advanced,
        "expected": want,
        "read_from_another_thread": bool(seen) and all(isinstance(v, int) for v in seen),
        "read_cpu_us_median": round(statistics.median(read_us), 3),
        "read_cpu_us_max_batch": round(max(read_us), 3),
        "training_state_cpu_us_median": round(statistics.median(sample_us), 3),
        "waits_published": sorted((training.read() or _Empty()).waits),
    }
    print(json.dumps(result, indent=2))
    dist.destroy_process_group()
    os.unlink(store) if os.path.exists(store) else None
    return 0 if advanced == want and result["read_from_another_thread"] else 1


class _Empty:
    waits: dict[str, float] = {}


if __name__ == "__main__":
    sys.exit(main())
