"""Starting the node's server from a rank when none runs (``serve="auto"``).

Eight local ranks finding no server at once: only the one holding the spool's spawn lock starts
it. A server that exits is restarted with a doubling backoff (at most ``SPAWN_BACKOFF_MAX``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from vramwatch import spool
from vramwatch._once import OnceLog
from vramwatch.config import Settings

SPAWN_BACKOFF_MAX = 60.0


class ServerSpawner:
    def __init__(self, settings: Settings, spool_dir: str, log_once: OnceLog, node_daemon: bool = False) -> None:
        self.settings = settings
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
            self._next_check = now + 5.0
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
