"""No user blinds another on a node daemon: per-owner shares of the rank and series budgets, final samples kept
apart from the live cap, one owner per job id. The daemon's reader in one process, as root, on a node root whose
user directories and files belong to test uids (tests/system/test_node_daemon.py runs real uids)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from samples import rank_sample

from vramwatch import spool
from vramwatch.server.collectors import ScrapeContext, ranks
from vramwatch.server.collectors.rank_view import RankView
from vramwatch.spool import files, limits, node

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to other uids")

ALICE, BOB = 64102, 64101  # bob's directory is listed first
OOMS = "torch_cuda_memory_ooms_total"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    node.ensure_root(str(r))
    return r


class User:
    """A user's directory in the root and the ranks they publish (their locks held here: live)."""

    def __init__(self, root: Path, uid: int) -> None:
        self.uid = uid
        self.dir = root / node.user_dir_name(uid)
        self.dir.mkdir()
        os.chown(self.dir, uid, root.stat().st_gid)
        self.dir.chmod(node.USER_DIR_MODE)
        self.locks: list[int] = []

    def _own(self, path: Path) -> None:
        os.chown(path, self.uid, -1)
        path.chmod(node.FILE_MODE)

    def publish(self, rank: int, t: float, job_id: str, live: bool = True, pid: int = 0, **kw) -> Path:
        pid = pid or 1000 + rank
        s = rank_sample(rank, world_size=64, pid=pid, time=t, job_id=job_id, **kw)
        path = self.dir / (files.rank_stem(rank, pid, job_id) + ".json")
        path.write_bytes(files.frame(spool.encode_sample(s)))
        self._own(path)
        if live:
            lock = Path(files.lock_path_of(str(path)))
            fd = files.hold_lock(str(lock))
            assert fd is not None
            self._own(lock)
            self.locks.append(fd)
        return path

    def close(self) -> None:
        for fd in self.locks:
            os.close(fd)


def _dev(**values: float) -> tuple[spool.DeviceSample, ...]:
    return (spool.DeviceSample(0, "GPU-0", {OOMS: 0.0, "torch_cuda_memory_allocated_bytes": 1.0, **values}),)


def _render(view: RankView, now: float) -> tuple[str, spool.SpoolRead]:
    from prometheus_client import CollectorRegistry, generate_latest

    read, carried = view.read(now)
    ctx = ScrapeContext(tuple(read.live), now, "node-a", tuple(read.final), carried)

    class _Static:
        def collect(self):
            return list(ranks.families(ctx))

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Static())
    return generate_latest(reg).decode(), read


def test_one_user_publishing_64_fake_ranks_does_not_hide_anothers(root: Path) -> None:
    bob, alice = User(root, BOB), User(root, ALICE)
    try:
        for r in range(64):
            bob.publish(r, 100.0, "000-fake")  # sorts before every real job id
        alice.publish(0, 100.0, "slurm-77", devices=_dev())
        alice.publish(1, 100.0, "slurm-77", devices=_dev())
        view = RankView(str(root), 64, 30.0)
        for t in range(100, 123):  # every scrape
            read = view.read(float(t))[0]
            assert [s.rank for s in read.live if s.job_id == "slurm-77"] == [0, 1]
            assert len(read.live) == 64 and read.dropped["rank"] == 2  # bob's share: what alice leaves
    finally:
        bob.close()
        alice.close()


def test_a_flood_never_evicts_another_users_final_sample(root: Path) -> None:
    bob, alice = User(root, BOB), User(root, ALICE)
    try:
        oom = alice.publish(0, 99.0, "slurm-77", live=False, devices=_dev(**{OOMS: 1.0}))  # the OOM that killed it
        for r in range(64):
            bob.publish(r, 100.0, "000-fake")  # live ranks filling the cap
        for r in range(100, 600):
            bob.publish(r, 100.0 + r / 1000, "000-fake", live=False)  # and newer fake dead ones
        view = RankView(str(root), 64, 30.0)
        for t in (100.0, 101.0, 110.0):
            text, read = _render(view, t)
            assert f'{OOMS}{{device="0",job_id="slurm-77",local_rank="0",rank="0",uuid="GPU-0"}} 1.0' in text
        assert oom.exists(), "alice's final sample is never evicted by bob's flood"
        assert len([s for s in read.final if s.job_id == "000-fake"]) == 63  # bob's share of the final cap
    finally:
        bob.close()
        alice.close()


def test_one_user_cannot_push_tens_of_thousands_of_series_into_a_scrape(root: Path) -> None:
    bob, alice = User(root, BOB), User(root, ALICE)
    buckets = tuple(float(i) for i in range(1, 1001))  # a histogram of 1,000 buckets in each sample
    hb = spool.HeartbeatSnapshot(1, 99.0, buckets, tuple([0] * 1001), 0.0)
    try:
        for r in range(64):
            bob.publish(r, 100.0, "000-fake", heartbeat=hb)
        alice.publish(0, 100.0, "slurm-77", devices=_dev())
        text, read = _render(RankView(str(root), 64, 30.0), 100.0)
        series = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert len(series) <= 64 * limits.SERIES_PER_RANK, len(series)
        assert len(text) < 2_000_000, len(text)
        assert 'job_id="slurm-77"' in text
        assert sum(limits.series(s) for s in read.live) <= 64 * limits.SERIES_PER_RANK
    finally:
        bob.close()
        alice.close()


def test_a_user_claiming_another_jobs_id_does_not_replace_its_series(root: Path) -> None:
    alice = User(root, ALICE)
    bob = User(root, BOB)
    try:
        alice.publish(0, 100.0, "slurm-42", devices=_dev(**{OOMS: 1.0}))
        time.sleep(0.02)  # bob comes later: his lock is younger
        forged = bob.publish(0, 100.5, "slurm-42", pid=9, devices=_dev(**{OOMS: 0.0}))  # newer, other values
        view = RankView(str(root), 64, 30.0)
        for t in (101.0, 102.0):
            text, read = _render(view, t)
            assert [(s.job_id, s.pid) for s in read.live] == [("slurm-42", 1000)], "alice's rank, not bob's"
            assert f'{OOMS}{{device="0",job_id="slurm-42",local_rank="0",rank="0",uuid="GPU-0"}} 1.0' in text
            assert [f.entry for f in read.refused] == [f"{bob.dir}/{forged.name}"]
            assert "slurm-42" in read.refused[0].why and str(ALICE) in read.refused[0].why
        bob.publish(1, 103.0, "bob-own")  # his own job id is his
        assert {s.job_id for s in view.read(103.0)[0].live} == {"slurm-42", "bob-own"}
    finally:
        alice.close()
        bob.close()


def test_a_job_id_stays_with_the_owner_seen_first(root: Path) -> None:
    """Once attributed, a job id stays its owner's while any of its ranks (live or final) is there."""
    bob = User(root, BOB)
    alice = User(root, ALICE)
    try:
        alice.publish(0, 100.0, "slurm-42", live=False, devices=_dev(**{OOMS: 1.0}))  # her rank OOMed, died
        view = RankView(str(root), 64, 30.0)
        assert [s.job_id for s in view.read(100.5)[0].final] == ["slurm-42"]
        bob.publish(0, 101.0, "slurm-42", pid=9)  # a live rank under her job id: would take her label set
        read = view.read(101.5)[0]
        assert read.live == [] and [s.pid for s in read.final] == [1000]
        assert len(read.refused) == 1
    finally:
        alice.close()
        bob.close()
