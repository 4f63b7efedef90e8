"""A rank that meets a server started with other settings (the server a previous run's rank started stays for
its grace and linger) says so in one line naming the difference, and gets what it asked for: the old server
replaced at once when it serves no other job, or once the job it serves is gone."""

from __future__ import annotations

import os
import subprocess
import sys

from harness import free_port, http_get, wait_until
from vramwatch import spool
from vramwatch.rank.server_spawn import read_server_info

ENV = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}


def _rank(port: int, spool_dir: str, seconds: float, **settings: object) -> subprocess.Popen:
    kwargs = ", ".join(f"{k}={v!r}" for k, v in {"port": port, "spool_dir": spool_dir, **settings}.items())
    code = f"import time, vramwatch\nvramwatch.start({kwargs}, interval=0.2)\ntime.sleep({seconds})\nvramwatch.stop()\n"
    return subprocess.Popen([sys.executable, "-c", code], env=ENV, stderr=subprocess.PIPE, text=True)


def _gpu_series(port: int) -> bool:
    try:
        code, body = http_get(f"http://127.0.0.1:{port}/metrics", 2)
    except OSError:
        return False
    return code == 200 and b"\ngpu_up{" in body


def _settings_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "other settings" in line]


def test_a_leftover_server_of_a_plain_run_is_replaced_for_a_simulated_one(tmp_path):
    port, spool_dir = free_port(), str(tmp_path / "spool")
    first = _rank(port, spool_dir, 4.0)  # no GPU here: its server exports no gpu_* series
    assert first.wait(timeout=60) == 0
    assert spool.server_running(spool_dir), "the first run's server stays for its grace"
    old = read_server_info(spool_dir)["pid"]
    assert not _gpu_series(port)

    second = _rank(port, spool_dir, 8.0, simulate=True)
    try:
        wait_until(lambda: _gpu_series(port), 30, "the simulated run's gpu_* series")
        assert read_server_info(spool_dir)["pid"] != old
    finally:
        _, err = second.communicate(timeout=60)
    (line,) = _settings_lines(err)
    assert "simulate 'false', here 'true'" in line and "replacing it" in line, err


def test_a_server_serving_another_job_is_replaced_only_once_that_job_is_gone(tmp_path):
    port, spool_dir = free_port(), str(tmp_path / "spool")
    other = _rank(port, spool_dir, 60.0, job_id="other-job")
    try:
        wait_until(lambda: spool.server_running(spool_dir) and read_server_info(spool_dir), 30, "job one's server")
        old = read_server_info(spool_dir)["pid"]
        mine = _rank(port, spool_dir, 20.0, simulate=True, job_id="my-job")
        wait_until(lambda: _settings_lines(_peek(mine)), 20, "the rank's line", interval=0.5)
        assert read_server_info(spool_dir)["pid"] == old and not _gpu_series(port), "another job's server was replaced"
    finally:
        other.terminate()
        other.wait(timeout=30)
    try:
        wait_until(lambda: _gpu_series(port), 30, "the server replaced once the other job is gone")
    finally:
        _, err = mine.communicate(timeout=60)
    first, second = _settings_lines(_peeked.get(mine.pid, "") + err)
    assert "serves job(s) other-job" in first and "replaced once they are gone" in first, first
    assert "serves no other job: replacing it" in second, second


_peeked: dict[int, str] = {}


def _peek(proc: subprocess.Popen) -> str:
    """What the process wrote to stderr so far (a line at a time, without blocking on a line not yet there)."""
    import select

    assert proc.stderr is not None
    while select.select([proc.stderr], [], [], 0)[0]:
        line = proc.stderr.readline()
        if not line:
            break
        _peeked[proc.pid] = _peeked.get(proc.pid, "") + line
    return _peeked.get(proc.pid, "")
