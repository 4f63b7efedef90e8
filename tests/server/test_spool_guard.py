"""The server's spool removed under it: noticed, made again, counted, and alertable while it cannot be."""

from __future__ import annotations

import json
import os
import shutil

from vramwatch import spool
from vramwatch.server.collectors import Health
from vramwatch.server.spool_guard import SpoolGuard


def test_a_removed_spool_is_made_again_with_lock_and_server_json(tmp_path, caplog):
    d = str(tmp_path / "spool")
    guard, health = SpoolGuard(d), Health()
    assert guard.take()
    guard.write_info({"pid": os.getpid(), "host": "127.0.0.1", "port": 9})
    guard.check(health)
    assert health.errors == 0 and guard.intact()
    shutil.rmtree(d)
    assert not guard.intact()
    guard.check(health)
    assert guard.intact() and guard.trouble == "" and health.errors == guard.vanished == 1
    assert spool.server_running(d), "the lock is held in the new spool"
    assert os.stat(d).st_mode & 0o777 == 0o700
    with open(os.path.join(d, spool.SERVER_INFO)) as fh:
        assert json.load(fh)["port"] == 9
    assert "vanished" in caplog.text
    guard.check(health)
    assert health.errors == guard.vanished == 1  # counted once
    guard.release()
    assert not spool.server_running(d) and not os.path.exists(os.path.join(d, spool.SERVER_INFO))


def test_a_spool_replaced_by_another_directory_is_noticed(tmp_path):
    """A rank made the spool again first: the inode changed, the server's lock is on the old one."""
    d = str(tmp_path / "spool")
    guard, health = SpoolGuard(d), Health()
    assert guard.take()
    shutil.rmtree(d)
    os.makedirs(d, mode=0o700)
    assert not guard.intact()
    guard.check(health)
    assert guard.intact() and spool.server_running(d) and health.errors == 1
    guard.release()


def test_a_spool_that_cannot_be_made_again_is_trouble_until_it_can(tmp_path, caplog):
    d = str(tmp_path / "spool")
    guard, health = SpoolGuard(d), Health()
    assert guard.take()
    shutil.rmtree(d)
    with open(d, "w"):  # a file where the directory was
        pass
    for _ in range(3):
        guard.check(health)
    assert guard.trouble and d in guard.trouble
    assert health.errors == 1 and caplog.text.count("cannot be made again") == 1
    os.unlink(d)
    guard.check(health)
    assert guard.trouble == "" and guard.intact()
    guard.release()


def test_a_removed_node_root_is_made_again_as_the_unit_makes_it(tmp_path):
    """The node daemon's root (deploy/systemd/): 3733 again, and a lock every user's ranks may open."""
    from vramwatch.spool import node

    d = str(tmp_path / "run-vramwatch")
    guard, health = SpoolGuard(d, node_daemon=True), Health()
    assert guard.take()
    shutil.rmtree(d)
    guard.check(health)
    assert guard.intact() and health.errors == 1
    assert os.stat(d).st_mode & 0o7777 == node.ROOT_MODE
    assert os.stat(os.path.join(d, spool.SERVER_LOCK)).st_mode & 0o777 == node.SHARED_MODE
    assert spool.server_running(d)
    guard.release()
    assert not spool.server_running(d)


def test_an_intact_spool_is_left_alone_and_a_remade_one_logged_once(tmp_path, caplog):
    d = str(tmp_path / "spool")
    guard, health = SpoolGuard(d), Health()
    assert guard.take()
    guard.write_info({"port": 9})
    with open(os.path.join(d, spool.SERVER_INFO)) as fh:
        assert json.load(fh) == {"port": 9}
    for _ in range(3):
        guard.check(health)
    assert caplog.messages == [] and health.errors == 0
    shutil.rmtree(d)
    for _ in range(3):
        guard.check(health)
    assert caplog.messages == [
        f"vramwatch: the spool {d} vanished (removed at logout by RemoveIPC, or by hand); made it again, "
        "ranks publish there again"
    ]
    shutil.rmtree(d)  # a second vanishing is counted again
    guard.check(health)
    assert health.errors == guard.vanished == 2 and len(caplog.messages) == 2
    guard.release()


def test_a_removed_lock_file_or_a_renamed_spool_is_noticed(tmp_path):
    """A clean-up of the spool's files, or `mv spool spool.old`: the lock is no longer where ranks look."""
    d = str(tmp_path / "spool")
    guard, health = SpoolGuard(d), Health()
    assert guard.take()
    os.unlink(os.path.join(d, spool.SERVER_LOCK))  # same directory, the lock file gone
    assert not guard.intact()
    guard.check(health)
    assert guard.intact() and spool.server_running(d)
    os.rename(d, d + ".old")  # the old lock still has its name, in the old directory
    os.makedirs(d, mode=0o700)
    assert not guard.intact()
    guard.check(health)
    assert guard.intact() and spool.server_running(d) and health.errors == 2
    guard.release()


def test_remaking_the_spool_leaks_no_descriptor(tmp_path):
    d = str(tmp_path / "spool")
    guard, health = SpoolGuard(d), Health()
    assert guard.take()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        shutil.rmtree(d)
        guard.check(health)
    assert guard.intact() and len(os.listdir("/proc/self/fd")) == before
    guard.release()


def test_a_second_server_neither_takes_nor_releases_the_first_ones_spool(tmp_path):
    for node_daemon in (False, True):
        d = str(tmp_path / f"spool-{node_daemon}")
        first, second = SpoolGuard(d, node_daemon), SpoolGuard(d, node_daemon)
        assert first.take()
        first.write_info({"port": 9})
        assert not second.take()
        assert not second.intact()
        second.release()  # a server that did not start releases what it holds: nothing
        assert spool.server_running(d) and os.path.exists(os.path.join(d, spool.SERVER_INFO))
        first.release()
        first.release()  # twice is harmless
        assert not first.intact()
        assert not spool.server_running(d) and not os.path.exists(os.path.join(d, spool.SERVER_INFO))


def test_trouble_says_which_file_failed_and_why(tmp_path, caplog):
    d = str(tmp_path / "spool")
    guard, health = SpoolGuard(d), Health()
    assert guard.take()
    guard.write_info({"port": 9})
    shutil.rmtree(d)
    os.makedirs(os.path.join(d, spool.SERVER_INFO), mode=0o700)  # the new spool, with server.json a directory
    os.chmod(d, 0o700)
    guard.check(health)
    where = os.path.join(d, spool.SERVER_INFO)
    assert guard.trouble == f"{where}: Is a directory"
    assert caplog.messages == [
        f"vramwatch: the spool {d} vanished and cannot be made again ({where}: Is a directory); no rank is seen"
    ]
    guard.release()


def test_a_new_spool_another_server_locked_first_is_trouble_naming_it(tmp_path):
    d = str(tmp_path / "spool")
    guard, health = SpoolGuard(d), Health()
    assert guard.take()
    shutil.rmtree(d)
    other = SpoolGuard(d)  # started by a rank in the gap
    assert other.take()
    guard.check(health)
    assert guard.trouble == f"{d}: the server lock is held by another process"
    other.release()
    guard.check(health)
    assert guard.trouble == "" and guard.intact()
    guard.release()
