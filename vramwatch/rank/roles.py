"""Memory by role: the bytes of a watched model's parameters, gradients and optimizer state per device.

``vramwatch.watch(model, optimizer)`` hands both over; the sampler thread walks them every
``role_interval`` seconds. A walk reads only tensor metadata (``.device``, ``untyped_storage().data_ptr()``
and ``.nbytes()``): no CUDA call, no context, no sync.

A torch parameter's ``.grad`` is never read off the training thread: autograd replaces it during
``backward()`` without the GIL, and a concurrent read of that pointer crashes the process (a thread
reading ``p.grad`` in a loop beside a training loop segfaulted it within 15 s, 5 runs of 5). The gradients
are located instead at the training thread's next optimizer step, the point where backward is over: a
step pre-hook (the watched optimizer's, else torch's global one) reads at most 256 gradients a
step while a snapshot is due, and does nothing otherwise. A walk counts the newest snapshot, so the
gradients figure is that of an optimizer step since the walk before; without optimizer steps (no
training) it stays 0. Tensor-likes that are not torch tensors (the simulator's) are read by the walk.

- Each storage counts once (tied weights, views, a flat parameter's views: keyed by device and data
  pointer), in the first role that holds it (parameters, then gradients, then optimizer state).
- A DTensor (FSDP2, tensor parallel) counts its local shard (``_local_tensor``): the bytes on this rank.
- Only the model and the optimizer are held weakly: a deleted model is never kept alive, its figures
  disappear. The parameter list is cached (refreshed every ``_REFRESH_WALKS`` walks).
- One pass reads at most ``max_tensors`` tensors; a larger model is walked over several passes and its
  figures publish when the walk completes, so a pass's cost is bounded whatever the model; and the next
  walk waits until the walks have used at most ``MAX_CORE_SHARE`` of a core.

``other`` is the device's allocated bytes at the sample minus the three roles of the newest walk, at
least 0: activations, autograd's saved tensors, workspaces and temporaries. With the cache (reserved -
allocated) the four roles stack up to reserved.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from vramwatch.spool import CollectorHealth, DeviceSample

_REFRESH_WALKS = 10
# Gradients located per optimizer step while a snapshot is due (~0.3 us each): a step of a large model
# pays ~0.1 ms on a few steps every role_interval, never one long pause.
_STEP_CHUNK = 256
# The walks' share of one core, at most: a model of many tensors is walked less often than role_interval
# (a walk of 30 ms waits 300 s for the next), so the in-process cost guarantee holds whatever the model.
MAX_CORE_SHARE = 1e-4
_ALLOCATED = "torch_cuda_memory_allocated_bytes"


def _weak(obj: Any) -> Any:
    if obj is None:
        return None
    try:
        return weakref.ref(obj)
    except TypeError:  # an object without weak references: held strongly (documented in watch())
        return lambda: obj


class RoleWalker:
    """Walks the watched objects on the sampler thread; :meth:`apply` adds the roles to a sample's devices."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        interval: float,
        max_tensors: int,
        device_types: tuple[str, ...] = ("cuda",),
    ) -> None:
        self._model = _weak(model)
        self._optimizer = _weak(optimizer)
        self.interval = interval
        self.max_tensors = max_tensors
        self.device_types = device_types
        # one device type with a flag on the tensor (is_cuda, is_cpu): read that, not t.device.type, which
        # builds a string per tensor (~0.3 us of a walk's ~1.5 us a tensor)
        self._flag = f"is_{device_types[0]}" if len(device_types) == 1 and device_types[0] in ("cuda", "cpu") else ""
        self._params: list[Any] = []  # weak references to the model's parameters
        self._walks = 0
        self._walk: Iterator[None] | None = None
        self._next = 0.0
        self.result: dict[int, tuple[int, int, int]] | None = None
        self.passes = 0  # passes run (a walk is one pass or more)
        self._walk_start = 0.0
        self._walk_cost = 0.0  # seconds the walk under way has taken, over its passes
        self.health = CollectorHealth(1, 0, 0.0)
        # gradients of torch parameters, located on the training thread (see the module's doc)
        self._grads: list[tuple[int, int, int]] = []  # (device, data_ptr, nbytes) of the newest snapshot
        self._grads_pending: list[tuple[int, int, int]] = []
        self._grads_cursor = 0
        self._grads_due = True  # the first step after watch() takes one
        self._hook = self._hook_safe_points(optimizer)

    def _hook_safe_points(self, optimizer: Any) -> Any:
        """Register :meth:`on_optimizer_step` as a step pre-hook; None without torch (never imported here)."""
        optim = sys.modules.get("torch.optim.optimizer")
        if optim is None:
            return None
        register = getattr(optimizer, "register_step_pre_hook", None) if optimizer is not None else None
        if register is None:
            register = getattr(optim, "register_optimizer_step_pre_hook", None)
        try:
            return register(self.on_optimizer_step) if register is not None else None
        except Exception:  # noqa: BLE001 - no hook: torch gradients then read 0
            return None

    def close(self) -> None:
        """Remove the step hook (watch() replacing this walker, or the exporter stopping)."""
        hook, self._hook = self._hook, None
        if hook is not None:
            try:
                hook.remove()
            except Exception:  # noqa: BLE001
                pass

    # --- on the training thread, at an optimizer step (backward is over) ---
    def on_optimizer_step(self, *_: Any) -> None:
        """Locate up to ``max_tensors`` gradients while a snapshot is due; never raises into the step."""
        if not self._grads_due:
            return
        try:
            params = self._params
            if not params:
                model = self._model() if self._model is not None else None
                if model is None:
                    return
                params = self._params = [weakref.ref(p) for p in model.parameters()]
                del model
            start = self._grads_cursor
            end = start + min(self.max_tensors, _STEP_CHUNK)
            pending = self._grads_pending
            for ref in params[start:end]:
                p = ref()
                g = p.grad if p is not None else None
                if g is not None:
                    key = self._locate(g)
                    if key is not None:
                        pending.append(key)
            if end < len(params):
                self._grads_cursor = end
                return
            self._grads, self._grads_pending, self._grads_cursor = pending, [], 0
            self._grads_due = False
        except Exception:  # noqa: BLE001 - a failed snapshot leaves the previous one
            self._grads_pending, self._grads_cursor = [], 0

    # --- on the sampler thread ---
    def poll(self, now: float) -> None:
        """Run one bounded pass if a walk is due or under way. Never raises."""
        if self._walk is None:
            if now < self._next:
                return
            self._next = now + self.interval
            self._walk = self._walk_all()
            self._walk_start, self._walk_cost = now, 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        up, errors = 1, self.health.errors
        try:
            next(self._walk)
        except StopIteration:
            self._walk = None
        except Exception:  # noqa: BLE001 - reported as vramwatch_collector_up{collector="roles"} 0
            self._walk = None
            up, errors = 0, errors + 1
        took = time.perf_counter() - t0
        # the budget is a share of a core: this thread's CPU time, not the wall time, which also counts the
        # waits for the GIL while the training thread launches kernels (tens of times the walk's own cost)
        self._walk_cost += time.thread_time() - c0
        if self._walk is None:  # done: the next waits for the share of a core it may use
            self._next = max(self._next, self._walk_start + self._walk_cost / MAX_CORE_SHARE)
        self.passes += 1
        self.health = CollectorHealth(up, errors, took)

    def apply(self, devices: Sequence[DeviceSample]) -> Sequence[DeviceSample]:
        """``devices`` with the newest walk's roles, ``other`` from each device's allocated bytes now."""
        result = self.result
        if not result:
            return devices
        out = []
        for d in devices:
            r = result.get(d.device)
            if r is None:
                out.append(d)
                continue
            p, g, o = r
            allocated = d.values.get(_ALLOCATED)
            roles = {"parameters": float(p), "gradients": float(g), "optimizer_state": float(o)}
            if allocated is not None:
                roles["other"] = max(0.0, allocated - p - g - o)
            out.append(DeviceSample(d.device, d.uuid, d.values, roles))
        return out

    # --- the walk ---
    def _walk_all(self) -> Iterator[None]:
        model = self._model() if self._model is not None else None
        if model is None and self._model is not None:
            self.result = None  # the model is gone: so are its figures
            return
        if model is not None and (not self._params or self._walks % _REFRESH_WALKS == 0):
            self._params = [weakref.ref(p) for p in model.parameters()]
        del model  # hold nothing across passes
        self._walks += 1
        self._grads_due = True  # a fresh snapshot for the next walk
        seen: set[tuple[int, int]] = set()
        totals: dict[int, list[int]] = {}
        budget = self.max_tensors
        for role, tensors in enumerate((self._parameters(), self._gradients(), self._optimizer_state())):
            if role == 2:  # the torch gradients of the newest optimizer-step snapshot, before the state
                for key in self._grads:
                    self._add(key, 1, seen, totals)
            for t in tensors:
                self._count(t, role, seen, totals)
                budget -= 1
                if budget <= 0:
                    budget = self.max_tensors
                    yield  # the rest on the next pass
        self.result = {dev: (v[0], v[1], v[2]) for dev, v in totals.items()}

    def _parameters(self) -> Iterator[Any]:
        for ref in self._params:
            p = ref()
            if p is not None:
                yield p

    def _gradients(self) -> Iterator[Any]:
        """Gradients of tensor-likes that are not torch tensors; torch's come from the step snapshot."""
        tensor = getattr(sys.modules.get("torch"), "Tensor", None)
        for ref in self._params:
            p = ref()
            if p is None or (tensor is not None and isinstance(p, tensor)):
                continue
            g = getattr(p, "grad", None)
            if g is not None:
                yield g

    def _optimizer_state(self) -> Iterator[Any]:
        opt = self._optimizer() if self._optimizer is not None else None
        state = getattr(opt, "state", None)
        if not state:
            return
        per_param = list(state.values())  # one C-level copy under the GIL: safe against a concurrent step
        del opt, state
        for entry in per_param:
            if isinstance(entry, dict):
                for v in list(entry.values()):
                    if hasattr(v, "untyped_storage") or hasattr(v, "_local_tensor"):
                        yield v

    def _locate(self, t: Any) -> tuple[int, int, int] | None:
        """(device index, storage pointer, bytes) of a tensor on a watched device type; None otherwise."""
        local = getattr(t, "_local_tensor", None)  # a DTensor: this rank's shard
        if local is not None:
            t = local
        on = getattr(t, self._flag, None) if self._flag else None
        if on is not None:  # a torch tensor
            if not on:
                return None  # CPU-offloaded state is not device memory
            index = max(t.get_device(), 0)  # -1 for the CPU (tests walk CPU tensors as a device's)
        else:  # another device type, or a tensor-like without the flag
            dev = t.device
            if dev.type not in self.device_types:
                return None  # CPU-offloaded state is not device memory
            index = dev.index or 0
        storage = t.untyped_storage()
        return index, storage.data_ptr(), storage.nbytes()

    def _count(self, t: Any, role: int, seen: set[tuple[int, int]], totals: dict[int, list[int]]) -> None:
        key = self._locate(t)
        if key is not None:
            self._add(key, role, seen, totals)

    @staticmethod
    def _add(key: tuple[int, int, int], role: int, seen: set[tuple[int, int]], totals: dict[int, list[int]]) -> None:
        index, ptr, nbytes = key
        if ptr == 0 or (index, ptr) in seen:  # 0: an empty or meta tensor
            return
        seen.add((index, ptr))
        row = totals.get(index)
        if row is None:
            row = totals[index] = [0, 0, 0]
        row[role] += nbytes
