"""The server's hold on its spool: the lock, ``server.json``, and the directory staying the one it took.

A spool removed under a running job (systemd-logind's RemoveIPC at logout, a clean-up script) leaves
the server holding a lock on a deleted file and listing a directory that is gone: it would serve
``vramwatch_ranks 0`` with no alert while ranks make the spool again. :meth:`SpoolGuard.check`, called
on the server's one-second loop, notices (the directory's device and inode changed, or the lock file
lost its name), makes the spool again with the checks of the start, takes the lock there and rewrites
``server.json``; each time it is counted as a spool error. While it cannot, :attr:`SpoolGuard.trouble`
says why, and the spool collector reads ``up`` 0 (the exporter's collector-down alert).
"""

from __future__ import annotations

import errno
import logging
import os

from vramwatch import spool
from vramwatch.server.collectors import Health
from vramwatch.spool import files, node

log = logging.getLogger("vramwatch")


class SpoolGuard:
    def __init__(self, spool_dir: str, node_daemon: bool = False) -> None:
        self.dir = spool_dir
        self.node = node_daemon  # the node root (3733, ranks of every user), not a private spool
        self.lock_fd: int | None = None
        self.trouble = ""  # why the spool is unusable now; empty while it is fine
        self.vanished = 0  # times it vanished (each counted once in the health's errors)
        self._info: dict[str, object] | None = None
        self._id: tuple[int, int] | None = None
        self._info_due = False  # server.json to write again into a spool made again

    def take(self) -> bool:
        """Make the spool and take the server lock; False if another server holds it."""
        self.ensure_dir()
        self.lock_fd = self._hold_lock()
        if self.lock_fd is None:
            return False
        self._id = self._dir_id()
        return True

    def ensure_dir(self) -> None:
        if self.node:
            node.ensure_root(self.dir)
        else:
            spool.ensure_dir(self.dir)

    def _hold_lock(self) -> int | None:
        fd = spool.hold_lock(os.path.join(self.dir, spool.SERVER_LOCK))
        if fd is not None and self.node:
            os.fchmod(fd, node.SHARED_MODE)  # every user's ranks open it to ask whether the daemon runs
        return fd

    def write_info(self, info: dict[str, object]) -> None:
        """``server.json``: where this server listens (raises OSError naming the file)."""
        self._info = info
        spool.write_server_info(self.dir, info)

    def intact(self) -> bool:
        if self.lock_fd is None or self._id is None:
            return False
        try:
            return self._dir_id() == self._id and os.fstat(self.lock_fd).st_nlink > 0
        except OSError:
            return False

    def check(self, health: Health) -> None:
        """Make the spool again if it vanished; counts it in ``health`` and logs it. Never raises."""
        intact = self.intact()
        if intact and not self._info_due:
            return
        if not intact and not self.trouble:
            health.errors += 1  # one vanishing, counted once however long the spool takes to come back
            self.vanished += 1
        try:
            if not intact:
                self._relock()
            if self._info_due and self._info is not None:
                spool.write_server_info(self.dir, self._info)
            self._info_due = False
        except OSError as e:
            why = f"{e.filename or self.dir}: {e.strerror or e}"
            if why != self.trouble:
                log.error(
                    "vramwatch: the spool %s vanished and cannot be made again (%s); no rank is seen", self.dir, why
                )
            self.trouble = why
            return
        self.trouble = ""
        log.warning(
            "vramwatch: the spool %s vanished (removed at logout by RemoveIPC, or by hand); made it again, "
            "ranks publish there again",
            self.dir,
        )

    def _relock(self) -> None:
        self.ensure_dir()
        fd = self._hold_lock()
        if fd is None:  # another server (started by a rank in the gap) holds the new one; retried next check
            raise BlockingIOError(errno.EAGAIN, "the server lock is held by another process", self.dir)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
        self.lock_fd, self._id = fd, self._dir_id()
        self._info_due = True

    def release(self) -> None:
        """Remove ``server.json`` and drop the lock, if this server holds it (else both are another's)."""
        if self.lock_fd is not None:
            files.remove_quietly(os.path.join(self.dir, spool.SERVER_INFO))
            os.close(self.lock_fd)
            self.lock_fd = None

    def _dir_id(self) -> tuple[int, int]:
        st = os.stat(self.dir)
        return st.st_dev, st.st_ino
