"""One NVML session per server: which library, init with back-off, the GPUs it found.

The NVML collector, the process counter and the Xid watcher share it, from
their own threads (NVML is thread-safe and its calls release the GIL). It
picks nvidia-ml-py's ``pynvml`` or, with ``simulate``, the fake over the
simulated node. Init is retried with exponential back-off (1 s to 60 s) when
the library or the driver is missing; every problem is logged once per kind.
It never calls ``nvmlShutdown`` (NVML is refcounted and torch never shuts it
down either) and never touches CUDA, so the server creates no CUDA context.

A node without NVML (no library: a CPU-only pod or host; the library without its driver; NVML with no
GPU) is a state, not a fault: :meth:`NvmlSession.absent_reason` names it (the reasons of
``vramwatch_nvml_available``) as long as NVML has never shown a GPU since the server started, and
its readers keep their ``up`` 1. Once GPUs were seen, NVML going away is a failure.

Error handling follows the reference notes (torch-nvml.md B3/B4): an error is
*unsupported* (remember it per GPU and field, skip it, ``up`` stays 1),
*lost* (the GPU fell off the bus or needs a reset), *session* (NVML itself is
gone: re-init), *quiet* (no data yet) or *transient* (timeout, unknown: the
read failed, try again next time).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vramwatch import spool
from vramwatch._once import OnceLog
from vramwatch.config import Settings
from vramwatch.monitoring.contract import NVML_ABSENT_REASONS

log = logging.getLogger("vramwatch")

# NVML return codes (nvml.h; the same numbers as pynvml.NVML_ERROR_*), so this module
# works even when nvidia-ml-py cannot be imported.
UNINITIALIZED = 1
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
RESET_REQUIRED = 16
LIB_RM_VERSION_MISMATCH = 18
NO_DATA = 21
ARGUMENT_VERSION_MISMATCH = 25
NOT_READY = 27
UNKNOWN = 999

NAMES = {
    UNINITIALIZED: "UNINITIALIZED",
    2: "INVALID_ARGUMENT",
    NOT_SUPPORTED: "NOT_SUPPORTED",
    NO_PERMISSION: "NO_PERMISSION",
    NOT_FOUND: "NOT_FOUND",
    DRIVER_NOT_LOADED: "DRIVER_NOT_LOADED",
    TIMEOUT: "TIMEOUT",
    LIBRARY_NOT_FOUND: "LIBRARY_NOT_FOUND",
    FUNCTION_NOT_FOUND: "FUNCTION_NOT_FOUND",
    GPU_IS_LOST: "GPU_IS_LOST",
    RESET_REQUIRED: "RESET_REQUIRED",
    LIB_RM_VERSION_MISMATCH: "LIB_RM_VERSION_MISMATCH",
    NO_DATA: "NO_DATA",
    ARGUMENT_VERSION_MISMATCH: "ARGUMENT_VERSION_MISMATCH",
    NOT_READY: "NOT_READY",
    UNKNOWN: "UNKNOWN",
}

UNSUPPORTED_CODES = frozenset({NOT_SUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH})
LOST_CODES = frozenset({GPU_IS_LOST, RESET_REQUIRED})
SESSION_CODES = frozenset({UNINITIALIZED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, LIB_RM_VERSION_MISMATCH})
QUIET_CODES = frozenset({NO_DATA, NOT_READY})

BACKOFF_FIRST = 1.0
BACKOFF_MAX = 60.0

# the reasons a node has no NVML (the contract's), and the init failures that mean one; others are faults,
# nvidia-ml-py not importable too (a dependency: a broken install, not a node without GPUs)
NO_LIBRARY, NO_DRIVER, NO_DEVICES = NVML_ABSENT_REASONS
ABSENT_AT_INIT = {"LIBRARY_NOT_FOUND": NO_LIBRARY, "DRIVER_NOT_LOADED": NO_DRIVER}


def error_code(e: BaseException) -> int | None:
    """The NVML return code of an NVMLError (None for anything else)."""
    if type(e).__name__ == "NVMLLibraryMismatchError":  # binding newer than the driver
        return FUNCTION_NOT_FOUND
    v = getattr(e, "value", None)
    return v if isinstance(v, int) and type(e).__name__.startswith("NVMLError") else None


def error_name(e: BaseException) -> str:
    code = error_code(e)
    if code is None:
        return type(e).__name__
    return NAMES.get(code, f"NVML_ERROR_{code}")


def classify(e: BaseException) -> str:
    """unsupported | lost | session | quiet | transient."""
    if isinstance(e, (AttributeError, TypeError, NotImplementedError)):
        return "unsupported"  # the binding lacks the function or this signature (an older nvidia-ml-py)
    code = error_code(e)
    if code in UNSUPPORTED_CODES:
        return "unsupported"
    if code in LOST_CODES:
        return "lost"
    if code in SESSION_CODES:
        return "session"
    if code in QUIET_CODES:
        return "quiet"
    return "transient"


def text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class Device:
    """One GPU as enumerated at init: identity and handle."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    mig_mode: str  # enabled | disabled | unsupported
    handle: Any  # None for a GPU lost before NVML could hand one out
    lost: bool = False  # lost at enumeration: identity from the spool's last readings, found again by re-enumeration


def load_module(settings: Settings) -> Any:
    """nvidia-ml-py's pynvml, or the fake over the simulated node."""
    if settings.simulate:
        from vramwatch.sim.nvml import SimNvml

        return SimNvml.from_spool(settings.resolved_spool_dir())
    import pynvml

    return pynvml


class NvmlSession:
    """NVML for one server. ``ensure()`` is cheap once initialised; call it before each read."""

    def __init__(
        self,
        settings: Settings,
        module: Any = None,
        loader: Callable[[Settings], Any] = load_module,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.nv: Any = module
        self._loader = loader
        self._clock = clock
        self._lock = threading.RLock()
        self.ready = False
        self.generation = 0  # bumped by every successful init: readers re-check what they remembered
        self.devices: tuple[Device, ...] = ()
        self.incomplete = False  # some GPU could not be identified at enumeration
        self._identity_failed = False
        self.driver_version = ""
        self.init_failures = 0
        self.last_error = ""
        self._init_failure = ""  # kind of the newest failed init (NVML error name, or "import")
        self.seen_gpus = False  # NVML has shown a GPU since the server started: its absence is a fault now
        self.lost: frozenset[str] = frozenset()  # uuids currently lost (kept by the NVML collector)
        self._on_lost: list[Callable[[Device], None]] = []
        self.once = OnceLog(log)
        self._next_try = 0.0
        self._backoff = BACKOFF_FIRST

    # --- init ---
    def ensure(self) -> bool:
        """True when NVML is initialised; else tries init, at most once per back-off period."""
        if self.ready:
            return True
        with self._lock:
            if self.ready:
                return True
            now = self._clock()
            if now < self._next_try:
                return False
            try:
                if self.nv is None:
                    self.nv = self._loader(self.settings)
                self.nv.nvmlInit()
                self.driver_version = self._driver_version()
                self._enumerate()
            except ImportError as e:
                self._init_failed(now, "import", f"nvidia-ml-py is not importable ({e})")
                return False
            except Exception as e:  # noqa: BLE001 - NVMLError of any kind, or a broken binding
                self._init_failed(now, error_name(e), f"{error_name(e)}: {e}")
                return False
            self.ready = True
            self.generation += 1
            self._backoff = BACKOFF_FIRST
            self.last_error = ""
            self._init_failure = ""
            log.info(
                "vramwatch: NVML ready (driver %s): %d GPU(s) %s",
                self.driver_version or "?",
                len(self.devices),
                ", ".join(f"{d.index}:{d.uuid}" for d in self.devices),
            )
            return True

    def _init_failed(self, now: float, kind: str, detail: str) -> None:
        self.init_failures += 1
        self.last_error = detail
        self._init_failure = kind
        self._next_try = now + self._backoff
        absent = self.absent_reason()
        self.once(
            ("init", kind),
            "vramwatch: NVML unavailable (%s)%s; device metrics are off, allocator metrics go on; "
            "retrying with back-off up to %.0f s",
            detail,
            f": no NVML on this node ({absent}), not a failure" if absent else "",
            BACKOFF_MAX,
            level=logging.INFO if absent else logging.WARNING,
        )
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)

    def absent_reason(self) -> str:
        """Why this node has no NVML (one of contract.NVML_ABSENT_REASONS), or "" when it has, or fails."""
        if self.seen_gpus:
            return ""
        if self.ready:
            return "" if self.devices else NO_DEVICES
        return ABSENT_AT_INIT.get(self._init_failure, "")

    def mark_down(self, e: BaseException) -> None:
        """NVML itself failed under a reader (uninitialised, driver gone): re-init on the next ensure()."""
        with self._lock:
            if not self.ready:
                return
            self.ready = False
            self.last_error = error_name(e)
            self._next_try = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        self.once(
            ("down", error_name(e)),
            "vramwatch: NVML stopped answering (%s); re-initialising with back-off",
            error_name(e),
            level=logging.WARNING,
        )

    def read_failed(self, d: Device, collector: str, what: str, e: BaseException, detail: str = "") -> None:
        """One collector's read of one GPU failed for a reason worth a warning: logged once per error."""
        self.once(
            ("transient", d.uuid, collector, error_name(e)),
            "vramwatch: GPU %d %s: %s failed (%s)",
            d.index,
            d.uuid,
            what,
            detail or error_name(e),
            level=logging.WARNING,
        )

    def next_try_in(self) -> float:
        return max(0.0, self._next_try - self._clock())

    def _driver_version(self) -> str:
        return self._soft(lambda: text(self.nv.nvmlSystemGetDriverVersion()))[:64]

    def _enumerate(self) -> None:
        nv = self.nv
        devices = []
        self._identity_failed = False
        if not self.driver_version:
            self.driver_version = self._driver_version()
        incomplete = False
        known: dict[int, spool.GpuIdentity] | None = None
        for i in range(int(nv.nvmlDeviceGetCount())):
            h = None
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = text(nv.nvmlDeviceGetUUID(h))
            except Exception as e:
                kind = classify(e)
                if kind == "session":
                    raise
                incomplete = True
                if kind == "lost":  # enumerated but lost: keep it visible, at gpu_up 0
                    if known is None:
                        known = spool.read_gpu_identities(self.settings.resolved_spool_dir())
                    devices.append(self._lost_device(i, h, known.get(i), e))
                    continue
                self.once(
                    ("enumerate", i, error_name(e)),
                    "vramwatch: NVML GPU %d cannot be identified (%s); skipping it for now",
                    i,
                    error_name(e),
                    level=logging.WARNING,
                )
                continue
            devices.append(
                Device(
                    i,
                    uuid[:96],
                    self._soft(lambda d: text(nv.nvmlDeviceGetName(d)), h)[:96],
                    self._soft(lambda d: text(nv.nvmlDeviceGetPciInfo(d).busId), h)[:32],
                    self._mig_mode(h),
                    h,
                )
            )
        # lost before they could be identified: lost from the start for every reader (no Xid 79 is counted:
        # the loss came before this server)
        with self._lock:
            self.lost = self.lost | {d.uuid for d in devices if d.lost}
        self.devices = tuple(devices)
        self.seen_gpus = self.seen_gpus or bool(devices)
        # an identity getter that failed for real (not "not supported") leaves a label empty: that is
        # trouble, so `up` says 0 until a slow-cadence re-enumeration reads it
        self.incomplete = incomplete or self._identity_failed

    def _lost_device(self, index: int, h: Any, last: spool.GpuIdentity | None, e: BaseException) -> Device:
        """A GPU lost before this session could identify it. Its identity: the index, the PCI bus id if the
        handle still gives it, and the UUID it had when it last answered (the spool's readings file), so its
        series are the same as before a restart; an empty uuid when no reading ever named it."""
        pci = self._soft(lambda d: text(self.nv.nvmlDeviceGetPciInfo(d).busId), h)[:32] if h is not None else ""
        if last is not None and pci and last.pci_bus_id and last.pci_bus_id != pci:
            last = None  # another card at this index now
        uuid = last.uuid if last is not None else ""
        self.once(
            ("lost at init", index, uuid),
            "vramwatch: NVML GPU %d is lost (%s) already at init; exported as gpu_up 0 with %s",
            index,
            error_name(e),
            f"its last known uuid {uuid}" if uuid else "no uuid (none was ever read here)",
            level=logging.ERROR,
        )
        name = last.name if last is not None else ""
        return Device(index, uuid, name, pci or (last.pci_bus_id if last else ""), "unsupported", h, lost=True)

    def reenumerate(self) -> None:
        """Retry identifying GPUs that failed at init (slow cadence)."""
        with self._lock:
            try:
                self._enumerate()
            except Exception as e:  # noqa: BLE001
                if classify(e) == "session":
                    self.mark_down(e)

    def _soft(self, read: Callable[..., str], *args: Any) -> str:
        try:
            return read(*args)
        except Exception as e:  # noqa: BLE001 - an identity string is not worth a missing GPU
            if classify(e) not in ("unsupported", "quiet"):
                self._identity_failed = True
            return ""

    def _mig_mode(self, h: Any) -> str:
        try:
            current = self.nv.nvmlDeviceGetMigMode(h)[0]
        except Exception as e:  # noqa: BLE001 - NOT_SUPPORTED on parts without MIG
            if classify(e) not in ("unsupported", "quiet"):
                self._identity_failed = True
            return "unsupported"
        return "enabled" if current else "disabled"

    def set_lost(self, uuid: str, lost: bool) -> None:
        """Kept by the NVML collector; a GPU newly lost is told to :meth:`on_lost`'s callbacks."""
        with self._lock:  # replaced, never mutated: other threads iterate it
            newly = lost and uuid not in self.lost
            self.lost = self.lost | {uuid} if lost else self.lost - {uuid}
            callbacks = tuple(self._on_lost)
        d = self.device(uuid) if newly else None
        if d is not None:
            for callback in callbacks:
                callback(d)

    def on_lost(self, callback: Callable[[Device], None]) -> None:
        """Call ``callback(device)`` on the reading thread each time a GPU is newly lost."""
        with self._lock:
            self._on_lost.append(callback)

    def off_lost(self, callback: Callable[[Device], None]) -> None:
        with self._lock:
            if callback in self._on_lost:
                self._on_lost.remove(callback)

    def watch_key(self) -> tuple[int, tuple[str, ...]]:
        """Changes when NVML re-initialised or a GPU was lost or came back (event sets re-register)."""
        lost = self.lost
        return self.generation, tuple(d.uuid for d in self.devices if d.uuid not in lost)

    def device(self, uuid: str) -> Device | None:
        for d in self.devices:
            if d.uuid == uuid:
                return d
        return None


_SESSIONS: dict[tuple[bool, str], NvmlSession] = {}
_SESSIONS_LOCK = threading.Lock()


def session_for(settings: Settings) -> NvmlSession:
    """The process's session for these settings' NVML (real or simulated spool)."""
    key = (settings.simulate, settings.resolved_spool_dir() if settings.simulate else "")
    with _SESSIONS_LOCK:
        s = _SESSIONS.get(key)
        if s is None:
            s = _SESSIONS[key] = NvmlSession(settings)
        return s
