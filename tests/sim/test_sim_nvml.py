"""The simulated NVML: pynvml's names, NVML's units and error codes, events, driven by SimNode."""

from __future__ import annotations

import inspect
import time

import pynvml
import pytest
from samples import rank_sample

from vramwatch.sim.nvml import SimHandle, SimNvml
from vramwatch.sim.state import MIB, SimNode, edit, state_path
from vramwatch.spool import RankSample

GIB = 1 << 30


def sample_on(rank: int, pid: int, uuid: str, reserved: int) -> RankSample:
    values = {"torch_cuda_memory_reserved_bytes": float(reserved)}
    return rank_sample(rank, hostname="h", pid=pid, uuid=uuid, values=values)


@pytest.fixture
def node() -> SimNode:
    return SimNode.default(2)


@pytest.fixture
def nv(node):
    fake = SimNvml.from_node(node)
    fake.nvmlInit()
    return fake


def test_every_fake_function_is_a_pynvml_function():
    names = [n for n, v in inspect.getmembers(SimNvml) if n.startswith("nvml") and callable(v)]
    assert len(names) > 25
    for name in names:
        assert callable(getattr(pynvml, name, None)), f"pynvml has no {name}"


def test_constants_are_pynvmls_and_unknown_functions_are_absent(nv):
    assert nv.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert nv.nvmlMemory_v2 == pynvml.nvmlMemory_v2
    assert nv.NVMLError is pynvml.NVMLError
    with pytest.raises(AttributeError):
        nv.nvmlDeviceGetFanSpeed  # noqa: B018 - not faked: a typo must not pass silently


def test_readings_in_nvml_units(node, nv):
    g = node.gpu(1)
    g.power_w, g.power_limit_w, g.energy_mj = 123.456, 650.0, 5_000_000
    g.utilization, g.memory_utilization, g.temperature_c = 0.97, 0.41, 71.6
    g.sm_clock_mhz, g.memory_clock_mhz, g.throttle_mask = 1755, 2619, 0x24
    g.ecc_corrected, g.ecc_uncorrected, g.remapped, g.pcie_replays = 3, 1, [2, 0, 1, 0], 9
    h = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetPowerUsage(h) == 123456  # mW
    assert nv.nvmlDeviceGetEnforcedPowerLimit(h) == 650000
    assert nv.nvmlDeviceGetTotalEnergyConsumption(h) == 5_000_000  # mJ
    u = nv.nvmlDeviceGetUtilizationRates(h)
    assert (u.gpu, u.memory) == (97, 41)  # percent
    assert nv.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU) == 72
    assert nv.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 72
    assert nv.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1755
    assert nv.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM) == 2619
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h) == 0x24
    assert nv.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC) == 3
    assert nv.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC) == 1
    assert nv.nvmlDeviceGetRemappedRows(h) == (2, 0, 1, 0)
    assert nv.nvmlDeviceGetPcieReplayCounter(h) == 9
    assert nv.nvmlDeviceGetUUID(h) == g.uuid and h.index == 1
    assert nv.nvmlDeviceGetPciInfo(h).busId == g.pci_bus_id.encode()  # bytes, as the ctypes struct gives
    assert nv.nvmlDeviceGetHandleByUUID(g.uuid) == h
    assert nv.nvmlSystemGetDriverVersion() == node.driver_version
    assert nv.nvmlDeviceGetCount() == 2


def test_processes_and_memory_come_from_rank_samples_and_foreign(node):
    uuid = node.gpu(0).uuid
    samples = [sample_on(0, 1111, uuid, 10 * GIB), sample_on(1, 2222, node.gpu(1).uuid, 3 * GIB)]
    node.add_foreign(0, 4242, 6 * GIB)
    node.gpu(0).extra_used_bytes = 100 * MIB
    nv = SimNvml.from_node(node, lambda: samples)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    procs = {p.pid: p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}
    assert procs == {1111: 10 * GIB + node.context_bytes, 4242: 6 * GIB}
    v1 = nv.nvmlDeviceGetMemoryInfo(h)
    v2 = nv.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    g = node.gpu(0)
    assert v1.used == sum(procs.values()) + g.extra_used_bytes + g.driver_reserved_bytes
    assert v1.total == v1.used + v1.free == g.total_bytes
    assert v2.reserved == g.driver_reserved_bytes and v2.used == v1.used - v2.reserved  # as measured on an H200
    assert v2.total == v2.used + v2.reserved + v2.free


CODES = [
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_GPU_IS_LOST,
    pynvml.NVML_ERROR_TIMEOUT,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_UNKNOWN,
    pynvml.NVML_ERROR_UNINITIALIZED,
]


@pytest.mark.parametrize("code", CODES)
def test_injected_errors_are_real_nvml_errors(node, nv, code):
    node.inject_error("nvmlDeviceGetPowerUsage", code, gpu=1)
    h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetPowerUsage(h0) == 120000  # the other GPU is untouched
    with pytest.raises(pynvml.NVMLError) as exc:
        nv.nvmlDeviceGetPowerUsage(h1)
    assert exc.value.value == code
    assert isinstance(exc.value, pynvml.nvmlExceptionClass(code))
    assert nv.nvmlDeviceGetTemperatureV(h1, 0) == 35  # other calls are untouched
    node.clear_error("nvmlDeviceGetPowerUsage", gpu=1)
    assert nv.nvmlDeviceGetPowerUsage(h1) == 120000


def test_error_keys_most_specific_first(node, nv):
    h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    node.inject_error("*", pynvml.NVML_ERROR_UNKNOWN, gpu=1)
    with pytest.raises(pynvml.NVMLError_Unknown):
        nv.nvmlDeviceGetUUID(h1)
    assert nv.nvmlDeviceGetUUID(h0)
    node.inject_error("nvmlDeviceGetUUID", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetUUID(h1)
    node.clear_error()
    node.inject_error("*", pynvml.NVML_ERROR_TIMEOUT)
    assert nv.nvmlDeviceGetCount() == 2  # "*" is for per-device calls only
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlDeviceGetUUID(h0)


def test_lost_gpu_raises_gpu_is_lost_on_every_device_call(node, nv):
    h = nv.nvmlDeviceGetHandleByIndex(0)
    node.gpu(0).lost = True
    for call in (
        lambda: nv.nvmlDeviceGetPowerUsage(h),
        lambda: nv.nvmlDeviceGetMemoryInfo(h),
        lambda: nv.nvmlDeviceGetUUID(h),
        lambda: nv.nvmlDeviceGetHandleByIndex(0),
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert nv.nvmlDeviceGetPowerUsage(nv.nvmlDeviceGetHandleByIndex(1)) == 120000


def test_library_missing_and_uninitialised(node):
    nv = SimNvml.from_node(node)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()  # before nvmlInit
    node.nvml_absent = "library_not_found"
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        nv.nvmlInit()
    node.nvml_absent = ""
    node.inject_error("nvmlInit", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        nv.nvmlInit()
    node.clear_error()
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 2


def test_mig_parent_has_no_utilisation_or_remapped_rows(node, nv):
    node.gpu(0).mig = True
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
    for call in (nv.nvmlDeviceGetUtilizationRates, nv.nvmlDeviceGetRemappedRows):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(h)
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(1)) == [0, 0]


def test_event_set_delivers_xids_injected_after_registration_once(node, nv):
    node.inject_xid(0, 13)  # before registration: never delivered
    es = nv.nvmlEventSetCreate()
    for i in (0, 1):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        assert nv.nvmlDeviceGetSupportedEventTypes(h) & pynvml.nvmlEventTypeXidCriticalError
        nv.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    node.inject_xid(1, 79)
    node.inject_xid(0, 48)
    got = []
    for _ in range(2):
        d = nv.nvmlEventSetWait(es, 500)
        got.append((d.device.index, d.eventData, d.eventType))
    assert got == [(1, 79, pynvml.nvmlEventTypeXidCriticalError), (0, 48, pynvml.nvmlEventTypeXidCriticalError)]
    t0 = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlEventSetWait(es, 150)
    assert 0.1 < time.monotonic() - t0 < 1.5
    nv.nvmlEventSetFree(es)
    with pytest.raises(pynvml.NVMLError):
        nv.nvmlEventSetWait(es, 10)


def test_event_wait_errors_can_be_injected(node, nv):
    es = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(SimHandle(0), pynvml.nvmlEventTypeXidCriticalError, es)
    node.inject_error("nvmlEventSetWait", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(pynvml.NVMLError_Unknown):
        nv.nvmlEventSetWait(es, 100)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceRegisterEvents(SimHandle(0), 1 << 40, es)  # an event type the GPU does not offer


def test_file_backed_fake_sees_what_a_driver_saves(tmp_path):
    spool = str(tmp_path)
    SimNode.default(1).save(state_path(spool))
    nv = SimNvml.from_spool(spool)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetPowerUsage(h) == 120000
    with edit(spool) as n:
        n.gpu(0).power_w = 95.5
        n.gpu(0).tick(2.0)  # energy follows the draw
    assert nv.nvmlDeviceGetPowerUsage(h) == 95500
    assert nv.nvmlDeviceGetTotalEnergyConsumption(h) == 191000
    es = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    with edit(spool) as n:
        n.inject_xid(0, 31)
    assert nv.nvmlEventSetWait(es, 1000).eventData == 31


def test_state_round_trips_and_keeps_the_xid_sequence(tmp_path):
    node = SimNode.default(1)
    for _ in range(300):
        node.inject_xid(0, 63)
    assert len(node.xids) == 256 and node.xids[-1]["seq"] == 300 == node.xid_seq
    path = state_path(str(tmp_path))
    node.save(path)
    again = SimNode.load(path)
    again.inject_xid(0, 64)
    assert again.xids[-1]["seq"] == 301


def _gpm_pair(nv, index):
    h = nv.nvmlDeviceGetHandleByIndex(index)
    a, b = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
    nv.nvmlGpmSampleGet(h, a)
    nv.nvmlGpmSampleGet(h, b)
    return a, b


def _gpm_get(nv, a, b, ids):
    req = nv.c_nvmlGpmMetricsGet_t()
    req.version, req.numMetrics, req.sample1, req.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, len(ids), a, b
    for i, mid in enumerate(ids):
        req.metrics[i].metricId = mid
    nv.nvmlGpmMetricsGet(req)
    return [(m.nvmlReturn, m.value) for m in req.metrics[: len(ids)]]


def test_gpm_in_nvml_units_between_two_samples(node, nv):
    g = node.gpu(1)
    g.sm_activity, g.dram_bandwidth_utilization, g.pcie_rx_bytes_per_second = 0.9, 0.25, 3 * (1 << 30)
    assert nv.nvmlGpmQueryDeviceSupport(nv.nvmlDeviceGetHandleByIndex(1)).isSupportedDevice == 1
    a, b = _gpm_pair(nv, 1)
    ids = [pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC]
    assert _gpm_get(nv, a, b, ids) == [(0, pytest.approx(90.0)), (0, pytest.approx(25.0)), (0, 3072.0)]  # %, MiB/s
    g.nvlink_links = 0  # no NVLink: its throughput is NOT_SUPPORTED per metric, the rest answers
    nv.nvmlGpmSampleGet(nv.nvmlDeviceGetHandleByIndex(1), b)
    got = _gpm_get(nv, a, b, [pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, pynvml.NVML_GPM_METRIC_SM_UTIL])
    assert got == [(pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0), (0, pytest.approx(90.0))]
    assert nv.gpm_samples_live == 2
    nv.nvmlGpmSampleFree(a)
    nv.nvmlGpmSampleFree(b)
    assert nv.gpm_samples_live == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlGpmSampleFree(a)  # a double free is an error, as a leak is a count


def test_gpm_refuses_mixed_or_freed_samples_and_parts_without_it(node, nv):
    a, _ = _gpm_pair(nv, 0)
    _, b = _gpm_pair(nv, 1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _gpm_get(nv, a, b, [pynvml.NVML_GPM_METRIC_SM_UTIL])  # samples of two GPUs
    node.gpu(1).gpm = False
    h = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlGpmSampleGet(h, b)
    node.gpu(0).mig = True
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlGpmSampleGet(nv.nvmlDeviceGetHandleByIndex(0), a)


def test_nvlink_states_and_error_counters(node, nv):
    g = node.gpu(0)
    g.nvlink_links, g.nvlink_errors = 2, {"1:2": 4}
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert [nv.nvmlDeviceGetNvLinkState(h, link) for link in range(2)] == [1, 1]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetNvLinkState(h, 2)  # past the part's last link
    assert nv.nvmlDeviceGetNvLinkErrorCounter(h, 1, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT) == 4
    assert nv.nvmlDeviceGetNvLinkErrorCounter(h, 0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY) == 0
    g.nvlink_links = 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetNvLinkState(h, 0)
