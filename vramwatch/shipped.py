"""The deploy files vramwatch ships: rules, PrometheusRule, alertmanager.yml, dashboards, manifests, Helm chart.

An installed wheel carries them as package data in ``vramwatch/_deploy`` (the build copies the
repository's ``deploy/`` there: setup.py); a source tree or an editable install reads ``deploy/``
itself. Either way there is one copy, and ``vramwatch alerts --check`` / ``dashboards --check`` keep
it equal to what the Python renders. Paths are relative to that directory, e.g.
``prometheus/rules/vramwatch.rules.yml``.
"""

from __future__ import annotations

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


def path(rel: str) -> Path:
    return root() / rel


def shipped_text(rel: str) -> str:
    """The text of one shipped file; FileNotFoundError names it."""
    p = path(rel)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"vramwatch ships no {rel} (looked in {root()})") from None


def shipped_files(under: str = "", pattern: str = "*") -> list[str]:
    """Relative paths of the shipped files below ``under`` matching ``pattern``, sorted."""
    base = root()
    return sorted(str(p.relative_to(base)) for p in (base / under).glob(pattern) if p.is_file())
