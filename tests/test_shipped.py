"""vramwatch.shipped in a source tree, `vramwatch dashboards` without the SDK, and `vramwatch --version`
(the installed wheel: tests/deploy/test_wheel.py)."""

from __future__ import annotations

import json
import sys

import pytest

from harness import ROOT
from vramwatch import _version, cli, shipped
from vramwatch.monitoring.dashboards import cli as dashboards_cli

DEPLOY = ROOT / "deploy"


def test_a_source_tree_reads_its_own_deploy_directory():
    assert shipped.root() == DEPLOY
    rel = "prometheus/rules/vramwatch.rules.yml"
    assert shipped.shipped_text(rel) == (DEPLOY / rel).read_text()
    with pytest.raises(FileNotFoundError, match="no-such.yml"):
        shipped.shipped_text("no-such.yml")


def test_the_shipped_dashboard_globs_are_what_render_writes():
    pytest.importorskip("grafana_foundation_sdk")
    from vramwatch.monitoring.dashboards import render

    assert sorted(dashboards_cli.shipped_dashboard_files()) == sorted(render.generated_files())


@pytest.fixture
def no_sdk(monkeypatch):
    """grafana-foundation-sdk unimportable, and the dashboard modules that import it forgotten."""
    for name in [n for n in sys.modules if n.startswith(("vramwatch.monitoring.dashboards", "grafana_foundation_sdk"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "grafana_foundation_sdk", None)


def test_dashboards_without_the_sdk_list_print_and_write_the_shipped_files(no_sdk, capsys, tmp_path):
    uids = sorted(json.loads(p.read_text())["uid"] for p in (DEPLOY / "grafana" / "dashboards").glob("*.json"))
    assert cli.main(["dashboards"]) == 0
    assert sorted(line.split()[0] for line in capsys.readouterr().out.splitlines()) == uids
    assert cli.main(["dashboards", "--uid", uids[0]]) == 0
    assert capsys.readouterr().out == (DEPLOY / "grafana" / "dashboards" / f"{uids[0]}.json").read_text()
    assert cli.main(["dashboards", "--uid", "nope"]) == 2
    assert cli.main(["dashboards", "--write", str(tmp_path)]) == 0
    for rel in dashboards_cli.shipped_dashboard_files():
        assert (tmp_path / rel).read_text() == (DEPLOY / rel).read_text()
    capsys.readouterr()
    assert cli.main(["dashboards", "--check", str(DEPLOY)]) == 2
    assert "grafana-foundation-sdk" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.split()[:2] == ["vramwatch", _version.__version__]
