"""Allocator pressure: cudaMalloc retries, OOMs, fragmentation while memory is high, leaks."""

from __future__ import annotations

import dataclasses

from vramwatch.monitoring import contract
from vramwatch.monitoring.config import MonitoringConfig
from vramwatch.monitoring.promql import (
    DEVICE_WHERE,
    LEAK_PROJECTION_RECORD,
    VALUE_BYTES,
    VALUE_INT,
    VALUE_PERCENT,
    WARNING,
    alert,
    duration,
    go_string,
    metric,
    num,
    percent,
)


def _time_to_limit(cfg: MonitoringConfig) -> str:
    """A sentence of the leak's description: when the peak meets the budget at its rate over the leak window
    (the rule's value is the peak at the horizon, which says how much, not when). Empty when not rising."""
    names = ("instance", "uuid", "device", "rank", contract.JOB_ID)  # one rank's device on one target
    where = [f"{n}=%q" for n in names]
    bare = dataclasses.replace(cfg, selector="")  # the labels pin the one series: no selector in the Go string
    peak = metric(bare, "torch_cuda_memory_step_peak_allocated_bytes", *where)
    limit = metric(bare, "torch_cuda_memory_limit_bytes", *where)
    query = f"({limit} - {peak}) / deriv({peak}[{duration(cfg.leak_window)}]) > 0"
    one = " ".join(f"$labels.{n}" for n in names)
    args = " ".join([one] * (query.count("%q") // len(names)))  # the labels of each use of the selector
    return (
        f"{{{{ with printf {go_string(query)} {args} | query }}}}{{{{ with first . }}}}"
        " At that rate it meets the budget in about {{ .Value | humanizeDuration }}.{{ end }}{{ end }}"
    )


def leak_projection(cfg: MonitoringConfig) -> str:
    """Per rank: the step peak extrapolated over ``leak_window`` to ``leak_horizon_hours`` ahead."""
    peak = metric(cfg, "torch_cuda_memory_step_peak_allocated_bytes")
    return f"predict_linear({peak}[{duration(cfg.leak_window)}], {num(cfg.leak_horizon_seconds)})"


def rules(cfg: MonitoringConfig) -> list[dict]:
    retries = metric(cfg, "torch_cuda_memory_alloc_retries_total")
    ooms = metric(cfg, "torch_cuda_memory_ooms_total")
    frag = metric(cfg, "torch_cuda_memory_fragmentation_ratio")
    reserved = metric(cfg, "torch_cuda_memory_reserved_bytes")
    limit = metric(cfg, "torch_cuda_memory_limit_bytes")
    return [
        alert(
            "TorchAllocatorRetries",
            f"increase({retries}[{duration(cfg.alloc_retry_window)}]) > {num(cfg.alloc_retries_max)}",
            WARNING,
            "The caching allocator keeps flushing its cache to retry cudaMalloc.",
            f"{DEVICE_WHERE}: about {VALUE_INT} cudaMalloc retries in the last {cfg.alloc_retry_window}. "
            "Each retry frees the whole cache and synchronises: steps slow down, and an OOM is near.",
        ),
        alert(
            "TorchOutOfMemory",
            # the second arm: a series whose first sample already counts an OOM (a rank that died of it
            # before Prometheus' first scrape of it), where increase() has no earlier sample to compare
            f"increase({ooms}[{duration(cfg.oom_window)}]) > 0\n"
            f"or ({ooms} > 0 unless {ooms} offset {duration(cfg.oom_window)})",
            WARNING,
            "The caching allocator raised an out-of-memory error.",
            f"{DEVICE_WHERE}: about {VALUE_INT} CUDA out-of-memory error(s) in the last {cfg.oom_window}. "
            "torch_cuda_memory_last_oom_requested_bytes shows the request that failed.",
        ),
        alert(
            "TorchMemoryFragmented",
            f"{frag} > {num(cfg.fragmentation_ratio)}\nand {reserved} / {limit} > {num(cfg.memory_warning_ratio)}",
            WARNING,
            f"More than {percent(cfg.fragmentation_ratio)} of the allocator's cache holds no tensor "
            f"while memory is above {percent(cfg.memory_warning_ratio)}.",
            f"{DEVICE_WHERE}: {VALUE_PERCENT} of the reserved bytes are free cached pieces "
            f"(fragmentation) while the rank's reserved bytes exceed {percent(cfg.memory_warning_ratio)} "
            "of its budget: a large request can fail although the card shows memory free.",
            cfg.fragmentation_for,
        ),
    ]


def leak_rules(cfg: MonitoringConfig) -> list[dict]:
    """The leak projection over an hour of every rank's step peak: a group of its own beside the fast alerts."""
    limit = metric(cfg, "torch_cuda_memory_limit_bytes")
    peak = metric(cfg, "torch_cuda_memory_step_peak_allocated_bytes")
    leak_w = duration(cfg.leak_window)
    return [
        # first: the leak alert reads it in the same evaluation; the dashboard's projection reads it too
        {"record": LEAK_PROJECTION_RECORD, "expr": leak_projection(cfg)},
        alert(
            "TorchMemoryLeak",
            f"{metric(cfg, LEAK_PROJECTION_RECORD)} > {limit}\nand {peak} offset {leak_w}",
            WARNING,
            f"A rank's per-step peak memory is on course to exhaust its budget within "
            f"{cfg.leak_horizon_hours:g} hours.",
            f"{DEVICE_WHERE}: the per-step high-water mark of allocated bytes is rising; extrapolated over "
            f"the last {cfg.leak_window} it reaches {VALUE_BYTES} in {cfg.leak_horizon_hours:g} hours, "
            "beyond the rank's budget (torch_cuda_memory_limit_bytes)." + _time_to_limit(cfg),
            cfg.leak_for,
        ),
    ]
