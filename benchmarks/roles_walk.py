"""What one memory-by-role walk costs the sampler thread, by tensor count (CPU tensors; no GPU needed).

    python3 benchmarks/roles_walk.py [--out roles_walk.json]

The walk reads metadata only, so its cost depends on how many tensors it visits, not on their size:
each case is a model of ``params`` small parameters, each with a gradient and AdamW's two moments (four
tensors a parameter). Reported: the best of several full walks, the cost per tensor, the number of
passes at the default ``role_max_tensors``, the longest pass, how often it walks (``role_interval``, or
less often for a walk that would use more than ``MAX_CORE_SHARE`` of a core) and the share of a core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vramwatch.config import Settings
from vramwatch.rank.roles import MAX_CORE_SHARE, RoleWalker

CASES = (150, 300, 1000, 5000)  # GPT-2 small has 148 parameters, a 7B Llama 291, a 70B one 723


def _model(params: int):
    import torch

    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(4)) for _ in range(params)])
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros(4)
    opt.step()
    return model, opt


def measure(params: int, interval: float, max_tensors: int, repeats: int = 5) -> dict[str, float]:
    model, opt = _model(params)
    best, longest, passes = float("inf"), 0.0, 0
    for _ in range(repeats):
        w = RoleWalker(model, opt, interval, max_tensors, device_types=("cpu",))
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
    tensors = params * 5  # parameter, gradient, exp_avg, exp_avg_sq, step
    return {
        "params": params,
        "tensors": tensors,
        "walk_s": best,
        "per_tensor_us": best / tensors * 1e6,
        "passes": passes,
        "longest_pass_s": longest,
        "walk_every_s": max(interval, best / MAX_CORE_SHARE),
        "core_share": best / max(interval, best / MAX_CORE_SHARE),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    s = Settings()
    res = {
        "role_interval_s": s.role_interval,
        "role_max_tensors": s.role_max_tensors,
        "cases": [measure(n, s.role_interval, s.role_max_tensors) for n in CASES],
    }
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
