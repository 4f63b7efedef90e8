"""An 8 GB card on a big GPU: a fine-tuning-shaped run that fragments the cache, seen by vramwatch.

    python3 benchmarks/fragmentation.py --out fragmentation.json            # real GPU, three variants
    python3 benchmarks/fragmentation.py --device cpu --seconds 3 --out f.json  # simulated GPU (harness check)

The process caps itself to ``--cap-gib`` (8 GiB) with
``torch.cuda.set_per_process_memory_fraction`` and runs a fine-tuning-shaped
loop: a frozen bf16 base and a few trainable fp32 blocks with AdamW, batches of
variable-length sequences padded to the batch's longest (so every step
allocates and frees differently sized activations), a few tensors kept for a
window of steps (as logging or metric code keeps them), and now and then a
large contiguous request (a flat gather buffer). An OOM is caught and the step
skipped, as training code that retries on OOM does. The run is observed only
through vramwatch's own scrape: the parent polls ``/metrics`` and records
allocated, reserved, fragmentation ratio, inactive split bytes, retries and
OOMs. Three variants, each a fresh process with the same seed: the default
allocator, ``garbage_collection_threshold:0.8`` and ``expandable_segments:True``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # puts the repository root on sys.path too

from harness import Prometheus, find_tool

GIB = 1 << 30
VARIANTS = {
    "default": "",
    "gc_threshold_0.8": "garbage_collection_threshold:0.8",
    "expandable_segments": "expandable_segments:True",
}
# contract name -> key in a recorded row
SERIES = {
    "torch_cuda_memory_allocated_bytes": "allocated",
    "torch_cuda_memory_reserved_bytes": "reserved",
    "torch_cuda_memory_active_bytes": "active",
    "torch_cuda_memory_inactive_split_bytes": "inactive_split",
    "torch_cuda_memory_fragmentation_ratio": "fragmentation",
    "torch_cuda_memory_largest_free_block_bytes": "largest_free_block",
    "torch_cuda_memory_segments": "segments",
    "torch_cuda_memory_limit_bytes": "limit",
    "torch_cuda_memory_peak_allocated_bytes": "peak_allocated",
    "torch_cuda_memory_peak_reserved_bytes": "peak_reserved",
    "torch_cuda_memory_alloc_retries_total": "retries",
    "torch_cuda_memory_ooms_total": "ooms",
    "torch_cuda_memory_device_allocs_total": "device_allocs",
    "torch_cuda_memory_device_frees_total": "device_frees",
    "vramwatch_training_steps_total": "steps",
}


def lengths(rng: random.Random, batch: int, lo: int, hi: int) -> list[int]:
    """One batch of sequence lengths: mostly short, a long tail (like instruction data)."""
    out = []
    for _ in range(batch):
        x = int(rng.lognormvariate(0, 0.6) * (lo + hi) / 4)
        out.append(max(lo, min(hi, x)) // 8 * 8 or 8)
    return out


# ----------------------------------------------------------------------------------------------
# the run (a child process)
# ----------------------------------------------------------------------------------------------
def run_cuda(a: dict[str, Any], vw: Any) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    on_cpu = a["device"] == "cpu-torch"  # the same loop on the CPU: a code check, no allocator stats
    dev = torch.device("cpu") if on_cpu else torch.device("cuda", 0)
    total = frac = None
    if not on_cpu:
        total = torch.cuda.get_device_properties(0).total_memory
        frac = min(1.0, a["cap_gib"] * GIB / total)
        torch.cuda.set_per_process_memory_fraction(frac, 0)
    torch.manual_seed(a["seed"])
    rng = random.Random(a["seed"])
    H, V = a["hidden"], a["vocab"]

    def block(dtype: torch.dtype, trainable: bool) -> nn.Module:
        kw = {"device": dev, "dtype": dtype}  # made (and initialised) where it lives
        b = nn.Sequential(nn.LayerNorm(H, **kw), nn.Linear(H, 4 * H, **kw), nn.GELU(), nn.Linear(4 * H, H, **kw))
        for p in b.parameters():
            p.requires_grad_(trainable)
        return b

    emb = nn.Embedding(V, H, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    frozen = nn.ModuleList(block(torch.bfloat16, False) for _ in range(a["frozen_layers"]))
    train = nn.ModuleList(block(torch.float32, True) for _ in range(a["trainable_layers"]))
    params = [p for p in train.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    kept: list[torch.Tensor] = []
    steps = ooms = big = 0
    step_times: list[float] = []
    t_end = time.monotonic() + a["seconds"]
    while time.monotonic() < t_end:
        t0 = time.perf_counter()
        lens = lengths(rng, a["batch"], a["min_len"], a["max_len"])
        seq = max(lens)
        ids = x = logits = loss = buf = None
        try:
            ids = torch.randint(0, V, (len(lens), seq), device=dev)
            with torch.no_grad():  # the frozen base keeps no activations
                x = emb(ids)
                for b in frozen:
                    x = x + b(x)
            x = x.float()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                for b in train:
                    x = x + b(x)
                logits = F.linear(x.to(torch.bfloat16), emb.weight)  # tied, frozen head
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            # what logging / metric code keeps for a few steps: differently sized, long-lived blocks
            kept.append(x.detach()[:, : max(1, seq // 4)].to(torch.bfloat16).clone())
            kept.append(loss.detach())
            del x, logits, loss
            if len(kept) > 2 * a["keep_steps"]:
                del kept[:2]
            if a["big_every"] and steps % a["big_every"] == a["big_every"] - 1:
                buf = torch.empty(int(a["big_gib"] * GIB), dtype=torch.uint8, device=dev)  # a flat gather
                buf[:1024].fill_(1)
                del buf
                big += 1
            steps += 1
        except torch.cuda.OutOfMemoryError:
            ooms += 1  # skip the step and go on, as training code that retries on OOM does
            ids = x = logits = loss = buf = None  # drop the half step's tensors (no cache flush)
            opt.zero_grad(set_to_none=True)
        vw.step()
        step_times.append(time.perf_counter() - t0)
    if on_cpu:
        return {"steps": steps, "caught_ooms": ooms, "big_requests": big, "device": "cpu-torch"}
    torch.cuda.synchronize()
    st = torch.cuda.memory_stats(0)
    return {
        "steps": steps,
        "caught_ooms": ooms,
        "big_requests": big,
        "step_time_mean_s": sum(step_times) / len(step_times) if step_times else None,
        "memory_fraction": frac,
        "total_memory_bytes": total,
        "final_stats": {
            k: st.get(k)
            for k in (
                "allocated_bytes.all.current",
                "reserved_bytes.all.current",
                "allocated_bytes.all.peak",
                "reserved_bytes.all.peak",
                "inactive_split_bytes.all.current",
                "num_alloc_retries",
                "num_ooms",
                "num_device_alloc",
                "num_device_free",
                "segment.all.current",
            )
        },
        "allocator_backend": torch.cuda.get_allocator_backend(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(0),
    }


def run_sim(a: dict[str, Any], handle: Any) -> dict[str, Any]:
    """The same loop's memory traffic on the simulated allocator (the variants cannot differ there)."""
    from vramwatch.sim.allocator import SimOutOfMemoryError

    sim = handle.sim
    sim.init(0)
    total = handle.sim.node.gpus[0].total_bytes
    sim.set_memory_fraction(min(1.0, a["cap_gib"] * GIB / total))
    refresh = getattr(handle.sampler, "refresh_limits", None)
    if refresh is not None:  # older samplers cached the budget
        refresh()
    rng = random.Random(a["seed"])
    per_token = a["hidden"] * 40 + a["vocab"] * 10  # activations + logits, bytes per token
    static = int(a["hidden"] ** 2 * (a["frozen_layers"] * 16 + a["trainable_layers"] * 128))
    sim.allocate(static)
    steps = ooms = 0
    t_end = time.monotonic() + a["seconds"]
    while time.monotonic() < t_end:
        lens = lengths(rng, a["batch"], a["min_len"], a["max_len"])
        act = per_token * len(lens) * max(lens)
        try:
            sim.allocate(act)
            sim.fragment(act // 20)  # kept pieces freed out of order
            sim.free(act - act // 20)
            steps += 1
        except SimOutOfMemoryError:
            ooms += 1
        handle.step()
        time.sleep(0.02)
    return {
        "steps": steps,
        "caught_ooms": ooms,
        "simulated": True,
        "final_stats": {"allocated_bytes.all.current": sim.allocated(), "reserved_bytes.all.current": sim.reserved()},
    }


def child(a: dict[str, Any]) -> int:
    try:
        import vramwatch

        settings = {
            "port": a["port"],
            "spool_dir": a["spool"],
            "interval": a["interval"],
            "largest_block_interval": a["largest_block_interval"],
            "linger": 0.0,
        }
        if a["device"] == "cpu":
            settings["simulate"] = True
        handle = vramwatch.start(**settings)
        if a["device"] == "cpu":
            res = run_sim(a, handle)
        else:
            import torch  # noqa: F401 - after start(), as a job's first lines would be

            res = run_cuda(a, vramwatch)
        time.sleep(2 * a["interval"])  # let the last sample reach the scrape
        vramwatch.stop()
        common.write_json(a["result"], res)
        return 0
    except BaseException:  # noqa: BLE001
        common.write_json(a["result"], {"error": traceback.format_exc()})
        return 1


# ----------------------------------------------------------------------------------------------
# the parent: one fresh process per variant, observed through /metrics
# ----------------------------------------------------------------------------------------------
def row_from_scrape(text: str, rank: str = "0", openmetrics: bool = False) -> dict[str, Any] | None:
    m = common.parse_metrics(text, openmetrics=openmetrics)
    row: dict[str, Any] = {}
    for name, key in SERIES.items():
        for labels, value in m.get(name, []):
            if labels.get("rank") == rank:
                row[key] = value
                if "uuid" in labels:
                    row["_uuid"] = labels["uuid"]
    if "allocated" not in row:
        return None
    uuid = row.pop("_uuid", None)
    for labels, value in m.get("gpu_memory_used_bytes", []):
        if uuid and labels.get("uuid") == uuid:
            row["gpu_memory_used"] = value
    for labels, _ in m.get("torch_cuda_allocator_info", []):
        if labels.get("rank") == rank:
            row["_info"] = {k: v for k, v in labels.items() if k not in ("rank", "local_rank", "job_id")}
    return row


def run_variant(name: str, conf: str, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    port = common.free_port()
    spool = tempfile.mkdtemp(prefix="vwbench-frag-", dir="/dev/shm" if os.path.isdir("/dev/shm") else workdir)
    result = os.path.join(workdir, f"{name}.json")
    spec = {
        k: getattr(args, k)
        for k in (
            "device",
            "cap_gib",
            "seconds",
            "seed",
            "hidden",
            "vocab",
            "batch",
            "min_len",
            "max_len",
            "frozen_layers",
            "trainable_layers",
            "keep_steps",
            "big_every",
            "big_gib",
            "interval",
            "largest_block_interval",
        )
    }
    spec.update(port=port, spool=spool, result=result)
    env = common.child_env()
    env.pop("PYTORCH_ALLOC_CONF", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    log = open(os.path.join(workdir, f"{name}.log"), "ab")
    t_start = time.monotonic()
    t_start_epoch = time.time()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    series: list[dict[str, Any]] = []
    info = None
    scrape_errors = 0
    deadline = t_start + args.seconds + 180
    recorder = common.OpenMetricsRecorder("vramwatch-fragmentation", name)
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            t = time.monotonic()
            status, body, _ = common.http_get(url, timeout=5, accept=common.OPENMETRICS)
            if status == 200:
                text = body.decode()
                recorder.add(text, time.time())
                row = row_from_scrape(text, openmetrics=text.rstrip().endswith("# EOF"))
                if row is not None:
                    info = row.pop("_info", info)
                    row["t"] = round(t - t_start, 3)
                    series.append(row)
            else:
                scrape_errors += 1
            time.sleep(max(0.0, args.poll - (time.monotonic() - t)))
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    finally:
        log.close()
        server = common.server_pid_in(spool)
        if server:  # the server the rank started lingers; removed under it, its spool would be made again
            common.stop_pid(server)
        shutil.rmtree(spool, ignore_errors=True)
    try:
        own = common.read_json(result)
    except (OSError, ValueError):
        own = {"error": f"no result (exit {proc.returncode})"}
    if "error" in own:
        own["log_tail"] = Path(log.name).read_bytes()[-3000:].decode(errors="replace")
    om = None
    if args.out:  # the whole scrape, for `promtool tsdb create-blocks-from openmetrics` and a report
        om = f"{os.path.splitext(os.path.basename(args.out))[0]}.{name}.om.gz"
        recorder.write(os.path.join(os.path.dirname(os.path.abspath(args.out)), om))
    return {
        "alloc_conf": conf,
        "allocator_info": info,
        "series": series,
        "scrape_errors": scrape_errors,
        "openmetrics_file": om,
        "t_start_epoch": t_start_epoch,
        "summary": summarize(series),
        "run": own,
    }


def summarize(series: list[dict[str, Any]]) -> dict[str, Any]:
    if not series:
        return {"samples": 0}

    def col(k: str) -> list[float]:
        return [r[k] for r in series if r.get(k) is not None]

    last = series[-1]
    out: dict[str, Any] = {
        "samples": len(series),
        "final_allocated_bytes": last.get("allocated"),
        "final_reserved_bytes": last.get("reserved"),
        "final_reserved_minus_allocated_bytes": (last.get("reserved", 0) - last.get("allocated", 0)),
        "peak_allocated_bytes": max(col("allocated"), default=None),
        "peak_reserved_bytes": max(col("reserved"), default=None),
        "allocator_peak_reserved_bytes": last.get("peak_reserved"),
        "max_fragmentation_ratio": max(col("fragmentation"), default=None),
        "mean_fragmentation_ratio": (
            sum(col("fragmentation")) / len(col("fragmentation")) if col("fragmentation") else None
        ),
        "final_fragmentation_ratio": last.get("fragmentation"),
        "max_inactive_split_bytes": max(col("inactive_split"), default=None),
        "min_largest_free_block_bytes": min(col("largest_free_block"), default=None),
        "retries": last.get("retries"),
        "ooms": last.get("ooms"),
        "steps": last.get("steps"),
        "limit_bytes": last.get("limit"),
        "device_allocs": last.get("device_allocs"),
        "device_frees": last.get("device_frees"),
    }
    return out


def report(json_path: str, report_dir: str, variants: list[str] | None = None) -> dict[str, Any]:
    """Backfill each variant's recorded scrape into a throwaway Prometheus and run `vramwatch report` on it.

    Runs where the recording is reviewed (needs prometheus, promtool and the report extras), not on the
    GPU machine. Returns {variant: html path or the reason it failed}.
    """
    data = common.read_json(json_path)
    base = os.path.dirname(os.path.abspath(json_path))
    promtool, prometheus = find_tool("promtool"), find_tool("prometheus")
    if not promtool or not prometheus:
        raise SystemExit("--report needs promtool and prometheus (make tools unpacks them into .cache/debian)")
    os.makedirs(report_dir, exist_ok=True)
    done: dict[str, Any] = {}
    for name, v in data["variants"].items():
        if variants and name not in variants:
            continue
        if not v.get("openmetrics_file") or not v.get("series"):
            done[name] = "no recording"
            continue
        tmp = tempfile.mkdtemp(prefix="vwbench-report-")
        prom: Prometheus | None = None
        try:
            tsdb = os.path.join(tmp, "data")
            src = os.path.join(base, v["openmetrics_file"])
            if src.endswith(".gz"):
                import gzip

                plain = os.path.join(tmp, "recording.om")
                with gzip.open(src, "rb") as fin, open(plain, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
                src = plain
            subprocess.run(
                [promtool, "tsdb", "create-blocks-from", "openmetrics", src, tsdb],
                check=True,
                capture_output=True,
                timeout=120,
            )
            prom = Prometheus(
                Path(tmp),
                config={"global": {"scrape_interval": "1s"}, "scrape_configs": []},
                tsdb=Path(tsdb),
                retention="10y",
                lifecycle=False,
            )
            prom.start(timeout=60)
            url = prom.url
            t0 = v["series"][0]["t"] + v.get("t_start_epoch", 0.0)
            t1 = v["series"][-1]["t"] + v.get("t_start_epoch", 0.0)
            html = os.path.join(report_dir, f"fragmentation-{name}.html")
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "vramwatch",
                    "report",
                    "--prometheus",
                    url,
                    "--start",
                    str(t0 - 1),
                    "--end",
                    str(t1 + 1),
                    "--scrape-interval",
                    "1s",
                    "--var",
                    "job=vramwatch-fragmentation",
                    "--out",
                    html,
                    "--quiet",
                ],
                capture_output=True,
                text=True,
                timeout=600,
                env=common.child_env(),
            )
            done[name] = html if r.returncode == 0 else f"vramwatch report exit {r.returncode}: {r.stderr[-1500:]}"
            common.progress(f"report {name}: {done[name]}")
        except (subprocess.SubprocessError, OSError, RuntimeError) as e:
            done[name] = repr(e)
            common.progress(f"report {name} failed: {e!r}")
        finally:
            if prom is not None:
                prom.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/fragmentation.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu", "cpu-torch"),
        help="cuda; cpu: the simulated GPU (a harness check); cpu-torch: the torch loop on the CPU "
        "(a code check, no allocator series)",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    p.add_argument("--cap-gib", type=float, default=8.0, help="per-process budget (the 8 GB card)")
    p.add_argument("--seconds", type=float, default=20.0, help="training seconds per variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4, help="sequences per batch")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1536)
    p.add_argument("--frozen-layers", type=int, default=16, help="frozen bf16 blocks (the base model)")
    p.add_argument("--trainable-layers", type=int, default=4, help="trainable fp32 blocks with AdamW")
    p.add_argument("--keep-steps", type=int, default=4, help="steps a kept activation slice lives")
    p.add_argument("--big-every", type=int, default=10, help="a large contiguous request every N steps (0: off)")
    p.add_argument("--big-gib", type=float, default=1.5)
    p.add_argument("--interval", type=float, default=0.5, help="vramwatch sample interval in the run")
    p.add_argument("--largest-block-interval", type=float, default=5.0)
    p.add_argument("--poll", type=float, default=0.5, help="seconds between scrapes of /metrics")
    p.add_argument("--quick", action="store_true", help="10 s per variant")
    p.add_argument("--out", default="")
    p.add_argument(
        "--report",
        metavar="FRAGMENTATION_JSON",
        help="instead of running: turn a recorded run into one `vramwatch report` HTML per variant "
        "(backfills each .om recording into a throwaway Prometheus; needs promtool, prometheus "
        "and the report extras)",
    )
    p.add_argument("--report-dir", default="reports", help="where --report writes the HTML files")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cut by `timeout`: save, clean up
    if args.child:
        return child(json.loads(args.child))
    if args.report:
        wanted = [v for v in args.variants.split(",") if v] if args.variants != ",".join(VARIANTS) else None
        res = report(args.report, args.report_dir, wanted)
        print(json.dumps(res, indent=1))
        return 0 if all(str(v).endswith(".html") for v in res.values()) else 1
    if args.quick:
        args.seconds = min(args.seconds, 10.0)
    if args.device != "cuda":
        args.hidden, args.vocab = min(args.hidden, 256), min(args.vocab, 1000)
        args.max_len = min(args.max_len, 256)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"unknown variant {n!r}; choose from {', '.join(VARIANTS)}")
    workdir = tempfile.mkdtemp(prefix="vwbench-frag-")
    out: dict[str, Any] = {
        "metadata": common.metadata(
            benchmark="fragmentation",
            device=args.device,
            settings={k: v for k, v in vars(args).items() if k not in ("out", "child")},
        ),
        "variants": {},
        "notes": [
            "series rows come from vramwatch's own /metrics (rank 0), polled every --poll seconds",
            "each variant is a fresh process with the same seed and sequence lengths",
        ],
    }
    if args.device == "cpu":
        out["notes"].append("SIMULATED allocator: the variants do not change it; this run only checks the harness")
    try:
        for name in names:
            common.progress(
                f"fragmentation: variant {name} (PYTORCH_CUDA_ALLOC_CONF={VARIANTS[name]!r}), "
                f"{args.seconds:g} s capped at {args.cap_gib:g} GiB"
            )
            res = run_variant(name, VARIANTS[name], args, workdir)
            out["variants"][name] = res
            s, r = res["summary"], res["run"]
            if "error" in r:
                common.progress(f"{name} FAILED:\n{r['error']}\n{r.get('log_tail', '')}")
            if s.get("samples"):
                common.progress(
                    f"{name}: {s['samples']} samples, steps {s['steps']:.0f}, final alloc "
                    f"{s['final_allocated_bytes'] / GIB:.2f} GiB / reserved {s['final_reserved_bytes'] / GIB:.2f} GiB, "
                    f"peak reserved {s['peak_reserved_bytes'] / GIB:.2f} GiB, max frag "
                    f"{s['max_fragmentation_ratio']:.3f}, retries {s['retries']}, ooms {s['ooms']}"
                )
            if args.out:
                common.write_json(args.out, out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["comparison"] = {
        n: {
            k: v["summary"].get(k)
            for k in (
                "final_allocated_bytes",
                "final_reserved_bytes",
                "peak_reserved_bytes",
                "max_fragmentation_ratio",
                "max_inactive_split_bytes",
                "retries",
                "ooms",
                "steps",
            )
        }
        for n, v in out["variants"].items()
    }
    if args.out:
        common.write_json(args.out, out)
    failed = [
        n for n, v in out["variants"].items() if "error" in v["run"] or (not v["series"] and args.device != "cpu-torch")
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
