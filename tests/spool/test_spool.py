from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import time

import pytest
from samples import rank_sample

from vramwatch import spool
from vramwatch.spool import files


def sample(rank: int = 0, t: float = 1.0, **kw) -> spool.RankSample:
    return rank_sample(rank, world_size=8, time=t, **kw)


def _hold_and_wait(spool_dir, rank, ready, done):
    pub = spool.RankPublisher(spool_dir, rank)
    pub.publish(sample(rank, time.time()))
    ready.set()
    done.wait(30)


def test_publish_is_atomic_and_readable(tmp_path):
    pub = spool.RankPublisher(str(tmp_path), 3)
    pub.publish(sample(3, 1.0))
    (s,) = spool.read_samples(str(tmp_path), 64)
    assert (s.rank, s.pid, s.time) == (3, os.getpid(), 1.0)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    pub.close()
    # the last sample stays as the rank's final one, its lock gone; a reader without grace reaps it
    assert os.listdir(tmp_path) == [os.path.basename(pub.path)]
    assert [s.time for s in spool.read_spool(str(tmp_path), 64, 60.0, now=2.0).final] == [1.0]
    assert spool.read_samples(str(tmp_path), 64) == []
    assert os.listdir(tmp_path) == []


def test_dead_rank_is_reaped_live_rank_kept(tmp_path):
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_and_wait, args=(str(tmp_path), 1, ready, done))
    p.start()
    assert ready.wait(10)
    assert [s.rank for s in spool.read_samples(str(tmp_path), 64)] == [1]
    os.kill(p.pid, signal.SIGKILL)
    p.join(5)
    assert spool.read_samples(str(tmp_path), 64) == []
    assert os.listdir(tmp_path) == []


def test_newest_sample_wins_per_rank_and_cap(tmp_path):
    pubs = [spool.RankPublisher(str(tmp_path / "a"), r) for r in range(5)]
    for i, p in enumerate(pubs):
        p.publish(sample(i, float(i)))
    assert [s.rank for s in spool.read_samples(str(tmp_path / "a"), 3)] == [0, 1, 2]
    for p in pubs:
        p.close()


def test_server_lock(tmp_path):
    d = str(tmp_path)
    assert not spool.server_running(d)
    fd = spool.hold_lock(os.path.join(d, spool.SERVER_LOCK))
    assert fd is not None
    assert spool.server_running(d)
    assert spool.hold_lock(os.path.join(d, spool.SERVER_LOCK)) is None
    os.close(fd)
    assert not spool.server_running(d)


def test_forked_child_does_not_keep_a_dead_parent_alive(tmp_path):
    # parent publishes, forks a long-lived child (a DataLoader worker), then dies
    ctx = mp.get_context("fork")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the "rank"
        try:
            pub = spool.RankPublisher(str(tmp_path), 0)
            pub.publish(sample(0, time.time()))
            child = ctx.Process(target=time.sleep, args=(30,), daemon=False)
            child.start()
            os.write(w, str(child.pid).encode())
        finally:
            os._exit(0)  # dies without cleanup, the worker lives on
    os.close(w)
    child_pid = int(os.read(r, 32))
    os.waitpid(pid, 0)
    try:
        # the worker drops its copy of the lock right after fork; give it a moment to be scheduled
        deadline = time.monotonic() + 5
        while spool.read_samples(str(tmp_path), 64) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert spool.read_samples(str(tmp_path), 64) == []
    finally:
        os.kill(child_pid, signal.SIGKILL)


def test_a_torn_record_is_never_parsed(tmp_path):
    pub = spool.RankPublisher(str(tmp_path), 0)
    pub.publish(sample(0, 1.0, collectors={"x" * 100: spool.CollectorHealth(1, 0, 0.0)}))
    pub.publish(sample(0, 2.0))  # shorter than the first: the stale tail must be ignored
    (s,) = spool.read_samples(str(tmp_path), 64)
    assert s == sample(0, 2.0)
    with open(pub.path, "r+b") as fh:  # flip a payload byte: what a reader sees mid-write
        fh.seek(len(files.frame(b"")) + 3)
        fh.write(b"#")
    assert spool.read_samples(str(tmp_path), 64) == []
    pub.publish(sample(0, 3.0))
    assert spool.read_samples(str(tmp_path), 64)[0].time == 3.0
    pub.close()


def test_a_dead_ranks_final_sample_is_served_for_its_grace_whoever_reads_then_removed(tmp_path):
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_and_wait, args=(str(tmp_path), 2, ready, done))
    p.start()
    assert ready.wait(10)
    os.kill(p.pid, signal.SIGKILL)
    p.join(5)
    d, now = str(tmp_path), time.time()
    assert spool.read_samples(d, 64, reap=False) == []
    assert os.listdir(tmp_path), "a reader that does not reap leaves the files"
    for _ in range(5):  # any number of reads, reaping or not: nothing uses the window up
        read = spool.read_spool(d, 64, 30.0, now=now + 29)
        assert read.live == [] and [(s.rank, s.hostname) for s in read.final] == [(2, "node-a")]
        assert spool.read_spool(d, 64, 30.0, now=now, reap=False).final == read.final
    assert spool.read_spool(d, 64, 30.0, now=now + 31).final == []  # the window is over: removed
    assert os.listdir(tmp_path) == []


def test_a_spool_removed_under_a_publishing_rank_is_made_again(tmp_path, caplog):
    d = str(tmp_path / "spool")
    pub = spool.RankPublisher(d, 2)
    try:
        pub.publish(sample(2, 1.0))
        for removed_at in (2.0, 3.0):  # twice: the new file and lock are watched like the first ones
            shutil.rmtree(d)
            pub.publish(sample(2, removed_at))
            (s,) = spool.read_samples(d, 64)
            assert s.time == removed_at
            assert os.stat(d).st_mode & 0o777 == 0o700
            assert files.lock_held(files.lock_path_of(pub.path)), "the rank's new lock is held"
        assert caplog.text.count("vanished under this rank") == 2
        pub.publish(sample(2, 4.0))  # and in place again from then on
        assert spool.read_samples(d, 64)[0].time == 4.0
    finally:
        pub.close()
    assert os.listdir(d) == [os.path.basename(pub.path)], "only the final sample stays, no lock or temp file"


def test_a_spool_removed_before_the_first_publish_is_made_again(tmp_path):
    d = str(tmp_path / "spool")
    pub = spool.RankPublisher(d, 0)
    shutil.rmtree(d)
    pub.publish(sample(0, 1.0))
    assert [s.time for s in spool.read_samples(d, 64)] == [1.0]
    pub.close()


def test_a_spool_that_cannot_be_made_again_raises_and_recovers_later(tmp_path):
    d = str(tmp_path / "spool")
    pub = spool.RankPublisher(d, 0)
    pub.publish(sample(0, 1.0))
    shutil.rmtree(d)
    with open(d, "w"):  # a file where the directory was
        pass
    for _ in range(2):  # the rank's handle logs it once; every publish tries again
        with pytest.raises(OSError):
            pub.publish(sample(0, 2.0))
    os.unlink(d)
    pub.publish(sample(0, 3.0))
    assert [s.time for s in spool.read_samples(d, 64)] == [3.0]
    pub.close()


def test_a_final_sample_stamped_in_the_future_is_not_kept_for_ever(tmp_path):
    pub = spool.RankPublisher(str(tmp_path), 0)
    pub.publish(sample(0, 10_000.0))
    pub.close()
    assert spool.read_spool(str(tmp_path), 64, 30.0, now=9_980.0, reap=False).final
    assert spool.read_spool(str(tmp_path), 64, 30.0, now=100.0).final == []
    assert os.listdir(tmp_path) == []


def _dead(d: str, rank: int, t: float) -> None:
    pub = spool.RankPublisher(d, rank)
    pub.publish(sample(rank, t))
    pub.close()  # in this process: its lock is gone, the file stays as a final sample


def test_final_samples_have_a_cap_of_their_own_oldest_dropped_first_and_counted(tmp_path):
    d = str(tmp_path)
    live = [spool.RankPublisher(d, r) for r in range(3)]
    for r, p in enumerate(live):
        p.publish(sample(r, 100.0))
    for r in range(10, 5010):  # 5,000 fake dead ranks
        with open(os.path.join(d, f"rank-{r}-{r}.json"), "wb") as fh:
            fh.write(files.frame(spool.encode_sample(sample(r, 50.0 + r / 1000))))
    read = spool.read_spool(d, 8, 3600.0, now=100.0)
    assert [s.rank for s in read.live] == [0, 1, 2]
    # the newest, up to a cap apart from the live ranks': live ranks never push a final sample out
    assert [s.rank for s in read.final] == list(range(5009, 5001, -1))
    assert read.dropped["dead_rank"] == 4992 and len(read.evicted) == 4992
    assert len([n for n in os.listdir(d) if n.endswith(".json")]) == 3 + 8, "the dropped ones are removed"
    assert spool.read_spool(d, 8, 3600.0, now=100.0).dropped["dead_rank"] == 0  # counted once
    for p in live:
        p.close()


def test_live_ranks_beyond_the_cap_are_counted(tmp_path):
    d = str(tmp_path)
    pubs = [spool.RankPublisher(d, r) for r in range(5)]
    for r, p in enumerate(pubs):
        p.publish(sample(r, 1.0))
    read = spool.read_spool(d, 3, 60.0)
    assert [s.rank for s in read.live] == [0, 1, 2] and read.dropped["rank"] == 2
    for p in pubs:
        p.close()
