"""prometheus_client's encoders without ``prometheus_client.exposition``'s imports.

``import prometheus_client`` runs the package's ``__init__``, which imports ``exposition``, which
imports ``http.server``, ``ssl``, ``wsgiref`` and ``urllib.request`` for its own servers and push
gateway: about 9.5 MB of the server's resident memory (measured: ``benchmarks/results/2026-12-03-cpu-lat``),
for a process that needs only the registry, the metric families and two encoders. :func:`lean` puts the
package in ``sys.modules`` without running its ``__init__`` (which then runs on the first attribute
the package itself is asked for, so ``from prometheus_client import X`` still works anywhere), and
:func:`choose_encoder` / :func:`generate_text` are ``prometheus_client.exposition``'s, copied from
prometheus_client 0.26 (Apache-2.0) onto the light ``openmetrics.exposition`` helpers. A
prometheus_client without those helpers (older than the escaping schemes) gets its own
``exposition`` instead; tests/server/test_promtext.py checks the copy is byte for byte the library's.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from functools import partial
from typing import Any


def lean() -> None:
    """Make ``prometheus_client``'s submodules importable without its package ``__init__``."""
    if "prometheus_client" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("prometheus_client")
    except (ImportError, ValueError):
        return
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader
    loaded = [False]

    def __getattr__(name: str) -> Any:  # PEP 562's module hook
        if name.startswith("__") or loaded[0]:
            raise AttributeError(name)
        if importlib.util.find_spec(f"prometheus_client.{name}") is not None:
            return importlib.import_module(f"prometheus_client.{name}")  # ``from . import values``: a submodule
        loaded[0] = True
        loader.exec_module(module)  # the real __init__, into this module: from here on the whole package
        return getattr(module, name)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules["prometheus_client"] = module


lean()  # before the imports below: they are the package's submodules

from prometheus_client.utils import floatToGoString, parse_version  # noqa: E402

Encoder = Callable[..., bytes]
CONTENT_TYPE_PLAIN_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
CONTENT_TYPE_LATEST = "text/plain; version=1.0.0; charset=utf-8"

try:
    from prometheus_client.openmetrics import exposition as openmetrics

    _ESCAPINGS = (openmetrics.ALLOWUTF8, openmetrics.UNDERSCORES, openmetrics.DOTS, openmetrics.VALUES)
    for _name in ("escape_metric_name", "escape_label_name", "_escape", "_is_valid_legacy_metric_name"):
        getattr(openmetrics, _name)
    LIBRARY_EXPOSITION = False
except (ImportError, AttributeError):  # an older prometheus_client: its own encoders, and their imports
    LIBRARY_EXPOSITION = True


def generate_text(registry: Any, escaping: str = "underscores") -> bytes:
    """prometheus_client.exposition.generate_latest: the Prometheus text format of ``registry.collect()``."""
    om = openmetrics

    def sample_line(samples: Any) -> str:
        name = om.escape_metric_name(samples.name, escaping)
        value = floatToGoString(samples.value)
        # label values always allow UTF-8 (the library passes False for its rune check)
        labelstr = ",".join(
            f'{om.escape_label_name(k, escaping)}="{om._escape(v, om.ALLOWUTF8, False)}"'  # type: ignore[arg-type]
            for k, v in sorted(samples.labels.items())
        )
        timestamp = ""
        if samples.timestamp is not None:
            timestamp = f" {int(float(samples.timestamp) * 1000):d}"  # milliseconds
        if escaping != om.ALLOWUTF8 or om._is_valid_legacy_metric_name(samples.name):
            if labelstr:
                labelstr = f"{{{labelstr}}}"
            return f"{name}{labelstr} {value}{timestamp}\n"
        maybe_comma = "," if labelstr else ""
        return f"{{{name}{maybe_comma}{labelstr}}} {value}{timestamp}\n"

    output = []
    for metric in registry.collect():
        try:
            mname = metric.name
            mtype = metric.type
            if mtype == "counter":
                mname = mname + "_total"
            elif mtype == "info":
                mname = mname + "_info"
                mtype = "gauge"
            elif mtype == "stateset":
                mtype = "gauge"
            elif mtype == "gaugehistogram":
                mtype = "histogram"
            elif mtype == "unknown":
                mtype = "untyped"
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            output.append(f"# HELP {om.escape_metric_name(mname, escaping)} {doc}\n")
            output.append(f"# TYPE {om.escape_metric_name(mname, escaping)} {mtype}\n")
            om_samples: dict[str, list[str]] = {}
            for s in metric.samples:
                for suffix in ["_created", "_gsum", "_gcount"]:
                    if s.name == metric.name + suffix:
                        om_samples.setdefault(suffix, []).append(sample_line(s))
                        break
                else:
                    output.append(sample_line(s))
        except Exception as exception:
            exception.args = (exception.args or ("",)) + (metric,)
            raise
        for suffix, lines in sorted(om_samples.items()):
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            output.append(f"# HELP {om.escape_metric_name(metric.name + suffix, escaping)} {doc}\n")
            output.append(f"# TYPE {om.escape_metric_name(metric.name + suffix, escaping)} gauge\n")
            output.extend(lines)
    return "".join(output).encode("utf-8")


def _get_version(toks: list[str]) -> str:
    for tok in toks:
        if "=" not in tok:
            continue
        key, value = tok.strip().split("=", 1)
        if key == "version":
            return value
    return ""


def _get_escaping(toks: list[str]) -> str:
    for tok in toks:
        if "=" not in tok:
            continue
        key, value = tok.strip().split("=", 1)
        if key != "escaping":
            continue
        return value if value in _ESCAPINGS else openmetrics.UNDERSCORES
    return openmetrics.UNDERSCORES


def choose_encoder(accept_header: str) -> tuple[Encoder, str]:
    """prometheus_client.exposition.choose_encoder, answering with :func:`generate_text` for text."""
    if LIBRARY_EXPOSITION:
        from prometheus_client.exposition import choose_encoder as library

        return library(accept_header)
    accept_header = accept_header or ""
    for accepted in accept_header.split(","):
        if accepted.split(";")[0].strip() == "application/openmetrics-text":
            toks = accepted.split(";")
            version = _get_version(toks)
            escaping = _get_escaping(toks)
            if not version:
                enc = partial(openmetrics.generate_latest, escaping=openmetrics.UNDERSCORES, version="1.0.0")
                return enc, openmetrics.CONTENT_TYPE_LATEST
            if version and parse_version(version) >= (1, 0, 0):
                return (
                    partial(openmetrics.generate_latest, escaping=escaping, version=version),
                    f"application/openmetrics-text; version={version}; charset=utf-8; escaping=" + str(escaping),
                )
        elif accepted.split(";")[0].strip() == "text/plain":
            toks = accepted.split(";")
            version = _get_version(toks)
            escaping = _get_escaping(toks)
            if version and parse_version(version) >= (1, 0, 0):
                return partial(generate_text, escaping=escaping), CONTENT_TYPE_LATEST + "; escaping=" + str(escaping)
    return generate_text, CONTENT_TYPE_PLAIN_0_0_4
