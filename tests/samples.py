"""One rank's sample for a test, with only the fields the test is about spelled out.

The ``rank_sample`` fixture (tests/conftest.py) hands this factory to a test; helpers outside a test
(rigs, module-level builders) import it from here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from vramwatch.spool import DeviceSample, RankSample


def rank_sample(
    rank: int = 0,
    *,
    uuid: str | None = None,
    values: Mapping[str, float] | None = None,
    device: int = 0,
    **fields: Any,
) -> RankSample:
    """A sample of ``rank`` (its local rank too) of a one-rank job on node-a, by this process, taken now.

    ``uuid`` (with ``values``, on CUDA device ``device``) gives it one device; ``fields`` set any other
    RankSample field, ``devices`` included.
    """
    if uuid is not None:
        fields.setdefault("devices", (DeviceSample(device, uuid, dict(values or {})),))
    base: dict[str, Any] = {
        "rank": rank,
        "local_rank": rank,
        "world_size": 1,
        "hostname": "node-a",
        "pid": os.getpid(),
        "time": time.time(),
    }
    base.update(fields)
    return RankSample(**base)
