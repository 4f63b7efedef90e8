"""vramwatch.server.process: what `vramwatch serve` sets for its own process before its threads start."""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import sys

import pytest

from harness import child_env
from vramwatch.server import process

PROBE = r"""
import json, sys
from vramwatch.server import process
print(json.dumps({"set": process.tune(), "now": sys.getswitchinterval()}))
"""


def test_serve_shortens_the_gil_switch_interval_and_caps_malloc_arenas():
    # a process of its own: the switch interval is the interpreter's, as it is serve's
    p = subprocess.run([sys.executable, "-c", PROBE], env=child_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["now"] == pytest.approx(0.0005)
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert got["set"]["arena_max"] == 2


FREEZE = r"""
import gc, json
from vramwatch.server import process

class Node:
    def __init__(self):
        self.me = self  # a cycle: only the cyclic collector frees it

held = [Node() for _ in range(1000)]  # what a started server holds for good
garbage = Node()
del garbage  # garbage before the freeze: collected, never frozen for good
frozen = process.freeze()
tracked = {id(o) for o in gc.get_objects()}
later = Node()
del later
print(json.dumps({"frozen": frozen, "held_tracked": sum(id(h) in tracked for h in held),
                  "later_collected": gc.collect() >= 1, "still_frozen": gc.get_freeze_count()}))
"""


def test_freeze_takes_what_the_server_holds_out_of_every_collection_but_collects_what_comes_after():
    p = subprocess.run([sys.executable, "-c", FREEZE], env=child_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["frozen"] >= 1000 and got["still_frozen"] == got["frozen"]
    assert got["held_tracked"] == 0, "a frozen object is in no generation: no collection scans it"
    assert got["later_collected"], "garbage made after the freeze is still collected"


glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)


@pytest.fixture
def switch_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@glibc
def test_tune_says_what_it_set(switch_interval):
    # in this process too (the arena cap only bounds how many malloc arenas pytest's threads get)
    assert process.tune(0.0007, 2) == {"switch_interval": pytest.approx(0.0007), "arena_max": 2}
    assert sys.getswitchinterval() == pytest.approx(0.0007)


def test_a_bad_switch_interval_is_left_out_and_the_rest_still_set(switch_interval, monkeypatch):
    monkeypatch.setattr(process, "_set_arena_max", lambda n: n)
    assert process.tune(-1.0, 3) == {"arena_max": 3}  # ValueError from the interpreter, never raised


class _Libc:
    """A C library as ctypes shows it: glibc has gnu_get_libc_version, musl does not."""

    def __init__(self, gnu: bool, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        if gnu:
            self.gnu_get_libc_version = lambda: b"2.36"

        def mallopt(param: int, value: int) -> int:
            self.calls.append((param, value))
            return answer

        self.mallopt = mallopt


@pytest.mark.parametrize(
    ("platform_name", "gnu", "answer", "got", "calls"),
    [
        ("linux", True, 1, 2, [(-8, 2)]),  # M_ARENA_MAX is -8 in glibc's malloc.h
        ("linux", True, 0, None, [(-8, 2)]),  # mallopt refused it
        ("linux", False, 1, None, []),  # musl: its own allocator, not asked
        ("darwin", True, 1, None, []),
    ],
)
def test_the_arena_cap_is_asked_of_glibc_only(monkeypatch, platform_name, gnu, answer, got, calls):
    libc = _Libc(gnu, answer)
    monkeypatch.setattr(sys, "platform", platform_name)
    monkeypatch.setattr(process.ctypes, "CDLL", lambda name: libc)
    assert process._set_arena_max(2) == got
    assert libc.calls == calls


def test_no_libc_to_load_is_logged_at_debug_and_answers_none(monkeypatch, caplog):
    def no_libc(name):
        raise OSError("no libc")

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(process.ctypes, "CDLL", no_libc)
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        assert process._set_arena_max(2) is None
    [record] = caplog.records
    assert record.getMessage() == "vramwatch: mallopt unavailable" and record.exc_info


def _thread_name(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().rstrip("\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names through prctl are Linux's")
def test_a_named_thread_reads_its_name_in_proc_and_only_that_thread():
    import threading

    got: list[object] = []

    def body() -> None:
        got.append(process.name_thread("vramwatch-http-and-more"))  # 15 bytes kept: the kernel's limit
        got.append(_thread_name(threading.get_native_id()))

    before = _thread_name(threading.get_native_id())
    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=10)
    assert got == [True, "vramwatch-http-"]
    assert _thread_name(threading.get_native_id()) == before  # the caller's thread alone


def test_naming_a_thread_off_linux_or_without_prctl_answers_false(monkeypatch, caplog):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert process.name_thread("x") is False
    monkeypatch.setattr(sys, "platform", "linux")

    class NoPrctl:
        def __getattr__(self, name: str) -> object:
            raise AttributeError(name)

    monkeypatch.setattr(process.ctypes, "CDLL", lambda name: NoPrctl())
    with caplog.at_level(logging.DEBUG, logger="vramwatch"):
        assert process.name_thread("x") is False
    [record] = caplog.records
    assert record.getMessage() == "vramwatch: prctl unavailable"


# A rank's launcher or library may block SIGTERM; a server it spawns inherits the mask across fork and exec.
BLOCKED_LAUNCH = r"""
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
os.execv(sys.executable, [sys.executable, "-m", "vramwatch", "serve"])
"""


def test_a_server_started_with_sigterm_blocked_still_stops_on_sigterm(tmp_path):
    import signal
    import time

    from harness import free_port, vramwatch_env, wait_until

    port = free_port()
    env = vramwatch_env(str(tmp_path / "spool"), port, simulate=True)
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_LAUNCH], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (tmp_path / "spool" / "server.json").exists(), 30, "the server to start")
        with open(f"/proc/{proc.pid}/status") as fh:
            blocked = int(next(line.split()[1] for line in fh if line.startswith("SigBlk:")), 16)
        assert not blocked & (1 << (signal.SIGTERM - 1)), "SIGTERM still blocked in the server's main thread"
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "SIGINT, SIGTERM were blocked (inherited); unblocked them" in proc.stderr.read()
