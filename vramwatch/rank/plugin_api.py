"""What a rank plugin is given and what it returns: the types the plugins and their runner share.

Apart from :mod:`vramwatch.rank.plugins` (which runs the plugins and imports each of them) so that a
plugin imports these types without importing its runner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vramwatch.config import Settings
from vramwatch.rank.allocator import AllocatorSource
from vramwatch.rank.heartbeat import Heartbeat
from vramwatch.rank.identity import RankIdentity
from vramwatch.spool import DeviceSample, OomSnapshot


@dataclass(frozen=True, slots=True)
class SampleExtras:
    """What a plugin adds to one sample: values per CUDA device index, and the newest OOM snapshot."""

    device_values: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    oom_snapshot: OomSnapshot | None = None


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a plugin may use of the rank it runs in."""

    settings: Settings
    identity: RankIdentity
    heartbeat: Heartbeat
    source: AllocatorSource
    spool_dir: str  # the server's spool (its NVML readings); the node root when the node daemon serves
    publish_now: Callable[[], bool]  # publish a sample on the calling thread before returning (an OOM)


class Plugin(Protocol):
    def on_sample(self, devices: Sequence[DeviceSample]) -> SampleExtras | None: ...
    def close(self) -> None: ...
