"""Scrape cost as the node grows: 1-64 ranks on 1-8 (simulated) GPUs, one ``vramwatch serve``.

    python3 benchmarks/scrape_scale.py --out scale.json             # the grid below, ~4 min
    python3 benchmarks/scrape_scale.py --gpus 1 --ranks 1,2 --quick  # a check of the pipeline
    python3 benchmarks/scrape_scale.py --doc-from scale.json         # rewrite docs/scale.md's table

For each GPU count a server starts on the simulated GPU; for each rank count this process
publishes that many ranks' samples into its spool (the same typed samples a rank publishes: every
allocator value of the contract, the step-time histogram, a loss), each rank once a second,
spread over the second as independent ranks would be. Then ``--scrapes`` scrapes at ``--rate``
per second on raw sockets with Prometheus' request headers (OpenMetrics, gzip): latency p50/p99, bytes plain
and gzipped, and the server's CPU (utime+stime from /proc) per scrape net of its rate in the windows just before
and after the scrapes, which carries the background renders that changing ranks cause; that rate is
reported too (``busy_share``: the server's CPU share with ranks publishing, between scrapes).
Ranks here are not processes: 64 real ones would measure this machine, not the server.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # puts the repository root on sys.path too
from scrape import memory_mb, raw_get

from harness import Exporter

DOC = common.ROOT / "docs" / "scale.md"
BEGIN, END = "<!-- BEGIN-SCRAPE-COST (benchmarks/scrape_scale.py) -->", "<!-- END-SCRAPE-COST -->"


class Ranks:
    """``n`` ranks' sample files in ``spool``, republished once a second each, from a thread of this process."""

    def __init__(self, spool: str, n: int, gpus: int) -> None:
        from vramwatch import spool as sp

        self.sp = sp
        self.n, self.gpus = n, gpus
        self.pubs = [sp.RankPublisher(spool, r) for r in range(n)]
        self.steps = 0
        self._stop = threading.Event()
        for r in range(n):
            self.pubs[r].publish(self.sample(r))
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def sample(self, r: int) -> Any:
        from vramwatch.monitoring import contract
        from vramwatch.rank.heartbeat import BUCKETS

        sp = self.sp
        values = {m.name: float(1 << 30) + r for m in contract.METRICS if m.collector == "allocator"}
        counts = tuple(range(len(BUCKETS) + 1))
        return sp.RankSample(
            rank=r,
            local_rank=r,
            world_size=self.n,
            hostname="bench",
            pid=os.getpid(),
            time=time.time(),
            devices=(sp.DeviceSample(r % self.gpus, f"GPU-{r % self.gpus:08d}", values),),
            allocator_info=sp.AllocatorInfo("native", "false", "", ""),
            heartbeat=sp.HeartbeatSnapshot(self.steps, time.time(), BUCKETS, counts, 12.5, loss=0.69, grad_norm=1.25),
            collectors={"allocator": sp.CollectorHealth(1, 0, 0.0002)},
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            for r in range(self.n):  # spread over the second
                if self._stop.wait(1.0 / self.n):
                    return
                self.steps += 1
                self.pubs[r].publish(self.sample(r))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for p in self.pubs:
            p.close()


def measure(port: int, pid: int, scrapes: int, rate: float, idle_s: float) -> dict[str, Any]:
    c0, t0 = common.proc_cpu_seconds(pid), time.monotonic()
    time.sleep(idle_s)
    c1, t1 = common.proc_cpu_seconds(pid), time.monotonic()
    busy = (c1 - c0) / (t1 - t0) if c0 is not None and c1 is not None else None
    status, body = common.http_get(f"http://127.0.0.1:{port}/metrics")[:2]
    plain = len(body) if status == 200 else None
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#")) if plain else None
    lat, sizes, errors = [], [], 0
    period = 1.0 / rate
    c2, t2 = common.proc_cpu_seconds(pid), time.monotonic()
    nxt = t2
    for _ in range(scrapes):
        status, n, elapsed = raw_get(port)
        if status == 200:
            lat.append(elapsed)
            sizes.append(n)
        else:
            errors += 1
        nxt += period
        time.sleep(max(0.0, nxt - time.monotonic()))
    c3, t3 = common.proc_cpu_seconds(pid), time.monotonic()
    time.sleep(idle_s)  # the rate again after the scrapes: its mean is what the scrapes did not cause
    c4, t4 = common.proc_cpu_seconds(pid), time.monotonic()
    if busy is not None and c3 is not None and c4 is not None:
        busy = (busy + (c4 - c3) / (t4 - t3)) / 2
    net = None
    if None not in (c2, c3, busy):
        net = max(0.0, (c3 - c2) - busy * (t3 - t2)) / scrapes  # type: ignore[operator]
    return {
        "scrapes": scrapes,
        "errors": errors,
        "p50_ms": _ms(common.percentile(lat, 50)),
        "p99_ms": _ms(common.percentile(lat, 99)),
        "bytes": plain,
        "bytes_gzip": sorted(sizes)[len(sizes) // 2] if sizes else None,  # the response, headers included
        "series": series,
        "cpu_per_scrape_s": (c3 - c2) / scrapes if c2 is not None and c3 is not None else None,
        "cpu_per_scrape_net_s": net,
        "busy_share": busy,
        **memory_mb(pid),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def render_doc(result: dict[str, Any]) -> str:
    rows = [
        "| GPUs | ranks | series | bytes (gzip) | scrape p50 / p99 | server CPU per scrape | "
        "server CPU between scrapes (its renders) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        m = p["result"]

        def f(v: float | None, fmt: str) -> str:
            return "n/a" if v is None else format(v, fmt)

        rows.append(
            f"| {p['gpus']} | {p['ranks']} | {m['series']} | {f(m['bytes'], ',')} ({f(m['bytes_gzip'], ',')}) | "
            f"{f(m['p50_ms'], '.2f')} / {f(m['p99_ms'], '.2f')} ms | "
            f"{f(None if m['cpu_per_scrape_net_s'] is None else m['cpu_per_scrape_net_s'] * 1e3, '.2f')} ms | "
            f"{f(None if m['busy_share'] is None else m['busy_share'] * 100, '.2f')} % of a core |"
        )
    md = result["metadata"]
    rows.append("")
    rows.append(
        f"Measured {md.get('date', '?')[:10]} at `{str(md.get('vramwatch_commit', '?'))[:7]}` "
        f"on {md.get('cpu_model', '?')} "
        f"({md.get('cpu_count', '?')} CPUs, shared with other work: figures vary by tens of per cent between runs); "
        f"{result['settings']['scrapes']} scrapes at {result['settings']['rate']}/s per point."
    )
    return "\n".join(rows) + "\n"


def update_doc(result: dict[str, Any], path: Path = DOC) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no {BEGIN} ... {END} block")
    path.write_text(pattern.sub(lambda _: BEGIN + "\n" + render_doc(result) + END, text))


def doc_block(path: Path = DOC) -> str | None:
    m = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), path.read_text(), re.S)
    return m.group(1) if m else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/scrape_scale.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpus", default="1,2,4,8", help="simulated GPU counts (default 1,2,4,8)")
    p.add_argument("--ranks", default="1,2,4,8,16,32,64", help="rank counts (default 1,2,4,8,16,32,64)")
    p.add_argument("--scrapes", type=int, default=100)
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--idle-seconds", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="10 scrapes, 0.5 s idle windows")
    p.add_argument("--out", default="")
    p.add_argument("--update-doc", action="store_true", help="rewrite docs/scale.md's scrape-cost table")
    p.add_argument("--doc-from", metavar="JSON", help="only rewrite docs/scale.md from a recorded result")
    args = p.parse_args(argv)
    if args.doc_from:
        update_doc(common.read_json(args.doc_from))
        return 0
    settle, gap = 1.5, 1.2  # a render or two with every rank in it; the last point's ranks gone
    if args.quick:
        args.scrapes, args.idle_seconds = min(args.scrapes, 10), min(args.idle_seconds, 0.5)
        settle, gap = 0.4, 0.2
    gpus = sorted({int(x) for x in args.gpus.split(",") if x.strip()})
    ranks = sorted({int(x) for x in args.ranks.split(",") if x.strip()})
    settings = {"scrapes": args.scrapes, "rate": args.rate, "idle_seconds": args.idle_seconds}
    meta = common.metadata(benchmark="scrape_scale", cpu_model=_cpu_model(), **settings)
    out: dict[str, Any] = {"metadata": meta, "settings": settings}
    out["points"] = points = []
    workdir = tempfile.mkdtemp(prefix="vwbench-scale-")
    try:
        for g in gpus:
            exp = Exporter(Path(workdir) / f"g{g}", gpus=g, max_ranks=max(ranks)).start(timeout=60)
            try:
                for n in ranks:
                    rk = Ranks(exp.spool, n, g)
                    try:
                        time.sleep(settle)
                        res = measure(exp.port, exp.proc.pid, args.scrapes, args.rate, args.idle_seconds)  # type: ignore[union-attr]
                    finally:
                        rk.close()
                    points.append({"gpus": g, "ranks": n, "result": res})
                    common.progress(
                        f"{g} GPU(s), {n} rank(s): {res['series']} series, {res['bytes']} B "
                        f"({res['bytes_gzip']} gzipped), p50 {res['p50_ms']:.2f} ms, p99 {res['p99_ms']:.2f} ms, "
                        f"CPU/scrape {(res['cpu_per_scrape_net_s'] or 0) * 1e3:.2f} ms net, "
                        f"busy {(res['busy_share'] or 0) * 100:.2f} %"
                    )
                    if args.out:
                        common.write_json(args.out, out)
                    time.sleep(gap)
            finally:
                exp.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out:
        common.write_json(args.out, out)
    if args.update_doc:
        update_doc(out)
    print(render_doc(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
