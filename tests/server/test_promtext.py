"""vramwatch.server.promtext: prometheus_client's encoders, byte for byte, without exposition's imports."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary
from prometheus_client import exposition as library
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.samples import NativeHistogram

from harness import child_env
from vramwatch.server import promtext


class _Fixed:
    def __init__(self, fams: list) -> None:
        self.fams = fams

    def collect(self) -> list:
        return self.fams


def _registry() -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("requests", "Requests.\nSecond line \\ with a backslash", ["code"], registry=r).labels("200").inc(3)
    Gauge("temp", "Temperature.", ["gpu", "uuid"], registry=r).labels("0", 'GPU-"quoted"\n\\x').set(41.5)
    Histogram("lat", "Latency.", registry=r, buckets=(0.1, 1.0)).observe(0.5)
    Summary("size", "Size.", registry=r).observe(7)
    Info("build", "Build.", registry=r).info({"version": "1.2", "name": "d\u00e9j\u00e0"})
    Enum("state", "State.", states=["a", "b"], registry=r).state("b")
    fams = [
        GaugeMetricFamily("g_inf", "Infinite.", value=float("inf")),
        GaugeMetricFamily("g_nan", "NaN.", value=float("nan")),
        CounterMetricFamily("c_ts", "With a timestamp.", labels=["k"]),
        InfoMetricFamily("i", "Info.", value={"a": "b"}),
        StateSetMetricFamily("ss", "Stateset.", value={"x": True, "y": False}),
        GaugeHistogramMetricFamily("gh", "Gauge histogram.", buckets=[("1.0", 4), ("+Inf", 5)], gsum_value=3),
        UnknownMetricFamily("u", "Unknown.", value=1e-7),
        GaugeMetricFamily("utf8.name", "A UTF-8 name.", value=2),
        GaugeMetricFamily("utf8.labelled", "UTF-8 names, labelled.", labels=["gpu.id", "ok"]),
        Metric("nh", "A native histogram (OpenMetrics 2.0.0 only).", "histogram"),
    ]
    fams[2].add_metric(["v"], 12, timestamp=1764780000.123)
    fams[-2].add_metric(["0", "y"], 1)
    fams[-1].add_sample("nh", {}, 0, None, None, NativeHistogram(3, 6.0, 0, 0.0, 0))
    r.register(_Fixed(fams))
    return r


ACCEPTS = [
    "",
    "*/*",
    "text/plain",
    "text/plain;version=0.0.4",
    "text/plain;version=1.0.0",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=dots",
    "text/plain;version=1.0.0;escaping=values",
    "text/plain;version=1.0.0;escaping=bogus",
    "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0",
    "application/openmetrics-text;version=0.0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=2.0.0",
    # odd parameters: a value holding `=` is the library's (a version of "2.=" reads as 2, an escaping
    # of "dots=x" as none), never a crash of the scrape
    "text/plain;version=2.=",
    "text/plain;version=1.0.0;escaping=dots=x",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8=x",
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
]


@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_copy_answers_as_prometheus_client_does(accept):
    if promtext.LIBRARY_EXPOSITION:
        pytest.skip("this prometheus_client has no escaping helpers: the library's own encoders serve")
    registry = _registry()
    ours, ours_type = promtext.choose_encoder(accept)
    theirs, theirs_type = library.choose_encoder(accept)
    assert ours_type == theirs_type
    assert ours(registry) == theirs(registry)


def test_text_is_byte_identical_for_every_escaping():
    if promtext.LIBRARY_EXPOSITION:
        pytest.skip("the library's own encoders serve")
    registry = _registry()
    for escaping in ("underscores", "allow-utf-8", "dots", "values"):
        assert promtext.generate_text(registry, escaping) == library.generate_latest(registry, escaping)


PROBE = r"""
import json, sys
import vramwatch.server.main  # what serve imports
light = sorted(m for m in ("ssl", "http.server", "wsgiref", "urllib.request", "email", "prometheus_client.exposition")
               if m in sys.modules)
from prometheus_client import CollectorRegistry, generate_latest, Gauge  # the whole package, on demand
r = CollectorRegistry()
Gauge("x", "X.", registry=r).set(1)
print(json.dumps({"light": light, "text": generate_latest(r).decode()}))
"""


def test_the_package_init_runs_only_when_asked_for():
    p = subprocess.run([sys.executable, "-c", PROBE], env=child_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["light"] == []
    assert "x 1.0" in got["text"]


class _NoFloat:
    def __init__(self, *args: object) -> None:
        self.args = args

    def __float__(self) -> float:
        raise ValueError(*self.args)


@pytest.mark.parametrize("why", [(), ("no float here",)])
def test_a_metric_that_cannot_be_rendered_is_named_in_the_error_as_the_library_names_it(why):
    """The exposition cache logs the exception: its last argument says which metric broke the scrape."""
    if promtext.LIBRARY_EXPOSITION:
        pytest.skip("the library's own encoders serve")
    bad = GaugeMetricFamily("bad", "Bad.")
    bad.add_metric([], _NoFloat(*why))
    registry = CollectorRegistry()
    registry.register(_Fixed([bad]))
    with pytest.raises(ValueError) as ours:
        promtext.generate_text(registry)
    with pytest.raises(ValueError) as theirs:
        library.generate_latest(registry)
    assert ours.value.args == theirs.value.args == ((why or ("",))[0], bad)


@pytest.fixture
def without_prometheus_client():
    """sys.modules without the package; afterwards the real one again, and none of the test's own copies."""
    ours = {m: sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] == "prometheus_client"}
    try:
        yield
    finally:
        for m in [m for m in sys.modules if m.split(".")[0] == "prometheus_client"]:
            del sys.modules[m]
        sys.modules.update(ours)


def test_lean_makes_submodules_importable_and_runs_the_package_init_on_first_use(without_prometheus_client):
    promtext.lean()
    pc = sys.modules["prometheus_client"]
    assert "prometheus_client.exposition" not in sys.modules  # nothing of the package ran yet
    from prometheus_client import utils  # a submodule, through the module's __getattr__

    assert utils is sys.modules["prometheus_client.utils"] and utils.floatToGoString(1.5) == "1.5"
    assert pc.samples is sys.modules["prometheus_client.samples"]  # an attribute, before any import of it
    with pytest.raises(AttributeError, match="__wrapped__"):
        pc.__wrapped__  # noqa: B018 - dunder probes (inspect, copy, pickle) never run the package's __init__
    assert "prometheus_client.exposition" not in sys.modules
    gauge = pc.Gauge  # a name of the package itself: its __init__ runs, once, into this module
    assert "prometheus_client.exposition" in sys.modules and sys.modules["prometheus_client"] is pc
    assert gauge.__name__ == "Gauge" and pc.CollectorRegistry.__name__ == "CollectorRegistry"
    with pytest.raises(AttributeError, match="no_such_name"):
        pc.no_such_name  # noqa: B018 - after the __init__, an unknown name is an AttributeError, not a rerun


def test_lean_leaves_an_imported_package_alone():
    real = sys.modules["prometheus_client"]
    promtext.lean()
    assert sys.modules["prometheus_client"] is real


def test_lean_without_a_usable_package_leaves_the_import_to_fail_as_usual(without_prometheus_client, monkeypatch):
    for spec in (None, importlib.machinery.ModuleSpec("prometheus_client", None, is_package=True)):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, spec=spec: spec)
        promtext.lean()
        assert "prometheus_client" not in sys.modules
    not_a_package = importlib.machinery.ModuleSpec("prometheus_client", importlib.machinery.SourceFileLoader("p", "/x"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: not_a_package)
    promtext.lean()
    assert "prometheus_client" not in sys.modules
