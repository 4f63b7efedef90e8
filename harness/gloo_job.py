"""A real multi-rank job: N processes, one gloo process group on CPU, vramwatch in each, a scenario per rank.

    python -m harness.gloo_job --rank R --world-size N --store FILE --spool DIR --scenario NAME [--duration S]

Each step a rank waits for its batch (a loader that sleeps ``LOADER_S``, through ``vramwatch.track``: the
data wait), computes for ``COMPUTE_S`` of wall time, then all-reduces one tensor, which takes ``COMM_S`` on
every rank (a sleep: the thread blocked, as in a real gradient all-reduce; vramwatch counts it as collective
wait) and reports the step. A rank's own work per step (step time less collective wait: what
``TrainingRankStraggler`` compares) is its loader and its compute, mostly compute, so a rank whose compute
is about 1.3x the others' in own work (the wake-ups after its sleeps add to every rank's: measured at load
8 on 2 cores, the straggler's own work is 1.2x-1.3x its job's median).

The compute runs until a wall-clock deadline, yielding the CPU while others want it: the thread never
sleeps (a sleep would count as collective wait), a loaded CI host cannot stretch it, and it takes only the
CPU left over. Burning a fixed amount of CPU time instead does not keep the ratio on a loaded host: the
slow rank's extra work runs while its peers sleep in the all-reduce, with the CPU to itself (measured at
load 7 on 2 cores: 1.04x its job's median own work, not 1.3x). The scenarios (:data:`SCENARIOS`) make one
rank the culprit:

- ``steady``: every rank alike;
- ``even_slow``: every rank computes 30% more (the job slows evenly: no rank stands out);
- ``straggler``: rank ``CULPRIT`` computes 30% more (every step time stays equal: the others wait for it);
- ``block``: rank ``CULPRIT`` stops before its collective at step ``AT_STEP`` (sleeps until the end): the
  others wait inside the all-reduce, their collective count one above its;
- ``raise``: rank ``CULPRIT`` raises ``InjectedFault`` at step ``AT_STEP``. Gloo's peers see it gone at
  once and raise; NCCL's wait in the collective until the job's collective timeout. The peers here do
  as NCCL's: they hold until ``--duration`` ends, then raise the collective's error.

:func:`start_job` launches the ranks against a running :class:`~harness.exporter.Exporter` (its spool): one
launcher imports torch and forks the ranks (accelerate's ``notebook_launcher`` with ``start_method="fork"``
does the same), so the job costs one torch import;
each job's ``job_id`` is ``gloo-<scenario>`` (:func:`job_id`), so several jobs can share one server and one
Prometheus. With ``VW_GLOO_DEVICE=cuda`` (the GPU machine) every rank shares the one GPU: its all-reduce
tensor lives there (gloo copies it through the host) and vramwatch reads its real allocator, not the
simulated one. The tests in tests/distributed/ assert on what a real Prometheus scraped and on the shipped
alerts it evaluated. Every wait has a deadline: a rank exits after ``--duration`` seconds
whatever its peers do (the process group's own timeout is shorter than the test's).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from harness.procs import ROOT, child_env, die_with

SCENARIOS = ("steady", "even_slow", "straggler", "block", "raise")
CULPRIT = 2
AT_STEP = 15
LOADER_S = 0.0  # each sleep's wake-up on a loaded host is own work too: noise against the 30%
COMPUTE_S = 0.3
COMM_S = 0.5
SLOWER = 1.3


class InjectedFault(Exception):
    """What the ``raise`` scenario's culprit raises (its class name is the exit's detail)."""


def job_id(scenario: str) -> str:
    return f"gloo-{scenario}"


def compute_seconds(scenario: str, rank: int) -> float:
    if scenario == "even_slow" or (scenario == "straggler" and rank == CULPRIT):
        return COMPUTE_S * SLOWER
    return COMPUTE_S


def _compute(seconds: float, deadline: float) -> None:
    end = min(time.monotonic() + seconds, deadline)
    while time.monotonic() < end:
        os.sched_yield()  # runnable, never asleep: own work, not a wait


def _loader(deadline: float) -> Iterator[int]:
    i = 0
    while time.monotonic() < deadline:
        time.sleep(LOADER_S)
        yield i
        i += 1


def run_rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import vramwatch

    deadline = time.monotonic() + args.duration
    on_gpu = os.environ.get("VW_GLOO_DEVICE", "cpu") == "cuda"
    vramwatch.start(
        spool_dir=args.spool,
        serve="external",
        simulate=not on_gpu,
        rank=args.rank,
        local_rank=args.rank,
        world_size=args.world_size,
        job_id=job_id(args.scenario),
        interval=args.interval,
    )
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.store}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.duration + 30),
    )
    t = torch.ones(1, device="cuda:0" if on_gpu else "cpu")  # CUDA initialised after the fork, in each rank
    # the compute spins on the CPU: at the lowest priority it takes only what the rest of a busy test run leaves
    # (on Linux the nice value is the calling thread's: vramwatch's sampler and gloo's threads keep theirs)
    os.nice(19)
    work = compute_seconds(args.scenario, args.rank)
    culprit = args.rank == CULPRIT
    for step in vramwatch.track(_loader(deadline)):
        _compute(work, deadline)
        if culprit and step == AT_STEP:
            if args.scenario == "block":
                while time.monotonic() < deadline:  # stuck before its collective until the job's end
                    time.sleep(0.2)
                return 0
            if args.scenario == "raise":
                raise InjectedFault(f"rank {args.rank} fails at step {step}")
        if time.monotonic() >= deadline:
            break
        try:
            dist.all_reduce(t)
            time.sleep(COMM_S)
        except RuntimeError:  # a peer is gone: wait as NCCL's ranks do, until the collective timeout
            while time.monotonic() < deadline:
                time.sleep(0.2)
            raise
    vramwatch.stop()
    return 0


def launch(args: argparse.Namespace) -> int:
    """Import torch once, then fork one process per rank (as accelerate's notebook_launcher does with
    start_method="fork"): 4 ranks cost one import. Waits for them, at most ``duration`` + 30 s."""
    import torch.distributed  # noqa: F401 - imported before the fork: the ranks share it

    import vramwatch  # noqa: F401

    children = []
    for rank in range(args.world_size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                die_with(signal.SIGKILL)()  # never outlive the launcher (the test stops its group)
                args.rank = rank
                code = run_rank(args)
            except BaseException:  # noqa: BLE001 - what an uncaught exception of a rank's main meets
                sys.excepthook(*sys.exc_info())
            finally:
                os._exit(code)
        children.append(pid)
    deadline = time.monotonic() + args.duration + 30
    while children and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            children.remove(pid)
        else:
            time.sleep(0.2)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    return 0


def start_job(
    spool: str, tmp: Path, scenario: str, world_size: int = 4, duration: float = 60.0, interval: float = 0.5
) -> subprocess.Popen:
    """The job's launcher (its own process group, the ranks in it), started; stop it with harness.stop_group."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario {scenario!r} is not one of {', '.join(SCENARIOS)}")
    store = tmp / f"gloo-store-{scenario}"
    store.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "harness.gloo_job", "--world-size", str(world_size), "--store", str(store)]
    cmd += ["--spool", spool, "--scenario", scenario, "--duration", str(duration), "--interval", str(interval)]
    with open(tmp / f"gloo-{scenario}.log", "ab") as log:
        return subprocess.Popen(
            cmd,
            env=child_env(OMP_NUM_THREADS="1"),
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            start_new_session=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=-1, help="run this one rank; without it, launch them all")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--spool", required=True)
    p.add_argument("--scenario", choices=SCENARIOS, required=True)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=0.5)
    args = p.parse_args(argv)
    return run_rank(args) if args.rank >= 0 else launch(args)


if __name__ == "__main__":
    sys.exit(main())
