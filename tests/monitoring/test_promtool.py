"""The rules under Debian's promtool 2.42: `check rules` on every rendering, `test rules` on tests/alerts/.

The test files name one of three rule files that this module renders beside them in a temporary
directory: ``behaviour.rules.yml`` (annotations stripped, so behaviour tests list labels only),
``vramwatch.rules.yml`` (the shipped rules with a Grafana link set, for the wording tests), ``absent.rules.yml`` (the
opt-in absent-target rule) and ``skew-exempt.rules.yml`` (ranks exempted from the rank-skew rule by a
matcher set).
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from harness import ROOT, tool
from vramwatch.monitoring.alerts.render import prometheus_rule, rule_file, to_yaml
from vramwatch.monitoring.alerts.rules import alerts
from vramwatch.monitoring.config import DEFAULT

CASES = ROOT / "tests" / "monitoring" / "alerts"
TEST_FILES = sorted(CASES.glob("*.yaml"))
ABSENT = dataclasses.replace(DEFAULT, target_absent_for="15m")
WORDING = dataclasses.replace(DEFAULT, dashboard_url="http://127.0.0.1:3000")  # no link by default
SKEW_EXEMPT = dataclasses.replace(DEFAULT, rank_skew_exempt=(*DEFAULT.rank_skew_exempt, 'job="pp-train", rank=~"0|3"'))
RENDERED = ("vramwatch.rules.yml", "behaviour.rules.yml", "absent.rules.yml", "skew-exempt.rules.yml")


def _strip_annotations(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for g in doc["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    return doc


def render_into(d: Path) -> None:
    (d / "vramwatch.rules.yml").write_text(to_yaml(rule_file(WORDING)))
    (d / "behaviour.rules.yml").write_text(to_yaml(_strip_annotations(rule_file(DEFAULT))))
    (d / "absent.rules.yml").write_text(to_yaml(_strip_annotations(rule_file(ABSENT))))
    (d / "skew-exempt.rules.yml").write_text(to_yaml(_strip_annotations(rule_file(SKEW_EXEMPT))))


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("promtool")
    render_into(d)
    for f in TEST_FILES:
        shutil.copy(f, d / f.name)
    return d


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", RENDERED)
def test_promtool_check_rules(rules_dir, name):
    r = _promtool("check", "rules", name, cwd=rules_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_checks_the_shipped_file_and_rules_of_a_custom_selector(tmp_path):
    r = _promtool("check", "rules", str(ROOT / "deploy" / "prometheus" / "rules" / "vramwatch.rules.yml"), cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    custom = dataclasses.replace(
        DEFAULT,
        selector='job="train", namespace="ml"',
        job_labels=("namespace", "job"),
        extra_labels=(("team", "ml-infra"),),
        job_gpus_only=False,
    )
    (tmp_path / "custom.yml").write_text(to_yaml(rule_file(custom)))
    r = _promtool("check", "rules", "custom.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    # a PrometheusRule's spec is a rule file
    (tmp_path / "spec.yml").write_text(yaml.safe_dump(prometheus_rule(DEFAULT)["spec"]))
    r = _promtool("check", "rules", "spec.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", TEST_FILES, ids=[f.stem for f in TEST_FILES])
def test_promtool_test_rules(rules_dir, path):
    r = _promtool("test", "rules", path.name, cwd=rules_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_catches_a_broken_expectation(rules_dir, tmp_path):
    """The harness can fail: flip one expectation and promtool must say FAILED."""
    doc = yaml.safe_load((CASES / "memory.yaml").read_text())
    case = next(c for c in doc["tests"][0]["alert_rule_test"] if c.get("exp_alerts"))
    case["exp_alerts"][0]["exp_labels"]["severity"] = "critical"
    shutil.copy(rules_dir / "behaviour.rules.yml", tmp_path)
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(doc))
    r = _promtool("test", "rules", "broken.yaml", cwd=tmp_path)
    assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr


def _expectations() -> tuple[set[tuple[str, str]], set[str], dict[str, list[str]]]:
    """(alertname, severity) pairs some test expects firing; alertnames some test expects silent."""
    fired: set[tuple[str, str]] = set()
    silent: set[str] = set()
    intervals: dict[str, list[str]] = {}
    for f in TEST_FILES:
        doc = yaml.safe_load(f.read_text())
        for t in doc["tests"]:
            intervals.setdefault(f.name, []).append(t.get("interval", ""))
            for case in t.get("alert_rule_test", []):
                exp = case.get("exp_alerts") or []
                if not exp:
                    silent.add(case["alertname"])
                for a in exp:
                    fired.add((case["alertname"], a["exp_labels"]["severity"]))
    return fired, silent, intervals


def test_every_alert_and_severity_is_tested_firing_and_silent():
    fired, silent, _ = _expectations()
    rules = alerts(DEFAULT) + alerts(ABSENT)
    wanted = {(r["alert"], r["labels"]["severity"]) for r in rules}
    assert wanted - fired == set(), "no promtool test sees these fire"
    assert {a for a, _ in wanted} - silent == set(), "no promtool test checks these stay silent"


def test_every_test_group_sets_interval():
    """promtool 2.42 does not default `interval` to evaluation_interval (fixed in 2.49): assertions
    then fail without a hint."""
    _, _, intervals = _expectations()
    missing = {f: iv for f, iv in intervals.items() if not all(iv)}
    assert not missing
