"""Every query of every panel, run through a real Prometheus scraping the simulated GPU and two ranks.

A query that errors or returns no series fails the test; all failures are listed at once. Each
query runs twice: with every variable at All, and with each variable at the first value its own
query offers (job, host, GPU, rank), as a person narrowing the dashboard down would. A second
scenario, two jobs on two nodes, checks that choosing a job narrows the GPU panels to its hosts.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

pytest.importorskip("grafana_foundation_sdk")

import live_scenario

from vramwatch.monitoring.config import DEFAULT
from vramwatch.monitoring.dashboards import build_all
from vramwatch.monitoring.dashboards.walk import TimeContext, format_values, spec
from vramwatch.report.data import run_annotation, run_panel, variable_options, variable_values
from vramwatch.report.prom import PromClient
from vramwatch.sim.state import SimGpu

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    lv = live_scenario.start(tmp_path_factory.mktemp("dash-live"))
    yield lv
    live_scenario.stop(lv)


@pytest.fixture(scope="module")
def client(live):
    return PromClient(live.prometheus.url, timeout=10)


def _tc(live) -> TimeContext:
    end = time.time()
    return TimeContext(start=live.t0 - 2, end=end, step=1.0, scrape_interval=1.0)


def test_variables_offer_the_node_its_gpus_and_ranks(live, client):
    """Each variable's own query, run as Grafana runs it (narrowed by the ones before it, at All)."""
    tc = _tc(live)
    node = live.exporter.node()
    expected = {
        "job": ["vramwatch"],
        "namespace": [live_scenario.TARGET_LABELS["namespace"]],
        "batch_kubernetes_io_job_name": [live_scenario.TARGET_LABELS["batch_kubernetes_io_job_name"]],
        "training_kubeflow_org_job_name": [],  # absent on this target: the variable offers only All
        "job_name": [],
        "node": [live_scenario.TARGET_LABELS["node"]],
        "host": [f"127.0.0.1:{live.exporter.port}"],
        "gpu": sorted(g.uuid for g in node.gpus),
        "job_id": [live_scenario.TARGET_LABELS["batch_kubernetes_io_job_name"]],
        "rank": ["0", "1"],
    }
    for d in (spec(m) for m in build_all()):
        values: dict[str, str] = {}
        offered = {}
        for v in d.variables:
            if v.type == "query":
                offered[v.name] = variable_options(client, v, values, tc)
                values[v.name] = v.all_value or format_values(offered[v.name], "")  # host: All is what it offers
        assert offered == expected, d.uid
        assert values["host"] == f"127\\\\.0\\\\.0\\\\.1:{live.exporter.port}"  # escaped as Grafana escapes it
        # narrowed by the earlier ones: a namespace that does not exist leaves nothing to pick after it
        values = {**variable_values(d, {}, client, tc), "namespace": "no-such-namespace"}
        later = [v for v in d.variables if v.type == "query"][2:]
        assert [variable_options(client, v, values, tc) for v in later] == [[]] * len(later), d.uid


def _failures(client, d, values, tc) -> tuple[list[str], int]:
    failures, ran = [], 0
    for p in d.panels:
        res = run_panel(client, p, values, tc)
        for r in res.results:
            ran += 1
            if r.error:
                failures.append(f"{d.uid} / {p.title} / {r.target.ref}: error {r.error}\n    {r.expr}")
            elif not r.series:
                failures.append(f"{d.uid} / {p.title} / {r.target.ref}: no series\n    {r.expr}")
            elif not any(v == v for s in r.series for v in s.values):  # all NaN draws nothing
                failures.append(f"{d.uid} / {p.title} / {r.target.ref}: only NaN\n    {r.expr}")
    return failures, ran


@pytest.mark.parametrize("mode", ["all", "first"])
def test_every_panel_query_returns_series(live, client, mode):
    tc = _tc(live)
    failures, ran = [], 0
    for d in (spec(m) for m in build_all()):
        values = variable_values(d, {}, client, tc, first=(mode == "first"))
        if mode == "first":
            # every variable whose label the target has is at a concrete value, the others at All
            concrete = {k for k, v in values.items() if v != ".*"}
            assert concrete == {v.name for v in d.variables if v.type == "query"} - {
                "training_kubeflow_org_job_name",
                "job_name",
            }, values
        f, n = _failures(client, d, values, tc)
        failures += f
        ran += n
    assert ran >= 50  # 52 targets when written
    assert not failures, f"{len(failures)} of {ran} queries failed:\n" + "\n".join(failures)


def test_each_variable_alone_at_a_value_narrows_every_panel(live, client):
    """One variable at a time: at a value it offers every panel still has data; at a value nobody has,
    every panel is empty (the matcher is in every query), except the alerts' and the zero-defaulted stats.
    The variables after it follow it, as in Grafana: a job that nobody runs leaves no host either."""
    tc = _tc(live)
    for d in (spec(m) for m in build_all()):
        all_values = variable_values(d, {}, client, tc)
        for v in (v for v in d.variables if v.type == "query"):
            options = variable_options(client, v, all_values, tc)
            if options:
                values = variable_values(d, {v.name: options[:1]}, client, tc)
                failures, _ = _failures(client, d, values, tc)
                assert not failures, f"{v.name}={options[0]}:\n" + "\n".join(failures)
            if v.name in ("gpu", "rank"):
                continue  # panels of a GPU's series do not narrow by rank, nor the heartbeat's by GPU
            nobody = variable_values(d, {v.name: ["no-such-value"]}, client, tc)
            for p in d.panels:
                for r in run_panel(client, p, nobody, tc).results:
                    if "ALERTS" in r.expr or "vector(0)" in r.expr:
                        continue
                    assert not r.error and not r.series, (d.uid, v.name, p.title, r.target.ref, r.expr)


def test_annotations_mark_the_xid_and_the_oom(live, client):
    tc = _tc(live)
    seen = {}
    for d in (spec(m) for m in build_all()):
        values = variable_values(d, {}, client, tc)
        for a in d.annotations:
            res = run_annotation(client, a, values, tc)
            assert not res.error, (d.uid, a.name, res.error)
            seen.setdefault(a.name, []).extend(res.events)
    assert any(title == f"Xid {live_scenario.XID}" for _, _, title in seen["Xid events"]), seen
    assert any(title == "OOM in rank 0" for _, _, title in seen["OOMs"]), seen
    for start, _, _ in seen["Xid events"] + seen["OOMs"]:
        assert live.t0 - 2 <= start <= time.time()


def test_stall_signature_and_live_values(live, client):
    """A few panels' numbers against what the scenario did (the queries mean what they say)."""
    tc = _tc(live)
    d = {x.uid: x for x in (spec(m) for m in build_all())}
    values = variable_values(d["vramwatch-fleet"], {}, client, tc)

    def panel(uid, title):
        (p,) = [p for p in d[uid].panels if p.title == title]
        return {r.target.ref: r for r in run_panel(client, p, values, tc).results}

    stalled = panel("vramwatch-fleet", "Stalled ranks")["A"].series
    assert [s.values[-1] for s in stalled] == [0.0]  # the 14 s scenario stays under the 120 s minimum bound
    ages = panel("vramwatch-fleet", "Ranks by heartbeat age")
    by_rank = {s.labels["rank"]: s.values[-1] for s in ages["A"].series}
    assert by_rank["0"] > by_rank["1"] + 2, by_rank  # rank 0 stopped stepping
    assert [s.labels["rank"] for s in ages["A"].series][0] == "0"  # sort_desc: the oldest first
    power = panel("vramwatch-gpu-health", "Power against utilisation")
    gpu0 = {ref: next(s for s in power[ref].series if s.labels.get("gpu") == "0") for ref in "ABC"}
    assert gpu0["C"].values[-1] == pytest.approx(1.0)  # utilisation pinned
    assert gpu0["A"].values[-1] < max(gpu0["A"].values) - 100  # power fell
    assert gpu0["B"].values[-1] == pytest.approx(SimGpu(0, "").power_limit_w * DEFAULT.busy_power_ratio)
    xids = panel("vramwatch-gpu-health", "Xid events")
    assert {s.labels["xid"] for s in xids["B"].series} == {str(live_scenario.XID)}
    assert xids["B"].series[0].values == [1.0]
    pressure = panel("vramwatch-fleet", "GPUs by memory pressure")
    used = [s.values[0] for s in pressure["A"].series]
    assert used == sorted(used, reverse=True) and len(used) == 2
    assert {s.labels["gpu"] for s in pressure["B"].series} == {"0", "1"}  # joined to the GPU index


# --- two jobs on two nodes: choosing a job narrows the GPU panels to its hosts ---

JOBS = ("job-a", "job-b")


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    """Two nodes (two `vramwatch serve` targets, two simulated GPUs each), each running one job of two ranks,
    under one Prometheus with the shipped rules' records. Yields (client, {job_id: its target})."""
    from harness import Exporter, Prometheus, start_sim_rank, stop_proc

    tmp = tmp_path_factory.mktemp("dash-jobs")
    exporters, ranks, prom = [], [], None
    try:
        for job in JOBS:
            (tmp / job).mkdir()
            exp = Exporter(tmp / job, gpus=2, nvml_slow_interval=1.0).start()
            exporters.append(exp)
            for r in range(2):
                ranks.append(
                    start_sim_rank(
                        exp, r, "--duration", "300", world_size=2, cuda_visible=str(r), job_id=job, interval=0.5
                    )
                )
        prom = Prometheus(
            tmp,
            [f"127.0.0.1:{e.port}" for e in exporters],
            rule_files=[str(live_scenario._recording_rules(tmp))],
        ).start()
        prom.wait_for("count(vramwatch_rank_info) == 4", timeout=60)
        prom.wait_for("count(torch_cuda_memory_allocated_bytes) == 4", timeout=60)
        prom.wait_for(f"count({promql_memory_ratio()}) == 4", timeout=60)
        prom.wait_for("count(gpu_sm_activity_ratio) == 4", timeout=60)  # GPM: the slow cadence
        time.sleep(3)  # a few samples of every family
        hosts = {job: f"127.0.0.1:{e.port}" for job, e in zip(JOBS, exporters, strict=True)}
        yield PromClient(prom.url, timeout=10), hosts
    finally:
        for p in ranks:
            stop_proc(p)
        if prom is not None:
            prom.stop()
        for e in exporters:
            e.stop()


def promql_memory_ratio() -> str:
    from vramwatch.monitoring import promql

    return promql.MEMORY_RATIO_RECORD


def _gpu_targets(d):
    """The targets that read a GPU family alone (no rank series, so no job_id in them)."""
    return [(p, t) for p in d.panels for t in p.targets if 'uuid=~"$gpu"' in t.expr and "$job_id" not in t.expr]


def test_choosing_a_job_narrows_every_gpu_panel_to_its_hosts(two_jobs):
    client, hosts = two_jobs
    end = time.time()
    tc = TimeContext(start=end - 30, end=end, step=1.0, scrape_interval=1.0)
    checked = 0
    for d in (spec(m) for m in build_all()):
        everything = variable_values(d, {}, client, tc)
        assert everything["host"] == "(" + "|".join(sorted(h.replace(".", "\\\\.") for h in hosts.values())) + ")"
        for job, host in hosts.items():
            values = variable_values(d, {"job_id": [job]}, client, tc)
            assert values["host"] == host.replace(".", "\\\\."), values  # the job's target alone
            gpus = variable_options(client, next(v for v in d.variables if v.name == "gpu"), values, tc)
            assert len(gpus) == 2, gpus  # its node's two cards
            for p, t in _gpu_targets(d):
                target = [x for x in p.targets if x is t]
                at_all = run_panel(client, dataclasses.replace(p, targets=target), everything, tc).results[0]
                chosen = run_panel(client, dataclasses.replace(p, targets=target), values, tc).results[0]
                assert not at_all.error and not chosen.error, (p.title, at_all.error, chosen.error)
                where = (d.uid, p.title, t.ref, job)
                if not at_all.series or "instance" not in at_all.series[0].labels:
                    continue  # an aggregate over GPUs (throttle reasons by reason): no host to count by
                # All shows every GPU of both nodes; the job shows exactly its node's
                assert {s.labels["instance"] for s in at_all.series} == set(hosts.values()), where
                mine = [s for s in at_all.series if s.labels["instance"] == host]
                assert mine and len(chosen.series) == len(mine), (*where, len(chosen.series), len(mine))
                assert {s.labels["instance"] for s in chosen.series} == {host}, where
                checked += 1
    # every GPU panel of GPU health but the throttle sum, and the GPU targets of the other two dashboards
    assert checked >= 2 * 15, checked
