"""Rank identity from the launcher's environment (torchrun, accelerate, DeepSpeed, SLURM, MPI).

Besides the rank numbers, the job the rank belongs to (``job_id``): two jobs on one node share one
spool and one target, and the same rank numbers, so without it the second job's rank 0 would be taken
for the first one's. The first of these that is present names the job:

1. the ``job_id`` setting (``VRAMWATCH_JOB_ID``; on Kubernetes the Job's name through the downward
   API, see the README, Job identity);
2. ``SLURM_JOB_ID``, with ``.`` and ``SLURM_STEP_ID`` when set (two steps of one allocation are two jobs);
3. ``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``), unless it is torchrun's default ``none``;
4. ``PMIX_NAMESPACE`` (Open MPI's and PRRTE's ``mpirun``);
5. for a job of several ranks, its master's address and port (``MASTER_ADDR`` + ``MASTER_PORT``, set
   by torchrun, accelerate and DeepSpeed): the same on every node of the job, so its ranks still
   compare across nodes, and two concurrent jobs cannot share one (their stores would be one);
6. for a job of several ranks (or any torchrun worker) without one, its launcher (the ranks' common
   parent: torchrun's agent, which also keeps it across the worker restarts it makes);
7. a lone process: the process itself. Its parent (a shell) may run others.

6 and 7 name a process as ``local-<12 hex digits>``: a hash of the boot, the pid and the process's start
time, so two processes alive at once never share one (nor a pid reused later), and no pid becomes a
label (docs/security.md: pids are never exported; the console's start line says which process it is).
A lone process restarted is a new job: its predecessor's final sample stays served, under the old id,
for ``dead_rank_grace_seconds`` (the OOM that ended it still reaches Prometheus). 5-7 tell jobs apart on
one node only; a job across nodes without 2-4 sets ``job_id``.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from vramwatch.spool.schema import JOB_ID, JOB_ID_MAX

# First variable present wins; torchrun/accelerate/DeepSpeed all set the torch names.
_RANK = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_LOCAL_RANK = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_WORLD_SIZE = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")

_HASH = 8  # hex digits of the hash a mapped value ends with
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
# torchrun's --rdzv-id when none is given (torch/distributed/run.py, PyTorch 2.13): every such job would
# share it. --standalone, and a one-node run without --master-port, draw a UUID instead.
_TORCHELASTIC_DEFAULT = "none"


@dataclass(frozen=True)
class RankIdentity:
    rank: int
    local_rank: int
    world_size: int
    job_id: str = ""


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is not None:
            try:
                return int(raw)
            except ValueError:
                continue
    return None


def bounded_job_id(raw: str) -> str:
    """``raw`` as a job id: itself when it fits (:data:`~vramwatch.spool.schema.JOB_ID`), else mapped
    deterministically: other characters replaced by ``_``, cut to fit, and a hash of the whole value
    appended, so two different values stay apart (two long ids sharing their first 55 characters,
    ``a@b`` and ``a#b``)."""
    if JOB_ID.fullmatch(raw):
        return raw
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH]
    return _UNSAFE.sub("_", raw)[: JOB_ID_MAX - _HASH - 1] + "-" + digest


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); "" when it is gone."""
    # the command name before it, in parentheses, may hold anything
    return "".join(_read(f"/proc/{pid}/stat").rpartition(")")[2].split()[19:20])


def process_job_id(pid: int) -> str:
    """``local-<hash>`` of a live process: the boot, its pid and its start time (Linux's /proc; the pid
    alone where there is none), the same for every rank that asks about it."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    digest = hashlib.sha256(f"{boot}:{pid}:{process_start(pid)}".encode()).hexdigest()[:12]
    return f"local-{digest}"


def job_id_from_env(world_size: int, env: Mapping[str, str], pid: int, ppid: int) -> str:
    """The job id the launcher's environment gives (the module's order 2-7), bounded."""
    slurm = env.get("SLURM_JOB_ID", "")
    if slurm:
        step = env.get("SLURM_STEP_ID", "")
        return bounded_job_id(f"{slurm}.{step}" if step else slurm)
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if run and run != _TORCHELASTIC_DEFAULT:
        return bounded_job_id(run)
    pmix = env.get("PMIX_NAMESPACE", "")
    if pmix:
        return bounded_job_id(pmix)
    if world_size > 1 or "TORCHELASTIC_RUN_ID" in env:  # launched: the ranks' parent is the launcher
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        if addr and port:
            return bounded_job_id(f"master-{addr}-{port}")
        return process_job_id(ppid)
    return process_job_id(pid)


def identify(
    rank: int = -1,
    local_rank: int = -1,
    world_size: int = -1,
    env: Mapping[str, str] | None = None,
    job_id: str = "",
) -> RankIdentity:
    """Explicit values (>= 0, a non-empty ``job_id``) win over the environment; a lone process is rank 0 of 1."""
    env = os.environ if env is None else env
    r = rank if rank >= 0 else _first_int(env, _RANK)
    lr = local_rank if local_rank >= 0 else _first_int(env, _LOCAL_RANK)
    ws = world_size if world_size >= 0 else _first_int(env, _WORLD_SIZE)
    r = 0 if r is None or r < 0 else r
    lr = r if lr is None or lr < 0 else lr
    ws = max(ws or 1, r + 1)
    job = bounded_job_id(job_id) if job_id else job_id_from_env(ws, env, os.getpid(), os.getppid())
    return RankIdentity(r, lr, ws, job)
