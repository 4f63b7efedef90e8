"""NVLink error counters of each GPU's active links, on the slow cadence, summed per GPU and type.

Links are found once per NVML session (``nvmlDeviceGetNvLinkState`` for each link up to NVML's
``NVML_NVLINK_MAX_LINKS``); a GPU whose first link answers NOT_SUPPORTED has no NVLink (or a VM hides
it): remembered with the code in a one-time log, ``up`` 1, no series. Each active link then reads its
data-link replay, recovery and CRC (flit + data) counters; a counter the GPU does not report is
dropped for that GPU. The export sums the links: per link, an 18-link GPU would be 54 series (half
again a node's series) for a question, "is this GPU's fabric erroring", that the sum answers; which
link it is, ``nvidia-smi nvlink -e`` tells once the alert points at the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from vramwatch.config import Settings
from vramwatch.monitoring import contract
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import Cadence, ScrapeContext, register
from vramwatch.server.collectors.nvml_base import NvmlSessionCollector
from vramwatch.server.collectors.xid import job_uuids

INVALID_ARGUMENT = 2  # a link number beyond the GPU's links
NVLINK_STATE_ACTIVE = 1
MAX_LINKS_FALLBACK = 18  # NVML_NVLINK_MAX_LINKS of older bindings
# contract.NVLINK_ERROR_TYPES -> NVML_NVLINK_ERROR_DL_* counters summed into it
_NO_LINKS = "no NVLink error counters (%s); not asked again until NVML re-inits"
COUNTERS: dict[str, tuple[int, ...]] = {"replay": (0,), "recovery": (1,), "crc": (2, 3)}


@dataclass(frozen=True)
class LinkErrors:
    index: int
    uuid: str
    counts: tuple[tuple[int, str, float], ...]  # (link, type, count)


@register("nvlink", lambda s: s.nvml and s.nvlink, "NVLink error counters per active link (NVML, slow cadence).")
class NvlinkCollector(NvmlSessionCollector[tuple[LinkErrors, ...]]):
    cadence = Cadence.SLOW

    what = "reading NVLink errors"

    def __init__(self, settings: Settings, session: nb.NvmlSession | None = None) -> None:
        super().__init__(settings, session)
        self._links: dict[str, tuple[int, ...]] = {}  # uuid -> its active links
        self._skip: dict[str, set[int]] = {}  # uuid -> counters it does not report

    def _forget(self) -> None:
        self._links.clear()
        self._skip.clear()
        super()._forget()

    def _read_device(self, d: nb.Device) -> LinkErrors | None:
        links = self._links.get(d.uuid)
        if links is None:
            links = self._links[d.uuid] = self._discover(d)
        return LinkErrors(d.index, d.uuid, self._counts(d, links)) if links else None

    def _discover(self, d: nb.Device) -> tuple[int, ...]:
        """The GPU's active links; lost and session errors go up, the rest end or skip a link."""
        nv = self.session.nv
        links = []
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", MAX_LINKS_FALLBACK))):
            try:
                state = nv.nvmlDeviceGetNvLinkState(d.handle, link)
            except Exception as e:
                if nb.classify(e) in ("lost", "session"):
                    raise
                if link == 0 and nb.classify(e) == "unsupported":
                    self._unavailable_gpu(
                        d, f"nvmlDeviceGetNvLinkState: {nb.error_name(e)} (NVML error {nb.error_code(e)})", _NO_LINKS
                    )
                    return ()
                if nb.error_code(e) == INVALID_ARGUMENT:
                    break  # past the GPU's last link
                continue
            if int(state) == NVLINK_STATE_ACTIVE:
                links.append(link)
        if not links:
            self._unavailable_gpu(d, "no active link", _NO_LINKS)
        return tuple(links)

    def _counts(self, d: nb.Device, links: tuple[int, ...]) -> tuple[tuple[int, str, float], ...]:
        nv = self.session.nv
        skip = self._skip.setdefault(d.uuid, set())
        out = []
        for link in links:
            for kind, counters in COUNTERS.items():
                total: float | None = None
                for c in counters:
                    if c in skip:
                        continue
                    v = self._counter(d, nv, link, c, skip)
                    if v is not None:
                        total = (total or 0.0) + v
                if total is not None:
                    out.append((link, kind, total))
        return tuple(out)

    def _counter(self, d: nb.Device, nv: Any, link: int, counter: int, skip: set[int]) -> float | None:
        try:
            return float(nv.nvmlDeviceGetNvLinkErrorCounter(d.handle, link, counter))
        except Exception as e:
            if nb.classify(e) != "unsupported":
                raise
        skip.add(counter)
        self._once_info(
            d,
            ("nvlink", counter),
            "NVLink error counter %d is not reported; not asked again until NVML re-inits",
            counter,
        )
        return None

    def families(self, snapshot: tuple[LinkErrors, ...], ctx: ScrapeContext) -> Iterable[Metric]:
        fam = contract.family("gpu_nvlink_errors_total")
        job = job_uuids(ctx) if self.settings.gpus == "job" else None
        for g in snapshot:
            if job is not None and g.uuid not in job:
                continue
            totals: dict[str, float] = {}
            for _link, kind, v in g.counts:
                totals[kind] = totals.get(kind, 0.0) + v
            for kind in contract.NVLINK_ERROR_TYPES:
                if kind in totals:
                    fam.add_metric([str(g.index), g.uuid, kind], totals[kind])
        return (fam,)
