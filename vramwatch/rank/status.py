"""The console status line: every N steps, one compact line per device.

    vramwatch: step 1200, 0.412 s/step, cuda:0 alloc 3.06 GiB reserved 4.14 GiB free 2.73 GiB frag 26%
               retries 0 power 212 W          (one line, folded here)

What the field notes' hand-written callback printed every step, from the values the sampler
already read (at most one ``interval`` old): the step path never reads allocator stats, it
compares one counter and formats a line only on every N-th step.

- ``free`` is NVML's free memory on the card when the node server publishes its readings into
  the spool (``nvml.json``, below); otherwise ``headroom`` is shown instead: the process's budget
  (memory fraction x total) minus what the allocator reserved.
- ``power`` comes from the same readings (the simulated GPU's state under ``simulate``) and is
  left out when there are none. The training process never calls NVML for it.
- ``reclaims`` appears when allocator hygiene is on, ``ooms`` once one happened.

Where it goes: with ``mode="auto"`` a postfix on the active tqdm bar if there is one (the
Trainer's or Lightning's progress bar), else the ``vramwatch.status`` logger at INFO (printed to
stderr when logging is not configured). Rank 0 only unless ``status_all_ranks``.

``<spool>/nvml.json``, if the server writes it: ``{"time": <unix seconds>, "gpus": [{"uuid":
"GPU-...", "power_watts": 212.0, "memory_free_bytes": 2.9e9}, ...]}``; readings older than
``STALE_AFTER`` seconds are ignored.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vramwatch.rank.handle import Handle

NVML_FILE = "nvml.json"
SIM_FILE = "sim-node.json"
STALE_AFTER = 30.0
GIB = float(1 << 30)

status_log = logging.getLogger("vramwatch.status")


def read_device_readings(
    spool_dir: str, simulate: bool = False, now: float | None = None
) -> dict[str, dict[str, float]]:
    """uuid -> {"power_watts", "memory_free_bytes"} from the server's NVML file, else the simulated GPU."""
    now = time.time() if now is None else now
    out: dict[str, dict[str, float]] = {}
    try:
        with open(os.path.join(spool_dir, NVML_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
        if now - float(data.get("time", 0)) <= STALE_AFTER:
            gpus = data.get("gpus") or []
            if isinstance(gpus, dict):
                gpus = [dict(v, uuid=k) for k, v in gpus.items()]
            for g in gpus:
                vals = {
                    k: float(g[k]) for k in ("power_watts", "memory_free_bytes") if isinstance(g.get(k), (int, float))
                }
                if g.get("uuid"):
                    out[str(g["uuid"])] = vals
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    if not out and simulate:
        try:
            with open(os.path.join(spool_dir, SIM_FILE), encoding="utf-8") as fh:
                node = json.load(fh)
            for g in node.get("gpus", []):
                if not g.get("lost"):
                    out[str(g["uuid"])] = {"power_watts": float(g.get("power_w", 0.0))}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass
    return out


def write_readings(spool_dir: str, snapshot: Any) -> None:
    """Server side: publish the NVML snapshot's power and free memory for the ranks' status lines.

    ``snapshot`` is the NVML collector's (``gpus`` with ``uuid``, ``up`` and ``values`` keyed by
    ``(family, label)``). Atomic replace; never raises.
    """
    try:
        gpus = []
        for g in snapshot.gpus:
            if not g.up:
                continue
            entry: dict[str, Any] = {"uuid": g.uuid}
            for key, fam in (("power_watts", "gpu_power_watts"), ("memory_free_bytes", "gpu_memory_free_bytes")):
                v = g.values.get((fam, ""))
                if v is not None:
                    entry[key] = float(v)
            gpus.append(entry)
        path = os.path.join(spool_dir, NVML_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"time": time.time(), "gpus": gpus}, fh)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - the status line is a convenience
        logging.getLogger("vramwatch").debug("vramwatch: writing %s failed: %r", NVML_FILE, e)


def _gib(v: float) -> str:
    return f"{v / GIB:.2f} GiB"


def format_device(dev: dict[str, Any], readings: dict[str, dict[str, float]]) -> str:
    v = dev.get("values") or {}
    alloc = v.get("torch_cuda_memory_allocated_bytes", 0.0)
    reserved = v.get("torch_cuda_memory_reserved_bytes", 0.0)
    limit = v.get("torch_cuda_memory_limit_bytes", 0.0)
    nv = readings.get(str(dev.get("uuid", "")), {})
    parts = [f"cuda:{dev.get('device', '?')}", f"alloc {_gib(alloc)}", f"reserved {_gib(reserved)}"]
    if "memory_free_bytes" in nv:
        parts.append(f"free {_gib(nv['memory_free_bytes'])}")
    elif limit > 0:
        parts.append(f"headroom {_gib(max(limit - reserved, 0.0))}")
    frag = v.get("torch_cuda_memory_fragmentation_ratio")
    if frag is not None:
        parts.append(f"frag {100 * frag:.0f}%")
    retries = v.get("torch_cuda_memory_alloc_retries_total")
    if retries is not None:
        parts.append(f"retries {int(retries)}")
    reclaims = v.get("torch_cuda_memory_cache_reclaims_total")
    if reclaims is not None:
        parts.append(f"reclaims {int(reclaims)}")
    ooms = v.get("torch_cuda_memory_ooms_total")
    if ooms:
        parts.append(f"ooms {int(ooms)}")
    if "power_watts" in nv:
        parts.append(f"power {nv['power_watts']:.0f} W")
    return " ".join(parts)


def active_tqdm() -> Any:
    """The outermost visible tqdm bar of this process, or None (never imports tqdm)."""
    mod = sys.modules.get("tqdm.std")
    cls = getattr(mod, "tqdm", None)
    if cls is None:
        return None
    try:
        bars = [b for b in list(cls._instances) if not getattr(b, "disable", False)]
    except Exception:  # noqa: BLE001 - a WeakSet changing under us
        return None
    if not bars:
        return None
    return min(bars, key=lambda b: abs(getattr(b, "pos", 0) or 0))


def _ensure_output() -> None:
    status_log.setLevel(logging.INFO)
    if not status_log.hasHandlers():  # logging not configured: print to stderr ourselves
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        status_log.addHandler(h)
        status_log.propagate = False


class StatusLine:
    def __init__(
        self,
        heartbeat: Any,
        every: int,
        *,
        rank: int = 0,
        show_rank: bool = False,
        spool_dir: str = "",
        simulate: bool = False,
        mode: str = "auto",
        emit: Callable[[list[str], str], None] | None = None,
    ) -> None:
        self.heartbeat = heartbeat
        self.every = max(1, int(every))
        self.rank = rank
        self.show_rank = show_rank
        self.spool_dir = spool_dir
        self.simulate = simulate
        self.mode = mode
        self.emit = emit
        self.lines = 0
        self._next = self.every
        self._devices: list[dict[str, Any]] = []
        self._readings: dict[str, dict[str, float]] = {}
        self._sum0 = 0.0
        self._steps0 = 1  # the first step has no duration
        self._failed = False
        if emit is None and mode != "postfix":
            _ensure_output()

    @classmethod
    def for_handle(cls, handle: Handle) -> StatusLine:
        s = handle.settings
        return cls(
            handle.heartbeat,
            s.status_every,
            rank=handle.identity.rank,
            show_rank=s.status_all_ranks,
            spool_dir=handle.spool_dir,
            simulate=s.simulate,
        )

    def on_sample(self, devices: Iterable[dict[str, Any]]) -> None:
        """Sampler thread: keep the newest device values and NVML readings for the next line."""
        self._devices = list(devices)
        if self.spool_dir:
            self._readings = read_device_readings(self.spool_dir, self.simulate)

    def on_step(self) -> None:
        """Training thread: one comparison per step; a line every ``every`` steps."""
        if self.heartbeat.steps < self._next or self._failed:
            return
        try:
            self.report()
        except Exception as e:  # noqa: BLE001
            self._failed = True
            logging.getLogger("vramwatch").warning("vramwatch: status line failed (%r); turned off", e)

    def report(self) -> list[str]:
        hb = self.heartbeat
        steps = hb.steps
        self._next = (steps // self.every + 1) * self.every
        n = steps - self._steps0
        head = f"step {steps}"
        if n > 0:
            head += f", {(hb.sum - self._sum0) / n:.3f} s/step"
        self._sum0, self._steps0 = hb.sum, steps
        if self.show_rank:
            head = f"rank {self.rank} {head}"
        devices = self._devices
        bodies = [format_device(d, self._readings) for d in devices] or ["no CUDA device in use yet"]
        lines = [f"vramwatch: {head}, {b}" for b in bodies]
        self.lines += 1
        if self.emit is not None:
            self.emit(lines, head)
            return lines
        bar = active_tqdm() if self.mode in ("auto", "postfix") else None
        if bar is not None:
            bar.set_postfix_str(" | ".join(bodies), refresh=False)
        elif self.mode != "postfix":
            for line in lines:
                status_log.info(line)
        return lines
