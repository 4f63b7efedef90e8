"""The spool directory's file names, its locks and the framing of a rank's sample file.

Every file in the spool is named here and nowhere else:

- ``rank-<rank>-<pid>-<job_id>.json``: one rank's newest sample, rewritten in place on every publish
  (a length + CRC header lets a reader detect a write in progress). The job id
  (:mod:`vramwatch.rank.identity`, letters, digits and ``_.-`` only) keeps the same rank of two jobs
  on one node apart; ``rank-<rank>-<pid>.json``, without it, is a rank of a version before job ids. The
  ``<pid>`` is ``pid + n * PID_SPAN`` when a dead process of the same pid, rank and job left its files (a
  container restarted beside a surviving spool is PID 1 again): its final sample is never written over;
- ``rank-<rank>-<pid>[-<job_id>].lock``: held with ``flock`` by the rank for its whole life. The kernel drops
  the lock when the process dies, however it dies (SIGKILL included), so a reader can tell a
  wedged rank (lock held, sample ageing) from a dead one (lock free: its files are reaped);
- ``server.lock``: held the same way by the node's server, so ranks can tell whether one runs;
- ``server.json``: the running server's address and pid;
- ``spawn.lock``: held by the one rank that starts the server when none runs;
- ``server.log``: the spawned server's stdout and stderr;
- ``nvml.json``: the server's NVML readings for the ranks' status lines (:mod:`.readings`).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import tempfile
import zlib

from vramwatch.spool.schema import JOB_ID

SERVER_LOCK = "server.lock"
SERVER_INFO = "server.json"
SPAWN_LOCK = "spawn.lock"
SERVER_LOG = "server.log"
NODE_READINGS = "nvml.json"

# rank, pid, job id (absent before job ids); the digits end at the first "-", so a job id may hold any
RANK_FILE = re.compile(rf"^rank-(\d+)-(\d+)(?:-({JOB_ID.pattern}))?\.json$")
# no pid reaches it (the kernel's PID_MAX_LIMIT): a process whose pid's name is a dead one's takes pid + n * this
PID_SPAN = 1 << 22


def process_id(instance: int) -> int:
    """The pid behind a rank's file name and sample pid (``pid + n * PID_SPAN``): what NVML lists it as."""
    return instance % PID_SPAN


_MAGIC = b"VWS1"
_HEADER = struct.Struct("<4sII")  # magic, payload length, CRC32 of the payload


def rank_stem(rank: int, pid: int, job_id: str = "") -> str:
    """The name of a rank's files without the suffix; ``job_id`` is a bounded one (``rank.identity``)."""
    return f"rank-{rank}-{pid}-{job_id}" if job_id else f"rank-{rank}-{pid}"


def sample_path(spool_dir: str, stem: str) -> str:
    return os.path.join(spool_dir, stem + ".json")


def lock_path_of(sample_file: str) -> str:
    """The lock beside a rank's sample file."""
    return sample_file[: -len(".json")] + ".lock"


def ensure_dir(path: str) -> None:
    """Make the spool private (0700). In a world-writable parent such as /dev/shm anyone could have made the
    directory first, to read the samples or plant fake ones: one owned by another user there is refused."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    uid = os.getuid()
    st, lst = os.stat(path), os.lstat(path)
    if uid not in (st.st_uid, lst.st_uid) or st.st_uid != lst.st_uid:
        parent = os.stat(os.path.dirname(os.path.abspath(path)) or "/")
        if parent.st_mode & 0o002:
            raise PermissionError(
                f"spool {path} belongs to uid {st.st_uid}, in a world-writable directory; remove it or set spool_dir"
            )
    elif st.st_mode & 0o077:
        os.chmod(path, 0o700)


def write_server_info(spool_dir: str, info: dict[str, object]) -> None:
    """Replace ``server.json`` whole (a reader never sees half of it). Raises OSError naming the file: on a
    full tmpfs the write fails with ENOSPC, and a server that cannot say where it listens must say so."""
    path = os.path.join(spool_dir, SERVER_INFO)
    try:
        replace_file(path, json.dumps(info).encode())
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), path) from None


def replace_file(path: str, data: bytes) -> None:
    """Write ``data`` to a new file and rename it over ``path``: whole or not at all, 0644 (the node daemon's
    files are read by every user's ranks).

    The new file is mkstemp's, ``O_EXCL | O_NOFOLLOW`` under a name nobody can guess: in a node daemon's root
    any local user may create entries, and a symlink planted at a predictable temporary name would have
    the daemon write through it where ``fs.protected_symlinks`` is 0."""
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=folder)
    try:
        with open(fd, "wb") as fh:
            os.fchmod(fd, 0o644)
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def probe_lock(fd: int) -> bool:
    """True if nobody holds the flock of the open file ``fd`` (we take and drop it at once); closes ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing releases the lock if we took it
    return True


def lock_held(path: str) -> bool:
    """Whether someone holds ``path``'s flock. Opened read-only: the node daemon's lock is 0644, and a rank
    opens it to ask."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    return not probe_lock(fd)


def hold_lock(path: str) -> int | None:
    """Open and lock ``path`` for the life of the process; None if another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def server_running(spool_dir: str) -> bool:
    """Whether a server (a rank-started one, or the node daemon in its root) holds the spool's server lock."""
    return lock_held(os.path.join(spool_dir, SERVER_LOCK))


def hold_spawn_lock(spool_dir: str) -> int | None:
    return hold_lock(os.path.join(spool_dir, SPAWN_LOCK))


def frame(payload: bytes) -> bytes:
    """A record: header (magic, length, CRC) then the payload."""
    return _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload


def unframe(raw: bytes) -> bytes | None:
    """The payload of a complete record, or None (a write in progress, or not a record)."""
    if len(raw) < _HEADER.size:
        return None
    magic, length, crc = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size : _HEADER.size + length]
    if magic == _MAGIC and len(payload) == length and zlib.crc32(payload) == crc:
        return payload
    return None


def remove_quietly(*paths: str) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass
