"""The training frameworks' callbacks, and what they share.

- :mod:`vramwatch.integrations.hf`: ``VramwatchCallback`` for the Hugging Face ``Trainer``.
- :mod:`vramwatch.integrations.lightning`: ``VramwatchCallback`` for Lightning (``lightning`` or
  ``pytorch_lightning``).

What runs beside the sampler in every training process (OOM forensics, hygiene, the status line)
is in :mod:`vramwatch.rank.plugins`.

Importing this package imports neither torch nor a training framework; the two callback modules import
their framework when they are imported themselves.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vramwatch.rank.handle import Handle

__all__ = ["framework_settings", "int_attr", "start_for_framework", "stop_if_started"]

log = logging.getLogger("vramwatch")


def framework_settings(
    settings: dict[str, Any],
    rank: int | None,
    local_rank: int | None,
    world_size: int | None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``settings`` plus the framework's rank identity where the user set none.

    Precedence: an explicit setting (argument, ``VRAMWATCH_*``, config file) wins; then what
    the framework reports; then the launcher's environment (torchrun, SLURM, ...), which
    ``vramwatch.rank.identity`` reads when a value stays unset. Raises ``ConfigError`` for bad
    settings, like ``start()``.
    """
    from vramwatch import config

    out = dict(settings)
    _, sources = config.load(out, env)
    for key, value in (("rank", rank), ("local_rank", local_rank), ("world_size", world_size)):
        if value is not None and sources.get(key) == "default" and int(value) >= 0:
            out[key] = int(value)
    return out


def start_for_framework(
    settings: dict[str, Any], rank: int | None, local_rank: int | None, world_size: int | None
) -> tuple[Handle | None, bool]:
    """Start the exporter for a framework callback: (handle, whether this call started it).

    An exporter the script already started is reused as it is. Never raises: a failure is
    logged and training goes on without telemetry (settings were checked when the callback
    was made).
    """
    import vramwatch

    h = vramwatch.current()
    if h is not None:
        return h, False
    try:
        kw = framework_settings(settings, rank, local_rank, world_size)
        return vramwatch.start(**kw), True
    except Exception as e:  # noqa: BLE001 - a callback never stops training
        log.warning("vramwatch: could not start from the training framework: %r", e)
        return None, False


def stop_if_started(handle: Handle | None, owned: bool, stop_on_end: bool) -> None:
    """At the end of training: stop the exporter the callback started itself, so no stale heartbeat stays."""
    import vramwatch

    if owned and stop_on_end and handle is not None and vramwatch.current() is handle:
        vramwatch.stop()


def int_attr(obj: Any, name: str) -> int | None:
    """A framework's rank number, or None; a property that needs a distributed state we lack reads None."""
    try:
        v = getattr(obj, name)
        return int(v) if v is not None else None
    except Exception:  # noqa: BLE001
        return None
