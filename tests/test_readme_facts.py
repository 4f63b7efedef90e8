"""What the README states about the tree: every alert is in its table, every path it names exists, and its
images load from an absolute URL (PyPI renders the README without the repository's files)."""

from __future__ import annotations

import re

from harness import ROOT
from vramwatch.monitoring.alerts.render import rule_file
from vramwatch.monitoring.config import DEFAULT

README = (ROOT / "README.md").read_text()


def test_every_shipped_alert_is_in_the_readme():
    names = {r["alert"] for g in rule_file(DEFAULT)["groups"] for r in g["rules"] if "alert" in r}
    assert names and not {n for n in names if f"`{n}`" not in README}, sorted(
        n for n in names if f"`{n}`" not in README
    )


def test_every_repository_path_the_readme_names_exists():
    paths = set(re.findall(r"`((?:tests|docs|deploy|scripts|harness|benchmarks|vramwatch)/[^`*<> ]*)", README))
    paths |= set(re.findall(r"\]\(((?:tests|docs|deploy|scripts|harness|benchmarks|vramwatch)/[^)#]*)", README))
    globbed = set(re.findall(r"`((?:tests|docs|deploy)/[^` ]*\*[^` ]*)`", README))
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    missing += sorted(g for g in globbed if not list(ROOT.glob(g)))
    assert not missing, missing


def test_images_are_absolute_urls():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert images and all(i.startswith("https://") for i in images), images
