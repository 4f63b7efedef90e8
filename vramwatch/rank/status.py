"""The console status line: every N steps, one compact line per device.

    vramwatch: step 1200, 0.412 s/step, cuda:0 alloc 3.06 GiB reserved 4.14 GiB free 2.73 GiB frag 26%
               retries 0 power 212 W          (one line, folded here)

What a hand-written logging callback would print every step, from the values the sampler
already read (at most one ``interval`` old): the step path never reads allocator stats, it
compares one counter and formats a line only on every N-th step.

- ``free`` is NVML's free memory on the card when the node server publishes its readings into
  the spool (:mod:`vramwatch.spool.readings`); otherwise ``headroom`` is shown instead: the
  process's budget (memory fraction x total) minus what the allocator reserved.
- ``power`` comes from the same readings (the simulated GPU's too, under ``simulate``: its server
  publishes them alike) and is left out when there are none. The training process never calls
  NVML for it.
- ``reclaims`` appears when allocator hygiene is on, ``ooms`` once one happened.
- On a node without NVML (the server says so in the same readings: no library, no driver, no
  GPU) one extra line, once, says what is missing.

At start, one line names the rank and its job (the ``job_id`` label of its series), once:

    vramwatch: rank 0 of 8, job_id 4711.0, pid 31337

Where it goes: a postfix on the active tqdm bar if there is one (the
Trainer's or Lightning's progress bar), else the ``vramwatch.status`` logger at INFO (printed to
stderr when logging is not configured). Rank 0 only unless ``status_all_ranks``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from vramwatch.spool import DeviceSample, GpuReadings, read_node

if TYPE_CHECKING:
    from vramwatch.rank.plugin_api import RankContext

GIB = float(1 << 30)

status_log = logging.getLogger("vramwatch.status")


_NO_READINGS = GpuReadings("")

# vramwatch_nvml_available's reasons, said on the console
NVML_ABSENT_TEXT = {
    "library_not_found": "the NVML library (libnvidia-ml.so.1) is not found",
    "driver_not_loaded": "the NVIDIA driver is not loaded",
    "no_devices": "NVML sees no GPU",
}


def nvml_absent_line(reason: str) -> str:
    what = NVML_ABSENT_TEXT.get(reason, reason)
    return f"vramwatch: no NVML on this node ({what}): no free memory or power readings; allocator metrics go on"


def _gib(v: float) -> str:
    return f"{v / GIB:.2f} GiB"


def format_device(dev: DeviceSample, readings: Mapping[str, GpuReadings]) -> str:
    v = dev.values
    alloc = v.get("torch_cuda_memory_allocated_bytes", 0.0)
    reserved = v.get("torch_cuda_memory_reserved_bytes", 0.0)
    limit = v.get("torch_cuda_memory_limit_bytes", 0.0)
    nv = readings.get(dev.uuid) or _NO_READINGS
    parts = [f"cuda:{dev.device}", f"alloc {_gib(alloc)}", f"reserved {_gib(reserved)}"]
    if nv.memory_free_bytes is not None:
        parts.append(f"free {_gib(nv.memory_free_bytes)}")
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
    if nv.power_watts is not None:
        parts.append(f"power {nv.power_watts:.0f} W")
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
        emit: Callable[[list[str], str], None] | None = None,
    ) -> None:
        self.heartbeat = heartbeat
        self.every = max(1, int(every))
        self.rank = rank
        self.show_rank = show_rank
        self.spool_dir = spool_dir
        self.emit = emit
        self.lines = 0
        self._next = self.every
        self._devices: list[DeviceSample] = []
        self._readings: dict[str, GpuReadings] = {}
        self._nvml_absent = ""
        self._told_absent = False
        self._sum0 = 0.0
        self._steps0 = 1  # the first step has no duration
        self._failed = False
        if emit is None:
            _ensure_output()

    @classmethod
    def for_rank(cls, ctx: RankContext) -> StatusLine:
        s = ctx.settings
        line = cls(
            ctx.heartbeat, s.status_every, rank=ctx.identity.rank, show_rank=s.status_all_ranks, spool_dir=ctx.spool_dir
        )
        line.start(ctx.identity.world_size, ctx.identity.job_id)
        return line

    def start(self, world_size: int, job_id: str) -> str:
        """The start line, once: which rank of which job this console belongs to."""
        # the pid only here, on the console (never a label): a local-<hash> job id is this process or its parent
        text = f"vramwatch: rank {self.rank} of {world_size}, job_id {job_id}, pid {os.getpid()}"
        if self.emit is not None:
            self.emit([text], "start")
        else:
            status_log.info(text)
        return text

    def on_sample(self, devices: Iterable[DeviceSample]) -> None:
        """Sampler thread: keep the newest device values and NVML readings for the next line (adds nothing)."""
        self._devices = list(devices)
        if self.spool_dir:
            node = read_node(self.spool_dir)
            self._readings, self._nvml_absent = node.gpus, node.nvml_absent

    def close(self) -> None:
        pass

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
        notice = ""
        if self._nvml_absent and not self._told_absent:
            self._told_absent = True
            notice = nvml_absent_line(self._nvml_absent)
            lines.append(notice)
        self.lines += 1
        if self.emit is not None:
            self.emit(lines, head)
            return lines
        bar = active_tqdm()
        if bar is not None:
            bar.set_postfix_str(" | ".join(bodies), refresh=False)
            if notice:
                type(bar).write(notice)  # tqdm's own print, above the bars
        else:
            for line in lines:
                status_log.info(line)
        return lines
