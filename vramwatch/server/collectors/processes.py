"""Who else is on the card: compute processes that are not ranks of this job.

Read on the slow cadence (``nvmlDeviceGetComputeRunningProcesses`` costs ~170 us
per GPU on an H200). A process is the job's when its pid is a rank's pid from
the spool samples. In a container NVML may report host pids (drivers before
560 do not translate them) while ranks know their namespaced pid: when none of
the ranks on a GPU is found by pid although they hold memory there, each rank
is matched instead to the unmatched process whose memory is closest to its
reserved bytes. Only counts and bytes are exported: no pid label, ever.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import Metric

from vramwatch.monitoring import contract
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import Cadence, ScrapeContext, register
from vramwatch.server.collectors.nvml_base import NvmlSessionCollector
from vramwatch.spool.files import process_id

MAX_PROCESSES = 256  # per GPU, to bound the work on a card shared by very many processes


@dataclass(frozen=True)
class GpuProcesses:
    index: int
    uuid: str
    processes: tuple[tuple[int, int], ...]  # (pid, used bytes)


@register("processes", lambda s: s.nvml and s.processes, "Foreign compute processes on the GPUs (NVML, slow cadence).")
class ProcessesCollector(NvmlSessionCollector[tuple[GpuProcesses, ...]]):
    cadence = Cadence.SLOW

    what = "listing compute processes"

    def _read_device(self, d: nb.Device) -> GpuProcesses | None:
        try:
            procs = self.session.nv.nvmlDeviceGetComputeRunningProcesses(d.handle)
        except Exception as e:
            if nb.classify(e) != "unsupported":
                raise
            self._unavailable_gpu(d, nb.error_name(e), "compute processes are %s; not asked again")
            return None
        rows = tuple((int(p.pid), int(p.usedGpuMemory or 0)) for p in list(procs)[:MAX_PROCESSES])
        return GpuProcesses(d.index, d.uuid, rows)

    def families(self, snapshot: tuple[GpuProcesses, ...], ctx: ScrapeContext) -> Iterable[Metric]:
        return process_families(snapshot, ctx, self.settings.gpus == "job")


def foreign(procs: tuple[tuple[int, int], ...], rank_pids: set[int], ranks_here: list[float]) -> list[tuple[int, int]]:
    """The processes that are not the job's. ``ranks_here``: reserved bytes of each rank on this GPU."""
    others = [p for p in procs if p[0] not in rank_pids]
    if ranks_here and len(others) == len(procs):
        # no rank found by pid although ranks hold memory here: pid namespaces differ
        for reserved in sorted(ranks_here, reverse=True):
            if not others:
                break
            above = [p for p in others if p[1] >= reserved]
            best = min(above or others, key=lambda p: abs(p[1] - reserved))
            others.remove(best)
    return others


def process_families(snap: tuple[GpuProcesses, ...], ctx: ScrapeContext, job_only: bool = False) -> Iterable[Metric]:
    count = contract.family("gpu_foreign_processes")
    mem = contract.family("gpu_foreign_process_memory_bytes")
    rank_pids: set[int] = set()
    ranks_on: dict[str, list[float]] = {}
    for s in ctx.samples:
        rank_pids.add(process_id(s.pid))  # a sample's pid may be pid + n * 2**22 (vramwatch.spool.files)
        for dev in s.devices:
            if dev.uuid:
                reserved = dev.values.get("torch_cuda_memory_reserved_bytes", 0.0)
                ranks_on.setdefault(dev.uuid, []).append(reserved)
    for g in snap:
        if job_only and g.uuid not in ranks_on:
            continue
        others = foreign(g.processes, rank_pids, ranks_on.get(g.uuid, []))
        labels = [str(g.index), g.uuid]
        count.add_metric(labels, float(len(others)))
        mem.add_metric(labels, float(sum(used for _, used in others)))
    return (count, mem)
