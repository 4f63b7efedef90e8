"""Families from the ranks' published samples: allocator, heartbeat, staleness.

Live ranks export everything. A dead rank's final sample (inside its grace window, see
:mod:`.rank_view`) exports only what describes how it ended: how (``vramwatch_rank_exits_total``:
its own word, or ``killed`` when it left none; shown even once a successor runs), its counters (OOMs,
retries, steps, collectives), the last OOM's values and its OOM snapshot; no memory gauges, heartbeat
or sample age, which would page for memory no process holds or a stall of a job that is gone. Each label set appears
once per exposition: a live rank wins over a dead one of the same rank and job, the newest dead one over
older ones, and counters carry what the dead processes of that label set counted. A rank is one of
its job (``job_id``): rank 0 of two jobs on the node are two ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import Metric

from vramwatch.monitoring import contract
from vramwatch.server.collectors import ScrapeContext
from vramwatch.server.collectors.rank_view import CARRIED, DeviceKey, RankKey, device_key, rank_key
from vramwatch.spool import MEMORY_ROLES, CollectorHealth, OomSnapshot, RankSample, TrainingState
from vramwatch.spool.schema import NONFINITE_VALUES, WAIT_KINDS

DEVICE_METRICS = [m for m in contract.METRICS if m.collector == "allocator" and m.labels == contract.RANK_DEVICE]
# what a dead rank's device exports besides its counters: the values of the OOM that ended it
LAST_OOM = frozenset(m.name for m in DEVICE_METRICS if m.name.startswith("torch_cuda_memory_last_oom_"))
FINAL_DEVICE = CARRIED | LAST_OOM
_DEVICE_FAMILIES = tuple(m.name for m in DEVICE_METRICS)


def _rank_labels(s: RankSample) -> list[str]:
    return [str(s.rank), str(s.local_rank), s.job_id]  # contract.RANK


RankFailed = Callable[[RankSample, Exception], None]

_ROLE_FAMILY = "vramwatch_memory_role_bytes"
# the per-rank families (not per device), in the contract's order
_RANK_FAMILIES = tuple(
    m.name for m in contract.METRICS if m.collector in ("allocator", "heartbeat") and m.labels != contract.RANK_DEVICE
)
_NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _empty() -> dict[str, Any]:
    """The families, in exposition order: the device ones, then the rank ones."""
    return {name: contract.family(name) for name in _DEVICE_FAMILIES + _RANK_FAMILIES}


def families(ctx: ScrapeContext, failed: RankFailed | None = None) -> Iterable[Metric]:
    """Every rank's families. Each rank (live, or dead with only its final sample left) renders into
    families of its own first, so one that fails (the codec refuses mis-shaped samples; this is the
    second line) is left out alone and told to ``failed``."""
    finals = _FinalIndex(ctx.final) if ctx.final else None
    merged = _empty()

    def add(s: RankSample, render: Callable[..., None], *args: Any) -> None:
        own = _empty()
        try:
            render(own, *args)
        except Exception as e:  # noqa: BLE001 - one rank never fails the scrape of the others
            if failed is not None:
                failed(s, e)
            return
        for name, fam in own.items():
            merged[name].samples.extend(fam.samples)

    for s in ctx.samples:
        add(s, _live_rank, s, ctx, finals)
    if finals is not None:
        live_devices = {device_key(s, d) for s in ctx.samples for d in s.devices}
        live_ranks = {rank_key(s) for s in ctx.samples}
        for rk, s in finals.rank.items():  # ranks with no live process now
            if rk not in live_ranks:
                add(s, _dead_rank, rk, s, finals)
            else:  # restarted within the grace window: how the previous process ended still shows
                add(s, _exit, s)
        for key, values in finals.devices.items():  # devices no live rank exports now
            if key not in live_devices:
                owner = finals.rank[(key[4], key[2], key[3])]
                add(owner, _dead_device, key, values, ctx.carried)
    return merged.values()


def _live_rank(fams: dict[str, Any], s: RankSample, ctx: ScrapeContext, finals: _FinalIndex | None) -> None:
    rl = _rank_labels(s)
    for dev in s.devices:
        labels = [dev.uuid, str(dev.device)] + rl
        values: Mapping[str, float] = dev.values
        if finals is not None or ctx.carried:
            values = _continued(device_key(s, dev), values, ctx.carried, finals)
        for name, value in values.items():
            if name in _DEVICE_FAMILIES:
                fams[name].add_metric(labels, value)
        for role in MEMORY_ROLES:  # the codec admits no other role: bounded label values
            if role in dev.roles:
                fams[_ROLE_FAMILY].add_metric(labels + [role], dev.roles[role])
    if s.allocator_info is not None:
        fams["torch_cuda_allocator_info"].add_metric(rl + list(s.allocator_info.labels()), 1.0)
    snapshot = s.oom_snapshot
    if finals is not None:
        snapshot = _newer(snapshot, finals.snapshot.get(rank_key(s)))
    _snapshot(fams, rl, snapshot)
    hb = s.heartbeat
    fams["vramwatch_training_steps_total"].add_metric(rl, float(hb.steps))
    if hb.tokens is not None:
        fams["vramwatch_training_tokens_total"].add_metric(rl, hb.tokens)
    if hb.samples is not None:
        fams["vramwatch_training_samples_total"].add_metric(rl, hb.samples)
    if s.flops_per_token is not None:
        fams["vramwatch_model_flops_per_token"].add_metric(rl, s.flops_per_token)
    if hb.last_step_time:
        fams["vramwatch_training_last_step_timestamp_seconds"].add_metric(rl, hb.last_step_time)
    if hb.buckets and len(hb.counts) == len(hb.buckets) + 1:
        cum, acc = [], 0
        for le, c in zip(hb.buckets + (float("inf"),), hb.counts, strict=True):
            acc += c
            cum.append((_le(le), acc))
        fams["vramwatch_training_step_duration_seconds"].add_metric(rl, cum, hb.sum)
    t = s.training
    loss = _NONFINITE[t.loss] if t is not None and t.loss else hb.loss  # NaN / +-Inf exported as they are
    if loss is not None:
        fams["vramwatch_training_loss"].add_metric(rl, loss)
    grad_norm = _NONFINITE[t.grad_norm] if t is not None and t.grad_norm else hb.grad_norm
    if grad_norm is not None:
        fams["vramwatch_training_grad_norm"].add_metric(rl, grad_norm)
    fams["vramwatch_sample_age_seconds"].add_metric(rl, s.age(ctx.now))
    _rank_info(fams, rl, s)
    if t is not None:
        _training(fams, rl, t)


def _training(fams: dict[str, Any], rl: list[str], t: TrainingState) -> None:
    """A live rank's collectives, waits, phase and non-finite counts (the codec admits only bounded names)."""
    if t.collectives is not None:
        fams["vramwatch_collectives_total"].add_metric(rl, float(t.collectives))
    for kind in WAIT_KINDS:
        if kind in t.waits:
            fams["vramwatch_training_wait_seconds_total"].add_metric(rl + [kind], t.waits[kind])
    if t.phase:
        fams["vramwatch_training_phase_start_timestamp_seconds"].add_metric(rl + [t.phase], t.phase_start)
    for value in NONFINITE_VALUES:
        if value in t.nonfinite:
            fams["vramwatch_training_nonfinite_total"].add_metric(rl + [value], float(t.nonfinite[value]))


def _exit(fams: dict[str, Any], s: RankSample) -> None:
    """How a dead rank ended: its own word, or ``killed`` when its final sample carries none."""
    t = s.training
    reason, detail = (t.exit_reason, t.exit_detail) if t is not None and t.exit_reason else ("killed", "")
    fams["vramwatch_rank_exits_total"].add_metric(_rank_labels(s) + [reason, detail], 1.0)


def _dead_rank(fams: dict[str, Any], rk: RankKey, s: RankSample, finals: _FinalIndex) -> None:
    rl = _rank_labels(s)
    _snapshot(fams, rl, finals.snapshot.get(rk))
    fams["vramwatch_training_steps_total"].add_metric(rl, float(s.heartbeat.steps))
    _rank_info(fams, rl, s)
    _exit(fams, s)
    t = s.training
    if t is not None and t.collectives is not None:  # where it stopped: lowest of its job in a hang it caused
        fams["vramwatch_collectives_total"].add_metric(rl, float(t.collectives))


def _dead_device(
    fams: dict[str, Any], key: DeviceKey, values: Mapping[str, float], carried: Mapping[DeviceKey, Mapping[str, float]]
) -> None:
    labels = [key[0], str(key[1]), str(key[2]), str(key[3]), key[4]]
    for name, value in _continued(key, values, carried, None, live=False).items():
        if name in FINAL_DEVICE and name in _DEVICE_FAMILIES:
            fams[name].add_metric(labels, value)


def _snapshot(fams: dict[str, Any], rl: list[str], snapshot: OomSnapshot | None) -> None:
    if snapshot is not None:
        fams["vramwatch_oom_snapshot_info"].add_metric(rl + [snapshot.path[:256]], 1.0)
        fams["vramwatch_oom_snapshot_timestamp_seconds"].add_metric(rl, snapshot.time)


def _rank_info(fams: dict[str, Any], rl: list[str], s: RankSample) -> None:
    fams["vramwatch_rank_info"].add_metric(rl + [str(s.world_size), s.hostname[:128]], 1.0)


class _FinalIndex:
    """The dead ranks' final samples by label set, the newest winning (``final`` comes newest first)."""

    def __init__(self, final: Iterable[RankSample]) -> None:
        self.devices: dict[DeviceKey, dict[str, float]] = {}  # the newest values, the last OOM's kept from older ones
        self.rank: dict[RankKey, RankSample] = {}
        self.snapshot: dict[RankKey, OomSnapshot] = {}
        for s in final:
            rk = rank_key(s)
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


AGE_FAMILY = "vramwatch_sample_age_seconds"


def age_family(samples: Iterable[RankSample], now: float) -> Metric:
    """The one family that moves with the clock, not with the samples: the cached exposition renders
    again once its render is older than the render gap, so this family is at most that old
    (:mod:`vramwatch.server.exposition_cache`)."""
    age = contract.family(AGE_FAMILY)
    for s in samples:
        age.add_metric(_rank_labels(s), s.age(now))
    return age


def _le(v: float) -> str:
    return "+Inf" if v == float("inf") else repr(float(v))


def rank_collector_health(ctx: ScrapeContext) -> Iterable[tuple[str, str, str, CollectorHealth]]:
    """(collector, rank, job_id, health) for the collectors that run inside ranks (live ranks only)."""
    for s in ctx.samples:
        for name, h in s.collectors.items():
            yield name, str(s.rank), s.job_id, h
