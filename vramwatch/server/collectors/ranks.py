"""Families from the ranks' published samples: allocator, heartbeat, staleness."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import Metric

from vramwatch.monitoring import contract
from vramwatch.server.collectors import ScrapeContext
from vramwatch.spool import MEMORY_ROLES, CollectorHealth, RankSample

DEVICE_METRICS = [m for m in contract.METRICS if m.collector == "allocator" and m.labels == contract.RANK_DEVICE]
_DEVICE_FAMILIES = tuple(m.name for m in DEVICE_METRICS)


def _rank_labels(s: RankSample) -> list[str]:
    return [str(s.rank), str(s.local_rank)]


RankFailed = Callable[[RankSample, Exception], None]


def families(ctx: ScrapeContext, failed: RankFailed | None = None) -> Iterable[Metric]:
    """Every rank's families. Each rank renders into families of its own first, so one that fails (the
    codec refuses mis-shaped samples; this is the second line) is left out alone and told to ``failed``."""
    merged = _empty()
    for s in ctx.samples:
        try:
            own = _rank_families(s, ctx.now)
        except Exception as e:  # noqa: BLE001 - one rank never fails the scrape of the others
            if failed is not None:
                failed(s, e)
            continue
        for name, fam in own.items():
            merged[name].samples.extend(fam.samples)
    return merged.values()


_ROLE_FAMILY = "vramwatch_memory_role_bytes"
_RANK_FAMILIES = (
    _ROLE_FAMILY,
    "torch_cuda_allocator_info",
    "vramwatch_oom_snapshot_info",
    "vramwatch_oom_snapshot_timestamp_seconds",
    "vramwatch_training_steps_total",
    "vramwatch_training_tokens_total",
    "vramwatch_training_samples_total",
    "vramwatch_model_flops_per_token",
    "vramwatch_training_last_step_timestamp_seconds",
    "vramwatch_training_step_duration_seconds",
    "vramwatch_training_loss",
    "vramwatch_training_grad_norm",
    "vramwatch_sample_age_seconds",
    "vramwatch_rank_info",
)


def _empty() -> dict[str, Any]:
    """The families, in exposition order: the device ones, then the rank ones."""
    return {name: contract.family(name) for name in _DEVICE_FAMILIES + _RANK_FAMILIES}


def _rank_families(s: RankSample, now: float) -> dict[str, Any]:
    fams = _empty()
    rl = _rank_labels(s)
    for dev in s.devices:
        labels = [dev.uuid, str(dev.device)] + rl
        for name, value in dev.values.items():
            if name in _DEVICE_FAMILIES:
                fams[name].add_metric(labels, value)
        for role in MEMORY_ROLES:  # the codec admits no other role: bounded label values
            if role in dev.roles:
                fams[_ROLE_FAMILY].add_metric(labels + [role], dev.roles[role])
    if s.allocator_info is not None:
        fams["torch_cuda_allocator_info"].add_metric(rl + list(s.allocator_info.labels()), 1.0)
    if s.oom_snapshot is not None:
        fams["vramwatch_oom_snapshot_info"].add_metric(rl + [s.oom_snapshot.path[:256]], 1.0)
        fams["vramwatch_oom_snapshot_timestamp_seconds"].add_metric(rl, s.oom_snapshot.time)
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
    if hb.loss is not None:
        fams["vramwatch_training_loss"].add_metric(rl, hb.loss)
    if hb.grad_norm is not None:
        fams["vramwatch_training_grad_norm"].add_metric(rl, hb.grad_norm)
    fams["vramwatch_sample_age_seconds"].add_metric(rl, s.age(now))
    fams["vramwatch_rank_info"].add_metric(rl + [str(s.world_size), s.hostname[:128]], 1.0)
    return fams


def _le(v: float) -> str:
    return "+Inf" if v == float("inf") else repr(float(v))


def rank_collector_health(ctx: ScrapeContext) -> Iterable[tuple[str, str, CollectorHealth]]:
    """(collector, rank, health) for the collectors that run inside ranks."""
    for s in ctx.samples:
        for name, h in s.collectors.items():
            yield name, str(s.rank), h
