"""``vramwatch dashboards``: print, write or check the generated Grafana dashboards.

The SDK is imported only when the command runs: every ``vramwatch`` command line (the
scrape server's too) builds this parser, and the server needs neither the SDK nor its import time.
Without the SDK the command lists, prints and writes the dashboards the package ships
(:mod:`vramwatch.shipped`); ``--check`` and ``--config`` (rebuilding them) need it, and say so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vramwatch import shipped

NEEDS = "grafana-foundation-sdk==0.0.21 (pip install 'vramwatch[dashboards]')"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vramwatch.monitoring.alerts.cli import add_config_argument  # no SDK: the parser is always built

    add_config_argument(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--write",
        metavar="DIR",
        help="write DIR/grafana/dashboards/<uid>.json and DIR/kubernetes/dashboards-configmap.yaml",
    )
    g.add_argument("--check", metavar="DIR", help="exit 1 if the files under DIR are missing or out of date")
    g.add_argument("--uid", help="print one dashboard's JSON (default: list the dashboards)")


def run(args: argparse.Namespace) -> int:
    from vramwatch.errors import ConfigError
    from vramwatch.monitoring.alerts.cli import config_from_args

    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"vramwatch dashboards: {e}", file=sys.stderr)
        return 2
    try:
        from vramwatch.monitoring.dashboards import build_all, render
    except ImportError as e:
        if args.check:
            print(f"vramwatch dashboards: --check rebuilds the dashboards and needs {NEEDS}: {e}", file=sys.stderr)
            return 2
        if args.config:  # the shipped JSON holds the default thresholds: writing it would ignore the file
            print(f"vramwatch dashboards: --config rebuilds the dashboards and needs {NEEDS}", file=sys.stderr)
            return 2
        return run_shipped(args)
    if args.write:
        for path in render.write(args.write, cfg):
            print(path)
        return 0
    if args.check:
        bad = render.stale(args.check, cfg)
        for rel in bad:
            print(f"stale: {args.check}/{rel} (run: vramwatch dashboards --write {args.check})", file=sys.stderr)
        return 1 if bad else 0
    return show(args, {str(m.uid): (str(m.title), render.dashboard_json(m)) for m in build_all(cfg)})


def show(args: argparse.Namespace, dashboards: dict[str, tuple[str, str]]) -> int:
    """Print the JSON of the dashboard ``--uid`` names, or list them all; ``dashboards``: uid -> (title, JSON)."""
    if not args.uid:
        for uid, (title, _) in dashboards.items():
            print(f"{uid:28} {title}")
        return 0
    if args.uid in dashboards:
        sys.stdout.write(dashboards[args.uid][1])
        return 0
    print(f"no dashboard {args.uid!r}; known: {', '.join(dashboards)}", file=sys.stderr)
    return 2


# the files `--write` writes (render.generated_files), as globs over the shipped tree
SHIPPED = (
    "grafana/dashboards/*.json",
    "kubernetes/dashboards-configmap.yaml",
    "helm/vramwatch/files/dashboards/*.json",
)


def shipped_dashboard_files() -> list[str]:
    out: list[str] = []
    for pattern in SHIPPED:
        under, _, glob = pattern.rpartition("/")
        out += shipped.shipped_files(under, glob)
    return out


def run_shipped(args: argparse.Namespace) -> int:
    """List, print or write the shipped dashboards (no SDK needed)."""
    try:
        if args.write:
            for rel in shipped_dashboard_files():
                path = Path(args.write) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(shipped.shipped_text(rel), encoding="utf-8")
                print(path)
            return 0
        texts = [shipped.shipped_text(rel) for rel in shipped.shipped_files("grafana/dashboards", "*.json")]
        return show(args, {str(d.get("uid")): (str(d.get("title")), t) for t in texts for d in [json.loads(t)]})
    except FileNotFoundError as e:
        print(f"vramwatch dashboards: {e}; rebuilding them needs {NEEDS}", file=sys.stderr)
        return 2
