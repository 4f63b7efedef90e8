"""Fixtures shared by the whole suite (harness/, tests/ and benchmarks/ are importable through pytest's
``pythonpath`` setting in pyproject.toml).

The processes (exporter, simulated ranks, Prometheus, Alertmanager) come from harness/, shared with the
benchmarks and `make demo`; here they get a test's lifetime. A binary the harness cannot find
(ToolMissing) skips the test, or fails it in CI (CI=true), where `make tools` installed everything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from samples import rank_sample as _rank_sample

from harness import Exporter, Prometheus, ToolMissing, start_sim_rank, stop_proc

ROOT = Path(__file__).resolve().parent.parent


@pytest.hookimpl(tryfirst=True)  # before the tmp_path factory reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist (`make test` runs `-n 6`) each worker's tmp_path gains a "popen-gwN" level. Start
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


# Seconds per file on two loaded cores (`make test`'s workers, 2026-12-07), for the order only: under xdist a
# file runs on one worker, so the longest start first (longest-processing-time first) and none ends the run
# alone. A file not named here comes after these, those with slow or e2e tests first; a stale figure only costs
# time (refresh from a run's per-file sums of `--durations=0` when files grow or move).
# (`make test` passes --no-loadscope-reorder: xdist's own order, by test count, started the soak last.)
FILE_SECONDS = {
    "system/test_e2e_incidents.py": 160,
    "test_benchmarks.py": 122,
    "system/test_soak.py": 75,
    "distributed/test_culprits.py": 70,
    "test_report.py": 56,
    "system/test_nothing_lost.py": 45,
    "system/test_e2e_alerting.py": 37,
    "system/test_e2e_tls.py": 37,
    "system/test_faults.py": 34,
    "deploy/test_helm.py": 24,
    "monitoring/test_dashboards_live.py": 23,
    "system/test_e2e_core.py": 23,
    "system/test_node_daemon.py": 22,
    "server/test_server_main.py": 20,
    "integrations/test_tokens.py": 18,
    "integrations/test_lightning.py": 16,
    "system/test_e2e_device.py": 16,
    "rank/test_roles_threads.py": 16,
    "server/test_http_admission.py": 16,
    "rank/test_api.py": 15,
    "deploy/test_kubernetes.py": 15,
    "system/test_e2e_squat.py": 14,
    "monitoring/test_promtool.py": 13,
    "integrations/test_hf.py": 13,
    "sim/test_scenario.py": 13,
    "monitoring/test_monitoring_config.py": 12,
    "monitoring/test_alerts.py": 12,
    "test_cli.py": 11,
    "rank/test_step_peak.py": 11,
    "deploy/test_slurm.py": 11,
    "server/test_bad_samples.py": 10,
}
_TESTS = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--timing",
        choices=("include", "exclude", "only"),
        default="include",
        help="tests marked `timing` (a wall-clock or CPU-time bound that load can break): run them with the "
        "rest (include, the default), leave them out (exclude: `make test`'s parallel run), or run only them "
        "(only: its serial run after)",
    )


def _mentions_timing(path: Path) -> bool:
    try:
        return "mark.timing" in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return True


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # --timing=only: a test file that never names the marker is not even imported (collecting the whole
    # suite costs ~10 s of CPU here, for the few timing tests)
    if (
        config.getoption("timing") == "only"
        and collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and not _mentions_timing(collection_path)
    ):
        return True
    return None


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    phase = config.getoption("timing")
    if phase != "include":
        timing = [it.get_closest_marker("timing") is not None for it in items]
        keep = [it for it, t in zip(items, timing, strict=True) if t == (phase == "only")]
        dropped = [it for it, t in zip(items, timing, strict=True) if t != (phase == "only")]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    heavy = {it.path for it in items if it.get_closest_marker("slow") or it.get_closest_marker("e2e")}

    def seconds(it: pytest.Item) -> int:
        try:
            return FILE_SECONDS.get(it.path.relative_to(_TESTS).as_posix(), 0)
        except ValueError:
            return 0

    items.sort(key=lambda it: (-seconds(it), it.path not in heavy))  # stable: a file's tests stay in order


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
def rank_sample() -> Callable[..., Any]:
    """The RankSample factory of tests/samples.py: ``rank_sample(rank, uuid=, values=, **fields)``."""
    return _rank_sample


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
