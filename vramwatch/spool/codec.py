"""A :class:`~.schema.RankSample` to and from its JSON payload: the only code that knows the keys.

The payload is compact JSON with the schema version under ``"v"``. Decoding never trusts the
file: anything but a well-formed sample of this version raises :class:`SampleRejected`, whose
``reason`` (``older_version``, ``newer_version``, ``malformed``) a reader logs and counts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vramwatch.spool.schema import (
    SCHEMA_VERSION,
    AllocatorInfo,
    CollectorHealth,
    DeviceSample,
    HeartbeatSnapshot,
    OomSnapshot,
    RankSample,
)

# One encoder for every sample: json.dumps would build a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
# The histogram's bounds are the same in every sample of a process: encoded once, spliced in where
# this marker lands (a NUL cannot occur in any other string of a sample: hostnames, paths, uuids).
_BUCKETS_MARK = "\x00buckets\x00"
_BUCKETS_MARK_JSON = _ENCODER.encode(_BUCKETS_MARK).encode()
_buckets_json: tuple[tuple[float, ...], bytes] = ((), b"[]")


def _encoded_buckets(buckets: tuple[float, ...]) -> bytes:
    global _buckets_json
    cached_for, raw = _buckets_json
    if buckets is not cached_for and buckets != cached_for:
        raw = _ENCODER.encode(buckets).encode()
        _buckets_json = (buckets, raw)
    return raw


class SampleRejected(ValueError):
    """A payload this reader cannot use; ``version`` is the one it carried, if any."""

    def __init__(self, reason: str, detail: str, version: int | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.version = version


def encode_sample(sample: RankSample) -> bytes:
    """The payload for ``sample``; raises ValueError for a non-finite number (JSON has none)."""
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
        "devices": [{"device": d.device, "uuid": d.uuid, "values": d.values} for d in sample.devices],
        "allocator_info": None
        if ai is None
        else {
            "backend": ai.backend,
            "expandable_segments": ai.expandable_segments,
            "garbage_collection_threshold": ai.garbage_collection_threshold,
            "max_split_size_mb": ai.max_split_size_mb,
        },
        "heartbeat": {
            "steps": hb.steps,
            "last": hb.last_step_time,
            "buckets": _BUCKETS_MARK,
            "counts": hb.counts,
            "sum": hb.sum,
            "loss": hb.loss,
            "grad_norm": hb.grad_norm,
        },
        "collectors": {
            name: {"up": h.up, "errors": h.errors, "duration": h.duration} for name, h in sample.collectors.items()
        },
    }
    if sample.oom_snapshot is not None:
        doc["oom_snapshot"] = {"path": sample.oom_snapshot.path, "time": sample.oom_snapshot.time}
    return _ENCODER.encode(doc).encode().replace(_BUCKETS_MARK_JSON, _encoded_buckets(hb.buckets), 1)


def decode_sample(payload: bytes) -> RankSample:
    """The sample in ``payload``; raises :class:`SampleRejected` for anything else."""
    try:
        doc = json.loads(payload)
    except ValueError as e:
        raise SampleRejected("malformed", f"not JSON ({e})") from None
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
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SampleRejected("malformed", f"bad field ({e!r})", version) from None


def _sample(doc: Mapping[str, Any]) -> RankSample:
    hb = doc.get("heartbeat") or {}
    ai = doc.get("allocator_info")
    oom = doc.get("oom_snapshot")
    return RankSample(
        rank=_int(doc["rank"]),
        local_rank=_int(doc["local_rank"]),
        world_size=_int(doc["world_size"]),
        hostname=str(doc["hostname"]),
        pid=_int(doc["pid"]),
        time=float(doc["time"]),
        devices=tuple(
            DeviceSample(_int(d["device"]), str(d["uuid"]), _numbers(d.get("values") or {}))
            for d in doc.get("devices") or ()
        ),
        allocator_info=None
        if not ai
        else AllocatorInfo(
            str(ai.get("backend", "")),
            str(ai.get("expandable_segments", "")),
            str(ai.get("garbage_collection_threshold", "")),
            str(ai.get("max_split_size_mb", "")),
        ),
        heartbeat=HeartbeatSnapshot(
            steps=_int(hb.get("steps", 0)),
            last_step_time=float(hb.get("last") or 0.0),
            buckets=tuple(float(b) for b in hb.get("buckets") or ()),
            counts=tuple(_int(c) for c in hb.get("counts") or ()),
            sum=float(hb.get("sum") or 0.0),
            loss=_optional_float(hb.get("loss")),
            grad_norm=_optional_float(hb.get("grad_norm")),
        ),
        collectors={
            str(name): CollectorHealth(_int(h.get("up", 0)), _int(h.get("errors", 0)), float(h.get("duration", 0.0)))
            for name, h in (doc.get("collectors") or {}).items()
        },
        oom_snapshot=OomSnapshot(str(oom["path"]), float(oom.get("time", 0.0))) if oom and oom.get("path") else None,
    )


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, got {type(v).__name__}")
    return int(v)


def _optional_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    # a value that is not a number is dropped, not the whole sample: the rest of the device still counts
    return {str(k): float(v) for k, v in values.items() if isinstance(v, (int, float))}
