"""Do the shipped rules cost the same over Prometheus' head (in memory) as over backfilled blocks?

    python3 benchmarks/fleet_head.py [--nodes 100] [--head-minutes 32] [--out FILE]

benchmarks/fleet.py times the rule groups over a TSDB filled with `promtool tsdb create-blocks-from
openmetrics`, so every rule reads persisted blocks (index, symbols, mmapped chunks). A live fleet's rules read
the last minutes to an hour, which Prometheus keeps in its head. This script measures both over the same
nodes and the same span of data:

- head: a loopback HTTP server (stdlib, threaded, in a forked child) serves ``--nodes`` simulated nodes, each
  node's current exposition from fleet.Fleet (the series of fleet.template(), values moving with the sample
  number from the wall clock), one target per node (``?node=N``, ``instance`` set per target,
  ``honor_labels``). A real Prometheus scrapes them every 15 s with no rules loaded.
- blocks: the same nodes backfilled by fleet.backfill into another TSDB, from the instant the scraping
  starts to ``--ahead-minutes`` past the timing, opened by a second Prometheus (no scrapes, no rules) and
  compacted as fleet.py's is.

Once the head holds ``--head-minutes`` of history, every rule's ``expr`` of deploy/prometheus/rules/*.yml
and a few plain selectors run as instant queries at the wall clock, one query at a time, on each side in
turn (the order alternating by round), ``--repeats`` rounds after one untimed warm-up round; the median
client-side time per side. The recorded series that fleet.py backfills (fleet.RECORD_SOURCES) are scraped
on the head side and backfilled on the blocks side; the records read only at the evaluation instant
(fleet.INSTANT_RECORDS) exist on neither. Rules whose range and offset reach past the head's history read
the same shorter span on both sides (the JSON lists them). Before timing, the CPU share of the scraping
Prometheus and of the server over ``--cpu-window`` idle seconds, so one can see the scraping does not
distort the timing. Progress goes to stderr; the JSON is rewritten as it goes; everything started is
stopped on exit.
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import common  # puts the repository root on sys.path too
import fleet
from common import progress

from harness import Prometheus, die_with, find_tool
from harness.servers import EXPORTER_JOB
from vramwatch.monitoring.config import parse_duration
from vramwatch.monitoring.dashboards.walk import TimeContext

OUT = common.ROOT / "benchmarks" / "results" / "2026-12-07-fleet-head" / "head-vs-blocks.json"
SIDES = ("head", "blocks")
# plain selectors, for the cost per series selected on each side
SELECTORS = (
    "count(gpu_up)",
    "count(gpu_xid_errors_total)",
    "count(rate(gpu_xid_errors_total[15m]))",
    "count(rate(vramwatch_training_step_duration_seconds_bucket[15m]))",
    "count(max_over_time(torch_cuda_memory_allocated_bytes[30m]))",
)
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


# --- the nodes' live expositions ---


def sample_number(t: float, origin: float) -> int:
    """The sample number fleet.backfill gives time ``t`` of a history starting at ``origin``."""
    return int((t - origin) // fleet.SCRAPE_INTERVAL)


def exposition(f: fleet.Fleet, node: int, t: float, origin: float) -> str:
    """Node ``node``'s exposition at time ``t``: the lines of the backfill at that time, without timestamps."""
    return f.lines(node, sample_number(t, origin), t, stamp=False)


class _Handler(BaseHTTPRequestHandler):
    server: _FleetHTTPServer

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        try:
            node = int(query["node"][0])
            if url.path != "/metrics" or not 0 <= node < len(self.server.fleet.prefixes):
                raise ValueError(node)
        except (KeyError, ValueError):
            self.send_error(404, f"no node in {self.path!r}: /metrics?node=0..{len(self.server.fleet.prefixes) - 1}")
            return
        body = exposition(self.server.fleet, node, time.time(), self.server.origin).encode()
        self.send_response(200)
        self.send_header("Content-Type", TEXT_FORMAT)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would flood stderr


class _FleetHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, f: fleet.Fleet, origin: float) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fleet, self.origin = f, origin


class FleetServer:
    """The nodes' expositions on one loopback port, served by a forked child (its CPU is its own, and it
    holds no lock the timing client needs). A context manager: the child goes on exit, and with its parent."""

    def __init__(self, f: fleet.Fleet, origin: float) -> None:
        self.http = _FleetHTTPServer(f, origin)  # bound here, so the port is known before the fork
        self.port = self.http.server_address[1]
        self.proc = multiprocessing.get_context("fork").Process(target=self._serve, daemon=True)

    def _serve(self) -> None:
        die_with(signal.SIGTERM)()
        self.http.serve_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def __enter__(self) -> FleetServer:
        self.proc.start()
        self.http.server_close()  # the child's copy serves
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def head_config(port: int, nodes: int, interval: float = fleet.SCRAPE_INTERVAL) -> dict[str, Any]:
    """fleet.py's Prometheus configuration, no rules, scraping each node as its own target."""
    cfg = fleet.prometheus_config([], interval)
    cfg["global"]["scrape_interval"] = f"{interval:g}s"
    cfg["scrape_configs"] = [
        {
            "job_name": EXPORTER_JOB,
            "scrape_interval": f"{interval:g}s",
            "scrape_timeout": f"{min(interval, 10.0):g}s",
            "honor_labels": True,  # the exposition carries fleet.py's job and instance
            "static_configs": [
                {
                    "targets": [f"127.0.0.1:{port}"],
                    "labels": {"__param_node": str(i), "instance": f"{fleet.node_name(i)}:9488"},
                }
                for i in range(nodes)
            ],
        }
    ]
    return cfg


# --- what is timed ---


@dataclass(frozen=True)
class Query:
    group: str  # a rule group, or "selectors"
    name: str  # the record or alert (its index in the group too: warning and critical share a name)
    expr: str


def rule_queries(rules: Path = fleet.RULES) -> list[Query]:
    import yaml

    out = []
    for path in sorted(rules.glob("*.yml")):
        for g in yaml.safe_load(path.read_text())["groups"]:
            for i, r in enumerate(g["rules"]):
                out.append(Query(g["name"], f"{i:02d} {r.get('record') or r.get('alert')}", r["expr"]))
    return out


_RANGE = re.compile(r"\[(\w+)(?::\w*)?\]")
_OFFSET = re.compile(r"\boffset\s+(\w+)")


def lookback_s(expr: str) -> float:
    """How far before the evaluation time ``expr`` can read: its longest range plus its longest offset."""
    ranges = [parse_duration(d) for d in _RANGE.findall(expr)]
    offsets = [parse_duration(d) for d in _OFFSET.findall(expr)]
    return max(ranges, default=0.0) + max(offsets, default=0.0)


def timed(prom: Prometheus, q: Query, t: float) -> tuple[float, int]:
    """(client-side seconds, result series) of ``q`` as an instant query at ``t``."""
    return fleet.time_query(prom, fleet.PanelQuery(q.group, q.name, "", q.expr, True), TimeContext(t, t, 15.0), {})


def time_all(proms: dict[str, Prometheus], queries: list[Query], repeats: int) -> list[dict[str, Any]]:
    """One untimed round, then ``repeats`` rounds of every query on each side in turn, one at a time."""
    runs: dict[tuple[int, str], list[float]] = {}
    results: dict[tuple[int, str], set[int]] = {}
    for r in range(repeats + 1):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for n, q in enumerate(queries):
            t = time.time()
            for side in order:
                dt, series = timed(proms[side], q, t)
                results.setdefault((n, side), set()).add(series)
                if r:
                    runs.setdefault((n, side), []).append(dt)
        progress(f"fleet_head: round {r}/{repeats} done" + (" (warm-up, untimed)" if r == 0 else ""))
    out = []
    for n, q in enumerate(queries):
        row: dict[str, Any] = {"group": q.group, "name": q.name, "expr": q.expr, "lookback_s": lookback_s(q.expr)}
        for side in SIDES:
            vals = runs[(n, side)]
            row[side] = {
                "median_s": statistics.median(vals),
                "min_s": min(vals),
                "max_s": max(vals),
                "runs_s": vals,  # by round: both sides' n-th runs were at the same instant, a pair
                "result_series": sorted(results[(n, side)]),
            }
        row["ratio_blocks_over_head"] = _ratio(row["blocks"]["median_s"], row["head"]["median_s"])
        out.append(row)
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def per_group(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per rule group, the sum of its rules' medians on each side."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        g = out.setdefault(row["group"], {"rules": 0, "head_s": 0.0, "blocks_s": 0.0})
        g["rules"] += 1
        g["head_s"] += row["head"]["median_s"]
        g["blocks_s"] += row["blocks"]["median_s"]
    for g in out.values():
        g["ratio_blocks_over_head"] = _ratio(g["blocks_s"], g["head_s"])
    return out


def per_series(proms: dict[str, Prometheus], rows: list[dict[str, Any]], t: float) -> list[dict[str, Any]]:
    """The selectors' cost per series selected (each is a count(), whose value is the series it selected)."""
    out = []
    for row in rows:
        entry: dict[str, Any] = {"expr": row["expr"]}
        for side in SIDES:
            r = proms[side].query(row["expr"], t, timeout=600)
            series = float(r[0]["value"][1]) if r else 0.0
            med = row[side]["median_s"]
            entry[side] = {"series": series, "median_s": med, "us_per_series": med / series * 1e6 if series else None}
        entry["ratio_blocks_over_head"] = _ratio(entry["blocks"]["median_s"], entry["head"]["median_s"])
        out.append(entry)
    return out


# --- the processes' own figures ---


def cpu_shares(pids: dict[str, int], seconds: float) -> dict[str, float | None]:
    """Each process's CPU over ``seconds`` with no queries running, as a share of one core."""
    before = {k: common.proc_cpu_seconds(p) for k, p in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    el = time.monotonic() - t0
    after = {k: common.proc_cpu_seconds(p) for k, p in pids.items()}
    out: dict[str, float | None] = {}
    for k in pids:
        a, b = before[k], after[k]
        out[k] = None if a is None or b is None else (b - a) / el
    return out


def tsdb_state(prom: Prometheus) -> dict[str, float]:
    text = fleet.self_metrics(prom)
    names = (
        "prometheus_tsdb_head_series",
        "prometheus_tsdb_head_chunks",
        "prometheus_tsdb_blocks_loaded",
        "process_resident_memory_bytes",
    )
    return {n: fleet.metric_values(text, n).get("", 0.0) for n in names}


def scraped_series(prom: Prometheus, t: float) -> float:
    """The series of the fleet at ``t`` (not Prometheus' own scrape_* series, which only the head has)."""
    r = prom.query(f'count({{job="{EXPORTER_JOB}", __name__!~"scrape_.*"}})', t, timeout=600)
    return float(r[0]["value"][1]) if r else 0.0


def wait_scraped(prom: Prometheus, nodes: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = prom.query(f'count(up{{job="{EXPORTER_JOB}"}} == 1)')
        if r and int(float(r[0]["value"][1])) == nodes:
            return
        time.sleep(1)
    raise SystemExit(f"fleet_head: not every one of the {nodes} targets was scraped in {timeout:.0f} s")


# --- the run ---


def render_table(result: dict[str, Any]) -> str:
    lines = ["| rule group | rules | head | blocks | blocks / head |", "|---|---|---|---|---|"]
    for name, g in result["rule_groups"].items():
        lines.append(
            f"| `{name}` | {g['rules']} | {fleet._sec(g['head_s'])} | {fleet._sec(g['blocks_s'])} | "
            f"{_x(g['ratio_blocks_over_head'])} |"
        )
    lines += ["", "| selector | series | head µs/series | blocks µs/series | blocks / head |", "|---|---|---|---|---|"]
    for s in result["selectors"]:
        h, b = s["head"], s["blocks"]
        lines.append(
            f"| `{s['expr']}` | {h['series']:.0f} / {b['series']:.0f} | {_us(h['us_per_series'])} | "
            f"{_us(b['us_per_series'])} | {_x(s['ratio_blocks_over_head'])} |"
        )
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _us(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=100, help="simulated nodes (8 GPUs and 8 ranks each)")
    p.add_argument("--nodes-per-job", type=int, default=16, help="nodes per training job (job_id, global rank)")
    p.add_argument("--head-minutes", type=float, default=32.0, help="head history before the timing starts")
    p.add_argument("--ahead-minutes", type=float, default=20.0, help="the blocks' history past the start of the timing")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds of every query (median)")
    p.add_argument("--cpu-window", type=float, default=60.0, help="idle seconds over which CPU shares are read")
    p.add_argument("--jobs", type=int, default=1, help="promtools backfilling at once")
    p.add_argument("--file-gb", type=float, default=2.0, help="largest OpenMetrics file to write at once")
    p.add_argument("--quiet-seconds", type=float, default=90.0, help="compaction counts still this long: done")
    p.add_argument("--work", help="where the run's directory (both TSDBs, removed at the end) is made")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if find_tool("prometheus") is None or find_tool("promtool") is None:
        print("fleet_head: needs Debian's prometheus and promtool (make tools, or TEST_TOOLS_DIR)", file=sys.stderr)
        return 2
    series, checks = fleet.template()
    live = fleet.Fleet.build(series, args.nodes, args.nodes_per_job, up=False)  # Prometheus adds each target's up
    filled = fleet.Fleet.build(series, args.nodes, args.nodes_per_job)
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vramwatch-fleet-head-", dir=args.work))
    result: dict[str, Any] = {
        "what": "the shipped rules as instant queries over Prometheus' head and over backfilled blocks "
        "of the same simulated nodes and span (benchmarks/fleet_head.py)",
        "meta": common.metadata(),
        "settings": vars(args),
        "template": {"series_per_node": filled.per_node(), **checks},
        "records": {
            "scraped_and_backfilled": sorted(fleet.RECORD_SOURCES),
            "on_neither_side": sorted(fleet.INSTANT_RECORDS),
        },
    }
    proms: dict[str, Prometheus] = {}
    try:
        # both sides' values at time t are those of sample number (t - origin) / 15, as fleet.backfill numbers them
        origin = time.time() // fleet.SCRAPE_INTERVAL * fleet.SCRAPE_INTERVAL
        with FleetServer(live, origin) as server:
            head = fleet.FleetPrometheus(
                work, config=head_config(server.port, args.nodes), retention="30d", lifecycle=False, detach=True
            )
            proms["head"] = head
            head.start(timeout=120)
            wait_scraped(head, args.nodes, 60)
            start = time.time()
            progress(f"fleet_head: Prometheus scrapes {args.nodes} nodes of {live.per_node()} series at {server.url}")
            timing_at = start + args.head_minutes * 60
            end = timing_at + args.ahead_minutes * 60
            blocks_dir = work / "blocks"
            (blocks_dir / "tsdb").mkdir(parents=True)
            result["backfill"] = fleet.backfill(
                filled, range(args.nodes), origin, end, blocks_dir / "tsdb", blocks_dir, args.file_gb * 1e9, args.jobs
            )
            common.write_json(args.out, result)
            blocks = fleet.FleetPrometheus(
                blocks_dir,
                config=fleet.prometheus_config([], fleet.SCRAPE_INTERVAL),
                tsdb=blocks_dir / "tsdb",
                retention="30d",
                lifecycle=False,
                detach=True,
            )
            proms["blocks"] = blocks
            blocks.start(timeout=900)
            result["blocks_compaction"] = fleet.wait_quiet(blocks, args.quiet_seconds, 1800)
            while (left := timing_at - time.time()) > 0:
                st = tsdb_state(head)
                progress(
                    f"fleet_head: head {st['prometheus_tsdb_head_series']:.0f} series, "
                    f"{(time.time() - start) / 60:.1f} min of history; timing in {left / 60:.1f} min"
                )
                time.sleep(min(60.0, left))
            assert head.proc is not None and blocks.proc is not None
            progress(f"fleet_head: CPU shares over {args.cpu_window:.0f} idle s")
            pids = {"head_prometheus": head.proc.pid, "server": server.pid, "blocks_prometheus": blocks.proc.pid}
            result["cpu_share_idle"] = cpu_shares(pids, args.cpu_window)
            now = time.time()
            result["history"] = {"start": start, "timing_at": now, "head_history_s": now - start, "blocks_end": end}
            result["series"] = {side: scraped_series(proms[side], now) for side in SIDES}
            result["tsdb_before"] = {side: tsdb_state(proms[side]) for side in SIDES}
            progress(f"fleet_head: series at {time.ctime(now)}: {result['series']}")
            common.write_json(args.out, result)
            rules = rule_queries()
            selectors = [Query("selectors", s, s) for s in SELECTORS]
            rows = time_all(proms, rules + selectors, args.repeats)
            if time.time() > end:
                raise SystemExit("fleet_head: the timing ran past the blocks' history: a larger --ahead-minutes")
            result["rules"] = rows[: len(rules)]
            result["rule_groups"] = per_group(result["rules"])
            result["selectors"] = per_series(proms, rows[len(rules) :], time.time())
            result["reads_past_the_head"] = [
                f"{r['group']} / {r['name']}"
                for r in result["rules"]
                if r["lookback_s"] > result["history"]["head_history_s"]
            ]
            result["result_series_differ"] = [
                f"{r['group']} / {r['name']}"
                for r in result["rules"]
                if r["head"]["result_series"] != r["blocks"]["result_series"]
            ]
            result["tsdb_after"] = {side: tsdb_state(proms[side]) for side in SIDES}
            result["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
            common.write_json(args.out, result)
    finally:
        for prom in proms.values():
            prom.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(render_table(result))
    progress(f"fleet_head: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
