"""What runs beside the sampler in a training process, and the framework callbacks.

- :mod:`vramwatch.integrations.hf`: ``VramwatchCallback`` for the Hugging Face ``Trainer``.
- :mod:`vramwatch.integrations.lightning`: ``VramwatchCallback`` for Lightning (``lightning`` or
  ``pytorch_lightning``).
- :mod:`vramwatch.rank.oom`: OOM forensics (the allocator's out-of-memory observer, snapshots).
- :mod:`vramwatch.rank.hygiene`: opt-in cache reclaim between steps.
- :mod:`vramwatch.rank.status`: the console status line.

Importing this package imports neither torch nor a training framework; the two callback modules import
their framework when they are imported themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vramwatch.rank.handle import Handle

__all__ = ["framework_settings", "setup", "start_for_framework"]

log = logging.getLogger("vramwatch")


def setup(handle: Handle) -> None:
    """Attach the in-process helpers the settings ask for (called by ``Handle.start()``).

    OOM forensics are always on (they cost nothing until an OOM); the status line and
    hygiene only when enabled. Step hooks run on the training thread inside
    ``vramwatch.step()``; sample hooks on the sampler thread after each read.
    """
    s = handle.settings
    step_hooks: list[Callable[[], None]] = []

    from vramwatch.rank.oom import OomWatcher

    handle.oom = OomWatcher.for_handle(handle)
    handle.sample_hooks.append(handle.oom.on_sample)

    if s.reclaim_threshold > 0:
        from vramwatch.rank.hygiene import Hygiene

        handle.hygiene = Hygiene.for_handle(handle)
        handle.sample_hooks.append(handle.hygiene.on_sample)
        step_hooks.append(handle.hygiene.on_step)

    if s.status_every > 0 and (s.status_all_ranks or handle.identity.rank == 0):
        from vramwatch.rank.status import StatusLine

        handle.status = StatusLine.for_handle(handle)
        handle.sample_hooks.append(handle.status.on_sample)
        step_hooks.append(handle.status.on_step)
    handle.step_hooks = tuple(step_hooks)


def teardown(handle: Handle) -> None:
    """Undo what :func:`setup` attached that can be undone (never raises)."""
    for name in ("oom", "hygiene", "status"):
        part = getattr(handle, name, None)
        close = getattr(part, "close", None)
        if close is not None:
            try:
                close()
            except Exception as e:  # noqa: BLE001
                log.debug("vramwatch: closing %s failed: %r", name, e)
    handle.step_hooks = ()


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
