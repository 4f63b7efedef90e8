"""Server-side collectors: each reads on its own cadence, a scrape only renders snapshots.

A collector registers a name, whether it is on by default (a Settings flag),
and a factory. Its ``read()`` does the IO and returns an immutable snapshot;
its ``families(snapshot, ctx)`` is pure. The shared :class:`Health` owns
``vramwatch_collector_up``, ``_errors_total`` and ``_duration_seconds``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from vramwatch.config import Settings
from vramwatch.spool import RankSample

log = logging.getLogger("vramwatch")


@dataclass(frozen=True)
class ScrapeContext:
    """What every collector may use during one scrape: the ranks' samples, read once."""

    samples: tuple[RankSample, ...]
    now: float
    hostname: str


class Health:
    """Self-health of one collector; updated by the thread that reads, read at scrape."""

    def __init__(self) -> None:
        self.up = 1
        self.errors = 0
        self.duration = 0.0
        self._logged: set[str] = set()

    def failed(self, key: str, msg: str, *args: Any) -> None:
        self.up = 0
        self.errors += 1
        self.log_once(key, msg, *args)

    def log_once(self, key: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args)


class Collector:
    """Base for server collectors that poll on a background thread."""

    name = "base"
    interval = 1.0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.health = Health()
        self.snapshot: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> Any:  # IO; runs on the collector's thread
        raise NotImplementedError

    def families(self, snapshot: Any, ctx: ScrapeContext) -> Iterable[Metric]:  # pure
        raise NotImplementedError

    def collect(self, ctx: ScrapeContext) -> Iterable[Metric]:
        snap = self.snapshot
        if snap is None:
            return ()
        return self.families(snap, ctx)

    def poll_once(self) -> None:
        t0 = time.perf_counter()
        try:
            self.snapshot = self.read()
            self.health.up = 1
        except Exception as e:  # noqa: BLE001 - a collector never takes the server down
            self.health.failed("read:" + type(e).__name__, "vramwatch: %s collector failed: %r", self.name, e)
        self.health.duration = time.perf_counter() - t0

    def start(self) -> None:
        self.poll_once()
        self._thread = threading.Thread(target=self._loop, name=f"vramwatch-{self.name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@dataclass(frozen=True)
class Registration:
    name: str
    enabled: Callable[[Settings], bool]
    factory: Callable[[Settings], Collector]
    doc: str


REGISTRY: dict[str, Registration] = {}


def register(name: str, enabled: Callable[[Settings], bool], doc: str):
    def deco(factory: Callable[[Settings], Collector]):
        REGISTRY[name] = Registration(name, enabled, factory, doc)
        return factory

    return deco


def enabled_collectors(settings: Settings) -> list[Collector]:
    _load_builtin()
    return [r.factory(settings) for r in REGISTRY.values() if r.enabled(settings)]


def _load_builtin() -> None:
    # import for the side effect of registering; optional ones may be absent
    import importlib

    for mod in ("nvml", "xid"):
        try:
            importlib.import_module(f"vramwatch.server.collectors.{mod}")
        except ImportError as e:
            if e.name != f"vramwatch.server.collectors.{mod}":
                log.warning("vramwatch: collector %s unavailable: %r", mod, e)
