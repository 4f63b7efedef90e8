"""How many series one vramwatch target costs Prometheus: measured from a real scrape.

    python3 benchmarks/series_count.py [--ranks 8] [--gpus 8] [--out benchmarks/results/series.json]

Starts `vramwatch serve` on the simulated GPU with ``--gpus`` GPUs and ``--ranks`` simulated ranks (one per
GPU, as torchrun starts them), waits until every rank and GPU is in the exposition, then scrapes /metrics
and counts series per family and per kind: per rank (series with a ``rank`` label), per GPU (``uuid`` or
``gpu``, no ``rank``) and per target (the rest: self-health, build info). With Debian's Prometheus
available (`make tools`), a real Prometheus scrapes the same target and its own numbers are recorded too
(``scrape_samples_scraped``, head series of the job, ``scrape_samples_post_metric_relabeling`` with the fleet
relabelling of docs/scale.md). The simulated GPU exposes the families a real one does; families that only
appear after an event are listed as such, from a second scrape after the script injects an Xid.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import Exporter, Prometheus, find_tool, http_get, start_sim_rank, stop_proc, wait_until  # noqa: E402
from vramwatch.sim.state import edit  # noqa: E402

FLEET_NODES, FLEET_GPUS_PER_NODE, FLEET_SCRAPE_INTERVAL = 1000, 8, 15.0
# Per-series memory of a Prometheus 2.x head, with ingestion at this interval: Brian Brazil, "How much RAM
# does Prometheus 2.x need for cardinality and ingestion?", Robust Perception, 2019 (Prometheus 2.9 profile:
# ~732 B per series + 32 B per label pair + 120 B per unique label value + the name twice, doubled for Go's GC;
# "a million series costs around 2GiB of RAM" with ingestion). Worst-case assumptions by the author's design.
BYTES_PER_SERIES = 2 * 1024**3 / 1e6
BYTES_PER_SERIES_SOURCE = (
    "Robust Perception, 'How much RAM does Prometheus 2.x need for cardinality and "
    "ingestion?' (2019): about 2 GiB per million series"
)


def parse(text: str) -> list[tuple[str, dict[str, str]]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels)) for fam in text_string_to_metric_families(text) for s in fam.samples]


def kind(labels: dict[str, str]) -> str:
    if labels.get("rank"):  # the server's own collectors carry rank=""
        return "per_rank"
    if "uuid" in labels or "gpu" in labels:
        return "per_gpu"
    return "per_target"


def by_family_and_kind(text: str) -> Counter[tuple[str, str]]:
    return Counter((name, kind(labels)) for name, labels in parse(text))


def predict(
    small: Counter[tuple[str, str]], ranks_gpus_small: tuple[int, int], ranks_gpus: tuple[int, int]
) -> dict[str, int]:
    """Series per family on a node of another size: per-rank and per-GPU series scale, per-target ones stay."""
    (r0, g0), (r1, g1) = ranks_gpus_small, ranks_gpus
    out: Counter[str] = Counter()
    for (name, k), n in small.items():
        scale = {"per_rank": r1 / r0, "per_gpu": g1 / g0}.get(k, 1.0)
        out[name] += round(n * scale)
    return dict(sorted(out.items()))


def summarize(text: str) -> dict[str, Any]:
    samples = parse(text)
    by_family: Counter[str] = Counter(name for name, _ in samples)
    by_kind: Counter[str] = Counter(kind(labels) for _, labels in samples)
    buckets = sum(1 for name, _ in samples if name.endswith("_bucket"))
    return {
        "series": len(samples),
        "by_kind": dict(sorted(by_kind.items())),
        "histogram_bucket_series": buckets,
        "families": dict(sorted(by_family.items())),
        "exposition_bytes": len(text.encode()),
        "exposition_gzip_bytes": len(gzip.compress(text.encode())),
    }


def fleet_relabel_configs() -> list[dict[str, Any]]:
    """The metric_relabel_configs of docs/scale.md (its one ```yaml block with a scrape config)."""
    text = (ROOT / "docs" / "scale.md").read_text()
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        doc = yaml.safe_load(block)
        if isinstance(doc, dict) and "scrape_configs" in doc:
            return doc["scrape_configs"][0].get("metric_relabel_configs", [])
    raise SystemExit("series_count: docs/scale.md has no scrape config with metric_relabel_configs")


def get(url: str, timeout: float = 5.0) -> bytes:
    status, body = http_get(url, timeout)
    if status != 200:
        raise OSError(f"GET {url}: {status}")
    return body


def prometheus_view(tmp: Path, target: str) -> dict[str, Any]:
    """A real Prometheus (Debian's 2.42) scrapes the target twice over: as is, and with the fleet relabelling."""
    fleet = fleet_relabel_configs()
    cfg = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": "vramwatch", "static_configs": [{"targets": [target]}]},
            {"job_name": "vramwatch-fleet", "static_configs": [{"targets": [target]}], "metric_relabel_configs": fleet},
        ],
    }
    prom = Prometheus(tmp, config=cfg, lifecycle=False)

    def query(expr: str) -> float | None:
        res = prom.query(expr)
        return float(res[0]["value"][1]) if res else None

    try:
        prom.start(timeout=60)
        wait_until(lambda: (query("count(up == 1)") or 0) >= 2, 60, "both scrapes to succeed")
        time.sleep(3)  # a few scrapes: the counts are per scrape
        out = {
            "version": json.loads(get(prom.url + "/api/v1/status/buildinfo"))["data"]["version"],
            "scrape_samples_scraped": query('scrape_samples_scraped{job="vramwatch"}'),
            "head_series_of_job": query('count({job="vramwatch"})'),
            "fleet_relabelled_samples_per_scrape": query(
                'scrape_samples_post_metric_relabeling{job="vramwatch-fleet"}'
            ),
            "fleet_relabelled_head_series": query('count({job="vramwatch-fleet"})'),
        }
        return out
    finally:
        prom.stop()


DOC = ROOT / "docs" / "scale.md"


def _n(x: float) -> str:
    return f"{x:,.0f}"


def render_doc_blocks(r: dict[str, Any]) -> dict[str, str]:
    """The generated parts of docs/scale.md, from a recorded result (tests compare them with the page)."""
    st, prom, fleet = r["steady"], r.get("prometheus") or {}, r["fleet"]
    kinds, fams, gpus, ranks = st["by_kind"], st["families"], r["gpus"], r["ranks"]
    buckets = st["histogram_bucket_series"]
    seen = (
        f" (Prometheus {prom['version']}: `scrape_samples_scraped` {_n(prom['scrape_samples_scraped'])})"
        if prom
        else ""
    )
    events = ", ".join(f"+{n} `{f}`" for f, n in sorted(r["events_add"].items())) or "none"
    measured = "\n".join(
        [
            "| | series |",
            "|---|---|",
            f"| one target ({gpus} GPUs, {ranks} ranks), one scrape | **{_n(st['series'])}**{seen} |",
            f"| per GPU (one rank each) | **{r['per_gpu_series']}** |",
            f"| per-GPU device families (NVML, Xid), all GPUs | {_n(kinds.get('per_gpu', 0))} |",
            f"| per-rank families (allocator, heartbeat), all ranks | {_n(kinds.get('per_rank', 0))}, of which "
            f"{_n(buckets)} are step-time histogram buckets |",
            f"| per target (build info, rank count, the server's collectors) | {_n(kinds.get('per_target', 0))} |",
            f"| stored by Prometheus per target (+ `up`, `scrape_*`) | "
            f"{_n(prom['head_series_of_job']) if prom else 'n/a'} |",
            f"| after one Xid event | {events} |",
            f"| exposition per scrape | {st['exposition_bytes'] / 1000:.1f} kB, "
            f"{st['exposition_gzip_bytes'] / 1000:.1f} kB gzipped |",
            "",
            "Largest families: "
            + ", ".join(f"`{f}` {n}" for f, n in sorted(fams.items(), key=lambda kv: -kv[1])[:5])
            + ".",
        ]
    )
    a, f = fleet["all_series"], fleet.get("fleet_relabelled")
    per_day = a["samples_per_second"] * 86400
    col = (lambda k, fmt: f" | {fmt(f[k])}") if f else (lambda k, fmt: " | n/a")
    fleet_md = "\n".join(
        [
            "| | all series | with the fleet relabelling below |",
            "|---|---|---|",
            f"| active series ({_n(fleet['nodes'])} targets, {_n(fleet['gpus'])} GPUs) | {_n(a['series'])}"
            + col("series", _n)
            + " |",
            f"| samples per second at a {fleet['scrape_interval_s']:.0f} s interval | {_n(a['samples_per_second'])}"
            + col("samples_per_second", _n)
            + " |",
            f"| head memory at ~{fleet['bytes_per_series'] / 1024:.1f} KiB per series | ~{a['head_memory_gib']} GiB"
            + col("head_memory_gib", lambda v: f"~{v} GiB")
            + " |",
            "",
            f"Disk, at the Prometheus documentation's 1-2 bytes per sample: {per_day / 1e9:.1f} billion samples a "
            f"day, {per_day / 1e9:.0f}-{2 * per_day / 1e9:.0f} GB. Scrape traffic: {_n(fleet['nodes'])} targets every "
            f"{fleet['scrape_interval_s']:.0f} s at {st['exposition_gzip_bytes'] / 1000:.1f} kB gzipped is "
            f"{fleet['nodes'] / fleet['scrape_interval_s'] * st['exposition_gzip_bytes'] / 1e6:.1f} MB/s.",
        ]
    )
    return {"MEASURED": measured, "FLEET": fleet_md}


def update_doc(result: dict[str, Any], path: Path = DOC) -> None:
    text = path.read_text()
    for name, body in render_doc_blocks(result).items():
        text = re.sub(
            rf"(<!-- BEGIN {name} [^\n]*-->\n).*?(<!-- END {name} -->)",
            lambda m, body=body: m.group(1) + body + "\n" + m.group(2),
            text,
            flags=re.S,
        )
    path.write_text(text)


def doc_blocks(path: Path = DOC) -> dict[str, str]:
    text = path.read_text()
    return {
        m.group(1): m.group(2).rstrip("\n")
        for m in re.finditer(r"<!-- BEGIN (\w+) [^\n]*-->\n(.*?)<!-- END \1 -->", text, re.S)
    }


def fleet_cost(per_target: int, per_target_fleet: int | None) -> dict[str, Any]:
    def cost(series_per_node: int) -> dict[str, Any]:
        series = series_per_node * FLEET_NODES
        return {
            "series": series,
            "samples_per_second": round(series / FLEET_SCRAPE_INTERVAL),
            "head_memory_gib": round(series * BYTES_PER_SERIES / 1024**3, 1),
        }

    out = {
        "nodes": FLEET_NODES,
        "gpus": FLEET_NODES * FLEET_GPUS_PER_NODE,
        "scrape_interval_s": FLEET_SCRAPE_INTERVAL,
        "bytes_per_series": round(BYTES_PER_SERIES),
        "bytes_per_series_source": BYTES_PER_SERIES_SOURCE,
        "all_series": cost(per_target),
    }
    if per_target_fleet is not None:
        out["fleet_relabelled"] = cost(per_target_fleet)
    return out


class SimulatedNode:
    """`vramwatch serve` on a simulated node with ``gpus`` GPUs and ``ranks`` simulated ranks, in a temporary
    directory, on a free loopback port; stopped and removed on exit."""

    def __init__(self, ranks: int, gpus: int, **settings: str) -> None:
        self.ranks, self.gpus, self.settings = ranks, gpus, settings
        self.tmp = Path(tempfile.mkdtemp(prefix="vramwatch-series-"))
        self.exporter = Exporter(self.tmp, gpus=gpus, **settings)
        self.spool = Path(self.exporter.spool)
        self.target = f"127.0.0.1:{self.exporter.port}"
        self.url = f"http://{self.target}/metrics"
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> SimulatedNode:
        try:
            self.exporter.start(timeout=60)
            for r in range(self.ranks):
                self.procs.append(
                    start_sim_rank(
                        self.exporter,
                        r,
                        *("--duration", "600", "--fill-gib", "8"),
                        world_size=self.ranks,
                        cuda_visible=str(r % self.gpus),
                        interval=None,  # vramwatch's default cadence, as a real job samples
                        **self.settings,
                    )
                )
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_complete(self, timeout: float = 120) -> None:
        """Until every rank (allocator and heartbeat) and every GPU is in the exposition."""

        def complete() -> bool:
            samples = parse(get(self.url).decode())
            ranks = {lb["rank"] for n, lb in samples if n == "torch_cuda_memory_allocated_bytes"}
            gpus = {lb.get("uuid") for n, lb in samples if n == "gpu_memory_used_bytes"}
            steps = {lb["rank"] for n, lb in samples if n == "vramwatch_training_step_duration_seconds_count"}
            return len(ranks) == self.ranks and len(gpus) == self.gpus and len(steps) == self.ranks

        wait_until(complete, timeout, f"{self.ranks} ranks and {self.gpus} GPUs in the exposition", interval=0.25)

    def __exit__(self, *exc: Any) -> None:
        for proc in reversed(self.procs):
            stop_proc(proc)
        self.exporter.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "series.json"))
    p.add_argument("--no-prometheus", action="store_true", help="skip the real Prometheus scrape")
    p.add_argument("--update-doc", action="store_true", help="rewrite the measured tables of docs/scale.md")
    p.add_argument("--doc-from", metavar="JSON", help="only rewrite docs/scale.md from a recorded result")
    args = p.parse_args(argv)
    if args.doc_from:
        with open(args.doc_from, encoding="utf-8") as fh:
            update_doc(json.load(fh))
        return 0

    with SimulatedNode(args.ranks, args.gpus) as node:
        node.wait_complete()
        time.sleep(12)  # past the slow NVML cadence (10 s) and the first largest-block snapshot
        steady = summarize(get(node.url).decode())

        prom = None
        if not args.no_prometheus and find_tool("prometheus"):
            prom = prometheus_view(node.tmp, node.target)

        # an event that adds series: an Xid on GPU 0 (gpu_last_xid_timestamp_seconds{xid} appears)
        with edit(str(node.spool)) as state:
            state.inject_xid(0, 13)
        time.sleep(4)
        after = summarize(get(node.url).decode())
    event_families = {
        f: n - steady["families"].get(f, 0) for f, n in after["families"].items() if n != steady["families"].get(f)
    }

    # what Prometheus stores per target: the samples plus its 5 per-target series (up, scrape_*)
    head = int(prom["head_series_of_job"]) if prom else steady["series"] + 5
    head_fleet = int(prom["fleet_relabelled_head_series"]) if prom else None
    result = {
        "what": "series of one vramwatch target (one node), simulated GPU, measured from real scrapes",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "vramwatch_commit": _git_commit(),
        "python": platform.python_version(),
        "ranks": args.ranks,
        "gpus": args.gpus,
        "steady": steady,
        "per_gpu_series": round(steady["series"] / args.gpus, 1),
        "events_add": event_families,
        "prometheus": prom,
        "fleet": fleet_cost(head, head_fleet),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
        fh.write("\n")
    print(json.dumps({k: result[k] for k in ("per_gpu_series", "prometheus", "fleet")}, indent=1))
    if args.update_doc:
        update_doc(result)
    print(f"series_count: {steady['series']} series per target ({steady['by_kind']}); wrote {args.out}")
    return 0


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    raise SystemExit(main())
