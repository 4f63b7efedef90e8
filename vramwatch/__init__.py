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
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from vramwatch._version import __version__
from vramwatch.config import ConfigError, Settings

if TYPE_CHECKING:
    from vramwatch.rank.handle import Handle

__all__ = [
    "ConfigError",
    "Handle",
    "Settings",
    "__version__",
    "current",
    "start",
    "step",
    "stop",
    "track",
    "watch",
]

T = TypeVar("T")
_lock = threading.Lock()
_handle: Handle | None = None
log = logging.getLogger("vramwatch")


def start(**settings: Any) -> Handle:
    """Start the exporter in this process (idempotent; safe in every rank).

    Raises ``ConfigError`` for an unknown key or a bad value, naming the key and
    its source. After it returns, nothing vramwatch does raises into the caller.
    """
    global _handle
    from vramwatch import config
    from vramwatch.rank.handle import Handle

    resolved, sources = config.load(settings)  # the one place that may raise
    with _lock:
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
    if h is not None:
        try:
            h.heartbeat.step(loss, grad_norm, tokens, samples)
            if h.step_hooks:  # status line / hygiene, only when enabled
                for hook in h.step_hooks:
                    hook()
        except Exception:  # noqa: BLE001
            pass


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
    """Yield from ``iterable``, reporting a step after each item is processed."""
    for item in iterable:
        yield item
        step()


def current() -> Handle | None:
    return _handle


def __getattr__(name: str) -> Any:
    if name == "Handle":
        from vramwatch.rank.handle import Handle

        return Handle
    raise AttributeError(name)
