"""Child processes: their environment, and stopping them (bounded: SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    """This environment with this checkout first on PYTHONPATH and no stray VRAMWATCH_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    pp = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + pp if pp else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def vramwatch_env(spool_dir: str, port: int, **settings: Any) -> dict[str, str]:
    """child_env plus vramwatch settings as VRAMWATCH_* variables (booleans as true/false, None left out)."""
    env = child_env(VRAMWATCH_SPOOL_DIR=str(spool_dir), VRAMWATCH_PORT=str(port))
    for k, v in settings.items():
        if v is not None:
            env["VRAMWATCH_" + k.upper()] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    return env


def stop_proc(proc: subprocess.Popen, timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Stop a child: ``sig``, then SIGKILL after ``timeout`` s; always reaped."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie nobody reaps counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            raw = fh.read()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def stop_pid(pid: int, timeout: float = 3.0) -> None:
    """SIGTERM a process we started (not necessarily our child), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.02)


def die_with(sig: int) -> Callable[[], None]:
    """For preexec_fn (Linux): the child gets ``sig`` when its parent dies, even by SIGKILL."""

    def set_death_signal() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    return set_death_signal


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(proc: subprocess.Popen | None, first: int, timeout: float) -> None:
    """Stop a child that leads its own process group: ``first`` to the leader (it may stop its own children),
    then SIGTERM and SIGKILL to whatever is left of the group; the leader is reaped."""
    if proc is None:
        return
    for sig, wait in ((first, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if not _group_alive(proc.pid):
            break
        try:
            if sig == first and proc.poll() is None:
                proc.send_signal(sig)
            else:
                os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(proc.pid):
            proc.poll()  # reap the leader, or the group stays alive as a zombie
            time.sleep(0.1)
    proc.poll()
