"""The server's NVML readings for the ranks' console status lines (``nvml.json``).

The server writes them after each NVML read (the real library or the simulated GPU alike); a rank
reads them on its sampler thread, so the training process never calls NVML itself. Plain JSON,
replaced atomically: ``{"time": <unix seconds>, "gpus": [{"uuid": "GPU-...", "power_watts":
212.0, "memory_free_bytes": 2.9e9}, ...], "identities": [{"index": 0, "uuid": "GPU-...",
"pci_bus_id": "...", "name": "..."}, ...]}``, plus ``"nvml_absent": "<reason>"`` on a node without
NVML (the reasons of ``vramwatch_nvml_available``), so the status line can say what is missing.
Readings older than :data:`STALE_AFTER` seconds are ignored (a server that stopped). The identities
are never stale: a server that restarts while a GPU is already lost (it can no longer tell its UUID)
takes that GPU's identity from here, so the GPU keeps its series, at ``gpu_up`` 0. The spool lives on
a tmpfs: a reboot, which may renumber the GPUs, also empties it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from vramwatch.spool.files import NODE_READINGS, replace_file

STALE_AFTER = 30.0

log = logging.getLogger("vramwatch")


@dataclass(frozen=True, slots=True)
class GpuReadings:
    """What NVML said of one GPU; None where it said nothing."""

    uuid: str
    power_watts: float | None = None
    memory_free_bytes: float | None = None


@dataclass(frozen=True, slots=True)
class NodeReadings:
    """The whole readings file: uuid -> readings, and why the node has no NVML ("" when it has)."""

    gpus: dict[str, GpuReadings]
    nvml_absent: str = ""


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """Who the GPU at an NVML index was when it last answered."""

    index: int
    uuid: str
    pci_bus_id: str = ""
    name: str = ""


def write_node_readings(
    spool_dir: str,
    gpus: Iterable[GpuReadings],
    now: float | None = None,
    nvml_absent: str = "",
    identities: Iterable[GpuIdentity] = (),
) -> None:
    """Replace the readings file atomically; never raises (the status line is a convenience)."""
    try:
        doc: dict[str, Any] = {
            "time": time.time() if now is None else now,
            "gpus": [{k: v for k, v in asdict(g).items() if v is not None} for g in gpus],
            "identities": [asdict(g) for g in identities],
        }
        if nvml_absent:
            doc["nvml_absent"] = nvml_absent
        replace_file(os.path.join(spool_dir, NODE_READINGS), json.dumps(doc).encode())
    except Exception as e:  # noqa: BLE001 - disk full, a spool removed under us: ranks just show less
        log.debug("vramwatch: writing %s failed: %r", NODE_READINGS, e)


def read_node(spool_dir: str, now: float | None = None) -> NodeReadings:
    """A fresh readings file; nothing (no GPUs, NVML not said absent) when there is none."""
    now = time.time() if now is None else now
    out: dict[str, GpuReadings] = {}
    try:
        with open(os.path.join(spool_dir, NODE_READINGS), encoding="utf-8") as fh:
            doc = json.load(fh)
        if now - float(doc.get("time", 0)) > STALE_AFTER:
            return NodeReadings(out)
        for g in doc.get("gpus") or []:
            if g.get("uuid"):
                uuid = str(g["uuid"])
                out[uuid] = GpuReadings(uuid, _number(g.get("power_watts")), _number(g.get("memory_free_bytes")))
        absent = doc.get("nvml_absent")
        # a word of the contract's small set, never free text (it is printed to the console)
        return NodeReadings(out, absent if isinstance(absent, str) and absent.isidentifier() else "")
    except (OSError, ValueError, TypeError, AttributeError):
        return NodeReadings(out)


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def read_gpu_identities(spool_dir: str) -> dict[int, GpuIdentity]:
    """NVML index -> the identity last written, however old; empty when there is none."""
    out: dict[int, GpuIdentity] = {}
    try:
        with open(os.path.join(spool_dir, NODE_READINGS), encoding="utf-8") as fh:
            doc = json.load(fh)
        for g in doc.get("identities") or []:
            index, uuid = g.get("index"), g.get("uuid")
            if isinstance(index, int) and not isinstance(index, bool) and isinstance(uuid, str) and uuid:
                pci, name = g.get("pci_bus_id"), g.get("name")
                out[index] = GpuIdentity(
                    index,
                    uuid[:96],
                    pci[:32] if isinstance(pci, str) else "",
                    name[:96] if isinstance(name, str) else "",
                )
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return out
