"""Server-side collectors: each reads on its own cadence, a scrape only renders snapshots.

The framework (:mod:`.framework`, :mod:`.health`) owns registration, cadence,
threads, self-health and "log once"; each collector module (``nvml``,
``processes``, ``xid``; ``ranks`` for the ranks' samples) holds only what it
reads. :class:`ScrapeContext` is what every collector may use during one scrape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vramwatch.server.collectors.framework import (
    REGISTRY,
    Cadence,
    Collector,
    ReadFailed,
    Runner,
    Tick,
    Watch,
    enabled_collectors,
    register,
)
from vramwatch.server.collectors.health import Health
from vramwatch.spool import RankSample

__all__ = [
    "REGISTRY",
    "Cadence",
    "Collector",
    "Health",
    "ReadFailed",
    "Runner",
    "ScrapeContext",
    "Tick",
    "Watch",
    "enabled_collectors",
    "register",
]


@dataclass(frozen=True)
class ScrapeContext:
    """What every collector may use during one scrape: the ranks' samples, read once.

    ``samples`` are the live ranks'. ``final`` holds the final samples of dead ranks inside their grace
    window (newest first) and ``carried`` the counters of dead processes, per (uuid, device, rank,
    local_rank, job_id), that the series of that label set go on from: only the ranks' families use them.
    """

    samples: tuple[RankSample, ...]
    now: float
    hostname: str
    final: tuple[RankSample, ...] = ()
    carried: Mapping[tuple[str, int, int, int, str], Mapping[str, float]] = field(default_factory=dict)
