"""The one place that chooses the allocator: torch's, or the simulated GPU's under ``simulate``."""

from __future__ import annotations

import importlib.util
import logging

from vramwatch.config import Settings
from vramwatch.rank.allocator import AllocatorSource, TorchSource

log = logging.getLogger("vramwatch")


def allocator_source(settings: Settings, spool_dir: str) -> AllocatorSource:
    if not settings.simulate:
        if importlib.util.find_spec("torch") is None:  # finds it without importing it
            log.warning(
                "vramwatch: torch is not installed: only the heartbeat (steps) will be exported, no allocator series"
            )
        return TorchSource()
    from vramwatch.sim.allocator import SimAllocator
    from vramwatch.sim.state import SimNode, load_or_create

    try:
        node = load_or_create(spool_dir)
    except OSError as e:  # start() raises only ConfigError: an unusable spool is reported later
        log.warning("vramwatch: cannot read the simulated node in %s (%s); using a default one", spool_dir, e)
        node = SimNode.default(1)
    return SimAllocator(node)
