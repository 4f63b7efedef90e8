"""The simulated node: its GPUs and what a test or the demo does to them.

The state is one JSON file, ``<spool>/sim-node.json``, shared by the simulated
ranks (:mod:`vramwatch.sim.allocator`), the server's fake NVML
(:mod:`vramwatch.sim.nvml`) and whoever drives the scenario. Every reading is
in the units a person thinks in (watts, 0..1, MHz, bytes); the fake NVML turns
them into NVML's own units (mW, mJ, %, MHz) on the way out.

Driving it from a test or the demo::

    from vramwatch.sim.state import edit

    with edit(spool_dir) as node:          # load, change, save atomically
        g = node.gpu(0)
        g.power_w, g.utilization = 95.0, 1.0      # the busy-looking stall
        g.throttle_mask = 0x4                      # NVML clocks-event bits (0x4: SW power cap)
        node.inject_xid(0, 79)                     # one Xid event, delivered once by the event set
        node.add_foreign(0, pid=4242, used_bytes=6 << 30)   # a second process on the card
        node.inject_error("nvmlDeviceGetPowerUsage", 3)     # NVML_ERROR_NOT_SUPPORTED, every GPU
        node.inject_error("*", 15, gpu=1)          # GPU_IS_LOST on every device call of GPU 1
        g.lost = True                              # the same, the short way
        node.nvml_absent = "library_not_found"     # a node without NVML: libnvidia-ml.so.1 "not found"
                                                   # at nvmlInit; or "driver_not_loaded", "no_devices"

Each field's meaning is beside it below; ``SimNode.errors`` keys are ``"nvmlDeviceGetPowerUsage"`` (every
GPU), ``"nvmlDeviceGetPowerUsage:1"`` (GPU 1 only), ``"*"`` / ``"*:1"`` (every per-device call),
``"nvmlInit"``, ``"nvmlEventSetWait"``, ...
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from vramwatch.rank.identity import process_start

MIB = 1 << 20
STATE_FILE = "sim-node.json"
MAX_XIDS = 256  # the queue keeps the newest events only


@dataclass
class SimMig:
    """One MIG instance (a compute instance of a GPU instance) of a GPU in MIG mode."""

    uuid: str  # MIG-..., what nvmlDeviceGetUUID gives for its handle (R470+)
    gpu_instance_id: int
    compute_instance_id: int = 0
    profile: str = "3g.71gb"
    total_bytes: int = 71 << 30
    extra_used_bytes: int = 0  # memory used on the instance by something that is not a rank


@dataclass
class SimGpu:
    index: int
    uuid: str
    name: str = "NVIDIA H200 (simulated)"
    total_bytes: int = 143771 * MIB
    pci_bus_id: str = ""
    power_w: float = 120.0
    power_limit_w: float = 700.0
    utilization: float = 0.0  # 0..1
    memory_utilization: float = 0.0
    temperature_c: float = 35.0
    sm_clock_mhz: float = 1980.0
    memory_clock_mhz: float = 3201.0
    throttle_mask: int = 0  # NVML clocks-event-reason bits
    energy_mj: float = 0.0  # the energy counter, mJ since "driver load"; tick() advances it by the power draw
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    remapped: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # corr, unc, pending, failure
    pcie_replays: int = 0
    extra_used_bytes: int = 0  # memory used by something other than the ranks and foreign processes
    driver_reserved_bytes: int = 615 * MIB  # what NVML's v2 memory call reports as reserved
    lost: bool = False  # every device call raises GPU_IS_LOST
    # NVML's GPU recovery action (field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): 0 none, 1 gpu_reset,
    # 2 node_reboot, 3 drain_p2p, 4 drain_and_reset, ...; None: a driver without the field (NOT_SUPPORTED)
    recovery_action: int | None = 0
    # MIG mode: utilisation, remapped rows and GPM become NOT_SUPPORTED, as on real MIG parents;
    # CUDA_VISIBLE_DEVICES=MIG-<uuid> puts a simulated rank on one of mig_instances
    mig: bool = False
    # GPM (NVML's performance counters, Hopper and newer): False makes nvmlGpmQueryDeviceSupport say
    # isSupportedDevice=0; the rates are what the next GPM interval reports
    gpm: bool = True
    # GPM rates (0..1, bytes/s) of the interval between two GPM samples, as they were at the newer one
    sm_activity: float = 0.0
    sm_occupancy: float = 0.0
    tensor_activity: float = 0.0
    dram_bandwidth_utilization: float = 0.0
    pcie_rx_bytes_per_second: float = 0.0
    pcie_tx_bytes_per_second: float = 0.0
    nvlink_rx_bytes_per_second: float = 0.0
    nvlink_tx_bytes_per_second: float = 0.0
    nvlink_links: int = 18  # NVLinks, all active (an H200 SXM has 18); 0: no NVLink (NOT_SUPPORTED)
    nvlink_errors: dict[str, int] = field(default_factory=dict)  # "link:counter" -> count (NVML_NVLINK_ERROR_DL_*)
    mig_instances: list[SimMig] = field(default_factory=list)  # with mig: the instances NVML enumerates

    def enable_mig(self, profiles: tuple[str, ...] = ("3g.71gb", "3g.71gb")) -> list[SimMig]:
        """MIG mode on with one instance per profile (a simulation only: nothing touches a real card)."""
        self.mig = True
        self.mig_instances = [
            SimMig(_mig_uuid(self.index, i), gpu_instance_id=i + 1, profile=p, total_bytes=_profile_bytes(p))
            for i, p in enumerate(profiles)
        ]
        return self.mig_instances

    def tick(self, seconds: float) -> None:
        """Advance the energy counter by ``seconds`` of the current power draw."""
        self.energy_mj += self.power_w * 1000.0 * seconds


@dataclass
class SimNode:
    gpus: list[SimGpu]
    driver_version: str = "580.159.04 (simulated)"
    # compute processes that are not ranks; a rank's own comes from its spool sample: its pid, its reserved
    # bytes plus context_bytes, on every GPU it has a device on
    foreign: list[dict[str, Any]] = field(default_factory=list)  # {"gpu": i, "pid": p, "used_bytes": n}
    xids: list[dict[str, Any]] = field(default_factory=list)  # the event queue: {"seq", "gpu", "xid", "time"}
    errors: dict[str, int] = field(default_factory=dict)  # NVML function (or "*") -> error code, raised as NVMLError
    # a node without NVML, one of contract.NVML_ABSENT_REASONS: library_not_found (nvmlInit: LIBRARY_NOT_FOUND),
    # driver_not_loaded (nvmlInit: DRIVER_NOT_LOADED), no_devices (NVML answers, with no GPU)
    nvml_absent: str = ""
    context_bytes: int = 527 * MIB  # what a CUDA context costs a rank (measured on an H200)
    xid_seq: int = 0  # sequence number of the newest injected Xid (survives the queue's trimming)
    # the process driving the state (the demo: {"pid", "start"}); once it is gone the state is stale, and
    # loading it gives a fresh node: a later simulated run never reads a finished demo's readings as current
    driver: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def default(cls, count: int = 1) -> SimNode:
        return cls([SimGpu(i, _uuid(i), pci_bus_id=f"00000000:{0x18 + i:02X}:00.0") for i in range(count)])

    # --- persistence: atomic replace, so readers never see half a file ---
    def save(self, path: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(asdict(self), fh)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> SimNode:
        """The state in ``path``; a fresh node of as many GPUs when the process that drove it is gone."""
        node = cls.read(path)
        return cls.default(len(node.gpus)) if node.stale() else node

    @classmethod
    def read(cls, path: str) -> SimNode:
        """The state in ``path`` as it was saved, stale or not."""
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
        raw["gpus"] = [SimGpu(**g) for g in raw["gpus"]]
        for g in raw["gpus"]:
            g.mig_instances = [SimMig(**m) for m in g.mig_instances]
        return cls(**raw)

    def drive_by(self, pid: int) -> None:
        """Mark the state as driven by process ``pid``: it is stale once that process is gone."""
        self.driver = {"pid": int(pid), "start": process_start(pid)}

    def stale(self) -> bool:
        if not self.driver:
            return False  # a state nobody drives (a test's edit) holds until changed
        pid = int(self.driver.get("pid", 0))
        return pid <= 0 or process_start(pid) != self.driver.get("start")

    # --- driving ---
    def gpu(self, index: int) -> SimGpu:
        return self.gpus[index]

    def inject_xid(self, gpu: int, xid: int) -> None:
        """Queue one Xid event on GPU ``gpu``; event sets registered before this call see it once."""
        last = max([self.xid_seq] + [int(x.get("seq", 0)) for x in self.xids])
        self.xid_seq = last + 1
        self.xids.append({"seq": self.xid_seq, "gpu": int(gpu), "xid": int(xid), "time": time.time()})
        del self.xids[:-MAX_XIDS]

    def add_foreign(self, gpu: int, pid: int, used_bytes: int) -> None:
        self.foreign.append({"gpu": int(gpu), "pid": int(pid), "used_bytes": int(used_bytes)})

    def inject_error(self, function: str, code: int, gpu: int | None = None) -> None:
        """Make NVML ``function`` (or ``"*"``: every per-device call) raise NVMLError(code)."""
        self.errors[_error_key(function, gpu)] = int(code)

    def clear_error(self, function: str | None = None, gpu: int | None = None) -> None:
        """Stop injecting ``function``'s error (None: every injected error)."""
        if function is None:
            self.errors.clear()
        else:
            self.errors.pop(_error_key(function, gpu), None)

    def error_for(self, function: str, gpu: int | None) -> int | None:
        """The injected error code for one call, most specific key first."""
        keys = [function]  # "*" is for per-device calls only
        if gpu is not None:
            keys = [f"{function}:{gpu}", function, f"*:{gpu}", "*"]
        for k in keys:
            if k in self.errors:
                return int(self.errors[k])
        return None


def _error_key(function: str, gpu: int | None) -> str:
    return function if gpu is None else f"{function}:{gpu}"


def _uuid(i: int) -> str:
    return f"GPU-5e1a0000-0000-4000-8000-{i:012x}"


def _mig_uuid(gpu: int, i: int) -> str:
    return f"MIG-5e1a0000-0000-4000-9000-{gpu:04x}{i:08x}"


def _profile_bytes(profile: str) -> int:
    """A profile's memory from its name ("3g.71gb": 71 GiB), 1 GiB when the name has no size."""
    try:
        return int(profile.split(".", 1)[1].lower().split("gb", 1)[0]) << 30
    except (IndexError, ValueError):
        return 1 << 30


def state_path(spool_dir: str) -> str:
    return os.path.join(spool_dir, STATE_FILE)


def load_or_create(spool_dir: str, count: int = 1) -> SimNode:
    path = state_path(spool_dir)
    try:
        node = SimNode.read(path)
        if node.stale():  # a finished driver's (the demo's) readings: start afresh, for every reader
            node = SimNode.default(len(node.gpus))
            node.save(path)
        return node
    except (OSError, ValueError, TypeError, KeyError):
        node = SimNode.default(count)
        os.makedirs(spool_dir, mode=0o700, exist_ok=True)
        node.save(path)
        return node


@contextlib.contextmanager
def edit(spool_dir: str, count: int = 1) -> Iterator[SimNode]:
    """Load the node's state, let the caller change it, save it atomically."""
    node = load_or_create(spool_dir, count)
    yield node
    node.save(state_path(spool_dir))
