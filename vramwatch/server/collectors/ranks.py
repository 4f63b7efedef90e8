"""Families from the ranks' published samples: allocator, heartbeat, staleness."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from vramwatch.monitoring import contract
from vramwatch.server.collectors import ScrapeContext
from vramwatch.spool import CollectorHealth, RankSample

DEVICE_METRICS = [m for m in contract.METRICS if m.collector == "allocator" and m.labels == contract.RANK_DEVICE]


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
    rank_info = contract.family("vramwatch_rank_info")

    for s in ctx.samples:
        rl = _rank_labels(s)
        for dev in s.devices:
            labels = [dev.uuid, str(dev.device)] + rl
            for name, value in dev.values.items():
                fam = fams.get(name)
                if fam is not None:
                    fam.add_metric(labels, value)
        if s.allocator_info is not None:
            info.add_metric(rl + list(s.allocator_info.labels()), 1.0)
        if s.oom_snapshot is not None:
            oom_info.add_metric(rl + [s.oom_snapshot.path[:256]], 1.0)
            oom_time.add_metric(rl, s.oom_snapshot.time)
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
        rank_info.add_metric(rl + [str(s.world_size), s.hostname[:128]], 1.0)

    yield from fams.values()
    yield from (info, oom_info, oom_time, steps, last, hist, loss, gnorm)
    yield age_family(ctx.samples, ctx.now)
    yield rank_info


AGE_FAMILY = "vramwatch_sample_age_seconds"


def age_family(samples: Iterable[RankSample], now: float) -> Metric:
    """The one family that moves with the clock, not with the samples: a cached exposition renders it
    per scrape (:mod:`vramwatch.server.exposition_cache`)."""
    age = contract.family(AGE_FAMILY)
    for s in samples:
        age.add_metric(_rank_labels(s), s.age(now))
    return age


def _le(v: float) -> str:
    return "+Inf" if v == float("inf") else repr(float(v))


def rank_collector_health(ctx: ScrapeContext) -> Iterable[tuple[str, str, CollectorHealth]]:
    """(collector, rank, health) for the collectors that run inside ranks."""
    for s in ctx.samples:
        for name, h in s.collectors.items():
            yield name, str(s.rank), h
