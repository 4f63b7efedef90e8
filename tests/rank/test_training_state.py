"""What step() is given never breaks publishing (issue 45.5), phases, non-finite values, forked ranks (45.3)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time

import pytest

import vramwatch
from harness import child_env, wait_until
from vramwatch import spool
from vramwatch.server.collectors import ScrapeContext
from vramwatch.server.collectors.ranks import families


def _sample(h):
    h.tick()
    (s,) = spool.read_samples(h.spool_dir, 64)
    return s


def _exposed(h) -> dict[str, list]:
    s = _sample(h)
    return {f.name: [(x.labels, x.value) for x in f.samples] for f in families(ScrapeContext((s,), time.time(), "h"))}


# --- 45.5: hostile values ---


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5, 10**400, -(10**400), "7", True])
def test_a_bad_token_count_is_dropped_and_the_counter_goes_on(start_rank, bad):
    h = start_rank()
    vramwatch.step(tokens=100)
    vramwatch.step(tokens=bad)
    vramwatch.step(tokens=50)
    assert _sample(h).heartbeat.tokens == 150.0
    # and publishing goes on: OOMs included
    vramwatch.step(tokens=1)
    assert _sample(h).heartbeat.tokens == 151.0


def test_tokens_as_a_tensor_are_counted_off_the_training_thread(start_rank):
    torch = pytest.importorskip("torch")
    h = start_rank()
    mask = torch.ones(4, 8)
    for _ in range(3):
        vramwatch.step(tokens=mask.sum())  # the natural count: a tensor
    assert h.heartbeat.tokens is None  # nothing converted on the training thread
    assert _sample(h).heartbeat.tokens == 96.0
    vramwatch.step(tokens=5)
    vramwatch.step(tokens=torch.tensor(float("nan")))  # dropped on the sampler thread
    assert _sample(h).heartbeat.tokens == 101.0


class _Hostile:
    """A loss whose .item() raises what is not an Exception."""

    def item(self):
        raise KeyboardInterrupt

    def __float__(self):
        raise SystemExit(3)


def test_a_loss_whose_item_raises_a_base_exception_does_not_stop_the_sampler(start_rank):
    h = start_rank(interval=0.05)
    vramwatch.step(loss=_Hostile(), tokens=1)
    before = _sample(h).time
    wait_until(lambda: spool.read_samples(h.spool_dir, 64)[0].time > before + 0.1, 10, "the sampler to publish on")
    assert h._thread._thread.is_alive()


# --- 41.5: non-finite loss and grad norm ---


def test_a_nan_loss_is_exported_and_counted(start_rank):
    h = start_rank()
    vramwatch.step(loss=1.5, grad_norm=float("inf"))
    vramwatch.step(loss=float("nan"))
    got = _exposed(h)
    (loss,) = [v for _, v in got["vramwatch_training_loss"]]
    assert math.isnan(loss)  # exported, not removed, when it matters most
    (gn,) = [v for _, v in got["vramwatch_training_grad_norm"]]
    assert gn == float("inf")
    counts = {lab["value"]: v for lab, v in got["vramwatch_training_nonfinite"]}
    assert counts == {"loss": 1.0, "grad_norm": 1.0}
    vramwatch.step(loss=0.5)
    got = _exposed(h)
    assert [v for _, v in got["vramwatch_training_loss"]] == [0.5]
    assert {lab["value"]: v for lab, v in got["vramwatch_training_nonfinite"]} == {"loss": 1.0, "grad_norm": 1.0}


def test_a_tensor_loss_read_as_nan_on_the_sampler_thread_is_counted(start_rank):
    torch = pytest.importorskip("torch")
    h = start_rank()
    vramwatch.step(loss=torch.tensor(float("nan")))
    got = _exposed(h)
    assert math.isnan(got["vramwatch_training_loss"][0][1])
    assert {lab["value"]: v for lab, v in got["vramwatch_training_nonfinite"]} == {"loss": 1.0}
    _sample(h)  # no step since: the same value is not counted again
    assert {lab["value"]: v for lab, v in _exposed(h)["vramwatch_training_nonfinite"]} == {"loss": 1.0}


def test_no_nonfinite_counter_before_a_value_is_passed(start_rank):
    h = start_rank()
    vramwatch.step()
    assert _exposed(h)["vramwatch_training_nonfinite"] == []


# --- 41.4: phases ---


def test_phase_is_published_while_open_and_nests(start_rank):
    h = start_rank()
    vramwatch.step()
    assert _exposed(h)["vramwatch_training_phase_start_timestamp_seconds"] == []
    t0 = time.time()
    with vramwatch.phase("eval"):
        (lab, start), *_ = _exposed(h)["vramwatch_training_phase_start_timestamp_seconds"]
        assert lab["phase"] == "eval" and t0 - 1 <= start <= time.time()
        with vramwatch.phase("save"):
            got = _exposed(h)["vramwatch_training_phase_start_timestamp_seconds"]
            assert [lab["phase"] for lab, _ in got] == ["save"]
        got = _exposed(h)["vramwatch_training_phase_start_timestamp_seconds"]
        assert got == [(lab, start)]  # the outer one again, with its own start
    assert _exposed(h)["vramwatch_training_phase_start_timestamp_seconds"] == []


def test_an_undeclared_phase_name_is_other_and_a_phase_never_raises(start_rank, caplog):
    h = start_rank()
    with vramwatch.phase("my-custom-eval" * 100):
        got = _exposed(h)["vramwatch_training_phase_start_timestamp_seconds"]
        assert [lab["phase"] for lab, _ in got] == ["other"]
    with pytest.raises(ZeroDivisionError), vramwatch.phase("eval"):  # the job's exception goes through
        raise ZeroDivisionError
    assert _exposed(h)["vramwatch_training_phase_start_timestamp_seconds"] == []
    vramwatch.stop()
    with vramwatch.phase(None):  # type: ignore[arg-type]  # no exporter: nothing, no error
        pass


# --- 42.3: the data wait of track() ---


def test_track_counts_the_wait_for_each_batch(start_rank):
    h = start_rank()

    def slow():
        for i in range(3):
            time.sleep(0.05)
            yield i

    for _ in vramwatch.track(slow()):
        pass
    waits = {lab["kind"]: v for lab, v in _exposed(h)["vramwatch_training_wait_seconds"]}
    assert 0.14 <= waits["data"] < 1.0 and "collective" not in waits  # no process group here


# --- 45.3: forked ranks ---


def test_a_child_forked_after_start_exports_as_its_own_rank(tmp_path):
    spool_dir = str(tmp_path / "spool")
    code = textwrap.dedent(
        f"""
        import os, sys, time
        import vramwatch
        os.environ["RANK"] = "0"
        vramwatch.start(spool_dir={spool_dir!r}, serve="external", simulate=True, interval=0.05)
        pid = os.fork()
        if pid == 0:
            os.environ["RANK"] = "1"
            vramwatch.step()  # notebook_launcher's rank: no start() of its own, the parent's settings
            h = vramwatch.current()
            assert h is not None and h.identity.rank == 1, h
            for _ in range(5):
                vramwatch.step()
                time.sleep(0.05)
            vramwatch.stop()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        vramwatch.stop()
        """
    )
    p = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "was forked from one that had started vramwatch" in p.stderr
    finals = spool.read_spool(spool_dir, 16, 600.0, reap=False).final
    by_rank = {s.rank: s for s in finals}
    assert set(by_rank) == {0, 1} and by_rank[1].heartbeat.steps == 6 and by_rank[1].pid != by_rank[0].pid


def test_a_forked_child_that_never_steps_starts_nothing(start_rank):
    h = start_rank()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker
        code = 0 if vramwatch.current() is None else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert vramwatch.current() is h  # the parent's is untouched
