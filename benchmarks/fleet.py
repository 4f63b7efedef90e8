"""What the shipped rules and dashboards cost one Prometheus over a whole fleet of vramwatch nodes.

    python3 benchmarks/fleet.py --nodes 125,250 [--history-hours 6] [--out benchmarks/results/fleet.json] [--doc]

One node's series are those of a real scrape: `vramwatch serve` on the simulated GPU with 8 GPUs and 8 ranks
(series_count.SimulatedNode), every family checked against the contract (vramwatch/monitoring/contract.py),
which also says how each one moves (counters and histograms grow, ``*_timestamp_seconds`` gauges follow
the clock, other gauges jitter by a few parts per thousand). The fleet is that node repeated: each copy
gets its own ``instance`` (``node-NNNN:9488``, job ``vramwatch``), ``hostname``, GPU uuids and PCI ids, and
its ranks belong to jobs of ``--nodes-per-job`` nodes (``job_id``, global ``rank``); Prometheus' own ``up``
is added per node. History at the scrape interval (15 s) runs from ``--history-hours`` ago to
``--ahead-minutes`` past the start, so the rules always evaluate over fresh data. It is written as
OpenMetrics, one 2 h window and group of nodes at a time, and backfilled with `promtool tsdb
create-blocks-from openmetrics` (the next file is written while promtool reads the last).

Then a real Prometheus (Debian's, from `make tools`) opens that TSDB with the shipped rule files
(deploy/prometheus/rules/*.yml, whatever they are when this runs), an out-of-order window so that rule
results may land beside data ahead of the clock, and compaction limited to the overlapping blocks the node
groups leave. Once compaction is quiet it records, per size:

- each rule group's evaluation time, ``prometheus_rule_group_last_duration_seconds`` over
  ``--evaluations`` evaluations (median and max);
- each dashboard panel's query time over the last 6 h (deploy/grafana/dashboards/*.json: every target of
  every panel, ``$__rate_interval`` and ``$__interval`` as Grafana sets them for ``--step``), instant
  targets at the end; median of ``--repeats`` runs, client-side wall time, the panel's time being the sum
  of its targets (Grafana sends them at once; on two loaded cores they queue). Twice: with every variable
  at All, and with one job chosen (``job_id``); the variables' own queries run first, in order, on this
  Prometheus's series API as Grafana runs them when a dashboard opens (timed too: they delay the panels),
  and a variable without a custom All (host) expands to the values its query offers;
- the series per GPU and per rank, from the TSDB itself, and Prometheus' RSS.

Sizes that do not fit the machine are extrapolated from a least-squares line through the measured ones;
the JSON and the table say which figures were measured and which extrapolated. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common  # puts the repository root on sys.path too
import yaml
from common import progress

from harness import Prometheus, find_tool, http_get
from harness.servers import EXPORTER_JOB
from vramwatch.monitoring import contract, promql
from vramwatch.monitoring.dashboards.walk import TimeContext, Variable, json_variables, substitute
from vramwatch.report import data as report_data
from vramwatch.report.prom import PromClient
from vramwatch.spool.schema import MEMORY_ROLES

ROOT = common.ROOT
RULES = ROOT / "deploy" / "prometheus" / "rules"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
DOC = ROOT / "docs" / "scale.md"
SCRAPE_INTERVAL = 15.0
PANEL_RANGE = 6 * 3600.0
WINDOW = 2 * 3600  # promtool's block range: files never straddle one
RULE_TARGET_S, PANEL_TARGET_S, TARGET_NODES = 1.0, 2.0, 1000
SELECTIONS = ("all", "job")
CHOSEN_JOB = "job-0000"  # the job the drill-down dashboards are opened with (the first --nodes-per-job nodes)
VARIABLES_IN_TURN = "the variables' own queries, in turn"
TROUBLE = re.compile(r"xid|ecc|oom|retr|remapped|replay|error|fail|drop|refus|lost|restart")
JITTER = tuple(1.0 + 0.002 * math.sin(k) for k in range(16))  # gauges wiggle, so chunks hold real XOR deltas


# --- one node's series, from a real scrape ---


@dataclass(frozen=True)
class Series:
    name: str
    labels: dict[str, str]
    value: float
    kind: str  # counter | gauge | clock (a *_timestamp_seconds gauge that follows time) | const


def template(ranks: int = 8, gpus: int = 8) -> tuple[list[Series], dict[str, Any]]:
    """One simulated node's series (its exposition, parsed), and what the contract says about them."""
    from prometheus_client.parser import text_string_to_metric_families
    from series_count import SimulatedNode, get

    progress(f"fleet: one simulated node ({gpus} GPUs, {ranks} ranks) for the series of a real scrape")
    with SimulatedNode(ranks, gpus) as node:
        node.wait_complete()
        time.sleep(12)  # past the slow NVML cadence (10 s): every family a node shows in steady state
        text = get(node.url).decode()
    specs = {m.name: m for m in contract.METRICS}
    out: list[Series] = []
    unknown: set[str] = set()
    for fam in text_string_to_metric_families(text):
        spec = specs.get(fam.name) or specs.get(fam.name + "_total")
        if spec is None:
            unknown.add(fam.name)
        for s in fam.samples:
            out.append(Series(s.name, dict(s.labels), float(s.value), _kind(s.name, fam.type, spec)))
    added = watched_job_series(out)
    out += added
    out += recorded_series(out)
    seen = {s.name for s in out}
    absent = sorted(m.name for m in contract.METRICS if not _exposed(m, seen))
    return out, {
        "families_not_in_contract": sorted(unknown),
        "contract_families_not_exposed": absent,
        "added_for_a_watched_trainer_job": sorted({s.name for s in added}),
    }


# What a rank of a Trainer job with the callback adds and the simulated rank does not publish: memory by
# role (watch()), tokens (include_num_input_tokens_seen), FLOPs per token (watch(flops_per_token=)) and the
# logged grad norm. Labels from the contract, label values from the rank's own allocator series.
WATCHED = {
    "vramwatch_memory_role_bytes": 1.5e9,
    "vramwatch_training_tokens_total": 1.0e9,
    "vramwatch_model_flops_per_token": 7.6e8,
    "vramwatch_training_grad_norm": 0.8,
    # a torch.distributed job: the default group's collectives, the input wait (NCCL: no collective wait)
    "vramwatch_collectives_total": 1.0e5,
    "vramwatch_training_wait_seconds_total": 60.0,
    "vramwatch_training_samples_total": 1.0e6,
}
WAIT_KINDS = ("data",)

# The rules' recorded series whose history the dashboards or the rules' ranges read, each with the family
# whose labels it keeps: backfilled as the rules would have recorded them, one sample per evaluation,
# up to the time the panels are timed at (the rules record on from there). The others are read only at the
# evaluation instant, by the alerts (and the Xid one exists only where a GPU had events).
RECORD_SOURCES = {
    promql.STEP_MEAN_RECORD: "vramwatch_training_step_duration_seconds_count",
    promql.STEP_SKEW_RECORD: "vramwatch_training_step_duration_seconds_count",
    promql.STALL_MEAN_RECORD: "vramwatch_training_step_duration_seconds_count",
    promql.LEAK_PROJECTION_RECORD: "torch_cuda_memory_step_peak_allocated_bytes",
    promql.PEAK_FLOPS_RECORD: "torch_cuda_memory_allocated_bytes",
    promql.MEMORY_RATIO_RECORD: "gpu_memory_used_bytes",
}
INSTANT_RECORDS = (
    promql.BUDGET_RATIO_RECORD,
    promql.XID_EVENTS_RECORD,
    promql.GPU_JOB_RECORD,
    promql.RECOVERY_ACTION_RECORD,
    promql.BUSY_STALL_RECORD,
    promql.HANG_SIGNATURE_RECORD,
    promql.OWN_MEAN_RECORD,
    promql.OWN_SKEW_RECORD,
    promql.INPUT_WAIT_MEAN_RECORD,
    promql.INPUT_WAIT_SKEW_RECORD,
)


def watched_job_series(series: list[Series]) -> list[Series]:
    have = {s.name for s in series}
    ranks = [s.labels for s in series if s.name == "torch_cuda_memory_allocated_bytes"]
    out = []
    for name, value in WATCHED.items():
        if name in have:
            continue
        spec = contract.spec(name)
        for labels in ranks:
            base = {k: labels[k] for k in spec.labels if k in labels}
            if "role" in spec.labels:
                for role in MEMORY_ROLES:
                    out.append(Series(name, {**base, "role": role}, value, "gauge"))
            elif "kind" in spec.labels:
                for kind in WAIT_KINDS:
                    out.append(Series(name, {**base, "kind": kind}, value, "counter"))
            else:
                kind = "counter" if spec.type == "counter" else "gauge"
                out.append(Series(name, base, value, kind))
    return out


def recorded_series(series: list[Series]) -> list[Series]:
    """The records of RECORD_SOURCES, one per series of its source family (labels kept, ``le`` never there)."""
    missing = sorted(set(promql.RECORDS) - set(RECORD_SOURCES) - set(INSTANT_RECORDS))
    if missing:
        raise SystemExit(f"fleet: no source family for the records {missing}: add them to RECORD_SOURCES")
    return [
        Series(record, dict(s.labels), 0.5, "record")
        for record, source in RECORD_SOURCES.items()
        for s in series
        if s.name == source
    ]


def _exposed(m: contract.MetricSpec, seen: set[str]) -> bool:
    return m.name in seen or any(m.name + sfx in seen for sfx in ("_bucket", "_count", "_sum", "_info"))


def _kind(name: str, fam_type: str, spec: contract.MetricSpec | None) -> str:
    if fam_type in ("counter", "histogram") or name.endswith(("_total", "_bucket", "_count", "_sum")):
        return "counter"
    if name.endswith("_timestamp_seconds") and "xid" not in name:
        return "clock"  # last step, last sample: a live fleet's are now
    if fam_type == "info" or name.endswith("_info") or (spec is not None and spec.type == "info"):
        return "const"
    return "gauge"


# --- the fleet: the node repeated with its own identity ---


def node_name(i: int) -> str:
    return f"node-{i:04d}"


def relabel(labels: dict[str, str], i: int, per_job: int, local_ranks: int) -> dict[str, str]:
    """Node ``i``'s copy of one series' labels: its instance, hostname, GPUs and its job's ranks."""
    out = {k: v for k, v in labels.items()}
    host = node_name(i)
    for key, v in labels.items():
        if key == "hostname":
            out[key] = host
        elif key == "uuid" and v:
            out[key] = _unique(v, i)
        elif key == "pci_bus_id" and v:
            out[key] = f"{i:08X}" + v[8:]
        elif key == "job_id" and v:
            out[key] = f"job-{i // per_job:04d}"
        elif key == "rank" and v:
            out[key] = str((i % per_job) * local_ranks + int(v) % local_ranks)
        elif key == "world_size" and v:
            out[key] = str(per_job * local_ranks)
    out["job"] = EXPORTER_JOB
    out["instance"] = f"{host}:9488"
    return out


def _unique(uuid: str, i: int) -> str:
    head, _, rest = uuid.partition("-")
    return f"{head}-{i:08x}{rest[8:]}" if len(rest) > 8 else f"{uuid}-{i:04d}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def line_prefix(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "} "


@dataclass
class Fleet:
    """Per node, each series' line prefix and how its value moves with the sample number."""

    prefixes: list[list[str]]  # [node][series], the recorded series last
    base: list[float]
    step: list[float]  # per sample, for counters
    kinds: list[str]
    records_until: float = math.inf  # the recorded series' history ends here (the rules record after it)

    @classmethod
    def build(
        cls, series: list[Series], nodes: int, per_job: int, records_until: float = math.inf, up: bool = True
    ) -> Fleet:
        local = 1 + max((int(s.labels["local_rank"]) for s in series if s.labels.get("local_rank")), default=0)
        raw = [s for s in series if s.kind != "record"] + ([Series("up", {}, 1.0, "const")] if up else [])
        ordered = [*raw, *(s for s in series if s.kind == "record")]
        prefixes = [[line_prefix(s.name, relabel(s.labels, i, per_job, local)) for s in ordered] for i in range(nodes)]
        steps = [_counter_step(s, series) for s in ordered]
        return cls(prefixes, [s.value for s in ordered], steps, [s.kind for s in ordered], records_until)

    def per_node(self) -> int:
        return len(self.base)

    def live(self) -> int:
        """How many of a node's series are scraped ones (the rest are records)."""
        return sum(1 for k in self.kinds if k != "record")

    def lines(self, node: int, k: int, t: float, stamp: bool = True) -> str:
        """Node ``node``'s samples at sample number ``k`` (time ``t``), one OpenMetrics line each; without
        ``stamp``, no timestamps (a live scrape's exposition: the scraper stamps it)."""
        ts = f" {t:.3f}\n" if stamp else "\n"
        fixed = self._fixed()[k % len(JITTER)]
        clock = repr(t - 1.0)
        out = []
        n = self.per_node() if t <= self.records_until else self.live()
        for p, v, b, st, kind in zip(
            self.prefixes[node][:n], fixed[:n], self.base[:n], self.step[:n], self.kinds[:n], strict=True
        ):
            if kind == "counter":
                v = repr(b + st * k)
            elif kind == "clock":
                v = clock
            out.append(p + v + ts)
        return "".join(out)

    def _fixed(self) -> list[list[str]]:
        """Gauges' and constants' values as text, per jitter state (the same for every node)."""
        cache = getattr(self, "_fixed_cache", None)
        if cache is None:
            cache = [
                [
                    repr(b * j if kind in ("gauge", "record") else b)
                    for b, kind in zip(self.base, self.kinds, strict=True)
                ]
                for j in JITTER
            ]
            self._fixed_cache = cache
        return cache


def _counter_step(s: Series, all_series: list[Series]) -> float:
    """A counter's growth per 15 s sample: histograms as one step a second spread like the template's
    buckets; others by a thousandth of their value (at least 1), so rate() has something to see."""
    if s.kind != "counter":
        return 0.0
    if s.name.endswith(("_bucket", "_count", "_sum")):
        fam = s.name.rsplit("_", 1)[0]
        key = {k: v for k, v in s.labels.items() if k != "le"}
        count = next(
            (x.value for x in all_series if x.name == fam + "_count" and x.labels == key),
            0.0,
        )
        per_sample = SCRAPE_INTERVAL  # one step a second
        if s.name.endswith("_count"):
            return per_sample
        if s.name.endswith("_sum"):
            total = next((x.value for x in all_series if x.name == fam + "_sum" and x.labels == key), 0.0)
            return per_sample * (total / count if count else 0.1)
        return per_sample * (s.value / count if count else 1.0)
    if TROUBLE.search(s.name):
        return 0.0  # a healthy fleet: no OOMs, retries, Xids, ECC errors; the alerts stay quiet
    return max(1.0, abs(s.value) * 1e-3)


# --- backfill ---


def backfill(
    fleet: Fleet,
    nodes: range,
    start: float,
    end: float,
    tsdb: Path,
    work: Path,
    group_bytes: float,
    jobs: int,
    origin: float | None = None,
) -> dict:
    """OpenMetrics files (2 h windows x node groups) into ``jobs`` promtools at once, the next file written
    while they read. Each file holds its series one after another (all of a series' samples together),
    which promtool reads about a quarter faster than one scrape after another."""
    promtool = find_tool("promtool")
    if promtool is None:
        raise SystemExit("fleet: promtool not found (make tools, or TEST_TOOLS_DIR)")
    per_node_window = fleet.per_node() * (WINDOW / SCRAPE_INTERVAL) * 190  # ~bytes a node's 2 h window writes
    group = max(1, min(len(nodes), int(group_bytes // per_node_window)))
    first = int(start // SCRAPE_INTERVAL) * SCRAPE_INTERVAL
    # sample numbers count from the history's origin, so counters extended later carry on without a reset
    zero = first if origin is None else int(origin // SCRAPE_INTERVAL) * SCRAPE_INTERVAL
    windows = []
    w = int(first // WINDOW) * WINDOW
    while w < end:
        windows.append((max(first, w), min(end, w + WINDOW)))
        w += WINDOW
    chunks = [
        (a, b, n0, min(nodes.stop, n0 + group)) for a, b in windows for n0 in range(nodes.start, nodes.stop, group)
    ]
    progress(
        f"fleet: backfilling nodes {nodes.start}-{nodes.stop - 1} x {fleet.per_node()} series, "
        f"{len(windows)} windows, {len(chunks)} files, {jobs} promtools at once"
    )
    t0 = time.monotonic()
    running: list[tuple[subprocess.Popen, Path]] = []
    samples = 0
    written = 0

    def reap(keep: int) -> None:
        while len(running) > keep:
            proc, path = running.pop(0)
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"fleet: promtool failed on {path}: {err.decode()[-2000:]}")
            path.unlink()

    try:
        for n, (a, b, n0, n1) in enumerate(chunks):
            path = work / f"chunk-{n:04d}.om"
            with open(path, "w", encoding="utf-8", buffering=1 << 22) as fh:
                k0 = int(round((a - zero) / SCRAPE_INTERVAL))
                count = int(math.ceil((b - a) / SCRAPE_INTERVAL - 1e-9))
                for node in range(n0, n1):
                    rows = [fleet.lines(node, k0 + j, a + j * SCRAPE_INTERVAL).splitlines(True) for j in range(count)]
                    for i in range(fleet.per_node()):
                        fh.write("".join(r[i] for r in rows if i < len(r)))
                        # (a record's rows end at records_until: shorter rows hold only the scraped series)
                    samples += sum(len(r) for r in rows)
                fh.write("# EOF\n")
            written += path.stat().st_size
            reap(jobs - 1)
            running.append(
                (
                    subprocess.Popen(
                        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(path), str(tsdb)],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                    ),
                    path,
                )
            )
            el = time.monotonic() - t0
            progress(
                f"fleet: file {n + 1}/{len(chunks)} ({n1 - n0} nodes, {(b - a) / 3600:.1f} h, "
                f"{path.stat().st_size / 1e9:.2f} GB) written; {samples / 1e6:.0f} M samples so far, {el:.0f} s"
            )
        reap(0)
    finally:
        for proc, _ in running:
            proc.kill()
    return {
        "nodes": [nodes.start, nodes.stop],
        "samples": samples,
        "openmetrics_bytes": written,
        "files": len(chunks),
        "nodes_per_file": group,
        "seconds": round(time.monotonic() - t0, 1),
    }


# --- Prometheus over the backfilled TSDB ---


def prometheus_config(rule_files: list[str], interval: float) -> dict[str, Any]:
    return {
        "global": {"evaluation_interval": f"{interval:g}s", "scrape_interval": f"{SCRAPE_INTERVAL:g}s"},
        "rule_files": rule_files,
        # rule results are written at the clock, behind data that runs ahead of it
        "storage": {"tsdb": {"out_of_order_time_window": "2h"}},
        "scrape_configs": [],
    }


class FleetPrometheus(Prometheus):
    """Prometheus over a backfilled TSDB, compaction only of what overlaps (min = max block duration)."""

    def command(self) -> list[str]:
        return [
            *super().command(),
            "--storage.tsdb.min-block-duration=2h",
            "--storage.tsdb.max-block-duration=2h",
            "--query.timeout=5m",
            "--query.max-samples=500000000",
        ]


@contextlib.contextmanager
def over_tsdb(work: Path, hist: History, args: argparse.Namespace, rules: Path | None = None) -> Iterator[Prometheus]:
    """A started FleetPrometheus over the size's TSDB, evaluating the rule files in ``rules`` (None: no rules)."""
    rule_files = sorted(str(p) for p in rules.glob("*.yml")) if rules else []
    cfg = prometheus_config(rule_files, args.evaluation_interval)
    prom = FleetPrometheus(work, config=cfg, tsdb=hist.tsdb, retention="30d", lifecycle=False)
    try:
        prom.start(timeout=900)
        yield prom
    finally:
        prom.stop()


def self_metrics(prom: Prometheus) -> str:
    return http_get(prom.url + "/metrics", 10)[1].decode()


def metric_values(text: str, name: str) -> dict[str, float]:
    """One family of Prometheus' own /metrics, keyed by its rule_group label (or "" without one)."""
    out = {}
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        out[labels.get("rule_group", "")] = float(m.group(2))
    return out


def wait_quiet(prom: Prometheus, quiet_s: float, timeout: float) -> dict[str, float]:
    """Until the block count and the compaction count hold still for ``quiet_s`` (compaction done)."""
    last: tuple[float, float] | None = None
    since = time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = self_metrics(prom)
        now = (
            metric_values(text, "prometheus_tsdb_blocks_loaded").get("", 0.0),
            metric_values(text, "prometheus_tsdb_compactions_total").get("", 0.0),
        )
        if now != last:
            last, since = now, time.monotonic()
            progress(f"fleet: blocks {now[0]:.0f}, compactions {now[1]:.0f}")
        elif time.monotonic() - since >= quiet_s:
            return {"blocks": now[0], "compactions": now[1]}
        time.sleep(5)
    progress("fleet: compaction still moving; measuring anyway")
    assert last is not None
    return {"blocks": last[0], "compactions": last[1]}


def rule_durations(prom: Prometheus, evaluations: int, interval: float) -> dict[str, dict[str, Any]]:
    """Each group's last duration after each of its next ``evaluations`` evaluations."""
    seen: dict[str, list[float]] = {}
    stamps: dict[str, float] = {}
    deadline = time.monotonic() + interval * (evaluations + 3) + 120
    while time.monotonic() < deadline:
        text = self_metrics(prom)
        last = metric_values(text, "prometheus_rule_group_last_evaluation_timestamp_seconds")
        dur = metric_values(text, "prometheus_rule_group_last_duration_seconds")
        for g, ts in last.items():
            if ts > 0 and stamps.get(g) != ts:
                stamps[g] = ts
                seen.setdefault(g, []).append(dur.get(g, float("nan")))
        if seen and all(len(v) > evaluations for v in seen.values()):
            break
        time.sleep(max(1.0, interval / 5))
    missed = metric_values(self_metrics(prom), "prometheus_rule_group_iterations_missed_total")
    per_rule = rule_times(prom)
    out = {}
    for g, vals in sorted(seen.items()):
        vals = vals[1:] or vals  # the first evaluation reads cold blocks
        out[_group_name(g)] = {
            "median_s": statistics.median(vals),
            "max_s": max(vals),
            "evaluations": len(vals),
            "iterations_missed": missed.get(g, 0.0),
            "rules": per_rule.get(_group_name(g), []),
        }
    return out


def rule_times(prom: Prometheus) -> dict[str, list[dict[str, Any]]]:
    """Each rule's own last evaluation time (/api/v1/rules), slowest first: which expression costs."""
    doc = json.loads(http_get(prom.url + "/api/v1/rules", 30)[1])
    out = {}
    for g in doc["data"]["groups"]:
        rules = [{"name": r["name"], "seconds": r.get("evaluationTime", 0.0), "expr": r["query"]} for r in g["rules"]]
        out[g["name"]] = sorted(rules, key=lambda r: -r["seconds"])
    return out


def rule_groups_alone(prom: Prometheus, repeats: int, rules: Path = RULES) -> dict[str, dict[str, Any]]:
    """Each group's rules one at a time, as instant queries at the clock in a Prometheus that evaluates no rules
    (the records the rules wrote a moment before are still within the lookback): the group's time on a core
    of its own, where the concurrent figure shares this machine's two cores among all the groups. Each
    expression is wrapped in ``count()`` so that encoding a large result does not count."""
    out = {}
    for path in sorted(rules.glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules = []
            for rule in group["rules"]:
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    prom.query(f"count({rule['expr']})", time.time(), timeout=300)
                    times.append(time.perf_counter() - t0)
                rules.append({"name": rule.get("record") or rule["alert"], "seconds": statistics.median(times)})
            out[group["name"]] = {
                "sum_s": sum(r["seconds"] for r in rules),
                "rules": sorted(rules, key=lambda r: -r["seconds"]),
            }
    return out


def _group_name(label: str) -> str:
    return label.rsplit(";", 1)[-1]  # "file;group"


def rules_alone(work: Path, hist: History, args: argparse.Namespace, rules: Path) -> dict[str, Any]:
    """One set of rule files on the TSDB: their groups evaluating together for ``--evaluations``, then each
    group alone in a Prometheus without rules, over the records the first one just wrote."""
    with over_tsdb(work, hist, args, rules) as prom:
        wait_quiet(prom, 10.0, args.compaction_timeout)
        together = rule_durations(prom, args.evaluations, args.evaluation_interval)
    with over_tsdb(work, hist, args) as prom:
        alone = rule_groups_alone(prom, args.repeats, rules)
    return {"rule_groups": together, "rule_groups_alone": alone}


def paired_rules(work: Path, hist: History, args: argparse.Namespace, baseline: Path) -> dict[str, Any]:
    """The rules in ``baseline`` (A) against this tree's (B), in the order A B A B on the same TSDB, so that a
    change of the rules is read as a ratio on a machine whose speed drifts between runs."""
    runs = []
    for i, (side, rules) in enumerate([("A", baseline), ("B", RULES)] * 2):
        progress(f"fleet: paired rules, run {i + 1}/4 ({side}: {rules})")
        runs.append({"side": side, **rules_alone(work, hist, args, rules)})
    return {"baseline": str(baseline), "runs": runs}


# --- dashboards ---


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str
    instant: bool
    max_points: int = 0  # the panel's "max data points" (0: none): its step is at least range / this


def panel_queries(dashboards: Path = DASHBOARDS) -> list[PanelQuery]:
    out = []
    for path in sorted(dashboards.glob("*.json")):
        d = json.loads(path.read_text())
        for p in _walk_panels(d.get("panels", [])):
            for t in p.get("targets", []):
                if t.get("expr") and not t.get("hide"):
                    title = p.get("title") or f"panel {p.get('id')}"
                    out.append(
                        PanelQuery(
                            path.stem,
                            title,
                            t.get("refId", ""),
                            t["expr"],
                            bool(t.get("instant")),
                            p.get("maxDataPoints") or 0,
                        )
                    )
    return out


def _walk_panels(panels: list[dict]) -> Any:
    for p in panels:
        yield p
        yield from _walk_panels(p.get("panels", []))


def dashboard_variables(dashboards: Path = DASHBOARDS) -> list[Variable]:
    """The template variables, the same on every shipped dashboard (their links carry them from one to another)."""
    per = {p.stem: json_variables(json.loads(p.read_text())) for p in sorted(dashboards.glob("*.json"))}
    first = next(iter(per.values()))
    odd = sorted(uid for uid, vs in per.items() if vs != first)
    if odd:
        raise SystemExit(f"fleet: the dashboards {odd} have other variables than {next(iter(per))}")
    return first


def variable_values(
    selection: str, client: PromClient, tc: TimeContext, dashboards: Path = DASHBOARDS
) -> tuple[dict[str, str], list[report_data.VariableQuery]]:
    """The dashboards' variables as Grafana fills them, and each variable's own query with its time.

    ``all`` leaves every one at All (their default: the whole fleet at once); ``job`` picks one training job
    (``job_id``: ``--nodes-per-job`` nodes), as one opens the drill-down dashboards. Each variable's query runs
    in order on ``client`` (the series API), narrowed by those before it; host's All expands to the hosts it
    offers (the chosen job's), which is what keeps the GPU panels to the job's GPUs."""
    chosen = {contract.JOB_ID: [CHOSEN_JOB]} if selection == "job" else {}
    queries: list[report_data.VariableQuery] = []
    values = report_data.variable_values(dashboard_variables(dashboards), chosen, client, tc, queries=queries)
    return values, queries


def time_query(prom: Prometheus, q: PanelQuery, tc: TimeContext, values: dict[str, str]) -> tuple[float, int]:
    tc = tc.for_panel(q.max_points)
    expr = substitute(q.expr, values, tc)
    if q.instant:
        params = {"query": expr, "time": f"{tc.end:.3f}"}
        path = "query"
    else:
        params = {"query": expr, "start": f"{tc.start:.3f}", "end": f"{tc.end:.3f}", "step": f"{tc.step:g}"}
        path = "query_range"
    t0 = time.perf_counter()
    code, body = http_get(f"{prom.url}/api/v1/{path}?" + urllib.parse.urlencode(params), 600)
    dt = time.perf_counter() - t0
    doc = json.loads(body)
    if code != 200 or doc.get("status") != "success":
        raise RuntimeError(f"{q.dashboard} / {q.panel} {q.ref}: {expr[:200]!r}: {doc.get('error', code)}")
    return dt, len(doc["data"]["result"])


def panel_times(
    prom: Prometheus, end: float, step: float, repeats: int, selection: str, judged_only: bool = False
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each panel's query time over the 6 h before ``end`` with the variables of ``selection``, and each
    variable's own query time (median of ``repeats`` openings; ``in_turn_s``: their sum, as Grafana waits for
    each variable before the next that it narrows). ``judged_only``: only the panels judged with that
    selection (the drill-down dashboards at All read the whole fleet and take longest)."""
    tc = TimeContext(start=end - PANEL_RANGE, end=end, step=step, scrape_interval=SCRAPE_INTERVAL)
    client = PromClient(prom.url, timeout=600)
    openings = [variable_values(selection, client, tc) for _ in range(repeats)]
    values = openings[0][0]
    timed: dict[str, Any] = {}
    for runs in zip(*(queries for _, queries in openings), strict=True):
        secs = [q.seconds for q in runs]
        timed[runs[0].name] = {
            "selector": runs[0].selector,
            "options": runs[0].options,
            "median_s": statistics.median(secs),
            "max_s": max(secs),
        }
    variables = {"in_turn_s": sum(v["median_s"] for v in timed.values()), "queries": timed}
    progress(
        f"fleet: variables ({selection}) in {variables['in_turn_s']:.2f} s, "
        + ", ".join(f"{name} {v['options']}" for name, v in timed.items())
    )
    panels: dict[str, dict[str, Any]] = {}
    queries = [
        q for q in panel_queries() if not judged_only or judged(f"panels_{selection}", f"{q.dashboard} / {q.panel}")
    ]
    for n, q in enumerate(queries):
        runs_s = []
        series = 0
        for _ in range(repeats):
            dt, series = time_query(prom, q, tc, values)
            runs_s.append(dt)
        key = f"{q.dashboard} / {q.panel}"
        p = panels.setdefault(key, {"seconds": 0.0, "targets": []})
        med = statistics.median(runs_s)
        p["seconds"] += med
        p["targets"].append({"ref": q.ref, "expr": q.expr, "median_s": med, "max_s": max(runs_s), "series": series})
        if (n + 1) % 10 == 0 or n + 1 == len(queries):
            progress(f"fleet: {n + 1}/{len(queries)} panel queries timed ({selection})")
    return panels, variables


def series_counts(prom: Prometheus, at: float, nodes: int, gpus: int, ranks: int) -> dict[str, Any]:
    def one(expr: str) -> float:
        r = prom.query(expr, at, timeout=600)  # a count over the whole fleet takes as long as a panel
        return float(r[0]["value"][1]) if r else 0.0

    scraped = f'job="{EXPORTER_JOB}", __name__!~".*:.*"'  # not the rules' records
    total = one(f"count({{{scraped}}})")
    per_rank = one(f'count({{{scraped}, rank=~".+"}})')
    per_gpu = one(f'count({{{scraped}, rank="", uuid=~".+"}})')
    return {
        "total": total,
        "per_node": total / nodes,
        "per_gpu": per_gpu / (nodes * gpus),
        "per_rank": per_rank / (nodes * ranks),
        "per_gpu_all_in": total / (nodes * gpus),
    }


# --- one size ---


@dataclass
class History:
    """One TSDB that grows with the sizes: nodes are added, never rewritten. ``end`` is when the panels are
    timed (the records' history ends there); the raw families run on to ``until``, past the last
    measurement, so the rules evaluate over fresh data. Kept in ``state.json`` beside the TSDB, so a later
    run (other rules, other dashboards) measures the same history without backfilling it again."""

    tsdb: Path
    start: float
    end: float
    until: float
    nodes: int = 0
    live_per_node: int = 0  # the scraped series of a node (and up)
    records: list[str] = field(default_factory=list)  # the recorded series backfilled so far

    @classmethod
    def open(cls, work: Path, args: argparse.Namespace, live_per_node: int) -> History:
        state = work / "state.json"
        if state.exists():
            h = cls(tsdb=work / "tsdb", **json.loads(state.read_text()))
            if h.live_per_node != live_per_node:
                raise SystemExit(
                    f"fleet: {work} holds nodes of {h.live_per_node} series, this template has {live_per_node}: "
                    "use a fresh --work"
                )
            progress(f"fleet: {work} holds {h.nodes} nodes already, up to {time.ctime(h.until)}")
            return h
        now = time.time()
        h = cls(
            tsdb=work / "tsdb",
            start=now - args.history_hours * 3600,
            end=now,
            until=now + args.ahead_minutes * 60,
            live_per_node=live_per_node,
            records=sorted(RECORD_SOURCES),
        )
        h.tsdb.mkdir(parents=True, exist_ok=True)
        h.save(work)
        return h

    def save(self, work: Path) -> None:
        keys = ("start", "end", "until", "nodes", "live_per_node", "records")
        (work / "state.json").write_text(json.dumps({k: getattr(self, k) for k in keys}))


def grow(series: list[Series], nodes: int, args: argparse.Namespace, work: Path, hist: History) -> dict | None:
    """Backfill what the TSDB lacks for ``nodes``: the records the rules gained, then the new nodes."""
    if nodes < hist.nodes:
        raise SystemExit(f"fleet: the TSDB in --work holds {hist.nodes} nodes; it measures {hist.nodes} or more")
    fleet = Fleet.build(series, nodes, args.nodes_per_job, records_until=hist.end)
    missing = sorted(set(RECORD_SOURCES) - set(hist.records))
    if missing and hist.nodes:  # records the rules gained since: their history for the nodes already there
        progress(f"fleet: backfilling the records the TSDB lacks: {', '.join(missing)}")
        records = [s for s in series if s.name in missing]
        only = Fleet.build(records, hist.nodes, args.nodes_per_job, records_until=hist.end, up=False)
        backfill(only, range(hist.nodes), hist.start, hist.end, hist.tsdb, work, args.file_gb * 1e9, args.jobs)
    hist.records = sorted(RECORD_SOURCES)
    hist.save(work)
    fill = None
    if hist.nodes < nodes:
        fill = backfill(
            fleet, range(hist.nodes, nodes), hist.start, hist.until, hist.tsdb, work, args.file_gb * 1e9, args.jobs
        )
        hist.nodes = nodes
        hist.save(work)
    return fill


def extend(series: list[Series], args: argparse.Namespace, work: Path, hist: History) -> dict:
    """Carry the scraped series of the nodes already there on to ``--extend-minutes`` from now, so that a kept
    TSDB can time other rules at the clock after its history has run out. Counters carry on without a reset."""
    until = time.time() + args.extend_minutes * 60
    if until <= hist.until:
        raise SystemExit(f"fleet: {work} runs to {time.ctime(hist.until)} already")
    fleet = Fleet.build(series, hist.nodes, args.nodes_per_job, records_until=hist.end)
    after = (int(hist.until // SCRAPE_INTERVAL) + 1) * SCRAPE_INTERVAL  # the sample after the last one there
    fill = backfill(
        fleet, range(hist.nodes), after, until, hist.tsdb, work, args.file_gb * 1e9, args.jobs, origin=hist.start
    )
    hist.until = until
    hist.save(work)
    return fill


def compact(work: Path, hist: History, args: argparse.Namespace) -> dict[str, float]:
    """Prometheus without rules over the TSDB until its compaction is done, so a copy starts compacted."""
    with over_tsdb(work, hist, args) as prom:
        return wait_quiet(prom, args.quiet_seconds, args.compaction_timeout)


def keep_copy(work: Path, hist: History) -> Path:
    """The TSDB as it is at this size, copied to ``work/sizes/N``: a later run measures each size there."""
    kept = work / "sizes" / str(hist.nodes)
    if kept.exists():
        shutil.rmtree(kept)
    shutil.copytree(hist.tsdb, kept / "tsdb")
    hist.save(kept)
    return kept


def measure(series: list[Series], nodes: int, args: argparse.Namespace, work: Path, hist: History) -> dict[str, Any]:
    fleet = Fleet.build(series, nodes, args.nodes_per_job, records_until=hist.end)
    fill = grow(series, nodes, args, work, hist)
    progress(f"fleet: Prometheus over {nodes} nodes' TSDB")
    with over_tsdb(work, hist, args, RULES) as prom:
        blocks = wait_quiet(prom, args.quiet_seconds, args.compaction_timeout)
        left = hist.until - time.time()
        if left < args.evaluation_interval * (args.evaluations + 3) + 300:
            raise SystemExit(
                f"fleet: the history ends in {left / 60:.0f} min, too soon to time the rules over fresh data: "
                "a fresh --work with a larger --ahead-minutes"
            )
        progress(f"fleet: rule groups, {args.evaluations} evaluations each")
        rules = rule_durations(prom, args.evaluations, args.evaluation_interval)
    # the rest without rules: what a group costs alone, and the panels without the rules' load beside them
    with over_tsdb(work, hist, args) as prom:
        progress("fleet: each rule group alone, one rule at a time")
        alone = rule_groups_alone(prom, args.repeats)
        panels, variables = {}, {}
        for sel in SELECTIONS:
            progress(f"fleet: dashboard panels over the 6 h before {time.ctime(hist.end)}, variables: {sel}")
            panels[sel], variables[sel] = panel_times(prom, hist.end, args.step, args.repeats, sel, args.judged_only)
        counts = series_counts(prom, hist.end, nodes, 8, 8)
        rss = metric_values(self_metrics(prom), "process_resident_memory_bytes").get("", 0.0)
        tsdb_bytes = sum(f.stat().st_size for f in hist.tsdb.rglob("*") if f.is_file())
        load = Path("/proc/loadavg").read_text().split()[:3]
    return {
        "nodes": nodes,
        "gpus": nodes * 8,
        "series_per_node": fleet.per_node(),
        "backfill": fill,
        "history": {"start": hist.start, "panels_end": hist.end, "until": hist.until},
        "blocks": blocks,
        "rule_groups": rules,
        "rule_groups_alone": alone,
        "panels": panels,
        "variables": variables,
        "series": counts,
        "prometheus_rss_bytes": rss,
        "tsdb_bytes": tsdb_bytes,
        "loadavg_after": load,
    }


# --- the curve, the table ---


def fit(xs: list[float], ys: list[float], x: float) -> float | None:
    """Least-squares line through (xs, ys), at x; one point: proportional."""
    if not xs:
        return None
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((a - mx) ** 2 for a in xs)
    b = sum((a - mx) * (c - my) for a, c in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return max(0.0, my + b * (x - mx))


def _categories() -> list[tuple[str, str, float]]:
    """(key, label, limit) of each kind of timed thing."""
    return [
        ("rule_groups", "rule group", RULE_TARGET_S),
        ("rule_groups_alone", "rule group alone", RULE_TARGET_S),
        *[(f"panels_{sel}", f"panel ({sel})", PANEL_TARGET_S) for sel in SELECTIONS],
        *[(f"variables_{sel}", f"variables ({sel})", PANEL_TARGET_S) for sel in SELECTIONS],
    ]


def _seconds(m: dict[str, Any], key: str) -> dict[str, float]:
    """One measurement's timed things of a category: name -> seconds (a result recorded before the variables
    were timed has none of them)."""
    if key == "rule_groups":
        return {n: g["median_s"] for n, g in m["rule_groups"].items() if g.get("median_s") is not None}
    if key == "rule_groups_alone":  # absent from a result recorded before it was measured
        return {n: g["sum_s"] for n, g in m.get("rule_groups_alone", {}).items()}
    kind, sel = key.split("_", 1)
    if kind == "panels":
        return {n: p["seconds"] for n, p in m["panels"].get(sel, {}).items()}
    v = m.get("variables", {}).get(sel)
    return {VARIABLES_IN_TURN: v["in_turn_s"]} if v else {}


def judged(key: str, name: str) -> bool:
    """The fleet dashboard is judged with every variable at All, the drill-down ones with one job chosen; the
    variables (the same on every dashboard) both ways, as they delay every panel."""
    if key.startswith(("rule_groups", "variables_")):
        return True
    fleet = name.startswith("vramwatch-fleet ")
    return key == ("panels_all" if fleet else "panels_job")


def summary(sizes: list[dict[str, Any]], target: int = TARGET_NODES, per_job: int = 16) -> dict[str, Any]:
    """Per rule group and panel: seconds at each measured size, and at ``target`` (measured or from the line).

    A panel with one job chosen is extrapolated along its line too: the rank families narrow to the job, and
    the GPU families (which carry no job label) to the job's hosts through the host variable, so both should
    stay flat; the line shows whether they do. The variables' queries are one entry per selection."""
    measured = {s["nodes"]: s for s in sizes}
    xs = sorted(measured)
    out: dict[str, Any] = {
        "sizes": xs,
        "target_nodes": target,
        "target_measured": target in measured,
        "nodes_per_job": per_job,
    }
    misses = []
    for key, _label, limit in _categories():
        timed = {x: _seconds(measured[x], key) for x in xs}
        names = sorted({n for t in timed.values() for n in t})
        rows = {}
        for name in names:
            pts = [(x, timed[x][name]) for x in xs if name in timed[x]]
            if target in measured:
                at = timed[target].get(name)
            else:
                line = fit([float(x) for x, _ in pts], [y for _, y in pts], target)
                # a cost does not fall as the fleet grows: a line tilted down by noise gives the largest size's
                at = None if line is None else max(line, pts[-1][1])
            ok = at is not None and at <= limit
            rows[name] = {"by_nodes": dict(pts), "at_target": at, "meets": ok, "judged": judged(key, name)}
            if not ok and rows[name]["judged"]:
                misses.append({"kind": key, "name": name, "at_target_s": at})
        out[key] = rows
    out["misses"] = misses
    return out


def render_table(result: dict[str, Any]) -> str:
    s = result["summary"]
    xs = s["sizes"]
    tgt = s["target_nodes"]
    how = "measured" if s["target_measured"] else "extrapolated"
    head = "| | " + " | ".join(f"{x:,} nodes" for x in xs) + f" | {tgt:,} nodes ({how}) | target |"
    lines = [head, "|---|" + "---|" * (len(xs) + 2)]
    for key, label, limit in _categories():
        for name, row in s.get(key, {}).items():
            if not row["judged"]:
                continue  # in the JSON: the drill-down dashboards with every variable at All
            cells = [_sec(row["by_nodes"].get(x)) for x in xs]
            mark = "" if row["meets"] else " **over**"
            lines.append(
                f"| {label} `{name}` | " + " | ".join(cells) + f" | {_sec(row['at_target'])}{mark} | <= {limit:g} s |"
            )
    by = {m["nodes"]: m for m in result["measurements"]}
    lines.append(
        "| series per GPU / per rank | "
        + " | ".join(f"{by[x]['series']['per_gpu']:.1f} / {by[x]['series']['per_rank']:.1f}" for x in xs)
        + " | | |"
    )
    lines.append(
        "| Prometheus RSS | " + " | ".join(f"{by[x]['prometheus_rss_bytes'] / 2**30:.1f} GiB" for x in xs) + " | | |"
    )
    return "\n".join(lines)


def slowest(result: dict[str, Any], miss: dict[str, Any], n: int = 2) -> list[str]:
    """The costliest rules or targets behind a miss, at the largest measured size, with their expressions."""
    last = max(result["measurements"], key=lambda m: m["nodes"])
    if miss["kind"] == "rule_groups":
        rules = last["rule_groups"].get(miss["name"], {}).get("rules", [])
        return [f"{_sec(r['seconds'])} {r['name']}: {' '.join(r['expr'].split())[:300]}" for r in rules[:n]]
    if miss["kind"] == "rule_groups_alone":
        rules = last["rule_groups_alone"].get(miss["name"], {}).get("rules", [])
        return [f"{_sec(r['seconds'])} {r['name']}" for r in rules[:n]]
    kind, sel = miss["kind"].split("_", 1)
    if kind == "variables":
        queries = sorted(last["variables"][sel]["queries"].items(), key=lambda kv: -kv[1]["median_s"])
        return [f"{_sec(v['median_s'])} {k}: {v['options']} values of {v['selector'][:300]}" for k, v in queries[:n]]
    targets = sorted(last["panels"][sel][miss["name"]]["targets"], key=lambda t: -t["median_s"])
    return [f"{_sec(t['median_s'])} {t['ref']}: {' '.join(t['expr'].split())[:300]}" for t in targets[:n]]


def _sec(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def update_doc(result: dict[str, Any], path: Path = DOC) -> None:
    text = path.read_text()
    begin, end = "<!-- BEGIN-FLEET-COST (benchmarks/fleet.py) -->", "<!-- END-FLEET-COST -->"
    block = f"{begin}\n{render_table(result)}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _m: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def merge_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Results of separate runs as one: the first's metadata, every run's sizes (each size once)."""
    merged = {**results[0], "measurements": []}
    for r in results:
        for m in r["measurements"]:
            if any(x["nodes"] == m["nodes"] for x in merged["measurements"]):
                raise SystemExit(f"fleet: {m['nodes']} nodes are measured in more than one of the results")
            merged["measurements"].append(m)
    merged["measurements"].sort(key=lambda m: m["nodes"])
    merged["merged_from"] = [r["meta"] for r in results]
    merged["summary"] = summary(merged["measurements"], per_job=merged["settings"]["nodes_per_job"])
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="125,250,500,1000", help="fleet sizes, comma-separated")
    p.add_argument("--nodes-per-job", type=int, default=16, help="nodes per training job (job_id, global rank)")
    p.add_argument("--history-hours", type=float, default=6.0, help="history before the start")
    p.add_argument(
        "--ahead-minutes",
        type=float,
        default=150.0,
        help="history past the start: the whole run's backfilling and measuring must end before it",
    )
    p.add_argument("--jobs", type=int, default=2, help="promtools backfilling at once")
    p.add_argument("--evaluation-interval", type=float, default=15.0)
    p.add_argument("--evaluations", type=int, default=5, help="evaluations of each rule group to record")
    p.add_argument("--step", type=float, default=30.0, help="query_range step (Grafana's for 6 h on a ~700 px panel)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each panel query (median)")
    p.add_argument(
        "--judged-only",
        action="store_true",
        help="time only the panels judged with each selection (not the drill-down dashboards at All)",
    )
    p.add_argument("--file-gb", type=float, default=2.0, help="largest OpenMetrics file to write at once")
    p.add_argument("--quiet-seconds", type=float, default=90.0, help="compaction counts still this long: done")
    p.add_argument("--compaction-timeout", type=float, default=1800.0)
    p.add_argument(
        "--work",
        help="directory for the TSDB (kept: a later run with the same --work measures it again without "
        "backfilling, and adds nodes for larger sizes; default: a temporary one, removed)",
    )
    p.add_argument(
        "--backfill-only",
        action="store_true",
        help="fill the TSDB in --work for each size and keep a compacted copy of it in --work/sizes/N, measuring "
        "nothing; a later run with the same --work measures each size from its copy",
    )
    p.add_argument(
        "--extend-minutes",
        type=float,
        help="carry the scraped series of each size kept in --work/sizes/N on to this many minutes from now "
        "(a history that ended before another set of rules could be timed), measuring nothing",
    )
    p.add_argument(
        "--pair-rules",
        metavar="DIR",
        help="only time the rule files in DIR (A, e.g. an older tree's deploy/prometheus/rules) against this "
        "tree's (B), A B A B, on each size kept in --work/sizes/N",
    )
    p.add_argument("--out", help="the result (default benchmarks/results/fleet.json; with --doc-from, the merged one)")
    p.add_argument("--doc", action="store_true", help="write the table into docs/scale.md")
    p.add_argument(
        "--doc-from",
        metavar="JSON",
        nargs="+",
        help="only write docs/scale.md's table from recorded results (several: their sizes merged, e.g. sizes "
        "measured in separate runs)",
    )
    args = p.parse_args(argv)
    if args.doc_from:
        recorded = merge_results([common.read_json(f) for f in args.doc_from])
        if args.out:
            common.write_json(args.out, recorded)
        update_doc(recorded)
        print(render_table(recorded))
        return 0
    args.out = args.out or str(ROOT / "benchmarks" / "results" / "fleet.json")
    if find_tool("prometheus") is None or find_tool("promtool") is None:
        print("fleet: needs Debian's prometheus and promtool (make tools, or TEST_TOOLS_DIR)", file=sys.stderr)
        return 2
    sizes = sorted(int(x) for x in args.nodes.split(","))
    series, checks = template()
    work = Path(args.work or tempfile.mkdtemp(prefix="vramwatch-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "what": "the shipped rules and dashboards over a simulated fleet in a real Prometheus (benchmarks/fleet.py)",
        "meta": common.metadata(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("doc", "doc_from")},
        "template": {"series_per_node": len(series) + 1, **checks},
        "rules": [str(p.relative_to(ROOT)) for p in sorted(RULES.glob("*.yml"))],
        "dashboards": [str(p.relative_to(ROOT)) for p in sorted(DASHBOARDS.glob("*.json"))],
        "measurements": [],
    }
    live = sum(1 for s in series if s.kind != "record") + 1
    hist = History.open(work, args, live)
    try:
        for n in sizes:
            progress(f"fleet: --- {n} nodes ---")
            kept = work / "sizes" / str(n)
            if args.pair_rules:
                pairs = paired_rules(kept, History.open(kept, args, live), args, Path(args.pair_rules))
                result["measurements"].append({"nodes": n, "paired_rules": pairs})
                common.write_json(args.out, result)
                continue
            if args.extend_minutes:
                size = History.open(kept, args, live)
                extend(series, args, kept, size)
                compact(kept, size, args)
                continue
            if args.backfill_only:
                grow(series, n, args, work, hist)
                compact(work, hist, args)
                progress(f"fleet: {n} nodes kept in {keep_copy(work, hist)}")
                continue
            if kept.exists():  # a size kept by --backfill-only
                result["measurements"].append(measure(series, n, args, kept, History.open(kept, args, live)))
            else:
                result["measurements"].append(measure(series, n, args, work, hist))
            result["summary"] = summary(result["measurements"], per_job=args.nodes_per_job)
            common.write_json(args.out, result)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if not result["measurements"] or args.pair_rules:  # --backfill-only, --extend-minutes, --pair-rules
        return 0
    print(render_table(result))
    for m in result["summary"]["misses"]:
        print(f"fleet: over target at {TARGET_NODES} nodes: {m['kind']} {m['name']}: {_sec(m['at_target_s'])}")
        for r in slowest(result, m):
            print(f"    {r}")
    if args.doc:
        update_doc(result)
    progress(f"fleet: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
