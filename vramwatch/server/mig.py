"""The MIG instances of the node's GPUs in MIG mode: enumerated on the slow cadence, memory on every read.

NVML (nvml.h; the reference notes torch-nvml.md B3/B4):

- ``nvmlDeviceGetMigMode(gpu)`` -> ``[current, pending]``; NOT_SUPPORTED on parts without MIG. Only a GPU
  whose current mode is on is enumerated: a card without MIG, or with MIG off, costs one call per slow read
  and nothing changes on it (this module only reads; it never sets a MIG mode or creates an instance).
- ``nvmlDeviceGetMaxMigDeviceCount(gpu)``: how many MIG devices may exist (7 on A100/H100/H200);
  ``nvmlDeviceGetMigDeviceHandleByIndex(gpu, i)`` for each, NOT_FOUND where no instance sits at ``i``.
- On a MIG handle: ``nvmlDeviceGetUUID`` gives ``MIG-<uuid>`` (R470+), the uuid CUDA names the instance by
  and the one a rank on it labels its series with (:mod:`vramwatch.rank.device_uuid`);
  ``nvmlDeviceGetGpuInstanceId`` / ``nvmlDeviceGetComputeInstanceId`` its ids; ``nvmlDeviceGetName`` ends in
  the profile (``... MIG 1g.10gb``); ``nvmlDeviceGetMemoryInfo`` the instance's own memory. Utilisation,
  remapped rows, process utilisation and GPM are NOT_SUPPORTED per instance, so only memory is read.
  The parent is ``nvmlDeviceGetDeviceHandleFromMigDeviceHandle``; enumerating from the parent already knows it.
- A handle stays valid until its compute instance is destroyed; then calls on it fail (INVALID_ARGUMENT or
  NOT_FOUND) and the GPU is enumerated again on the next read.

dcgm-exporter labels a MIG instance's series with the parent's ``UUID`` and ``GPU_I_ID`` +
``GPU_I_PROFILE`` (internal/pkg/rendermetrics/render_metrics.go; DCGM cannot give the MIG uuid,
NVIDIA/go-dcgm#30); here the instance's own uuid is the series' ``uuid``, and ``gpu_mig_info`` carries the
parent's uuid, the GPU instance id and the profile, which join either side.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vramwatch.server import nvml_backend as nb

log = logging.getLogger("vramwatch")

MAX_PER_GPU = 8  # NVML's maximum is 7 MIG devices per GPU; a larger count is not believed (cardinality)
_GONE = frozenset({nb.NOT_FOUND, 2})  # NOT_FOUND, INVALID_ARGUMENT: the instance was destroyed


@dataclass(frozen=True)
class MigInstance:
    gpu: int  # the parent's NVML index
    parent_uuid: str
    uuid: str
    gpu_instance_id: str  # "" when NVML did not say
    compute_instance_id: str
    profile: str
    handle: Any


@dataclass(frozen=True)
class MigReading:
    instance: MigInstance
    memory: tuple[float, float, float] | None  # total, used, free; None when NVML did not say


def profile_of(name: str) -> str:
    """The MIG profile at the end of a MIG device's name ("NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> "1g.10gb")."""
    head, sep, tail = name.rpartition(" MIG ")
    return tail.strip()[:32] if sep and head else ""


class MigTable:
    """The MIG instances of one NVML session, and their memory."""

    def __init__(self, session: nb.NvmlSession) -> None:
        self.session = session
        self.instances: tuple[MigInstance, ...] = ()
        self._no_mig: set[str] = set()  # parent uuids whose MIG calls are not supported: not asked again
        self._no_memory: set[str] = set()  # instance uuids whose memory is not supported: not asked again
        self._stale = False  # an instance vanished: enumerate again on the next read, not the next slow one
        self._generation = -1

    def read(self, devices: Iterable[nb.Device], lost: set[str], slow: bool) -> tuple[tuple[MigReading, ...], bool]:
        """(readings, ok): enumerate on slow reads (or after an instance vanished), memory every read.
        Raises what :func:`nb.classify` calls ``session`` for the caller to mark NVML down."""
        if self._generation != self.session.generation:  # NVML re-initialised: handles and verdicts are new
            self._generation = self.session.generation
            self._no_mig.clear()
            self._no_memory.clear()
            slow = True
        ok = True
        if slow or self._stale:
            self.instances, ok = self._enumerate([d for d in devices if not d.lost and d.uuid not in lost])
            self._stale = False
        out = []
        for m in self.instances:
            if m.parent_uuid in lost:
                continue  # a lost card's instances have no readings
            if m.uuid in self._no_memory:
                out.append(MigReading(m, None))
                continue
            try:
                mem = self.session.nv.nvmlDeviceGetMemoryInfo(m.handle)
            except Exception as e:  # noqa: BLE001 - sorted by _failed; session errors go up from there
                kind = self._failed(m, e, "memory")
                ok = ok and kind != "transient"
                if kind != "gone":
                    out.append(MigReading(m, None))
                continue
            out.append(MigReading(m, (float(mem.total), float(mem.used), float(mem.free))))
        return tuple(out), ok

    def _failed(self, m: MigInstance, e: BaseException, what: str) -> str:
        kind = nb.classify(e)
        if kind == "session":
            raise e
        if nb.error_code(e) in _GONE:
            self._stale = True  # destroyed (or reconfigured): find out what is there now
            return "gone"
        if kind == "unsupported":
            self._no_memory.add(m.uuid)
            self.session.once(
                ("mig unsupported", m.uuid, what),
                "vramwatch: GPU %d MIG %s: %s is %s; not asked again until NVML re-inits",
                m.gpu,
                m.uuid,
                what,
                nb.error_name(e),
                level=logging.INFO,
            )
        elif kind == "transient":
            self.session.once(
                ("mig transient", m.uuid, what, nb.error_name(e)),
                "vramwatch: GPU %d MIG %s: reading %s failed (%s)",
                m.gpu,
                m.uuid,
                what,
                nb.error_name(e),
                level=logging.WARNING,
            )
        return kind

    def _enumerate(self, devices: list[nb.Device]) -> tuple[tuple[MigInstance, ...], bool]:
        nv = self.session.nv
        out: list[MigInstance] = []
        ok = True
        for d in devices:
            if d.mig_mode == "unsupported" or d.uuid in self._no_mig or d.handle is None:
                continue
            try:
                if not nv.nvmlDeviceGetMigMode(d.handle)[0]:
                    continue  # MIG off (the mode read again on every slow read: it changes after a GPU reset)
                count = min(int(nv.nvmlDeviceGetMaxMigDeviceCount(d.handle)), MAX_PER_GPU)
            except Exception as e:
                kind = nb.classify(e)
                if kind == "session":
                    raise
                if kind == "unsupported":
                    self._no_mig.add(d.uuid)
                    self.session.once(
                        ("mig unsupported", d.uuid),
                        "vramwatch: GPU %d %s: MIG devices cannot be enumerated (%s); not asked again until "
                        "NVML re-inits",
                        d.index,
                        d.uuid,
                        nb.error_name(e),
                        level=logging.INFO,
                    )
                elif kind == "transient":
                    ok = False
                    self.session.read_failed(d, "nvml", "MIG enumeration", e)
                    out.extend(self._previous(d))  # keep the card's instances: one failed read is no change
                continue
            found: list[MigInstance] = []
            card_ok = True
            for i in range(count):
                m, inst_ok = self._instance(d, i)
                card_ok = card_ok and inst_ok
                if m is not None:
                    found.append(m)
            ok = ok and card_ok
            out.extend(found if card_ok else self._previous(d) or found)
        return tuple(out), ok

    def _previous(self, d: nb.Device) -> list[MigInstance]:
        return [m for m in self.instances if m.parent_uuid == d.uuid]

    def _instance(self, d: nb.Device, i: int) -> tuple[MigInstance | None, bool]:
        nv = self.session.nv
        try:
            h = nv.nvmlDeviceGetMigDeviceHandleByIndex(d.handle, i)
            uuid = nb.text(nv.nvmlDeviceGetUUID(h))[:96]
        except Exception as e:
            kind = nb.classify(e)
            if kind == "session":
                raise
            if nb.error_code(e) in _GONE or kind in ("unsupported", "quiet", "lost"):
                return None, True  # no instance at this index (the usual case), or the parent's own trouble
            self.session.read_failed(d, "nvml", f"MIG device {i}", e)
            return None, False
        return (
            MigInstance(
                d.index,
                d.uuid,
                uuid,
                self._soft(lambda: str(int(nv.nvmlDeviceGetGpuInstanceId(h)))),
                self._soft(lambda: str(int(nv.nvmlDeviceGetComputeInstanceId(h)))),
                profile_of(self._soft(lambda: nb.text(nv.nvmlDeviceGetName(h)))),
                h,
            ),
            True,
        )

    @staticmethod
    def _soft(read: Any) -> str:
        try:
            return str(read())
        except Exception as e:  # a missing id or profile leaves its label empty
            if nb.classify(e) == "session":
                raise
            return ""
