"""Which job a rank belongs to: the resolution order, and the bound on what becomes its label."""

from __future__ import annotations

import os

import pytest

from vramwatch import ConfigError, config
from vramwatch.rank import identity
from vramwatch.rank.identity import bounded_job_id, identify, job_id_from_env, process_job_id
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
    assert _job(env) == process_job_id(200)  # the launcher: the ranks' common parent
    assert _job({}, world_size=1) == process_job_id(300)  # a lone process: itself (its shell may run others)
    assert _job({"TORCHELASTIC_RUN_ID": "none"}, world_size=1) == process_job_id(200)  # a torchrun worker: its agent


def test_identify_reads_the_environment_and_this_process():
    ident = identify(env=TORCHRUN)
    assert (ident.rank, ident.local_rank, ident.world_size, ident.job_id) == (1, 1, 4, "master-10.0.0.7-29500")
    assert identify(env={}).job_id == process_job_id(os.getpid())
    assert identify(env={"WORLD_SIZE": "2"}).job_id == process_job_id(os.getppid())
    assert process_job_id(os.getpid()) != process_job_id(os.getppid())


def test_a_process_is_named_without_its_pid_and_a_reused_pid_is_another_job(monkeypatch):
    own = process_job_id(os.getpid())
    assert JOB_ID.fullmatch(own) and own.startswith("local-") and len(own) == len("local-") + 12
    assert process_job_id(os.getpid()) == own  # every rank asking about its launcher gets the same
    stat = "4242 (python3 (x) y) S 1 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 {start} 1 1"
    for start, other in ((100, 200), (100, 100)):
        ids = []
        for s in (start, other):
            monkeypatch.setattr(identity, "_read", lambda path, s=s: stat.format(start=s) if "stat" in path else "b")
            ids.append(process_job_id(4242))
        assert (ids[0] == ids[1]) == (start == other)  # the start time tells a reused pid apart


def test_two_concurrent_jobs_on_one_node_never_share_an_id():
    # the same ranks, both without any launcher id: told apart by their launchers (or masters)
    a = _job({"RANK": "0", "WORLD_SIZE": "2"}, ppid=os.getpid())
    b = _job({"RANK": "0", "WORLD_SIZE": "2"}, ppid=os.getppid())
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
