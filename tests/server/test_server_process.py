"""vramwatch.server.process: what `vramwatch serve` sets for its own process before its threads start."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from harness import child_env

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
