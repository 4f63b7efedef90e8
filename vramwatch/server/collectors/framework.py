"""The collector framework: registration, cadence, threads and self-health, once for every collector.

Modelled on node_exporter's ``collector.go``: each collector module registers
a name, whether it is on (a Settings flag) and a doc line; one :class:`Runner`
per enabled collector polls its ``read()`` on the collector's cadence, times
it and keeps its :class:`~.health.Health`; a scrape only renders the last
snapshot through the pure ``families()``. A collector returns data or raises:
:class:`ReadFailed` keeps the data it carries and turns ``up`` 0, anything
else keeps the previous snapshot, turns ``up`` 0 and is logged once per kind.

A collector may also bring a :class:`Watch`, a blocking source such as NVML's
event set, which the runner loops on a thread of its own in bounded steps.
The watch then owns the collector's ``up`` and ``errors``: reading what it
gathered cannot fail.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from prometheus_client.core import Metric

from vramwatch.config import Settings
from vramwatch.server.collectors.health import Health

if TYPE_CHECKING:
    from vramwatch.server.collectors import ScrapeContext

log = logging.getLogger("vramwatch")

S = TypeVar("S")

# The built-in collector modules, in the order their families appear on /metrics.
BUILTIN = ("processes", "xid", "nvml", "gpm", "nvlink")


class Cadence(Enum):
    FAST = "fast"  # every nvml_interval; each read is told whether it is also a slow one
    SLOW = "slow"  # every nvml_slow_interval; every read is a slow one


@dataclass(frozen=True)
class Tick:
    """When a read runs (the runner's monotonic clock) and whether slow fields are due."""

    now: float
    slow: bool


class ReadFailed(Exception):
    """A read that got data but saw trouble (already logged by the collector): keep it, ``up`` 0."""

    def __init__(self, snapshot: object) -> None:
        super().__init__("read failed")
        self.snapshot: Any = snapshot


class Watch(Protocol):
    """A blocking source looped by the runner: ``step()`` blocks at most ``max_wait`` s, never raises."""

    health: Health
    max_wait: float

    def step(self) -> float:
        """One bounded wait or one recovery attempt; returns the pause before the next."""
        ...

    def close(self) -> None: ...


class Collector(ABC, Generic[S]):
    """What one collector reads. ``read()`` does the IO on the runner's thread; ``families()`` is pure."""

    name: ClassVar[str]  # set by register()
    cadence: ClassVar[Cadence] = Cadence.FAST
    watch: Watch | None = None

    @abstractmethod
    def read(self, tick: Tick) -> S | None:
        """An immutable snapshot (None: nothing to show); raise :class:`ReadFailed` to keep a partial one."""

    @abstractmethod
    def families(self, snapshot: S, ctx: ScrapeContext) -> Iterable[Metric]:
        """The families of one scrape, from the snapshot and the ranks' samples only."""

    def close(self) -> None:
        """Release what reads hold (NVML buffers); called once the runner's thread has stopped."""


class Runner(Generic[S]):
    """Polls one collector on its cadence, keeps its snapshot and health, renders it at scrape."""

    def __init__(
        self, collector: Collector[S], settings: Settings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.collector = collector
        self.name = collector.name
        self.settings = settings
        self.interval = settings.nvml_interval if collector.cadence is Cadence.FAST else settings.nvml_slow_interval
        self.health = collector.watch.health if collector.watch is not None else Health()
        self.snapshot: S | None = None
        self._clock = clock
        self._next_slow = 0.0
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._watcher: threading.Thread | None = None

    # --- reading (the runner's thread) ---
    def poll_once(self) -> None:
        now = self._clock()
        slow = self.collector.cadence is Cadence.SLOW or now >= self._next_slow
        if slow:
            self._next_slow = now + self.settings.nvml_slow_interval
        t0 = time.perf_counter()
        try:
            self.snapshot = self.collector.read(Tick(now, slow))
            if self.collector.watch is None:
                self.health.ok()
        except ReadFailed as f:
            self.snapshot = f.snapshot
            self.health.failed()
        except Exception as e:  # noqa: BLE001 - a collector never takes the server down
            self.health.failed("read:" + type(e).__name__, "vramwatch: %s collector failed: %r", self.name, e)
        self.health.duration = time.perf_counter() - t0

    # --- scrape ---
    def collect(self, ctx: ScrapeContext) -> Iterable[Metric]:
        snap = self.snapshot
        if snap is None:
            return ()
        try:
            return tuple(self.collector.families(snap, ctx))
        except Exception as e:  # noqa: BLE001 - a bad snapshot drops families, never the scrape
            self.health.failed("families", "vramwatch: %s families failed: %r", self.name, e)
            return ()

    # --- threads ---
    def start(self) -> None:
        watch = self.collector.watch
        if watch is not None:
            self._watcher = self._spawn(f"vramwatch-{self.name}-watch", self._watch_loop, watch)
        self.poll_once()
        self._poller = self._spawn(f"vramwatch-{self.name}", self._poll_loop)

    def stop(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5.0)
        if self._poller is None or not self._poller.is_alive():  # never while a read may still run
            self.collector.close()
        watch = self.collector.watch
        if watch is not None and self._watcher is not None:
            self._watcher.join(timeout=watch.max_wait + 2.0)  # its loop closes the watch
        elif watch is not None:
            watch.close()  # never started (the server failed to open)

    @property
    def running(self) -> bool:
        return any(t is not None and t.is_alive() for t in (self._poller, self._watcher))

    @staticmethod
    def _spawn(name: str, target: Callable[..., None], *args: object) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        return t

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll_once()

    def _watch_loop(self, watch: Watch) -> None:
        while not self._stop.is_set():
            pause = watch.step()
            if pause > 0:
                self._stop.wait(pause)
        watch.close()


# --- registration ---
@dataclass(frozen=True)
class Registration:
    name: str
    enabled: Callable[[Settings], bool]
    factory: Callable[[Settings], Collector]
    doc: str


REGISTRY: dict[str, Registration] = {}

C = TypeVar("C", bound=type[Collector])


def register(name: str, enabled: Callable[[Settings], bool], doc: str) -> Callable[[C], C]:
    """Class decorator: the collector ``name``, on when ``enabled(settings)``, built as ``cls(settings)``."""

    def deco(cls: C) -> C:
        cls.name = name
        REGISTRY[name] = Registration(name, enabled, cls, doc)
        return cls

    return deco


def enabled_collectors(settings: Settings) -> list[Runner]:
    _load_builtin()
    ordered = sorted(REGISTRY.values(), key=lambda r: BUILTIN.index(r.name) if r.name in BUILTIN else len(BUILTIN))
    return [Runner(r.factory(settings), settings) for r in ordered if r.enabled(settings)]


def _load_builtin() -> None:
    # imported for the side effect of registering, in BUILTIN's order; a missing one is skipped
    for mod in BUILTIN:
        try:
            importlib.import_module(f"vramwatch.server.collectors.{mod}")
        except ImportError as e:
            if e.name != f"vramwatch.server.collectors.{mod}":
                log.warning("vramwatch: collector %s unavailable: %r", mod, e)
