"""MIG: the server's enumeration of MIG instances and their memory, on the simulated NVML."""

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
from vramwatch.server.collectors.nvml import NvmlCollector
from vramwatch.server.mig import profile_of
from vramwatch.sim.nvml import SimNvml
from vramwatch.sim.state import SimNode
from vramwatch.spool import HeartbeatSnapshot, RankSample

GIB = 1 << 30
E = pynvml


class MigRig:
    """Two simulated GPUs; GPU 0 in MIG mode with two 3g.71gb instances, on a fake clock."""

    def __init__(self, tmp_path: Any, mig: bool = True, **settings: Any) -> None:
        self.node = SimNode.default(2)
        if mig:
            self.node.gpu(0).enable_mig(("3g.71gb", "3g.71gb"))
        self.samples: list[RankSample] = []
        self.nv = CountingNvml(SimNvml.from_node(self.node, lambda: self.samples))
        self.t = 1000.0
        kw = dict(simulate=True, spool_dir=str(tmp_path), nvml_interval=1.0, nvml_slow_interval=10.0)
        kw.update(settings)
        self.settings = Settings(**kw)
        self.session = nb.NvmlSession(self.settings, module=self.nv, clock=lambda: self.t)
        self.nvml = Runner(NvmlCollector(self.settings, self.session), self.settings, clock=lambda: self.t)

    def poll(self, advance: float = 1.0) -> None:
        self.t += advance
        self.nvml.poll_once()

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for fam in self.nvml.collect(ScrapeContext(tuple(self.samples), time.time(), "node-a")):
            for s in fam.samples:
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
        return out

    def mig(self, name: str) -> dict[str, float]:
        return {lab["uuid"]: v for lab, v in self.metrics().get(name, [])}

    def rank_on(self, uuid: str, reserved: int, pid: int = 4100) -> None:
        values = {"torch_cuda_memory_reserved_bytes": float(reserved)}
        self.samples.append(
            rank_sample(0, hostname="h", pid=pid, uuid=uuid, values=values, heartbeat=HeartbeatSnapshot(steps=1))
        )


def test_instances_are_enumerated_with_their_parent_ids_and_profile(tmp_path):
    rig = MigRig(tmp_path)
    rig.poll(0)
    a, b = rig.node.gpu(0).mig_instances
    info = sorted((lab for lab, v in rig.metrics()["gpu_mig_info"] if v == 1.0), key=lambda lab: lab["uuid"])
    assert info == [
        {
            "gpu": "0",
            "uuid": m.uuid,
            "parent_uuid": rig.node.gpu(0).uuid,
            "gpu_instance_id": str(m.gpu_instance_id),
            "compute_instance_id": "0",
            "profile": "3g.71gb",
        }
        for m in (a, b)
    ]
    assert all(lab["uuid"].startswith("MIG-") for lab in info)
    assert rig.mig("gpu_mig_memory_total_bytes") == {a.uuid: 71 * GIB, b.uuid: 71 * GIB}
    assert rig.nvml.health.up == 1
    # the families and their labels are the contract's
    for name in ("gpu_mig_info", "gpu_mig_memory_total_bytes", "gpu_mig_memory_used_bytes"):
        for lab, _ in rig.metrics()[name]:
            assert tuple(lab) == contract.spec(name).labels


def test_instance_memory_is_its_own_and_follows_the_rank_on_it(tmp_path):
    rig = MigRig(tmp_path)
    a, b = rig.node.gpu(0).mig_instances
    rig.rank_on(a.uuid, 20 * GIB)
    b.extra_used_bytes = 3 * GIB
    rig.poll(0)
    used, free = rig.mig("gpu_mig_memory_used_bytes"), rig.mig("gpu_mig_memory_free_bytes")
    assert used[a.uuid] == 20 * GIB + rig.node.context_bytes
    assert used[b.uuid] == 3 * GIB
    assert free[a.uuid] == 71 * GIB - used[a.uuid]  # the instance's total, not the card's 140 GiB
    # the rank's reservation counts on its card too: not "outside PyTorch" there
    non_torch = {lab["gpu"]: v for lab, v in rig.metrics()["gpu_non_torch_memory_bytes"]}
    assert non_torch["0"] < 20 * GIB


def test_the_ranks_status_line_gets_its_instances_free_memory(tmp_path):
    rig = MigRig(tmp_path)
    a, _ = rig.node.gpu(0).mig_instances
    rig.rank_on(a.uuid, 10 * GIB)
    rig.poll(0)
    readings = spool.read_node(str(tmp_path)).gpus
    mine = readings[a.uuid]
    assert mine.memory_free_bytes == 71 * GIB - 10 * GIB - rig.node.context_bytes
    assert mine.power_watts == rig.node.gpu(0).power_w  # the card's: an instance has no power reading


def test_a_card_without_mig_changes_nothing_and_asks_once_per_slow_read(tmp_path):
    rig = MigRig(tmp_path, mig=False)
    rig.poll(0)
    rig.nv.calls.clear()
    for _ in range(20):
        rig.poll(1.0)
    ctx = ScrapeContext((), time.time(), "node-a")
    assert not [f.name for f in rig.nvml.collect(ctx) if f.name.startswith("gpu_mig_")]  # not even HELP lines
    assert rig.nv.calls["nvmlDeviceGetMigMode"] == 4  # 2 GPUs x every 10 s
    assert rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 0
    assert rig.nv.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == 0
    assert {lab["mig_mode"] for lab, _ in rig.metrics()["gpu_info"]} == {"disabled"}


def test_enumeration_is_slow_memory_is_fast(tmp_path):
    rig = MigRig(tmp_path)
    rig.poll(0)
    rig.nv.calls.clear()
    for _ in range(20):
        rig.poll(1.0)
    assert rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 2  # GPU 0, every 10 s
    assert rig.nv.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == 2 * 7  # every slot of an H200
    mig_memory = rig.nv.calls["nvmlDeviceGetMemoryInfo"] - 2 * 20  # minus the two cards' own reads
    assert mig_memory == 2 * 20  # two instances, every read


def test_a_new_instance_shows_within_a_slow_read_and_a_destroyed_one_at_once(tmp_path):
    rig = MigRig(tmp_path)
    rig.poll(0)
    g = rig.node.gpu(0)
    first = g.mig_instances[0].uuid
    del g.mig_instances[1:]  # destroyed: its handle now fails
    rig.poll(1.0)
    rig.poll(1.0)  # re-enumerated on the read after the failure
    assert set(rig.mig("gpu_mig_memory_total_bytes")) == {first}
    assert rig.nvml.health.up == 1
    g.enable_mig(("1g.18gb", "1g.18gb", "2g.35gb"))
    rig.poll(10.0)
    assert sorted(lab["profile"] for lab, _ in rig.metrics()["gpu_mig_info"]) == ["1g.18gb", "1g.18gb", "2g.35gb"]


def test_unsupported_enumeration_is_remembered_until_nvml_reinits(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vramwatch")
    rig = MigRig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetMaxMigDeviceCount", E.NVML_ERROR_NOT_SUPPORTED)
    rig.poll(0)
    for _ in range(3):
        rig.poll(10.0)
    assert rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 1
    assert not rig.metrics().get("gpu_mig_info") and rig.nvml.health.up == 1
    assert sum("MIG devices cannot be enumerated" in r.getMessage() for r in caplog.records) == 1


def test_unsupported_instance_memory_is_remembered(tmp_path):
    rig = MigRig(tmp_path)
    rig.poll(0)
    real = rig.nv.nv.nvmlDeviceGetMemoryInfo

    def memory(h: Any, version: Any = None) -> Any:
        if getattr(h, "mig", -1) >= 0:
            raise E.NVMLError(E.NVML_ERROR_NOT_SUPPORTED)
        return real(h, version) if version else real(h)

    rig.nv.nv.nvmlDeviceGetMemoryInfo = memory
    rig.nv.calls.clear()
    for _ in range(5):
        rig.poll(1.0)
    assert rig.nv.calls["nvmlDeviceGetMemoryInfo"] == 2 * 5 + 2  # the cards every read, each instance once
    assert not rig.metrics().get("gpu_mig_memory_total_bytes") and rig.nvml.health.up == 1
    assert len(rig.metrics()["gpu_mig_info"]) == 2  # the instances are still named


@pytest.mark.parametrize("code", [E.NVML_ERROR_UNKNOWN, E.NVML_ERROR_TIMEOUT])
def test_a_transient_enumeration_failure_fails_the_read_and_recovers(tmp_path, code):
    rig = MigRig(tmp_path)
    rig.poll(0)
    rig.node.inject_error("nvmlDeviceGetMigDeviceHandleByIndex", code)
    rig.poll(10.0)
    assert rig.nvml.health.up == 0
    assert len(rig.mig("gpu_mig_memory_total_bytes")) == 2  # a failed enumeration keeps what was there
    rig.node.inject_error("nvmlDeviceGetMaxMigDeviceCount", code)
    rig.poll(10.0)
    assert rig.nvml.health.up == 0 and len(rig.mig("gpu_mig_memory_total_bytes")) == 2
    rig.node.clear_error()
    rig.poll(10.0)
    assert rig.nvml.health.up == 1 and len(rig.mig("gpu_mig_memory_total_bytes")) == 2


def test_nvml_gone_under_the_mig_read_reinitialises(tmp_path):
    rig = MigRig(tmp_path)
    rig.poll(0)
    rig.node.inject_error("nvmlDeviceGetMigDeviceHandleByIndex", E.NVML_ERROR_UNINITIALIZED)
    rig.poll(10.0)
    assert rig.nvml.health.up == 0 and not rig.session.ready
    rig.node.clear_error()
    for _ in range(5):
        rig.poll(10.0)
    assert rig.session.ready and len(rig.mig("gpu_mig_memory_total_bytes")) == 2


def test_a_lost_card_drops_its_instances(tmp_path):
    rig = MigRig(tmp_path)
    rig.poll(0)
    rig.node.gpu(0).lost = True
    rig.poll(1.0)
    assert not rig.metrics().get("gpu_mig_memory_total_bytes")


def test_job_mode_keeps_the_ranks_instance_and_its_card(tmp_path):
    rig = MigRig(tmp_path, gpus="job")
    a, b = rig.node.gpu(0).mig_instances
    rig.rank_on(a.uuid, GIB)
    rig.poll(0)
    assert set(rig.mig("gpu_mig_memory_used_bytes")) == {a.uuid}
    assert {lab["gpu"] for lab, _ in rig.metrics()["gpu_info"]} == {"0"}  # the parent joins too


def test_profile_from_the_name():
    assert profile_of("NVIDIA H100 80GB HBM3 MIG 1g.10gb") == "1g.10gb"
    assert profile_of("NVIDIA H100 NVL MIG 1g.12gb+me") == "1g.12gb+me"
    assert profile_of("NVIDIA H200") == "" and profile_of("MIG 1g.10gb") == ""


def test_the_simulated_nvml_answers_mig_handles_as_the_notes_say():
    node = SimNode.default(1)
    a, b = node.gpu(0).enable_mig(("3g.71gb", "4g.71gb"))
    nv = SimNvml.from_node(node)
    nv.nvmlInit()
    card = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMigMode(card) == [1, 1] and nv.nvmlDeviceGetMaxMigDeviceCount(card) == 7
    h = nv.nvmlDeviceGetMigDeviceHandleByIndex(card, 1)
    assert nv.nvmlDeviceGetUUID(h) == b.uuid and nv.nvmlDeviceGetHandleByUUID(b.uuid) == h  # MIG-aware lookup
    assert (nv.nvmlDeviceGetGpuInstanceId(h), nv.nvmlDeviceGetComputeInstanceId(h)) == (2, 0)
    assert nv.nvmlDeviceGetName(h).endswith(" MIG 4g.71gb")
    assert nv.nvmlDeviceGetMemoryInfo(h).total == 71 * GIB
    for call in (nv.nvmlDeviceGetPowerUsage, nv.nvmlDeviceGetUtilizationRates, nv.nvmlDeviceGetRemappedRows):
        with pytest.raises(E.NVMLError_NotSupported):
            call(h)
    with pytest.raises(E.NVMLError_NotFound):
        nv.nvmlDeviceGetMigDeviceHandleByIndex(card, 2)  # an empty slot
    with pytest.raises(E.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetGpuInstanceId(card)  # not a MIG handle
    del node.gpu(0).mig_instances[1]
    with pytest.raises(E.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetMemoryInfo(h)  # destroyed: the handle is invalid


def _mig_memory_fails(rig: MigRig, code: int) -> None:
    real = rig.nv.nv.nvmlDeviceGetMemoryInfo

    def memory(h: Any, version: Any = None) -> Any:
        if getattr(h, "mig", -1) >= 0:
            raise E.NVMLError(code)
        return real(h, version) if version else real(h)

    rig.nv.nv.nvmlDeviceGetMemoryInfo = memory


def test_a_transient_instance_memory_failure_fails_the_read_keeps_the_instances_and_logs_once(tmp_path, caplog):
    rig = MigRig(tmp_path)
    rig.poll(0)
    real = rig.nv.nv.nvmlDeviceGetMemoryInfo
    _mig_memory_fails(rig, E.NVML_ERROR_UNKNOWN)
    for _ in range(3):
        rig.poll(1.0)
        assert rig.nvml.health.up == 0
        assert len(rig.metrics()["gpu_mig_info"]) == 2 and not rig.mig("gpu_mig_memory_total_bytes")
    a, b = rig.node.gpu(0).mig_instances
    lines = [r.getMessage() for r in caplog.records if "MIG" in r.getMessage()]
    assert sorted(lines) == sorted(f"vramwatch: GPU 0 MIG {m.uuid}: reading memory failed (UNKNOWN)" for m in (a, b))
    rig.nv.nv.nvmlDeviceGetMemoryInfo = real
    rig.poll(1.0)
    assert rig.nvml.health.up == 1 and len(rig.mig("gpu_mig_memory_total_bytes")) == 2


def test_an_instance_gone_under_its_memory_read_is_left_out_and_looked_for_at_once(tmp_path):
    rig = MigRig(tmp_path)
    rig.poll(0)
    real = rig.nv.nv.nvmlDeviceGetMemoryInfo
    _mig_memory_fails(rig, E.NVML_ERROR_NOT_FOUND)
    rig.nv.calls.clear()
    rig.poll(1.0)  # a fast read: memory only
    assert rig.nvml.health.up == 1 and not rig.metrics().get("gpu_mig_info")
    assert rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 0
    rig.nv.nv.nvmlDeviceGetMemoryInfo = real
    rig.poll(1.0)  # the next fast read enumerates again, not the next slow one
    assert rig.nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 1
    assert len(rig.mig("gpu_mig_memory_total_bytes")) == 2


def test_an_instance_id_nvml_cannot_give_leaves_its_label_empty(tmp_path):
    rig = MigRig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetGpuInstanceId", E.NVML_ERROR_NOT_SUPPORTED)
    rig.poll(0)
    info = [lab for lab, _ in rig.metrics()["gpu_mig_info"]]
    assert len(info) == 2 and {lab["gpu_instance_id"] for lab in info} == {""}
    assert {lab["profile"] for lab in info} == {"3g.71gb"}


def test_nvml_gone_under_an_instance_id_read_reinitialises(tmp_path):
    rig = MigRig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetComputeInstanceId", E.NVML_ERROR_UNINITIALIZED)
    rig.poll(0)
    assert rig.nvml.health.up == 0 and not rig.session.ready


def test_unsupported_instance_memory_is_logged_once_per_instance_at_info(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vramwatch")
    rig = MigRig(tmp_path)
    rig.poll(0)
    _mig_memory_fails(rig, E.NVML_ERROR_NOT_SUPPORTED)
    for _ in range(3):
        rig.poll(1.0)
    a, b = rig.node.gpu(0).mig_instances
    got = sorted((r.levelno, r.getMessage()) for r in caplog.records if " MIG " in r.getMessage())
    assert got == sorted(
        (logging.INFO, f"vramwatch: GPU 0 MIG {m.uuid}: memory is NOT_SUPPORTED; not asked again until NVML re-inits")
        for m in (a, b)
    )


def test_nvml_gone_under_an_instance_memory_read_reinitialises(tmp_path):
    rig = MigRig(tmp_path)
    rig.poll(0)
    _mig_memory_fails(rig, E.NVML_ERROR_UNINITIALIZED)
    rig.poll(1.0)
    assert rig.nvml.health.up == 0 and not rig.session.ready


def test_a_mig_card_after_one_without_mig_is_enumerated(tmp_path):
    rig = MigRig(tmp_path, mig=False)
    rig.node.gpu(1).enable_mig(("3g.71gb", "3g.71gb"))
    rig.poll(0)
    info = [lab for lab, _ in rig.metrics()["gpu_mig_info"]]
    assert {lab["gpu"] for lab in info} == {"1"} and len(info) == 2
