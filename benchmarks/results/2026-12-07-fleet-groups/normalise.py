"""Each rule group's time alone at 1,000 nodes, on the earlier sweep's machine speed (2026-12-07-fleet-500).

The shared 2-core machine ran 1.3-2.4x slower during these runs than during that sweep, so the paired runs are
read against the groups whose rules did not change: a group's estimate is its time in a paired run at
`size` nodes over the unchanged groups' time in the same run, times the unchanged groups' time at 1,000 nodes
on the earlier sweep's line. Run from anywhere: python3 <this file>.
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
UNCHANGED = ("allocator", "contention", "exporter", "incidents", "leak", "memory")


def main(size: int = 500) -> None:
    earlier = json.loads((HERE.parent / "2026-12-07-fleet-500" / "fleet.json").read_text())
    paired = json.loads((HERE / "paired.json").read_text())
    (m,) = [m for m in paired["measurements"] if m["nodes"] == size]
    ref_1000 = sum(_earlier_alone_1000(earlier, g) for g in UNCHANGED)
    out = {}
    for side in ("A", "B"):
        runs = [r["rule_groups_alone"] for r in m["paired_rules"]["runs"] if r["side"] == side]
        groups = sorted(set().union(*runs))
        for g in groups:
            est = [
                r[g]["sum_s"] / sum(r[f"vramwatch-{u}"]["sum_s"] for u in UNCHANGED) * ref_1000 for r in runs if g in r
            ]
            out.setdefault(side, {})[g] = round(statistics.median(est), 3)
    print(json.dumps({"size": size, "unchanged_at_1000_s": round(ref_1000, 3), "estimate_at_1000_s": out}, indent=1))


def _earlier_alone_1000(earlier: dict, group: str) -> float:
    return earlier["summary"]["rule_groups_alone"][f"vramwatch-{group}"]["at_target"]


if __name__ == "__main__":
    main()
