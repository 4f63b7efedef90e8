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
from collections.abc import Mapping
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


def _field(doc: Mapping[str, Any], key: str, where: str = "") -> Any:
    if key not in doc:
        raise _Bad(f"{where}{key} is missing")
    return doc[key]


_JSON_TYPES: dict[type, str] = {dict: "an object", list: "an array", str: "a string"}


def _of(kind: type[_T], v: Any, where: str) -> _T:
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


def _sample(doc: Mapping[str, Any]) -> RankSample:
    hb = _of(dict, _field(doc, "heartbeat"), "heartbeat")
    ai = _field(doc, "allocator_info")
    oom = doc.get("oom_snapshot")
    fpt = doc.get("flops_per_token")
    job_id = doc.get("job_id")
    training = doc.get("training")
    return RankSample(
        rank=_int(_field(doc, "rank"), "rank", 0, _MAX_ID),
        local_rank=_int(_field(doc, "local_rank"), "local_rank", 0, _MAX_ID),
        world_size=_int(_field(doc, "world_size"), "world_size", 1, _MAX_ID),
        hostname=_of(str, _field(doc, "hostname"), "hostname"),
        pid=_int(_field(doc, "pid"), "pid", 1, _MAX_ID),
        time=_float(_field(doc, "time"), "time", 0.0),
        devices=tuple(_device(d, f"devices[{i}]") for i, d in enumerate(_of(list, _field(doc, "devices"), "devices"))),
        allocator_info=None if ai is None else _allocator_info(_of(dict, ai, "allocator_info")),
        heartbeat=_heartbeat(hb),
        collectors={
            _of(str, name, "collectors key"): _health(_of(dict, h, f"collectors.{name}"), f"collectors.{name}.")
            for name, h in _of(dict, _field(doc, "collectors"), "collectors").items()
        },
        oom_snapshot=None if oom is None else _oom(_of(dict, oom, "oom_snapshot")),
        flops_per_token=None if fpt is None else _float(fpt, "flops_per_token", 0.0),
        job_id="" if job_id is None else _job_id(job_id),
        training=None if training is None else _training(_of(dict, training, "training")),
    )


def _training(t: Mapping[str, Any]) -> TrainingState:
    # every value here is a label value or a number the server renders: closed sets and checked ranges only
    w = "training."
    reason = detail = phase = ""
    start = 0.0
    ex = t.get("exit")
    if ex is not None:
        ex = _of(dict, ex, w + "exit")
        reason = _one_of(_field(ex, "reason", w + "exit."), w + "exit.reason", EXIT_REASONS[:-1])
        detail = _of(str, _field(ex, "detail", w + "exit."), w + "exit.detail")
        if not EXIT_DETAIL.fullmatch(detail):
            raise _Bad(f"{w}exit.detail must be at most 64 of [A-Za-z0-9_.], not {detail[:32]!r}")
    ph = t.get("phase")
    if ph is not None:
        ph = _of(dict, ph, w + "phase")
        phase = _one_of(_field(ph, "name", w + "phase."), w + "phase.name", PHASES)
        start = _float(_field(ph, "start", w + "phase."), w + "phase.start", 0.0)
    coll = t.get("collectives")
    waits = _of(dict, t.get("waits", {}), w + "waits")
    nonfinite = _of(dict, t.get("nonfinite", {}), w + "nonfinite")
    loss, grad_norm = t.get("loss", ""), t.get("grad_norm", "")
    return TrainingState(
        exit_reason=reason,
        exit_detail=detail,
        collectives=None if coll is None else _int(coll, w + "collectives"),
        waits={_one_of(k, w + "waits key", WAIT_KINDS): _float(v, f"{w}waits.{k}", 0.0) for k, v in waits.items()},
        phase=phase,
        phase_start=start,
        nonfinite={
            _one_of(k, w + "nonfinite key", NONFINITE_VALUES): _int(v, f"{w}nonfinite.{k}")
            for k, v in nonfinite.items()
        },
        loss="" if loss == "" else _one_of(loss, w + "loss", NONFINITE_KINDS),
        grad_norm="" if grad_norm == "" else _one_of(grad_norm, w + "grad_norm", NONFINITE_KINDS),
    )


def _one_of(v: Any, where: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in allowed:
        raise _Bad(f"{where} must be one of {', '.join(allowed)}, not {_kind(v)[:32]!r}")
    return v


def _job_id(v: Any) -> str:
    # a label value and part of the file name: only what the rank itself could have written
    if not isinstance(v, str) or not JOB_ID.fullmatch(v):
        raise _Bad(f"job_id must be 1-{JOB_ID_MAX} letters, digits and _ . -, not {_kind(v)[:32]!r}")
    return v


def _device(d: Any, where: str) -> DeviceSample:
    d = _of(dict, d, where)
    values = _of(dict, _field(d, "values", where + "."), where + ".values")
    roles = d.get("roles")
    return DeviceSample(
        _int(_field(d, "device", where + "."), where + ".device", 0, _MAX_ID),
        _of(str, _field(d, "uuid", where + "."), where + ".uuid"),
        _numbers(values),
        {} if roles is None else _roles(_of(dict, roles, where + ".roles"), where + ".roles"),
    )


def _roles(roles: Mapping[str, Any], where: str) -> dict[str, float]:
    # the role names are a closed set: a label value the server renders, so nothing else gets through
    for k in roles:
        if k not in MEMORY_ROLES:
            raise _Bad(f"{where} key {k[:32]!r} is not one of {', '.join(MEMORY_ROLES)}")
    return {k: _float(v, f"{where}.{k}", 0.0) for k, v in roles.items()}


def _allocator_info(ai: Mapping[str, Any]) -> AllocatorInfo:
    w = "allocator_info."
    return AllocatorInfo(*(_of(str, _field(ai, k, w), w + k) for k in _ALLOCATOR_INFO_KEYS))


def _heartbeat(hb: Mapping[str, Any]) -> HeartbeatSnapshot:
    w = "heartbeat."
    buckets = tuple(
        _float(b, f"{w}buckets[{i}]") for i, b in enumerate(_of(list, _field(hb, "buckets", w), w + "buckets"))
    )
    counts = tuple(_int(c, f"{w}counts[{i}]") for i, c in enumerate(_of(list, _field(hb, "counts", w), w + "counts")))
    if (buckets or counts) and len(counts) != len(buckets) + 1:
        raise _Bad(f"{w}counts must hold one more entry than {w}buckets, not {len(counts)} for {len(buckets)}")
    if any(b >= nxt for b, nxt in pairwise(buckets)):
        raise _Bad(f"{w}buckets must increase")
    loss, grad_norm = _field(hb, "loss", w), _field(hb, "grad_norm", w)
    tokens, samples = hb.get("tokens"), hb.get("samples")
    return HeartbeatSnapshot(
        steps=_int(_field(hb, "steps", w), w + "steps"),
        last_step_time=_float(_field(hb, "last", w), w + "last", 0.0),
        buckets=buckets,
        counts=counts,
        sum=_float(_field(hb, "sum", w), w + "sum", 0.0),
        loss=None if loss is None else _float(loss, w + "loss"),
        grad_norm=None if grad_norm is None else _float(grad_norm, w + "grad_norm"),
        tokens=None if tokens is None else _float(tokens, w + "tokens", 0.0),
        samples=None if samples is None else _float(samples, w + "samples", 0.0),
    )


def _health(h: Mapping[str, Any], where: str) -> CollectorHealth:
    return CollectorHealth(
        _int(_field(h, "up", where), where + "up", 0, 1),
        _int(_field(h, "errors", where), where + "errors"),
        _float(_field(h, "duration", where), where + "duration", 0.0),
    )


def _oom(oom: Mapping[str, Any]) -> OomSnapshot:
    return OomSnapshot(
        _of(str, _field(oom, "path", "oom_snapshot."), "oom_snapshot.path"),
        _float(_field(oom, "time", "oom_snapshot."), "oom_snapshot.time", 0.0),
    )


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    # a value that is not a finite number is dropped, not the whole sample: the rest of the device still counts
    out = {}
    for k, v in values.items():
        f = _finite(v)
        if f is not None:
            out[k] = f
    return out
