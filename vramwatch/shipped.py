"""The deploy files vramwatch ships: rules, PrometheusRule, alertmanager.yml, dashboards, manifests, Helm chart.

An installed wheel carries them as package data in ``vramwatch/_deploy`` (the build copies the
repository's ``deploy/`` there: setup.py); a source tree or an editable install reads ``deploy/``
itself. Either way there is one copy, and ``vramwatch alerts --check`` / ``dashboards --check`` keep
it equal to what the Python renders. Paths are relative to that directory, e.g.
``prometheus/rules/vramwatch.rules.yml``. ``vramwatch deploy --write DIR`` copies them all out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PACKAGE_DATA = Path(__file__).resolve().parent / "_deploy"
SOURCE_TREE = Path(__file__).resolve().parent.parent / "deploy"


def root() -> Path:
    """Where the shipped files are: the wheel's package data, else the source tree's deploy/."""
    if PACKAGE_DATA.is_dir():
        return PACKAGE_DATA
    if (SOURCE_TREE / "prometheus").is_dir():
        return SOURCE_TREE
    raise FileNotFoundError(f"vramwatch's deploy files are missing: neither {PACKAGE_DATA} nor {SOURCE_TREE}")


def shipped_text(rel: str) -> str:
    """The text of one shipped file; FileNotFoundError names it."""
    try:
        return (root() / rel).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"vramwatch ships no {rel} (looked in {root()})") from None


def shipped_files(under: str = "", pattern: str = "*") -> list[str]:
    """Relative paths of the shipped files below ``under`` matching ``pattern``, sorted."""
    base = root()
    return sorted(str(p.relative_to(base)) for p in (base / under).glob(pattern) if p.is_file())


# --- `vramwatch deploy --write DIR`: the shipped files, for a wheel install that has no checkout ---


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--write",
        metavar="DIR",
        required=True,
        help="copy the shipped deploy files into DIR: helm/vramwatch (the chart), kubernetes/, systemd/, "
        "alertmanager/alertmanager.yml, prometheus/ (rules, config), grafana/dashboards/, ...",
    )
    p.add_argument("--force", action="store_true", help="overwrite files in DIR that differ")


def run(args: argparse.Namespace) -> int:
    base = root()
    files = sorted(p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    target = Path(args.write)
    texts = {target / p.relative_to(base): p.read_bytes() for p in files}
    clash = [str(t) for t, data in texts.items() if t.exists() and t.read_bytes() != data]
    if clash and not args.force:
        print(f"vramwatch deploy: would overwrite {', '.join(clash)} (--force to do so)", file=sys.stderr)
        return 1
    for t, data in texts.items():
        t.parent.mkdir(parents=True, exist_ok=True)
        t.write_bytes(data)
    print(f"wrote {len(texts)} files under {target} (the Helm chart: {target / 'helm' / 'vramwatch'})")
    return 0
