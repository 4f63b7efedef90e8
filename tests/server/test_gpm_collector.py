"""GPU activity (NVML GPM) and NVLink errors in the server, on the simulated NVML: values, NOT_SUPPORTED
remembered, errors mid-run, a lost GPU, NVML re-initialising, and every GPM buffer freed."""

from __future__ import annotations

import logging

import pynvml as E
import pytest
from test_nvml_collector import Rig

from vramwatch.config import Settings
from vramwatch.monitoring import contract
from vramwatch.server.collectors import Runner, enabled_collectors
from vramwatch.server.collectors.gpm import FAMILIES, GpmCollector
from vramwatch.server.collectors.nvlink import COUNTERS, NvlinkCollector

MIB = 1 << 20


def _name(code: int) -> str:
    return {E.NVML_ERROR_UNKNOWN: "UNKNOWN (NVML error 999)", E.NVML_ERROR_TIMEOUT: "TIMEOUT (NVML error 10)"}[code]


class GpmRig(Rig):
    """The NVML rig plus the GPM and NVLink collectors on the same session and clock."""

    def __init__(self, tmp_path, **kw) -> None:
        super().__init__(tmp_path, **kw)
        self.gpm = Runner(GpmCollector(self.settings, self.session), self.settings, clock=self.clock)
        self.nvlink = Runner(NvlinkCollector(self.settings, self.session), self.settings, clock=self.clock)

    def poll(self, advance: float = 1.0) -> None:
        super().poll(advance)
        if hasattr(self, "gpm"):
            self.gpm.poll_once()
            self.nvlink.poll_once()

    def metrics(self):
        out = super().metrics()
        for c in (self.gpm, self.nvlink):
            for fam in c.collect(self.ctx()):
                for s in fam.samples:
                    out.setdefault(s.name, []).append((dict(s.labels), s.value))
        return out

    @property
    def live(self) -> int:
        return self.nv.nv.gpm_samples_live


@pytest.fixture
def rig(tmp_path):
    r = GpmRig(tmp_path)
    g = r.node.gpu(0)
    g.sm_activity, g.sm_occupancy, g.tensor_activity, g.dram_bandwidth_utilization = 0.8, 0.4, 0.6, 0.3
    g.pcie_rx_bytes_per_second, g.pcie_tx_bytes_per_second = 3.0e9, 1.0e9
    g.nvlink_rx_bytes_per_second, g.nvlink_tx_bytes_per_second = 2.0e11, 1.5e11
    return r


def test_the_first_read_primes_the_second_reports_in_base_units(rig):
    rig.poll(0)
    assert not any(name in rig.metrics() for name in FAMILIES)  # one sample: no interval yet
    assert rig.gpm.health.up == 1
    rig.poll(10)
    assert rig.value("gpu_sm_activity_ratio") == pytest.approx(0.8)
    assert rig.value("gpu_sm_occupancy_ratio") == pytest.approx(0.4)
    assert rig.value("gpu_tensor_activity_ratio") == pytest.approx(0.6)
    assert rig.value("gpu_dram_bandwidth_utilization_ratio") == pytest.approx(0.3)
    assert rig.value("gpu_pcie_rx_bytes_per_second") == pytest.approx(3.0e9)
    assert rig.value("gpu_pcie_tx_bytes_per_second") == pytest.approx(1.0e9)
    assert rig.value("gpu_nvlink_rx_bytes_per_second") == pytest.approx(2.0e11)
    assert rig.value("gpu_nvlink_tx_bytes_per_second") == pytest.approx(1.5e11)
    assert rig.value("gpu_sm_activity_ratio", gpu=1) == 0.0
    assert rig.gpm.health.up == 1 and rig.gpm.health.duration > 0
    rig.node.gpu(0).sm_activity = 0.25  # the next interval reports the new rate
    rig.poll(10)
    assert rig.value("gpu_sm_activity_ratio") == pytest.approx(0.25)
    assert rig.live == 4  # two buffers per GPU, reused: no allocation per read


def test_buffers_are_freed_on_close_and_at_reinit(rig):
    rig.poll(0)
    rig.poll(10)
    assert rig.live == 4
    rig.node.inject_error("nvmlGpmSampleGet", E.NVML_ERROR_UNINITIALIZED, gpu=0)
    rig.poll(10)  # NVML went away under the read: the old session's buffers go with it
    assert rig.live == 0 and rig.gpm.health.up == 0
    rig.node.clear_error()
    rig.clock.t += 100
    rig.poll(10)
    rig.poll(10)
    assert rig.session.ready and rig.live == 4 and rig.value("gpu_sm_activity_ratio") == pytest.approx(0.8)
    rig.gpm.stop()
    assert rig.live == 0


@pytest.mark.parametrize("how", ["no gpm", "mig", "sample not supported", "query not supported"])
def test_a_gpu_without_gpm_is_remembered_logged_once_and_keeps_up(tmp_path, caplog, how):
    caplog.set_level(logging.INFO, "vramwatch")
    rig = GpmRig(tmp_path)
    if how == "no gpm":
        rig.node.gpu(1).gpm = False
    elif how == "mig":
        rig.node.gpu(1).mig = True
    elif how == "sample not supported":
        rig.node.inject_error("nvmlGpmSampleGet", E.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    else:
        rig.node.inject_error("nvmlGpmQueryDeviceSupport", E.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    for _ in range(5):
        rig.poll(10)
    assert rig.gpm.health.up == 1 and rig.gpm.health.errors == 0
    assert rig.value("gpu_sm_activity_ratio", gpu=0) == 0.0
    assert all(rig.value(name, gpu=1) is None for name in FAMILIES)
    assert rig.nv.calls["nvmlGpmQueryDeviceSupport"] == 2  # once per GPU, never retried
    assert rig.live == 2  # GPU 1's buffers freed (or never taken)
    logged = [r.getMessage() for r in caplog.records if "GPM is unavailable" in r.getMessage()]
    assert len(logged) == 1 and "GPU 1" in logged[0]
    want = "isSupportedDevice=0" if how == "no gpm" else "NOT_SUPPORTED (NVML error 3)"
    assert want in logged[0]


def test_a_metric_the_gpu_lacks_is_dropped_for_it_alone(rig, caplog):
    caplog.set_level(logging.INFO, "vramwatch")
    asked: list[tuple[int, int]] = []
    real = rig.nv.nv.nvmlGpmMetricsGet

    def metrics_get(req):
        asked.append((req.sample2.index, req.numMetrics))
        return real(req)

    rig.nv.nv.nvmlGpmMetricsGet = metrics_get
    rig.node.gpu(1).nvlink_links = 0  # no NVLink: its throughput metrics answer NOT_SUPPORTED
    for _ in range(4):
        rig.poll(10)
    assert [n for i, n in asked if i == 1] == [8, 6, 6]  # asked once, then not again
    assert [n for i, n in asked if i == 0] == [8, 8, 8]
    logged = [r.getMessage() for r in caplog.records if "GPM metric" in r.getMessage()]
    assert len(logged) == 2 and all("GPU 1" in m and "NOT_SUPPORTED" in m for m in logged)
    assert rig.value("gpu_nvlink_rx_bytes_per_second", gpu=1) is None
    assert rig.value("gpu_pcie_rx_bytes_per_second", gpu=1) == 0.0
    assert rig.value("gpu_nvlink_rx_bytes_per_second", gpu=0) == pytest.approx(2.0e11)
    assert rig.gpm.health.up == 1


@pytest.mark.parametrize("call", ["nvmlGpmSampleGet", "nvmlGpmMetricsGet"])
@pytest.mark.parametrize("code", [E.NVML_ERROR_UNKNOWN, E.NVML_ERROR_TIMEOUT])
def test_errors_mid_run_fail_the_read_and_recover(rig, call, code):
    rig.poll(0)
    rig.poll(10)
    rig.node.inject_error(call, code, gpu=0)
    rig.poll(10)
    assert rig.gpm.health.up == 0 and rig.gpm.health.errors == 1
    assert isinstance(rig.gpm.collector, GpmCollector)
    assert rig.gpm.collector.last_failure == {rig.node.gpu(0).uuid: _name(code)}
    assert rig.value("gpu_sm_activity_ratio", gpu=0) is None  # no stale rate
    assert rig.value("gpu_sm_activity_ratio", gpu=1) == 0.0  # the other GPU goes on
    rig.node.clear_error()
    rig.poll(10)  # primes again
    rig.poll(10)
    assert rig.gpm.health.up == 1 and rig.value("gpu_sm_activity_ratio", gpu=0) == pytest.approx(0.8)
    assert rig.live == 4  # the failed GPU's buffers were freed before new ones were taken


def test_a_lost_gpu_drops_its_buffers_and_comes_back(rig):
    rig.poll(0)
    rig.poll(10)
    rig.node.gpu(0).lost = True
    rig.poll(10)
    rig.poll(10)
    assert rig.gpm.health.up == 0 and rig.nvlink.health.up == 0
    assert rig.value("gpu_sm_activity_ratio", gpu=0) is None and rig.value("gpu_nvlink_errors_total", gpu=0) is None
    assert rig.value("gpu_sm_activity_ratio", gpu=1) == 0.0
    assert rig.live == 2
    rig.node.gpu(0).lost = False
    for _ in range(4):
        rig.poll(10)
    assert rig.value("gpu_up", gpu=0) == 1.0
    assert rig.gpm.health.up == 1 and rig.value("gpu_sm_activity_ratio", gpu=0) == pytest.approx(0.8)
    assert rig.live == 4


def test_nvlink_errors_of_the_active_links_summed_per_type(rig):
    g = rig.node.gpu(0)
    g.nvlink_links = 4
    # replay, recovery, CRC flit, CRC data on link 2; a replay on link 3
    g.nvlink_errors = {"2:0": 5, "2:1": 1, "2:2": 3, "2:3": 4, "3:0": 2}
    rig.poll(10)
    assert rig.value("gpu_nvlink_errors_total", gpu=0, type="replay") == 7.0  # links 2 and 3
    assert rig.value("gpu_nvlink_errors_total", gpu=0, type="recovery") == 1.0
    assert rig.value("gpu_nvlink_errors_total", gpu=0, type="crc") == 7.0  # flit + data
    series = [lab for lab, _ in rig.metrics()["gpu_nvlink_errors_total"] if lab["gpu"] == "0"]
    assert [lab["type"] for lab in series] == list(contract.NVLINK_ERROR_TYPES) == list(COUNTERS)  # 3, not 12
    assert all("link" not in lab for lab in series)
    assert rig.nvlink.health.up == 1
    state_calls = rig.nv.calls["nvmlDeviceGetNvLinkState"]
    assert state_calls == 5 + 19  # links 0-3 of GPU 0, 0-17 of GPU 1, and one past each end (NVML's max is 36)
    g.nvlink_errors["2:0"] = 6
    rig.poll(10)
    assert rig.value("gpu_nvlink_errors_total", gpu=0, type="replay") == 8.0
    assert rig.nv.calls["nvmlDeviceGetNvLinkState"] == state_calls  # links are found once per session


def test_nvlink_reads_stay_within_nvml_max_links(rig):
    rig.node.gpu(0).nvlink_links = 99  # more than NVML can number
    rig.poll(10)
    assert rig.nvlink.collector._links[rig.node.gpu(0).uuid] == tuple(range(E.NVML_NVLINK_MAX_LINKS))


def test_no_nvlink_is_remembered_and_logged_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, "vramwatch")
    rig = GpmRig(tmp_path)
    for g in rig.node.gpus:
        g.nvlink_links = 0
    for _ in range(4):
        rig.poll(10)
    assert rig.nvlink.health.up == 1 and "gpu_nvlink_errors_total" not in rig.metrics()
    assert rig.nv.calls["nvmlDeviceGetNvLinkState"] == 2  # link 0 of each GPU, once
    logged = [r.getMessage() for r in caplog.records if "no NVLink error counters" in r.getMessage()]
    assert len(logged) == 2 and all("NOT_SUPPORTED (NVML error 3)" in m for m in logged)
    assert isinstance(rig.nvlink.collector, NvlinkCollector)
    assert set(rig.nvlink.collector.unavailable.values()) == {"nvmlDeviceGetNvLinkState: NOT_SUPPORTED (NVML error 3)"}


def test_an_nvlink_counter_the_gpu_lacks_is_dropped(rig):
    rig.node.inject_error("nvmlDeviceGetNvLinkErrorCounter", E.NVML_ERROR_NOT_SUPPORTED, gpu=1)
    rig.poll(10)
    rig.poll(10)
    assert rig.nvlink.health.up == 1
    assert rig.value("gpu_nvlink_errors_total", gpu=1) is None
    assert rig.value("gpu_nvlink_errors_total", gpu=0, type="crc") == 0.0
    assert rig.nv.calls["nvmlDeviceGetNvLinkErrorCounter"] <= 2 * 18 * 4 + 4  # GPU 1 tried each counter once


def test_nvlink_transient_error_fails_the_read(rig):
    rig.poll(10)
    rig.node.inject_error("nvmlDeviceGetNvLinkErrorCounter", E.NVML_ERROR_UNKNOWN, gpu=0)
    rig.poll(10)
    assert rig.nvlink.health.up == 0 and rig.value("gpu_nvlink_errors_total", gpu=1, type="replay") == 0
    rig.node.clear_error()
    rig.poll(10)
    assert rig.nvlink.health.up == 1


def test_both_are_server_collectors_on_the_slow_cadence_with_their_own_switch(tmp_path):
    names = [r.name for r in enabled_collectors(Settings(simulate=True, spool_dir=str(tmp_path)))]
    assert "gpm" in names and "nvlink" in names
    runners = {r.name: r for r in enabled_collectors(Settings(simulate=True, spool_dir=str(tmp_path)))}
    assert runners["gpm"].interval == runners["nvlink"].interval == Settings().nvml_slow_interval
    off = [r.name for r in enabled_collectors(Settings(simulate=True, spool_dir=str(tmp_path), gpm=False))]
    assert "gpm" not in off and "nvlink" in off
    off = [r.name for r in enabled_collectors(Settings(simulate=True, spool_dir=str(tmp_path), nvlink=False))]
    assert "nvlink" not in off and "gpm" in off


def test_a_node_without_nvml_keeps_both_up(tmp_path):
    rig = GpmRig(tmp_path)
    rig.node.nvml_absent = "library_not_found"
    rig.poll(0)
    assert rig.gpm.health.up == 1 and rig.nvlink.health.up == 1
    assert rig.gpm.snapshot is None and rig.nvlink.snapshot is None
