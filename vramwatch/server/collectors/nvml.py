"""NVML device readings in the server: one snapshot per ``nvml_interval``, never read at scrape.

Fast getters (memory, power, limit, utilisation, temperature, clocks,
throttle reasons: 1-10 us each on an H200; NVML's GPU recovery action, one
field value: 6.8 us median, 13 us p99 on an H100, driver 580) run every ``nvml_interval``; slow
ones (energy ~3 ms, ECC, remapped rows, PCIe replays) every
``nvml_slow_interval``. Units leave here as Prometheus base units.

Faults (see :mod:`vramwatch.server.nvml_backend`): a field a GPU does not
support is dropped for that GPU after the first try, logged once, and keeps
``up`` 1; a lost GPU reads ``gpu_up`` 0 (its identity stays, its readings go),
is probed again on the slow cadence, turns the collector's ``up`` to 0 and is
counted once as Xid 79 (by the Xid watcher, told through the session); NVML
gone, or failing its init for a reason other than absence, makes ``up`` 0 with
init retried under back-off, while the rest of the exporter keeps serving.

A node without NVML (see :meth:`~vramwatch.server.nvml_backend.NvmlSession.absent_reason`:
no library, no driver, no GPU) is a state: ``up`` stays 1, no device series,
``vramwatch_nvml_available{reason}`` 0 says why, and the ranks' status line is told
through the node readings file. Init is still retried, so a driver loaded later is found.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from vramwatch import spool
from vramwatch.config import Settings
from vramwatch.monitoring import contract, xid_catalogue
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import ReadFailed, ScrapeContext, Tick, register
from vramwatch.server.collectors.nvml_base import NvmlSessionCollector, SessionDown
from vramwatch.server.collectors.xid import job_uuids
from vramwatch.server.mig import MigReading, MigTable

log = logging.getLogger("vramwatch")

# nvidia-ml-py constants, by value (nvml.h), so the getters work on the fake and the real module alike
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_MEMORY_V2 = 0x02000028  # pynvml.nvmlMemory_v2
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230  # a field value (newer drivers); nvmlDeviceGpuRecoveryAction_t
NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2  # a field id the driver does not know (measured, driver 580: id 9999)
NVML_ERROR_NOT_SUPPORTED = 3

# NVML clocks-event (throttle) reason bits -> the reason label (torch-nvml.md B3)
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)
REMAPPED_KINDS = ("correctable", "uncorrectable", "pending", "failure")

Key = tuple[str, str]  # (contract name, value of its one extra label or "")
Getter = Callable[[Any, Any], dict[Key, float]]


def _memory_v2(nv: Any, h: Any) -> dict[Key, float]:
    m = nv.nvmlDeviceGetMemoryInfo(h, version=NVML_MEMORY_V2)
    return {
        ("gpu_memory_total_bytes", ""): float(m.total),
        ("gpu_memory_used_bytes", ""): float(m.used),
        ("gpu_memory_free_bytes", ""): float(m.free),
        ("gpu_memory_reserved_bytes", ""): float(m.reserved),
    }


def _memory_v1(nv: Any, h: Any) -> dict[Key, float]:
    m = nv.nvmlDeviceGetMemoryInfo(h)
    return {
        ("gpu_memory_total_bytes", ""): float(m.total),
        ("gpu_memory_used_bytes", ""): float(m.used),
        ("gpu_memory_free_bytes", ""): float(m.free),
    }


def _scalar(family: str, call: str, *args: int, times: float = 1.0, per: float = 1.0) -> Getter:
    """A getter of one NVML call that answers one number: ``family``'s value, in its base unit (x times / per)."""
    return lambda nv, h: {(family, ""): float(getattr(nv, call)(h, *args)) * times / per}


def _utilization(nv: Any, h: Any) -> dict[Key, float]:
    u = nv.nvmlDeviceGetUtilizationRates(h)
    return {("gpu_utilization_ratio", ""): u.gpu / 100.0, ("gpu_memory_utilization_ratio", ""): u.memory / 100.0}


def _reasons(mask: int) -> dict[Key, float]:
    return {("gpu_clock_throttle", name): 1.0 if mask & bit else 0.0 for bit, name in THROTTLE_REASONS}


def _throttle(nv: Any, h: Any) -> dict[Key, float]:
    return _reasons(int(nv.nvmlDeviceGetCurrentClocksEventReasons(h)))


def _throttle_old(nv: Any, h: Any) -> dict[Key, float]:  # the deprecated name, for older drivers
    return _reasons(int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)))


def _ecc(nv: Any, h: Any) -> dict[Key, float]:
    corr = nv.nvmlDeviceGetTotalEccErrors(h, NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC)
    unc = nv.nvmlDeviceGetTotalEccErrors(h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
    return {("gpu_ecc_errors_total", "corrected"): float(corr), ("gpu_ecc_errors_total", "uncorrected"): float(unc)}


def _remapped(nv: Any, h: Any) -> dict[Key, float]:
    rows = nv.nvmlDeviceGetRemappedRows(h)
    return {("gpu_remapped_rows", kind): float(v) for kind, v in zip(REMAPPED_KINDS, rows, strict=False)}


def _recovery_action(nv: Any, h: Any) -> dict[Key, float]:
    """One series per state of NVML's GPU recovery action, 1 for the one in force."""
    (v,) = nv.nvmlDeviceGetFieldValues(h, [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    ret = int(v.nvmlReturn)
    if ret != NVML_SUCCESS:
        # a field id the driver does not know is an invalid argument to it: unsupported, not trouble
        raise nv.NVMLError(NVML_ERROR_NOT_SUPPORTED if ret == NVML_ERROR_INVALID_ARGUMENT else ret)
    try:
        state = xid_catalogue.recovery_action(int(v.value.uiVal))
    except ValueError as e:  # a state newer than this table: dropped for the GPU (logged once), never mislabelled
        raise NotImplementedError(str(e)) from None
    return {("gpu_recovery_action", s): 1.0 if s == state else 0.0 for s in contract.RECOVERY_ACTIONS}


@dataclass(frozen=True)
class Field:
    name: str
    slow: bool
    getters: tuple[Getter, ...]  # tried in order; one a GPU does not support is dropped for that GPU


_TEMPERATURE = "gpu_temperature_celsius"
FIELDS: tuple[Field, ...] = (
    Field("memory", False, (_memory_v2, _memory_v1)),
    Field("power", False, (_scalar("gpu_power_watts", "nvmlDeviceGetPowerUsage", per=1000.0),)),  # mW, as the limit
    Field("power_limit", False, (_scalar("gpu_power_limit_watts", "nvmlDeviceGetEnforcedPowerLimit", per=1000.0),)),
    Field("utilization", False, (_utilization,)),
    Field(
        "temperature",
        False,
        (  # nvmlDeviceGetTemperature is deprecated in NVML 13, kept for older drivers
            _scalar(_TEMPERATURE, "nvmlDeviceGetTemperatureV", NVML_TEMPERATURE_GPU),
            _scalar(_TEMPERATURE, "nvmlDeviceGetTemperature", NVML_TEMPERATURE_GPU),
        ),
    ),
    Field("sm_clock", False, (_scalar("gpu_sm_clock_hertz", "nvmlDeviceGetClockInfo", NVML_CLOCK_SM, times=1e6),)),
    Field(
        "memory_clock", False, (_scalar("gpu_memory_clock_hertz", "nvmlDeviceGetClockInfo", NVML_CLOCK_MEM, times=1e6),)
    ),
    Field("throttle", False, (_throttle, _throttle_old)),
    Field("recovery_action", False, (_recovery_action,)),
    Field(
        "energy", True, (_scalar("gpu_energy_joules_total", "nvmlDeviceGetTotalEnergyConsumption", per=1000.0),)
    ),  # mJ
    Field("ecc", True, (_ecc,)),
    Field("remapped_rows", True, (_remapped,)),
    Field("pcie_replays", True, (_scalar("gpu_pcie_replays_total", "nvmlDeviceGetPcieReplayCounter"),)),
)

VALUE_FAMILIES = tuple(
    m.name
    for m in contract.METRICS
    if m.collector == "nvml"
    and m.name not in ("gpu_info", "gpu_up", "gpu_non_torch_memory_bytes", "vramwatch_nvml_available")
    and not m.name.startswith("gpu_mig_")
)
MIG_MEMORY = ("gpu_mig_memory_total_bytes", "gpu_mig_memory_used_bytes", "gpu_mig_memory_free_bytes")


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    mig_mode: str
    up: bool
    values: Mapping[Key, float]


@dataclass(frozen=True)
class NvmlSnapshot:
    gpus: tuple[GpuReading, ...]
    driver_version: str
    time: float
    absent: str = ""  # why the node has no NVML (contract.NVML_ABSENT_REASONS); "" when it has
    mig: tuple[MigReading, ...] = ()  # the MIG instances of GPUs in MIG mode, with their memory


@register("nvml", lambda s: s.nvml, "NVML device readings (power, memory, utilisation, clocks, health).")
class NvmlCollector(NvmlSessionCollector[NvmlSnapshot]):
    def __init__(self, settings: Settings, session: nb.NvmlSession | None = None) -> None:
        super().__init__(settings, session)
        self._choice: dict[tuple[str, str], int] = {}  # (uuid, field) -> first getter not known unsupported
        self._slow: dict[str, dict[str, dict[Key, float]]] = {}  # uuid -> field -> last slow values
        self._lost: dict[str, float] = {}  # uuid -> when to probe it again
        self._handles: dict[str, Any] = {}  # re-acquired handles of GPUs that came back
        self._known: tuple[nb.Device, ...] = ()
        self._mig = MigTable(self.session)

    # --- reading (the framework's thread) ---
    def read(self, tick: Tick) -> NvmlSnapshot | None:
        snap, ok = self._read(tick)
        if snap is not None:
            # power / free memory (or why there is no NVML) for the ranks' console status line, and each
            # GPU's identity for a server restarting while one is lost (never raises)
            spool.write_node_readings(
                self.settings.resolved_spool_dir(),
                status_readings(snap),
                nvml_absent=snap.absent,
                identities=self._ids(),
            )
        if not ok:
            raise ReadFailed(snap)
        return snap

    def _ids(self) -> list[spool.GpuIdentity]:
        """Who each GPU is, for a later server that finds one already lost."""
        return [spool.GpuIdentity(d.index, d.uuid, d.pci_bus_id, d.name) for d in self._known if d.uuid]

    def _unavailable(self, absent: str) -> tuple[NvmlSnapshot | None, bool]:
        if absent:  # no NVML on this node: a state, not a failed read
            return NvmlSnapshot((), "", time.time(), absent), True
        return self._down(), False

    def _forget(self) -> None:  # re-check everything we remembered
        self._choice.clear()
        self._slow.clear()
        self._lost.clear()
        self._handles.clear()
        for d in self.session.devices:
            if not d.lost:
                self.session.set_lost(d.uuid, False)

    def _read_gpus(self, tick: Tick, reinit: bool) -> tuple[NvmlSnapshot | None, bool]:
        s = self.session
        slow = tick.slow or reinit  # after a re-init the slow values were just forgotten: read them now
        if slow and (s.incomplete or not s.devices):  # no GPU yet: one may appear (cheap: a count)
            s.reenumerate()
        self._known = s.devices
        ok = True
        gpus = []
        try:
            for d in s.devices:
                reading, gpu_ok = self._read_gpu(d, tick.now, slow)
                gpus.append(reading)
                ok = ok and gpu_ok
            lost = {g.uuid for g in gpus if not g.up} | set(s.lost)
            mig, mig_ok = self._mig.read(s.devices, lost, slow)
        except SessionDown:
            raise
        except Exception as e:
            if nb.classify(e) != "session":
                raise
            s.mark_down(e)
            return self._down(), False
        snap = NvmlSnapshot(tuple(gpus), s.driver_version, time.time(), s.absent_reason(), mig)
        return snap, ok and mig_ok and not s.incomplete

    def _down(self) -> NvmlSnapshot | None:
        """NVML is not answering: the GPUs we knew read gpu_up 0; never initialised, no device series."""
        if self._generation < 0:
            return None
        return NvmlSnapshot(
            tuple(_reading(d, False, {}) for d in self._known), self.session.driver_version, time.time()
        )

    def _read_gpu(self, d: nb.Device, now: float, slow: bool) -> tuple[GpuReading, bool]:
        if d.lost:  # lost already at enumeration (the session logged it): re-enumeration finds it back
            self._lost[d.uuid] = 0.0  # and then it is probed at once
            return _reading(d, False, {}), False
        if d.uuid in self._lost:  # probed again on the slow cadence only
            if now < self._lost[d.uuid]:
                return _reading(d, False, {}), False
            if not self._probe(d):
                self._lost[d.uuid] = now + self.settings.nvml_slow_interval
                return _reading(d, False, {}), False
            slow = True  # back: read everything now
        nv = self.session.nv
        h = self._handles.get(d.uuid, d.handle)
        values: dict[Key, float] = {}
        ok = True
        slow_cache = self._slow.setdefault(d.uuid, {})
        for f in FIELDS:
            if f.slow and not slow:
                values.update(slow_cache.get(f.name, {}))
                continue
            out, field_ok = self._read_field(d, f, nv, h)
            if out is None and field_ok == "lost":
                self._mark_lost(d, now)
                return _reading(d, False, {}), False
            ok = ok and field_ok is True
            if out is not None:
                values.update(out)
                if f.slow:
                    slow_cache[f.name] = out
            elif f.slow:
                slow_cache.pop(f.name, None)
        return _reading(d, True, values), ok

    def _read_field(self, d: nb.Device, f: Field, nv: Any, h: Any) -> tuple[dict[Key, float] | None, Any]:
        """(values or None, True | False | "lost"); False: a failed read that turns ``up`` 0."""
        key = (d.uuid, f.name)
        i = self._choice.get(key, 0)
        while i < len(f.getters):
            try:
                return f.getters[i](nv, h), True
            except Exception as e:
                kind = nb.classify(e)
                if kind == "unsupported":
                    i += 1
                    self._choice[key] = i
                    if i == len(f.getters):
                        level = logging.WARNING if nb.error_code(e) == nb.NO_PERMISSION else logging.INFO
                        self.session.once(
                            ("unsupported", d.uuid, f.name),
                            "vramwatch: GPU %d %s: %s is %s; not asked again until NVML re-inits",
                            d.index,
                            d.uuid,
                            f.name,
                            nb.error_name(e),
                            level=level,
                        )
                    continue
                if kind == "lost":
                    return None, "lost"
                if kind == "session":
                    self.session.mark_down(e)
                    raise SessionDown() from e
                if kind == "quiet":
                    self.session.once(
                        ("quiet", d.uuid, f.name, nb.error_name(e)),
                        "vramwatch: GPU %d: %s has no data yet (%s)",
                        d.index,
                        f.name,
                        nb.error_name(e),
                        level=logging.DEBUG,
                    )
                    return None, True
                self.session.once(
                    ("transient", d.uuid, f.name, nb.error_name(e)),
                    "vramwatch: GPU %d %s: reading %s failed (%s: %s); retrying every read",
                    d.index,
                    d.uuid,
                    f.name,
                    nb.error_name(e),
                    e,
                    level=logging.WARNING,
                )
                return None, False
        return None, True  # not supported: skipped, not a failure

    def _mark_lost(self, d: nb.Device, now: float) -> None:
        self._lost[d.uuid] = now + self.settings.nvml_slow_interval
        log.error(
            "vramwatch: GPU %d %s is lost (GPU_IS_LOST: fallen off the bus or needs a reset); "
            "gpu_up is 0 and it is probed every %.0f s",
            d.index,
            d.uuid,
            self.settings.nvml_slow_interval,
        )
        self.session.set_lost(d.uuid, True)  # the Xid watcher counts the loss

    def _probe(self, d: nb.Device) -> bool:
        nv = self.session.nv
        try:
            h = nv.nvmlDeviceGetHandleByUUID(d.uuid)
            nv.nvmlDeviceGetMemoryInfo(h)
        except Exception as e:  # noqa: BLE001
            if nb.classify(e) == "session":
                self.session.mark_down(e)
            return False
        self._handles[d.uuid] = h
        del self._lost[d.uuid]
        self.session.set_lost(d.uuid, False)
        log.warning("vramwatch: GPU %d %s answers again", d.index, d.uuid)
        return True

    # --- families (pure) ---
    def families(self, snapshot: NvmlSnapshot, ctx: ScrapeContext) -> Iterable[Metric]:
        return nvml_families(snapshot, ctx, self.settings.gpus == "job")


def _reading(d: nb.Device, up: bool, values: Mapping[Key, float]) -> GpuReading:
    return GpuReading(d.index, d.uuid, d.name, d.pci_bus_id, d.mig_mode, up, values)


def status_readings(snap: NvmlSnapshot) -> list[spool.GpuReadings]:
    """Power and free memory of the GPUs that answered, for the ranks' console status lines; a MIG instance
    under its own uuid, with its own free memory and its card's power."""
    out = [
        spool.GpuReadings(g.uuid, g.values.get(("gpu_power_watts", "")), g.values.get(("gpu_memory_free_bytes", "")))
        for g in snap.gpus
        if g.up
    ]
    power = {r.uuid: r.power_watts for r in out}
    for r in snap.mig:
        if r.memory is not None:
            out.append(spool.GpuReadings(r.instance.uuid, power.get(r.instance.parent_uuid), r.memory[2]))
    return out


def reserved_by_uuid(ctx: ScrapeContext) -> dict[str, float]:
    """Sum of the ranks' reserved bytes per GPU uuid."""
    out: dict[str, float] = {}
    for s in ctx.samples:
        for dev in s.devices:
            v = dev.values.get("torch_cuda_memory_reserved_bytes")
            if dev.uuid and v is not None:
                out[dev.uuid] = out.get(dev.uuid, 0.0) + v
    return out


def nvml_families(snap: NvmlSnapshot, ctx: ScrapeContext, job_only: bool = False) -> Iterable[Metric]:
    info = contract.family("gpu_info")
    up = contract.family("gpu_up")
    non_torch = contract.family("gpu_non_torch_memory_bytes")
    fams = {name: contract.family(name) for name in VALUE_FAMILIES}
    job = job_uuids(ctx) if job_only else None
    reserved = reserved_by_uuid(ctx)
    for r in snap.mig:  # a rank on a MIG instance holds memory of its card too
        m = r.instance
        if m.uuid in reserved:
            reserved[m.parent_uuid] = reserved.get(m.parent_uuid, 0.0) + reserved[m.uuid]
        if job is not None and m.uuid in job:
            job.add(m.parent_uuid)  # the card of a job's instance is a job GPU
    available = contract.family("vramwatch_nvml_available")
    available.add_metric([snap.absent], 0.0 if snap.absent else 1.0)
    for g in snap.gpus:
        if job is not None and g.uuid not in job:
            continue
        labels = [str(g.index), g.uuid]
        info.add_metric(labels + [g.name, snap.driver_version, g.pci_bus_id, ctx.hostname[:128], g.mig_mode], 1.0)
        up.add_metric(labels, 1.0 if g.up else 0.0)
        if not g.up:
            continue  # a lost GPU's last readings would be stale
        for (name, extra), v in g.values.items():
            fam = fams.get(name)
            if fam is not None:
                fam.add_metric(labels + [extra] if extra else labels, v)
        used = g.values.get(("gpu_memory_used_bytes", ""))
        if used is not None:
            # sampled at other moments than NVML: clamp the small negative a fresh allocation can leave
            non_torch.add_metric(labels, max(0.0, used - reserved.get(g.uuid, 0.0)))
    return (available, info, up, non_torch, *fams.values(), *mig_families(snap.mig, job))


def mig_families(readings: Iterable[MigReading], job: set[str] | None = None) -> list[Metric]:
    """gpu_mig_info and the instances' memory (job: only the instances a rank of the job is on)."""
    info = contract.family("gpu_mig_info")
    mem = [contract.family(name) for name in MIG_MEMORY]
    for r in readings:
        m = r.instance
        if job is not None and m.uuid not in job:
            continue
        labels = [str(m.gpu), m.uuid]
        info.add_metric(labels + [m.parent_uuid, m.gpu_instance_id, m.compute_instance_id, m.profile], 1.0)
        for fam, v in zip(mem, r.memory or (), strict=False):
            fam.add_metric(labels, v)
    return [info, *mem] if info.samples else []  # a node without MIG exposes nothing more, not even HELP lines
