"""Fixtures shared by the whole suite, and the repository's harness/ on sys.path.

The processes (exporter, simulated ranks, Prometheus, Alertmanager) come from harness/, shared with the
benchmarks and `make demo`; here they get a test's lifetime. A binary the harness cannot find
(ToolMissing) skips the test, or fails it in CI (CI=true), where `make tools` installed everything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the harness package (harness/), and this folder's helpers (live_scenario, promql_names, tlsutil)
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from harness import Exporter, Prometheus, ToolMissing, start_sim_rank, stop_proc  # noqa: E402 - after the path


@pytest.hookimpl(tryfirst=True)  # before the tmp_path factory reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist (`make test` runs `-n 2`) each worker's tmp_path gains a "popen-gwN" level. Start
    # the controller from a short base instead, so paths stay as short as in a plain run: tests quote
    # them in messages that shorten long values.
    if config.getoption("numprocesses", None) and not config.option.basetemp and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="vwt-")
        config.stash[_SHORT_BASETEMP] = config.option.basetemp


_SHORT_BASETEMP = pytest.StashKey[str]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    base = session.config.stash.get(_SHORT_BASETEMP, None)
    if base and exitstatus == 0:  # a failed run keeps its files, as pytest's own base does
        shutil.rmtree(base, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the files with slow or e2e tests first (stable otherwise): under xdist the long ones then start
    # early instead of ending the run on one worker while the other idles
    heavy = {it.path for it in items if it.get_closest_marker("slow") or it.get_closest_marker("e2e")}
    items.sort(key=lambda it: it.path not in heavy)


def _skip_or_fail(e: ToolMissing) -> None:
    if os.environ.get("CI"):
        pytest.fail(str(e), pytrace=False)
    pytest.skip(str(e))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except ToolMissing as e:
        _skip_or_fail(e)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except ToolMissing as e:
        _skip_or_fail(e)


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[Callable[..., Exporter]]:
    """Factory: a ``vramwatch serve`` on the simulated GPU (call .start()); stopped at teardown."""
    started: list[Exporter] = []

    def make(**kw: Any) -> Exporter:
        e = Exporter(tmp_path / f"exp{len(started)}", **kw)
        started.append(e)
        return e

    yield make
    for e in started:
        e.stop()


@pytest.fixture
def sim_rank() -> Iterator[Callable[..., subprocess.Popen]]:
    """Factory: a simulated rank process (harness.start_sim_rank's arguments); stopped at teardown."""
    started: list[subprocess.Popen] = []

    def make(exp: Exporter, rank: int, *args: str, **kw: Any) -> subprocess.Popen:
        started.append(start_sim_rank(exp, rank, *args, **kw))
        return started[-1]

    yield make
    for p in started:
        stop_proc(p)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[..., Prometheus]]:
    """Factory: a real Prometheus on loopback scraping ``targets``, started; stopped at teardown."""
    started: list[Prometheus] = []

    def make(targets: list[str], **kw: Any) -> Prometheus:
        p = Prometheus(tmp_path, targets, **kw).start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


@pytest.fixture
def start_rank(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory: vramwatch.start() in this process on the simulated GPU, publishing only (no server), every
    0.05 s, into tmp_path/spool unless told otherwise; vramwatch.stop() at teardown."""

    import vramwatch

    def start(**kw: Any) -> vramwatch.Handle:
        kw.setdefault("spool_dir", str(tmp_path / "spool"))
        kw.setdefault("serve", "external")
        kw.setdefault("simulate", True)
        kw.setdefault("interval", 0.05)
        return vramwatch.start(**kw)

    yield start
    vramwatch.stop()
