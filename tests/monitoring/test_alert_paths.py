"""The alert rules under configs other than the shipped one, the helpers that write their PromQL, and the
``vramwatch alerts`` command line.

The shipped rule file is pinned whole by test_alerts.py (`test_generated_files_are_in_sync`) and its
behaviour by promtool (test_promtool.py); these cover what the default config never takes: an empty
selector, no dashboard URL, rules off, per-job GPU filtering off, exempt ranks, the CLI's options.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil

import pytest
import yaml

from harness import ROOT
from vramwatch.errors import ConfigError
from vramwatch.monitoring import contract, dashboard_ids, helm, promql
from vramwatch.monitoring.alerts import cli, progress, rules
from vramwatch.monitoring.alerts.render import prometheus_rule, rule_file, to_yaml
from vramwatch.monitoring.config import DEFAULT, DEFAULT_RELEASE, shown

BARE = dataclasses.replace(DEFAULT, selector="", target_selector="")


def by_name(cfg, name, severity="warning"):
    (r,) = [r for r in rules.alerts(cfg) if r["alert"] == name and r["labels"]["severity"] == severity]
    return r


# --- promql helpers ---


def test_metric_adds_the_selector_and_matchers_and_checks_the_contract():
    assert promql.metric(BARE, "gpu_power_watts") == "gpu_power_watts"
    assert promql.metric(BARE, "gpu_power_watts", "", 'gpu="0"') == 'gpu_power_watts{gpu="0"}'
    cfg = dataclasses.replace(DEFAULT, selector='job="t"')
    assert promql.metric(cfg, "gpu_power_watts", 'gpu="0"') == 'gpu_power_watts{job="t", gpu="0"}'
    h = "vramwatch_training_step_duration_seconds"
    for suffix in ("_sum", "_count", "_bucket"):
        assert promql.metric(BARE, h + suffix) == h + suffix  # a contract histogram's series
    for unknown in ("no_such_metric", h + "_total", "no_such_metric_sum"):
        with pytest.raises(KeyError):
            promql.metric(BARE, unknown)


def test_numbers_percentages_and_durations_as_promql_writes_them():
    assert [promql.num(v) for v in (0.85, 120.0, 4294967296, 0.5, 3)] == ["0.85", "120", "4294967296", "0.5", "3"]
    assert [promql.percent(r) for r in (0.85, 0.355, 1.0, 0.1234, 0.05, 0.123456)] == [
        "85%",
        "35.5%",
        "100%",
        "12.34%",
        "5%",
        "12.3456%",  # four decimals of a percent, the last one kept
    ]
    assert [promql.duration(t) for t in ("90s", "5m", "1h30m", "500ms")] == ["1m30s", "5m", "1h30m", "500ms"]
    assert promql.regex((48, 62, "x")) == "48|62|x" and promql.up(BARE) == "up{}"
    assert promql.label("rank") == "{{ $labels.rank }}"


def test_an_alert_rule_dict():
    r = promql.alert("A", "x > 1", "warning", "S.", "D.", "90s", {"team": "ml"})
    assert r == {
        "alert": "A",
        "expr": "x > 1",
        "for": "1m30s",
        "labels": {"severity": "warning", "team": "ml"},
        "annotations": {"summary": "S.", "description": "D."},
    }
    assert "for" not in promql.alert("A", "x", "critical", "S.", "D.") and "for" not in promql.alert(
        "A", "x", "critical", "S.", "D.", "0s"
    )
    assert promql.alert("A", "x", "critical", "S.", "D.")["labels"] == {"severity": "critical"}
    assert promql.alert("A", "x", "critical", "S.", "D.", "1s")["for"] == "1s"  # a scaled config's shortest


def test_job_gpus_joins_only_when_configured():
    on = dataclasses.replace(BARE, job_gpus_only=True)
    off = dataclasses.replace(BARE, job_gpus_only=False)
    assert promql.job_gpus(off, "x > 0") == "x > 0"
    ignore = ",".join(("gpu", "reason", *(x for x in contract.RANK_DEVICE if x != "uuid")))
    assert promql.job_gpus(on, "x > 0", "reason") == (
        f"x > 0\nand ignoring({ignore})\ntorch_cuda_memory_allocated_bytes"
    )
    assert "ignoring(" not in by_name(off, "GPUForeignProcess")["expr"]
    assert "ignoring(" in by_name(on, "GPUForeignProcess")["expr"]


def test_stall_bound_floor_and_step_statistics():
    cfg = dataclasses.replace(BARE, stall_factor=4.0, stall_window="10m", stall_min_seconds=120.0)
    out = promql.stall_bound(cfg, lambda n: n)
    h = "vramwatch_training_step_duration_seconds"
    assert out == f"clamp_min(4 * {promql.STALL_MEAN_RECORD}, 120)"
    # the mean is 0, not NaN, for a rank with a heartbeat and no step in the window: its bound is the floor
    assert promql.stall_mean(cfg) == (
        f"rate({h}_sum[10m]) / rate({h}_count[10m]) > 0\nor vramwatch_training_last_step_timestamp_seconds * 0"
    )
    assert promql.stall_bound(cfg, lambda n: n, floor=600.0).endswith(", 600)")
    cfg = dataclasses.replace(BARE, straggler_window="15m", job_labels=("namespace", "job"))
    mean = promql.step_mean(cfg, lambda n: n)
    assert mean == f"(rate({h}_sum[15m]) / rate({h}_count[15m]) > 0)"
    skew = promql.step_skew(cfg, "m")  # over the median of the rank's job: the job's labels on both sides
    assert skew.startswith("m\n/ on(namespace, job") and "group_left()\nquantile by (namespace, job" in skew
    assert skew.endswith(") (0.5, m)")


# --- the rule modules under other configs ---


def test_without_a_target_selector_the_target_rules_use_what_served_vramwatch():
    down = by_name(BARE, "VramwatchTargetDown")["expr"]
    assert down.startswith("(\nup == 0 and on(job, instance) max_over_time(vramwatch_build_info[")
    assert "\nor " not in down
    impostor = by_name(BARE, "VramwatchTargetImpostor")["expr"]
    assert impostor.startswith("up == 1\nunless on(job, instance) vramwatch_build_info\n")
    cfg = dataclasses.replace(BARE, target_selector='job="v"')
    down = by_name(cfg, "VramwatchTargetDown")["expr"]
    assert down.startswith('(\nup{job="v"} == 0\nor up == 0 and on(job, instance)')
    assert by_name(cfg, "VramwatchTargetImpostor")["expr"].startswith('up{job="v"} == 1\nunless')


def test_the_absent_target_rule_only_when_configured():
    assert "VramwatchTargetAbsent" not in rules.alert_names(DEFAULT)
    cfg = dataclasses.replace(DEFAULT, target_absent_for="15m", target_selector='job="v"')
    r = by_name(cfg, "VramwatchTargetAbsent")
    assert r["expr"] == 'absent(up{job="v"})' and r["for"] == "15m"
    assert r["annotations"]["summary"] == "No vramwatch target is known to Prometheus."
    assert r["annotations"]["description"] == (
        'Prometheus has had no target matching job="v" for more than 15m: service discovery lost the jobs, '
        "or none runs."
    )


def test_exempt_ranks_are_never_flagged_but_count_in_the_median():
    plain = by_name(dataclasses.replace(BARE, rank_skew_exempt=()), "TrainingRankMemorySkew")["expr"]
    assert "unless" not in plain
    cfg = dataclasses.replace(BARE, rank_skew_exempt=('rank="0"', 'rank="7"'))
    expr = by_name(cfg, "TrainingRankMemorySkew")["expr"]
    flagged = (
        '(torch_cuda_memory_reserved_bytes unless (torch_cuda_memory_reserved_bytes{rank="0"} or '
        'torch_cuda_memory_reserved_bytes{rank="7"}))'
    )
    assert expr.count(flagged) == 2  # the ratio and the byte margin
    assert "(0.5, torch_cuda_memory_reserved_bytes)" in expr  # the median over every rank, exempt ones too


def test_the_first_stopped_ranks_query_is_a_go_string_even_with_quotes_in_the_selector():
    assert promql.go_string('a\\b "c"') == '"a\\\\b \\"c\\""'
    cfg = dataclasses.replace(DEFAULT, selector='job="train"', job_labels=("job",))
    text = progress.first_stopped(cfg)
    assert text.startswith(
        '{{ with printf "bottomk(1, vramwatch_training_last_step_timestamp_seconds{job=\\"train\\", job=%q, '
        'job_id=%q})" $labels.job $labels.job_id | query }}{{ with first . }}'
    )
    assert text in by_name(cfg, "TrainingStalled", "critical")["annotations"]["description"]


# --- assembling the groups ---


def test_annotations_without_a_dashboard_and_with_extra_labels():
    cfg = dataclasses.replace(
        DEFAULT,
        dashboard_url="",
        runbook_url="https://wiki.example/{alertname}#{anchor}",
        extra_labels=(("team", "ml"), ("tier", "1")),
    )
    for r in rules.alerts(cfg):
        assert "dashboard_url" not in r["annotations"], r["alert"]
        assert r["annotations"]["runbook_url"] == f"https://wiki.example/{r['alert']}#{r['alert'].lower()}"
        assert r["labels"]["team"] == "ml" and r["labels"]["tier"] == "1" and r["labels"]["severity"]
    records = [r for g in rules.groups(cfg) for r in g["rules"] if "record" in r]
    assert records and all("labels" not in r and "annotations" not in r for r in records)


def test_each_alert_links_its_own_dashboard_scoped_by_its_labels():
    cfg = dataclasses.replace(DEFAULT, dashboard_url="https://g.example")
    link = rules.dashboard_link(cfg, "uid-x")
    assert link == (
        "https://g.example/d/uid-x?orgId=1"
        "{{ if $labels.instance }}&var-host={{ $labels.instance }}{{ end }}"
        "{{ if $labels.uuid }}&var-gpu={{ $labels.uuid }}{{ end }}"
        "{{ if $labels.job_id }}&var-job_id={{ $labels.job_id }}{{ end }}"
        "{{ if $labels.rank }}&var-rank={{ $labels.rank }}{{ end }}"
    )
    uid = {r["alert"]: r["annotations"]["dashboard_url"].split("/d/")[1].split("?")[0] for r in rules.alerts(cfg)}
    assert uid["GPUForeignProcess"] == dashboard_ids.GPU_HEALTH_UID  # not its area's (contention: training memory)
    assert uid["TrainingRankMemorySkew"] == dashboard_ids.TRAINING_MEMORY_UID
    assert uid["GPULost"] == dashboard_ids.GPU_HEALTH_UID and uid["VramwatchTargetDown"] == dashboard_ids.FLEET_UID
    assert rules.anchor("GPULost") == "gpulost"


def test_disabled_alerts_go_and_a_group_keeps_only_its_records():
    names = ("GPUMemoryUsageHigh", "TorchMemoryBudgetHigh")  # the whole memory group
    cfg = dataclasses.replace(DEFAULT, disabled_alerts=names)
    assert [g["name"] for g in rules.groups(cfg)] == [g for g, _, _ in rules.AREAS]
    memory = next(g for g in rules.groups(cfg) if g["name"] == "vramwatch-memory")
    # the dashboards read the card's ratio; the records stay whichever alerts are off
    assert [r.get("record") for r in memory["rules"]] == [promql.MEMORY_RATIO_RECORD, promql.BUDGET_RATIO_RECORD]
    assert not set(names) & set(rules.alert_names(cfg))
    assert set(rules.alert_names(DEFAULT)) - set(names) == set(rules.alert_names(cfg))


def test_an_unknown_disabled_alert_is_a_config_error_naming_it():
    cfg = dataclasses.replace(DEFAULT, disabled_alerts=("GPULost", "NoSuchAlert", "AlsoNot"))
    with pytest.raises(ConfigError) as e:
        rules.groups(cfg)
    msg = str(e.value)
    assert msg.startswith("invalid monitoring setting disabled_alerts=") and "(from MonitoringConfig)" in msg
    assert f"disabled_alerts={shown(cfg.disabled_alerts)} (from MonitoringConfig)" in msg
    assert msg.endswith(f"no alert named AlsoNot, NoSuchAlert; known: {', '.join(sorted(rules.all_alert_names()))}")
    assert "VramwatchTargetAbsent" in msg
    with pytest.raises(ConfigError, match=r"\(from monitoring\.yaml\)"):
        rules.check_disabled_alerts(cfg, "monitoring.yaml")
    rules.check_disabled_alerts(dataclasses.replace(DEFAULT, disabled_alerts=("VramwatchTargetAbsent",)))


def test_all_alert_names_include_the_opt_in_rule():
    assert rules.all_alert_names() == set(rules.alert_names(dataclasses.replace(DEFAULT, target_absent_for="1h")))


# --- rendering ---


def test_a_prometheusrule_without_release_or_namespace_and_with_labels():
    pr = prometheus_rule(DEFAULT, name="x", namespace=None, release=None, labels={"team": "ml"})
    assert pr["metadata"] == {
        "name": "x",
        "labels": {"app.kubernetes.io/name": "vramwatch", "app.kubernetes.io/component": "alert-rules", "team": "ml"},
    }
    pr = prometheus_rule(DEFAULT, namespace="ml", release="kps", labels={"release": "other"})
    assert pr["metadata"]["namespace"] == "ml" and pr["metadata"]["labels"]["release"] == "other"
    assert prometheus_rule()["metadata"]["labels"]["release"] == DEFAULT_RELEASE
    assert prometheus_rule()["metadata"]["name"] == "vramwatch"


def test_yaml_keeps_one_line_strings_plain_and_multi_line_ones_as_blocks():
    text = to_yaml({"a": "x > 1", "b": "x\nand y", "c": "ü"})
    assert text.startswith("# Generated by `vramwatch alerts`")
    assert "a: x > 1\n" in text and "b: |-\n  x\n  and y\n" in text and "c: ü\n" in text


# --- the command line ---


def parser():
    p = argparse.ArgumentParser(prog="vramwatch alerts")
    cli.add_arguments(p)
    return p


def run(*argv):
    return cli.run(parser().parse_args(list(argv)))


def test_cli_options_and_their_defaults():
    p = parser()
    args = p.parse_args([])
    assert (args.config, args.format, args.release, args.namespace, args.selector) == (
        None,
        "rules",
        DEFAULT_RELEASE,
        None,
        None,
    )
    assert args.write is None and args.check is None
    text = p.format_help()
    for usage in ("--config FILE", "--format {rules,prometheusrule}", "--write DIR", "--check DIR", "--selector"):
        assert usage in text
    helps = {a.dest: a.help for a in p._actions}
    assert all(helps[d] for d in ("config", "format", "release", "namespace", "selector", "write", "check"))
    for bad in (["--format", "yaml"], ["--write", "a", "--check", "b"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_cli_renders_a_config_file(tmp_path, capsys):
    f = tmp_path / "monitoring.yaml"
    f.write_text("memory_warning_ratio: 0.8\nselector: 'job=\"train\"'\n")
    assert run("--config", str(f)) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc == rule_file(dataclasses.replace(DEFAULT, memory_warning_ratio=0.8, selector='job="train"'))
    assert run("--config", str(f), "--format", "prometheusrule", "--namespace", "ml") == 0
    pr = yaml.safe_load(capsys.readouterr().out)
    assert pr["spec"] == doc and pr["metadata"]["namespace"] == "ml"


def test_cli_selector_overrides_the_configs(capsys):
    assert run("--selector", 'job="x"', "--format", "prometheusrule", "--release", "") == 0
    pr = yaml.safe_load(capsys.readouterr().out)
    assert pr["spec"] == rule_file(dataclasses.replace(DEFAULT, selector='job="x"'))
    assert "release" not in pr["metadata"]["labels"]


def test_cli_bad_config_or_selector_exits_2_naming_it(tmp_path, capsys):
    f = tmp_path / "monitoring.yaml"
    f.write_text("no_such_key: 1\n")
    assert run("--config", str(f)) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("vramwatch alerts: ") and "no_such_key" in out.err
    assert run("--selector", "job=") == 2
    err = capsys.readouterr().err
    assert err.startswith("vramwatch alerts: ") and "(from --selector)" in err


def test_cli_write_and_check_cover_the_chart_where_the_directory_has_it(tmp_path, capsys):
    (tmp_path / helm.CHART).mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / helm.CHART / "Chart.yaml", tmp_path / helm.CHART / "Chart.yaml")
    assert run("--write", str(tmp_path)) == 0
    out = capsys.readouterr().out
    for rel in (cli.RULES_PATH, cli.PROMETHEUS_RULE_PATH, cli.EXAMPLE_CONFIG_PATH, helm.RULES_PATH):
        assert (tmp_path / rel).is_file() and f"wrote {tmp_path / rel}" in out
    assert (tmp_path / cli.RULES_PATH).read_text(encoding="utf-8") == to_yaml(rule_file(DEFAULT))
    assert run("--check", str(tmp_path)) == 0
    template = tmp_path / helm.RULES_PATH
    template.write_text(template.read_text() + "# edited\n")
    assert run("--check", str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert err == f"vramwatch alerts: {template} is out of date (run `vramwatch alerts --write {tmp_path}`)\n"
    template.unlink()  # missing counts as stale too
    assert run("--check", str(tmp_path)) == 1
