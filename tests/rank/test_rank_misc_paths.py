"""Small rank modules' edges: the simulated source's fallback, plugins' merge and failures, uuid spellings,
the sample's collector health and pid, the device scalar's defaults."""

from __future__ import annotations

import logging
import os

from vramwatch._once import OnceLog
from vramwatch.config import Settings
from vramwatch.rank.allocator import AllocatorSampler
from vramwatch.rank.device_scalar import DeviceScalar
from vramwatch.rank.device_uuid import device_uuid, mig_entry
from vramwatch.rank.heartbeat import Heartbeat
from vramwatch.rank.identity import RankIdentity
from vramwatch.rank.plugin_api import SampleExtras
from vramwatch.rank.plugins import Plugins
from vramwatch.rank.sample import SampleAssembler
from vramwatch.rank.sources import allocator_source
from vramwatch.sim import SimAllocator, SimNode
from vramwatch.spool import DeviceSample

MIG = "MIG-11111111-2222-3333-4444-555555555555"


# --- sources ---


def test_an_unreadable_simulated_node_falls_back_to_one_default_gpu_and_says_so(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    spool = str(blocker / "spool")  # under a regular file: cannot be created
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        src = allocator_source(Settings(simulate=True), spool)
    assert len(src.node.gpus) == 1
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert msg.startswith(f"vramwatch: cannot read the simulated node in {spool} (")
    assert "Errno" in msg and msg.endswith("); using a default one")


# --- plugins ---


class _Adds:
    def __init__(self, values):
        self.values = values

    def on_sample(self, devices):
        return SampleExtras(self.values)

    def close(self):
        pass


class _Fails(_Adds):
    def on_sample(self, devices):
        raise ValueError("bad plugin")


def _devices():
    return [DeviceSample(0, "GPU-0", {"a": 1.0}), DeviceSample(1, "GPU-1", {"a": 2.0})]


def test_a_plugins_values_reach_only_the_devices_it_names():
    p = Plugins()
    p.plugins = (_Adds({0: {"b": 3.0}}),)
    merged, snap = p.on_sample(_devices())
    assert [d.values for d in merged] == [{"a": 1.0, "b": 3.0}, {"a": 2.0}]
    assert snap is None


def test_a_failing_plugin_is_logged_once_and_the_others_still_run(caplog):
    p = Plugins()
    failing = _Fails({})
    p.plugins = (failing, _Adds({1: {"b": 4.0}}))
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        for _ in range(3):
            merged, _snap = p.on_sample(_devices())
    assert merged[1].values == {"a": 2.0, "b": 4.0}
    assert [r.getMessage() for r in caplog.records] == [f"vramwatch: {failing!r} failed: ValueError('bad plugin')"]


# --- device_uuid ---


def test_a_uuid_that_already_says_mig_is_kept():
    assert device_uuid("MIG-abc", "NVIDIA H100", 1, None) == "MIG-abc"


def test_the_first_mig_entry_after_a_gpu_entry_is_the_visible_one():
    assert mig_entry("GPU-aaaa," + MIG) == MIG


# --- sample ---


def _assembler(sampler):
    return SampleAssembler(
        RankIdentity(0, 0, 1, "j"), "host", sampler, Heartbeat(), Plugins(), OnceLog(logging.getLogger("vramwatch"))
    )


def test_a_fresh_sample_counts_no_allocator_errors_and_carries_this_pid():
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    s = _assembler(AllocatorSampler(sim, 0)).assemble()
    assert s.collectors["allocator"].up == 1 and s.collectors["allocator"].errors == 0
    assert s.pid == os.getpid() and len(s.devices) == 1


def test_a_sample_assembled_in_a_forked_child_carries_the_childs_pid():
    sim = SimAllocator(SimNode.default(1), visible="0")
    a = _assembler(AllocatorSampler(sim, 0))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its sample's pid and its own, then leave at once
        try:
            os.write(w, f"{a.assemble().pid} {os.getpid()}".encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 100).decode().split()
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert got == [str(pid), str(pid)]


# --- device_scalar ---


class _Cuda:
    is_cuda = True

    def __init__(self, value):
        self.value = value


class _Done:
    def query(self):
        return True


class _Host:
    def __init__(self, value):
        self.value = value

    def item(self):
        return self.value


def test_a_device_scalar_with_its_own_clocks_reads_a_gpu_value_one_sample_later():
    r = DeviceScalar()
    slots_seen = []

    def copy_behind(t, slots):
        slots_seen.append(slots)
        return _Host(t.value), _Done()

    r.copy_behind = copy_behind  # the default clocks stay: time.monotonic and time.thread_time
    assert r.read(_Cuda(2.5), step=1) is None
    r._next_read = 0.0  # the spacing is tested elsewhere
    assert r.read(_Cuda(3.5), step=2) == 2.5
    assert isinstance(slots_seen[0], dict) and slots_seen[0] is slots_seen[1]  # one cache of buffers, reused
