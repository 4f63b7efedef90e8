"""Families from the ranks' published samples: allocator, heartbeat, staleness."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from vramwatch.monitoring import contract
from vramwatch.server.collectors import ScrapeContext
from vramwatch.spool import sample_age

DEVICE_METRICS = [m for m in contract.METRICS if m.collector == "allocator" and m.labels == contract.RANK_DEVICE]


def _rank_labels(data: dict) -> list[str]:
    return [str(data.get("rank", "")), str(data.get("local_rank", ""))]


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

    for s in ctx.samples:
        d = s.data
        rl = _rank_labels(d)
        for dev in d.get("devices") or ():
            labels = [str(dev.get("uuid", "")), str(dev.get("device", ""))] + rl
            for name, value in (dev.get("values") or {}).items():
                fam = fams.get(name)
                if fam is not None and isinstance(value, (int, float)):
                    fam.add_metric(labels, float(value))
        ai = d.get("allocator_info")
        if ai:
            info.add_metric(rl + [str(ai.get(k, "")) for k in info_keys()], 1.0)
        snap = d.get("oom_snapshot")
        if snap and snap.get("path"):
            oom_info.add_metric(rl + [str(snap["path"])[:256]], 1.0)
            oom_time.add_metric(rl, float(snap.get("time", 0.0)))
        hb = d.get("heartbeat") or {}
        steps.add_metric(rl, float(hb.get("steps", 0)))
        if hb.get("last"):
            last.add_metric(rl, float(hb["last"]))
        buckets, counts = hb.get("buckets") or [], hb.get("counts") or []
        if buckets and len(counts) == len(buckets) + 1:
            cum, acc = [], 0
            for le, c in zip(list(buckets) + [float("inf")], counts, strict=True):
                acc += c
                cum.append((_le(le), acc))
            hist.add_metric(rl, cum, float(hb.get("sum", 0.0)))
        if hb.get("loss") is not None:
            loss.add_metric(rl, float(hb["loss"]))
        if hb.get("grad_norm") is not None:
            gnorm.add_metric(rl, float(hb["grad_norm"]))
        age.add_metric(rl, sample_age(s, ctx.now))
        rank_info.add_metric(rl + [str(d.get("world_size", "")), str(d.get("hostname", ""))[:128]], 1.0)

    yield from fams.values()
    yield from (info, oom_info, oom_time, steps, last, hist, loss, gnorm, age, rank_info)


def info_keys() -> list[str]:
    return list(contract.spec("torch_cuda_allocator_info").labels[len(contract.RANK) :])


def _le(v: float) -> str:
    return "+Inf" if v == float("inf") else repr(float(v))


def rank_collector_health(ctx: ScrapeContext) -> Iterable[tuple[str, str, dict]]:
    """(collector, rank, {up, errors, duration}) for the collectors that run inside ranks."""
    for s in ctx.samples:
        for name, h in (s.data.get("collectors") or {}).items():
            yield str(name), str(s.data.get("rank", "")), h
