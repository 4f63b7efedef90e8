"""The NVML collector and the process counter, on the simulated NVML, one call site at a time."""

from __future__ import annotations

import logging
import time
from typing import Any

import pynvml
import pytest
from samples import rank_sample

from harness.nvml_calls import CountingNvml
from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.monitoring import contract
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import Runner, ScrapeContext
from vramwatch.server.collectors.nvml import FIELDS, THROTTLE_REASONS, NvmlCollector
from vramwatch.server.collectors.processes import GpuProcesses, ProcessesCollector, foreign, process_families
from vramwatch.server.collectors.xid import XidLedger, XidWatcher
from vramwatch.sim.nvml import SimNvml
from vramwatch.sim.state import SimNode
from vramwatch.spool import HeartbeatSnapshot, RankSample

GIB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Rig:
    """A node, its fake NVML (counted), a session and the collectors on a fake clock.

    The Xid watcher is built (it counts lost GPUs as Xid 79) but never waits here.
    """

    def __init__(self, tmp_path, count: int = 2, **settings: Any) -> None:
        self.node = SimNode.default(count)
        self.samples: list[RankSample] = []
        self.nv = CountingNvml(SimNvml.from_node(self.node, lambda: self.samples))
        self.clock = Clock()
        kw = dict(simulate=True, spool_dir=str(tmp_path), nvml_interval=1.0, nvml_slow_interval=10.0)
        kw.update(settings)
        self.settings = Settings(**kw)
        self.session = nb.NvmlSession(self.settings, module=self.nv, clock=self.clock)
        self.nvml = Runner(NvmlCollector(self.settings, self.session), self.settings, clock=self.clock)
        self.procs = Runner(ProcessesCollector(self.settings, self.session), self.settings, clock=self.clock)
        self.ledger = XidWatcher(self.session, XidLedger(), self.settings).ledger

    def poll(self, advance: float = 1.0) -> None:
        self.clock.t += advance
        self.nvml.poll_once()
        self.procs.poll_once()

    def ctx(self) -> ScrapeContext:
        return ScrapeContext(tuple(self.samples), time.time(), "node-a")

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for c in (self.nvml, self.procs):
            for fam in c.collect(self.ctx()):
                for s in fam.samples:
                    out.setdefault(s.name, []).append((dict(s.labels), s.value))
        return out

    def value(self, name: str, gpu: int = 0, **labels: str) -> float | None:
        for lab, v in self.metrics().get(name, []):
            if lab.get("gpu") == str(gpu) and all(lab.get(k) == x for k, x in labels.items()):
                return v
        return None

    def rank(self, rank: int, pid: int, gpu: int, reserved: int) -> None:
        uuid = self.node.gpu(gpu).uuid
        values = {"torch_cuda_memory_reserved_bytes": float(reserved)}
        self.samples.append(
            rank_sample(rank, hostname="h", pid=pid, uuid=uuid, values=values, heartbeat=HeartbeatSnapshot(steps=7))
        )


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    r.poll(0)
    return r


def test_every_device_family_in_base_units(rig):
    g = rig.node.gpu(0)
    g.power_w, g.power_limit_w, g.energy_mj = 431.25, 700.0, 7_500_000
    g.utilization, g.memory_utilization, g.temperature_c = 1.0, 0.55, 64
    g.sm_clock_mhz, g.memory_clock_mhz, g.throttle_mask = 1980, 3201, 0x4 | 0x40
    g.ecc_corrected, g.ecc_uncorrected, g.remapped, g.pcie_replays = 5, 1, [1, 2, 1, 0], 3
    rig.poll(10)  # a slow round too
    v = rig.value
    assert v("gpu_power_watts") == 431.25 and v("gpu_power_limit_watts") == 700.0
    assert v("gpu_energy_joules_total") == 7500.0
    assert v("gpu_utilization_ratio") == 1.0 and v("gpu_memory_utilization_ratio") == 0.55
    assert v("gpu_temperature_celsius") == 64.0
    assert v("gpu_sm_clock_hertz") == 1.98e9 and v("gpu_memory_clock_hertz") == 3.201e9
    throttled = {lab["reason"]: val for lab, val in rig.metrics()["gpu_clock_throttle"] if lab["gpu"] == "0"}
    assert len(throttled) == len(THROTTLE_REASONS) == 11  # one series per reason, always
    assert {r for r, val in throttled.items() if val == 1.0} == {"sw_power_cap", "hw_thermal_slowdown"}
    assert v("gpu_ecc_errors_total", type="corrected") == 5 and v("gpu_ecc_errors_total", type="uncorrected") == 1
    assert [v("gpu_remapped_rows", kind=k) for k in ("correctable", "uncorrectable", "pending", "failure")] == [
        1,
        2,
        1,
        0,
    ]
    assert v("gpu_pcie_replays_total") == 3
    total, used, free = v("gpu_memory_total_bytes"), v("gpu_memory_used_bytes"), v("gpu_memory_free_bytes")
    assert total == g.total_bytes and total == used + free + v("gpu_memory_reserved_bytes")
    info = [lab for lab, _ in rig.metrics()["gpu_info"] if lab["gpu"] == "0"][0]
    assert info == {
        "gpu": "0",
        "uuid": g.uuid,
        "name": g.name,
        "driver_version": rig.node.driver_version,
        "pci_bus_id": g.pci_bus_id,
        "hostname": "node-a",
        "mig_mode": "disabled",
    }
    assert v("gpu_up") == 1.0 and rig.nvml.health.up == 1
    exposed = contract.exposed_names(rig.metrics())
    assert exposed <= set(contract.BY_NAME)
    # (the gpu_mig_* families come only from a card in MIG mode: tests/server/test_mig.py)
    ours = {
        m.name for m in contract.METRICS if m.collector in ("nvml", "processes") and not m.name.startswith("gpu_mig_")
    }
    assert ours <= exposed, ours - exposed


def test_non_torch_memory_is_used_minus_the_ranks_reserved(rig):
    rig.rank(0, 101, 0, 10 * GIB)
    rig.rank(1, 102, 0, 4 * GIB)
    rig.node.gpu(0).extra_used_bytes = 256 << 20
    rig.poll()
    used = rig.value("gpu_memory_used_bytes")
    assert used == 14 * GIB + 2 * rig.node.context_bytes + (256 << 20)
    assert rig.value("gpu_non_torch_memory_bytes") == 2 * rig.node.context_bytes + (256 << 20)
    assert rig.value("gpu_non_torch_memory_bytes", gpu=1) == 0.0


def test_fast_and_slow_cadence(rig):
    rig.nv.calls.clear()
    for _ in range(20):
        rig.poll(1.0)
    assert rig.nv.calls["nvmlDeviceGetPowerUsage"] == 40  # 2 GPUs x 20 reads
    assert rig.nv.calls["nvmlDeviceGetTotalEnergyConsumption"] == 4  # 2 GPUs x every 10 s
    assert rig.nv.calls["nvmlDeviceGetPcieReplayCounter"] == 4
    assert rig.value("gpu_energy_joules_total") is not None  # slow values stay between slow reads


def test_a_scrape_never_calls_nvml(rig):
    rig.nv.calls.clear()
    rig.node.inject_error("*", pynvml.NVML_ERROR_UNKNOWN)
    for _ in range(3):
        assert rig.value("gpu_power_watts") == 120.0
    assert sum(rig.nv.calls.values()) == 0


# --- one NVML call site at a time, every error kind ---
SITES = {  # field -> the NVML function it calls first
    "memory": "nvmlDeviceGetMemoryInfo",
    "power": "nvmlDeviceGetPowerUsage",
    "power_limit": "nvmlDeviceGetEnforcedPowerLimit",
    "utilization": "nvmlDeviceGetUtilizationRates",
    "temperature": "nvmlDeviceGetTemperatureV",
    "sm_clock": "nvmlDeviceGetClockInfo",
    "memory_clock": "nvmlDeviceGetClockInfo",
    "throttle": "nvmlDeviceGetCurrentClocksEventReasons",
    "recovery_action": "nvmlDeviceGetFieldValues",
    "energy": "nvmlDeviceGetTotalEnergyConsumption",
    "ecc": "nvmlDeviceGetTotalEccErrors",
    "remapped_rows": "nvmlDeviceGetRemappedRows",
    "pcie_replays": "nvmlDeviceGetPcieReplayCounter",
}
FAMILY = {  # field -> one family it fills
    "memory": "gpu_memory_used_bytes",
    "power": "gpu_power_watts",
    "power_limit": "gpu_power_limit_watts",
    "utilization": "gpu_utilization_ratio",
    "temperature": "gpu_temperature_celsius",
    "sm_clock": "gpu_sm_clock_hertz",
    "memory_clock": "gpu_memory_clock_hertz",
    "throttle": "gpu_clock_throttle",
    "recovery_action": "gpu_recovery_action",
    "energy": "gpu_energy_joules_total",
    "ecc": "gpu_ecc_errors_total",
    "remapped_rows": "gpu_remapped_rows",
    "pcie_replays": "gpu_pcie_replays_total",
}
FALLBACK = {"temperature", "throttle"}  # a deprecated twin under another name still answers
E = pynvml


def test_sites_cover_every_field():
    assert set(SITES) == {f.name for f in FIELDS}


@pytest.mark.parametrize("field", sorted(SITES))
@pytest.mark.parametrize("code", [E.NVML_ERROR_NOT_SUPPORTED, E.NVML_ERROR_NO_PERMISSION])
def test_unsupported_field_is_dropped_once_and_keeps_up(tmp_path, caplog, field, code):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = Rig(tmp_path)
    rig.node.inject_error(SITES[field], code, gpu=1)
    for _ in range(12):
        rig.poll(1.0)
    fam = FAMILY[field]
    if field in FALLBACK:
        assert rig.value(fam, gpu=1) is not None  # answered by the older call
    elif field == "memory_clock" or field == "sm_clock":
        assert rig.value(FAMILY["sm_clock"], gpu=1) is None and rig.value(FAMILY["memory_clock"], gpu=1) is None
    else:
        assert rig.value(fam, gpu=1) is None
    assert rig.value(fam, gpu=0) is not None  # the other GPU is untouched
    assert rig.nvml.health.up == 1 and rig.nvml.health.errors == 0
    assert rig.value("gpu_up", gpu=1) == 1.0
    # asked on GPU 1 once (each getter of the field that uses this function), then never again
    f = next(f for f in FIELDS if f.name == field)
    reads_gpu0 = 2 if f.slow else 12
    per_read = 2 if field == "ecc" else 1
    sharing = 2 if field in ("sm_clock", "memory_clock") else 1  # one function, two fields
    tries_gpu1 = 2 if field == "memory" else 1  # v2, then v1: the same function
    assert rig.nv.calls[SITES[field]] == sharing * (reads_gpu0 * per_read + tries_gpu1)
    logged = [r for r in caplog.records if "not asked again" in r.getMessage() and "GPU 1" in r.getMessage()]
    assert len(logged) == (0 if field in FALLBACK else sharing)


@pytest.mark.parametrize("field", sorted(SITES))
def test_gpu_is_lost_turns_gpu_up_and_collector_up_to_zero(tmp_path, field):
    rig = Rig(tmp_path)
    rig.node.inject_error(SITES[field], E.NVML_ERROR_GPU_IS_LOST, gpu=1)
    rig.poll(10.0)
    assert rig.value("gpu_up", gpu=1) == 0.0 and rig.value("gpu_up", gpu=0) == 1.0
    assert rig.value("gpu_power_watts", gpu=1) is None  # no stale readings for a lost GPU
    assert rig.value("gpu_info", gpu=1) == 1.0  # ... but its identity stays, for the alert's labels
    assert rig.nvml.health.up == 0 and rig.nvml.health.errors == 1
    assert [r.events for r in rig.ledger.counts() if r.uuid == rig.node.gpu(1).uuid and r.xid == "79"] == [1.0]


@pytest.mark.parametrize("field", sorted(SITES))
@pytest.mark.parametrize("code", [E.NVML_ERROR_TIMEOUT, E.NVML_ERROR_UNKNOWN])
def test_transient_errors_fail_the_read_and_recover(tmp_path, field, code):
    rig = Rig(tmp_path)
    rig.node.inject_error(SITES[field], code, gpu=0)
    rig.poll(10.0)
    assert rig.nvml.health.up == 0 and rig.nvml.health.errors == 1
    assert rig.value("gpu_up", gpu=0) == 1.0  # the GPU answers, one field did not
    if field not in ("sm_clock", "memory_clock"):
        assert rig.value(FAMILY[field], gpu=0) is None
    assert rig.value(FAMILY[field], gpu=1) is not None
    rig.node.clear_error()
    rig.poll(10.0)
    assert rig.nvml.health.up == 1 and rig.value(FAMILY[field], gpu=0) is not None


@pytest.mark.parametrize("field", sorted(SITES))
@pytest.mark.parametrize(
    "code", [E.NVML_ERROR_UNINITIALIZED, E.NVML_ERROR_DRIVER_NOT_LOADED, E.NVML_ERROR_LIBRARY_NOT_FOUND]
)
def test_nvml_gone_under_a_read_reinitialises_with_backoff(tmp_path, field, code):
    rig = Rig(tmp_path)
    rig.poll(0)
    generation = rig.session.generation
    rig.node.inject_error(SITES[field], code, gpu=0)
    rig.poll(10.0)
    assert rig.nvml.health.up == 0 and not rig.session.ready
    assert rig.value("gpu_up", gpu=0) == 0.0 and rig.value("gpu_up", gpu=1) == 0.0  # NVML stopped answering
    rig.node.clear_error()
    rig.poll(0.1)  # inside the back-off: no init yet
    assert not rig.session.ready
    rig.poll(2.0)
    assert rig.session.ready and rig.session.generation == generation + 1
    assert rig.nvml.health.up == 1 and rig.value("gpu_up", gpu=0) == 1.0


@pytest.mark.parametrize(
    "code",
    [
        E.NVML_ERROR_LIBRARY_NOT_FOUND,
        E.NVML_ERROR_DRIVER_NOT_LOADED,
        E.NVML_ERROR_NO_PERMISSION,
        E.NVML_ERROR_UNKNOWN,
        E.NVML_ERROR_TIMEOUT,
    ],
)
def test_init_failure_is_logged_once_and_retried_with_backoff(tmp_path, caplog, code):
    caplog.set_level(logging.INFO, "vramwatch")
    rig = Rig(tmp_path)
    if code == E.NVML_ERROR_LIBRARY_NOT_FOUND:
        rig.node.nvml_absent = "library_not_found"
    else:
        rig.node.inject_error("nvmlInit", code)
    attempts = []
    for _ in range(40):
        before = rig.session.init_failures
        rig.poll(1.0)
        if rig.session.init_failures > before:
            attempts.append(rig.clock.t)
    if code in (E.NVML_ERROR_LIBRARY_NOT_FOUND, E.NVML_ERROR_DRIVER_NOT_LOADED):  # a node without NVML
        assert rig.nvml.health.up == 1 and rig.procs.health.up == 1
        assert [f.name for f in rig.nvml.collect(rig.ctx()) if f.samples] == ["vramwatch_nvml_available"]
    else:  # a fault
        assert rig.nvml.health.up == 0 and rig.procs.health.up == 0
        assert rig.nvml.collect(rig.ctx()) == ()  # never worked: no device series at all
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert gaps[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]  # exponential back-off
    warned = [r for r in caplog.records if "NVML unavailable" in r.getMessage()]
    assert len(warned) == 1
    absent = code in (E.NVML_ERROR_LIBRARY_NOT_FOUND, E.NVML_ERROR_DRIVER_NOT_LOADED)
    assert warned[0].levelno == (logging.INFO if absent else logging.WARNING)
    rig.node.nvml_absent = ""
    rig.node.clear_error()
    for _ in range(61):
        rig.poll(1.0)
    assert rig.session.ready and rig.nvml.health.up == 1 and rig.value("gpu_up") == 1.0


def test_an_older_binding_without_a_function_or_keyword_falls_back(tmp_path):
    rig = Rig(tmp_path, count=1)
    fake = rig.nv.nv

    def memory_v1_only(h, version=None):
        if version is not None:
            raise TypeError("nvmlDeviceGetMemoryInfo() got an unexpected keyword argument 'version'")
        return SimNvml.nvmlDeviceGetMemoryInfo(fake, h)

    def no_such_function(*a):
        raise AttributeError("module 'pynvml' has no attribute 'nvmlDeviceGetTemperatureV'")

    fake.nvmlDeviceGetMemoryInfo = memory_v1_only
    fake.nvmlDeviceGetTemperatureV = no_such_function
    for _ in range(3):
        rig.poll(1.0)
    assert rig.nvml.health.up == 1
    assert rig.value("gpu_memory_used_bytes") is not None and rig.value("gpu_memory_reserved_bytes") is None
    assert rig.value("gpu_temperature_celsius") == 35.0


def test_missing_binding_is_an_unavailable_nvml_not_a_crash(tmp_path):
    settings = Settings(simulate=False, spool_dir=str(tmp_path))

    def loader(_s):
        raise ImportError("No module named 'pynvml'")

    session = nb.NvmlSession(settings, loader=loader)
    c = Runner(NvmlCollector(settings, session), settings)
    c.poll_once()
    assert c.health.up == 0 and c.snapshot is None and "nvidia-ml-py" in session.last_error


def test_lost_gpu_is_probed_on_the_slow_cadence_and_comes_back(rig):
    rig.node.gpu(1).lost = True
    rig.poll(1.0)
    assert rig.value("gpu_up", gpu=1) == 0.0
    rig.nv.calls.clear()
    rig.node.gpu(1).lost = False
    for _ in range(5):
        rig.poll(1.0)
    assert rig.value("gpu_up", gpu=1) == 0.0 and rig.nv.calls["nvmlDeviceGetHandleByUUID"] == 0
    for _ in range(6):
        rig.poll(1.0)
    assert rig.nv.calls["nvmlDeviceGetHandleByUUID"] == 1
    assert rig.value("gpu_up", gpu=1) == 1.0 and rig.value("gpu_power_watts", gpu=1) == 120.0
    assert rig.nvml.health.up == 1
    lost_xids = [r for r in rig.ledger.counts() if r.xid == "79" and r.events > 0]
    assert len(lost_xids) == 1  # one loss, one Xid 79


def test_mig_mode_is_labelled_not_a_crash(tmp_path):
    rig = Rig(tmp_path)
    rig.node.gpu(0).mig = True
    rig.poll(10.0)
    info = {lab["gpu"]: lab["mig_mode"] for lab, _ in rig.metrics()["gpu_info"]}
    assert info == {"0": "enabled", "1": "disabled"}
    assert (
        rig.value("gpu_utilization_ratio", gpu=0) is None
        and rig.value("gpu_remapped_rows", gpu=0, kind="pending") is None
    )
    assert rig.value("gpu_power_watts", gpu=0) == 120.0 and rig.nvml.health.up == 1


def test_mig_mode_unsupported_part(tmp_path):
    rig = Rig(tmp_path, count=1)
    rig.node.inject_error("nvmlDeviceGetMigMode", E.NVML_ERROR_NOT_SUPPORTED)
    rig.poll(0)
    assert rig.metrics()["gpu_info"][0][0]["mig_mode"] == "unsupported" and rig.nvml.health.up == 1


def test_job_mode_limits_to_the_ranks_gpus(tmp_path):
    rig = Rig(tmp_path, gpus="job")
    rig.poll(0)
    assert "gpu_info" not in {n for n, v in rig.metrics().items() if v}
    rig.rank(0, 300, 1, GIB)
    m = rig.metrics()
    assert {lab["gpu"] for lab, _ in m["gpu_info"]} == {"1"}
    assert {lab["gpu"] for lab, _ in m["gpu_foreign_processes"]} == {"1"}


def test_unidentifiable_gpu_is_skipped_then_found(tmp_path):
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetUUID", E.NVML_ERROR_UNKNOWN, gpu=1)
    rig.poll(0)
    assert {lab["gpu"] for lab, _ in rig.metrics()["gpu_info"]} == {"0"} and rig.nvml.health.up == 0
    rig.node.clear_error()
    rig.poll(10.0)
    assert {lab["gpu"] for lab, _ in rig.metrics()["gpu_info"]} == {"0", "1"} and rig.nvml.health.up == 1


# --- processes ---
def test_foreign_processes_exclude_the_ranks(rig):
    rig.rank(0, 501, 0, 8 * GIB)
    rig.rank(1, 502, 1, 8 * GIB)
    rig.node.add_foreign(0, 9999, 6 * GIB)
    rig.node.add_foreign(0, 9998, GIB)
    rig.poll(10.0)
    assert rig.value("gpu_foreign_processes", gpu=0) == 2
    assert rig.value("gpu_foreign_process_memory_bytes", gpu=0) == 7 * GIB
    assert rig.value("gpu_foreign_processes", gpu=1) == 0 and rig.procs.health.up == 1


def test_a_stranger_sized_like_a_rank_is_still_foreign(rig):
    # the rank's own process holds reserved + its context (527 MiB); the stranger is closer to the rank's
    # reserved bytes than that, so only the pid tells them apart (a guess by size would drop the stranger)
    rig.rank(0, 501, 0, 8 * GIB)
    rig.node.add_foreign(0, 9999, 8 * GIB + 100 * 2**20)
    rig.poll(10.0)
    assert rig.value("gpu_foreign_processes", gpu=0) == 1
    assert rig.value("gpu_foreign_process_memory_bytes", gpu=0) == 8 * GIB + 100 * 2**20


def test_foreign_fallback_when_pid_namespaces_differ():
    # NVML reports host pids 70001/70002 for the ranks (container pids 11, 12) plus one real stranger
    procs = ((70001, 8 * GIB + 527 * 2**20), (70002, 4 * GIB + 527 * 2**20), (70003, 3 * GIB))
    others = foreign(procs, {11, 12}, [8 * GIB, 4 * GIB])
    assert others == [(70003, 3 * GIB)]
    assert foreign(procs, {1}, []) == list(procs)  # no rank on this GPU, none of the pids a rank's: all foreign


def test_foreign_fallback_prefers_the_closest_process_at_or_above_the_reservation():
    # a process holds at least what its rank reserved: one exactly at it is the rank, not the one above
    assert foreign(((1, 8 * GIB), (2, 8 * GIB + 100 * 2**20)), {11}, [8 * GIB]) == [(2, 8 * GIB + 100 * 2**20)]
    # of those above, the closest; a closer one below (another job's) is not taken
    procs = ((1, 9 * GIB), (2, 4 * GIB + 527 * 2**20), (3, 4 * GIB - 2**20))
    assert foreign(procs, {11}, [4 * GIB]) == [(1, 9 * GIB), (3, 4 * GIB - 2**20)]
    # none above (NVML reporting less than the rank reserved): the closest below
    assert foreign(((1, 1 * GIB), (2, 7 * GIB)), {11}, [8 * GIB]) == [(1, 1 * GIB)]


def test_the_fallback_uses_each_ranks_reservation_on_that_gpu(rank_sample):
    uuid = "GPU-0"
    snap = (GpuProcesses(0, uuid, ((70001, 8 * GIB + 527 * 2**20), (70003, 3 * GIB))),)
    reserved = {"torch_cuda_memory_reserved_bytes": float(8 * GIB)}
    rank = rank_sample(0, hostname="h", pid=11, uuid=uuid, values=reserved)  # pid 11 in its container
    count, mem = process_families(snap, ScrapeContext((rank,), time.time(), "node-a"))
    assert [s.value for s in count.samples] == [1.0] and [s.value for s in mem.samples] == [3 * GIB]


def test_one_gpus_failure_leaves_the_others_listed(tmp_path):
    rig = Rig(tmp_path)
    rig.node.add_foreign(1, 9999, GIB)
    rig.node.inject_error("nvmlDeviceGetComputeRunningProcesses", E.NVML_ERROR_UNKNOWN, gpu=0)
    rig.poll(10.0)
    assert rig.value("gpu_foreign_processes", gpu=1) == 1 and rig.procs.health.up == 0
    rig.node.clear_error()
    rig.node.inject_error("nvmlDeviceGetComputeRunningProcesses", E.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    rig.poll(10.0)
    assert rig.value("gpu_foreign_processes", gpu=1) == 1 and rig.procs.health.up == 1


def test_a_lost_gpu_is_skipped_and_marks_the_read_failed(tmp_path):
    rig = Rig(tmp_path)
    rig.poll(0)
    rig.node.add_foreign(1, 9999, GIB)
    rig.node.gpu(0).lost = True
    rig.poll(10.0)  # the NVML collector finds GPU 0 lost; the process listing skips it from then on
    assert rig.value("gpu_foreign_processes", gpu=0) is None
    assert rig.value("gpu_foreign_processes", gpu=1) == 1 and rig.procs.health.up == 0


def test_unsupported_process_listing_is_logged_once_and_not_asked_again(tmp_path, caplog):
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetComputeRunningProcesses", E.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    with caplog.at_level(logging.INFO, logger="vramwatch"):
        for _ in range(3):
            rig.poll(10.0)
    assert rig.nv.calls["nvmlDeviceGetComputeRunningProcesses"] == 3 + 1  # GPU 0 each round, GPU 1 once
    (rec,) = [r for r in caplog.records if "compute processes are" in r.getMessage()]
    uuid = rig.node.gpu(1).uuid
    assert rec.levelno == logging.INFO
    assert rec.getMessage() == f"vramwatch: GPU 1 {uuid}: compute processes are NOT_SUPPORTED; not asked again"


def test_unsupported_is_remembered_per_gpu_until_nvml_is_reinitialised(tmp_path, caplog):
    rig = Rig(tmp_path)
    for gpu in (0, 1):
        rig.node.inject_error("nvmlDeviceGetComputeRunningProcesses", E.NVML_ERROR_NOT_SUPPORTED, gpu=gpu)
    with caplog.at_level(logging.INFO, logger="vramwatch"):
        rig.poll(10.0)
        rig.poll(10.0)
    assert len([r for r in caplog.records if "compute processes are" in r.getMessage()]) == 2  # one per GPU
    assert rig.nv.calls["nvmlDeviceGetComputeRunningProcesses"] == 2
    rig.session.mark_down(RuntimeError("driver reloaded"))  # a new NVML session may support it after all
    rig.node.clear_error()
    rig.poll(120.0)
    rig.poll(10.0)
    assert rig.nv.calls["nvmlDeviceGetComputeRunningProcesses"] > 2
    assert rig.value("gpu_foreign_processes", gpu=0) == 0 and rig.value("gpu_foreign_processes", gpu=1) == 0


def test_a_transient_listing_failure_is_logged_once_by_name(tmp_path, caplog):
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetComputeRunningProcesses", E.NVML_ERROR_TIMEOUT, gpu=1)
    with caplog.at_level(logging.INFO, logger="vramwatch"):
        for _ in range(3):
            rig.poll(10.0)
    recs = [r for r in caplog.records if "listing compute processes" in r.getMessage()]
    uuid = rig.node.gpu(1).uuid
    assert [(r.levelno, r.getMessage()) for r in recs] == [
        (logging.WARNING, f"vramwatch: GPU 1 {uuid}: listing compute processes failed (TIMEOUT)")
    ]


def test_a_quiet_listing_error_keeps_the_collector_up(tmp_path):
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetComputeRunningProcesses", E.NVML_ERROR_NO_DATA, gpu=1)
    rig.poll(10.0)
    assert rig.procs.health.up == 1 and rig.value("gpu_foreign_processes", gpu=0) == 0


def test_foreign_by_pid_never_guesses_by_size():
    procs = ((70001, 8 * GIB + 527 * 2**20), (70002, 4 * GIB + 527 * 2**20), (70003, 8 * GIB))
    # both ranks found by pid: the stranger closest in size to a rank stays foreign
    assert foreign(procs, {70001, 70002}, [8 * GIB, 4 * GIB]) == [(70003, 8 * GIB)]
    # one rank found by pid, the other not (it is elsewhere): nothing else is taken for a rank
    assert foreign(procs, {70001, 12}, [8 * GIB, 4 * GIB]) == [(70002, 4 * GIB + 527 * 2**20), (70003, 8 * GIB)]
    # a rank's pid is the job's on any GPU, also where it published no device (a stray context)
    assert foreign(procs, {70001}, []) == [(70002, 4 * GIB + 527 * 2**20), (70003, 8 * GIB)]


@pytest.mark.parametrize(
    "code,up",
    [
        (E.NVML_ERROR_NOT_SUPPORTED, 1),
        (E.NVML_ERROR_NO_PERMISSION, 1),
        (E.NVML_ERROR_TIMEOUT, 0),
        (E.NVML_ERROR_UNKNOWN, 0),
        (E.NVML_ERROR_GPU_IS_LOST, 0),
        (E.NVML_ERROR_UNINITIALIZED, 0),
    ],
)
def test_process_listing_errors(tmp_path, code, up):
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetComputeRunningProcesses", code, gpu=1)
    rig.poll(10.0)
    assert rig.procs.health.up == up
    assert rig.value("gpu_foreign_processes", gpu=1) is None
    if code != E.NVML_ERROR_UNINITIALIZED:
        assert rig.value("gpu_foreign_processes", gpu=0) == 0
    else:  # the session is down: nothing is listed until it is back
        assert rig.value("gpu_foreign_processes", gpu=0) is None


def test_each_read_publishes_power_and_free_memory_for_the_status_lines(tmp_path):
    r = Rig(tmp_path)
    r.node.gpu(0).power_w = 212.0
    r.node.gpu(1).lost = True
    r.poll(0)
    readings = spool.read_node(str(tmp_path)).gpus
    assert list(readings) == [r.node.gpu(0).uuid]  # a lost GPU publishes nothing
    (g,) = readings.values()
    assert g.power_watts == 212.0 and g.memory_free_bytes == r.value("gpu_memory_free_bytes")


# --- a node without NVML: a state, not a fault ---
ABSENT_MODES = {
    "library_not_found": E.NVML_ERROR_LIBRARY_NOT_FOUND,
    "driver_not_loaded": E.NVML_ERROR_DRIVER_NOT_LOADED,
    "no_devices": None,
}


@pytest.mark.parametrize("mode", sorted(ABSENT_MODES))
def test_a_node_without_nvml_says_why_and_keeps_every_collector_up(tmp_path, mode):
    rig = Rig(tmp_path)
    rig.node.nvml_absent = mode
    watcher = XidWatcher(rig.session, XidLedger(), rig.settings)
    for _ in range(3):
        rig.poll(1.0)
        watcher.step()
    assert rig.nvml.health.up == 1 and rig.procs.health.up == 1 and watcher.health.up == 1
    assert rig.nvml.health.errors == 0 and rig.procs.health.errors == 0
    m = rig.metrics()
    assert m["vramwatch_nvml_available"] == [({"reason": mode}, 0.0)]
    assert not m.get("gpu_info") and not m.get("gpu_up")  # no device series
    node = spool.read_node(str(tmp_path))
    assert node.nvml_absent == mode and node.gpus == {}  # the ranks' status line learns it
    # the driver arrives: init is retried with back-off and the node has NVML from then on
    rig.node.nvml_absent = ""
    for _ in range(70):
        rig.poll(1.0)
    assert rig.session.ready and rig.nvml.health.up == 1
    assert rig.metrics()["vramwatch_nvml_available"] == [({"reason": ""}, 1.0)]
    assert spool.read_node(str(tmp_path)).nvml_absent == ""


def test_nvml_that_answered_and_then_went_away_is_a_fault(tmp_path):
    """Once NVML showed GPUs, losing the library or driver is trouble (up 0), never 'absent'."""
    rig = Rig(tmp_path)
    rig.poll(0)
    rig.node.inject_error("nvmlDeviceGetPowerUsage", E.NVML_ERROR_DRIVER_NOT_LOADED)
    rig.poll(1.0)
    rig.node.clear_error()
    rig.node.nvml_absent = "driver_not_loaded"  # and re-init keeps failing that way
    for _ in range(5):
        rig.poll(1.0)
    assert not rig.session.ready and rig.session.absent_reason() == ""
    assert rig.nvml.health.up == 0 and rig.procs.health.up == 0
    assert rig.metrics()["vramwatch_nvml_available"] == [({"reason": ""}, 1.0)]  # the node has NVML
    assert rig.value("gpu_up", gpu=0) == 0.0  # the GPUs it knew read lost


def test_the_nvml_available_series_with_gpus(rig):
    assert rig.metrics()["vramwatch_nvml_available"] == [({"reason": ""}, 1.0)]


def test_the_real_nvml_on_a_machine_without_it_is_absent_not_failing(tmp_path):
    """nvidia-ml-py's own pynvml on this machine: it imports, and nvmlInit fails LIBRARY_NOT_FOUND."""
    settings = Settings(simulate=False, spool_dir=str(tmp_path))
    session = nb.NvmlSession(settings)
    c = Runner(NvmlCollector(settings, session), settings)
    c.poll_once()
    if session.ready:
        pytest.skip("this machine has NVML")
    assert session.absent_reason() == "library_not_found", session.last_error
    assert c.health.up == 1 and c.health.errors == 0
    (fam,) = [f for f in c.collect(ScrapeContext((), time.time(), "h")) if f.samples]
    assert [(s.name, s.labels, s.value) for s in fam.samples] == [
        ("vramwatch_nvml_available", {"reason": "library_not_found"}, 0.0)
    ]


# --- a GPU already lost when the server (re)starts ---
def _up_series(rig: Rig) -> dict[str, tuple[str, float]]:
    return {lab["gpu"]: (lab["uuid"], v) for lab, v in rig.metrics()["gpu_up"]}


def test_a_gpu_lost_before_a_restart_keeps_its_series_at_gpu_up_0(tmp_path):
    before = Rig(tmp_path)  # the previous server: it wrote who each GPU is into the spool
    before.poll(0)
    uuid1 = before.node.gpu(1).uuid
    for restart in range(2):  # and a restart of the restarted one, still lost, keeps it too
        rig = Rig(tmp_path)
        rig.node.gpu(1).lost = True  # every call on it, nvmlDeviceGetHandleByIndex included: GPU_IS_LOST
        rig.poll(0)
        assert _up_series(rig) == {"0": (rig.node.gpu(0).uuid, 1.0), "1": (uuid1, 0.0)}, restart
        info = {lab["gpu"]: lab for lab, _ in rig.metrics()["gpu_info"]}
        assert info["1"]["uuid"] == uuid1 and info["1"]["pci_bus_id"] == rig.node.gpu(1).pci_bus_id
        assert rig.value("gpu_power_watts", gpu=1) is None and rig.value("gpu_power_watts", gpu=0) is not None
        assert rig.nvml.health.up == 0  # a lost GPU is trouble
        assert uuid1 in rig.session.lost
        assert not [r for r in rig.ledger.counts() if r.xid == "79" and r.events > 0]  # lost before us
    rig.node.gpu(1).lost = False
    rig.poll(10.0)  # slow cadence: re-enumerated, found, read
    rig.poll(1.0)
    assert _up_series(rig) == {"0": (rig.node.gpu(0).uuid, 1.0), "1": (uuid1, 1.0)}
    assert rig.value("gpu_power_watts", gpu=1) is not None and rig.nvml.health.up == 1


def test_a_gpu_lost_at_first_start_is_shown_without_a_uuid(tmp_path):
    rig = Rig(tmp_path)
    rig.node.gpu(1).lost = True
    rig.poll(0)
    assert _up_series(rig) == {"0": (rig.node.gpu(0).uuid, 1.0), "1": ("", 0.0)}


def test_a_handle_that_answers_while_its_uuid_is_lost(tmp_path):
    """nvmlDeviceGetHandleByIndex succeeds, nvmlDeviceGetUUID says GPU_IS_LOST: the index and the PCI bus id
    the handle still gives, and the last known uuid."""
    Rig(tmp_path).poll(0)
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetUUID", E.NVML_ERROR_GPU_IS_LOST, gpu=1)
    rig.poll(0)
    assert _up_series(rig)["1"] == (rig.node.gpu(1).uuid, 0.0)
    info = {lab["gpu"]: lab for lab, _ in rig.metrics()["gpu_info"]}
    assert info["1"]["pci_bus_id"] == rig.node.gpu(1).pci_bus_id


def test_a_different_card_at_the_index_does_not_inherit_the_old_uuid(tmp_path):
    Rig(tmp_path).poll(0)
    rig = Rig(tmp_path)
    rig.node.gpu(1).pci_bus_id = "00000000:99:00.0"  # not the card the readings file knew at index 1
    rig.node.inject_error("nvmlDeviceGetUUID", E.NVML_ERROR_GPU_IS_LOST, gpu=1)
    rig.poll(0)
    assert _up_series(rig)["1"] == ("", 0.0)


# --- NVML's GPU recovery action (a field value) ---
def recovery(rig: Rig, gpu: int = 0) -> dict[str, float]:
    return {lab["action"]: v for lab, v in rig.metrics().get("gpu_recovery_action", []) if lab["gpu"] == str(gpu)}


def test_the_recovery_action_is_one_series_per_state_and_follows_the_driver(rig):
    from vramwatch.monitoring import contract

    assert recovery(rig) == {s: 1.0 if s == "none" else 0.0 for s in contract.RECOVERY_ACTIONS}
    rig.node.gpu(0).recovery_action = 4  # NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET
    rig.poll(1.0)  # the fast cadence: the next read, never the scrape
    assert recovery(rig)["drain_and_reset"] == 1.0 and recovery(rig)["none"] == 0.0
    assert sum(recovery(rig).values()) == 1.0
    assert recovery(rig, gpu=1)["none"] == 1.0


def test_a_driver_without_the_field_leaves_the_family_absent_and_up_1(tmp_path, caplog):
    caplog.set_level(logging.INFO, "vramwatch")
    rig = Rig(tmp_path)
    rig.node.gpu(1).recovery_action = None  # the field's own nvmlReturn is NOT_SUPPORTED
    for _ in range(3):
        rig.poll(1.0)
    assert recovery(rig, gpu=1) == {} and recovery(rig, gpu=0)["none"] == 1.0
    assert rig.nvml.health.up == 1
    assert len([r for r in caplog.records if "recovery_action is NOT_SUPPORTED" in r.getMessage()]) == 1
    assert rig.nv.calls["nvmlDeviceGetFieldValues"] == 3 + 1, "GPU 1 is not asked again"


class _FieldAnswers:
    """The simulated NVML with one field answer replaced (a driver older than the field, a newer state)."""

    def __init__(self, nv: Any, ret: int = 0, value: int = 0) -> None:
        self._nv, self.ret, self.value = nv, ret, value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nv, name)

    def nvmlDeviceGetFieldValues(self, h: Any, ids: list[Any]) -> list[Any]:
        (v,) = self._nv.nvmlDeviceGetFieldValues(h, ids)
        v.nvmlReturn, v.value.uiVal = self.ret, self.value
        return [v]


@pytest.mark.parametrize(
    "ret, value",
    [(E.NVML_ERROR_INVALID_ARGUMENT, 0), (0, 99)],
    ids=["older driver: invalid field id", "a state newer than the table"],
)
def test_an_unknown_field_or_state_is_dropped_never_mislabelled(tmp_path, ret, value):
    rig = Rig(tmp_path)
    rig.nv = rig.session.nv = _FieldAnswers(rig.nv, ret, value)
    rig.poll(1.0)
    rig.poll(1.0)
    assert recovery(rig) == {} and rig.nvml.health.up == 1
