"""Generated documentation: the metric tables come from the contract, never typed twice."""

from __future__ import annotations

import os
import sys

from vramwatch.monitoring import contract

BEGIN = "<!-- BEGIN GENERATED METRICS (vramwatch docs) -->"
END = "<!-- END GENERATED METRICS -->"
CONFIG_BEGIN = "<!-- BEGIN GENERATED SETTINGS (vramwatch docs) -->"
CONFIG_END = "<!-- END GENERATED SETTINGS -->"
_SECTIONS = (
    ("allocator", "Allocator (in each rank, per CUDA device it initialised)"),
    ("heartbeat", "Heartbeat (per rank)"),
    ("nvml", "Device (NVML, in the server, per GPU)"),
    (
        "gpm",
        "GPU activity (NVML GPM, in the server, per GPU; Hopper and newer). Its cost to a GPU-bound step (bf16 "
        "matmuls on an H100, GPM read every second, 8 pairs on/off): +0.44% at the median, range -0.14% to "
        "+0.86%, against an A/A null of -0.44% to +0.45% (benchmarks/RESULTS.md, run 18): within noise, at "
        "most about 0.9%",
    ),
    ("nvlink", "NVLink errors (NVML, in the server, per GPU and link)"),
    ("processes", "Processes on the GPU"),
    ("xid", "Xid events"),
    ("self", "Self-health"),
)


def metric_table(with_absent: bool = False) -> str:
    lines = []
    for collector, title in _SECTIONS:
        rows = [m for m in contract.METRICS if m.collector == collector]
        if not rows:
            continue
        lines.append(f"**{title}**\n")
        head = "| name | type | labels | meaning |" + (" absent when |" if with_absent else "")
        lines.append(head)
        lines.append("|---" * (5 if with_absent else 4) + "|")
        for m in rows:
            labels = ", ".join(f"`{x}`" for x in m.labels) or "—"
            row = f"| `{m.name}` | {m.type} | {labels} | {m.help} |"
            if with_absent:
                row += f" {m.absent_when or '—'} |"
            lines.append(row)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def settings_table() -> str:
    import dataclasses

    from vramwatch.config import ENV_PREFIX, Settings

    lines = ["| key | environment | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        default = f.default if f.default != "" else "(empty)"
        lines.append(f"| `{f.name}` | `{ENV_PREFIX}{f.name.upper()}` | `{default}` | {f.metadata.get('doc', '')} |")
    return "\n".join(lines) + "\n"


def metrics_doc() -> str:
    return (
        "# Metrics\n\nGenerated from `vramwatch/monitoring/contract.py` by `vramwatch docs`; do not edit by hand.\n"
        "Units are Prometheus base units (bytes, seconds, watts, joules, celsius, hertz, ratios 0..1).\n"
        "Info families are gauges of value 1 whose labels carry the information.\n\n" + metric_table(with_absent=True)
    )


def _splice(text: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"README.md lacks the markers {begin} ... {end}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{table}{end}{tail}"


def _readme(old: str) -> str:
    return _splice(_splice(old, metric_table()), settings_table(), CONFIG_BEGIN, CONFIG_END)


def regenerate(check: bool = False, root: str | None = None) -> int:
    """Rewrite (or ``check``) the generated tables of a vramwatch checkout at ``root`` (the working directory);
    2 and one line, writing nothing, where ``root`` is not one (the tables live in the checkout's README)."""
    root = root or os.getcwd()
    readme = os.path.join(root, "README.md")
    try:
        with open(readme, encoding="utf-8") as fh:
            text = fh.read()
        marked = all(m in text for m in (BEGIN, END, CONFIG_BEGIN, CONFIG_END))
    except OSError:
        marked = False
    if not marked:
        print(
            f"vramwatch docs: {root} is not a vramwatch checkout (no README.md with the generated tables); "
            "run it at the root of one, where it rewrites README.md and docs/METRICS.md",
            file=sys.stderr,
        )
        return 2
    targets = {
        os.path.join(root, "README.md"): _readme,
        os.path.join(root, "docs", "METRICS.md"): lambda old: metrics_doc(),
    }
    stale = []
    for path, render in targets.items():
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        new = render(old)
        if new != old:
            stale.append(path)
            if not check:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(new)
    if check and stale:
        print("out of date (run `vramwatch docs`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0
