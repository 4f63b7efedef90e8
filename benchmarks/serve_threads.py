"""Where ``vramwatch serve``'s CPU goes, thread by thread: idle, at a paced scrape rate, and back to back.

    python3 benchmarks/serve_threads.py --ranks 1 --seconds 10 --out threads.json   # simulated GPU

The server runs in this process, as ``vramwatch serve`` runs it (its command line in the main thread),
so each of its threads can be read on its own CPU clock (``pthread_getcpuclockid``: nanoseconds, not
/proc's 10 ms ticks). The ranks (simulated) and the scraper (raw sockets, Prometheus' request) are
processes of their own, so they take nothing from the server's GIL. Per window: each thread's CPU, the
process's CPU (threads that came and went included), scrapes and their latency; ``marginal`` is the
window's process CPU minus the idle window's rate over the same time, per scrape.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # puts the repository root on sys.path too

# A scraper process: ``rate`` scrapes a second (0: back to back) for ``seconds``; prints the latencies.
SCRAPER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
from scrape import raw_get
port, rate, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
lat, starts, bad = [], [], 0
t0 = nxt = time.monotonic()
while time.monotonic() - t0 < seconds:
    start = time.monotonic()
    status, _, elapsed = raw_get(port)
    if status == 200:
        lat.append(elapsed)
        starts.append(start)
    else:
        bad += 1
    if rate > 0:
        nxt += 1.0 / rate
        time.sleep(max(0.0, nxt - time.monotonic()))
print(json.dumps({"lat": lat, "starts": starts, "errors": bad}))
"""


def _process_cpu() -> float:
    return time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)


_WAKES = [0]  # the event loop's select() calls
_BUSY: list[tuple[str, float, float]] = []  # (what, start, end) on the monotonic clock: renders, collector reads


def _record_busy() -> None:
    """Note when each render and each collector read ran (CLOCK_MONOTONIC is the scraper's clock too)."""
    from vramwatch.server.collectors.framework import Runner
    from vramwatch.server.exposition_cache import CachedExposition

    build, poll = CachedExposition.refresh, Runner.poll_once

    def refresh(self: CachedExposition) -> bool:
        t0 = time.monotonic()
        did = build(self)
        if did and len(_BUSY) < 100000:
            _BUSY.append(("render", t0, time.monotonic()))
        return did

    def poll_once(self: Runner) -> None:
        t0 = time.monotonic()
        poll(self)
        if len(_BUSY) < 100000:
            _BUSY.append((self.name, t0, time.monotonic()))

    gc_start = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0] = time.monotonic()
        elif len(_BUSY) < 100000:
            _BUSY.append((f"gc{info['generation']}", gc_start[0], time.monotonic()))

    gc.callbacks.append(on_gc)
    CachedExposition.refresh = refresh  # type: ignore[method-assign]
    Runner.poll_once = poll_once  # type: ignore[method-assign]


def _tail_overlap(lat: list[float], starts: list[float]) -> dict[str, Any]:
    """How many of the slowest 2% of scrapes ran while a render or a collector read did, against all."""
    if len(lat) < 50:
        return {}
    spans = list(_BUSY)

    def hit(i: int) -> str:
        a, b = starts[i], starts[i] + lat[i]
        return next((w for w, s, e in spans if s < b and e > a), "")

    cut = sorted(lat)[int(len(lat) * 0.98)]
    slow = [i for i in range(len(lat)) if lat[i] >= cut]
    kinds: dict[str, int] = {}
    for i in slow:
        k = hit(i) or "none"
        kinds[k] = kinds.get(k, 0) + 1
    every = sum(1 for i in range(len(lat)) if hit(i))
    return {
        "slowest_2pct": len(slow),
        "slowest_2pct_from_ms": cut * 1e3,
        "slowest_overlapping": kinds,
        "all_overlapping_share": every / len(lat),
        "busy_ms": {w: sum(e - s for x, s, e in spans if x == w) * 1e3 for w in sorted({x for x, _, _ in spans})},
        "busy_count": {w: sum(1 for x, _, _ in spans if x == w) for w in sorted({x for x, _, _ in spans})},
        "busy_max_ms": {w: max(e - s for x, s, e in spans if x == w) * 1e3 for w in sorted({x for x, _, _ in spans})},
    }


def _count_wakes() -> None:
    from vramwatch.server.http import ExporterHTTPServer

    if not hasattr(ExporterHTTPServer, "_next_timeout"):
        return  # the asyncio transport has no poll of its own to count: loop_wakes stays 0
    inner = ExporterHTTPServer._next_timeout

    def counted(self: ExporterHTTPServer, poll_interval: float) -> float:
        _WAKES[0] += 1
        return inner(self, poll_interval)

    ExporterHTTPServer._next_timeout = counted  # type: ignore[method-assign]


def _window(port: int, rate: float | None, seconds: float) -> dict[str, Any]:
    """One window: idle (``rate`` None) or a scraper at ``rate``/s (0: back to back)."""
    wakes = _WAKES[0]
    before, c0, t0 = common.thread_cpu_seconds(), _process_cpu(), time.monotonic()
    lat: list[float] = []
    errors = 0
    overlap: dict[str, Any] = {}
    if rate is None:
        time.sleep(seconds)
    else:
        bench = str(Path(__file__).resolve().parent)
        p = subprocess.run(
            [sys.executable, "-c", SCRAPER, str(port), str(rate), str(seconds), bench],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=True,
        )
        got = json.loads(p.stdout)
        lat, errors = got["lat"], got["errors"]
        overlap = _tail_overlap(lat, got["starts"])
    after, c1, t1 = common.thread_cpu_seconds(), _process_cpu(), time.monotonic()
    threads = {k: round(v * 1e3, 3) for k, v in sorted(common.cpu_delta(before, after).items()) if v > 0}
    return {
        "rate_per_s": rate,
        "seconds": t1 - t0,
        "scrapes": len(lat) + errors,
        "errors": errors,
        "p50_ms": _ms(common.percentile(lat, 50)),
        "p99_ms": _ms(common.percentile(lat, 99)),
        "max_ms": _ms(max(lat, default=None)),
        "process_cpu_ms": (c1 - c0) * 1e3,
        "loop_wakes": _WAKES[0] - wakes,
        "tail": overlap,
        "threads_cpu_ms": threads,
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def _measure(port: int, args: argparse.Namespace, out: dict[str, Any]) -> None:
    idle = _window(port, None, args.seconds)
    idle_rate = idle["process_cpu_ms"] / idle["seconds"]
    out["idle"] = idle
    out["idle_cpu_ms_per_s"] = idle_rate
    for name, rate in (("paced", args.rate), ("back_to_back", 0.0)):
        w = _window(port, rate, args.seconds)
        n = w["scrapes"] or 1
        w["total_cpu_per_scrape_ms"] = w["process_cpu_ms"] / n
        w["marginal_cpu_per_scrape_ms"] = (w["process_cpu_ms"] - idle_rate * w["seconds"]) / n
        out[name] = w


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--seconds", type=float, default=10.0, help="each window (idle, paced, back to back)")
    p.add_argument("--rate", type=float, default=10.0, help="the paced window's scrapes per second")
    p.add_argument("--switch-interval", type=float, default=0.0, help="override serve's GIL switch interval (s)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    _count_wakes()
    _record_busy()
    work = tempfile.mkdtemp(prefix="vwbench-threads-")
    spool = os.path.join(work, "spool")
    os.makedirs(spool)
    from vramwatch.sim.state import SimNode, state_path

    SimNode.default(1).save(state_path(spool))
    port = common.free_port()
    env = {"VRAMWATCH_PORT": str(port), "VRAMWATCH_SPOOL_DIR": spool, "VRAMWATCH_SIMULATE": "true"}
    os.environ.update(env)
    log = open(os.path.join(work, "ranks.log"), "ab")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "vramwatch.sim.worker", "--duration", "3600", "--fill-gib", "1"],
            env=common.child_env(
                **env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.ranks), VRAMWATCH_SERVE="external"
            ),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        for r in range(args.ranks)
    ]
    out: dict[str, Any] = {"metadata": common.metadata(benchmark="serve_threads", ranks=args.ranks)}

    def run() -> None:
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            if not common.wait_http(url, timeout=60):
                raise RuntimeError("the server did not answer")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # every rank's samples in the render
                _, body, _ = common.http_get(url)
                if body.count(b"torch_cuda_memory_allocated_bytes{") >= args.ranks:
                    break
                time.sleep(0.25)
            time.sleep(2.0)
            if args.switch_interval > 0:
                sys.setswitchinterval(args.switch_interval)
            out["switch_interval"] = sys.getswitchinterval()
            # a full collection's stall now (what a gen-2 pass costs some scrape), and how much of the
            # heap serve froze out of the collector's sight (process.freeze)
            out["gc_frozen"] = gc.get_freeze_count()
            out["gc_tracked"] = len(gc.get_objects())
            t0 = time.perf_counter()
            gc.collect()
            out["full_gc_ms"] = (time.perf_counter() - t0) * 1e3
            _measure(port, args, out)
        except Exception as e:  # noqa: BLE001 - the report says what failed
            out["error"] = repr(e)
        finally:
            for r in ranks:
                r.terminate()
            for r in ranks:
                r.wait(timeout=10)
            text = json.dumps(out, indent=1, default=str)
            if args.out:
                Path(args.out).write_text(text)
            print(text, flush=True)
            os._exit(1 if "error" in out else 0)

    threading.Thread(target=run, name="bench-measure", daemon=True).start()
    from vramwatch.cli import main as cli

    cli(["serve"])
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
