"""Starting the node's server from a rank when none runs (``serve="auto"``).

Eight local ranks finding no server at once: only the one holding the spool's spawn lock starts it. A
server that exits is restarted with a doubling backoff (at most ``SPAWN_BACKOFF_MAX``).

A server that runs with other settings than this rank's (``server.json``; a rank-started server outlives
its job by its grace and linger, and the next run would meet it) is named in one line with the
difference (under ``serve: external`` the server's settings are its operator's: nothing is compared). A
rank-started one that serves no other job's live ranks is asked to leave (SIGTERM) and this rank starts
its own; one that serves another job is replaced once that job is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from vramwatch import spool
from vramwatch._once import OnceLog
from vramwatch.config import Settings, server_settings

SPAWN_BACKOFF_MAX = 60.0


class ServerSpawner:
    def __init__(
        self, settings: Settings, spool_dir: str, log_once: OnceLog, node_daemon: bool = False, job_id: str = ""
    ) -> None:
        self.settings = settings
        self.job_id = job_id  # this rank's job: a server serving only it (and dead ranks) may be replaced
        self.node_daemon = node_daemon  # the node's daemon serves this rank: never start one
        self.spool_dir = spool_dir
        self.log_once = log_once
        self._proc: subprocess.Popen | None = None
        self._spawn_lock_fd: int | None = None
        self._next_check = 0.0
        self._backoff = 2.0

    def ensure(self) -> None:
        """Called on each tick: start a server if none runs and it is this rank's turn."""
        if self.settings.serve != "auto" or self.node_daemon:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._next_check = now + 5.0
            return
        if spool.server_running(self.spool_dir):
            self._proc = None
            self.release()
            self._backoff = 2.0
            self._next_check = now + (0.5 if self._check_settings() else 5.0)
            return
        if proc is not None:  # ours exited and no server runs: back off before the next try
            log_path = os.path.join(self.spool_dir, spool.SERVER_LOG)
            self.log_once(
                "server-exit",
                "vramwatch: the server exited with %s%s; see %s",
                proc.returncode,
                last_error(log_path),
                log_path,
            )
            self._backoff = min(self._backoff * 2, SPAWN_BACKOFF_MAX)
        elif self._spawn_lock_fd is None:
            self._spawn_lock_fd = spool.hold_spawn_lock(self.spool_dir)
            if self._spawn_lock_fd is None:
                self._next_check = now + 2.0
                return
        self._proc = spawn_server(self.settings, self.spool_dir)
        self._next_check = now + self._backoff

    def _check_settings(self) -> bool:
        """Say in one line how the running server's settings differ from this rank's; True when it was asked
        to leave (a rank-started server serving no other job), so that this rank starts its own."""
        info = read_server_info(self.spool_dir)
        theirs = info.get("settings")
        if not isinstance(theirs, dict):
            return False  # a server of a version that does not say: nothing to compare
        ours = server_settings(self.settings)
        diff = [f"{k} {theirs.get(k)!r}, here {v!r}" for k, v in ours.items() if theirs.get(k) != v]
        if not diff:
            return False
        pid = info.get("pid")
        where = f"the server of {self.spool_dir} (pid {pid}) runs with other settings ({'; '.join(diff)})"
        if info.get("exit_when_idle") is not True or not _is_server(pid):
            self.log_once(
                ("server-settings", pid), "vramwatch: %s; no rank started it: restart it to change them", where
            )
            return False
        other = live_jobs(self.spool_dir, self.settings) - {self.job_id}
        if other:
            self.log_once(
                ("server-settings", pid),
                "vramwatch: %s; it serves job(s) %s, and is replaced once they are gone",
                where,
                ", ".join(sorted(other)),
            )
            return False
        self.log_once(("server-replaced", pid), "vramwatch: %s; it serves no other job: replacing it", where)
        assert isinstance(pid, int)
        _terminate(pid)
        return True

    def release(self) -> None:
        if self._spawn_lock_fd is not None:
            os.close(self._spawn_lock_fd)
            self._spawn_lock_fd = None


def last_error(log_path: str) -> str:
    """': <the last ERROR line of the server's log>' (e.g. who squats the port), or '' if none."""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - 8192))
            tail = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in reversed(tail):
        _, sep, msg = line.partition(" ERROR ")
        if sep:
            return ": " + msg.strip()[:500]
    return ""


def spawn_server(settings: Settings, spool_dir: str) -> subprocess.Popen:
    """Start ``vramwatch serve`` for the node, in its own session, exiting once the ranks are gone."""
    env = dict(os.environ)
    env.update(settings.to_env())
    env["VRAMWATCH_SPOOL_DIR"] = spool_dir
    env.pop("VRAMWATCH_CONFIG_FILE", None)  # already resolved into the variables above
    logf = open(os.path.join(spool_dir, spool.SERVER_LOG), "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "vramwatch", "serve", "--exit-when-idle"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        logf.close()


def read_server_info(spool_dir: str) -> dict[str, Any]:
    """``server.json`` of the server holding the spool ({} when absent or unreadable)."""
    try:
        with open(os.path.join(spool_dir, spool.SERVER_INFO), encoding="utf-8") as fh:
            info = json.load(fh)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def live_jobs(spool_dir: str, settings: Settings) -> set[str]:
    """The jobs of the ranks alive in the spool (dead ranks' final samples are no job to serve)."""
    read = spool.read_spool(spool_dir, settings.max_ranks, settings.dead_rank_grace_seconds, reap=False)
    return {s.job_id for s in read.live}


def _is_server(pid: object) -> bool:
    """Whether ``pid`` is a `vramwatch serve` now (server.json may name a pid reused since its server died)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    return b"vramwatch" in argv and b"serve" in argv


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)  # the server closes its port and drops its lock (serve()'s handler)
    except OSError:
        pass  # gone already


def stop_idle_server(spool_dir: str, settings: Settings, wait: float = 5.0) -> bool:
    """Stop the rank-started server of ``spool_dir`` when no rank is alive there (the demo's end: its grace
    and linger would keep the port bound for ~100 s); True once no server holds the spool."""
    info = read_server_info(spool_dir)
    pid = info.get("pid")
    if not spool.server_running(spool_dir):
        return True
    if info.get("exit_when_idle") is not True or not _is_server(pid) or live_jobs(spool_dir, settings):
        return False
    assert isinstance(pid, int)
    _terminate(pid)
    end = time.monotonic() + wait
    while spool.server_running(spool_dir):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True
