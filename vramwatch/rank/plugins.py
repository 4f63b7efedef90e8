"""What runs beside the sampler in a training process: OOM forensics, allocator hygiene, the status line.

OOM forensics are always on (they cost nothing until an OOM); hygiene and the status line only when
enabled. Each plugin may have an ``on_step()`` (the training thread, inside ``vramwatch.step()``) and
an ``on_sample(devices)`` (the sampler thread, after each read) that RETURNS what it adds to the
sample (:class:`~vramwatch.rank.plugin_api.SampleExtras`) instead of writing into shared state.
Plugins run in order, each seeing the devices with the previous plugins' values added (the status
line, last, sees them all).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from vramwatch._once import OnceLog
from vramwatch.rank.hygiene import Hygiene
from vramwatch.rank.oom import OomWatcher
from vramwatch.rank.plugin_api import Plugin, RankContext
from vramwatch.rank.status import StatusLine
from vramwatch.spool import DeviceSample, OomSnapshot

log = logging.getLogger("vramwatch")


class Plugins:
    """The plugins of one rank, in order, and the step hooks they registered."""

    def __init__(self, oom: OomWatcher | None = None, hygiene: Hygiene | None = None, status: StatusLine | None = None):
        self.oom, self.hygiene, self.status = oom, hygiene, status
        self.plugins: tuple[Plugin, ...] = tuple(p for p in (oom, hygiene, status) if p is not None)  # status last
        # run by vramwatch.step() on the training thread; empty when hygiene and the status line are off
        self.step_hooks: tuple[Callable[[], None], ...] = tuple(p.on_step for p in (hygiene, status) if p is not None)
        self._once = OnceLog(log)

    def on_sample(self, devices: Sequence[DeviceSample]) -> tuple[Sequence[DeviceSample], OomSnapshot | None]:
        """Run each plugin on the devices; the devices with every plugin's values, and the OOM snapshot."""
        snapshot: OomSnapshot | None = None
        for plugin in self.plugins:
            try:
                extras = plugin.on_sample(devices)
            except Exception as e:  # noqa: BLE001 - a plugin never stops the sample
                self._once("plugin:" + type(e).__name__, "vramwatch: %r failed: %r", plugin, e)
                continue
            if extras is None:
                continue
            if extras.device_values:
                devices = _merged(devices, extras.device_values)
            if extras.oom_snapshot is not None:
                snapshot = extras.oom_snapshot
        return devices, snapshot

    def close(self) -> None:
        """Undo what can be undone (never raises)."""
        for plugin in self.plugins:
            try:
                plugin.close()
            except Exception as e:  # noqa: BLE001
                log.debug("vramwatch: closing %r failed: %r", plugin, e)
        self.step_hooks = ()


def _merged(devices: Sequence[DeviceSample], extra: Mapping[int, Mapping[str, float]]) -> list[DeviceSample]:
    out = []
    for d in devices:
        more = extra.get(d.device)
        out.append(DeviceSample(d.device, d.uuid, {**d.values, **more}) if more else d)
    return out


def attach(ctx: RankContext) -> Plugins:
    """The plugins the settings ask for."""
    s = ctx.settings
    hygiene = Hygiene.for_rank(ctx) if s.reclaim_threshold > 0 else None
    status = StatusLine.for_rank(ctx) if s.status_every > 0 and (s.status_all_ranks or ctx.identity.rank == 0) else None
    return Plugins(OomWatcher.for_rank(ctx), hygiene, status)
