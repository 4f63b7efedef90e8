"""The processes of a local monitoring stack on loopback: `vramwatch serve`, simulated ranks, Prometheus and
Alertmanager with generated configs. `make demo` (scripts/demo_stack.py), the tests and the benchmarks all
start them through this package.

It lives at the top of the repository, not inside `vramwatch/`, for two reasons: it is a development tool
that no installed copy of vramwatch needs (pyproject ships `vramwatch*` only), and importing it must not
import vramwatch: benchmarks/overhead.py forks its baseline runs from a parent that has not loaded the
package. Only the standard library is imported at module level (PyYAML and vramwatch's simulator are
imported by the few functions that need them); every address is 127.0.0.1 and every wait has a deadline.

The scripts that import it put the repository root on sys.path first (tests/conftest.py does it for the
tests); a binary it cannot find raises ToolMissing, which the tests turn into a skip.
"""

from __future__ import annotations

from harness.exporter import Exporter, parse_metrics, start_sim_job, start_sim_rank
from harness.net import (
    WaitTimeout,
    free_port,
    http_get,
    port_open,
    read_answer,
    wait_http,
    wait_port_closed,
    wait_until,
)
from harness.procs import ROOT, child_env, die_with, pid_alive, stop_group, stop_pid, stop_proc, vramwatch_env
from harness.servers import Alertmanager, Prometheus, Server, loopback_prometheus_config
from harness.tools import ToolMissing, find_tool, tool, tool_dirs

__all__ = [
    "ROOT",
    "Alertmanager",
    "Exporter",
    "Prometheus",
    "Server",
    "ToolMissing",
    "WaitTimeout",
    "child_env",
    "die_with",
    "find_tool",
    "free_port",
    "http_get",
    "loopback_prometheus_config",
    "parse_metrics",
    "pid_alive",
    "read_answer",
    "port_open",
    "start_sim_job",
    "start_sim_rank",
    "stop_group",
    "stop_pid",
    "stop_proc",
    "tool",
    "tool_dirs",
    "vramwatch_env",
    "wait_http",
    "wait_port_closed",
    "wait_until",
]
