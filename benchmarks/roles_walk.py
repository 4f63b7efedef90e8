"""What the rank's two in-process walks cost, and how old their figures get, as models grow.

    python3 benchmarks/roles_walk.py [--params 150,300,1000,5000] [--device cpu|cuda] [--segments 0] [--out F]

**Memory by role** (``vramwatch.watch()``): the walk reads metadata only, so its cost depends on how many
tensors it visits, not on their size: each case is a model of ``params`` small parameters, each with a
gradient and AdamW's state (five tensors a parameter: the parameter, its gradient, exp_avg, exp_avg_sq,
step). Reported: the best of several full walks, the cost per tensor, the number of passes at the default
``role_max_tensors`` (one pass per sample), the longest pass, how often it walks (``role_interval``, or less
often for a walk that would use more than ``MAX_CORE_SHARE`` of a core), the share of a core, and the age
of the figures: at most the gap between walks plus the samples a walk spans.

**Largest free block** (``--segments N``): the allocator snapshot vramwatch takes every
``largest_block_interval`` (or less often, so that it stays within ``SNAPSHOT_MAX_SHARE`` of a core). On
CUDA the script makes N small-pool segments (2 MiB each, 2N tensors of 1 MiB with every other one freed, so
each segment holds a free block) and times vramwatch's own read (``TorchSource.snapshot`` and
``segment_summary``); on a machine without CUDA it times ``segment_summary`` over a synthetic snapshot of N
segments (torch's own snapshot is not in that figure; the JSON says so).

With ``--device cuda`` the parameters live on the GPU, as a job's do; the CPU needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vramwatch.config import Settings
from vramwatch.rank.allocator import SNAPSHOT_MAX_SHARE, segment_summary
from vramwatch.rank.roles import MAX_CORE_SHARE, RoleWalker

CASES = (150, 300, 1000, 5000)  # GPT-2 small has 148 parameters, a 7B Llama 291, a 70B one 723
TENSORS_PER_PARAM = 5  # parameter, gradient, exp_avg, exp_avg_sq, step
MIB = 1 << 20


def _model(params: int, device: str) -> tuple[Any, Any]:
    import torch

    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(4, device=device)) for _ in range(params)])
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros(4, device=device)
    opt.step()
    return model, opt


def measure(
    params: int, interval: float, max_tensors: int, sample_interval: float, device: str = "cpu", repeats: int = 5
) -> dict[str, float]:
    t_build = time.perf_counter()
    model, opt = _model(params, device)
    build_s = time.perf_counter() - t_build
    best, longest, passes = float("inf"), 0.0, 0
    for _ in range(repeats):
        w = RoleWalker(model, opt, interval, max_tensors, device_types=(device,))
        t0 = time.perf_counter()
        w.poll(0.0)
        n = 1
        longest = max(longest, w.health.duration)
        while w._walk is not None:
            w.poll(0.0)
            n += 1
            longest = max(longest, w.health.duration)
        best = min(best, time.perf_counter() - t0)
        passes = n
    tensors = params * TENSORS_PER_PARAM
    every = max(interval, best / MAX_CORE_SHARE)
    return {
        "params": params,
        "tensors": tensors,
        "device": device,
        "walk_s": best,
        "per_tensor_us": best / tensors * 1e6,
        "passes": passes,
        "longest_pass_s": longest,
        "walk_every_s": every,
        "core_share": best / every,
        # a figure is published when its walk completes: it is at most one gap between walks old, plus the
        # samples its passes span
        "age_max_s": every + (passes - 1) * sample_interval,
        "model_build_s": build_s,
    }


def _synthetic_snapshot(segments: int) -> list[dict[str, Any]]:
    return [
        {
            "device": 0,
            "total_size": 2 * MIB,
            "blocks": [{"size": MIB, "state": "active_allocated"}, {"size": MIB, "state": "inactive"}],
        }
        for _ in range(segments)
    ]


def snapshot_cost(segments: int, device: str, block_interval: float, sample_interval: float, repeats: int = 5):
    """One largest-free-block snapshot with ``segments`` segments: its cost, how often it runs, its share."""
    held: list[Any] = []
    if device == "cuda":
        import torch

        from vramwatch.rank.allocator import TorchSource

        pairs = [torch.empty(MIB // 4, dtype=torch.float32, device="cuda") for _ in range(2 * segments)]
        held = pairs[::2]  # every other one freed: each 2 MiB segment keeps a free 1 MiB block
        del pairs
        torch.cuda.synchronize()
        source = TorchSource()
        read = source.snapshot
        basis = "TorchSource.snapshot() + segment_summary() on CUDA"
    else:
        synthetic = _synthetic_snapshot(segments)

        def read() -> list[dict[str, Any]]:
            return synthetic

        basis = "segment_summary() over a synthetic snapshot (no CUDA: torch's snapshot not included)"
    costs = []
    found = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        found = segment_summary(read())
        costs.append(time.perf_counter() - t0)
    best = min(costs)
    every = max(block_interval, best / SNAPSHOT_MAX_SHARE)
    seg = found.get(0, {"segments": 0, "largest_free": 0})
    del held
    return {
        "segments_requested": segments,
        "segments_seen": seg["segments"],
        "largest_free_bytes": seg["largest_free"],
        "basis": basis,
        "snapshot_s": best,
        "snapshot_s_all": costs,
        "per_segment_us": best / max(1, seg["segments"]) * 1e6,
        "snapshot_every_s": every,
        "core_share": best / every,
        "age_max_s": every + sample_interval,  # read at a sample, published with it
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default=",".join(map(str, CASES)), help="parameter counts, comma-separated")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--segments", type=int, default=0, help="allocator segments for the snapshot figure (0: none)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("roles_walk: --device cuda needs a CUDA GPU (use --device cpu here)", file=sys.stderr)
            return 2
    s = Settings()
    res: dict[str, Any] = {
        "role_interval_s": s.role_interval,
        "role_max_tensors": s.role_max_tensors,
        "sample_interval_s": s.interval,
        "largest_block_interval_s": s.largest_block_interval,
        "max_core_share": MAX_CORE_SHARE,
        "snapshot_max_share": SNAPSHOT_MAX_SHARE,
        "cases": [],
    }
    for n in (int(x) for x in a.params.split(",") if x):
        print(f"roles_walk: {n} parameters on {a.device}", file=sys.stderr, flush=True)
        res["cases"].append(measure(n, s.role_interval, s.role_max_tensors, s.interval, a.device, a.repeats))
    if a.segments:
        print(f"roles_walk: allocator snapshot at {a.segments} segments", file=sys.stderr, flush=True)
        res["snapshot"] = snapshot_cost(a.segments, a.device, s.largest_block_interval, s.interval, a.repeats)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
