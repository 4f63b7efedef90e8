"""Which rank: four real gloo ranks (harness.gloo_job), one vramwatch serve, a real Prometheus scraping it.

- a rank that stops before its collective has the lowest ``vramwatch_collectives_total`` of its job while
  the others wait inside theirs (and its peers' counts are one above it);
- a rank whose own compute is 30% slower: the step times of all ranks stay equal, its collective wait
  stands out (it waits least);
- a job that slows evenly: no rank's collective wait stands out;
- a rank that raises: ``vramwatch_rank_exits_total{reason="exception", detail="InjectedFault"}`` for it.

The queries that name the culprit (:data:`LOWEST`, :data:`STRAGGLER`) are the ones an alert can use; the
shipped alerts can be asserted on the same scenarios later (harness.gloo_job starts them).
"""

from __future__ import annotations

import signal
import time

import pytest

from harness import WaitTimeout, stop_group, wait_until
from harness.gloo_job import AT_STEP, CULPRIT, JOB_ID, start_job

pytestmark = pytest.mark.e2e

WORLD = 4
# the ranks whose collective count is the lowest of their job
LOWEST = "vramwatch_collectives_total == on (job_id) group_left min by (job_id) (vramwatch_collectives_total)"
# each rank's share of wall time spent waiting for its peers, and the job's median of it
WAIT = 'rate(vramwatch_training_wait_seconds_total{kind="collective"}[30s])'
# a straggler waits less than 0.6 of the job's median, where the median is a real part of the time (5%)
STRAGGLER = (
    f"({WAIT}) < on (job_id) group_left 0.6 * quantile by (job_id) (0.5, {WAIT}) "
    f"and on (job_id) (quantile by (job_id) (0.5, {WAIT}) > 0.05)"
)


@pytest.fixture
def job(tmp_path, exporter, prometheus):
    procs: list = []
    exp = exporter().start()
    prom = prometheus([f"127.0.0.1:{exp.port}"])

    def start(scenario: str, duration: float = 240.0):
        procs.append(start_job(exp.spool, tmp_path, scenario, WORLD, duration))
        return exp, prom

    yield start
    for p in procs:
        stop_group(p, signal.SIGTERM, 5.0)


def _by_rank(result: list) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in result}


def _ranks_alive(prom, n: int = WORLD) -> None:
    # a loaded CI host takes a while to import torch: the ranks' deadline is minutes, each wait bounded
    prom.wait_for(f'count(vramwatch_collectives_total{{job_id="{JOB_ID}"}}) == {n}', timeout=180)


def test_the_rank_that_stops_before_its_collective_is_the_lowest(job):
    exp, prom = job("block")
    _ranks_alive(prom)
    # the others reach the collective the culprit never issues (each at its own pace on a loaded host)
    lowest = prom.wait_for(
        f"({LOWEST}) and on (job_id) (max by (job_id) (vramwatch_collectives_total) > {AT_STEP})",
        timeout=120,
        check=lambda r: [x["metric"]["rank"] for x in r] == [str(CULPRIT)],
    )
    assert [r["metric"]["rank"] for r in lowest] == [str(CULPRIT)]
    # the others stopped one collective ahead, waiting inside it: their count no longer moves either
    counts = _by_rank(prom.query("vramwatch_collectives_total"))
    others = {r: c for r, c in counts.items() if r != str(CULPRIT)}
    assert set(others.values()) == {counts[str(CULPRIT)] + 1}, counts
    # the sampler goes on reading while the training thread is blocked inside the collective
    wait_until(
        lambda: all(v > 0 for v in exp.values("vramwatch_sample_age_seconds")) and _fresh(exp), 10, "fresh samples"
    )


def _fresh(exp) -> bool:
    return all(v < 2.0 for v in exp.values("vramwatch_sample_age_seconds"))


def test_a_rank_with_slower_compute_waits_least_while_step_times_stay_equal(job):
    exp, prom = job("straggler")
    _ranks_alive(prom)
    try:  # the 30 s rate window fills after the ranks' staggered start; a loaded host is noisy: minutes
        flagged = prom.wait_for(
            STRAGGLER, timeout=180, check=lambda r: [x["metric"]["rank"] for x in r] == [str(CULPRIT)]
        )
    except WaitTimeout:
        raise AssertionError(f"collective wait rates by rank: {_by_rank(prom.query(WAIT))}") from None
    assert [r["metric"]["rank"] for r in flagged] == [str(CULPRIT)]
    # the step times are equal: the ranks' step counts are at most one apart, their mean step times within 5%
    steps = _by_rank(prom.query("vramwatch_training_steps_total"))
    assert len(steps) == WORLD and max(steps.values()) - min(steps.values()) <= 1, steps
    mean = _by_rank(
        prom.query("vramwatch_training_step_duration_seconds_sum / vramwatch_training_step_duration_seconds_count")
    )
    assert max(mean.values()) <= 1.05 * min(mean.values()), mean


def test_a_job_that_slows_evenly_blames_no_rank(job):
    exp, prom = job("even_slow")
    _ranks_alive(prom)
    prom.wait_for(f"count({WAIT}) == {WORLD}", timeout=60)
    time.sleep(35)  # the rate's window past the start, when the ranks joined one by one
    for _ in range(10):  # ten evaluations over ten seconds of a steady job
        assert prom.query(STRAGGLER) == []
        assert len(prom.query(WAIT)) == WORLD
        time.sleep(1.0)


def test_a_rank_that_raises_says_so_with_its_class(job):
    exp, prom = job("raise")
    exits = prom.wait_for('vramwatch_rank_exits_total{reason="exception"}', timeout=90)
    culprit = [r["metric"] for r in exits if r["metric"]["rank"] == str(CULPRIT)]
    assert culprit and culprit[0]["detail"] == "InjectedFault", exits
