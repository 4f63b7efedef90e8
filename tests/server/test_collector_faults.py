"""What each NVML-reading collector tells the operator when a call fails, on the simulated NVML.

The log line is the operator's only clue for a GPU that drops a family, so each fault's line is
checked as written: its level, the GPU it names, the error, and that it comes once per GPU and
error however many reads hit it (two GPUs failing alike give two lines).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from types import SimpleNamespace
from typing import Any

import pynvml as E
import pytest
from test_gpm_collector import GpmRig
from test_nvml_collector import Rig

from harness.nvml_calls import CountingNvml
from vramwatch import spool
from vramwatch.server.collectors import ScrapeContext
from vramwatch.server.collectors.gpm import GpmCollector
from vramwatch.server.collectors.nvlink import NvlinkCollector
from vramwatch.server.collectors.xid import LOST_REPEAT_S, XidCollector, XidLedger, XidWatcher
from vramwatch.sim.nvml import SimNvml
from vramwatch.sim.state import SimNode


def lines(caplog, part: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if part in r.getMessage()]


def err(code: int) -> E.NVMLError:
    return E.NVMLError(code)


# --- NVML device readings ---


def test_a_lost_gpu_is_logged_once_per_loss_with_its_probe_interval(tmp_path, caplog):
    caplog.set_level(logging.INFO, "vramwatch")
    rig = Rig(tmp_path)
    rig.poll(0)
    uuid = rig.node.gpu(1).uuid
    rig.node.gpu(1).lost = True
    for _ in range(25):  # lost across two probes
        rig.poll(1.0)
    assert lines(caplog, "is lost") == [
        (
            logging.ERROR,
            f"vramwatch: GPU 1 {uuid} is lost (GPU_IS_LOST: fallen off the bus or needs a reset); "
            "gpu_up is 0 and it is probed every 10 s",
        )
    ]
    assert rig.nv.calls["nvmlDeviceGetHandleByUUID"] == 2, "probed once per slow interval"
    assert rig.value("gpu_up", gpu=1) == 0.0 and uuid in rig.session.lost
    rig.node.gpu(1).lost = False
    for _ in range(10):
        rig.poll(1.0)
    assert lines(caplog, "answers again") == [(logging.WARNING, f"vramwatch: GPU 1 {uuid} answers again")]
    assert uuid not in rig.session.lost and rig.value("gpu_up", gpu=1) == 1.0


def test_nvml_going_away_during_a_probe_marks_the_session_down(tmp_path):
    rig = Rig(tmp_path)
    rig.poll(0)
    rig.node.gpu(1).lost = True
    rig.poll(1.0)
    rig.node.inject_error("nvmlDeviceGetHandleByUUID", E.NVML_ERROR_UNINITIALIZED)
    rig.poll(10.0)
    assert not rig.session.ready and rig.session.last_error == "UNINITIALIZED"


def test_the_gpu_temperature_sensor_is_asked(tmp_path):
    # the deprecated getter on a driver without the V one: the GPU sensor (0), not whatever comes first
    rig = Rig(tmp_path, count=1)
    fake = rig.nv.nv
    sensors: list[Any] = []

    def no_v(*a: Any) -> int:
        raise AttributeError("nvmlDeviceGetTemperatureV")

    def temperature(h: Any, sensor: Any) -> int:
        sensors.append(sensor)
        return SimNvml.nvmlDeviceGetTemperature(fake, h, sensor)

    fake.nvmlDeviceGetTemperatureV = no_v
    fake.nvmlDeviceGetTemperature = temperature
    rig.poll(1.0)
    assert sensors == [E.NVML_TEMPERATURE_GPU] and rig.value("gpu_temperature_celsius") == 35.0


def test_memory_on_an_older_driver_reports_total_used_and_free(tmp_path):
    rig = Rig(tmp_path, count=1)
    fake = rig.nv.nv

    def memory_v1_only(h: Any, version: Any = None) -> Any:
        if version is not None:
            raise err(E.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return SimNvml.nvmlDeviceGetMemoryInfo(fake, h)

    fake.nvmlDeviceGetMemoryInfo = memory_v1_only
    rig.poll(1.0)
    g = rig.node.gpu(0)
    total, used, free = (rig.value(f"gpu_memory_{k}_bytes") for k in ("total", "used", "free"))
    assert total == float(g.total_bytes) and used is not None and free is not None
    assert math.isclose(used + free, total, rel_tol=0.02)
    assert rig.value("gpu_memory_reserved_bytes") is None  # only v2 knows it
    assert rig.value("gpu_non_torch_memory_bytes") == used, "no rank here: all of the used memory is foreign"
    (reading,) = spool.read_node(str(tmp_path)).gpus.values()
    assert reading.memory_free_bytes == free  # the ranks' status line gets the v1 free memory too


@pytest.mark.parametrize(
    "code, level", [(E.NVML_ERROR_NOT_SUPPORTED, logging.INFO), (E.NVML_ERROR_NO_PERMISSION, logging.WARNING)]
)
def test_an_unsupported_field_is_logged_once_per_gpu_at_its_level(tmp_path, caplog, code, level):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetPowerUsage", code)
    for _ in range(3):
        rig.poll(1.0)
    name = {E.NVML_ERROR_NOT_SUPPORTED: "NOT_SUPPORTED", E.NVML_ERROR_NO_PERMISSION: "NO_PERMISSION"}[code]
    assert lines(caplog, "power is") == [
        (level, f"vramwatch: GPU {i} {rig.node.gpu(i).uuid}: power is {name}; not asked again until NVML re-inits")
        for i in (0, 1)
    ]


def test_a_transient_field_error_is_logged_once_per_gpu_and_error(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetPowerUsage", E.NVML_ERROR_UNKNOWN)
    for _ in range(3):
        rig.poll(1.0)
    rig.node.inject_error("nvmlDeviceGetPowerUsage", E.NVML_ERROR_TIMEOUT, gpu=0)
    rig.poll(1.0)
    got = lines(caplog, "reading power failed")
    assert [lvl for lvl, _ in got] == [logging.WARNING] * 3
    assert [m.split(": reading")[0] for _, m in got] == [
        f"vramwatch: GPU 0 {rig.node.gpu(0).uuid}",
        f"vramwatch: GPU 1 {rig.node.gpu(1).uuid}",
        f"vramwatch: GPU 0 {rig.node.gpu(0).uuid}",
    ]
    assert got[0][1].endswith("reading power failed (UNKNOWN: Unknown Error); retrying every read")
    assert "(TIMEOUT: " in got[2][1]
    assert rig.nvml.health.up == 0 and rig.nvml.health.errors == 4


def test_a_field_with_no_data_yet_is_quiet_and_keeps_up(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetPowerUsage", E.NVML_ERROR_NO_DATA, gpu=1)
    for _ in range(3):
        rig.poll(1.0)
    assert rig.nvml.health.up == 1 and rig.value("gpu_power_watts", gpu=1) is None
    assert lines(caplog, "has no data yet") == [(logging.DEBUG, "vramwatch: GPU 1: power has no data yet (NO_DATA)")]


def test_slow_fields_are_served_between_slow_reads_and_dropped_when_they_fail(tmp_path):
    rig = Rig(tmp_path)
    rig.poll(0)
    rig.node.gpu(0).energy_mj = 5_000_000
    rig.poll(1.0)  # a fast read: the energy of the last slow read
    assert rig.value("gpu_energy_joules_total") != 5000.0 and rig.value("gpu_energy_joules_total") is not None
    rig.node.inject_error("nvmlDeviceGetTotalEnergyConsumption", E.NVML_ERROR_UNKNOWN, gpu=0)
    rig.poll(10.0)  # the slow read fails: no stale value on the following fast reads
    rig.node.clear_error()
    rig.poll(1.0)
    assert rig.value("gpu_energy_joules_total") is None
    rig.poll(10.0)
    assert rig.value("gpu_energy_joules_total") == 5000.0


def test_gpus_known_before_nvml_went_away_keep_their_identity_labels(tmp_path):
    rig = Rig(tmp_path)
    rig.poll(0)
    before = {lab["gpu"]: lab for lab, _ in rig.metrics()["gpu_info"]}
    rig.node.inject_error("nvmlDeviceGetPowerUsage", E.NVML_ERROR_UNINITIALIZED)
    rig.poll(1.0)
    assert rig.value("gpu_up", gpu=0) == 0.0 and rig.value("gpu_up", gpu=1) == 0.0
    after = {lab["gpu"]: lab for lab, _ in rig.metrics()["gpu_info"]}
    assert after == before and before["0"]["driver_version"]  # the alert's labels do not change under it


def test_session_errors_in_a_read_bring_every_gpu_down_and_say_why(tmp_path):
    rig = Rig(tmp_path)
    rig.poll(0)
    rig.node.inject_error("nvmlDeviceGetPowerUsage", E.NVML_ERROR_DRIVER_NOT_LOADED, gpu=1)
    rig.poll(1.0)
    assert rig.session.last_error == "DRIVER_NOT_LOADED" and not rig.session.ready


# --- GPM ---


def _gpm_rig(tmp_path, **kw: Any) -> GpmRig:
    return GpmRig(tmp_path, **kw)


def test_gpm_unavailable_is_logged_per_gpu_and_the_other_gpu_still_reports(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = _gpm_rig(tmp_path, count=3)
    rig.node.gpu(0).gpm = False
    rig.node.gpu(1).gpm = False
    for _ in range(3):
        rig.poll(10)
    assert isinstance(rig.gpm.collector, GpmCollector)
    why = "nvmlGpmQueryDeviceSupport: isSupportedDevice=0"
    assert rig.gpm.collector.unavailable == {rig.node.gpu(0).uuid: why, rig.node.gpu(1).uuid: why}
    assert lines(caplog, "GPM is unavailable") == [
        (
            logging.INFO,
            f"vramwatch: GPU {i} {rig.node.gpu(i).uuid}: GPM is unavailable ({why}); the GPU activity families "
            "are absent for it, not asked again until NVML re-inits",
        )
        for i in (0, 1)
    ]
    assert rig.value("gpu_sm_activity_ratio", gpu=2) == 0.0 and rig.gpm.health.up == 1


def test_gpm_is_asked_again_after_nvml_reinitialises(tmp_path):
    rig = _gpm_rig(tmp_path)
    rig.node.gpu(0).gpm = False
    rig.poll(0)
    rig.node.gpu(0).gpm = True  # e.g. MIG turned off, which needs a GPU reset
    rig.poll(10)
    assert rig.value("gpu_sm_activity_ratio", gpu=0) is None
    rig.node.inject_error("nvmlDeviceGetPowerUsage", E.NVML_ERROR_UNINITIALIZED)
    rig.poll(1)
    rig.node.clear_error()
    for _ in range(3):
        rig.poll(10)
    assert rig.session.generation == 2 and rig.value("gpu_sm_activity_ratio", gpu=0) == 0.0


def test_a_support_answer_without_the_flag_is_no_gpm(tmp_path):
    rig = _gpm_rig(tmp_path, count=1)
    rig.nv.nv.nvmlGpmQueryDeviceSupport = lambda h: SimpleNamespace(version=1)  # an older struct
    rig.poll(10)
    assert rig.gpm.health.up == 1 and rig.gpm.collector.unavailable == {
        rig.node.gpu(0).uuid: "nvmlGpmQueryDeviceSupport: isSupportedDevice=0"
    }


def test_a_failed_second_buffer_frees_the_first(tmp_path):
    rig = _gpm_rig(tmp_path, count=1)
    fake = rig.nv.nv
    real = SimNvml.nvmlGpmSampleAlloc
    allocs = [0]

    def alloc() -> Any:
        allocs[0] += 1
        if allocs[0] == 2:
            raise err(E.NVML_ERROR_MEMORY)
        return real(fake)

    fake.nvmlGpmSampleAlloc = alloc
    rig.poll(10)
    assert rig.live == 0 and rig.gpm.health.up == 0


def test_a_lost_gpu_is_not_asked_for_gpm_and_not_reported_as_a_gpm_failure(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = _gpm_rig(tmp_path)
    rig.poll(0)
    rig.node.gpu(1).lost = True
    for _ in range(3):
        rig.poll(10)
    assert rig.gpm.health.up == 0 and rig.gpm.collector.last_failure == {}
    assert lines(caplog, "reading GPM failed") == []
    assert rig.value("gpu_sm_activity_ratio", gpu=0) == 0.0, "the GPU after a lost one still reports"


def test_gpm_read_failures_are_logged_once_per_gpu_and_prime_afresh(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = _gpm_rig(tmp_path)
    rig.poll(0)
    rig.poll(10)
    rig.node.inject_error("nvmlGpmSampleGet", E.NVML_ERROR_UNKNOWN)
    for _ in range(3):
        rig.poll(10)
    assert lines(caplog, "reading GPM failed") == [
        (logging.WARNING, f"vramwatch: GPU {i} {rig.node.gpu(i).uuid}: reading GPM failed (UNKNOWN (NVML error 999))")
        for i in (0, 1)
    ]
    rig.node.clear_error()
    rig.poll(10)
    assert rig.value("gpu_sm_activity_ratio", gpu=0) is None, "the first read after a failure only primes"
    rig.poll(10)
    assert rig.value("gpu_sm_activity_ratio", gpu=0) == 0.0


def test_a_non_nvml_error_in_gpm_is_named_by_its_type(tmp_path):
    rig = _gpm_rig(tmp_path, count=1)
    rig.poll(0)

    def broken(h: Any, sample: Any) -> Any:
        raise RuntimeError("binding bug")

    rig.nv.nv.nvmlGpmSampleGet = broken
    rig.poll(10)
    assert rig.gpm.collector.last_failure == {rig.node.gpu(0).uuid: "RuntimeError"}


def test_gpm_with_no_data_yet_is_quiet(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = _gpm_rig(tmp_path)
    rig.poll(0)
    rig.node.inject_error("nvmlGpmSampleGet", E.NVML_ERROR_NO_DATA, gpu=0)
    rig.poll(10)
    assert rig.gpm.health.up == 1 and rig.gpm.collector.last_failure == {}
    assert lines(caplog, "reading GPM failed") == []


def test_nvml_gone_under_gpm_marks_the_session_down_with_the_error(tmp_path):
    rig = _gpm_rig(tmp_path)
    rig.poll(0)
    rig.node.inject_error("nvmlGpmSampleGet", E.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
    rig.gpm.poll_once()
    assert not rig.session.ready and rig.session.last_error == "LIB_RM_VERSION_MISMATCH"


def test_gpm_metric_values_that_are_errors_or_not_rates_are_dropped(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = _gpm_rig(tmp_path, count=1)
    fake = rig.nv.nv
    real = SimNvml.nvmlGpmMetricsGet

    def metrics_get(req: Any) -> Any:
        out = real(fake, req)
        by_id = {m.metricId: m for m in req.metrics[: req.numMetrics]}
        by_id[2].nvmlReturn, by_id[2].value = E.NVML_ERROR_UNKNOWN, 50.0  # SM activity: an error with a value
        by_id[3].value = float("nan")  # occupancy: not a number
        by_id[5].value = -1.0  # tensor: negative
        by_id[10].nvmlReturn = E.NVML_ERROR_NOT_SUPPORTED  # DRAM: not on this GPU
        by_id[21].value = 100.0  # PCIe rx: 100 MiB/s
        return out

    fake.nvmlGpmMetricsGet = metrics_get
    rig.poll(10)
    rig.poll(10)
    m = rig.metrics()
    for gone in (
        "gpu_sm_activity_ratio",
        "gpu_sm_occupancy_ratio",
        "gpu_tensor_activity_ratio",
        "gpu_dram_bandwidth_utilization_ratio",
    ):
        assert gone not in m, gone
    assert rig.value("gpu_pcie_rx_bytes_per_second") == 100.0 * (1 << 20)
    assert lines(caplog, "GPM metric") == [
        (
            logging.INFO,
            f"vramwatch: GPU 0 {rig.node.gpu(0).uuid}: GPM metric 10 (gpu_dram_bandwidth_utilization_ratio) is "
            "NOT_SUPPORTED; not asked again until NVML re-inits",
        )
    ]


def test_gpm_in_job_mode_shows_only_the_ranks_gpus(tmp_path):
    rig = _gpm_rig(tmp_path, gpus="job")
    rig.rank(0, 300, 1, 1 << 30)
    rig.poll(0)
    rig.poll(10)
    m = rig.metrics()
    assert {lab["gpu"] for lab, _ in m["gpu_sm_activity_ratio"]} == {"1"}
    assert {lab["gpu"] for lab, _ in m["gpu_nvlink_errors_total"]} == {"1"}
    assert [lab["uuid"] for lab, _ in m["gpu_nvlink_errors_total"]] == [rig.node.gpu(1).uuid] * 3


# --- NVLink ---


def _states(rig: GpmRig, per_link) -> None:
    """Replace nvmlDeviceGetNvLinkState: ``per_link(gpu, link)`` returns a state or raises."""
    fake = rig.nv.nv

    def state(h: Any, link: int) -> int:
        fake._call("nvmlDeviceGetNvLinkState", h)
        return per_link(h.index, link)

    fake.nvmlDeviceGetNvLinkState = state


def test_a_link_that_is_not_supported_is_skipped_and_the_later_ones_found(tmp_path):
    rig = _gpm_rig(tmp_path, count=1)

    def per_link(gpu: int, link: int) -> int:
        if link == 3:
            raise err(E.NVML_ERROR_NOT_SUPPORTED)
        if link == 5:
            raise err(E.NVML_ERROR_UNKNOWN)
        if link >= 8:
            raise err(E.NVML_ERROR_INVALID_ARGUMENT)
        return 0 if link == 6 else 1

    _states(rig, per_link)
    rig.poll(10)
    assert rig.nvlink.collector._links[rig.node.gpu(0).uuid] == (0, 1, 2, 4, 7)
    assert rig.nvlink.health.up == 1


def test_a_gpu_whose_links_are_all_down_is_remembered_without_links(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = _gpm_rig(tmp_path)

    def per_link(gpu: int, link: int) -> int:
        if link >= 18:
            raise err(E.NVML_ERROR_INVALID_ARGUMENT)
        return 0 if gpu == 0 else 1

    _states(rig, per_link)
    for _ in range(3):
        rig.poll(10)
    assert isinstance(rig.nvlink.collector, NvlinkCollector)
    assert rig.nvlink.collector.unavailable == {rig.node.gpu(0).uuid: "no active link"}
    assert lines(caplog, "no NVLink error counters") == [
        (
            logging.INFO,
            f"vramwatch: GPU 0 {rig.node.gpu(0).uuid}: no NVLink error counters (no active link); "
            "not asked again until NVML re-inits",
        )
    ]
    assert rig.value("gpu_nvlink_errors_total", gpu=0) is None
    assert rig.value("gpu_nvlink_errors_total", gpu=1, type="replay") == 0.0


@pytest.mark.parametrize("code", [E.NVML_ERROR_GPU_IS_LOST, E.NVML_ERROR_UNINITIALIZED])
def test_a_gpu_lost_or_nvml_gone_while_links_are_found_is_not_remembered_as_without_nvlink(tmp_path, code):
    rig = _gpm_rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetNvLinkState", code, gpu=0)
    rig.nvlink.poll_once()
    assert rig.nvlink.health.up == 0 and rig.nvlink.collector.unavailable == {}
    if code == E.NVML_ERROR_UNINITIALIZED:
        assert not rig.session.ready and rig.session.last_error == "UNINITIALIZED"
    rig.node.clear_error()
    rig.clock.t += 100
    rig.poll(10)
    assert rig.value("gpu_nvlink_errors_total", gpu=0, type="replay") == 0.0


def test_nvlink_read_failures_are_logged_once_per_gpu(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = _gpm_rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetNvLinkErrorCounter", E.NVML_ERROR_UNKNOWN)
    for _ in range(3):
        rig.poll(10)
    assert lines(caplog, "reading NVLink errors failed") == [
        (logging.WARNING, f"vramwatch: GPU {i} {rig.node.gpu(i).uuid}: reading NVLink errors failed (UNKNOWN)")
        for i in (0, 1)
    ]
    assert rig.nvlink.health.up == 0 and rig.nvlink.health.errors == 3


def test_nvlink_quiet_errors_keep_the_collector_up(tmp_path):
    rig = _gpm_rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetNvLinkErrorCounter", E.NVML_ERROR_NOT_READY, gpu=0)
    rig.poll(10)
    assert rig.nvlink.health.up == 1 and rig.value("gpu_nvlink_errors_total", gpu=1, type="crc") == 0.0


def test_a_lost_gpu_is_skipped_and_the_next_one_still_read(tmp_path):
    rig = _gpm_rig(tmp_path)
    rig.poll(0)
    rig.node.gpu(0).lost = True
    rig.poll(10)
    assert rig.nvlink.health.up == 0
    assert rig.value("gpu_nvlink_errors_total", gpu=1, type="replay") == 0.0


def test_a_counter_the_gpu_lacks_is_logged_once_and_the_other_crc_counter_still_summed(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = _gpm_rig(tmp_path, count=1)
    g = rig.node.gpu(0)
    g.nvlink_links = 2
    g.nvlink_errors = {"0:2": 5, "0:3": 4, "1:3": 1, "0:0": 2}
    fake = rig.nv.nv

    def counter(h: Any, link: int, c: int) -> int:
        if c == 2:  # CRC flit not reported
            fake._call("nvmlDeviceGetNvLinkErrorCounter", h)
            raise err(E.NVML_ERROR_NOT_SUPPORTED)
        return SimNvml.nvmlDeviceGetNvLinkErrorCounter(fake, h, link, c)

    fake.nvmlDeviceGetNvLinkErrorCounter = counter
    for _ in range(3):
        rig.poll(10)
    assert rig.value("gpu_nvlink_errors_total", type="crc") == 5.0  # data CRC of both links
    assert rig.value("gpu_nvlink_errors_total", type="replay") == 2.0
    assert lines(caplog, "NVLink error counter") == [
        (
            logging.INFO,
            f"vramwatch: GPU 0 {g.uuid}: NVLink error counter 2 is not reported; not asked again until NVML re-inits",
        )
    ]


def test_a_binding_without_the_max_links_constant_tries_eighteen_links(tmp_path):
    class Older(CountingNvml):
        def __getattr__(self, name: str) -> Any:
            if name == "NVML_NVLINK_MAX_LINKS":
                raise AttributeError(name)
            return super().__getattr__(name)

    rig = _gpm_rig(tmp_path, count=1)
    rig.nv.__class__ = Older
    rig.node.gpu(0).nvlink_links = 30
    rig.poll(10)
    assert rig.nvlink.collector._links[rig.node.gpu(0).uuid] == tuple(range(18))


# --- Xid watcher ---


def make(tmp_path, count: int = 2):
    node = SimNode.default(count)
    settings_kw = dict(simulate=True, spool_dir=str(tmp_path))
    from vramwatch.config import Settings
    from vramwatch.server import nvml_backend as nb

    settings = Settings(**settings_kw)
    session = nb.NvmlSession(settings, module=SimNvml.from_node(node))
    ledger = XidLedger()
    return node, session, ledger, XidWatcher(session, ledger, settings, wait_ms=50)


def xids(ledger: XidLedger, uuid: str) -> dict[str, tuple[int, float]]:
    return {r.xid: (r.gpu, r.events) for r in ledger.counts() if r.uuid == uuid}


def test_a_loss_right_after_a_real_xid_79_is_that_event_and_a_later_one_counts_again(tmp_path, caplog):
    caplog.set_level(logging.INFO, "vramwatch")
    node, session, ledger, w = make(tmp_path)
    w.step()
    session.ensure()
    d1 = session.devices[1]
    ledger.record(1, d1.uuid, 79, when=time.time() - 5.0)  # the event came 5 s ago
    session.set_lost(d1.uuid, True)
    assert xids(ledger, d1.uuid)["79"] == (1, 1.0)
    session.set_lost(d1.uuid, False)
    ledger.record(1, d1.uuid, 79, when=time.time() - LOST_REPEAT_S - 5.0)  # an older event is another loss
    session.set_lost(d1.uuid, True)
    assert xids(ledger, d1.uuid)["79"] == (1, 3.0)
    d0 = session.devices[0]
    session.set_lost(d0.uuid, True)  # GPU 0 never had an Xid 79: its loss counts
    assert xids(ledger, d0.uuid)["79"] == (0, 1.0)
    got = lines(caplog, "[GPU_IS_LOST]")
    assert got == [
        (
            logging.ERROR,
            f"vramwatch: Xid 79 (GPU has fallen off the bus; action restart_bm) on GPU 1 {d1.uuid} [GPU_IS_LOST]: "
            "no rank of this job",
        ),
        (
            logging.ERROR,
            f"vramwatch: Xid 79 (GPU has fallen off the bus; action restart_bm) on GPU 0 {d0.uuid} [GPU_IS_LOST]: "
            "no rank of this job",
        ),
    ]


def test_the_loss_of_a_gpu_that_offers_no_xid_events_is_counted_on_its_index(tmp_path):
    node, session, ledger, w = make(tmp_path)
    node.inject_error("nvmlDeviceRegisterEvents", E.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    w.step()
    d1 = session.devices[1]
    session.set_lost(d1.uuid, True)
    assert xids(ledger, d1.uuid) == {"79": (1, 1.0)}


def test_the_loss_line_names_the_ranks_on_that_gpu(tmp_path, caplog, rank_sample):
    caplog.set_level(logging.INFO, "vramwatch")
    node, session, ledger, other = make(tmp_path)
    other.close()  # the collector's own watcher only
    xc = XidCollector(session.settings, session, wait_ms=50)
    pub = spool.RankPublisher(str(tmp_path), 2)
    try:
        pub.publish(rank_sample(2, world_size=4, hostname="h", uuid=node.gpu(1).uuid))
        xc.watcher.step()
        session.set_lost(session.devices[1].uuid, True)
    finally:
        pub.close()
    (line,) = lines(caplog, "[GPU_IS_LOST]")
    assert line[1].endswith("[GPU_IS_LOST]: rank 2 (last step 0)")
    assert xc.read(None) == xc.watcher.ledger.counts()  # type: ignore[arg-type]


def test_a_closed_watcher_no_longer_counts_losses(tmp_path):
    node, session, ledger, w = make(tmp_path)
    w.step()
    w.close()
    session.set_lost(session.devices[0].uuid, True)
    assert xids(ledger, session.devices[0].uuid)["79"] == (0, 0.0)


def test_the_log_line_lookup_never_removes_a_dead_ranks_file(tmp_path, rank_sample):
    node, session, ledger, w = make(tmp_path)
    pub = spool.RankPublisher(str(tmp_path), 0)
    pub.publish(rank_sample(0))
    pub.close()  # the rank is gone; its final sample is the scrape path's to serve and reap
    before = sorted(os.listdir(tmp_path))
    w.step()
    node.inject_xid(0, 13)
    w.step()
    assert sorted(os.listdir(tmp_path)) == before


def test_an_event_from_a_gpu_that_cannot_be_named(tmp_path, caplog):
    caplog.set_level(logging.INFO, "vramwatch")
    node, session, ledger, w = make(tmp_path)
    w.step()
    node.inject_error("nvmlDeviceGetUUID", E.NVML_ERROR_GPU_IS_LOST, gpu=1)
    node.inject_xid(1, 79)
    w.step()
    assert lines(caplog, "could not name") == [(logging.ERROR, "vramwatch: Xid 79 on a GPU NVML could not name")]
    assert w.events == 1 and all(r.events == 0 for r in ledger.counts())


def test_with_one_gpu_watched_an_unnamed_event_is_that_gpus(tmp_path):
    node, session, ledger, w = make(tmp_path, count=1)
    w.step()
    node.inject_error("nvmlDeviceGetUUID", E.NVML_ERROR_GPU_IS_LOST)
    node.inject_xid(0, 48)
    w.step()
    assert xids(ledger, node.gpu(0).uuid)["48"] == (0, 1.0)


def test_an_event_without_its_data_counts_as_xid_999(tmp_path):
    node, session, ledger, w = make(tmp_path, count=1)
    w.step()
    real = session.nv.nvmlEventSetWait

    def wait(es: Any, ms: int) -> Any:
        data = real(es, ms)
        return SimpleNamespace(device=data.device, eventType=data.eventType)

    session.nv.nvmlEventSetWait = wait
    node.inject_xid(0, 31)
    w.step()
    assert xids(ledger, node.gpu(0).uuid)["999"] == (0, 1.0)


@pytest.mark.parametrize("code, level", [(E.NVML_ERROR_UNKNOWN, logging.WARNING)])
def test_watcher_failures_are_logged_once_per_place_and_error(tmp_path, caplog, code, level):
    caplog.set_level(logging.DEBUG, "vramwatch")
    node, session, ledger, w = make(tmp_path)
    w.step()
    node.inject_error("nvmlEventSetWait", code)
    for _ in range(3):
        w.step()
    node.clear_error()
    node.inject_error("nvmlDeviceRegisterEvents", code, gpu=0)
    w.step()
    node.inject_error("nvmlEventSetWait", E.NVML_ERROR_UNINITIALIZED)
    node.clear_error("nvmlDeviceRegisterEvents", gpu=0)
    w.step()
    w.step()
    assert lines(caplog, "Xid watcher") == [
        (level, "vramwatch: Xid watcher wait failed (UNKNOWN: Unknown Error); retrying with back-off"),
        (level, "vramwatch: Xid watcher register failed (UNKNOWN: Unknown Error); retrying with back-off"),
        (level, "vramwatch: Xid watcher wait failed (UNINITIALIZED: Uninitialized); retrying with back-off"),
    ]
    assert session.last_error == "UNINITIALIZED"


def test_families_skip_the_timestamp_of_an_xid_never_seen(tmp_path):
    from vramwatch.server.collectors.xid import xid_families

    ledger = XidLedger()
    ledger.preinit(0, "GPU-a", (13,))
    ledger.record(0, "GPU-a", 79, when=1.5)
    _, last = xid_families(ledger.counts(), ScrapeContext((), 0.0, "h"))
    assert [(s.labels["xid"], s.value) for s in last.samples] == [("79", 1.5)]


def test_registration_says_which_gpus_are_watched_and_why_the_others_are_not(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    node, session, ledger, w = make(tmp_path, count=4)
    real = session.nv.nvmlDeviceGetSupportedEventTypes

    def supported(h: Any) -> int:
        return 0 if h.index == 0 else real(h)  # GPU 0 offers no Xid event at all

    session.nv.nvmlDeviceGetSupportedEventTypes = supported
    node.inject_error("nvmlDeviceRegisterEvents", E.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    node.inject_error("nvmlDeviceRegisterEvents", E.NVML_ERROR_GPU_IS_LOST, gpu=2)
    for _ in range(2):
        w.step()
        session.set_lost(node.gpu(3).uuid, True)  # re-registers: each line still comes once
        w.step()
        session.set_lost(node.gpu(3).uuid, False)
    w.step()
    u = [g.uuid for g in node.gpus]
    assert lines(caplog, "not watched") == [
        (logging.INFO, f"vramwatch: GPU 0 {u[0]} offers no Xid events; not watched"),
        (logging.INFO, f"vramwatch: Xid events on GPU 1 {u[1]}: NOT_SUPPORTED; not watched"),
        (logging.INFO, f"vramwatch: Xid events on GPU 2 {u[2]}: GPU_IS_LOST; not watched"),
    ]
    assert set(lines(caplog, "watching Xid")) == {(logging.INFO, "vramwatch: watching Xid events on 1 GPU(s)")}
    assert w.registered == {u[3]: 3} and sorted({r.uuid for r in ledger.counts()}) == [u[3]]
    assert w.health.up == 1 and w.health.errors == 0


def test_the_xid_collector_in_job_mode_shows_only_the_ranks_gpus(tmp_path, rank_sample):
    node, session, ledger, other = make(tmp_path)
    other.close()
    from vramwatch.config import Settings

    settings = Settings(simulate=True, spool_dir=str(tmp_path), gpus="job")
    xc = XidCollector(settings, session, wait_ms=50)
    xc.watcher.step()
    sample = rank_sample(0, pid=1, time=0.0, uuid=node.gpu(1).uuid)
    total, _ = xc.families(xc.read(None), ScrapeContext((sample,), 0.0, "h"))  # type: ignore[arg-type]
    assert {s.labels["gpu"] for s in total.samples} == {"1"}
    assert xc.watcher.wait_ms == 50


def test_the_event_line_names_the_catalogue_meaning_and_action_and_several_ranks():
    from vramwatch.server.collectors.xid import describe_event

    assert describe_event(2, "GPU-x", 150, [("0", 5), ("1", 6)]) == (
        "vramwatch: Xid 150 (NVLINK: MSE Error; action workflow_nvlink5_err) on GPU 2 GPU-x: "
        "rank 0 (last step 5), rank 1 (last step 6)"
    )
    assert describe_event(0, "GPU-y", 13, []) == (
        "vramwatch: Xid 13 (Graphics Engine Exception; action restart_app) on GPU 0 GPU-y: no rank of this job"
    )
    assert (
        describe_event(0, "GPU-y", 999, []) == "vramwatch: Xid 999 (action unknown) on GPU 0 GPU-y: no rank of this job"
    )


def test_a_warning_xid_logs_a_warning_and_a_critical_one_an_error(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    from vramwatch.config import Settings
    from vramwatch.server.collectors.xid import log_event

    settings = Settings(simulate=True, spool_dir=str(tmp_path))
    log_event(settings, 0, "GPU-a", 31)
    log_event(settings, 0, "GPU-a", 48)
    assert lines(caplog, "GPU-a") == [
        (
            logging.WARNING,
            "vramwatch: Xid 31 (GPU memory page fault; action restart_app) on GPU 0 GPU-a: no rank of this job",
        ),
        (
            logging.ERROR,
            "vramwatch: Xid 48 (Double Bit ECC Error; action workflow_xid_48) on GPU 0 GPU-a: no rank of this job",
        ),
    ]


def test_after_an_event_the_watcher_waits_again_at_once_and_a_later_failure_backs_off_from_the_start(tmp_path):
    node, session, ledger, w = make(tmp_path, count=1)
    w.step()
    node.inject_xid(0, 13)
    assert w.step() == 0.0, "the next wait starts at once: events may come in bursts"
    node.inject_error("nvmlEventSetWait", E.NVML_ERROR_UNKNOWN)
    assert [w.step() for _ in range(2)] == [1.0, 2.0]


def test_only_xid_events_are_counted(tmp_path):
    node, session, ledger, w = make(tmp_path, count=1)
    w.step()
    real = session.nv.nvmlEventSetWait
    shapes = iter([dict(eventType=0x1), dict()])  # a single-bit ECC event, then one without a type

    def wait(es: Any, ms: int) -> Any:
        data = real(es, ms)
        return SimpleNamespace(device=data.device, eventData=data.eventData, **next(shapes))

    session.nv.nvmlEventSetWait = wait
    for _ in range(2):
        node.inject_xid(0, 31)
        assert w.step() == 0.0
    assert w.events == 0 and xids(ledger, node.gpu(0).uuid)["31"] == (0, 0.0) and w.health.up == 1


def test_while_nvml_is_down_the_watcher_retries_between_half_a_second_and_five(tmp_path):
    from vramwatch.config import Settings
    from vramwatch.server import nvml_backend as nb

    node = SimNode.default(1)
    clock = [1000.0]
    settings = Settings(simulate=True, spool_dir=str(tmp_path))
    session = nb.NvmlSession(settings, module=SimNvml.from_node(node), clock=lambda: clock[0])
    w = XidWatcher(session, XidLedger(), settings, wait_ms=50)
    node.inject_error("nvmlInit", E.NVML_ERROR_UNKNOWN)
    pauses = []
    for _ in range(8):
        pauses.append(w.step())
        clock[0] += pauses[-1]
    assert pauses[0] == 1.0 and pauses[-1] == 5.0 and all(0.5 <= p <= 5.0 for p in pauses)
    clock[0] += 0.9 * session.next_try_in()
    assert w.step() == 0.5, "never a busy loop just before the next try"


def test_the_watcher_frees_its_event_set_on_close_and_on_re_registration(tmp_path):
    node = SimNode.default(2)
    from vramwatch.config import Settings
    from vramwatch.server import nvml_backend as nb

    settings = Settings(simulate=True, spool_dir=str(tmp_path))
    nv = CountingNvml(SimNvml.from_node(node))
    session = nb.NvmlSession(settings, module=nv)
    w = XidWatcher(session, XidLedger(), settings, wait_ms=50)
    w.step()
    assert nv.calls["nvmlEventSetFree"] == 0
    session.set_lost(node.gpu(1).uuid, True)
    w.step()
    assert nv.calls["nvmlEventSetCreate"] == 2 and nv.calls["nvmlEventSetFree"] == 1
    w.close()
    w.close()
    assert nv.calls["nvmlEventSetFree"] == 2, "once per set"


def test_every_event_set_the_watcher_created_is_freed(tmp_path):
    node, session, ledger, w = make(tmp_path)
    made: list[Any] = []
    real = session.nv.nvmlEventSetCreate

    def create() -> Any:
        made.append(real())
        return made[-1]

    session.nv.nvmlEventSetCreate = create
    w.step()
    session.set_lost(node.gpu(0).uuid, True)  # GPU 0, not the last: GPU 1 must stay watched
    w.step()
    assert list(w.registered) == [node.gpu(1).uuid]
    w.close()
    assert len(made) == 2 and all(es.freed for es in made)


def test_each_gpu_without_xid_events_is_logged(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    node, session, ledger, w = make(tmp_path)
    session.nv.nvmlDeviceGetSupportedEventTypes = lambda h: 0
    w.step()
    assert [m for _, m in lines(caplog, "offers no Xid events")] == [
        f"vramwatch: GPU {i} {node.gpu(i).uuid} offers no Xid events; not watched" for i in (0, 1)
    ]


def test_the_ledger_bounds_preinitialised_xids_and_stamps_events_with_now():
    ledger = XidLedger(max_per_gpu=3)
    ledger.preinit(0, "GPU-a", (1, 2, 3, 4, 5))
    assert sorted(r.xid for r in ledger.counts()) == ["1", "2", "3"]
    t0 = time.time()
    ledger.record(0, "GPU-a", 2)
    assert t0 <= ledger.last("GPU-a", 2) <= time.time() and ledger.last("GPU-a", 3) == 0.0


def test_nvlink_is_asked_again_after_nvml_reinitialises(tmp_path):
    rig = _gpm_rig(tmp_path)
    rig.node.gpu(0).nvlink_links = 0
    rig.poll(10)
    assert rig.node.gpu(0).uuid in rig.nvlink.collector.unavailable
    rig.node.gpu(0).nvlink_links = 4  # e.g. a fabric manager that came up late
    rig.node.inject_error("nvmlDeviceGetPowerUsage", E.NVML_ERROR_UNINITIALIZED)
    rig.poll(1)
    rig.node.clear_error()
    for _ in range(3):
        rig.poll(10)
    assert rig.session.generation == 2 and rig.nvlink.collector.unavailable == {}
    assert rig.value("gpu_nvlink_errors_total", gpu=0, type="replay") == 0.0


def test_a_lost_gpu_is_not_asked_for_nvlink_and_not_reported_as_a_failure(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = _gpm_rig(tmp_path)
    rig.poll(0)
    rig.node.gpu(1).lost = True
    for _ in range(3):
        rig.poll(10)
    assert rig.nvlink.health.up == 0 and lines(caplog, "reading NVLink errors failed") == []


def test_two_different_gpm_errors_on_one_gpu_are_two_lines(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = _gpm_rig(tmp_path, count=1)
    rig.poll(0)
    for code in (E.NVML_ERROR_UNKNOWN, E.NVML_ERROR_TIMEOUT, E.NVML_ERROR_UNKNOWN):
        rig.node.inject_error("nvmlGpmSampleGet", code)
        rig.poll(10)
    got = [m.rsplit("(", 2)[-2] for _, m in lines(caplog, "reading GPM failed")]
    assert got == ["UNKNOWN ", "TIMEOUT "]


def test_nvml_is_asked_for_the_gpu_sensor_the_clocks_and_the_volatile_ecc_counts(tmp_path):
    rig = Rig(tmp_path, count=1)
    fake = rig.nv.nv
    asked: list[tuple[str, tuple[Any, ...]]] = []
    for name in ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetClockInfo", "nvmlDeviceGetTotalEccErrors"):
        real = getattr(SimNvml, name)

        def wrapped(h: Any, *args: Any, _real: Any = real, _name: str = name) -> Any:
            asked.append((_name, args))
            return _real(fake, h, *args)

        setattr(fake, name, wrapped)
    rig.poll(10.0)
    assert sorted(asked) == sorted(
        [
            ("nvmlDeviceGetTemperatureV", (E.NVML_TEMPERATURE_GPU,)),
            ("nvmlDeviceGetClockInfo", (E.NVML_CLOCK_SM,)),
            ("nvmlDeviceGetClockInfo", (E.NVML_CLOCK_MEM,)),
            ("nvmlDeviceGetTotalEccErrors", (E.NVML_MEMORY_ERROR_TYPE_CORRECTED, E.NVML_VOLATILE_ECC)),
            ("nvmlDeviceGetTotalEccErrors", (E.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, E.NVML_VOLATILE_ECC)),
        ]
    )


def test_while_a_gpu_is_lost_every_read_is_fresh_for_the_others_and_down_for_it(tmp_path):
    rig = Rig(tmp_path)
    rig.poll(0)
    rig.node.gpu(1).lost = True
    for i in range(25):  # across probes that fail
        rig.node.gpu(0).power_w = 100.0 + i
        rig.poll(1.0)
        assert rig.nvml.health.up == 0, i
        assert rig.value("gpu_up", gpu=1) == 0.0, i
        assert rig.value("gpu_power_watts", gpu=0) == 100.0 + i, i
    assert rig.nvml.health.errors == 25
    rig.node.gpu(1).lost = False
    for _ in range(10):
        rig.poll(1.0)
        if rig.value("gpu_up", gpu=1) == 1.0:
            break
    # back: everything read at once, the slow fields too (not the values from before the loss)
    assert rig.value("gpu_power_watts", gpu=1) is not None


def test_a_gpu_that_comes_back_between_slow_reads_reports_its_slow_fields_at_once(tmp_path):
    rig = Rig(tmp_path)
    rig.poll(0)  # a slow read at t; the next at t + 10
    rig.node.gpu(1).energy_mj = 1_000_000
    rig.node.gpu(1).lost = True
    rig.poll(1.0)  # lost at t + 1: probed again at t + 11, between slow reads
    rig.node.gpu(1).lost = False
    rig.node.gpu(1).energy_mj = 7_000_000
    for _ in range(10):
        rig.poll(1.0)
        if rig.value("gpu_up", gpu=1) == 1.0:
            break
    assert rig.value("gpu_energy_joules_total", gpu=1) == 7000.0


def test_a_reinit_clears_the_loss_of_a_gpu_that_answers_for_every_collector(tmp_path):
    rig = Rig(tmp_path)
    rig.poll(0)
    uuid = rig.node.gpu(1).uuid
    rig.node.gpu(1).lost = True
    rig.poll(1.0)
    assert uuid in rig.session.lost
    rig.node.gpu(1).lost = False
    rig.node.inject_error("nvmlDeviceGetPowerUsage", E.NVML_ERROR_UNINITIALIZED, gpu=0)
    rig.poll(1.0)  # NVML went away before the probe came
    rig.node.clear_error()
    rig.poll(2.0)
    assert rig.session.generation == 2 and uuid not in rig.session.lost
    assert rig.value("gpu_up", gpu=1) == 1.0 and rig.value("gpu_foreign_processes", gpu=1) is not None


def test_the_identity_kept_for_a_later_server_names_the_card(tmp_path):
    rig = Rig(tmp_path)
    rig.poll(0)
    later = Rig(tmp_path)
    later.node.gpu(1).lost = True
    later.poll(0)
    info = {lab["gpu"]: lab for lab, _ in later.metrics()["gpu_info"]}
    assert info["1"]["name"] == rig.node.gpu(1).name


def test_quiet_fields_are_logged_once_per_gpu(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "vramwatch")
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetPowerUsage", E.NVML_ERROR_NO_DATA)
    rig.poll(1.0)
    rig.poll(1.0)
    assert [m for _, m in lines(caplog, "has no data yet")] == [
        "vramwatch: GPU 0: power has no data yet (NO_DATA)",
        "vramwatch: GPU 1: power has no data yet (NO_DATA)",
    ]


def test_non_torch_memory_with_a_rank_that_reports_no_reservation_and_a_long_hostname(tmp_path):
    rig = Rig(tmp_path)
    rig.rank(0, 300, 0, 0)
    devices = (
        spool.DeviceSample(0, rig.node.gpu(0).uuid, {}),  # no reserved bytes in its sample
        spool.DeviceSample(1, "", {"torch_cuda_memory_reserved_bytes": 5.0}),  # a device NVML cannot name
    )
    rig.samples[0] = dataclasses.replace(rig.samples[0], devices=devices)
    rig.poll(1.0)
    used = rig.value("gpu_memory_used_bytes", gpu=0)
    assert used is not None and rig.value("gpu_non_torch_memory_bytes", gpu=0) == used
    assert rig.nvml.health.errors == 0
    ctx = ScrapeContext((), time.time(), "h" * 300)
    from vramwatch.server.collectors.nvml import nvml_families

    info = [s for f in nvml_families(rig.nvml.snapshot, ctx) for s in f.samples if s.name == "gpu_info"]
    assert len(info) == 2 and {s.labels["hostname"] for s in info} == {"h" * 128}


# --- foreign processes ---


def test_a_gpu_that_cannot_list_processes_does_not_stop_the_next_ones(tmp_path):
    rig = Rig(tmp_path)
    rig.node.inject_error("nvmlDeviceGetComputeRunningProcesses", E.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    rig.node.add_foreign(1, 4242, 1 << 30)
    for _ in range(3):  # GPU 0 is remembered as unsupported from the second read on
        rig.poll(10.0)
        assert rig.value("gpu_foreign_processes", gpu=1) == 1.0 and rig.value("gpu_foreign_processes", gpu=0) is None


def test_nvml_gone_under_the_process_listing_marks_the_session_down_with_the_error(tmp_path):
    rig = Rig(tmp_path)
    rig.poll(0)
    rig.node.inject_error("nvmlDeviceGetComputeRunningProcesses", E.NVML_ERROR_DRIVER_NOT_LOADED, gpu=0)
    rig.procs.poll_once()
    assert not rig.session.ready and rig.session.last_error == "DRIVER_NOT_LOADED" and rig.procs.health.up == 0
