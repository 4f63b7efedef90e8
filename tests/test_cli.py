from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import free_port, http_get


def _run(*args, env=None, timeout=60):
    e = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "vramwatch", *args], capture_output=True, text=True, env=e, timeout=timeout
    )


@pytest.mark.parametrize(
    "args,env,needle",
    [
        (["serve", "--port", "70000"], {}, "invalid setting port='70000' (from argument): must be 1-65535"),
        (["serve"], {"VRAMWATCH_PORT": "x"}, "invalid setting port='x' (from VRAMWATCH_PORT)"),
        (["serve"], {"VRAMWATCH_NOPE": "1"}, "unknown setting 'nope' (from VRAMWATCH_NOPE)"),
    ],
)
def test_serve_rejects_bad_config_with_exit_2(args, env, needle):
    r = _run(*args, env=env)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_reports_a_busy_port(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run("serve", "--port", str(port), "--spool-dir", str(tmp_path), "--simulate", "true")
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr


def test_config_shows_values_and_sources(tmp_path):
    f = tmp_path / "c.yml"
    f.write_text("linger: 3\n")
    r = _run("config", "--port", "9500", env={"VRAMWATCH_INTERVAL": "2", "VRAMWATCH_CONFIG_FILE": str(f)})
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert rows["port"].endswith("argument") and "9500" in rows["port"]
    assert rows["interval"].endswith("VRAMWATCH_INTERVAL")
    assert rows["linger"].endswith(f"file {f}")
    assert rows["max_ranks"].endswith("default")


def test_demo_runs_simulated_and_prints_the_url(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vramwatch",
            "demo",
            "--real",
            "no",
            "--duration",
            "8",
            "--port",
            str(port),
            "--spool-dir",
            str(tmp_path / "s"),
            "--ranks",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")},
    )
    first = proc.stdout.readline()
    assert f"http://127.0.0.1:{port}/metrics" in first
    import time

    deadline = time.monotonic() + 20
    body = b""
    while time.monotonic() < deadline:
        try:
            code, body = http_get(f"http://127.0.0.1:{port}/metrics", 1)
            if code == 200 and body.count(b"vramwatch_training_steps_total{") == 2:
                break
        except OSError:
            pass
        time.sleep(0.3)
    assert body.count(b"vramwatch_training_steps_total{") == 2, body[-2000:]
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "done" in out


def test_demo_sigterm_stops_its_ranks(tmp_path):
    import signal
    import time

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vramwatch",
            "demo",
            "--real",
            "no",
            "--port",
            str(port),
            "--spool-dir",
            str(tmp_path / "s"),
            "--ranks",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")},
    )
    assert "metrics" in proc.stdout.readline()
    time.sleep(2)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
