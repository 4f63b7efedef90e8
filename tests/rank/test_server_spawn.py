"""The rank side of ``serve="auto"``: when a rank starts the node's server, how, and what it says.

The end-to-end tests (tests/rank/test_api.py) run their ranks as child processes, so the spawner runs in
a process the test (and mutmut's coverage of it) never sees. Here ``ServerSpawner``, ``spawn_server``
and ``last_error`` are called directly: a test clock, a fake server process, the real spool locks.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from typing import Any

import pytest

from vramwatch import spool
from vramwatch._once import OnceLog
from vramwatch.config import Settings
from vramwatch.rank import server_spawn
from vramwatch.rank.server_spawn import SPAWN_BACKOFF_MAX, ServerSpawner, last_error, spawn_server
from vramwatch.spool import files

log = logging.getLogger("vramwatch")


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeServer:
    """A spawned server: running until ``exit(code)``; counts the polls."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.polls = 0

    def poll(self) -> int | None:
        self.polls += 1
        return self.returncode

    def exit(self, code: int) -> None:
        self.returncode = code


class Rig:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, spool_dir: str) -> None:
        self.clock = Clock()
        self.spool_dir = spool_dir
        self.spawned: list[tuple[Settings, str]] = []
        self.servers: list[FakeServer] = []
        monkeypatch.setattr(server_spawn, "time", types.SimpleNamespace(monotonic=self.clock))
        monkeypatch.setattr(server_spawn, "spawn_server", self._spawn)

    def _spawn(self, settings: Settings, spool_dir: str) -> FakeServer:
        self.spawned.append((settings, spool_dir))
        self.servers.append(FakeServer())
        return self.servers[-1]

    def spawner(self, node_daemon: bool | None = None, **settings: Any) -> ServerSpawner:
        s = Settings(**{"serve": "auto", **settings})
        once = OnceLog(log)
        if node_daemon is None:
            return ServerSpawner(s, self.spool_dir, once)
        return ServerSpawner(s, self.spool_dir, once, node_daemon)

    def at(self, t: float, sp: ServerSpawner) -> None:
        self.clock.now = 1000.0 + t
        sp.ensure()


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Rig:
    d = tmp_path / "spool"
    d.mkdir()
    return Rig(monkeypatch, str(d))


def _spawn_lock_free(spool_dir: str) -> bool:
    return not files.lock_held(os.path.join(spool_dir, files.SPAWN_LOCK))


@pytest.mark.parametrize(("serve", "node_daemon"), [("external", False), ("off", False), ("auto", True)])
def test_no_server_is_started_unless_serve_is_auto_and_no_node_daemon_serves(rig, serve, node_daemon):
    sp = rig.spawner(serve=serve, node_daemon=node_daemon)
    for t in (0.0, 10.0, 100.0):
        rig.at(t, sp)
    assert rig.spawned == []
    assert not os.path.exists(os.path.join(rig.spool_dir, files.SPAWN_LOCK)), "not even the lock is taken"


def test_the_first_tick_takes_the_spawn_lock_and_starts_one_server_then_watches_it(rig):
    sp = rig.spawner()  # node_daemon defaults to False: a rank of its own starts the server
    rig.at(0.0, sp)
    assert rig.spawned == [(sp.settings, rig.spool_dir)]
    assert not _spawn_lock_free(rig.spool_dir), "held while this rank's server runs"
    server = rig.servers[0]
    rig.at(1.999, sp)  # the next look is 2 s (the first backoff) after the start
    assert server.polls == 0
    rig.at(2.0, sp)
    assert server.polls == 1 and len(rig.spawned) == 1, "running: left alone"
    rig.at(6.999, sp)  # then every 5 s while it runs
    assert server.polls == 1
    rig.at(7.0, sp)
    assert server.polls == 2 and len(rig.spawned) == 1
    rig.at(12.0, sp)
    assert server.polls == 3 and len(rig.spawned) == 1
    sp.release()
    assert _spawn_lock_free(rig.spool_dir)
    sp.release()  # twice: nothing to close


def test_of_two_ranks_on_one_spool_only_the_lock_holder_starts_a_server(rig):
    a, b = rig.spawner(), rig.spawner()
    rig.at(0.0, a)
    rig.at(0.0, b)
    assert len(rig.spawned) == 1
    assert b._proc is None


def test_a_rank_without_the_spawn_lock_asks_again_two_seconds_later(rig):
    other = spool.hold_spawn_lock(rig.spool_dir)  # another rank is starting one
    assert other is not None
    sp = rig.spawner()
    rig.at(0.0, sp)
    assert rig.spawned == []
    os.close(other)  # that rank died before its server came up
    rig.at(1.999, sp)
    assert rig.spawned == []
    rig.at(2.0, sp)
    assert len(rig.spawned) == 1
    sp.release()


def test_a_server_that_exited_is_said_once_with_its_error_and_restarted_with_a_doubling_backoff(rig, caplog):
    log_path = os.path.join(rig.spool_dir, spool.SERVER_LOG)
    with open(log_path, "w") as fh:
        fh.write("2026-12-03 17:00:00,001 vramwatch INFO vramwatch: starting\n")
        fh.write("2026-12-03 17:00:00,002 vramwatch ERROR port 9400 is taken by pid 4242 (python)\n")
    sp = rig.spawner()
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        rig.at(0.0, sp)
        t, wait = 0.0, 2.0
        for backoff in (4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0):
            rig.servers[-1].exit(3)
            n = len(rig.spawned)
            rig.at(t + wait - 0.001, sp)  # not a moment before the backoff ends
            assert len(rig.spawned) == n
            t += wait
            rig.at(t, sp)
            assert len(rig.spawned) == n + 1, "restarted as soon as it ends"
            wait = backoff
    assert wait == SPAWN_BACKOFF_MAX
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            f"vramwatch: the server exited with 3: port 9400 is taken by pid 4242 (python); see {log_path}",
        )
    ]
    sp.release()


def test_a_server_someone_else_started_releases_the_lock_and_resets_the_backoff(rig, caplog):
    sp = rig.spawner()
    with caplog.at_level(logging.WARNING, logger="vramwatch"):
        rig.at(0.0, sp)
        rig.servers[0].exit(1)
        rig.at(2.0, sp)  # exited: restarted, the backoff now 4 s
        assert len(rig.spawned) == 2
        rig.servers[1].exit(1)
        other = spool.hold_lock(os.path.join(rig.spool_dir, files.SERVER_LOCK))  # another rank's server is up
        assert other is not None
        rig.at(6.0, sp)
        assert len(rig.spawned) == 2, "a server runs: none started"
        assert _spawn_lock_free(rig.spool_dir), "the lock is let go for the next rank"
        rig.at(10.999, sp)  # the next look is 5 s later
        os.close(other)  # that server left
        rig.at(10.999, sp)
        assert len(rig.spawned) == 2
        rig.at(11.0, sp)
        assert len(rig.spawned) == 3, "none runs: this rank starts one again"
        assert not _spawn_lock_free(rig.spool_dir)
        rig.servers[2].exit(1)
        rig.at(12.999, sp)  # the backoff is back at 2 s, not 8
        assert len(rig.spawned) == 3
        rig.at(13.0, sp)
        assert len(rig.spawned) == 4
    assert [r.getMessage().split(";")[0] for r in caplog.records] == ["vramwatch: the server exited with 1"]
    sp.release()


def test_a_running_server_found_first_is_left_alone_every_five_seconds(rig):
    other = spool.hold_lock(os.path.join(rig.spool_dir, files.SERVER_LOCK))
    sp = rig.spawner()
    rig.at(0.0, sp)
    rig.at(4.999, sp)
    os.close(other)
    rig.at(4.999, sp)
    assert rig.spawned == [] and _spawn_lock_free(rig.spool_dir)
    rig.at(5.0, sp)
    assert len(rig.spawned) == 1
    sp.release()


# --- spawn_server: the command, its environment, its log ---


class FakePopen:
    calls: list[tuple[list[str], dict[str, Any]]] = []

    def __init__(self, args: list[str], **kw: Any) -> None:
        kw["stdout"].write(b"child output\n")  # what the server writes goes to the log, after what was there
        FakePopen.calls.append((args, kw))


@pytest.fixture
def popen(monkeypatch: pytest.MonkeyPatch) -> type[FakePopen]:
    FakePopen.calls = []
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    return FakePopen


@pytest.mark.parametrize("config_file", ["/etc/vramwatch.toml", None])
def test_the_server_is_vramwatch_serve_in_its_own_session_with_the_ranks_settings(
    popen, monkeypatch, tmp_path, config_file
):
    if config_file:
        monkeypatch.setenv("VRAMWATCH_CONFIG_FILE", config_file)
    else:
        monkeypatch.delenv("VRAMWATCH_CONFIG_FILE", raising=False)
    monkeypatch.setenv("VRAMWATCH_SPOOL_DIR", "/somewhere/else")
    monkeypatch.setenv("JOB_SECRET_FREE_VAR", "kept")
    log_path = tmp_path / spool.SERVER_LOG
    log_path.write_bytes(b"an earlier server's line\n")
    settings = Settings(port=9555, interval=2.5)
    proc = spawn_server(settings, str(tmp_path))
    assert isinstance(proc, FakePopen)
    ((args, kw),) = popen.calls
    assert args == [sys.executable, "-m", "vramwatch", "serve", "--exit-when-idle"]
    env = kw["env"]
    assert env["VRAMWATCH_PORT"] == "9555" and env["VRAMWATCH_INTERVAL"] == "2.5", "the rank's own settings"
    assert env["VRAMWATCH_SPOOL_DIR"] == str(tmp_path), "the spool it was given"
    assert "VRAMWATCH_CONFIG_FILE" not in env, "already resolved into the variables"
    assert env["JOB_SECRET_FREE_VAR"] == "kept" and env["PATH"] == os.environ["PATH"]
    assert os.environ.get("VRAMWATCH_CONFIG_FILE") == config_file, "the rank's own environment untouched"
    assert kw["stdin"] == subprocess.DEVNULL
    assert kw["stdout"] is kw["stderr"], "one log"
    assert kw["stdout"].name == str(log_path) and kw["stdout"].closed, "the parent's copy closed after the start"
    assert kw["start_new_session"] is True and kw["close_fds"] is True
    assert set(kw) == {"env", "stdin", "stdout", "stderr", "start_new_session", "close_fds"}
    assert log_path.read_bytes() == b"an earlier server's line\nchild output\n", "appended"


def test_a_server_that_cannot_be_started_raises_and_leaves_no_log_open(monkeypatch, tmp_path):
    opened: list[Any] = []

    def fail(args: list[str], **kw: Any) -> None:
        opened.append(kw["stdout"])
        raise FileNotFoundError(2, "No such file or directory", args[0])

    monkeypatch.setattr(subprocess, "Popen", fail)
    with pytest.raises(FileNotFoundError):
        spawn_server(Settings(), str(tmp_path))
    assert opened and opened[0].closed


def test_a_spool_without_room_for_the_log_raises(tmp_path, popen):
    with pytest.raises(FileNotFoundError):
        spawn_server(Settings(), str(tmp_path / "gone"))
    assert popen.calls == []


# --- last_error: the server's last ERROR line, for the rank's "server exited" warning ---


def test_last_error_is_the_last_error_line_of_the_log(tmp_path):
    p = tmp_path / "server.log"
    p.write_text(
        "2026-12-03 17:00:00,001 vramwatch ERROR an older error\n"
        "2026-12-03 17:00:00,002 vramwatch ERROR bind failed: ERROR from the kernel  \n"
        "2026-12-03 17:00:00,003 vramwatch INFO vramwatch: shutting down\n"
    )
    assert last_error(str(p)) == ": bind failed: ERROR from the kernel"


def test_last_error_is_empty_without_a_log_or_an_error_line(tmp_path):
    assert last_error(str(tmp_path / "none.log")) == ""
    p = tmp_path / "server.log"
    p.write_text("2026-12-03 17:00:00,001 vramwatch INFO fine\n2026-12-03 17:00:00,002 vramwatch WARNING error here\n")
    assert last_error(str(p)) == ""
    p.write_text("")
    assert last_error(str(p)) == ""


def test_last_error_is_cut_at_500_characters_and_survives_bad_bytes(tmp_path):
    p = tmp_path / "server.log"
    p.write_bytes(b"t vramwatch INFO \xff\xfe binary\nt vramwatch ERROR caf\xc3\xa9 " + b"x" * 600 + b"\n")
    assert last_error(str(p)) == ": caf\u00e9 " + "x" * 495
    p.write_bytes(b"t vramwatch ERROR bad \xff byte\n")
    assert last_error(str(p)) == ": bad \ufffd byte"


def test_last_error_reads_only_the_last_8_kib(tmp_path):
    p = tmp_path / "server.log"
    head = b"t ERROR early\n"  # " ERROR " starts at byte 1
    p.write_bytes(head + b"i" * (8194 - len(head) - 1) + b"\n")  # ... 8193 bytes before the end: outside
    assert last_error(str(p)) == ""
    p.write_bytes(head + b"i" * (8193 - len(head) - 1) + b"\n")  # 8192 bytes before the end: inside
    assert last_error(str(p)) == ": early"
