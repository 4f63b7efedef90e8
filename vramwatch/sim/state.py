"""The simulated node: its GPUs and what a test or the demo does to them."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MIB = 1 << 20
STATE_FILE = "sim-node.json"


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
    energy_mj: float = 0.0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    remapped: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # corr, unc, pending, failure
    pcie_replays: int = 0
    extra_used_bytes: int = 0  # memory used by something other than the ranks and foreign processes
    driver_reserved_bytes: int = 615 * MIB
    lost: bool = False
    mig: bool = False


@dataclass
class SimNode:
    gpus: list[SimGpu]
    driver_version: str = "580.159.04 (simulated)"
    foreign: list[dict[str, Any]] = field(default_factory=list)  # {"gpu": i, "pid": p, "used_bytes": n}
    xids: list[dict[str, Any]] = field(default_factory=list)  # {"seq", "gpu", "xid", "time"}
    errors: dict[str, int] = field(default_factory=dict)  # NVML function name (or "*") -> NVML error code
    nvml_missing: bool = False  # libnvidia-ml "not found"
    context_bytes: int = 527 * MIB  # what a CUDA context costs a rank (measured on an H200)

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
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
        raw["gpus"] = [SimGpu(**g) for g in raw["gpus"]]
        return cls(**raw)

    # --- driving ---
    def gpu(self, index: int) -> SimGpu:
        return self.gpus[index]

    def inject_xid(self, gpu: int, xid: int) -> None:
        seq = (self.xids[-1]["seq"] + 1) if self.xids else 1
        self.xids.append({"seq": seq, "gpu": gpu, "xid": int(xid), "time": time.time()})

    def add_foreign(self, gpu: int, pid: int, used_bytes: int) -> None:
        self.foreign.append({"gpu": gpu, "pid": pid, "used_bytes": int(used_bytes)})


def _uuid(i: int) -> str:
    return f"GPU-5e1a0000-0000-4000-8000-{i:012x}"


def state_path(spool_dir: str) -> str:
    return os.path.join(spool_dir, STATE_FILE)


def load_or_create(spool_dir: str, count: int = 1) -> SimNode:
    path = state_path(spool_dir)
    try:
        return SimNode.load(path)
    except (OSError, ValueError, TypeError, KeyError):
        node = SimNode.default(count)
        os.makedirs(spool_dir, mode=0o700, exist_ok=True)
        node.save(path)
        return node
