"""GPU activity from NVML's GPM (GPU performance monitoring, Hopper and newer): no DCGM needed.

GPM metrics are rates between two samples: each GPU keeps two sample buffers, and every read (the slow
cadence) fills the older one and computes SM activity and occupancy, tensor-core activity, DRAM bandwidth
and PCIe / NVLink throughput over the interval since the previous read, then swaps them. The first read of
a GPU only primes it. Buffers are allocated once per GPU and freed when the GPU is lost, when NVML
re-initialises, when GPM turns out unsupported and when the server stops.

A GPU without GPM (before Hopper, MIG on, or a VM that hides the counters) is remembered with the NVML
error code in a one-time log and skipped until NVML re-initialises: ``up`` stays 1, the families are absent.
A metric one GPU does not report (NVLink throughput without NVLink) is dropped for that GPU alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric

from vramwatch.config import Settings
from vramwatch.monitoring import contract
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import Cadence, ScrapeContext, register
from vramwatch.server.collectors.nvml_base import NvmlSessionCollector
from vramwatch.server.collectors.xid import job_uuids

MIB = float(1 << 20)

# NVML_GPM_METRIC_* ids (nvml.h, by value so the fake NVML and the real one are asked alike) -> the contract
# family and the factor from NVML's unit (percent, MiB/s) to the base unit (ratio, bytes/s)
METRICS: tuple[tuple[int, str, float], ...] = (
    (2, "gpu_sm_activity_ratio", 0.01),  # SM_UTIL
    (3, "gpu_sm_occupancy_ratio", 0.01),  # SM_OCCUPANCY
    (5, "gpu_tensor_activity_ratio", 0.01),  # ANY_TENSOR_UTIL
    (10, "gpu_dram_bandwidth_utilization_ratio", 0.01),  # DRAM_BW_UTIL
    (21, "gpu_pcie_rx_bytes_per_second", MIB),  # PCIE_RX_PER_SEC
    (20, "gpu_pcie_tx_bytes_per_second", MIB),  # PCIE_TX_PER_SEC
    (60, "gpu_nvlink_rx_bytes_per_second", MIB),  # NVLINK_TOTAL_RX_PER_SEC
    (61, "gpu_nvlink_tx_bytes_per_second", MIB),  # NVLINK_TOTAL_TX_PER_SEC
)
FAMILIES = tuple(name for _, name, _ in METRICS)
METRICS_GET_VERSION = 1  # NVML_GPM_METRICS_GET_VERSION


@dataclass(frozen=True)
class GpmReading:
    index: int
    uuid: str
    values: dict[str, float]


@dataclass
class _Sampler:
    """One GPU's two sample buffers: ``prev`` holds the last read's sample once ``primed``."""

    prev: Any
    cur: Any
    primed: bool = False
    skip: set[int] = field(default_factory=set)  # metric ids this GPU does not report


class _Unsupported(Exception):
    """The GPU has no GPM; the message names the NVML call and its answer."""


@register("gpm", lambda s: s.nvml and s.gpm, "GPU activity from NVML GPM (SM, tensor, DRAM, PCIe, NVLink).")
class GpmCollector(NvmlSessionCollector[tuple[GpmReading, ...]]):
    cadence = Cadence.SLOW

    what = "reading GPM"

    def __init__(self, settings: Settings, session: nb.NvmlSession | None = None) -> None:
        super().__init__(settings, session)
        self._samplers: dict[str, _Sampler] = {}
        self.last_failure: dict[str, str] = {}  # uuid -> the newest failed read's NVML error (kept after recovery)

    def _forget(self) -> None:  # old buffers belong to the old session
        self._free_all()
        super()._forget()

    def _down(self) -> None:
        self._free_all()
        return None

    def _drop(self, d: nb.Device) -> None:  # lost, failed or unsupported: the next read primes afresh
        self._free(d.uuid)

    def _read_failed(self, d: nb.Device, e: BaseException) -> bool:
        if nb.classify(e) not in ("quiet", "session"):
            self.last_failure[d.uuid] = _code(e)
        return self._failed(d, e, self.what, detail=_code(e))

    def _read_device(self, d: nb.Device) -> GpmReading | None:
        try:
            sm = self._samplers.get(d.uuid) or self._start(d)
            self._gpm("nvmlGpmSampleGet", d.handle, sm.cur)
        except _Unsupported as u:
            self._unavailable_gpu(
                d,
                str(u),
                "GPM is unavailable (%s); the GPU activity families are absent for it, not asked again "
                "until NVML re-inits",
            )
            return None
        if not sm.primed:
            sm.prev, sm.cur, sm.primed = sm.cur, sm.prev, True
            return None
        values = self._metrics(d, sm)
        sm.prev, sm.cur = sm.cur, sm.prev
        return GpmReading(d.index, d.uuid, values)

    def _start(self, d: nb.Device) -> _Sampler:
        """Check GPM support, then allocate the GPU's two buffers (freed by :meth:`_free`)."""
        nv = self.session.nv
        if not getattr(self._gpm("nvmlGpmQueryDeviceSupport", d.handle), "isSupportedDevice", 0):
            raise _Unsupported("nvmlGpmQueryDeviceSupport: isSupportedDevice=0")
        first = nv.nvmlGpmSampleAlloc()
        try:
            second = nv.nvmlGpmSampleAlloc()
        except Exception:
            _free_sample(nv, first)
            raise
        sm = self._samplers[d.uuid] = _Sampler(first, second)
        return sm

    def _gpm(self, call: str, *args: Any) -> Any:
        """NVML's ``call(*args)``; an answer that GPM is unsupported raises :class:`_Unsupported`."""
        try:
            return getattr(self.session.nv, call)(*args)
        except Exception as e:
            if nb.classify(e) == "unsupported":
                raise _Unsupported(f"{call}: {_code(e)}") from e
            raise

    def _metrics(self, d: nb.Device, sm: _Sampler) -> dict[str, float]:
        nv = self.session.nv
        wanted = [m for m in METRICS if m[0] not in sm.skip]
        req = nv.c_nvmlGpmMetricsGet_t()
        req.version = METRICS_GET_VERSION
        req.numMetrics = len(wanted)
        req.sample1, req.sample2 = sm.prev, sm.cur
        for i, (metric_id, _, _) in enumerate(wanted):
            req.metrics[i].metricId = metric_id
        nv.nvmlGpmMetricsGet(req)
        values: dict[str, float] = {}
        for i, (metric_id, name, scale) in enumerate(wanted):
            m = req.metrics[i]
            ret = int(m.nvmlReturn)
            if ret in nb.UNSUPPORTED_CODES:
                sm.skip.add(metric_id)
                self._once_info(
                    d,
                    ("gpm", metric_id),
                    "GPM metric %d (%s) is %s; not asked again until NVML re-inits",
                    metric_id,
                    name,
                    nb.NAMES.get(ret, f"NVML_ERROR_{ret}"),
                )
                continue
            v = float(m.value)
            if ret == 0 and math.isfinite(v) and v >= 0.0:
                values[name] = v * scale
        return values

    # --- buffers ---
    def _free(self, uuid: str) -> None:
        sm = self._samplers.pop(uuid, None)
        if sm is not None:
            _free_sample(self.session.nv, sm.prev)
            _free_sample(self.session.nv, sm.cur)

    def _free_all(self) -> None:
        for uuid in list(self._samplers):
            self._free(uuid)

    def close(self) -> None:
        self._free_all()

    # --- families (pure) ---
    def families(self, snapshot: tuple[GpmReading, ...], ctx: ScrapeContext) -> Iterable[Metric]:
        return gpm_families(snapshot, ctx, self.settings.gpus == "job")


def _code(e: BaseException) -> str:
    """An NVML error as a person looks it up: its name and number."""
    code = nb.error_code(e)
    return nb.error_name(e) if code is None else f"{nb.error_name(e)} (NVML error {code})"


def _free_sample(nv: Any, sample: Any) -> None:
    try:
        nv.nvmlGpmSampleFree(sample)
    except Exception:  # noqa: BLE001 - freeing after a lost GPU or a re-init may fail; nothing else to do
        pass


def gpm_families(snap: tuple[GpmReading, ...], ctx: ScrapeContext, job_only: bool = False) -> Iterable[Metric]:
    fams = {name: contract.family(name) for name in FAMILIES}
    job = job_uuids(ctx) if job_only else None
    for g in snap:
        if job is not None and g.uuid not in job:
            continue
        labels = [str(g.index), g.uuid]
        for name, v in g.values.items():
            fams[name].add_metric(labels, v)
    return tuple(fams.values())
