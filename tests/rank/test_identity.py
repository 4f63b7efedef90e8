"""Which job a rank belongs to: the resolution order, and the bound on what becomes its label."""

from __future__ import annotations

import os

import pytest

from vramwatch import ConfigError, config
from vramwatch.rank.identity import bounded_job_id, identify, job_id_from_env
from vramwatch.spool.schema import JOB_ID, JOB_ID_MAX

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}


def _job(env: dict[str, str], world_size: int = 4, pid: int = 300, ppid: int = 200) -> str:
    return job_id_from_env(world_size, env, pid, ppid)


def test_each_source_wins_over_the_ones_after_it():
    env = {
        **TORCHRUN,
        "SLURM_JOB_ID": "4711",
        "SLURM_STEP_ID": "0",
        "TORCHELASTIC_RUN_ID": "run-9",
        "PMIX_NAMESPACE": "prterun-n1-99@1",
    }
    assert identify(env=env, job_id="mine").job_id == "mine"  # the setting first
    assert _job(env) == "4711.0"  # a SLURM step: two steps of one allocation are two jobs
    del env["SLURM_STEP_ID"]
    assert _job(env) == "4711"
    del env["SLURM_JOB_ID"]
    assert _job(env) == "run-9"
    env["TORCHELASTIC_RUN_ID"] = "none"  # torchrun's default: every job without --rdzv-id has it
    assert _job(env) == bounded_job_id("prterun-n1-99@1")
    del env["PMIX_NAMESPACE"]
    assert _job(env) == "master-10.0.0.7-29500"  # the same on every node of the job
    del env["MASTER_PORT"]
    assert _job(env) == "pid-200"  # the launcher: the ranks' common parent
    assert _job({}, world_size=1) == "pid-300"  # a lone process: its own pid (its shell may run others)
    assert _job({"TORCHELASTIC_RUN_ID": "none"}, world_size=1) == "pid-200"  # a torchrun worker: its agent


def test_identify_reads_the_environment_and_this_process():
    ident = identify(env=TORCHRUN)
    assert (ident.rank, ident.local_rank, ident.world_size, ident.job_id) == (1, 1, 4, "master-10.0.0.7-29500")
    assert identify(env={}).job_id == f"pid-{os.getpid()}"
    assert identify(env={"WORLD_SIZE": "2"}).job_id == f"pid-{os.getppid()}"


def test_two_concurrent_jobs_on_one_node_never_share_an_id():
    # the same ranks, both without any launcher id: told apart by their launchers (or masters)
    a = _job({"RANK": "0", "WORLD_SIZE": "2"}, ppid=200)
    b = _job({"RANK": "0", "WORLD_SIZE": "2"}, ppid=201)
    lone_a, lone_b = _job({}, world_size=1, pid=300), _job({}, world_size=1, pid=301)
    assert len({a, b, lone_a, lone_b}) == 4
    assert _job({**TORCHRUN, "MASTER_PORT": "29501"}) != _job(TORCHRUN)


@pytest.mark.parametrize(
    "raw",
    ["4711.0", "d9b0c3f2-7a1e-4c55-9f0b-2f3e1c9a8b7d", "my-job", "a" * JOB_ID_MAX, "j_1.2-3"],
)
def test_a_value_that_fits_is_kept_as_it_is(raw):
    assert bounded_job_id(raw) == raw


@pytest.mark.parametrize(
    "raw",
    [
        "prterun-n1-99@1",
        "a" * (JOB_ID_MAX + 1),
        "x" * 10_000,
        "../../etc/passwd",
        "job/1",
        'job"}\nfake_metric 1',
        "naïve",
        "\udcff",  # a byte the environment could not decode (os.environ keeps it as a surrogate)
        " ",
    ],
)
def test_any_other_value_is_mapped_into_the_bound_deterministically(raw):
    out = bounded_job_id(raw)
    assert JOB_ID.fullmatch(out) and len(out) <= JOB_ID_MAX
    assert "/" not in out and out == bounded_job_id(raw)  # safe in a file name; the same every time


def test_values_that_map_to_one_prefix_stay_apart():
    assert bounded_job_id("a@b") != bounded_job_id("a#b")
    long = "j" * 80
    assert bounded_job_id(long + "1") != bounded_job_id(long + "2")


def test_the_setting_is_validated_where_it_comes_from():
    assert config.load({"job_id": "train-42"}, env={})[0].job_id == "train-42"
    assert config.load({}, env={"VRAMWATCH_JOB_ID": "4711.0"})[0].job_id == "4711.0"
    for bad in ("a b", "x" * (JOB_ID_MAX + 1), "job/1"):
        with pytest.raises(ConfigError, match="job_id"):
            config.load({"job_id": bad}, env={})
    with pytest.raises(ConfigError, match="VRAMWATCH_JOB_ID"):
        config.load({}, env={"VRAMWATCH_JOB_ID": "a@b"})
