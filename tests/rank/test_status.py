"""The console status line: content, cadence, destinations, rank selection, power readings."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import time

import pytest

import vramwatch
from vramwatch.rank import status
from vramwatch.rank.allocator import AllocatorSampler
from vramwatch.rank.heartbeat import Heartbeat
from vramwatch.rank.status import StatusLine
from vramwatch.sim import SimAllocator, SimNode
from vramwatch.sim.state import state_path
from vramwatch.spool import DeviceSample, GpuReadings, read_node, write_node_readings

GIB = 1 << 30


@pytest.fixture
def sim_devices(tmp_path):
    node = SimNode.default(1)
    node.save(state_path(str(tmp_path)))
    # what the server's (simulated) NVML publishes: power, no free memory
    write_node_readings(str(tmp_path), [GpuReadings(node.gpus[0].uuid, power_watts=187.0)])
    sim = SimAllocator(node, visible="0")
    sim.init(0)
    sim.set_memory_fraction(0.5)
    sim.allocate(4 * GIB)
    sim.allocate(2 * GIB)
    sim.free(2 * GIB)  # 2 GiB stays cached
    return node, sim, AllocatorSampler(sim, 0).read()


def _status(tmp_path, every=10, **kw):
    out: list[list[str]] = []
    hb = Heartbeat()
    line = StatusLine(hb, every, spool_dir=str(tmp_path), emit=lambda lines, head: out.append(lines), **kw)
    return hb, line, out


def test_a_line_every_n_steps_with_the_field_notes_figures(tmp_path, sim_devices):
    node, sim, devices = sim_devices
    hb, line, out = _status(tmp_path, every=10)
    line.on_sample(devices)
    for _ in range(25):
        hb.step()
        line.on_step()
    assert len(out) == 2  # steps 10 and 20, not 25
    (text,) = out[1]
    assert text.startswith("vramwatch: step 20, ") and " s/step, cuda:0 " in text
    assert "alloc 4.00 GiB" in text and "reserved 6.00 GiB" in text
    limit = node.gpus[0].total_bytes * 0.5
    assert f"headroom {(limit - 6 * GIB) / GIB:.2f} GiB" in text  # no NVML readings: budget minus reserved
    assert "frag 33%" in text and "retries 0" in text
    assert "power 187 W" in text  # the server's reading of the simulated GPU
    assert "reclaims" not in text and "ooms" not in text  # hygiene off, no OOM


def test_step_time_is_the_mean_since_the_previous_line(tmp_path):
    hb, line, out = _status(tmp_path, every=2)
    hb.step()
    hb.sum, hb.steps = 0.0, 1
    for d in (0.5, 1.5, 3.0):  # three intervals: lines at step 2 (0.5 s) and step 4 (mean of 1.5 and 3.0)
        hb.steps += 1
        hb.sum += d
        line.on_step()
    assert "step 2, 0.500 s/step" in out[0][0]
    assert "step 4, 2.250 s/step" in out[1][0]
    assert "no CUDA device in use yet" in out[0][0]


def test_free_memory_and_power_from_the_server_readings(tmp_path, sim_devices):
    node, sim, devices = sim_devices
    uuid = node.gpus[0].uuid
    write_node_readings(str(tmp_path), [GpuReadings(uuid, 212.4, 2.73 * GIB)])
    hb, line, out = _status(tmp_path, every=1)
    line.on_sample(devices)
    hb.step()
    line.on_step()
    text = out[0][0]
    assert "free 2.73 GiB" in text and "headroom" not in text and "power 212 W" in text
    # stale readings (a dead server) are ignored: no power, headroom instead of free
    write_node_readings(str(tmp_path), [GpuReadings(uuid, 212.4, 2.73 * GIB)], now=time.time() - 60)
    assert read_node(str(tmp_path)).gpus == {}
    line.on_sample(devices)
    hb.step()
    line.on_step()
    assert "power" not in out[1][0] and "headroom" in out[1][0]


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        ("library_not_found", "the NVML library (libnvidia-ml.so.1) is not found"),
        ("driver_not_loaded", "the NVIDIA driver is not loaded"),
        ("no_devices", "NVML sees no GPU"),
    ],
)
def test_one_line_says_what_is_missing_on_a_node_without_nvml(tmp_path, reason, said):
    write_node_readings(str(tmp_path), [], nvml_absent=reason)  # what the server writes on such a node
    hb, line, out = _status(tmp_path, every=1)
    line.on_sample([])  # a CPU-only rank
    for _ in range(3):
        hb.step()
        line.on_step()
    notices = [text for lines in out for text in lines if "NVML" in text]
    assert notices == [
        f"vramwatch: no NVML on this node ({said}): no free memory or power readings; allocator metrics go on"
    ]  # once, not on every line
    assert out[0][0].startswith("vramwatch: step 1") and len(out[1]) == 1


def test_no_notice_where_the_node_has_nvml(tmp_path, sim_devices):
    _, _, devices = sim_devices
    hb, line, out = _status(tmp_path, every=1)
    line.on_sample(devices)
    hb.step()
    line.on_step()
    assert len(out[0]) == 1 and "NVML" not in out[0][0]


def test_power_is_left_out_without_readings(tmp_path, sim_devices):
    _, _, devices = sim_devices
    text = status.format_device(devices[0], {})
    assert "power" not in text and "headroom" in text


def test_reclaims_and_ooms_are_shown_when_present(sim_devices):
    _, _, devices = sim_devices
    values = {**devices[0].values, "torch_cuda_memory_cache_reclaims_total": 3.0, "torch_cuda_memory_ooms_total": 1.0}
    d = DeviceSample(devices[0].device, devices[0].uuid, values)
    text = status.format_device(d, {})
    assert "reclaims 3" in text and "ooms 1" in text


def test_postfix_on_an_active_tqdm_bar(tmp_path, sim_devices):
    tqdm = pytest.importorskip("tqdm")
    _, _, devices = sim_devices
    hb = Heartbeat()
    line = StatusLine(hb, 1, spool_dir=str(tmp_path))
    line.on_sample(devices)
    logged = []
    handler = logging.Handler()
    handler.emit = logged.append
    status.status_log.addHandler(handler)
    try:
        with tqdm.tqdm(total=10, file=io.StringIO()) as bar:
            hb.step()
            line.on_step()
            assert "cuda:0 alloc 4.00 GiB" in bar.postfix
        assert logged == []  # the bar took it
        hb.step()
        line.on_step()  # the bar is closed: to the log
        assert len(logged) == 1 and "cuda:0 alloc 4.00 GiB" in logged[0].getMessage()
        assert logged[0].levelno == logging.INFO
    finally:
        status.status_log.removeHandler(handler)


def test_rank_zero_only_by_default(tmp_path):
    kw = dict(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05, status_every=1)
    with vramwatch.start(rank=1, world_size=2, **kw) as h:
        assert h.status is None and h.step_hooks == ()
    with vramwatch.start(rank=1, world_size=2, status_all_ranks=True, **kw) as h:
        assert h.status is not None
        seen = []
        h.status.emit = lambda lines, head: seen.append(lines)
        vramwatch.step()
        assert seen and seen[0][0].startswith("vramwatch: rank 1 step 1")
    with vramwatch.start(rank=1, world_size=2, status_all_ranks=True, job_id="train-42", **kw) as h:
        assert h.status is not None
        assert h.status.start(2, "train-42") == f"vramwatch: rank 1 of 2, job_id train-42, pid {os.getpid()}"
    with vramwatch.start(rank=0, world_size=2, **{**kw, "status_every": 0}) as h:
        assert h.status is None  # off by default


def test_a_job_prints_status_lines_to_stderr_without_logging_configured(tmp_path):
    code = f"""
import time, vramwatch
from vramwatch import spool
h = vramwatch.start(simulate=True, serve="external", spool_dir={str(tmp_path / "spool")!r}, interval=0.05,
                    status_every=2)
# what the node's server writes after reading the simulated GPU's NVML
spool.write_node_readings(h.spool_dir, [spool.GpuReadings(h.sim.uuid(0), power_watts=120.0)])
h.sim.init(0)
h.sim.allocate(3 << 30)
time.sleep(0.3)   # a sample with the device in it
for i in range(4):
    vramwatch.step()
vramwatch.stop()
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.startswith("vramwatch: step")]
    assert len(lines) == 2, p.stderr
    # the start line names the job once (a lone process: itself), before the first status line
    starts = [x for x in p.stderr.splitlines() if "job_id" in x]
    start_line = r"vramwatch: rank 0 of 1, job_id local-[0-9a-f]{12}, pid \d+"
    assert len(starts) == 1 and re.fullmatch(start_line, starts[0]), p.stderr
    assert p.stderr.splitlines().index(starts[0]) < p.stderr.splitlines().index(lines[0])
    assert lines[0].startswith("vramwatch: step 2, ") and "alloc 3.00 GiB" in lines[0] and "power 120 W" in lines[1]
    assert p.stdout == ""  # nothing on the job's stdout


def test_a_failing_status_line_turns_itself_off(tmp_path):
    hb = Heartbeat()

    def broken(lines, head):
        raise OSError("stderr closed")

    line = StatusLine(hb, 1, emit=broken)
    hb.step()
    line.on_step()  # logged once, never raised
    hb.step()
    line.on_step()
    assert line._failed
