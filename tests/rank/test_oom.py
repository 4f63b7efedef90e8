"""OOM forensics on the simulated GPU: values, early publish, snapshots and their caps, never raising."""

from __future__ import annotations

import os
import pickle
import sys
import time
import types

import pytest

import vramwatch
from harness import wait_until
from vramwatch.rank import oom
from vramwatch.rank.oom import LAST_FREE, LAST_REQUESTED, LAST_TIME, OomWatcher, snapshot_files
from vramwatch.sim import SimAllocator, SimNode, SimOutOfMemoryError

GIB = 1 << 30


def _oom_message(sim, nbytes):
    with pytest.raises(SimOutOfMemoryError) as e:
        sim.allocate(nbytes)
    return e.value


def _small_sim(fraction_gib=8):
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    sim.set_memory_fraction(fraction_gib * GIB / sim._dev(0).total)
    return sim


def test_an_oom_is_counted_published_at_once_and_snapshotted(exporter, tmp_path):
    exp = exporter().start()
    snaps = tmp_path / "snaps"
    # a long interval: the OOM must reach the scrape through the early publish, not the next tick
    with vramwatch.start(
        simulate=True,
        serve="external",
        spool_dir=exp.spool,
        port=exp.port,
        interval=30,
        oom_snapshot_dir=str(snaps),
        rank=1,
        world_size=2,
    ) as h:
        sim = h.sim
        sim.init(0)
        sim.set_memory_fraction(8 * GIB / sim._dev(0).total)
        sim.allocate(6 * GIB)
        time.sleep(0.2)
        t0 = time.time()
        err = _oom_message(sim, 4 * GIB)
        # the job gets the allocator's own error, unchanged
        twin = _small_sim()
        twin.allocate(6 * GIB)
        plain = _oom_message(twin, 4 * GIB)
        assert type(err) is type(plain) and str(err) == str(plain)

        def scraped(name):
            return [(lab, v) for lab, v in exp.metrics().get(name, []) if lab.get("rank") == "1"]

        wait_until(
            lambda: [v for _, v in scraped("torch_cuda_memory_ooms_total")] == [1.0],
            5,
            "the OOM counter in a scrape within seconds of a 30 s interval",
        )
        assert [v for _, v in scraped("torch_cuda_memory_last_oom_requested_bytes")] == [4.0 * GIB]
        (free,) = [v for _, v in scraped("torch_cuda_memory_last_oom_free_bytes")]
        assert free == pytest.approx(2 * GIB, rel=1e-3)  # budget 8 GiB minus 6 GiB reserved
        (when,) = [v for _, v in scraped("torch_cuda_memory_last_oom_timestamp_seconds")]
        assert t0 - 1 <= when <= time.time()
        ((labels, one),) = scraped("vramwatch_oom_snapshot_info")
        assert one == 1.0 and os.path.dirname(labels["path"]) == str(snaps)
        (stamp,) = [v for _, v in scraped("vramwatch_oom_snapshot_timestamp_seconds")]
        assert t0 - 1 <= stamp <= time.time()
        with open(labels["path"], "rb") as fh:
            snap = pickle.load(fh)
        assert {"segments", "device_traces"} <= set(snap)
        held = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
        assert held == 6 * GIB
        assert h.oom.count == 1
        sim.allocate(1 * GIB)  # training goes on after a caught OOM


def _watcher(tmp_path, **kw):
    kw.setdefault("min_interval", 0.0)
    kw.setdefault("dump", lambda: {"segments": [], "device_traces": [[]], "pad": b"x" * 100_000})
    return OomWatcher(snapshot_dir=str(tmp_path), **kw)


def test_snapshots_are_capped_by_count_oldest_deleted_first(tmp_path):
    w = _watcher(tmp_path, max_files=3)
    for _ in range(6):
        w(0, GIB, 8 * GIB, 0)
        time.sleep(0.01)  # distinct mtimes
    files = snapshot_files(str(tmp_path))
    assert len(files) == 3
    assert [p.rsplit("-", 1)[1] for _, _, p in files] == ["4.pickle", "5.pickle", "6.pickle"]
    assert w.count == 6 and w.snapshots == 6
    assert w.last_path == files[-1][2]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_snapshots_are_capped_by_bytes(tmp_path):
    w = _watcher(tmp_path, max_files=100, max_bytes=250_000)
    for _ in range(5):
        w(0, GIB, 8 * GIB, 0)
        time.sleep(0.01)
    files = snapshot_files(str(tmp_path))
    assert len(files) == 2 and sum(sz for _, sz, _ in files) <= 250_000


def test_a_snapshot_larger_than_the_cap_is_not_written(tmp_path, caplog):
    w = _watcher(tmp_path, max_bytes=50_000)
    w(0, GIB, 8 * GIB, 123)
    assert os.listdir(tmp_path) == []  # nothing, not even a partial temporary file
    assert w.values[0][LAST_REQUESTED] == GIB and w.values[0][LAST_FREE] == 123  # still counted
    assert "larger than" in caplog.text


def test_one_snapshot_per_interval_however_many_ooms(tmp_path):
    w = _watcher(tmp_path, min_interval=60.0)
    for _ in range(20):  # a retry loop catching OOMs
        w(0, GIB, 8 * GIB, 0)
    assert len(snapshot_files(str(tmp_path))) == 1 and w.count == 20


def test_unwritable_directory_leaves_training_untouched(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with vramwatch.start(
        simulate=True,
        serve="external",
        spool_dir=str(tmp_path / "spool"),
        interval=0.05,
        oom_snapshot_dir=str(blocker / "snaps"),
    ) as h:
        sim = h.sim
        sim.init(0)
        sim.set_memory_fraction(8 * GIB / sim._dev(0).total)
        err = _oom_message(sim, 10 * GIB)
        assert "Tried to allocate" in str(err)
        assert h.oom.count == 1 and h.oom.snapshots == 0
        assert h.oom.values[0][LAST_REQUESTED] == 10 * GIB
        assert h.oom.last_snapshot is None
        sim.allocate(GIB)  # and on it goes
        vramwatch.step()


def test_a_full_disk_gets_no_snapshot(tmp_path):
    full = types.SimpleNamespace(total=100 * GIB, free=oom.DISK_RESERVE_RATIO * 100 * GIB - 1)
    w = _watcher(tmp_path, disk_usage=lambda d: full)
    w(0, GIB, 8 * GIB, 0)
    assert os.listdir(tmp_path) == [] and w.count == 1
    # room for the reserve plus less than the snapshot: the write stops at the room left, nothing remains
    tight = types.SimpleNamespace(total=100 * GIB, free=oom.DISK_RESERVE_RATIO * 100 * GIB + 50_000)
    w2 = _watcher(tmp_path, disk_usage=lambda d: tight)
    w2(0, GIB, 8 * GIB, 0)
    assert os.listdir(tmp_path) == []


def test_the_observer_never_raises(tmp_path):
    def broken_dump():
        raise RuntimeError("snapshot failed")

    w = _watcher(tmp_path, dump=broken_dump)
    w(0, GIB, 8 * GIB, 0)  # no exception
    w.values = None  # even a broken state inside
    w(0, GIB, 8 * GIB, 0)
    bad = _watcher(tmp_path, dump=lambda: {"unpicklable": lambda: None})
    bad(0, GIB, 8 * GIB, 0)
    assert snapshot_files(str(tmp_path)) == [] and not os.listdir(tmp_path)


def test_stop_detaches_from_the_simulated_allocator(tmp_path):
    h = vramwatch.start(simulate=True, serve="external", spool_dir=str(tmp_path / "spool"), interval=0.05)
    sim = h.sim
    assert sim.oom_observers == [h.oom]
    vramwatch.stop()
    assert sim.oom_observers == []


class _FakeTorch:
    """Just enough of torch for the attach logic (the real path runs in tests/gpu)."""

    def __init__(self, initialized=False, backend="native"):
        self.calls = []
        fake = self

        class cuda:
            @staticmethod
            def is_initialized():
                return initialized

            @staticmethod
            def get_allocator_backend():
                return backend

            class memory:
                @staticmethod
                def _record_memory_history(**kw):
                    fake.calls.append(("history", kw))

                @staticmethod
                def _snapshot():
                    return {"segments": [], "device_traces": []}

        class _C:
            @staticmethod
            def _cuda_attach_out_of_memory_observer(fn):
                fake.calls.append(("attach", fn))

        self.cuda, self._C = cuda, _C


def test_torch_observer_attaches_only_after_the_job_initialised_cuda(monkeypatch, tmp_path):
    fake = _FakeTorch(initialized=False)
    monkeypatch.setitem(sys.modules, "torch", fake)
    w = OomWatcher(snapshot_dir=str(tmp_path), history_entries=1000)
    w.on_sample()
    assert fake.calls == [] and not w.attached  # attaching would initialise CUDA for the job
    fake2 = _FakeTorch(initialized=True)
    monkeypatch.setitem(sys.modules, "torch", fake2)
    w.on_sample()
    w.on_sample()
    assert [c[0] for c in fake2.calls] == ["attach", "history"] and fake2.calls[0][1] is w
    assert fake2.calls[1][1] == {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 1000}
    w.close()
    assert fake2.calls[-1] == ("history", {"enabled": None})


def test_no_history_unless_asked_and_none_under_cuda_malloc_async(monkeypatch, tmp_path):
    fake = _FakeTorch(initialized=True)
    monkeypatch.setitem(sys.modules, "torch", fake)
    w = OomWatcher(snapshot_dir=str(tmp_path))  # history_entries=0: the default
    w.on_sample()
    assert [c[0] for c in fake.calls] == ["attach"]
    w.close()
    assert [c[0] for c in fake.calls] == ["attach"]  # we never touch a history we did not start
    asyn = _FakeTorch(initialized=True, backend="cudaMallocAsync")
    monkeypatch.setitem(sys.modules, "torch", asyn)
    w2 = OomWatcher()
    w2.on_sample()
    assert asyn.calls == [] and not w2.attached


def test_values_land_in_the_device_sample(tmp_path):
    w = OomWatcher()
    w(1, 3 * GIB, 80 * GIB, 2 * GIB)
    assert w.values[1][LAST_REQUESTED] == 3 * GIB and w.values[1][LAST_FREE] == 2 * GIB
    assert abs(w.values[1][LAST_TIME] - time.time()) < 5
    assert w.snapshots == 0  # no directory: no snapshot


# --- snapshots never follow a planted link nor write into a directory others control ---------------------------


def test_a_link_planted_at_the_temporary_name_is_never_followed(tmp_path, monkeypatch, caplog):
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's file")
    victim.chmod(0o600)
    snaps = tmp_path / "snaps"
    snaps.mkdir(mode=0o700)
    monkeypatch.setattr(oom.secrets, "token_hex", lambda n: "0" * 2 * n)  # a name the attacker guessed
    (snaps / f".{oom.PREFIX}{'0' * 16}.tmp").symlink_to(victim)
    w = _watcher(snaps)
    w(0, GIB, 8 * GIB, 0)  # no exception
    assert victim.read_bytes() == b"root's file"
    assert w.count == 1 and w.snapshots == 0 and "cannot create an OOM snapshot" in caplog.text


def test_a_link_planted_at_the_final_name_is_replaced_not_followed(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's file")
    snaps = tmp_path / "snaps"
    snaps.mkdir(mode=0o700)
    monkeypatch.setattr(oom.time, "strftime", lambda fmt, t: "20260101T000000")
    final = snaps / f"{oom.PREFIX}rank0-20260101T000000-{os.getpid()}-1{oom.SUFFIX}"
    final.symlink_to(victim)
    w = _watcher(snaps)
    w(0, GIB, 8 * GIB, 0)
    assert victim.read_bytes() == b"root's file"
    assert w.last_path == str(final) and not final.is_symlink() and pickle.loads(final.read_bytes())["pad"]


def test_a_directory_others_may_write_into_gets_no_snapshot(tmp_path, caplog):
    snaps = tmp_path / "shared"
    snaps.mkdir()
    snaps.chmod(0o777)  # anyone could plant links or swap files in it
    w = _watcher(snaps)
    w(0, GIB, 8 * GIB, 0)
    assert os.listdir(snaps) == [] and w.count == 1
    assert "writable by others (mode 777)" in caplog.text


def test_a_directory_of_another_user_gets_no_snapshot(tmp_path, monkeypatch, caplog):
    snaps = tmp_path / "theirs"
    snaps.mkdir(mode=0o700)
    real = os.geteuid()
    monkeypatch.setattr(oom.os, "geteuid", lambda: real + 4242)  # as if the directory were someone else's
    w = _watcher(snaps)
    w(0, GIB, 8 * GIB, 0)
    assert os.listdir(snaps) == [] and w.count == 1
    assert f"belongs to uid {real}, not {real + 4242}" in caplog.text


def test_a_missing_directory_is_made_private(tmp_path):
    w = _watcher(tmp_path / "new" / "snaps")
    w(0, GIB, 8 * GIB, 0)
    assert (tmp_path / "new" / "snaps").stat().st_mode & 0o777 == 0o700 and w.snapshots == 1


def test_a_full_disk_while_writing_is_one_clear_log_line_and_nothing_raised(tmp_path, monkeypatch, caplog):
    import errno

    real_write = os.write

    def full(fd, data):
        if fd > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(oom.os, "write", full)
    w = _watcher(tmp_path)
    for _ in range(3):
        w(0, GIB, 8 * GIB, 0)  # no exception into the job
    assert os.listdir(tmp_path) == [], "the partial file is removed"
    assert w.count == 3 and w.snapshots == 0
    lines = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path) in lines[0] and "No space left on device" in lines[0]


def test_the_oom_is_in_the_spool_before_the_job_sees_the_exception(start_rank, monkeypatch):
    from vramwatch import spool

    h = start_rank(interval=30)
    monkeypatch.setattr(h._thread, "wake", lambda: None)  # no help from the sampler thread
    sim = h.sim
    sim.init(0)
    sim.set_memory_fraction(8 * GIB / sim._dev(0).total)
    try:
        sim.allocate(16 * GIB)
    except SimOutOfMemoryError:
        (s,) = spool.read_samples(h.spool_dir, 64, reap=False)
        (dev,) = s.devices
        assert dev.values["torch_cuda_memory_ooms_total"] == 1.0 and dev.values[LAST_REQUESTED] == 16 * GIB
        assert not [n for n in os.listdir(h.spool_dir) if n.endswith(".tmp")], "renamed into place"
    else:
        raise AssertionError("no OOM")
