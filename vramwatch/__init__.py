"""vramwatch: the CUDA caching allocator and NVML as a Prometheus target, from inside a PyTorch job.

    import vramwatch
    vramwatch.start()          # once per process, every rank
    for batch in loader:
        ...
        vramwatch.step()       # the heartbeat

Importing vramwatch imports neither torch nor any training framework.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from vramwatch._version import __version__
from vramwatch.config import ConfigError, Settings

if TYPE_CHECKING:
    from vramwatch.rank.handle import Handle
    from vramwatch.rank.phase import Phase

__all__ = [
    "ConfigError",
    "Handle",
    "Settings",
    "__version__",
    "current",
    "phase",
    "start",
    "step",
    "stop",
    "track",
    "watch",
]

T = TypeVar("T")
_lock = threading.Lock()
_handle: Handle | None = None
# the settings of a handle a forked child inherited from its parent: the child starts its own with them at
# its first step() (a rank forked by accelerate's notebook_launcher); None: nothing to start
_forked_settings: dict[str, Any] | None = None
_start_settings: dict[str, Any] = {}
log = logging.getLogger("vramwatch")


def _after_fork_in_child() -> None:
    """The parent's handle is dead here (no sampler thread, its spool files the parent's): drop it, so
    that start() and the callbacks make the child its own, and its first step() starts one by itself."""
    global _handle, _lock, _forked_settings
    _lock = threading.Lock()  # a copy held by another of the parent's threads at the fork would never be freed
    if _handle is not None:
        _forked_settings = dict(_start_settings)
    _handle = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def start(**settings: Any) -> Handle:
    """Start the exporter in this process (idempotent; safe in every rank).

    Raises ``ConfigError`` for an unknown key or a bad value, naming the key and
    its source. After it returns, nothing vramwatch does raises into the caller.
    """
    global _handle
    from vramwatch import config
    from vramwatch.rank.handle import Handle

    global _forked_settings, _start_settings
    resolved, sources = config.load(settings)  # the one place that may raise
    with _lock:
        _forked_settings = None
        if _handle is not None:
            if settings and resolved != _handle.settings:
                log.warning("vramwatch.start() called again with other settings; keeping the first")
            return _handle
        logging.getLogger("vramwatch").setLevel(resolved.log_level)
        h = Handle(resolved, sources)
        try:
            h.start()
        except Exception as e:  # noqa: BLE001 - a broken exporter must not stop the job
            log.warning("vramwatch: could not start: %r", e)
        _handle = h
        _start_settings = dict(settings)
        return h


def stop() -> None:
    """Stop sampling and withdraw this process's series."""
    global _handle
    with _lock:
        h, _handle = _handle, None
    if h is not None:
        try:
            h.stop()
        except Exception as e:  # noqa: BLE001
            log.warning("vramwatch: stop failed: %r", e)


def step(loss: Any = None, grad_norm: Any = None, tokens: Any = None, samples: Any = None) -> None:
    """Report one training step (the heartbeat). Costs about a microsecond; never raises.

    ``tokens`` / ``samples``: how many the step processed on this rank (Python numbers), summed into
    ``vramwatch_training_tokens_total`` / ``_samples_total``.
    """
    h = _handle
    if h is None:
        if _forked_settings is None:
            return
        h = _start_in_forked_child()
        if h is None:
            return
    try:
        h.heartbeat.step(loss, grad_norm, tokens, samples)
        if h.step_hooks:  # status line / hygiene, only when enabled
            for hook in h.step_hooks:
                hook()
    except Exception:  # noqa: BLE001
        pass


def _start_in_forked_child() -> Handle | None:
    """A child forked after its parent's start() steps: it exports as its own rank, said in one line."""
    global _forked_settings
    settings, _forked_settings = _forked_settings, None
    if settings is None:
        return None
    try:
        h = start(**settings)
        pid = os.getpid()
        log.warning("vramwatch: process %d was forked from one that had started vramwatch; started its own", pid)
        return h
    except Exception as e:  # noqa: BLE001 - never into the job
        log.warning(
            "vramwatch: forked process %d could not start its own exporter (%r); it exports nothing", os.getpid(), e
        )
        return None


def phase(name: str) -> Phase:
    """Declare a non-training phase: ``with vramwatch.phase("eval"): ...`` (also ``save``, ``load``, ``compile``;
    any other name is published as ``other``).

    While it is open the rank publishes ``vramwatch_training_phase_start_timestamp_seconds{phase}``, so the
    stall alerts wait (up to their limit) instead of paging for an evaluation. Phases nest (the innermost is
    published). Without ``start()`` it does nothing; it never raises.
    """
    from vramwatch.rank.phase import Phase

    h = _handle
    return Phase(h.heartbeat.phases if h is not None else None, name)


def watch(model: Any, optimizer: Any = None, flops_per_token: float | None = None) -> None:
    """Publish the device memory of ``model``'s parameters and gradients and ``optimizer``'s state.

    Walked on the sampler thread every ``role_interval`` seconds (never on the training thread), held
    through weak references (a deleted model is never kept alive). ``flops_per_token``: the model's
    training FLOPs per token (about 6 x parameters for a dense transformer), for the MFU panel.
    Call after ``start()``; a later call replaces the watched objects. Never raises.
    """
    h = _handle
    if h is None:
        log.warning("vramwatch.watch() before vramwatch.start(): nothing is watched")
        return
    try:
        h.watch(model, optimizer, flops_per_token)
    except Exception as e:  # noqa: BLE001 - never into training code
        log.warning("vramwatch: cannot watch the model: %r", e)


def track(iterable: Iterable[T]) -> Iterator[T]:
    """Yield from ``iterable``, reporting a step after each item is processed.

    The time spent in the iterable's ``next()`` (waiting for the batch) is published as
    ``vramwatch_training_wait_seconds_total{kind="data"}``."""
    it = iter(iterable)
    clock = time.perf_counter
    while True:
        t0 = clock()
        try:
            item = next(it)
        except StopIteration:
            return
        h = _handle
        if h is not None:
            hb = h.heartbeat
            hb.data_wait += clock() - t0
            hb.data_tracked = True
        yield item
        step()


def current() -> Handle | None:
    return _handle


def __getattr__(name: str) -> Any:
    if name == "Handle":
        from vramwatch.rank.handle import Handle

        return Handle
    raise AttributeError(name)
