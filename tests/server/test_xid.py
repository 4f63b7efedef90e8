"""Xid ledger and watcher on the simulated NVML's event set."""

from __future__ import annotations

import logging
import time

import pynvml
import pytest
from samples import rank_sample

from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.monitoring.config import DEFAULT
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import Runner, ScrapeContext
from vramwatch.server.collectors.xid import PREINIT, XidCollector, XidLedger, XidWatcher, xid_families
from vramwatch.sim.nvml import SimNvml
from vramwatch.sim.state import SimNode
from vramwatch.spool import HeartbeatSnapshot

E = pynvml


def make(tmp_path, count: int = 2, wait_ms: int = 100):
    node = SimNode.default(count)
    nv = SimNvml.from_node(node)
    settings = Settings(simulate=True, spool_dir=str(tmp_path))
    session = nb.NvmlSession(settings, module=nv)
    ledger = XidLedger()
    return node, session, ledger, XidWatcher(session, ledger, settings, wait_ms=wait_ms)


def counts(ledger: XidLedger, uuid: str) -> dict[str, float]:
    return {r.xid: r.events for r in ledger.counts() if r.uuid == uuid}


# --- ledger ---
def test_ledger_preinitialises_the_xids_that_matter_and_counts_repeats():
    ledger = XidLedger()
    ledger.preinit(0, "GPU-a")
    # the alerts' default code lists are the pre-initialised codes whose action pages or warns
    assert set(DEFAULT.xid_critical + DEFAULT.xid_warning) < set(PREINIT)
    assert counts(ledger, "GPU-a") == {str(x): 0.0 for x in PREINIT}
    assert ledger.record(0, "GPU-a", 79, when=100.0) == 1
    assert ledger.record(0, "GPU-a", 79, when=200.0) == 2  # a repeat is visible, never a last-value gauge
    assert ledger.record(0, "GPU-a", 150, when=300.0) == 1  # an Xid not in the lists still counts
    rows = {(u, x): (c, t) for _, u, x, c, t in ledger.counts()}
    assert rows[("GPU-a", "79")] == (2.0, 200.0) and rows[("GPU-a", "150")] == (1.0, 300.0)
    assert rows[("GPU-a", "48")] == (0.0, 0.0)


def test_ledger_bounds_distinct_xids_per_gpu():
    ledger = XidLedger(max_per_gpu=3)
    for x in (1, 2, 3, 4, 5):
        ledger.record(0, "GPU-a", x)
    assert counts(ledger, "GPU-a") == {"1": 1, "2": 1, "3": 1, "other": 2}


def test_families_counter_and_timestamp_only_once_seen():
    ledger = XidLedger()
    ledger.preinit(0, "GPU-a", (13, 79))
    ledger.record(0, "GPU-a", 79, when=1234.5)
    ledger.preinit(1, "GPU-b", (79,))
    ctx = ScrapeContext((), time.time(), "h")
    total, last = xid_families(ledger.counts(), ctx)
    assert {tuple(s.labels.values()): s.value for s in total.samples if s.name.endswith("_total")} == {
        ("0", "GPU-a", "13", "restart_app"): 0.0,
        ("0", "GPU-a", "79", "restart_bm"): 1.0,
        ("1", "GPU-b", "79", "restart_bm"): 0.0,
    }
    assert total.name + "_total" == "gpu_xid_errors_total"
    assert [(s.labels["xid"], s.labels["action"], s.value) for s in last.samples] == [("79", "restart_bm", 1234.5)]
    sample = rank_sample(0, hostname="h", pid=1, time=0.0, uuid="GPU-b")
    total, _ = xid_families(ledger.counts(), ScrapeContext((sample,), time.time(), "h"), job_only=True)
    assert {s.labels["uuid"] for s in total.samples} == {"GPU-b"}


# --- watcher ---
def test_watcher_registers_every_gpu_and_counts_injected_xids(tmp_path):
    node, session, ledger, w = make(tmp_path)
    node.inject_xid(0, 13)  # before registration: not recorded, as NVML documents
    assert w.step() == 0.0  # registers, then a wait that times out
    assert set(w.registered) == {g.uuid for g in node.gpus} and w.health.up == 1
    node.inject_xid(1, 79)
    node.inject_xid(1, 79)
    node.inject_xid(0, 31)
    for _ in range(3):
        w.step()
    assert counts(ledger, node.gpu(1).uuid)["79"] == 2
    assert counts(ledger, node.gpu(0).uuid)["31"] == 1 and counts(ledger, node.gpu(0).uuid)["13"] == 0
    assert w.events == 3 and w.health.errors == 0


def test_xid_log_line_names_the_gpu_and_the_ranks_on_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, "vramwatch")
    node, session, ledger, w = make(tmp_path)
    pub = spool.RankPublisher(str(tmp_path), 3)
    try:
        pub.publish(
            rank_sample(3, world_size=4, hostname="h", heartbeat=HeartbeatSnapshot(steps=4821), uuid=node.gpu(1).uuid)
        )
        w.step()
        node.inject_xid(1, 48)
        w.step()
    finally:
        pub.close()
    line = [r for r in caplog.records if "Xid 48" in r.getMessage()]
    assert len(line) == 1 and line[0].levelno == logging.ERROR  # 48 pages: an error, not a warning
    msg = line[0].getMessage()
    assert "GPU 1" in msg and node.gpu(1).uuid in msg and "rank 3 (last step 4821)" in msg


@pytest.mark.parametrize(
    "code", [E.NVML_ERROR_UNKNOWN, E.NVML_ERROR_GPU_IS_LOST, E.NVML_ERROR_NO_PERMISSION, E.NVML_ERROR_NOT_SUPPORTED]
)
def test_wait_errors_back_off_and_re_register(tmp_path, code):
    node, session, ledger, w = make(tmp_path)
    w.step()
    node.inject_error("nvmlEventSetWait", code)
    pauses = [w.step() for _ in range(3)]
    assert pauses == [1.0, 2.0, 4.0]  # exponential back-off
    assert w.health.up == 0 and w.health.errors == 3
    node.clear_error()
    node.inject_xid(0, 94)
    w.step()  # re-registers (the old set was freed) ...
    node.inject_xid(0, 94)
    w.step()
    assert w.health.up == 1 and counts(ledger, node.gpu(0).uuid)["94"] == 1  # ... and only sees events after it


@pytest.mark.parametrize(
    "code", [E.NVML_ERROR_UNINITIALIZED, E.NVML_ERROR_DRIVER_NOT_LOADED, E.NVML_ERROR_LIBRARY_NOT_FOUND]
)
def test_session_errors_mark_nvml_down_and_reinit(tmp_path, code):
    node, session, ledger, w = make(tmp_path)
    w.step()
    gen = session.generation
    node.inject_error("nvmlEventSetWait", code)
    w.step()
    assert not session.ready and w.health.up == 0
    node.clear_error()
    session._next_try = 0.0  # skip the back-off wait
    w.step()
    assert session.ready and session.generation == gen + 1 and w.health.up == 1
    node.inject_xid(1, 119)
    w.step()
    assert counts(ledger, node.gpu(1).uuid)["119"] == 1


@pytest.mark.parametrize("code", [E.NVML_ERROR_NOT_SUPPORTED, E.NVML_ERROR_NO_PERMISSION, E.NVML_ERROR_GPU_IS_LOST])
def test_a_gpu_without_xid_events_is_skipped_and_up_stays(tmp_path, code):
    node, session, ledger, w = make(tmp_path)
    node.inject_error("nvmlDeviceRegisterEvents", code, gpu=0)
    w.step()
    assert list(w.registered) == [node.gpu(1).uuid] and w.health.up == 1 and w.health.errors == 0
    assert counts(ledger, node.gpu(0).uuid) == {}  # no pre-initialised series where no event can come


def test_no_gpu_with_xid_events_is_not_trouble(tmp_path):
    node, session, ledger, w = make(tmp_path)
    node.inject_error("nvmlDeviceGetSupportedEventTypes", E.NVML_ERROR_NOT_SUPPORTED)
    assert w.step() == 5.0
    assert w.registered == {} and w.health.up == 1


def test_register_unknown_error_frees_the_set_and_backs_off(tmp_path):
    node, session, ledger, w = make(tmp_path)
    node.inject_error("nvmlDeviceRegisterEvents", E.NVML_ERROR_UNKNOWN, gpu=1)
    assert w.step() == 1.0 and w.health.up == 0 and w.health.errors == 1
    node.clear_error()
    w.step()
    assert w.health.up == 1 and len(w.registered) == 2


def test_lost_gpu_leaves_the_set_and_rejoins_when_back(tmp_path):
    node, session, ledger, w = make(tmp_path)
    w.step()
    session.set_lost(node.gpu(1).uuid, True)
    w.step()
    assert list(w.registered) == [node.gpu(0).uuid]
    session.set_lost(node.gpu(1).uuid, False)
    w.step()
    assert len(w.registered) == 2


def test_a_node_without_nvml_keeps_the_watcher_up_with_nothing_to_watch(tmp_path):
    node, session, ledger, w = make(tmp_path)
    node.nvml_absent = "library_not_found"
    assert w.step() >= 0.5 and w.health.up == 1 and w.health.errors == 0
    assert ledger.counts() == ()


def test_nvml_failing_its_init_keeps_the_watcher_down_without_raising(tmp_path):
    node, session, ledger, w = make(tmp_path)
    node.inject_error("nvmlInit", pynvml.NVML_ERROR_NO_PERMISSION)
    assert w.step() >= 0.5 and w.health.up == 0
    assert ledger.counts() == ()


def test_thread_stops_within_one_wait(tmp_path):
    node, session, ledger, _ = make(tmp_path)
    xid = XidCollector(session.settings, session, wait_ms=300)
    c = Runner(xid, session.settings)
    c.start()
    try:
        deadline = time.monotonic() + 5
        while not xid.watcher.registered and time.monotonic() < deadline:
            time.sleep(0.02)
        node.inject_xid(0, 79)
        while time.monotonic() < deadline:
            c.poll_once()
            if any(x == "79" and n == 1 for _, _, x, n, _ in c.snapshot):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the Xid never reached the collector: {c.snapshot}")
        assert c.health.up == 1
    finally:
        t0 = time.monotonic()
        c.stop()
        assert time.monotonic() - t0 < 1.5
    assert not c.running
