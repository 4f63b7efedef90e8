"""Simulator state that a finished driver (the demo) left is never read as current: a later simulated
server or rank gets a fresh node, while a state nobody drives (a test's edit) holds."""

from __future__ import annotations

import os
import subprocess
import sys

from vramwatch.sim.nvml import SimNvml
from vramwatch.sim.state import SimNode, edit, load_or_create, state_path


def _driven_by_a_process_now_gone(spool_dir: str) -> None:
    node = SimNode.default(2)
    node.gpu(0).power_w = 540.0
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    node.drive_by(gone.pid)
    gone.wait(timeout=30)
    node.save(state_path(spool_dir))


def test_a_finished_drivers_state_reads_as_a_fresh_node(tmp_path):
    d = str(tmp_path)
    _driven_by_a_process_now_gone(d)
    assert SimNode.read(state_path(d)).gpu(0).power_w == 540.0  # on disk as it was left
    node = SimNode.load(state_path(d))
    assert len(node.gpus) == 2 and node.gpu(0).power_w == SimNode.default(1).gpu(0).power_w and not node.driver
    assert load_or_create(d).gpu(0).power_w != 540.0
    assert SimNode.read(state_path(d)).gpu(0).power_w != 540.0, "load_or_create writes the fresh node back"


def test_the_simulated_nvml_of_a_later_server_does_not_read_it(tmp_path):
    d = str(tmp_path)
    _driven_by_a_process_now_gone(d)
    nvml = SimNvml.from_spool(d)
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetPowerUsage(nvml.nvmlDeviceGetHandleByIndex(0)) != 540_000


def test_a_live_drivers_state_and_an_undriven_one_hold(tmp_path):
    d = str(tmp_path)
    with edit(d, 1) as node:
        node.gpu(0).power_w = 300.0  # a test's edit: nobody drives it, it holds
    assert SimNode.load(state_path(d)).gpu(0).power_w == 300.0
    with edit(d, 1) as node:
        node.drive_by(os.getpid())
        node.gpu(0).power_w = 400.0
    assert SimNode.load(state_path(d)).gpu(0).power_w == 400.0
