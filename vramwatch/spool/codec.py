"""A :class:`~.schema.RankSample` to and from its JSON payload: the only code that knows the keys.

The payload is compact JSON with the schema version under ``"v"``. Decoding never trusts the
file: anything but a well-formed sample of this version raises :class:`SampleRejected`, whose
``reason`` (``older_version``, ``newer_version``, ``malformed``) a reader logs and counts. Every
field is checked for its type and range (the detail names the first bad one), so a sample either
decodes into values the exposition can render, or is dropped alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from itertools import pairwise
from typing import Any, TypeVar

from vramwatch.spool.schema import (
    EXIT_DETAIL,
    EXIT_REASONS,
    JOB_ID,
    JOB_ID_MAX,
    MEMORY_ROLES,
    NONFINITE_KINDS,
    NONFINITE_VALUES,
    PHASES,
    SCHEMA_VERSION,
    WAIT_KINDS,
    AllocatorInfo,
    CollectorHealth,
    DeviceSample,
    HeartbeatSnapshot,
    OomSnapshot,
    RankSample,
    TrainingState,
)

_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_ALLOCATOR_INFO_KEYS = ("backend", "expandable_segments", "garbage_collection_threshold", "max_split_size_mb")


class SampleRejected(ValueError):
    """A payload this reader cannot use; ``version`` is the one it carried, if any."""

    def __init__(self, reason: str, detail: str, version: int | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.version = version


def _training_doc(t: TrainingState) -> dict[str, Any]:
    doc: dict[str, Any] = {}  # only what is set: a rank outside torch.distributed that never ends sends nothing
    if t.exit_reason:
        doc["exit"] = {"reason": t.exit_reason, "detail": t.exit_detail}
    if t.collectives is not None:
        doc["collectives"] = t.collectives
    if t.waits:
        doc["waits"] = dict(t.waits)
    if t.phase:
        doc["phase"] = {"name": t.phase, "start": t.phase_start}
    if t.nonfinite:
        doc["nonfinite"] = dict(t.nonfinite)
    if t.loss:
        doc["loss"] = t.loss
    if t.grad_norm:
        doc["grad_norm"] = t.grad_norm
    return doc


def encode_sample(sample: RankSample) -> bytes:
    """The payload for ``sample``. Raises ValueError for a non-finite number (JSON has none)."""
    hb = sample.heartbeat
    ai = sample.allocator_info
    doc: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "time": sample.time,
        "pid": sample.pid,
        "rank": sample.rank,
        "local_rank": sample.local_rank,
        "world_size": sample.world_size,
        "hostname": sample.hostname,
        "devices": [_encoded_device(d) for d in sample.devices],
        "allocator_info": None if ai is None else dict(zip(_ALLOCATOR_INFO_KEYS, ai.labels(), strict=True)),
        "heartbeat": {
            "steps": hb.steps,
            "last": hb.last_step_time,
            "buckets": hb.buckets,
            "counts": hb.counts,
            "sum": hb.sum,
            "loss": hb.loss,
            "grad_norm": hb.grad_norm,
        },
        "collectors": {
            name: {"up": h.up, "errors": h.errors, "duration": h.duration} for name, h in sample.collectors.items()
        },
    }
    # the optional fields appear only when set, so a job that uses none of them publishes what it did before
    if hb.tokens is not None:
        doc["heartbeat"]["tokens"] = hb.tokens
    if hb.samples is not None:
        doc["heartbeat"]["samples"] = hb.samples
    if sample.flops_per_token is not None:
        doc["flops_per_token"] = sample.flops_per_token
    if sample.job_id:
        doc["job_id"] = sample.job_id
    if sample.oom_snapshot is not None:
        doc["oom_snapshot"] = {"path": sample.oom_snapshot.path, "time": sample.oom_snapshot.time}
    if sample.training:
        doc["training"] = _training_doc(sample.training)
    return _ENCODER.encode(doc).encode()


def _encoded_device(d: DeviceSample) -> dict[str, Any]:
    doc: dict[str, Any] = {"device": d.device, "uuid": d.uuid, "values": d.values}
    if d.roles:
        doc["roles"] = d.roles
    return doc


def decode_sample(payload: bytes) -> RankSample:
    """The sample in ``payload``; raises :class:`SampleRejected` for anything else."""
    try:
        doc = json.loads(payload)
    except (ValueError, RecursionError) as e:
        raise SampleRejected("malformed", f"not JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise SampleRejected("malformed", "not a JSON object")
    version = doc.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        raise SampleRejected("malformed", "no schema version")
    if version != SCHEMA_VERSION:
        reason = "older_version" if version < SCHEMA_VERSION else "newer_version"
        raise SampleRejected(reason, f"schema version {version}, this reader knows {SCHEMA_VERSION}", version)
    try:
        return _sample(doc)
    except _Bad as e:
        raise SampleRejected("malformed", str(e), version) from None


# --- validation: a well-formed but mis-shaped sample (a string for a number, a missing field, a negative
# count) is refused here, whole and alone, so nothing downstream ever renders it ---
_MAX_ID = 2**31 - 1
_T = TypeVar("_T")


class _Bad(Exception):
    """What is wrong, and where: ``heartbeat.counts[2] must be an integer 0-..., not str``."""


class _Obj:
    """A JSON object of the payload at ``where``: each field is taken through a check that names it
    (``heartbeat.steps``) in what it raises."""

    def __init__(self, v: Any, where: str) -> None:
        self.doc: dict[str, Any] = _of(v, where, dict)
        self.where = f"{where}." if where else ""

    def get(self, key: str, check: Callable[..., _T], *args: Any) -> _T:
        if key not in self.doc:
            raise _Bad(f"{self.where}{key} is missing")
        return check(self.doc[key], self.where + key, *args)

    def opt(self, key: str, check: Callable[..., _T], *args: Any) -> _T | None:
        """The field, or None where it is absent or null."""
        v = self.doc.get(key)
        return None if v is None else check(v, self.where + key, *args)


_JSON_TYPES: dict[type, str] = {dict: "an object", list: "an array", str: "a string"}


def _of(v: Any, where: str, kind: type) -> Any:
    """``v`` if it is a JSON object, array or string (``kind``: dict, list, str)."""
    if not isinstance(v, kind):
        raise _Bad(f"{where} must be {_JSON_TYPES[kind]}, not {type(v).__name__}")
    return v


def _int(v: Any, where: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _Bad(f"{where} must be an integer {lo}-{hi}, not {_kind(v)}")
    return v


def _float(v: Any, where: str, lo: float = -math.inf) -> float:
    f = _finite(v)
    if f is None or f < lo:
        raise _Bad(f"{where} must be a finite number{'' if lo == -math.inf else f' >= {lo:g}'}, not {_kind(v)}")
    return f


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer beyond any float
        return None
    return f if math.isfinite(f) else None


def _kind(v: Any) -> str:
    return type(v).__name__ if not isinstance(v, (int, float)) or isinstance(v, bool) else repr(v)[:32]


def _one_of(v: Any, where: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in allowed:
        raise _Bad(f"{where} must be one of {', '.join(allowed)}, not {_kind(v)[:32]!r}")
    return v


def _sample(doc: dict[str, Any]) -> RankSample:
    d = _Obj(doc, "")
    heartbeat = d.get("heartbeat", _heartbeat)
    return RankSample(
        rank=d.get("rank", _int, 0, _MAX_ID),
        local_rank=d.get("local_rank", _int, 0, _MAX_ID),
        world_size=d.get("world_size", _int, 1, _MAX_ID),
        hostname=d.get("hostname", _of, str),
        pid=d.get("pid", _int, 1, _MAX_ID),
        time=d.get("time", _float, 0.0),
        devices=tuple(_device(v, f"devices[{i}]") for i, v in enumerate(d.get("devices", _of, list))),
        allocator_info=d.opt("allocator_info", _allocator_info),
        heartbeat=heartbeat,
        collectors={
            _of(name, "collectors key", str): _health(h, f"collectors.{name}")
            for name, h in d.get("collectors", _of, dict).items()
        },
        oom_snapshot=d.opt("oom_snapshot", _oom),
        flops_per_token=d.opt("flops_per_token", _float, 0.0),
        job_id=d.opt("job_id", _job_id) or "",
        training=d.opt("training", _training),
    )


def _training(v: Any, where: str) -> TrainingState:
    # every value here is a label value or a number the server renders: closed sets and checked ranges only
    t = _Obj(v, where)
    ex, ph = t.opt("exit", _Obj), t.opt("phase", _Obj)
    detail = ex.get("detail", _of, str) if ex else ""
    if not EXIT_DETAIL.fullmatch(detail):
        raise _Bad(f"{where}.exit.detail must be at most 64 of [A-Za-z0-9_.], not {detail[:32]!r}")
    waits, nonfinite = t.opt("waits", _of, dict) or {}, t.opt("nonfinite", _of, dict) or {}
    return TrainingState(
        exit_reason=ex.get("reason", _one_of, EXIT_REASONS[:-1]) if ex else "",
        exit_detail=detail,
        collectives=t.opt("collectives", _int),
        waits={
            _one_of(k, f"{where}.waits key", WAIT_KINDS): _float(n, f"{where}.waits.{k}", 0.0) for k, n in waits.items()
        },
        phase=ph.get("name", _one_of, PHASES) if ph else "",
        phase_start=ph.get("start", _float, 0.0) if ph else 0.0,
        nonfinite={
            _one_of(k, f"{where}.nonfinite key", NONFINITE_VALUES): _int(n, f"{where}.nonfinite.{k}")
            for k, n in nonfinite.items()
        },
        loss=t.opt("loss", _one_of, NONFINITE_KINDS) or "",
        grad_norm=t.opt("grad_norm", _one_of, NONFINITE_KINDS) or "",
    )


def _job_id(v: Any, where: str) -> str:
    # a label value and part of the file name: only what the rank itself could have written
    if not isinstance(v, str) or not JOB_ID.fullmatch(v):
        raise _Bad(f"{where} must be 1-{JOB_ID_MAX} letters, digits and _ . -, not {_kind(v)[:32]!r}")
    return v


def _device(v: Any, where: str) -> DeviceSample:
    d = _Obj(v, where)
    return DeviceSample(
        d.get("device", _int, 0, _MAX_ID),
        d.get("uuid", _of, str),
        _numbers(d.get("values", _of, dict)),
        d.opt("roles", _roles) or {},
    )


def _roles(v: Any, where: str) -> dict[str, float]:
    # the role names are a closed set: a label value the server renders, so nothing else gets through
    for k in _of(v, where, dict):
        if k not in MEMORY_ROLES:
            raise _Bad(f"{where} key {k[:32]!r} is not one of {', '.join(MEMORY_ROLES)}")
    return {k: _float(n, f"{where}.{k}", 0.0) for k, n in v.items()}


def _allocator_info(v: Any, where: str) -> AllocatorInfo:
    a = _Obj(v, where)
    return AllocatorInfo(*(a.get(k, _of, str) for k in _ALLOCATOR_INFO_KEYS))


def _heartbeat(v: Any, where: str) -> HeartbeatSnapshot:
    hb = _Obj(v, where)
    buckets = tuple(_float(b, f"{where}.buckets[{i}]") for i, b in enumerate(hb.get("buckets", _of, list)))
    counts = tuple(_int(c, f"{where}.counts[{i}]") for i, c in enumerate(hb.get("counts", _of, list)))
    if (buckets or counts) and len(counts) != len(buckets) + 1:
        raise _Bad(
            f"{where}.counts must hold one more entry than {where}.buckets, not {len(counts)} for {len(buckets)}"
        )
    if any(b >= nxt for b, nxt in pairwise(buckets)):
        raise _Bad(f"{where}.buckets must increase")
    return HeartbeatSnapshot(
        steps=hb.get("steps", _int),
        last_step_time=hb.get("last", _float, 0.0),
        buckets=buckets,
        counts=counts,
        sum=hb.get("sum", _float, 0.0),
        loss=hb.opt("loss", _float),
        grad_norm=hb.opt("grad_norm", _float),
        tokens=hb.opt("tokens", _float, 0.0),
        samples=hb.opt("samples", _float, 0.0),
    )


def _health(v: Any, where: str) -> CollectorHealth:
    h = _Obj(v, where)
    return CollectorHealth(h.get("up", _int, 0, 1), h.get("errors", _int), h.get("duration", _float, 0.0))


def _oom(v: Any, where: str) -> OomSnapshot:
    o = _Obj(v, where)
    return OomSnapshot(o.get("path", _of, str), o.get("time", _float, 0.0))


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    # a value that is not a finite number is dropped, not the whole sample: the rest of the device still counts
    out = {}
    for k, v in values.items():
        f = _finite(v)
        if f is not None:
            out[k] = f
    return out
