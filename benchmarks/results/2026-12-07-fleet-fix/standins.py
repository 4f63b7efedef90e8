"""Stand-in panels for benchmarks/fleet.py: a recorded series has no history in the benchmark's TSDB.

fleet.py backfills the raw families only; the shipped rules record their series from the moment its
Prometheus starts, so a panel reading a record over 6 h finds a few minutes of it and looks free. For each
panel of deploy/grafana/dashboards that reads a record, this writes a copy in which every record is replaced
by a raw family with the same labels, one series per rank, rank's device or GPU like the record, and a
sample every 15 s like the records at the default evaluation interval: what reading the record over 6 h
costs once it has that history. The copies go beside the shipped dashboards as ``<name> (stand-in).json``;
fleet.py then measures them with the rest (the fleet dashboard's at All, the others with one job chosen).

    python3 benchmarks/results/2026-12-07-fleet-fix/standins.py deploy/grafana/dashboards
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vramwatch.monitoring import promql

# each record -> a raw family with its labels (contract.spec(...).labels match)
STAND_IN = {
    promql.STALL_MEAN_RECORD: "vramwatch_training_last_step_timestamp_seconds",
    **{name: "vramwatch_training_last_step_timestamp_seconds" for name in promql.STEP_QUANTILE_RECORDS.values()},
    promql.LEAK_PROJECTION_RECORD: "torch_cuda_memory_active_bytes",
    promql.MEMORY_RATIO_RECORD: "gpu_memory_used_bytes",
}


def reads_record(expr: str) -> bool:
    return any(name in expr for name in promql.RECORDS)


def stand_in(expr: str) -> str:
    # longest first: no record name is a prefix of another, but keep it safe
    for name in sorted(STAND_IN, key=len, reverse=True):
        expr = expr.replace(name + "{", STAND_IN[name] + "{")
    if reads_record(expr):
        raise SystemExit(f"standins: no stand-in for a record in {expr!r}")
    return expr


def main(directory: str) -> int:
    for path in sorted(Path(directory).glob("*.json")):
        if "(stand-in)" in path.stem:
            continue
        d = json.loads(path.read_text())
        panels = []
        for p in d.get("panels", []):
            targets = [t for t in p.get("targets", []) if t.get("expr")]
            if any(reads_record(t["expr"]) for t in targets):
                p = {**p, "targets": [{**t, "expr": stand_in(t["expr"])} if t.get("expr") else t for t in targets]}
                panels.append(p)
        if panels:
            out = path.with_name(f"{path.stem} (stand-in).json")
            out.write_text(json.dumps({**d, "panels": panels}, indent=1))
            print(f"standins: {out.name}: {', '.join(p['title'] for p in panels)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "deploy/grafana/dashboards"))
