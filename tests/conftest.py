from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Exporter, Prometheus


@pytest.fixture
def exporter(tmp_path):
    """Factory: start a ``vramwatch serve`` on the simulated GPU; stopped at teardown."""
    started: list[Exporter] = []

    def make(**kw) -> Exporter:
        e = Exporter(tmp_path / f"exp{len(started)}", **kw)
        started.append(e)
        return e

    yield make
    for e in started:
        e.stop()


@pytest.fixture
def prometheus(tmp_path):
    """Factory: start a real Prometheus on loopback; stopped at teardown."""
    started: list[Prometheus] = []

    def make(targets, **kw) -> Prometheus:
        p = Prometheus(tmp_path, targets, **kw).start()
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()
