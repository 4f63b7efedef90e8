"""An NVML module (pynvml, or the simulator's) that counts its calls: the tests that check how often the
collectors ask NVML (a MIG-less card asked once per slow read, NOT_SUPPORTED remembered) wrap it in this."""

from __future__ import annotations

from collections import Counter
from typing import Any


class CountingNvml:
    """Wraps an NVML module and counts calls per ``nvml*`` function."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        v = getattr(self.nv, name)
        if callable(v) and name.startswith("nvml"):

            def call(*a: Any, **k: Any) -> Any:
                self.calls[name] += 1
                return v(*a, **k)

            return call
        return v
