"""Identity's edges: explicit zeros, unreadable launcher variables, job ids mapped to fit, the process hash."""

from __future__ import annotations

import hashlib
import os

from vramwatch.rank import identity as identity_mod
from vramwatch.rank.identity import bounded_job_id, identify, job_id_from_env, process_job_id
from vramwatch.spool.schema import JOB_ID, JOB_ID_MAX


def test_an_unreadable_rank_variable_falls_through_to_the_next_launcher():
    ident = identify(env={"RANK": "x", "SLURM_PROCID": "3", "WORLD_SIZE": "8"}, job_id="j")
    assert ident.rank == 3


def test_explicit_zeros_win_over_the_environment():
    env = {"RANK": "5", "LOCAL_RANK": "3", "WORLD_SIZE": "8"}
    ident = identify(rank=0, local_rank=0, env=env, job_id="j")
    assert (ident.rank, ident.local_rank, ident.world_size) == (0, 0, 8)
    # an explicit world size of 0 is "no world size given by the caller": at least rank + 1, not the env's
    assert identify(rank=2, world_size=0, env=env, job_id="j").world_size == 3


def test_local_rank_comes_from_the_environment_when_not_given():
    ident = identify(env={"RANK": "5", "LOCAL_RANK": "2", "WORLD_SIZE": "8"}, job_id="j")
    assert (ident.rank, ident.local_rank) == (5, 2)


def test_rank_one_and_local_rank_zero_are_kept():
    ident = identify(env={"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, job_id="j")
    assert (ident.rank, ident.local_rank) == (1, 0)
    ident = identify(env={"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}, job_id="j")
    assert (ident.rank, ident.local_rank) == (3, 0)


def test_world_size_is_at_least_rank_plus_one():
    assert identify(env={"RANK": "5"}, job_id="j").world_size == 6


def test_an_unsafe_job_id_is_mapped_with_underscores_and_a_hash():
    digest = hashlib.sha256(b"a@b").hexdigest()[:8]
    assert bounded_job_id("a@b") == f"a_b-{digest}"


def test_a_long_job_id_is_cut_to_exactly_the_maximum():
    mapped = bounded_job_id("x" * (JOB_ID_MAX + 20))
    assert len(mapped) == JOB_ID_MAX and JOB_ID.fullmatch(mapped)
    assert mapped.startswith("x" * (JOB_ID_MAX - 9) + "-")


def test_a_master_port_without_an_address_names_the_launcher_not_a_master():
    env = {"WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    assert job_id_from_env(2, env, pid=os.getpid(), ppid=os.getppid()) == process_job_id(os.getppid())


def test_read_replaces_what_is_not_ascii_and_reads_nothing_from_a_missing_file(tmp_path):
    p = tmp_path / "stat"
    p.write_bytes("1 (tr\u00e9n) S\n".encode())
    assert identity_mod._read(str(p)) == "1 (tr\ufffd\ufffdn) S"
    assert identity_mod._read(str(tmp_path / "missing")) == ""


def test_the_process_hash_keeps_over_the_processs_life():
    before = process_job_id(os.getpid())
    grown = bytearray(32 << 20)  # the process's size (the field after its start time) changes; the id must not
    grown[-1] = 1
    assert process_job_id(os.getpid()) == before
    del grown


def test_the_process_hash_takes_the_boot(monkeypatch):
    real = identity_mod._read
    boot = ["boot-a"]
    monkeypatch.setattr(identity_mod, "_read", lambda path: boot[0] if path.endswith("boot_id") else real(path))
    a = process_job_id(os.getpid())
    boot[0] = "boot-b"
    assert process_job_id(os.getpid()) != a
