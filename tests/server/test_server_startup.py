"""The server's start on a hostile spool: a full tmpfs never wedges it, and it says the true cause."""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading

from harness import ROOT, free_port, vramwatch_env
from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.server.main import serve
from vramwatch.sim.state import SimNode, state_path
from vramwatch.spool import files as spool_files


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_full_spool_at_start_exits_1_naming_enospc_and_releases_port_and_lock(tmp_path, monkeypatch, caplog):
    """A 64 MB container /dev/shm, full: writing server.json fails with ENOSPC after the bind."""
    spool_dir = str(tmp_path / "spool")
    os.makedirs(spool_dir)
    SimNode.default(1).save(state_path(spool_dir))
    real_replace = spool_files.replace_file

    def replace_file(path: str, data: bytes) -> None:
        if os.path.basename(path) == spool.SERVER_INFO:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_replace(path, data)

    monkeypatch.setattr(spool_files, "replace_file", replace_file)
    port = free_port()
    settings = Settings(simulate=True, spool_dir=spool_dir, port=port, nvml_interval=0.1, nvml_slow_interval=0.3)
    result: list[int] = []
    caplog.set_level(logging.INFO, logger="vramwatch")
    t = threading.Thread(target=lambda: result.append(serve(settings)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "serve() hung after failing to write server.json"
    assert result == [1]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert f"cannot write {os.path.join(spool_dir, spool.SERVER_INFO)}" in errors[0], errors
    assert "No space left on device (ENOSPC)" in errors[0], errors
    assert "cannot listen" not in caplog.text
    assert _port_is_free(port), "the port is still held"
    assert not spool.server_running(spool_dir), "the server lock is still held"
    assert not [n for n in os.listdir(spool_dir) if n.startswith(spool.SERVER_INFO)], "no server.json, no temp file"
    assert not [th.name for th in threading.enumerate() if th.name.startswith("vramwatch-") and th.is_alive()]


def test_a_file_size_limit_at_start_is_a_clean_exit_1_in_bounded_time(tmp_path):
    """The real thing in a subprocess: a 1-byte RLIMIT_FSIZE makes the kernel refuse server.json (EFBIG)."""
    spool_dir = str(tmp_path / "spool")
    os.makedirs(spool_dir)
    SimNode.default(1).save(state_path(spool_dir))
    port = free_port()

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))

    r = subprocess.run(
        [sys.executable, "-m", "vramwatch", "serve"],
        env=vramwatch_env(spool_dir, port, simulate=True),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        preexec_fn=limit_file_size,
    )
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert f"cannot write {os.path.join(spool_dir, spool.SERVER_INFO)}: File too large (EFBIG)" in r.stderr, r.stderr
    assert "cannot listen" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert _port_is_free(port)
    assert not spool.server_running(spool_dir)


def test_a_port_in_use_is_named_as_such(tmp_path, caplog):
    spool_dir = str(tmp_path / "spool")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        caplog.set_level(logging.INFO, logger="vramwatch")
        assert serve(Settings(simulate=True, nvml=False, spool_dir=spool_dir, port=port)) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text and "Address already in use" in caplog.text
    assert not spool.server_running(spool_dir)
