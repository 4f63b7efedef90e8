"""`vramwatch serve` and simulated training ranks, as separate processes publishing through one spool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from harness.net import free_port, http_get, wait_until
from harness.procs import stop_proc, vramwatch_env


def parse_metrics(text: str, openmetrics: bool = False) -> dict[str, list[tuple[dict[str, str], float]]]:
    """An exposition as {sample name: [(labels, value), ...]} (prometheus_client's parser)."""
    if openmetrics:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


class Exporter:
    """``vramwatch serve`` in its own process, on the simulated GPU unless told otherwise."""

    def __init__(self, tmp: Path, simulate: bool = True, gpus: int = 1, **settings: Any) -> None:
        self.spool = str(tmp / "spool")
        os.makedirs(self.spool, exist_ok=True)
        self.port = free_port()
        self.settings = dict(simulate=simulate, **settings)
        if simulate:
            from vramwatch.sim.state import SimNode, state_path

            if not os.path.exists(state_path(self.spool)):
                SimNode.default(gpus).save(state_path(self.spool))
        self.env = vramwatch_env(self.spool, self.port, **self.settings)
        self.log: IO[bytes] = open(tmp / f"server-{self.port}.log", "ab")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> Exporter:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vramwatch", "serve"],
            env=self.env,
            stdout=self.log,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
        )
        proc = self.proc
        wait_until(
            lambda: proc.poll() is None and http_get(self.url + "/-/healthy", 1)[0] == 200,
            timeout,
            "the exporter to answer",
        )
        return self

    def scrape(self) -> str:
        code, body = http_get(self.url + "/metrics")
        assert code == 200, body
        return body.decode()

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        return parse_metrics(self.scrape())

    def values(self, name: str, **labels: object) -> list[float]:
        """Values of ``name`` whose labels include ``labels`` (compared as text), from one scrape."""
        want = {k: str(v) for k, v in labels.items()}
        return [v for lab, v in self.metrics().get(name, []) if all(lab.get(k) == x for k, x in want.items())]

    def wait_steps(self, n: int, timeout: float = 15.0) -> None:
        """Until rank 0's scrape counts ``n`` optimiser steps (WaitTimeout otherwise)."""
        wait_until(
            lambda: self.values("vramwatch_training_steps_total", rank=0, local_rank=0) == [float(n)],
            timeout,
            f"{n} optimiser steps in the scrape",
        )

    def node(self) -> Any:
        from vramwatch.sim.state import SimNode, state_path

        return SimNode.load(state_path(self.spool))

    def save_node(self, node: Any) -> None:
        from vramwatch.sim.state import state_path

        node.save(state_path(self.spool))

    def stop(self) -> None:
        if self.proc is not None:
            stop_proc(self.proc, sig=signal.SIGTERM)
        self.log.close()


def start_sim_rank(
    exporter: Exporter,
    rank: int,
    *args: str,
    world_size: int = 1,
    local_rank: int | None = None,
    cuda_visible: str | None = None,
    **settings: Any,
) -> subprocess.Popen:
    """A simulated training rank publishing into ``exporter``'s spool (it never starts a server).

    It samples every 0.2 s unless ``interval`` says otherwise (None: vramwatch's default)."""
    settings = {"simulate": True, "serve": "external", "interval": 0.2, **settings}
    env = vramwatch_env(exporter.spool, exporter.port, **settings)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "WORLD_SIZE": str(world_size),
        }
    )
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    return subprocess.Popen(
        [sys.executable, "-m", "vramwatch.sim.worker", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=exporter.log,
        stderr=exporter.log,
    )


# what names a job (vramwatch.rank.identity): a job of start_sim_job has only the ones it is given
JOB_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE", "MASTER_ADDR", "MASTER_PORT")

# a launcher as torchrun is one: it starts the ranks as its children and waits for them; SIGTERM stops them
_LAUNCHER = r"""
import os, signal, subprocess, sys
world_size, args = int(sys.argv[1]), sys.argv[2:]
procs = []
def stop(*_):
    for p in procs:
        p.terminate()
signal.signal(signal.SIGTERM, stop)
for r in range(world_size):
    env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size))
    procs.append(subprocess.Popen([sys.executable, "-m", "vramwatch.sim.worker", *args], env=env,
                                  stdin=subprocess.DEVNULL))
sys.exit(max(p.wait() for p in procs))
"""


def start_sim_job(
    exporter: Exporter, world_size: int, *args: str, job_env: dict[str, str] | None = None, **settings: Any
) -> subprocess.Popen:
    """A simulated job of ``world_size`` ranks (0..n-1) under a launcher process of its own, publishing into
    ``exporter``'s spool; stop it with :func:`harness.stop_group` (it leads its own process group).

    The job's identity comes from ``job_env`` (e.g. ``SLURM_JOB_ID``) and ``settings`` (``job_id``) alone:
    the :data:`JOB_VARS` of this environment are left out, so without them the ranks fall back to the
    launcher's pid, as the ranks of two plain launches on one node do."""
    settings = {"simulate": True, "serve": "external", "interval": 0.2, **settings}
    env = vramwatch_env(exporter.spool, exporter.port, **settings)
    for name in JOB_VARS:
        env.pop(name, None)
    env.update(job_env or {})
    return subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(world_size), *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=exporter.log,
        stderr=exporter.log,
        start_new_session=True,
    )
