"""A simulated model and optimizer for ``vramwatch.watch()``: objects with a tensor's metadata only.

The role walker reads ``.device`` and ``untyped_storage()`` (``data_ptr()``, ``nbytes()``); these
stand-ins carry the same attributes on the simulated GPU, so the demo and the tests walk the real code.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

_ptrs = itertools.count(0x7F0000000000, 1 << 32)  # distinct fake device addresses


@dataclass(frozen=True)
class SimDevice:
    index: int
    type: str = "cuda"


class SimStorage:
    def __init__(self, nbytes: int) -> None:
        self._ptr = next(_ptrs)
        self._nbytes = nbytes

    def data_ptr(self) -> int:
        return self._ptr

    def nbytes(self) -> int:
        return self._nbytes


class SimTensor:
    """A tensor of ``nbytes`` on simulated ``cuda:device``."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        self.device = SimDevice(device)
        self._storage = SimStorage(nbytes)
        self.grad: SimTensor | None = None

    def untyped_storage(self) -> SimStorage:
        return self._storage


class SimModel:
    """``layers`` parameters sharing ``param_bytes``, each with a gradient of its size."""

    def __init__(self, param_bytes: int, layers: int = 32, device: int = 0) -> None:
        each = max(1, param_bytes // layers)
        self.params = [SimTensor(each, device) for _ in range(layers)]
        for p in self.params:
            p.grad = SimTensor(each, device)

    def parameters(self) -> list[SimTensor]:
        return list(self.params)

    @property
    def param_count(self) -> int:
        return sum(p.untyped_storage().nbytes() for p in self.params) // 2  # bf16


class SimAdam:
    """Adam's two moments per parameter, in fp32 (twice a bf16 parameter's bytes each)."""

    def __init__(self, model: SimModel) -> None:
        self.state: dict[Any, dict[str, SimTensor]] = {
            p: {
                "exp_avg": SimTensor(2 * p.untyped_storage().nbytes(), p.device.index),
                "exp_avg_sq": SimTensor(2 * p.untyped_storage().nbytes(), p.device.index),
            }
            for p in model.params
        }
