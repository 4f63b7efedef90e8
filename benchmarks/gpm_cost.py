"""What reading GPM (NVML's GPU performance monitoring) costs the GPU: paired runs of a GPU-bound step with
the server's GPM collector on and off.

    python3 benchmarks/gpm_cost.py [--pairs 10] [--segment-seconds 4] [--slow-interval 1] [--out gpm_cost.json]

This process runs a GPU-bound step (``--matmuls`` bf16 products of ``--size``-square matrices) and, beside it,
one `vramwatch serve` per segment with real NVML: GPM on in one segment of a pair, off in the other (the order
alternates pair by pair, so a drift of the host cancels). Everything else of the server runs in both (the
fast and slow NVML reads, Xid, NVLink). GPM is read on the slow cadence; ``--slow-interval`` (default 1 s,
ten times the default's rate) makes each segment hold several GPM reads, so a cost per read would show;
at the default 10 s it is a tenth of that. Each segment: the server starts and answers (and, with GPM on,
shows ``gpu_sm_activity_ratio``), the step warms up, then ``--segment-seconds`` of steps are timed, ended by
one synchronize. Per pair: step time with GPM over step time without; the null: each GPM-off segment over
the next one (what two identical segments differ by). Also recorded: the SM activity GPM itself reported.

``--device cpu`` checks the plumbing on a machine without a GPU: the server runs on the simulated GPU (whose
GPM is simulated) and the step is a small CPU matmul; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # puts the repository root on sys.path too
from common import progress

from harness import Exporter, wait_until


def build_step(device: str, size: int, matmuls: int) -> tuple[Any, Any, dict[str, Any]]:
    import torch

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)

    def step() -> None:
        for _ in range(matmuls):
            torch.mm(a, b)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    info = {"size": size, "matmuls_per_step": matmuls, "dtype": str(dtype), "flop_per_step": 2.0 * size**3 * matmuls}
    if dev.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(0)
    return step, sync, info


def timed(step: Any, sync: Any, warmup_s: float, run_s: float) -> dict[str, float]:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup_s:
        step()
    sync()
    n = 0
    start = time.perf_counter()
    while True:
        step()
        n += 1
        if time.perf_counter() - start >= run_s:
            break
    sync()
    wall = time.perf_counter() - start
    return {"steps": n, "wall_s": wall, "step_time_s": wall / n}


def segment(
    tmp: Path, gpm: bool, simulate: bool, slow_interval: float, step: Any, sync: Any, args: argparse.Namespace
) -> dict[str, Any]:
    exp = Exporter(
        tmp,
        simulate=simulate,
        gpus=1,
        gpm=gpm,
        nvml_slow_interval=slow_interval,
        nvml_interval=1.0,
    )
    t0 = time.monotonic()
    exp.start(timeout=60)
    try:
        if gpm:  # the first read only primes: wait for a value, so every timed second has GPM reads
            wait_until(lambda: exp.values("gpu_sm_activity_ratio"), 60, "a GPM reading", interval=0.25)
        started = time.monotonic() - t0
        r = timed(step, sync, args.warmup_seconds, args.segment_seconds)
        sm = exp.values("gpu_sm_activity_ratio")
        r.update(gpm=gpm, server_start_s=started, gpm_sm_activity=sm[0] if sm else None)
        return r
    finally:
        exp.stop()


def summarize(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    on = [p["on"]["step_time_s"] for p in pairs]
    off = [p["off"]["step_time_s"] for p in pairs]
    st = common.paired_stats(off, on)  # ratios: on / off
    null = common.spread(st["null_ratios"])
    return {
        "ratio_basis": "step time with GPM over step time without, pair by pair",
        "pairs": st["pairs"],
        "median_ratio": st["median_ratio"],
        "min_ratio": st["min_ratio"],
        "max_ratio": st["max_ratio"],
        "null_median_ratio": null["median"],
        "null_min_ratio": null["min"],
        "null_max_ratio": null["max"],
        "within_null": (
            st["median_ratio"] is not None
            and null["min"] is not None
            and null["min"] <= st["median_ratio"] <= null["max"]
        ),
        "step_times": {"gpm_off": off, "gpm_on": on},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--segment-seconds", type=float, default=4.0)
    p.add_argument("--warmup-seconds", type=float, default=0.5)
    p.add_argument("--slow-interval", type=float, default=1.0, help="the server's nvml_slow_interval (GPM cadence)")
    p.add_argument("--size", type=int, default=None, help="matrix size (cuda: 8192; cpu: 128)")
    p.add_argument("--matmuls", type=int, default=10, help="products per step")
    p.add_argument("--deadline", type=float, default=0.0, help="stop starting pairs after this many seconds")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    simulate = args.device == "cpu"
    if not simulate:
        import torch

        if not torch.cuda.is_available():
            print("gpm_cost: needs a CUDA GPU with NVML (--device cpu checks the plumbing here)", file=sys.stderr)
            return 2
    size = args.size or (8192 if not simulate else 128)
    step, sync, info = build_step(args.device, size, args.matmuls)
    started = time.monotonic()
    out: dict[str, Any] = {
        "meta": common.metadata(benchmark="gpm_cost", device=args.device),
        "settings": {k: v for k, v in vars(args).items()},
        "step": info,
        "pairs": [],
    }
    tmp = Path(tempfile.mkdtemp(prefix="vwbench-gpm-"))
    seg_s: list[float] = []
    for i in range(args.pairs):
        if args.deadline and seg_s and time.monotonic() - started + 2 * statistics.mean(seg_s) > args.deadline:
            out["truncated"] = True
            progress(f"gpm_cost: deadline reached after {i} pairs")
            break
        order = (True, False) if i % 2 == 0 else (False, True)
        pair: dict[str, Any] = {}
        for gpm in order:
            t0 = time.monotonic()
            pair["on" if gpm else "off"] = segment(
                tmp / f"s{i}{int(gpm)}", gpm, simulate, args.slow_interval, step, sync, args
            )
            seg_s.append(time.monotonic() - t0)
        out["pairs"].append(pair)
        progress(
            f"gpm_cost pair {i + 1}/{args.pairs}: on {pair['on']['step_time_s'] * 1000:.3f} ms, "
            f"off {pair['off']['step_time_s'] * 1000:.3f} ms"
        )
        out["summary"] = summarize(out["pairs"])
        if args.out:
            common.write_json(args.out, out)
    out["summary"] = summarize(out["pairs"])
    s = out["summary"]
    if s["median_ratio"] is not None:
        null = (
            f"A/A null {s['null_median_ratio']:.4f} [{s['null_min_ratio']:.4f}, {s['null_max_ratio']:.4f}]"
            if s["null_median_ratio"] is not None
            else "no null (one pair)"
        )
        progress(
            f"gpm_cost: GPM on/off median {s['median_ratio']:.4f} [{s['min_ratio']:.4f}, {s['max_ratio']:.4f}] "
            f"over {s['pairs']} pairs; {null}"
        )
    if args.out:
        common.write_json(args.out, out)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
