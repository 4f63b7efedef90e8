"""``vramwatch report``: the dashboards rendered from a Prometheus into one self-contained HTML file."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prometheus", required=True, help="Prometheus base URL")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("vramwatch report: not implemented yet")
