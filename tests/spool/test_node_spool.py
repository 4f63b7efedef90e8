"""The node root's checks in one process (tests/system/test_node_daemon.py runs them across real uids):
when a rank trusts a node root, and what the daemon refuses in a user's directory."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from vramwatch import spool
from vramwatch.spool import files, node


def _root(parent: Path, mode: int = node.ROOT_MODE, lock: bool = True) -> Path:
    root = parent / "vramwatch"
    root.mkdir()
    root.chmod(mode)
    if lock:
        (root / files.SERVER_LOCK).touch()
    return root


@pytest.fixture
def parent(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    return tmp_path


def test_a_rank_trusts_a_root_with_the_daemons_lock_in_a_directory_nobody_else_writes(parent: Path) -> None:
    root = _root(parent)
    assert node.daemon_root(str(root)) == str(root)
    assert node.daemon_root("") is None
    assert node.daemon_root(str(parent / "absent")) is None


def test_a_rank_ignores_a_root_anyone_could_have_made(parent: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = parent / "shm"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp or /dev/shm
    root = _root(shared)
    assert node.daemon_root(str(root)) is None
    assert "writable by others" in caplog.text


def test_a_rank_ignores_a_root_without_sticky_bit_or_with_a_foreign_lock(parent: Path) -> None:
    private = parent / "a"
    private.mkdir()
    assert node.daemon_root(str(_root(private, 0o700))) is None  # a rank-started server's spool
    b = parent / "b"
    b.mkdir()
    root = _root(b)
    os.chown(root / files.SERVER_LOCK, 64009, 64009)  # planted by another user
    assert node.daemon_root(str(root)) is None
    c = parent / "c"
    c.mkdir()
    root = _root(c, lock=False)
    os.symlink("/etc/passwd", root / files.SERVER_LOCK)
    assert node.daemon_root(str(root)) is None


def test_the_daemon_refuses_a_file_others_may_write(tmp_path: Path, rank_sample: Any) -> None:
    root = tmp_path / "root"
    node.ensure_root(str(root))
    assert stat.S_IMODE(root.stat().st_mode) == node.ROOT_MODE
    mine = Path(node.user_dir(str(root)))
    assert mine.name == f"u{os.geteuid()}"
    pub = spool.RankPublisher(str(mine), 3, shared=True)
    pub.publish(rank_sample(3, local_rank=0, hostname="h", time=1.0))
    assert stat.S_IMODE(Path(pub.path).stat().st_mode) == node.FILE_MODE
    assert [s.rank for s in spool.read_spool(str(root), 64, 0.0, now=1.0).live] == [3]
    os.chmod(pub.path, 0o660)  # group-writable: the group is the daemon's, and the rank's user must not share it
    read = spool.read_spool(str(root), 64, 0.0, now=1.0)
    assert read.live == [] and [r.why for r in read.refused] == ["writable by others (mode 0660)"]
    assert read.dropped["refused"] == 1
    pub.close()


def test_a_job_spool_reads_as_before(tmp_path: Path) -> None:
    """A rank-started server's private spool is no node root: one directory, of no owner to check."""
    spool.ensure_dir(str(tmp_path / "s"))
    assert not node.is_node_root(str(tmp_path / "s"))
    assert [(d.uid, d.path) for d in node.open_dirs(str(tmp_path / "s"))] == [(None, str(tmp_path / "s"))]


def test_the_daemon_removes_a_users_directory_left_empty(tmp_path: Path) -> None:
    """Jobs over, their files reaped: the user's directory goes after EMPTY_DIR_GRACE (a fallback one too)."""
    root = tmp_path / "root"
    node.ensure_root(str(root))
    old, fresh, used = (root / f"u{os.geteuid()}{s}" for s in ("", "-0123456789abcdef", "-fedcba9876543210"))
    for d in (old, fresh, used):
        node.claim(str(d), os.geteuid())
    (used / "rank-1-1.lock").touch()  # a rank's lock (a live rank's, or a dead one's until its sample is reaped)
    now = time.time()
    for d in (old, used):
        os.utime(d, (now - node.EMPTY_DIR_GRACE - 1, now - node.EMPTY_DIR_GRACE - 1))
    spool.read_spool(str(root), 64, 1.0, now=now, reap=False)
    assert old.exists()  # only a reaping read removes
    spool.read_spool(str(root), 64, 1.0, now=now)
    assert not old.exists() and fresh.exists() and used.exists()


@pytest.mark.parametrize("write", ["server_info", "readings"])
def test_the_daemons_temporary_files_never_follow_a_planted_symlink(tmp_path: Path, write: str) -> None:
    """Any local user may create entries in the root (3733): a symlink planted where the daemon writes its
    temporary file must not be followed, even where fs.protected_symlinks is 0 (as on this machine)."""
    root = tmp_path / "root"
    node.ensure_root(str(root))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = files.SERVER_INFO if write == "server_info" else files.NODE_READINGS
    for name in (f"{target}.{os.getpid()}.tmp", f"{target}.tmp", f".{target}.tmp"):  # the names a writer could use
        os.symlink(victim, root / name)
    if write == "server_info":
        files.write_server_info(str(root), {"pid": 1, "port": 9})
    else:
        spool.write_node_readings(str(root), [spool.GpuReadings("GPU-a", 1.0)], now=1.0)
    assert victim.read_text() == "precious"
    assert (root / target).is_file() and not (root / target).is_symlink()
    leftovers = {p.name for p in root.iterdir()} - {target, files.SERVER_LOCK}
    assert all((root / n).is_symlink() for n in leftovers), leftovers  # only the planted links, no temporary file


def test_a_symlink_in_a_private_spool_is_refused_not_followed(tmp_path: Path, rank_sample) -> None:
    """A private spool's files are opened under its directory descriptor with O_NOFOLLOW, as a user's are."""
    d = tmp_path / "s"
    spool.ensure_dir(str(d))
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(files.frame(spool.encode_sample(rank_sample(1))))
    os.symlink(elsewhere, d / "rank-1-1.json")
    read = spool.read_spool(str(d), 64, 60.0, reap=False)
    assert read.live == read.final == [] and [r.why for r in read.refused] == ["a symlink"]
