"""benchmarks/fleet.py's pure parts (the fleet's identities, its OpenMetrics history, the dashboards' queries,
the curve), benchmarks/fleet_head.py's live expositions (parsed, served, scraped by a real Prometheus) and
benchmarks/roles_walk.py on the CPU. The fleet runs themselves need minutes and are not part of the suite
(benchmarks/README.md)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import time

import fleet
import fleet_head
import pytest
import roles_walk
import yaml

from harness import find_tool, http_get
from harness.servers import EXPORTER_JOB
from vramwatch.monitoring import promql
from vramwatch.monitoring.dashboards.walk import TimeContext, substitute, variable_names

S = fleet.Series
UUID = "GPU-5e1a0000-0000-4000-8000-00000000000"


LINE = re.compile(r"^([\w:]+)\{(.*)\} (\S+) (\S+)$")


def _parse(text: str) -> list[tuple[str, dict[str, str], float, float]]:
    """(name, labels, value, timestamp) of each line, as promtool reads them."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        assert m, line
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))
        out.append((m.group(1), labels, float(m.group(3)), float(m.group(4))))
    return out


def _node_series() -> list[fleet.Series]:
    out = []
    for r in range(2):
        rank = {"uuid": UUID + str(r), "device": "0", "rank": str(r), "local_rank": str(r), "job_id": "j"}
        out.append(S("torch_cuda_memory_allocated_bytes", rank, 3e9, "gauge"))
        for le, v in (("0.1", 2.0), ("1.0", 8.0), ("+Inf", 10.0)):
            out.append(S("vramwatch_training_step_duration_seconds_bucket", {**rank, "le": le}, v, "counter"))
        out.append(S("vramwatch_training_step_duration_seconds_count", rank, 10.0, "counter"))
        out.append(S("vramwatch_training_step_duration_seconds_sum", rank, 2.5, "counter"))
        out.append(S("torch_cuda_memory_ooms_total", rank, 0.0, "counter"))
        gpu = {"gpu": str(r), "uuid": UUID + str(r), "pci_bus_id": f"00000000:1{r}:00.0"}
        out.append(S("gpu_info", {**gpu, "hostname": "sim"}, 1.0, "const"))
        out.append(S("vramwatch_training_last_step_timestamp_seconds", rank, 5.0, "clock"))
    return out


def test_each_node_and_job_gets_identities_of_its_own():
    series = _node_series()
    f = fleet.Fleet.build(series, nodes=4, per_job=2)
    samples = [s for n in range(4) for s in _parse(f.lines(n, 0, 1e9))]
    keys = {(name, tuple(sorted(labels.items()))) for name, labels, _, _ in samples}
    assert len(keys) == len(samples) == 4 * f.per_node(), "every series of every node is distinct"
    info = [labels for name, labels, _, _ in samples if name == "gpu_info"]
    assert len({lab["uuid"] for lab in info}) == 8 and len({lab["pci_bus_id"] for lab in info}) == 8
    assert {lab["hostname"] for lab in info} == {fleet.node_name(i) for i in range(4)}
    ranks = [labels for name, labels, _, _ in samples if name == "torch_cuda_memory_allocated_bytes"]
    by_job: dict[str, set[str]] = {}
    for lab in ranks:
        by_job.setdefault(lab["job_id"], set()).add(lab["rank"])
        assert lab["job"] == EXPORTER_JOB and lab["instance"].endswith(":9488")
    assert by_job == {"job-0000": {"0", "1", "2", "3"}, "job-0001": {"0", "1", "2", "3"}}
    assert sum(1 for name, *_ in samples if name == "up") == 4


def test_the_history_moves_as_the_contract_says():
    f = fleet.Fleet.build(_node_series(), nodes=1, per_job=1)

    def values(k: int) -> dict[tuple, float]:
        rows = _parse(f.lines(0, k, 1e9 + 15 * k))
        assert {ts for *_, ts in rows} == {1e9 + 15 * k}
        return {(name, tuple(sorted(labels.items()))): v for name, labels, v, _ in rows}

    a, b = values(0), values(40)
    for key, v in a.items():
        name = key[0]
        if name.endswith(("_bucket", "_count", "_sum")):
            assert b[key] > v, f"{name} grows"
        if name == "torch_cuda_memory_ooms_total":
            assert b[key] == v, "a healthy fleet has no OOMs: the alerts stay quiet"
        if name == "vramwatch_training_last_step_timestamp_seconds":
            assert b[key] == pytest.approx(1e9 + 15 * 40 - 1.0), "a live rank's last step is now"
    # the histogram stays a histogram: cumulative buckets, +Inf equal to the count
    for r in ("0", "1"):
        buckets = sorted(
            (float(dict(k[1])["le"]), v) for k, v in b.items() if k[0].endswith("_bucket") and dict(k[1])["rank"] == r
        )
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)
        count = next(v for k, v in b.items() if k[0].endswith("_count") and dict(k[1])["rank"] == r)
        assert buckets[-1][1] == pytest.approx(count)


class _OneTarget:
    """A Prometheus series API that knows one target with one job's rank and GPU, whatever is asked."""

    labels = {"job": EXPORTER_JOB, "instance": "node-0000:9488", "uuid": UUID + "0", "job_id": "job-0000", "rank": "0"}

    def series(self, match: str, start: float, end: float) -> list[dict[str, str]]:
        return [self.labels]


def test_every_panel_query_of_the_shipped_dashboards_is_run_with_its_variables_filled():
    queries = fleet.panel_queries()
    assert {q.dashboard for q in queries} == {p.stem for p in fleet.DASHBOARDS.glob("*.json")}
    shipped = sum(
        1
        for p in fleet.DASHBOARDS.glob("*.json")
        for panel in fleet._walk_panels(json.loads(p.read_text())["panels"])
        for t in panel.get("targets", [])
        if t.get("expr") and not t.get("hide")
    )
    assert len(queries) == shipped
    tc = TimeContext(0, fleet.PANEL_RANGE, 30)
    for sel in fleet.SELECTIONS:
        values, timed = fleet.variable_values(sel, _OneTarget(), tc)
        assert [q.name for q in timed] == [v.name for v in fleet.dashboard_variables() if v.type == "query"]
        for q in queries:
            expr = substitute(q.expr, values, tc)
            assert not variable_names(expr), (q.panel, expr)
        assert values["host"] == "node-0000:9488"  # host's All: the hosts its query offers
    job_expr = next(q.expr for q in queries if "$job_id" in q.expr)
    assert 'job_id=~"job-0000"' in substitute(job_expr, fleet.variable_values("job", _OneTarget(), tc)[0], tc)
    # a panel's "max data points" bounds its steps, as Grafana steps it
    (fullest,) = [q for q in queries if q.panel == "Memory pressure, the ten fullest GPUs"]
    assert fullest.max_points == 360 and tc.for_panel(fullest.max_points).step == 60  # 6 h / 360
    assert tc.for_panel(0).step == 30 and tc.for_panel(360).builtins()["__rate_interval"] == "75s"


def test_sizes_not_measured_are_extrapolated_and_misses_name_what_is_judged():
    assert fleet.fit([100.0, 200.0], [1.0, 2.0], 1000) == pytest.approx(10.0)
    assert fleet.fit([125.0], [0.5], 1000) == pytest.approx(4.0)

    def size(n: int, secs: float) -> dict:
        panel = {"seconds": secs, "targets": []}
        return {
            "nodes": n,
            "rule_groups": {"g": {"median_s": secs / 10}},
            "panels": {
                "all": {"vramwatch-fleet / p": panel, "vramwatch-gpu-health / q": panel},
                "job": {"vramwatch-fleet / p": panel, "vramwatch-gpu-health / q": {"seconds": 0.01}},
            },
        }

    s = fleet.summary([size(100, 0.1), size(200, 0.5)])
    assert not s["target_measured"]
    assert s["rule_groups"]["g"]["at_target"] == pytest.approx(0.37)
    missed = {(m["kind"], m["name"]) for m in s["misses"]}
    # the fleet dashboard at All, the drill-down one with a job chosen
    assert missed == {("panels_all", "vramwatch-fleet / p")}
    # a group alone is judged too; sizes measured in separate runs merge into one curve, each size once
    alone = {**size(1000, 0.1), "rule_groups_alone": {"g": {"sum_s": 1.5}}}
    run = {"meta": {"date": "x"}, "settings": {"nodes_per_job": 16}}
    merged = fleet.merge_results([{**run, "measurements": [alone]}, {**run, "measurements": [size(100, 0.1)]}])
    assert [m["nodes"] for m in merged["measurements"]] == [100, 1000] and merged["summary"]["target_measured"]
    assert ("rule_groups_alone", "g") in {(m["kind"], m["name"]) for m in merged["summary"]["misses"]}
    with pytest.raises(SystemExit, match="100 nodes"):
        fleet.merge_results([{**run, "measurements": [size(100, 0.1)]}] * 2)


def test_the_walks_script_measures_both_walks_on_the_cpu(tmp_path):
    out = tmp_path / "walks.json"
    assert roles_walk.main(["--params", "20", "--segments", "40", "--repeats", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    (case,) = r["cases"]
    assert case["tensors"] == 100 and case["age_max_s"] >= case["walk_every_s"] >= r["role_interval_s"]
    snap = r["snapshot"]
    assert snap["segments_seen"] == 40 and snap["largest_free_bytes"] == roles_walk.MIB
    assert snap["age_max_s"] >= snap["snapshot_every_s"] >= r["largest_block_interval_s"]


def _with_records() -> list[fleet.Series]:
    series = _node_series()
    return series + fleet.recorded_series(series)


def test_every_record_of_the_rules_is_backfilled_or_read_only_at_its_instant():
    recorded = {
        r["record"]
        for p in fleet.RULES.glob("*.yml")
        for g in yaml.safe_load(p.read_text())["groups"]
        for r in g["rules"]
        if "record" in r
    }
    assert recorded == set(promql.RECORDS)
    assert recorded == set(fleet.RECORD_SOURCES) | set(fleet.INSTANT_RECORDS)
    # a record a panel reads over its range has a history
    for q in fleet.panel_queries():
        assert not any(r in q.expr for r in fleet.INSTANT_RECORDS), (q.panel, q.expr)


def test_records_keep_their_sources_labels_and_stop_where_the_rules_take_over():
    f = fleet.Fleet.build(_with_records(), nodes=1, per_job=1, records_until=1e9)
    before, after = _parse(f.lines(0, 0, 1e9)), _parse(f.lines(0, 1, 1e9 + 15))
    stall = [labels for name, labels, *_ in before if name == promql.STALL_MEAN_RECORD]
    counts = [labels for name, labels, *_ in before if name == "vramwatch_training_step_duration_seconds_count"]
    assert stall and sorted(map(sorted, (s.items() for s in stall))) == sorted(
        map(sorted, (c.items() for c in counts))
    ), "one record per rank, with the rank's labels"
    assert not any(":" in name for name, *_ in after), "after the panels' end the rules record"
    assert len(after) == f.live() < len(before) == f.per_node()


def test_a_larger_size_adds_its_nodes_to_the_tsdb_that_promtool_writes(tmp_path):
    promtool = find_tool("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make tools)")
    start = 1_800_000_000.0
    f = fleet.Fleet.build(_with_records(), nodes=2, per_job=1, records_until=start + 300)
    tsdb = tmp_path / "tsdb"
    for nodes in (range(0, 1), range(1, 2)):
        fill = fleet.backfill(f, nodes, start, start + 600, tsdb, tmp_path, 1e9, jobs=2)
        assert fill["samples"] == 40 * f.live() + 21 * (f.per_node() - f.live())
    (tsdb / "wal").mkdir()  # promtool's dump reads the WAL too
    dump = subprocess.run([promtool, "tsdb", "dump", str(tsdb)], capture_output=True, text=True, check=True).stdout
    rows = [re.match(r'^\{__name__="([^"]+)", (.*)\} (\S+) (\d+)$', line) for line in dump.splitlines() if line]
    assert all(rows) and len(rows) == 2 * (40 * f.live() + 21 * (f.per_node() - f.live()))
    instances = {re.search(r'instance="([^"]+)"', m.group(2)).group(1) for m in rows}
    assert instances == {"node-0000:9488", "node-0001:9488"}
    record_ts = [int(m.group(4)) for m in rows if ":" in m.group(1)]
    assert record_ts and max(record_ts) == (start + 300) * 1000
    assert not list(tmp_path.glob("*.om")), "each file goes once promtool has read it"
    # --backfill-only keeps each size's TSDB as a copy a later run measures (state and all), apart from the growing one
    hist = fleet.History(tsdb, start, start + 300, start + 600, nodes=2, live_per_node=f.live(), records=["r"])
    kept = fleet.keep_copy(tmp_path, hist)
    again = fleet.History.open(kept, argparse.Namespace(), f.live())
    assert kept == tmp_path / "sizes" / "2" and (again.nodes, again.records, again.tsdb) == (2, ["r"], kept / "tsdb")
    blocks = sorted(x.name for x in tsdb.iterdir())
    assert sorted(x.name for x in again.tsdb.iterdir()) == blocks
    shutil.rmtree(tsdb / blocks[0])
    assert (again.tsdb / blocks[0]).exists()


def test_an_extended_history_carries_its_counters_on_without_a_reset(tmp_path):
    """--extend-minutes: the samples after the kept history's end follow on from it, one sample apart, and the
    counters keep the step they grew by (a reset would read as a rate spike to every rule)."""
    promtool = find_tool("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make tools)")
    start = time.time() - 1200
    series = _node_series()
    f = fleet.Fleet.build(series, nodes=1, per_job=1)
    tsdb = tmp_path / "tsdb"
    fleet.backfill(f, range(1), start, start + 600, tsdb, tmp_path, 1e9, jobs=1)
    hist = fleet.History(tsdb, start, start + 300, start + 600, nodes=1, live_per_node=f.live())
    args = argparse.Namespace(extend_minutes=0.0, nodes_per_job=1, file_gb=1.0, jobs=1)
    fleet.extend(series, args, tmp_path, hist)
    assert hist.until >= start + 1200 and fleet.History.open(tmp_path, args, f.live()).until == hist.until
    (tsdb / "wal").mkdir()  # promtool's dump reads the WAL too
    dump = subprocess.run([promtool, "tsdb", "dump", str(tsdb)], capture_output=True, text=True, check=True).stdout
    count = sorted(
        (int(ts), float(v))
        for name, labels, v, ts in re.findall(r'^\{__name__="([^"]+)", (.*)\} (\S+) (\d+)$', dump, re.M)
        if name == "vramwatch_training_step_duration_seconds_count" and 'rank="0"' in labels
    )
    stamps = [ts for ts, _ in count]
    assert stamps == list(range(stamps[0], stamps[-1] + 1, 15_000)) and stamps[-1] > (start + 600) * 1000
    steps = {round(b[1] - a[1], 6) for a, b in zip(count, count[1:], strict=False)}
    assert steps == {fleet.SCRAPE_INTERVAL}, steps


def test_paired_rules_run_the_baseline_and_this_trees_rules_in_turn(tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(fleet, "rules_alone", lambda work, hist, args, rules: order.append(rules) or {"x": 1})
    out = fleet.paired_rules(tmp_path, None, argparse.Namespace(), tmp_path / "old")
    assert order == [tmp_path / "old", fleet.RULES] * 2
    assert [r["side"] for r in out["runs"]] == ["A", "B", "A", "B"] and out["runs"][0]["x"] == 1


def _fleet_node() -> list[fleet.Series]:
    """What the dashboards' variables and one GPU panel read: the target's build info, its ranks, its GPUs."""
    out = [S("vramwatch_build_info", {"version": "1"}, 1.0, "const")]
    for r in range(2):
        rank = {"rank": str(r), "local_rank": str(r), "job_id": "j", "hostname": "sim", "world_size": "2"}
        out.append(S("vramwatch_rank_info", rank, 1.0, "const"))
        gpu = {"gpu": str(r), "uuid": UUID + str(r)}
        out.append(S("gpu_info", {**gpu, "hostname": "sim", "name": "NVIDIA H100 80GB HBM3"}, 1.0, "const"))
        out.append(S("gpu_power_watts", gpu, 500.0, "gauge"))
    return out


def test_a_chosen_job_reads_the_gpus_of_its_nodes_alone_and_its_variables_are_timed(tmp_path):
    """Two jobs of two nodes each in a real Prometheus: with the job selection, host expands to the first job's
    nodes through the series API, and a GPU panel reads their GPUs alone; at All, every node's."""
    if find_tool("promtool") is None or find_tool("prometheus") is None:
        pytest.skip("prometheus and promtool not installed (make tools)")
    end = time.time() - 60
    f = fleet.Fleet.build(_fleet_node(), nodes=4, per_job=2)
    tsdb = tmp_path / "tsdb"
    fleet.backfill(f, range(4), end - 600, end, tsdb, tmp_path, 1e9, jobs=2)
    prom = fleet.FleetPrometheus(tmp_path, config=fleet.prometheus_config([], 15.0), tsdb=tsdb, lifecycle=False)
    prom.start(timeout=60)
    try:
        measured = {sel: fleet.panel_times(prom, end, 30.0, 1, sel) for sel in fleet.SELECTIONS}
        alone = fleet.rule_groups_alone(prom, 1)
        judged = {sel: fleet.panel_times(prom, end, 30.0, 1, sel, judged_only=True)[0] for sel in fleet.SELECTIONS}
    finally:
        prom.stop()
    # --judged-only: the fleet dashboard at All, the drill-down ones with a job chosen, and nothing else
    assert judged["all"] and all(k.startswith("vramwatch-fleet ") for k in judged["all"])
    assert set(judged["all"]) | set(judged["job"]) == set(measured["all"][0])
    assert not any(k.startswith("vramwatch-fleet ") for k in judged["job"])
    # every shipped rule, each group's in turn (a rule Prometheus refused would have raised)
    shipped = {
        g["name"]: g["rules"] for p in fleet.RULES.glob("*.yml") for g in yaml.safe_load(p.read_text())["groups"]
    }
    assert {g: len(a["rules"]) for g, a in alone.items()} == {g: len(r) for g, r in shipped.items()}
    for a in alone.values():
        assert a["sum_s"] == pytest.approx(sum(r["seconds"] for r in a["rules"])) and a["sum_s"] > 0
    power = "vramwatch-gpu-health / Power against utilisation"
    for sel, nodes in (("all", 4), ("job", 2)):
        panels, variables = measured[sel]
        queries = variables["queries"]
        assert queries["host"]["options"] == nodes, queries["host"]  # job-0000 runs on node 0 and 1
        assert queries["gpu"]["options"] == 2 * nodes
        assert queries["job_id"]["options"] == 2  # job_id comes before host: both jobs are offered
        assert variables["in_turn_s"] == pytest.approx(sum(q["median_s"] for q in queries.values()))
        assert all(q["median_s"] > 0 for q in queries.values())
        (a,) = [t for t in panels[power]["targets"] if t["ref"] == "A"]
        assert a["series"] == 2 * nodes, (sel, a)  # each node's two GPUs
    job = measured["job"][1]["queries"]
    assert 'job_id=~"job-0000"' in job["host"]["selector"]
    assert job["gpu"]["selector"].count("node-000") == 2  # narrowed to the two hosts host expanded to


def _identities(text: str) -> list[tuple[str, dict[str, str], float, float | None]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), s.value, s.timestamp)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def test_each_node_serves_the_backfills_samples_of_the_moment_as_a_live_exposition():
    f = fleet.Fleet.build(_with_records(), nodes=3, per_job=1, up=False)
    origin, t = 1_800_000_000.0, 1_800_000_000.0 + 15 * 40 + 7
    for node in range(3):
        served = _identities(fleet_head.exposition(f, node, t, origin))
        assert len(served) == f.per_node() and all(ts is None for *_, ts in served), "the scraper stamps it"
        assert {labels["instance"] for _, labels, *_ in served} == {f"{fleet.node_name(node)}:9488"}
        assert {labels["job"] for _, labels, *_ in served} == {EXPORTER_JOB}
        hosts = {labels["hostname"] for _, labels, *_ in served if "hostname" in labels}
        assert hosts == {fleet.node_name(node)}
        # the same values the backfill writes for that sample number
        backfilled = _parse(f.lines(node, 40, t))
        assert [(n, lab, v) for n, lab, v, _ in backfilled] == [(n, lab, v) for n, lab, v, _ in served]
    uuids = [
        {labels["uuid"] for name, labels, *_ in _identities(fleet_head.exposition(f, n, t, origin)) if "uuid" in labels}
        for n in range(3)
    ]
    assert not (uuids[0] & uuids[1]) and not (uuids[1] & uuids[2]), "every node has GPUs of its own"
    later = dict(
        ((n, tuple(sorted(lab.items()))), v)
        for n, lab, v, _ in _identities(fleet_head.exposition(f, 0, t + 150, origin))
    )
    now = dict(
        ((n, tuple(sorted(lab.items()))), v) for n, lab, v, _ in _identities(fleet_head.exposition(f, 0, t, origin))
    )
    count = next(k for k in now if k[0] == "vramwatch_training_step_duration_seconds_count")
    assert later[count] == pytest.approx(now[count] + 10 * fleet.SCRAPE_INTERVAL), "counters move with the clock"


def test_the_rules_timed_are_every_shipped_rule_and_their_reach_is_read_from_the_expression():
    queries = fleet_head.rule_queries()
    shipped = [
        r for p in fleet.RULES.glob("*.yml") for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"]
    ]
    assert [q.expr for q in queries] == [r["expr"] for r in shipped]
    assert len({(q.group, q.name) for q in queries}) == len(queries), "warning and critical twins stay apart"
    assert fleet_head.lookback_s("rate(x[1h] offset 10m) / rate(x[5m:30s])") == 4200
    assert fleet_head.lookback_s("up == 0") == 0


@pytest.mark.e2e
def test_a_real_prometheus_scrapes_each_simulated_node_as_its_own_target(tmp_path, prometheus):
    f = fleet.Fleet.build(_with_records(), nodes=3, per_job=1, up=False)
    with fleet_head.FleetServer(f, origin=1_800_000_000.0) as server:
        assert http_get(server.url + "?node=3", 5)[0] == 404
        code, body = http_get(server.url + "?node=2", 5)
        assert code == 200 and b'instance="node-0002:9488"' in body
        prom = prometheus([], config=fleet_head.head_config(server.port, 3, interval=1.0))
        scraped = prom.wait_for(
            f'count_over_time(up{{job="{EXPORTER_JOB}"}}[1m]) >= 2', timeout=20, check=lambda r: len(r) == 3
        )
        assert sorted(r["metric"]["instance"] for r in scraped) == [f"{fleet.node_name(i)}:9488" for i in range(3)]
        per_node = prom.query(f'count by (instance, hostname) ({{job="{EXPORTER_JOB}", hostname!=""}})')
        assert {(r["metric"]["instance"], r["metric"]["hostname"]) for r in per_node} == {
            (f"{fleet.node_name(i)}:9488", fleet.node_name(i)) for i in range(3)
        }
        stored = prom.query('{instance="node-0001:9488", __name__!~"scrape_.*|up"}')
        served = _identities(fleet_head.exposition(f, 1, time.time(), 0.0))
        assert sorted(sorted(r["metric"].items()) for r in stored) == sorted(
            sorted({"__name__": name, **labels}.items()) for name, labels, *_ in served
        ), "every served series, with the labels the backfill gives it"
        q = fleet_head.Query("g", "r", "count(torch_cuda_memory_allocated_bytes)")
        seconds, series = fleet_head.timed(prom, q, time.time())
        assert seconds > 0 and series == 1
