"""The heartbeat on its own: what one step() records and what the sampler's snapshot publishes."""

from __future__ import annotations

import time

import pytest

from vramwatch.rank import heartbeat as hbmod
from vramwatch.rank.heartbeat import BUCKETS, Heartbeat


def beats(monkeypatch, gaps):
    """A heartbeat stepped with these gaps (seconds) between steps on a fake monotonic clock."""
    now = [1000.0]
    monkeypatch.setattr(hbmod.time, "monotonic", lambda: now[0])
    hb = Heartbeat()
    hb.step()
    for g in gaps:
        now[0] += g
        hb.step()
    return hb


def test_a_fresh_heartbeat_publishes_nothing_yet():
    hb = Heartbeat()
    assert hb.loss is None and hb.grad_norm is None  # the HF callback writes these; None: none given yet
    snap = hb.snapshot()
    assert (snap.steps, snap.last_step_time, snap.sum, snap.loss, snap.grad_norm) == (0, 0.0, 0.0, None, None)
    assert snap.buckets == BUCKETS and snap.counts == (0,) * (len(BUCKETS) + 1)
    assert (snap.tokens, snap.samples) == (None, None)


def test_intervals_land_in_their_bucket_and_sum(monkeypatch):
    # bounds are inclusive upper bounds (Prometheus' le): 1 ms lands in le=0.001
    hb = beats(monkeypatch, [0.001, 0.0011, 0.3, 0.4, 5000.0])
    snap = hb.snapshot()
    i = {b: k for k, b in enumerate(BUCKETS)}
    want = [0] * (len(BUCKETS) + 1)
    want[i[0.001]] += 1
    want[i[0.0025]] += 1
    want[i[0.5]] += 2  # two intervals in one bucket
    want[-1] += 1  # beyond the last bound: +Inf only
    assert list(snap.counts) == want
    assert snap.steps == 6 and snap.sum == pytest.approx(0.001 + 0.0011 + 0.3 + 0.4 + 5000.0)


def test_the_first_step_has_no_interval(monkeypatch):
    hb = beats(monkeypatch, [])
    assert hb.steps == 1 and sum(hb.counts) == 0 and hb.sum == 0.0


def test_the_last_step_time_is_wall_clock():
    hb = Heartbeat()
    before = time.time()
    hb.step()
    assert before <= hb.snapshot().last_step_time <= time.time()


def test_loss_and_grad_norm_keep_the_newest_given():
    hb = Heartbeat()
    hb.step(loss=2.0, grad_norm=1.5)
    hb.step()  # a step without values keeps the last ones
    hb.step(loss=1.0)
    snap = hb.snapshot()
    assert (snap.loss, snap.grad_norm, snap.steps) == (1.0, 1.5, 3)


def test_tokens_and_samples_are_totals_and_absent_until_given():
    hb = Heartbeat()
    hb.step()
    assert (hb.snapshot().tokens, hb.snapshot().samples) == (None, None)
    hb.step(tokens=4096, samples=8)
    hb.step(tokens=4096)
    hb.step(samples=2)
    snap = hb.snapshot()
    assert (snap.tokens, snap.samples) == (8192.0, 10.0)
    assert isinstance(snap.tokens, float)


@pytest.mark.parametrize(
    "v,want", [(0, 0.0), (3, 3.0), (2.5, 2.5), (-1, None), (float("inf"), None), (True, None), ("7", None)]
)
def test_only_finite_non_negative_numbers_are_published_as_counts(v, want):
    hb = Heartbeat()
    hb.step(tokens=v)
    assert hb.snapshot().tokens == want


def test_a_loss_with_a_graph_is_detached_and_a_plain_one_kept():
    torch = pytest.importorskip("torch")
    w = torch.tensor(2.0, requires_grad=True)
    kept = hbmod._keep(w * 3)
    assert not kept.requires_grad and float(kept) == 6.0
    plain = torch.tensor(1.0)
    assert hbmod._keep(plain) is plain and hbmod._keep(4) == 4 and hbmod._keep(0.5) == 0.5

    class Odd:  # claims a graph, is no tensor
        requires_grad = True

    assert hbmod._keep(Odd()) is None


class _CudaScalar:  # a one-element CUDA tensor the job updates in place (no GPU here)
    is_cuda = True

    def __init__(self, value):
        self.value = value


class _Event:
    done = True

    def query(self):
        return self.done


class _Host:
    def __init__(self, value):
        self.value = value

    def item(self):
        return self.value


def test_a_device_loss_updated_in_place_is_copied_again_only_after_a_step():
    hb = Heartbeat()
    copies = []
    for r in hb._reads:
        r.cpu_clock = lambda: 0.0
        r.copy_behind = lambda t, _slots: copies.append(t.value) or (_Host(t.value), _Event())
    loss = _CudaScalar(0.5)
    hb.step(loss=loss, grad_norm=_CudaScalar(3.0))
    assert hb.snapshot().loss is None and copies == [0.5, 3.0]  # queued; read at a later sample
    assert hb.snapshot().loss == 0.5 and len(copies) == 2  # no step since: no second copy
    loss.value = 0.25  # the job's next step wrote into the same tensor
    hb.step(loss=loss)
    hb.snapshot()
    assert copies[2:] == [0.25, 3.0]  # one new copy each: the step count moved
    assert (hb.snapshot().loss, hb.snapshot().grad_norm) == (0.25, 3.0)
