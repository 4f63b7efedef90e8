"""Two jobs on one node, one target: the same ranks of each are told apart by job_id, end to end.

Each job is a launcher with two simulated ranks (0 and 1), as two plain ``torchrun`` launches of one user
on one node are: the same default port and spool, no job id in the environment, so each rank's job_id
falls back to its launcher (``local-<hash>`` of the launcher process). One ``vramwatch serve``, one
real Prometheus scraping it.
"""

from __future__ import annotations

import signal

import pytest

from harness import start_sim_job, stop_group
from vramwatch.rank.identity import process_job_id

pytestmark = pytest.mark.e2e

GIB = 2**30


@pytest.fixture
def sim_job():
    started = []

    def make(exp, world_size, *args, **kw):
        started.append(start_sim_job(exp, world_size, *args, **kw))
        return started[-1]

    yield make
    for p in started:
        stop_group(p, signal.SIGTERM, 10.0)


def test_two_jobs_with_the_same_ranks_on_one_node_are_both_scraped(exporter, prometheus, sim_job):
    exp = exporter().start()
    a = sim_job(exp, 2, "--duration", "90", "--fill-gib", "2")
    b = sim_job(exp, 2, "--duration", "90", "--fill-gib", "5")
    sim_job(exp, 1, "--duration", "90", "--fill-gib", "1", job_env={"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0"})
    jobs = {process_job_id(a.pid): 2, process_job_id(b.pid): 5, "4711.0": 1}  # each launcher names its job
    prom = prometheus([f"127.0.0.1:{exp.port}"])

    # every rank of every job: three of rank 0, two of rank 1, none lost to another job's rank (and a
    # third job named by SLURM, its step included)
    prom.wait_for("vramwatch_ranks == 5", timeout=60)
    info = prom.wait_for("vramwatch_rank_info", check=lambda r: len(r) == 5)
    assert sorted((r["metric"]["job_id"], r["metric"]["rank"]) for r in info) == sorted(
        [(j, str(r)) for j in jobs for r in range(2 if j.startswith("local-") else 1)]
    )
    per_rank = {r["metric"]["rank"]: float(r["value"][1]) for r in prom.query("count by (rank) (vramwatch_rank_info)")}
    assert per_rank == {"0": 3.0, "1": 2.0}

    # each job's memory is its own: the series of one job never carry the other's values
    alloc = prom.wait_for("torch_cuda_memory_allocated_bytes", check=lambda r: len(r) == 5)
    for r in alloc:
        fill = jobs[r["metric"]["job_id"]]
        assert fill * GIB <= float(r["value"][1]) < (fill + 1.5) * GIB, r
    # and each job's heartbeat goes on, counted per job (its two ranks)
    steps = prom.wait_for(
        "count by (job_id) (rate(vramwatch_training_steps_total[5s]) > 0)", timeout=30, check=lambda r: len(r) == 3
    )
    assert {r["metric"]["job_id"]: float(r["value"][1]) for r in steps} == {
        j: (2.0 if j.startswith("local-") else 1.0) for j in jobs
    }
    # the rank's own collector health carries its job; the server's own have none
    up = prom.query('vramwatch_collector_up{collector="allocator"}')
    assert {(r["metric"]["job_id"], r["metric"]["rank"]) for r in up} == {
        (r["metric"]["job_id"], r["metric"]["rank"]) for r in info
    }
    assert all("job_id" not in r["metric"] for r in prom.query('vramwatch_collector_up{collector="spool"}'))
