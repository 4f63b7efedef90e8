"""Families from the ranks' published samples: allocator, heartbeat, staleness.

Live ranks export everything. A dead rank's final sample (inside its grace window, see
:mod:`.rank_view`) exports only what describes how it ended: its counters (OOMs, retries, steps),
the last OOM's values and its OOM snapshot; no memory gauges, heartbeat or sample age, which
would page for memory no process holds or a stall of a job that is gone. Each label set appears
once per exposition: a live rank wins over a dead one of the same rank, the newest dead one over
older ones, and counters carry what the dead processes of that label set counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.core import Metric

from vramwatch.monitoring import contract
from vramwatch.server.collectors import ScrapeContext
from vramwatch.server.collectors.rank_view import CARRIED, DeviceKey, device_key
from vramwatch.spool import CollectorHealth, OomSnapshot, RankSample

DEVICE_METRICS = [m for m in contract.METRICS if m.collector == "allocator" and m.labels == contract.RANK_DEVICE]
# what a dead rank's device exports besides its counters: the values of the OOM that ended it
LAST_OOM = frozenset(m.name for m in DEVICE_METRICS if m.name.startswith("torch_cuda_memory_last_oom_"))
FINAL_DEVICE = CARRIED | LAST_OOM


def _rank_labels(s: RankSample) -> list[str]:
    return [str(s.rank), str(s.local_rank)]


def families(ctx: ScrapeContext) -> Iterable[Metric]:
    fams = {m.name: contract.family(m.name) for m in DEVICE_METRICS}
    info = contract.family("torch_cuda_allocator_info")
    oom_info = contract.family("vramwatch_oom_snapshot_info")
    oom_time = contract.family("vramwatch_oom_snapshot_timestamp_seconds")
    steps = contract.family("vramwatch_training_steps_total")
    last = contract.family("vramwatch_training_last_step_timestamp_seconds")
    hist = contract.family("vramwatch_training_step_duration_seconds")
    loss = contract.family("vramwatch_training_loss")
    gnorm = contract.family("vramwatch_training_grad_norm")
    age = contract.family("vramwatch_sample_age_seconds")
    rank_info = contract.family("vramwatch_rank_info")

    finals = _FinalIndex(ctx.final) if ctx.final else None
    for s in ctx.samples:
        rl = _rank_labels(s)
        for dev in s.devices:
            labels = [dev.uuid, str(dev.device)] + rl
            values = dev.values
            if finals is not None or ctx.carried:
                values = _continued(device_key(s, dev), values, ctx.carried, finals)
            for name, value in values.items():
                fam = fams.get(name)
                if fam is not None:
                    fam.add_metric(labels, value)
        if s.allocator_info is not None:
            info.add_metric(rl + list(s.allocator_info.labels()), 1.0)
        snapshot = s.oom_snapshot
        if finals is not None:
            snapshot = _newer(snapshot, finals.snapshot.get((s.rank, s.local_rank)))
        if snapshot is not None:
            oom_info.add_metric(rl + [snapshot.path[:256]], 1.0)
            oom_time.add_metric(rl, snapshot.time)
        hb = s.heartbeat
        steps.add_metric(rl, float(hb.steps))
        if hb.last_step_time:
            last.add_metric(rl, hb.last_step_time)
        if hb.buckets and len(hb.counts) == len(hb.buckets) + 1:
            cum, acc = [], 0
            for le, c in zip(hb.buckets + (float("inf"),), hb.counts, strict=True):
                acc += c
                cum.append((_le(le), acc))
            hist.add_metric(rl, cum, hb.sum)
        if hb.loss is not None:
            loss.add_metric(rl, hb.loss)
        if hb.grad_norm is not None:
            gnorm.add_metric(rl, hb.grad_norm)
        age.add_metric(rl, s.age(ctx.now))
        rank_info.add_metric(rl + [str(s.world_size), s.hostname[:128]], 1.0)

    if finals is not None:
        live_devices = {device_key(s, d) for s in ctx.samples for d in s.devices}
        live_ranks = {(s.rank, s.local_rank) for s in ctx.samples}
        for key, values in finals.devices.items():  # devices no live rank exports now
            if key in live_devices:
                continue
            labels = [key[0], str(key[1]), str(key[2]), str(key[3])]
            for name, value in _continued(key, values, ctx.carried, None, live=False).items():
                fam = fams.get(name)
                if fam is not None and name in FINAL_DEVICE:
                    fam.add_metric(labels, value)
        for rk, s in finals.rank.items():  # ranks with no live process now
            if rk in live_ranks:
                continue
            rl = _rank_labels(s)
            snapshot = finals.snapshot.get(rk)
            if snapshot is not None:
                oom_info.add_metric(rl + [snapshot.path[:256]], 1.0)
                oom_time.add_metric(rl, snapshot.time)
            steps.add_metric(rl, float(s.heartbeat.steps))
            rank_info.add_metric(rl + [str(s.world_size), s.hostname[:128]], 1.0)

    yield from fams.values()
    yield from (info, oom_info, oom_time, steps, last, hist, loss, gnorm, age, rank_info)


class _FinalIndex:
    """The dead ranks' final samples by label set, the newest winning (``final`` comes newest first)."""

    def __init__(self, final: Iterable[RankSample]) -> None:
        self.devices: dict[DeviceKey, dict[str, float]] = {}  # the newest values, the last OOM's kept from older ones
        self.rank: dict[tuple[int, int], RankSample] = {}
        self.snapshot: dict[tuple[int, int], OomSnapshot] = {}
        for s in final:
            rk = (s.rank, s.local_rank)
            self.rank.setdefault(rk, s)
            newest = _newer(self.snapshot.get(rk), s.oom_snapshot)
            if newest is not None:
                self.snapshot[rk] = newest
            for d in s.devices:
                values = self.devices.setdefault(device_key(s, d), dict(d.values))
                for name in LAST_OOM - values.keys():
                    if name in d.values:
                        values[name] = d.values[name]


def _newer(a: OomSnapshot | None, b: OomSnapshot | None) -> OomSnapshot | None:
    if a is None or (b is not None and b.time > a.time):
        return b
    return a


def _continued(
    key: DeviceKey,
    values: Mapping[str, float],
    carried: Mapping[DeviceKey, Mapping[str, float]],
    finals: _FinalIndex | None,
    live: bool = True,
) -> Mapping[str, float]:
    """A label set's values: its counters go on from what its dead processes counted (for a live
    process, added to its own; with only dead ones left, their sum), and the last OOM's values stay
    when the newest process has had none yet."""
    base = carried.get(key)
    dead = finals.devices.get(key) if finals is not None else None
    if not base and not dead:
        return values
    out = dict(values)
    if dead:
        for name in LAST_OOM - out.keys():
            if name in dead:
                out[name] = dead[name]
    if base:
        for name, value in base.items():
            out[name] = out.get(name, 0.0) + value if live else value
    return out


def _le(v: float) -> str:
    return "+Inf" if v == float("inf") else repr(float(v))


def rank_collector_health(ctx: ScrapeContext) -> Iterable[tuple[str, str, CollectorHealth]]:
    """(collector, rank, health) for the collectors that run inside ranks (live ranks only)."""
    for s in ctx.samples:
        for name, h in s.collectors.items():
            yield name, str(s.rank), h
