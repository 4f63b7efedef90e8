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
