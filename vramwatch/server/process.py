"""Settings of the ``vramwatch serve`` process itself, made once before its threads start.

The server owns its interpreter (it is always a process of its own, never inside a training job), so
it may tune what is process-wide:

- the GIL's switch interval: the event loop answers a scrape in well under a millisecond, but when a
  background thread (a render, a collector's read) holds the GIL, the loop waits for it up to
  ``sys.getswitchinterval()`` (5 ms by default), which is the tail of a scrape's latency;
- glibc's malloc arenas: each thread that mallocs gets an arena of its own (up to 8 per core), and
  every arena's touched pages stay resident; the server's threads mostly wait, so two arenas are plenty;
- the signal mask: SIGTERM and SIGINT unblocked, whatever the rank that spawned the server blocked;
- the cyclic collector's view: once the server has started, what it holds (modules, settings, collectors,
  the event loop) lives as long as the process, so ``freeze`` moves it out of every generation; a full
  collection (the renders allocate, so one comes every few minutes) then scans only what came after,
  a stall of a few hundred microseconds instead of several milliseconds in some scrape's latency.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import signal
import sys

log = logging.getLogger("vramwatch")

SWITCH_INTERVAL = 0.0005  # s: a render's slice before the loop gets the GIL back (CPython's default: 0.005)
ARENA_MAX = 2
_M_ARENA_MAX = -8  # glibc's malloc.h
_PR_SET_NAME = 15  # linux/prctl.h


def tune(switch_interval: float = SWITCH_INTERVAL, arena_max: int = ARENA_MAX) -> dict[str, object]:
    """Apply both; never raises (a libc without mallopt keeps its default). Returns what was set."""
    done: dict[str, object] = {}
    try:
        sys.setswitchinterval(switch_interval)
        done["switch_interval"] = sys.getswitchinterval()
    except (ValueError, TypeError):
        pass
    done["arena_max"] = _set_arena_max(arena_max)
    return done


def unblock_signals() -> set[signal.Signals]:
    """Unblock SIGTERM and SIGINT in the calling thread (before the server's threads start: they inherit
    its mask). A server spawned by a rank inherits the rank's signal mask across fork and exec, and a
    training job's launcher or library may block them; blocked, they would never reach the handlers
    that stop the server. Returns the ones that were blocked."""
    stop = {signal.SIGTERM, signal.SIGINT}
    was = signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
    return stop & set(was)


def name_thread(name: str) -> bool:
    """Give the calling thread ``name`` (15 bytes at most) where the kernel shows it: ``top -H``,
    ``/proc/PID/task/TID/comm``, py-spy. Python names its threads for itself only (until 3.14), so
    every thread of the server would read "python3". Never raises; whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None).prctl
        prctl.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        prctl.restype = ctypes.c_int
        return prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0) == 0
    except (OSError, AttributeError):
        log.debug("vramwatch: prctl unavailable", exc_info=True)
        return False


def freeze() -> int:
    """``gc.freeze()`` after a collection (so no garbage is kept for good); returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _set_arena_max(n: int) -> int | None:
    """mallopt(M_ARENA_MAX, n) on glibc (before the threads it is meant for); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: its libc (find_library would fork)
        gnu = getattr(libc, "gnu_get_libc_version", None)  # musl and others: their own allocator
        mallopt = getattr(libc, "mallopt", None)
        if gnu is None or mallopt is None:
            return None
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        return n if mallopt(_M_ARENA_MAX, n) == 1 else None
    except (OSError, AttributeError):
        log.debug("vramwatch: mallopt unavailable", exc_info=True)
        return None
