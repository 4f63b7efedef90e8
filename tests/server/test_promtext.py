"""vramwatch.server.promtext: prometheus_client's encoders, byte for byte, without exposition's imports."""

from __future__ import annotations

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
    StateSetMetricFamily,
    UnknownMetricFamily,
)

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
    ]
    fams[2].add_metric(["v"], 12, timestamp=1764780000.123)
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
