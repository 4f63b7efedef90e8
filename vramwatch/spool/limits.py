"""How much of one rank's sample the server takes: the size and count bounds, in one place.

Any local user who can write into the spool (or a buggy rank) decides what a sample holds, so the
server bounds what it reads before anything reaches an exposition: the file's size, the devices,
the collector entries and the values of one sample, and the length of every string that becomes a
label value. What a bound cuts is counted by reason (``vramwatch_spool_dropped_total``), never
silently lost. A real rank stays far inside every bound: 8 GPUs with 7 MIG slices each are 56
devices; a GPU UUID is 40 characters, a MIG one 44; a host name at most 253.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from vramwatch.spool.schema import DeviceSample, RankSample

MAX_SAMPLE_BYTES = 1 << 20  # a rank's sample file; a real one is a few KiB
MAX_DEVICES = 64  # devices in one sample
MAX_COLLECTORS = 16  # collector entries in one sample (a rank has one: the allocator)
MAX_DEVICE_VALUES = 128  # values of one device (a rank sends about 25)
MAX_LABEL_VALUE = 256  # characters of any string that becomes a label value
# series a target's ranks may render: max_ranks times this, shared fairly among a node daemon's users (a rank
# on one GPU renders about 50, one process driving 8 GPUs about 280; within its own per-sample bounds a
# sample may claim thousands)
SERIES_PER_RANK = 128

# reasons of vramwatch_spool_dropped_total, each exported from 0
DROP_REASONS = ("dead_rank", "rank", "oversized", "device", "collector", "value", "label", "refused")


def _fits(text: str) -> bool:
    return len(text) <= MAX_LABEL_VALUE


def bounded(sample: RankSample, dropped: Counter[str]) -> RankSample:
    """``sample`` within the bounds; what was cut is added to ``dropped`` by reason.

    A device, collector or OOM snapshot whose label value is too long is dropped with its entry,
    not truncated: two entries cut to one prefix would repeat a label set in one exposition.
    The host name labels only the rank's own info series and is cut instead.
    """
    before = dropped.total()
    devices = sample.devices
    if len(devices) > MAX_DEVICES:
        dropped["device"] += len(devices) - MAX_DEVICES
        devices = devices[:MAX_DEVICES]
    kept: list[DeviceSample] = []
    for d in devices:
        if not _fits(d.uuid):
            dropped["label"] += 1
            continue
        if len(d.values) > MAX_DEVICE_VALUES:
            dropped["value"] += len(d.values) - MAX_DEVICE_VALUES
            d = replace(d, values=dict(list(d.values.items())[:MAX_DEVICE_VALUES]))
        kept.append(d)
    collectors = dict(list(sample.collectors.items())[:MAX_COLLECTORS])
    if len(sample.collectors) > MAX_COLLECTORS:
        dropped["collector"] += len(sample.collectors) - MAX_COLLECTORS
    for name in [n for n in collectors if not _fits(n)]:
        dropped["label"] += 1
        del collectors[name]
    info = sample.allocator_info
    if info is not None and not all(_fits(v) for v in info.labels()):
        dropped["label"] += 1
        info = None
    snapshot = sample.oom_snapshot
    if snapshot is not None and not _fits(snapshot.path):
        dropped["label"] += 1
        snapshot = None
    hostname = sample.hostname
    if not _fits(hostname):
        dropped["label"] += 1
        hostname = hostname[:MAX_LABEL_VALUE]
    if dropped.total() == before:
        return sample  # the usual case: nothing cut (every cut is counted), nothing copied
    return replace(
        sample,
        hostname=hostname,
        devices=tuple(kept),
        collectors=collectors,
        allocator_info=info,
        oom_snapshot=snapshot,
    )


def series(sample: RankSample) -> int:
    """At most how many series ``sample`` renders (its devices' values and roles, its rank's own families,
    the step histogram's buckets, its collectors' health): what the series budget counts."""
    n = 16 + len(sample.heartbeat.buckets) + 3 * len(sample.collectors)
    for d in sample.devices:
        n += len(d.values) + len(d.roles)
    return n
