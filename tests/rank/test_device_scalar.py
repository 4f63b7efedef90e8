"""Reading the job's loss without waiting on the GPU (vramwatch/rank/device_scalar.py), with a fake
CUDA tensor and event standing in for the device: the GPU half is in tests/gpu/test_gpu_core.py."""

from __future__ import annotations

import itertools
import math

import pytest

from vramwatch.rank.device_scalar import READ_MAX_GAP, READ_MAX_SHARE, DeviceScalar, finite, scalar
from vramwatch.rank.heartbeat import Heartbeat


class FakeCudaScalar:
    is_cuda = True

    def __init__(self, value: float) -> None:
        self.value = value


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.raise_on_query = False

    def query(self) -> bool:
        if self.raise_on_query:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done


class FakeHost:  # the pinned host copy: readable once the event says the copy ran
    def __init__(self, value: float) -> None:
        self.value = value

    def item(self) -> float:
        return self.value


class Reader(DeviceScalar):
    __slots__ = ("queued",)  # the events of the copies queued so far


@pytest.fixture
def reader():
    r = Reader()
    r.queued = []

    def copy_behind(t, slots):
        assert slots is r._slots, "the reader's own buffers, reused from one copy to the next"
        ev = FakeEvent()
        r.queued.append(ev)
        return FakeHost(t.value), ev

    r.copy_behind = copy_behind
    r.cpu_clock = lambda: 0.0  # reads that cost nothing: no spacing (tested on its own below)
    return r


def test_a_cuda_scalar_is_read_at_a_later_sample_never_waited_for(reader):
    assert reader.read(FakeCudaScalar(2.0)) is None, "nothing read yet: the copy is only queued"
    assert len(reader.queued) == 1
    assert reader.read(FakeCudaScalar(3.0)) is None, "the GPU has not got there: no wait, no value"
    assert len(reader.queued) == 1, "one copy in flight at a time"
    reader.queued[0].done = True
    assert reader.read(FakeCudaScalar(3.0)) == 2.0, "the value queued earlier, once its event completed"
    assert len(reader.queued) == 2, "and the current one is queued behind the GPU's work"
    assert reader.read(FakeCudaScalar(4.0)) == 2.0, "the last value read stands while the GPU is busy"
    reader.queued[1].done = True
    assert reader.read(FakeCudaScalar(4.0)) == 3.0


def test_no_new_step_means_no_new_copy(reader):
    loss = FakeCudaScalar(5.0)
    reader.read(loss, step=1)
    reader.queued[0].done = True
    for _ in range(10):  # the job is between steps (or stalled in Python): the same step each sample
        assert reader.read(loss, step=1) == 5.0
    assert len(reader.queued) == 1, "the value is known: nothing more queued on the GPU"
    assert reader.read(FakeCudaScalar(6.0), step=2) == 5.0 and len(reader.queued) == 2, "a new step's loss is queued"


def test_one_tensor_updated_in_place_is_read_again_after_each_step(reader):
    running = FakeCudaScalar(1.0)  # e.g. a running-mean loss the job keeps and passes every step
    reader.read(running, step=1)
    reader.queued[0].done = True
    running.value = 2.0  # the job updated it in place and stepped
    assert reader.read(running, step=2) == 1.0 and len(reader.queued) == 2, "same tensor, new step: copied again"
    reader.queued[1].done = True
    assert reader.read(running, step=2) == 2.0


def test_a_stuck_gpu_leaves_the_last_value_and_the_sampler_free(reader):
    reader.read(FakeCudaScalar(1.0))
    reader.queued[0].done = True
    assert reader.read(FakeCudaScalar(1.0)) == 1.0
    for _ in range(100):  # a hung collective: the event never completes; every read returns at once
        assert reader.read(FakeCudaScalar(9.0)) == 1.0
    assert len(reader.queued) == 2


def test_a_failing_event_or_copy_never_raises(reader):
    reader.read(FakeCudaScalar(1.0))
    reader.queued[0].raise_on_query = True
    assert reader.read(FakeCudaScalar(2.0)) is None, "the broken copy is dropped, another queued"
    assert len(reader.queued) == 2

    def broken(_t, _slots):
        raise RuntimeError("CUDA error: out of memory")

    reader.copy_behind = broken
    reader.queued[1].done = True
    assert reader.read(FakeCudaScalar(3.0)) == 2.0
    assert reader.read(FakeCudaScalar(3.0)) == 2.0


class Clocks:
    """Wall and CPU clocks a test moves; a copy "costs" ``copy_cpu`` seconds of the sampler's CPU."""

    def __init__(self, r: Reader, copy_cpu: float) -> None:
        self.wall = self.cpu = 0.0
        inner = r.copy_behind

        def costly_copy(t, slots):
            self.cpu += copy_cpu
            return inner(t, slots)

        r.copy_behind, r.clock, r.cpu_clock = costly_copy, lambda: self.wall, lambda: self.cpu


def test_gpu_reads_are_spaced_by_their_own_cost(reader):
    clocks = Clocks(reader, copy_cpu=100e-6)  # 0.1 ms a read: 2 s apart keeps it at 0.005% of a core
    gap = 100e-6 / READ_MAX_SHARE
    assert gap == pytest.approx(2.0)
    reader.read(FakeCudaScalar(1.0), step=1)
    reader.queued[0].done = True
    for k in range(1, 20):  # samples every 0.1 s, a new step each time: nothing looked at inside the gap
        clocks.wall = k * 0.1
        assert reader.read(FakeCudaScalar(2.0), step=1 + k) is None
    assert len(reader.queued) == 1
    clocks.wall = gap
    assert reader.read(FakeCudaScalar(3.0), step=30) == 1.0, "after the gap: the finished copy is read"
    assert len(reader.queued) == 2, "and the newest loss queued"
    for k in range(1, 2001):  # 200 s more of samples at 10 Hz, the GPU always done by the next read
        reader.queued[-1].done = True
        clocks.wall = gap + k * 0.1
        reader.read(FakeCudaScalar(float(k)), step=30 + k)
    assert clocks.cpu / clocks.wall == pytest.approx(READ_MAX_SHARE, rel=0.03), "the reads' share of a core"
    assert len(reader.queued) == pytest.approx(clocks.wall / gap, abs=1.5)


def test_a_costly_read_still_comes_back_within_the_longest_gap(reader):
    clocks = Clocks(reader, copy_cpu=0.05)  # a first copy that allocates its pinned buffer, say
    reader.read(FakeCudaScalar(1.0), step=1)
    reader.queued[0].done = True
    clocks.wall = READ_MAX_GAP - 0.01
    assert reader.read(FakeCudaScalar(2.0), step=2) is None
    clocks.wall = READ_MAX_GAP
    assert reader.read(FakeCudaScalar(2.0), step=2) == 1.0, "never staler than the longest gap allows"


def _read_times(reader, interval: float, seconds: float, copy_cpu: float) -> tuple[list[float], float]:
    """When copies were queued over ``seconds`` of samples every ``interval`` s (a jitter of up to 5% of an
    interval either way, as a loaded host's waits have), a new step at each and the GPU always done; and
    the reads' share of a core."""
    clocks = Clocks(reader, copy_cpu=copy_cpu)
    reader.sample_interval = interval
    times, k = [], 0
    while k * interval <= seconds:
        clocks.wall = k * interval + (0.05 if k % 2 else -0.05) * interval * (k > 0)
        for ev in reader.queued:
            ev.done = True
        n = len(reader.queued)
        reader.read(FakeCudaScalar(float(k)), step=k + 1)
        if len(reader.queued) > n:
            times.append(clocks.wall)
        k += 1
    return times, clocks.cpu / clocks.wall


@pytest.mark.parametrize(
    ("interval", "spacing", "within_share"),
    [(1.0, 6.0, True), (2.0, 6.0, True), (0.5, 5.5, True), (4.0, 4.0, False), (10.0, 10.0, False)],
)
def test_reads_land_on_samples_within_their_share_and_the_longest_gap(reader, interval, spacing, within_share):
    # 0.27 ms a read (an H200 host's, cold): its share spaces reads 5.4 s apart, the cap says 6 s. Reads
    # happen at samples: the first one past 5.4 s (at 2 s intervals the third, 6 s: the second, 4 s, would
    # spend 0.0068% of a core), unless that is past the cap (at 4 s intervals: 8 s, so 4 s); a cadence
    # longer than the cap reads at every sample
    times, share = _read_times(reader, interval, 240.0, 0.27e-3)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps and max(gaps) <= max(READ_MAX_GAP, interval) * 1.1, gaps
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(spacing, abs=0.11 * interval), gaps
    if within_share:
        assert share <= READ_MAX_SHARE * 1.05, share


def test_a_pending_copy_is_looked_at_again_soon(reader):
    clocks = Clocks(reader, copy_cpu=0.0)  # queries and copies that cost (next to) nothing
    reader.read(FakeCudaScalar(1.0), step=1)
    for k in range(1, 4):
        clocks.wall = k * 0.1
        assert reader.read(FakeCudaScalar(1.0), step=1) is None  # not done yet: asked again each sample
    reader.queued[0].done = True
    clocks.wall = 0.5
    assert reader.read(FakeCudaScalar(1.0), step=1) == 1.0


def test_host_values_are_read_at_once(reader):
    assert reader.read(0.5) == 0.5
    assert reader.read(None) == 0.5, "no new value: the last one stands"
    assert reader.read(float("nan")) is None, "NaN is not published"
    assert reader.queued == []


@pytest.mark.parametrize(
    "v, want",
    [(1, 1.0), (2.5, 2.5), ("x", None), (math.inf, None), (-math.inf, None), (float("nan"), None), (None, None)],
)
def test_scalar_and_finite(v, want):
    assert scalar(v) == want
    if v is not None:
        assert finite(v) == want


def test_the_heartbeat_reads_a_device_loss_through_the_reader():
    hb = Heartbeat()
    queued = []
    for r in hb._reads:
        r.cpu_clock = lambda: 0.0
        r.copy_behind = lambda t, _slots: (FakeHost(t.value), queued.append(FakeEvent()) or queued[-1])
    hb.step(loss=FakeCudaScalar(0.75), grad_norm=FakeCudaScalar(12.0))
    snap = hb.snapshot()
    assert snap.loss is None and snap.grad_norm is None and len(queued) == 2
    for ev in queued:
        ev.done = True
    snap = hb.snapshot()
    assert (snap.loss, snap.grad_norm) == (0.75, 12.0)


def test_queue_copy_reuses_one_pinned_buffer_and_event_per_device_and_dtype(monkeypatch):
    """queue_copy itself, with torch's CUDA pieces stood in for (no GPU here): real tensors are copied."""
    import torch

    from vramwatch.rank.device_scalar import queue_copy

    made = {"empty": 0, "event": 0}
    real_empty = torch.empty

    def empty(*a, pin_memory=False, **k):
        assert pin_memory, "the host buffer is pinned, so the copy is truly asynchronous"
        made["empty"] += 1
        return real_empty(*a, **k)

    class Event:
        def __init__(self):
            made["event"] += 1
            self.streams = []

        def record(self, stream):
            self.streams.append(stream)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device: f"default stream of {device}")
    slots: dict = {}
    w = torch.tensor(2.0, requires_grad=True)
    buf1, ev1 = queue_copy(w * 1.5, slots)  # a loss with a graph: copied detached
    assert buf1.item() == 3.0 and not buf1.requires_grad and ev1.streams == ["default stream of cpu"]
    buf2, ev2 = queue_copy(torch.tensor([4.0]), slots)  # one element, any shape
    assert (buf2, ev2) == (buf1, ev1) and buf2.item() == 4.0, "the same buffer and event, reused"
    assert made == {"empty": 1, "event": 1}
    buf3, _ = queue_copy(torch.tensor(1.0, dtype=torch.float64), slots)
    assert buf3 is not buf1 and buf3.dtype == torch.float64 and made == {"empty": 2, "event": 2}
    with pytest.raises(RuntimeError):
        queue_copy(torch.ones(3), slots)  # not a scalar: the reader turns this into no value


def test_the_readme_states_the_read_budget_the_code_has():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"at most {READ_MAX_SHARE * 100:g}% of a core" in readme
    assert f"one every\n{READ_MAX_GAP:g} s" in readme or f"one every {READ_MAX_GAP:g} s" in readme
