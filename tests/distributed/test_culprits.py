"""Which rank: four real gloo jobs of four ranks each (harness.gloo_job), one vramwatch serve, a real Prometheus
scraping it and evaluating the shipped rules.

The rules are the shipped ones on a 60x faster clock (``MonitoringConfig.scaled``, as
tests/system/test_e2e_alerting.py: a 15m ``for`` becomes 15 s), their expressions unchanged. The four
scenarios run at once, each its own job (``job_id`` ``gloo-<scenario>``: never peers of each other), so the
module waits for the slowest of them, not for their sum; each test asserts the series and the alerts of its
own job, in the order their alerts fire (a dead rank's exit is served for 90 s, so its alert is asserted first):

- a rank that raises: ``vramwatch_rank_exits_total{reason="exception", detail="InjectedFault"}`` for it, and
  ``TrainingRankExited`` names it while its peers wait in their collective;
- a rank that stops before its collective has the lowest ``vramwatch_collectives_total`` of its job while
  the others wait inside theirs (their counts one above it), and the job's stall alert (on CPU the per-rank
  idle-stall warning: no GPU, no busy-stall page) names it as the rank the others wait for;
- a rank whose own compute is 30% slower: the step times of all ranks stay equal, its collective wait
  stands out (it waits least), and ``TrainingRankStraggler`` fires for it alone;
- a job that slows evenly: no rank's collective wait stands out, and no ``TrainingRankStraggler`` fires for
  it, while the straggler job's does (the same window: the jobs started together).
"""

from __future__ import annotations

import dataclasses
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness import Exporter, Prometheus, WaitTimeout, stop_group, wait_until
from harness.gloo_job import AT_STEP, COMPUTE_S, CULPRIT, SLOWER, job_id, start_job
from vramwatch.monitoring.alerts.render import rule_file, to_yaml
from vramwatch.monitoring.config import DEFAULT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORLD = 4
SCENARIOS = ("raise", "block", "straggler", "even_slow")
# the shipped rules, 60x faster; the stall floor and the straggler's window kept above a loaded CI host's
# scheduling noise (a 10 s window holds ten steps: at load 10 on 2 cores the straggler's own work read
# 1.09x-1.3x its job's median from one evaluation to the next)
CFG = dataclasses.replace(
    DEFAULT.scaled(1 / 60), selector='job="vramwatch"', stall_min_seconds=4.0, straggler_window="30s"
)
# a loaded CI host takes a while to import torch (four launchers at once); each wait bounded (measured:
# the module takes about 70 s on a 2-core host at load 6)
START_S = 180.0
# straggler_for 15 s past the ranks' staggered start, on a noisy host
STRAGGLER_S = 120.0
# the ranks' own deadline: past every wait of the module (teardown stops them sooner)
DURATION_S = START_S + STRAGGLER_S + 60


def lowest(job: str) -> str:
    """The ranks whose collective count is the lowest of their job."""
    c = f'vramwatch_collectives_total{{job_id="{job}"}}'
    return f"{c} == on (job_id) group_left min by (job_id) ({c})"


def wait_per_step(job: str) -> str:
    """Each rank's wait for its peers per step (the all-reduce's own COMM_S included, alike on every rank)."""
    sel = f'job_id="{job}"'
    return (
        f'sum without(kind) (rate(vramwatch_training_wait_seconds_total{{kind="collective", {sel}}}[30s]))'
        f" / rate(vramwatch_training_step_duration_seconds_count{{{sel}}}[30s])"
    )


# a rank stands out when it waits less than each of the others by half what the straggler's extra compute
# is per step (the others wait that long for it, the straggler does not)
STANDS_OUT_S = 0.5 * COMPUTE_S * (SLOWER - 1)
OWN_SKEW = "vramwatch:training_own_seconds_per_step:skew_ratio"


@dataclasses.dataclass
class Stack:
    exp: Exporter
    prom: Prometheus


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gloo")
    rules = tmp / "vramwatch.rules.yml"
    rules.write_text(to_yaml(rule_file(CFG)))
    exp = Exporter(tmp).start()
    procs: list = []
    prom = None
    try:
        prom = Prometheus(tmp, [f"127.0.0.1:{exp.port}"], rule_files=[str(rules)]).start()
        for scenario in SCENARIOS:
            procs.append(start_job(exp.spool, tmp, scenario, WORLD, DURATION_S))
        yield Stack(exp, prom)
    finally:
        for p in procs:
            stop_group(p, signal.SIGTERM, 5.0)
        if prom is not None:
            prom.stop()
        exp.stop()


def _by_rank(result: list) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in result}


def _ranks(alerts: list[dict[str, Any]]) -> list[str]:
    return sorted(a["labels"]["rank"] for a in alerts)


def _ranks_alive(prom: Prometheus, job: str) -> None:
    prom.wait_for(f'count(vramwatch_collectives_total{{job_id="{job}"}}) == {WORLD}', timeout=START_S)


def _fresh(exp: Exporter) -> bool:
    return all(0 < v < 2.0 for v in exp.values("vramwatch_sample_age_seconds"))


def test_a_rank_that_raises_says_so_with_its_class_and_the_exit_alert_names_it(stack):
    job, prom = job_id("raise"), stack.prom
    exits = prom.wait_for(f'vramwatch_rank_exits_total{{job_id="{job}", reason="exception"}}', timeout=START_S)
    assert [(r["metric"]["rank"], r["metric"]["detail"]) for r in exits] == [(str(CULPRIT), "InjectedFault")], exits
    # its peers wait in their collective (as NCCL's would until the timeout): the job still runs, so it pages
    fired = wait_until(lambda: prom.alerts("TrainingRankExited", job_id=job), 30, "TrainingRankExited firing")
    assert [(a["labels"]["rank"], a["labels"]["reason"], a["labels"]["detail"]) for a in fired] == [
        (str(CULPRIT), "exception", "InjectedFault")
    ], fired
    assert f"rank {CULPRIT} " in fired[0]["annotations"]["description"]
    assert "ended: exception (InjectedFault)" in fired[0]["annotations"]["description"]


def test_the_rank_that_stops_before_its_collective_is_the_lowest_and_the_stall_alert_names_it(stack):
    job, prom = job_id("block"), stack.prom
    _ranks_alive(prom, job)
    # the others reach the collective the culprit never issues (each at its own pace on a loaded host)
    ahead = f'max by (job_id) (vramwatch_collectives_total{{job_id="{job}"}}) > {AT_STEP}'
    found = prom.wait_for(
        f"({lowest(job)}) and on (job_id) ({ahead})",
        timeout=120,
        check=lambda r: [x["metric"]["rank"] for x in r] == [str(CULPRIT)],
    )
    assert [r["metric"]["rank"] for r in found] == [str(CULPRIT)]
    # the others stopped one collective ahead, waiting inside it: their count no longer moves either
    counts = _by_rank(prom.query(f'vramwatch_collectives_total{{job_id="{job}"}}'))
    others = {r: c for r, c in counts.items() if r != str(CULPRIT)}
    assert set(others.values()) == {counts[str(CULPRIT)] + 1}, counts
    # the sampler goes on reading while the training thread is blocked inside the collective
    wait_until(lambda: _fresh(stack.exp), 10, "fresh samples")

    # every rank stalls (no GPU: the idle-stall warning, per rank), each naming the culprit; the floor (4 s)
    # and the `for` (2 s) past the last step, a few seconds more for the ranks' staggered stops
    stalled = wait_until(
        lambda: (a := prom.alerts("TrainingStalled", job_id=job)) and len(a) == WORLD and a,
        60,
        "TrainingStalled firing for every rank of the blocked job",
    )
    assert {a["labels"]["severity"] for a in stalled} == {"warning"}, stalled
    assert prom.alerts("TrainingStalled", job_id=job, severity="critical", state="") == []
    for a in stalled:
        named = re.findall(r"rank (\d+) on \S+ \(collective \d+\)", a["annotations"]["description"])
        assert named == [str(CULPRIT)], a["annotations"]["description"]


def test_a_rank_with_slower_compute_is_the_straggler_while_step_times_stay_equal(stack):
    job, prom = job_id("straggler"), stack.prom
    _ranks_alive(prom, job)

    def culprit_waits_least(r: list) -> bool:
        w = _by_rank(r)
        return len(w) == WORLD and all(v - w[str(CULPRIT)] > STANDS_OUT_S for k, v in w.items() if k != str(CULPRIT))

    try:  # the 30 s rate window fills after the ranks' staggered start; a loaded host is noisy: minutes
        prom.wait_for(wait_per_step(job), timeout=STRAGGLER_S, check=culprit_waits_least)
    except WaitTimeout:
        raise AssertionError(f"collective wait per step by rank: {_by_rank(prom.query(wait_per_step(job)))}") from None
    # the step times are equal: the ranks' step counts are at most one apart, their mean step times within 5%
    sel = f'{{job_id="{job}"}}'
    steps = _by_rank(prom.query(f"vramwatch_training_steps_total{sel}"))
    assert len(steps) == WORLD and max(steps.values()) - min(steps.values()) <= 1, steps
    mean = _by_rank(
        prom.query(
            f"vramwatch_training_step_duration_seconds_sum{sel} / vramwatch_training_step_duration_seconds_count{sel}"
        )
    )
    assert max(mean.values()) <= 1.05 * min(mean.values()), mean

    # the shipped alert names the slow rank, and it alone
    fired = _straggler_fired(prom)
    assert _ranks(fired) == [str(CULPRIT)], fired
    assert prom.alerts("TrainingRankStraggler", job_id=job, state="") == fired
    assert "the others wait for it" in fired[0]["annotations"]["description"]


def _straggler_fired(prom: Prometheus) -> list[dict[str, Any]]:
    """TrainingRankStraggler firing for the straggler job (straggler_window + straggler_for after its start)."""
    job = job_id("straggler")
    try:
        return wait_until(
            lambda: prom.alerts("TrainingRankStraggler", job_id=job), STRAGGLER_S, "TrainingRankStraggler firing"
        )
    except WaitTimeout:
        skew = prom.query(f'{OWN_SKEW}{{job_id="{job}"}}')
        raise AssertionError(f"own work per step over the job's median, by rank: {_by_rank(skew)}") from None


def test_a_job_that_slows_evenly_blames_no_rank(stack):
    job, prom = job_id("even_slow"), stack.prom
    _ranks_alive(prom, job)
    prom.wait_for(f"count({wait_per_step(job)}) == {WORLD}", timeout=60)
    # the straggler job, started with this one, has had its straggler named: the same window has passed here
    _straggler_fired(prom)
    for _ in range(10):  # ten evaluations over ten seconds of a steady job
        waits = _by_rank(prom.query(wait_per_step(job)))
        assert len(waits) == WORLD and max(waits.values()) - min(waits.values()) < STANDS_OUT_S, waits
        assert len(prom.query(f'{OWN_SKEW}{{job_id="{job}"}}')) == WORLD
        assert prom.alerts("TrainingRankStraggler", job_id=job) == []
        time.sleep(1.0)
