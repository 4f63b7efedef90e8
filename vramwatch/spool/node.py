"""The node daemon's spool: one root that every user's ranks publish into, one directory per user in it.

The layout (docs/security.md states the threat model and which test proves each line):

- ``<root>``: the daemon's (owner: the daemon user, group: its group), mode 3733: setgid and sticky,
  others may create entries and traverse but not list, nor remove or rename what is not theirs. systemd
  makes it (``RuntimeDirectory=``, deploy/systemd/); ``ensure_root`` when the daemon runs by hand.
- ``<root>/server.lock``, ``server.json``, ``nvml.json``: the daemon's, 0644, so ranks can tell it runs.
- ``<root>/u<uid>``: a user's, made by their rank, mode 2770. It is in the daemon's group (the root's
  setgid bit makes it so although the user is not in that group) and so is every file made in it, the
  rank's sample and lock at 0640: the daemon reads through the group; other users cannot even traverse.
  The group may also write: the daemon, the group's one member, removes dead ranks' files after their
  grace window as it does in a rank-started server's spool (else they stay on the tmpfs until reboot).
- ``<root>/u<uid>-<hex>``: the same, when ``u<uid>`` is taken by someone else (squatted).

The daemon attributes what it reads to the kernel's owner of the directory and of each file, which
must agree; never to anything a file says. Whatever does not fit (a symlink, a file of another owner,
a directory named for another uid, a writable-by-others entry, a FIFO) is refused, one log line each.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from vramwatch.spool import files

log = logging.getLogger("vramwatch")

ROOT_MODE = 0o3733
USER_DIR_MODE = 0o2770
FILE_MODE = 0o640
SHARED_MODE = 0o644  # the daemon's own files in the root: ranks flock and read them
EMPTY_DIR_GRACE = 300.0  # seconds a user's directory stays empty before the daemon removes it

USER_DIR = re.compile(r"^u(\d+)(?:-[0-9a-f]{16})?$")

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a symlink, never block on a FIFO


def user_dir_name(uid: int) -> str:
    return f"u{uid}"


def is_node_root(path: str) -> bool:
    """Whether ``path`` is a node root (sticky: a rank-started server's spool is a private 0700 one)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_ISVTX)


# ---------------------------------------------------------------- the daemon's side


def ensure_root(path: str) -> None:
    """Make the root as systemd would (3733) when the daemon runs by hand; refuse one it does not own."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, ROOT_MODE)  # mkdir's mode loses setgid and sticky to some kernels and to the umask
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"node spool root {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"node spool root {path} belongs to uid {st.st_uid}, not to this daemon's uid")
    if stat.S_IMODE(st.st_mode) != ROOT_MODE:
        os.chmod(path, ROOT_MODE)


@dataclass(frozen=True, slots=True)
class Refused:
    """An entry of the spool the server will not read, and why (logged once per entry and reason)."""

    entry: str  # its path under the root
    why: str

    def describe(self) -> str:
        return f"refused {self.entry}: {self.why}; nothing of it is exported"


class SpoolDir:
    """A directory of rank files, opened once (O_NOFOLLOW): every name is looked up in that directory, never
    through a path that could be swapped. A user's directory in the node root has its owner's ``uid``, and every
    file in it must be a regular one of that owner that nobody else may write; a rank-started server's private
    spool (0700, one user) has ``uid`` None."""

    def __init__(self, fd: int, uid: int | None, path: str, refused: list[Refused], root_fd: int = -1) -> None:
        self.fd, self.uid, self.path, self._refused = fd, uid, path, refused
        self._root_fd = root_fd
        # the kernel's change time of each file opened: a lock's is when its rank started (nobody can set it
        # back), which settles which of two users publishing one job id came first
        self.ctime: dict[str, float] = {}

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def _open(self, name: str, unreadable: int | None = None) -> int | None:
        """The checked file, or None; ``unreadable`` is returned when it exists but cannot be opened."""
        try:
            fd = os.open(name, _OPEN, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                self._refused.append(Refused(f"{self.path}/{name}", "a symlink"))
                return None
            return unreadable
        st = os.fstat(fd)
        why = ""
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif self.uid is not None and st.st_uid != self.uid:
            why = f"belongs to uid {st.st_uid}, its directory to uid {self.uid}"
        elif self.uid is not None and st.st_mode & 0o022:
            why = f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
        if why:
            os.close(fd)
            self._refused.append(Refused(f"{self.path}/{name}", why))
            return None
        self.ctime[name] = st.st_ctime
        return fd

    def lock_free(self, name: str) -> bool:
        fd = self._open(name, unreadable=-1)
        if fd == -1:
            return False  # there, but not ours to open (mode 0600 from another tool): never reap what may live
        if fd is None:
            return True  # no lock of this owner: its rank is gone (or it never was one)
        return files.probe_lock(fd)

    def read(self, name: str, limit: int) -> bytes | None:
        fd = self._open(name)
        return None if fd is None else _read_and_close(fd, limit)

    def remove(self, *names: str) -> None:
        for n in names:
            try:
                os.unlink(n, dir_fd=self.fd)
            except OSError:
                pass

    def remove_if_stale(self, now: float) -> None:
        """Remove this directory once empty for ``EMPTY_DIR_GRACE`` s (the daemon owns the sticky root, so it
        may): the user's jobs are over, and a fallback ``u<uid>-<hex>`` would otherwise stay until reboot.
        A rank makes its lock in it right after making it, so a directory a rank is about to use is never
        empty that long; a rank that finds its directory gone makes it again (RankPublisher). A private spool
        stays: its server runs in it."""
        if self._root_fd < 0:
            return
        try:
            if os.listdir(self.fd) or now - os.fstat(self.fd).st_mtime < EMPTY_DIR_GRACE:
                return
            os.rmdir(os.path.basename(self.path), dir_fd=self._root_fd)
        except OSError:
            pass  # not empty any more (ENOTEMPTY), or gone

    def close(self) -> None:
        os.close(self.fd)


def _read_and_close(fd: int, limit: int) -> bytes | None:
    """At most ``limit`` bytes of the open file ``fd``, or None if it cannot be read. It asks for the file's size
    and one more (a read allocates what it asks for: a whole MiB per sample of a few KiB cost more than the rest)."""
    try:
        return os.read(fd, min(limit, os.fstat(fd).st_size + 1))
    except OSError:
        return None
    finally:
        os.close(fd)


# the root's own files (the daemon's), never read as a user's
_DAEMON_FILES = frozenset(
    {files.SERVER_LOCK, files.SERVER_INFO, files.SPAWN_LOCK, files.SERVER_LOG, files.NODE_READINGS}
)


def open_dirs(spool_dir: str, refused: list[Refused] | None = None) -> Iterator[SpoolDir]:
    """The directories whose samples a server reads: its own spool, or each user's in a node root.

    Raises OSError at once when the spool itself cannot be listed (a read then has nothing). Each user's
    directory is closed once the caller moves on to the next (or stops)."""
    refused = [] if refused is None else refused
    if not is_node_root(spool_dir):
        return _closing(
            SpoolDir(os.open(spool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), None, spool_dir, refused)
        )
    root_fd = os.open(spool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        names = sorted(os.listdir(root_fd))
    except OSError:
        os.close(root_fd)
        raise
    return _user_dirs(root_fd, names, spool_dir, refused)


def _closing(d: SpoolDir) -> Iterator[SpoolDir]:
    try:
        yield d
    finally:
        d.close()


def _user_dirs(root_fd: int, names: list[str], root: str, refused: list[Refused]) -> Iterator[SpoolDir]:
    me = os.geteuid()
    try:
        for name in names:
            d = _open_user_dir(root_fd, name, root, me, refused)
            if d is None:
                continue
            try:
                yield d
            finally:
                d.close()
    finally:
        os.close(root_fd)


def _open_user_dir(root_fd: int, name: str, root: str, me: int, refused: list[Refused]) -> SpoolDir | None:
    entry = f"{root}/{name}"
    try:
        lst = os.lstat(name, dir_fd=root_fd)
    except OSError:
        return None  # gone since the listing
    if lst.st_uid == me and (name in _DAEMON_FILES or not stat.S_ISDIR(lst.st_mode)):
        return None  # the daemon's own
    m = USER_DIR.match(name)
    if stat.S_ISLNK(lst.st_mode):
        why = "a symlink"
    elif not stat.S_ISDIR(lst.st_mode):
        why = f"not a user directory (a file of uid {lst.st_uid})"
    elif m is None:
        why = f"not named u<uid> (a directory of uid {lst.st_uid})"
    elif int(m.group(1)) != lst.st_uid:
        why = f"named for uid {m.group(1)} but belongs to uid {lst.st_uid}"
    elif lst.st_mode & 0o007:
        why = f"open to other users (mode {stat.S_IMODE(lst.st_mode):04o})"
    else:
        why = ""
    if why:
        refused.append(Refused(entry, why))
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError as e:
        refused.append(Refused(entry, f"cannot be opened ({e.strerror}): not in the daemon's group?"))
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino, st.st_uid) != (lst.st_dev, lst.st_ino, lst.st_uid):  # swapped in between
        os.close(fd)
        refused.append(Refused(entry, "replaced while it was opened"))
        return None
    return SpoolDir(fd, st.st_uid, entry, refused, root_fd)


# ---------------------------------------------------------------- the rank's side


def daemon_root(node_dir: str) -> str | None:
    """The node daemon's root if one is set up at ``node_dir`` (its server lock is there), else None.

    Trusted only where nobody but root could have made it: a root in a directory others may write
    (/tmp, /dev/shm) could be anyone's, pretending to be the daemon to collect the ranks' samples."""
    if not node_dir:
        return None
    try:
        st = os.lstat(node_dir)
        if not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
            return None
        parent = os.stat(os.path.dirname(os.path.abspath(node_dir)))
        lock = os.lstat(os.path.join(node_dir, files.SERVER_LOCK))
    except OSError:
        return None
    if parent.st_mode & 0o022:
        log.warning("vramwatch: ignoring the node spool %s: its parent directory is writable by others", node_dir)
        return None
    if not stat.S_ISREG(lock.st_mode) or lock.st_uid != st.st_uid:
        log.warning(
            "vramwatch: ignoring the node spool %s: its %s is not the daemon's (uid %d)",
            node_dir,
            files.SERVER_LOCK,
            st.st_uid,
        )
        return None
    return node_dir


def user_dir(root: str) -> str:
    """This user's directory in ``root``, made if needed: ``u<uid>``, or a fresh ``u<uid>-<hex>`` when that
    name is taken by something this user cannot trust (logged). Raises OSError when none can be made."""
    uid = os.geteuid()
    own = os.path.join(root, user_dir_name(uid))
    why = claim(own, uid)
    if not why:
        return own
    log.warning("vramwatch: refused %s: %s; publishing into a directory of a new name", own, why)
    for _ in range(3):
        alt = f"{own}-{os.urandom(8).hex()}"  # secrets.token_hex, without hmac/hashlib/libcrypto
        try:
            _mkdir(alt)
        except FileExistsError:
            continue
        why = _unusable(alt, uid)
        if not why:
            return alt
        raise PermissionError(f"cannot publish into the node spool {root}: {alt} {why}")
    raise FileExistsError(f"cannot make a directory of this user's in {root}")


def claim(path: str, uid: int) -> str:
    """Make ``path`` this user's directory, or say why an existing one cannot be ('' when it is fine)."""
    try:
        _mkdir(path)
    except FileExistsError:
        pass
    return _unusable(path, uid)


def _unusable(path: str, uid: int) -> str:
    try:
        st = os.lstat(path)
        root = os.stat(os.path.dirname(path))
    except OSError as e:
        return f"cannot be looked at ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}"
    if st.st_gid != root.st_gid or not st.st_mode & stat.S_ISGID:
        return f"it is not in the daemon's group {root.st_gid} (the root lacks its setgid bit, or it was chmod-ed)"
    if stat.S_IMODE(st.st_mode) != USER_DIR_MODE:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not {USER_DIR_MODE:04o}"
    return ""


def _mkdir(path: str) -> None:
    """mkdir 2770 without a chmod: a chmod by a user outside the directory's group clears its setgid bit,
    and files made in it afterwards would no longer be in the daemon's group. The umask (a usual one, 022,
    takes the group's write bit) is set aside for the one call; it is the process's: that instant is the cost."""
    old = os.umask(0o007)
    try:
        os.mkdir(path, 0o770)
    finally:
        os.umask(old)


def share(fd: int) -> None:
    """A rank's file in its user directory: readable by the daemon's group (whatever the umask made it)."""
    os.fchmod(fd, FILE_MODE)
