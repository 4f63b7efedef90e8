"""The status line's edges, without a sampler: missing values, where the line goes (tqdm bar, logger,
a caller's emit), the outermost tqdm bar, logging when nothing is configured, a failing line."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from vramwatch.rank import status
from vramwatch.rank.heartbeat import Heartbeat
from vramwatch.rank.status import StatusLine
from vramwatch.spool import DeviceSample, GpuReadings

GIB = float(1 << 30)
NS = types.SimpleNamespace


def dev(device=0, uuid="GPU-a", **values):
    return DeviceSample(device=device, uuid=uuid, values=values)


def test_a_device_without_values_or_readings():
    assert status.format_device(dev(), {}) == "cuda:0 alloc 0.00 GiB reserved 0.00 GiB"
    # a budget of 0 (none known) shows no headroom; a full one shows zero, never a negative
    assert "headroom" not in status.format_device(dev(torch_cuda_memory_limit_bytes=0.0), {})
    full = dev(torch_cuda_memory_limit_bytes=2 * GIB, torch_cuda_memory_reserved_bytes=3 * GIB)
    assert status.format_device(full, {}).endswith("reserved 3.00 GiB headroom 0.00 GiB")
    some = dev(torch_cuda_memory_limit_bytes=4 * GIB, torch_cuda_memory_reserved_bytes=1 * GIB)
    assert status.format_device(some, {"GPU-b": GpuReadings("GPU-b", memory_free_bytes=GIB)}).endswith(
        "headroom 3.00 GiB"  # another GPU's readings are not this one's
    )


def test_an_unknown_nvml_reason_is_said_as_it_is():
    assert "(NVML_ERROR_UNKNOWN)" in status.nvml_absent_line("NVML_ERROR_UNKNOWN")
    assert "(the NVIDIA driver is not loaded)" in status.nvml_absent_line("driver_not_loaded")


class Bar:
    written: list[str] = []

    def __init__(self, **attrs):
        self.__dict__.update(attrs)
        self.postfix = []

    def set_postfix_str(self, s, refresh=True):
        self.postfix.append((s, refresh))

    @classmethod
    def write(cls, s):
        cls.written.append(s)


@pytest.fixture
def bars(monkeypatch):
    """A stand-in tqdm.std whose tqdm class holds the bars the test puts in the returned list."""
    instances: list[Bar] = []
    Bar.written = []
    monkeypatch.setitem(sys.modules, "tqdm.std", NS(tqdm=NS(_instances=instances, write=Bar.write)))
    return instances


def test_no_tqdm_no_bar(monkeypatch, bars):
    assert status.active_tqdm() is None  # imported, no bar
    monkeypatch.setitem(sys.modules, "tqdm.std", NS())  # a module without the class
    assert status.active_tqdm() is None
    monkeypatch.delitem(sys.modules, "tqdm.std")
    assert status.active_tqdm() is None


def test_the_outermost_visible_bar(bars):
    inner, hidden, outer_no_pos, other = Bar(pos=1, disable=False), Bar(pos=0, disable=True), Bar(), Bar(pos=2)
    bars += [inner, hidden, other, outer_no_pos]
    assert status.active_tqdm() is outer_no_pos  # no pos: position 0; the disabled one is not shown
    bars.remove(outer_no_pos)
    none_pos = Bar(pos=None)
    bars += [none_pos]
    assert status.active_tqdm() is none_pos
    bars.remove(none_pos)
    bars += [Bar(pos=-3)]  # tqdm gives nested bars negative positions too: the distance counts
    assert status.active_tqdm() is inner
    bars.clear()
    bars += [hidden]
    assert status.active_tqdm() is None


def line(hb=None, **kw):
    got = []
    s = StatusLine(hb or Heartbeat(), 5, emit=lambda lines, head: got.append((lines, head)), **kw)
    return s, got


def test_defaults_and_the_line_without_devices():
    s, got = line()
    assert (s.rank, s.spool_dir, s.show_rank, s.lines) == (0, "", False, 0)
    s.heartbeat.steps = 5
    s.on_step()
    assert got == [(["vramwatch: step 5, 0.000 s/step, no CUDA device in use yet"], "step 5, 0.000 s/step")]
    assert s.lines == 1
    s.on_sample([dev(), dev(1, "GPU-b")])  # no spool: no readings, no notice
    s.heartbeat.steps = 10
    s.on_step()
    head = "vramwatch: step 10, 0.000 s/step, "
    assert got[-1][0] == [head + status.format_device(d, {}) for d in (dev(), dev(1, "GPU-b"))]
    assert s.lines == 2


def test_the_next_line_comes_at_the_next_multiple():
    s, got = line()
    s.heartbeat.steps = 7
    s.report()  # off the grid (a report forced at step 7): the next is at 10
    for steps in (8, 9, 10, 11, 12):
        s.heartbeat.steps = steps
        s.on_step()
    assert [head.split(",")[0] for _, head in got] == ["step 7", "step 10"]


def test_for_rank_takes_the_settings():
    ctx = NS(
        heartbeat=Heartbeat(),
        settings=NS(status_every=3, status_all_ranks=True),
        identity=NS(rank=4, world_size=8, job_id="7.0"),
        spool_dir="/spool",
    )
    s = StatusLine.for_rank(ctx)
    assert (s.every, s.rank, s.show_rank, s.spool_dir, s.heartbeat) == (3, 4, True, "/spool", ctx.heartbeat)


def test_a_failing_line_warns_once_exactly(caplog):
    s, _ = line()

    def broken():
        raise RuntimeError("x")

    s.report = broken
    s.heartbeat.steps = 5
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        s.on_step()
        s.on_step()
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("vramwatch", "vramwatch: status line failed (RuntimeError('x')); turned off")
    ]


def test_the_notice_goes_above_the_bar_once(bars, caplog):
    bar = Bar(pos=0)
    bars.append(bar)
    hb = Heartbeat()
    s = StatusLine(hb, 5)
    s._nvml_absent = "no_devices"
    hb.steps = 5
    s.on_step()
    assert Bar.written == [status.nvml_absent_line("no_devices")] and len(bar.postfix) == 1
    hb.steps = 10
    s.on_step()
    assert Bar.written == [status.nvml_absent_line("no_devices")]  # once
    assert len(bar.postfix) == 2 and not [r for r in caplog.records if r.name == "vramwatch.status"]


@pytest.fixture
def bare_status_log():
    """vramwatch.status as in a process that configured no logging."""
    log = status.status_log
    saved = (log.handlers[:], log.propagate, log.level)
    log.handlers[:] = [h for h in log.handlers if type(h) is not logging.StreamHandler]
    log.propagate = False  # hide the test runner's own handlers above it
    yield log
    log.handlers[:], log.propagate, log.level = saved[0], saved[1], saved[2]


def ours(log):
    return [h for h in log.handlers if type(h) is logging.StreamHandler]  # not the test runner's capture


def test_without_logging_configured_lines_go_to_stderr(bare_status_log, capsys):
    bare_status_log.handlers.clear()  # the test runner's capture too: hasHandlers() would see it
    StatusLine(Heartbeat(), 5, emit=lambda lines, head: None)
    assert ours(bare_status_log) == []  # it does not print by itself
    s = StatusLine(Heartbeat(), 5)
    (h,) = ours(bare_status_log)
    assert bare_status_log.propagate is False and bare_status_log.level == logging.INFO
    s.report()
    assert capsys.readouterr().err == "vramwatch: step 0, no CUDA device in use yet\n"
    StatusLine(Heartbeat(), 5)  # a second one adds no second handler
    assert ours(bare_status_log) == [h]
