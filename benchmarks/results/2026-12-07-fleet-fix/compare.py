"""Before and after, paired: the fleet table of two benchmarks/fleet.py runs side by side (markdown).

    python3 benchmarks/results/2026-12-07-fleet-fix/compare.py before.json after.json

Rows are fleet.py's judged rows (every rule group; the fleet dashboard's panels at All, the others' with one
job chosen). A panel that reads a recorded series is shown by its stand-in (standins.py beside this file:
the recorded series have no history in the benchmark's TSDB), marked "(stand-in)".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

import fleet

STAND_IN = " (stand-in)"


def rows(result: dict) -> dict[str, tuple[dict, float | None, bool]]:
    """name -> (seconds by nodes, at the target, judged), stand-ins in place of the panels they stand for."""
    s = fleet.summary(result["measurements"], per_job=result["settings"]["nodes_per_job"])
    out = {}
    for key, label, _limit, _ in fleet._categories():
        for name, row in s[key].items():
            if row["judged"]:
                out[f"{label} `{name}`"] = (row["by_nodes"], row["at_target"])
    for name in [n for n in out if STAND_IN in n]:
        out[name.replace(STAND_IN, "")] = out.pop(name) + (True,)
    return {k: v if len(v) == 3 else (*v, False) for k, v in out.items()}


def main(before_path: str, after_path: str) -> int:
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    b, a = rows(before), rows(after)
    sizes = sorted({m["nodes"] for m in before["measurements"]} & {m["nodes"] for m in after["measurements"]})
    head = " | ".join(f"{n:,} nodes" for n in sizes)
    print(f"| | {head} | {fleet.TARGET_NODES:,} nodes (extrapolated) | target |")
    print("|---|" + "---|" * (len(sizes) + 2))
    for name in sorted(set(b) | set(a)):
        limit = fleet.RULE_TARGET_S if name.startswith("rule") else fleet.PANEL_TARGET_S
        (bb, bt, _), (ab, at, standin) = b.get(name, ({}, None, False)), a.get(name, ({}, None, False))
        cells = [f"{fleet._sec(bb.get(n))} → {fleet._sec(ab.get(n))}" for n in sizes]
        over = " **over**" if at is None or at > limit else ""
        mark = STAND_IN if standin else ""
        target = f"{fleet._sec(bt)} → {fleet._sec(at)}{over}"
        print(f"| {name}{mark} | " + " | ".join(cells) + f" | {target} | <= {limit:g} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
