"""A fake ``pynvml`` over the simulated node: the same function names, units and errors.

The server uses it in place of nvidia-ml-py when ``simulate`` is set. Readings
come from the node's state file (:mod:`vramwatch.sim.state`), converted to
NVML's units (mW, mJ, %, MHz, bytes); errors are real ``pynvml.NVMLError``
instances (so ``NVMLError_GpuIsLost`` and friends match), raised for the calls
named in ``SimNode.errors``, for every call on a ``lost`` GPU, and at
``nvmlInit`` on a node without NVML (``nvml_absent``; with ``no_devices`` NVML
answers and counts no GPU). GPM samples are objects of their own (:class:`SimGpmSample`) whose
allocations are counted, so a test sees a leak or a double free. Constants (``NVML_CLOCK_SM``,
``nvmlMemory_v2``, ``NVML_ERROR_*``, ...) are nvidia-ml-py's own.

The ranks' compute processes come from their spool samples: each rank pid
holds its reserved bytes plus the node's ``context_bytes`` on every GPU it
has a device on; ``SimNode.foreign`` adds the others. Device memory "used"
is the sum of those, ``extra_used_bytes`` and the driver's reservation.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from vramwatch.sim.state import SimNode, load_or_create, state_path

# what an H200 on driver 580 reports for nvmlDeviceGetSupportedEventTypes (measured)
SUPPORTED_EVENTS = 0xFF9F
_NO_INSTANCE = 0xFFFFFFFF


# SimNode.nvml_absent -> what nvmlInit raises
_ABSENT_AT_INIT = {
    "library_not_found": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    "driver_not_loaded": pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
}


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass(frozen=True)
class SimHandle:
    """What nvmlDeviceGetHandleBy* returns: a GPU index of the simulated node; with ``mig`` >= 0, the MIG
    device at that position of the GPU's ``mig_instances`` (nvmlDeviceGetMigDeviceHandleByIndex)."""

    index: int
    mig: int = -1


# what a MIG device handle answers; every other per-device call is NOT_SUPPORTED on one (torch-nvml.md B4:
# memory and processes per MIG handle, no utilisation, remapped rows or per-instance events)
_MIG_CALLS = frozenset(
    {
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
    }
)
MAX_MIG_DEVICES = 7  # nvmlDeviceGetMaxMigDeviceCount of an H200 (7 GPU instances at most)


# NVML_GPM_METRIC_* id -> the SimGpu field it reports and the factor to NVML's unit (percent, MiB/s)
_GPM_FIELDS: dict[int, tuple[str, float]] = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: ("sm_activity", 100.0),
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: ("sm_occupancy", 100.0),
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: ("tensor_activity", 100.0),
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: ("dram_bandwidth_utilization", 100.0),
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: ("pcie_rx_bytes_per_second", 1.0 / (1 << 20)),
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: ("pcie_tx_bytes_per_second", 1.0 / (1 << 20)),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: ("nvlink_rx_bytes_per_second", 1.0 / (1 << 20)),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: ("nvlink_tx_bytes_per_second", 1.0 / (1 << 20)),
}
_NVLINK_METRICS = frozenset(
    {pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC}
)
_GPM_METRIC_SLOTS = 98  # as many as one request may ask; NVML's array holds NVML_GPM_METRIC_MAX


@dataclass
class SimGpmSample:
    """What nvmlGpmSampleAlloc returns; nvmlGpmSampleGet fills it with the GPU's rates of that moment."""

    index: int = -1  # the GPU sampled into it; -1: never filled
    taken: float = 0.0
    values: dict[int, float] = field(default_factory=dict)  # metric id -> value in NVML's unit
    freed: bool = False


class SimGpmMetricsGet:
    """nvmlGpmMetricsGet's request and answer, with pynvml's field names (``c_nvmlGpmMetricsGet_t``)."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: Any = None
        self.sample2: Any = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(_GPM_METRIC_SLOTS)]


@dataclass
class SimEventSet:
    masks: dict[int, int] = field(default_factory=dict)  # gpu index -> registered event types
    cursors: dict[int, int] = field(default_factory=dict)  # gpu index -> newest Xid seq already seen
    freed: bool = False


class _Reading:
    """A per-device call answered from the GPU's state alone: ``read(gpu, *args)`` after ``_call``'s checks."""

    def __init__(self, read: Callable[..., Any]) -> None:
        self.read = read
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __call__(self, nv: SimNvml, h: SimHandle, *args: Any) -> Any:
        return self.read(nv._call(self.name, h)[1], *args)

    def __get__(self, nv: SimNvml | None, owner: type | None = None) -> Any:
        return self if nv is None else functools.partial(self, nv)  # bound, as a method is


class SimNvml:
    """A pynvml-compatible object; build it with :meth:`from_spool` or :meth:`from_node`."""

    def __init__(
        self, node: Callable[[], SimNode], samples: Callable[[], list[Any]] | None = None, poll: float = 0.05
    ) -> None:
        self._node = node
        self._samples = samples or (lambda: [])
        self._poll = poll
        self._initialized = False
        self._lock = threading.Lock()
        self.gpm_samples_live = 0  # allocated and not yet freed (a leak shows here)

    # --- construction ---
    @classmethod
    def from_spool(cls, spool_dir: str) -> SimNvml:
        """The server's view: the node's state file and the ranks' samples in ``spool_dir``."""
        return cls(_FileNode(spool_dir), _SpoolSamples(spool_dir))

    @classmethod
    def from_node(cls, node: SimNode, samples: Callable[[], list[Any]] | None = None, poll: float = 0.01) -> SimNvml:
        """An in-memory node (unit tests): change ``node`` and the next call sees it."""
        return cls(lambda: node, samples, poll)

    def __getattr__(self, name: str) -> Any:
        # constants and error classes are nvidia-ml-py's; a function we do not fake is an AttributeError
        value = getattr(pynvml, name)
        if callable(value) and not isinstance(value, type) and name.startswith("nvml"):
            raise AttributeError(f"the simulated NVML has no {name}()")
        return value

    # --- plumbing ---
    def _call(self, fn: str, handle: SimHandle | None = None) -> tuple[SimNode, Any]:
        if not self._initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        node = self._node()
        if handle is None:
            code = node.error_for(fn, None)
            if code is not None:
                raise _err(code)
            return node, None
        if not isinstance(handle, SimHandle) or not 0 <= handle.index < len(node.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        code = node.error_for(fn, handle.index)
        if code is not None:
            raise _err(code)
        gpu = node.gpus[handle.index]
        if gpu.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if handle.mig >= 0:
            if not gpu.mig or handle.mig >= len(gpu.mig_instances):
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # the instance is gone: its handle is invalid
            if fn not in _MIG_CALLS:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return node, gpu

    @staticmethod
    def _instance(gpu: Any, h: SimHandle) -> Any:
        return gpu.mig_instances[h.mig] if h.mig >= 0 else None

    def _processes(self, node: SimNode, gpu: Any, mig: Any = None) -> list[tuple[int, int]]:
        # a MIG instance holds the ranks on it; its parent every rank on the card or on one of its instances
        uuids = {mig.uuid} if mig is not None else {gpu.uuid} | {m.uuid for m in gpu.mig_instances if gpu.mig}
        out = []
        for s in self._samples():
            for dev in s.devices:
                if dev.uuid in uuids:
                    reserved = dev.values.get("torch_cuda_memory_reserved_bytes", 0)
                    out.append((s.pid, int(reserved) + node.context_bytes))
                    break
        for f in node.foreign if mig is None else ():
            if int(f.get("gpu", -1)) == gpu.index:
                out.append((int(f.get("pid", 0)), int(f.get("used_bytes", 0))))
        return out

    # --- library ---
    def nvmlInit(self) -> None:
        node = self._node()
        if node.nvml_absent in _ABSENT_AT_INIT:
            raise _err(_ABSENT_AT_INIT[node.nvml_absent])
        code = node.error_for("nvmlInit", None)
        if code is not None:
            raise _err(code)
        self._initialized = True

    def nvmlSystemGetDriverVersion(self) -> str:
        node, _ = self._call("nvmlSystemGetDriverVersion")
        return node.driver_version

    def nvmlDeviceGetCount(self) -> int:
        node, _ = self._call("nvmlDeviceGetCount")
        return 0 if node.nvml_absent == "no_devices" else len(node.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimHandle:
        self._call("nvmlDeviceGetHandleByIndex", SimHandle(int(index)))
        return SimHandle(int(index))

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> SimHandle:
        node, _ = self._call("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        for g in node.gpus:
            if g.uuid == text:
                self._call("nvmlDeviceGetHandleByUUID", SimHandle(g.index))
                return SimHandle(g.index)
            for i, m in enumerate(g.mig_instances if g.mig else ()):
                if m.uuid == text:  # MIG-aware since R470 (NVML change log)
                    self._call("nvmlDeviceGetHandleByUUID", SimHandle(g.index))
                    return SimHandle(g.index, i)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    # --- identity ---
    def nvmlDeviceGetUUID(self, h: SimHandle) -> str:
        g = self._call("nvmlDeviceGetUUID", h)[1]
        m = self._instance(g, h)
        return m.uuid if m is not None else g.uuid

    def nvmlDeviceGetName(self, h: SimHandle) -> str:
        g = self._call("nvmlDeviceGetName", h)[1]
        m = self._instance(g, h)
        return f"{g.name} MIG {m.profile}" if m is not None else g.name  # as "NVIDIA H100 80GB HBM3 MIG 1g.10gb"

    # --- MIG devices ---
    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: SimHandle, index: int) -> SimHandle:
        g = self._call("nvmlDeviceGetMigDeviceHandleByIndex", h)[1]
        if h.mig >= 0 or not 0 <= int(index) < MAX_MIG_DEVICES:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not g.mig or int(index) >= len(g.mig_instances):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)  # no MIG device at that index
        return SimHandle(h.index, int(index))

    def nvmlDeviceGetGpuInstanceId(self, h: SimHandle) -> int:
        return int(self._mig_device("nvmlDeviceGetGpuInstanceId", h).gpu_instance_id)

    def nvmlDeviceGetComputeInstanceId(self, h: SimHandle) -> int:
        return int(self._mig_device("nvmlDeviceGetComputeInstanceId", h).compute_instance_id)

    def _mig_device(self, fn: str, h: SimHandle) -> Any:
        m = self._instance(self._call(fn, h)[1], h)
        if m is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # not a MIG device handle
        return m

    # --- readings of the card's state alone, after the call's checks (injected errors, a lost GPU, MIG) ---
    nvmlDeviceGetPciInfo = _Reading(  # the bus id in bytes, as the ctypes struct holds it
        lambda g: SimpleNamespace(busId=g.pci_bus_id.encode(), busIdLegacy=g.pci_bus_id.encode())
    )
    nvmlDeviceGetMigMode = _Reading(lambda g: [1, 1] if g.mig else [0, 0])
    nvmlDeviceGetMaxMigDeviceCount = _Reading(lambda g: MAX_MIG_DEVICES)
    nvmlDeviceGetPowerUsage = _Reading(lambda g: int(round(g.power_w * 1000)))
    nvmlDeviceGetEnforcedPowerLimit = _Reading(lambda g: int(round(g.power_limit_w * 1000)))
    nvmlDeviceGetTotalEnergyConsumption = _Reading(lambda g: int(g.energy_mj))
    nvmlDeviceGetTemperature = _Reading(lambda g, sensor: int(round(g.temperature_c)))
    nvmlDeviceGetTemperatureV = _Reading(lambda g, sensor, version=0: int(round(g.temperature_c)))
    # SM and graphics clocks are one on these parts
    nvmlDeviceGetClockInfo = _Reading(
        lambda g, clock: int(round(g.memory_clock_mhz if clock == pynvml.NVML_CLOCK_MEM else g.sm_clock_mhz))
    )
    nvmlDeviceGetCurrentClocksEventReasons = _Reading(lambda g: int(g.throttle_mask))
    nvmlDeviceGetCurrentClocksThrottleReasons = _Reading(lambda g: int(g.throttle_mask))
    nvmlDeviceGetTotalEccErrors = _Reading(
        lambda g, kind, counter: int(
            g.ecc_uncorrected if kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else g.ecc_corrected
        )
    )
    nvmlDeviceGetPcieReplayCounter = _Reading(lambda g: int(g.pcie_replays))
    nvmlDeviceGetSupportedEventTypes = _Reading(lambda g: SUPPORTED_EVENTS)

    # --- readings that need more than the card's state ---
    def nvmlDeviceGetMemoryInfo(self, h: SimHandle, version: int | None = None) -> SimpleNamespace:
        node, g = self._call("nvmlDeviceGetMemoryInfo", h)
        m = self._instance(g, h)  # a MIG instance: its own memory, its processes and what else is on it
        own = m if m is not None else g
        reserved = 0 if m is not None else g.driver_reserved_bytes
        in_use = sum(used for _, used in self._processes(node, g, m)) + own.extra_used_bytes
        used = min(own.total_bytes, in_use + reserved)
        free = own.total_bytes - used
        if not version:
            return SimpleNamespace(total=own.total_bytes, free=free, used=used)
        # v2 reports the driver's reservation apart (measured: v2.used = v1.used - reserved)
        return SimpleNamespace(
            version=version, total=own.total_bytes, reserved=reserved, free=free, used=used - reserved
        )

    def nvmlDeviceGetUtilizationRates(self, h: SimHandle) -> SimpleNamespace:
        g = self._call("nvmlDeviceGetUtilizationRates", h)[1]
        if g.mig:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=int(round(g.utilization * 100)), memory=int(round(g.memory_utilization * 100)))

    def nvmlDeviceGetRemappedRows(self, h: SimHandle) -> tuple[int, int, int, int]:
        g = self._call("nvmlDeviceGetRemappedRows", h)[1]
        if g.mig:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        corr, unc, pending, failure = (list(g.remapped) + [0, 0, 0, 0])[:4]
        return int(corr), int(unc), int(pending), int(failure)

    def nvmlDeviceGetFieldValues(self, h: SimHandle, field_ids: list[Any]) -> list[SimpleNamespace]:
        """Only the GPU recovery action (field 230); any other field answers NOT_SUPPORTED in its own
        nvmlReturn, as a driver does, and so does 230 where ``recovery_action`` is None (an older driver)."""
        g = self._call("nvmlDeviceGetFieldValues", h)[1]
        out = []
        for fid in field_ids:
            field_id, scope = fid if isinstance(fid, tuple) else (fid, 0)
            action = g.recovery_action if field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION else None
            ret = pynvml.NVML_SUCCESS if action is not None else pynvml.NVML_ERROR_NOT_SUPPORTED
            out.append(
                SimpleNamespace(
                    fieldId=field_id,
                    scopeId=scope,
                    timestamp=int(time.time() * 1e6),
                    latencyUsec=0,
                    valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                    nvmlReturn=ret,
                    value=SimpleNamespace(uiVal=int(action or 0)),
                )
            )
        return out

    # --- GPM and NVLink ---
    c_nvmlGpmMetricsGet_t = SimGpmMetricsGet

    def nvmlGpmQueryDeviceSupport(self, h: SimHandle) -> SimpleNamespace:
        g = self._call("nvmlGpmQueryDeviceSupport", h)[1]
        return SimpleNamespace(version=pynvml.NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(g.gpm))

    def nvmlGpmSampleAlloc(self) -> SimGpmSample:
        self._call("nvmlGpmSampleAlloc")
        with self._lock:
            self.gpm_samples_live += 1
        return SimGpmSample()

    def nvmlGpmSampleFree(self, sample: SimGpmSample) -> None:
        self._call("nvmlGpmSampleFree")
        if sample.freed:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # a double free
        sample.freed = True
        with self._lock:
            self.gpm_samples_live -= 1

    def nvmlGpmSampleGet(self, h: SimHandle, sample: SimGpmSample) -> SimGpmSample:
        g = self._call("nvmlGpmSampleGet", h)[1]
        if not g.gpm or g.mig:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if sample.freed:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        sample.index, sample.taken = h.index, time.monotonic()
        sample.values = {
            mid: float(getattr(g, name)) * scale
            for mid, (name, scale) in _GPM_FIELDS.items()
            if g.nvlink_links > 0 or mid not in _NVLINK_METRICS
        }
        return sample

    def nvmlGpmMetricsGet(self, req: SimGpmMetricsGet) -> SimGpmMetricsGet:
        a, b = req.sample1, req.sample2
        if not isinstance(a, SimGpmSample) or not isinstance(b, SimGpmSample) or a.freed or b.freed:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if a.index < 0 or a.index != b.index or b.taken < a.taken or req.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._call("nvmlGpmMetricsGet", SimHandle(b.index))
        for m in req.metrics[: req.numMetrics]:
            value = b.values.get(m.metricId)
            m.nvmlReturn = pynvml.NVML_SUCCESS if value is not None else pynvml.NVML_ERROR_NOT_SUPPORTED
            m.value = value if value is not None else 0.0
        return req

    def nvmlDeviceGetNvLinkState(self, h: SimHandle, link: int) -> int:
        g = self._call("nvmlDeviceGetNvLinkState", h)[1]
        if g.nvlink_links <= 0:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < min(g.nvlink_links, pynvml.NVML_NVLINK_MAX_LINKS):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # the part has no such link
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, h: SimHandle, link: int, counter: int) -> int:
        g = self._call("nvmlDeviceGetNvLinkErrorCounter", h)[1]
        if not 0 <= link < g.nvlink_links:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED if g.nvlink_links <= 0 else pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(g.nvlink_errors.get(f"{link}:{counter}", 0))

    def nvmlDeviceGetComputeRunningProcesses(self, h: SimHandle) -> list[SimpleNamespace]:
        node, g = self._call("nvmlDeviceGetComputeRunningProcesses", h)
        m = self._instance(g, h)
        gi = m.gpu_instance_id if m is not None else _NO_INSTANCE
        ci = m.compute_instance_id if m is not None else _NO_INSTANCE
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=gi, computeInstanceId=ci)
            for pid, used in self._processes(node, g, m)
        ]

    # --- events ---
    def nvmlEventSetCreate(self) -> SimEventSet:
        self._call("nvmlEventSetCreate")
        return SimEventSet()

    def nvmlDeviceRegisterEvents(self, h: SimHandle, event_types: int, es: SimEventSet) -> None:
        node, _ = self._call("nvmlDeviceRegisterEvents", h)
        if es.freed:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if event_types & ~SUPPORTED_EVENTS:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        es.masks[h.index] = es.masks.get(h.index, 0) | int(event_types)
        # "events that occurred before this call are not recorded"
        es.cursors.setdefault(h.index, max([node.xid_seq] + [int(x.get("seq", 0)) for x in node.xids]))

    def nvmlEventSetWait(self, es: SimEventSet, timeoutms: int) -> SimpleNamespace:
        deadline = time.monotonic() + max(0, int(timeoutms)) / 1000.0
        while True:
            node, _ = self._call("nvmlEventSetWait")
            if es.freed:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            for x in sorted(node.xids, key=lambda e: int(e.get("seq", 0))):
                idx, seq = int(x.get("gpu", -1)), int(x.get("seq", 0))
                if es.masks.get(idx, 0) & pynvml.nvmlEventTypeXidCriticalError and seq > es.cursors.get(idx, 0):
                    es.cursors[idx] = seq
                    return SimpleNamespace(
                        device=SimHandle(idx),
                        eventType=pynvml.nvmlEventTypeXidCriticalError,
                        eventData=int(x.get("xid", 999)),
                        gpuInstanceId=_NO_INSTANCE,
                        computeInstanceId=_NO_INSTANCE,
                    )
            left = deadline - time.monotonic()
            if left <= 0:
                raise _err(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(min(self._poll, left))

    def nvmlEventSetFree(self, es: SimEventSet) -> None:
        self._call("nvmlEventSetFree")
        es.freed = True


class _FileNode:
    """The node's state file, reloaded when it was replaced (saves are atomic renames)."""

    def __init__(self, spool_dir: str) -> None:
        self.spool_dir = spool_dir
        self.path = state_path(spool_dir)
        self._key: tuple[int, int, int] | None = None
        self._node: SimNode | None = None

    def __call__(self) -> SimNode:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._node = load_or_create(self.spool_dir)
            return self._node
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key or self._node is None:
            try:
                node = SimNode.load(self.path)
            except (OSError, ValueError, TypeError, KeyError):
                if self._node is None:
                    raise
                return self._node  # keep the last good state
            self._node, self._key = node, key
        return self._node


class _SpoolSamples:
    """The ranks' newest samples, read at most every ``ttl`` seconds."""

    def __init__(self, spool_dir: str, ttl: float = 0.25) -> None:
        self.spool_dir = spool_dir
        self.ttl = ttl
        self._at = -1e9
        self._samples: list[Any] = []

    def __call__(self) -> list[Any]:
        now = time.monotonic()
        if now - self._at >= self.ttl:
            from vramwatch.spool import read_samples

            self._samples = read_samples(self.spool_dir, 4096, reap=False)
            self._at = now
        return self._samples
