"""torch.cuda.memory_stats() key lists recorded per torch version (tests/data/memory_stats_keys/), and the
flattening torch itself applies, for the CPU shape tests (tests/sim/) and the GPU check (tests/gpu/)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

KEYS_DIR = Path(__file__).resolve().parent / "data" / "memory_stats_keys"
# Present only for each torch.cuda.MemPool (graph pools too), one block of 12 keys per pool id: not a fixed key.
DYNAMIC_PREFIXES = ("reserved_bytes_by_private_pools.",)


def short_version(version: str) -> str:
    """'2.13.0+cpu' -> '2.13'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return f"{m[1]}.{m[2]}"


def recorded_versions() -> list[str]:
    return sorted(p.stem.removeprefix("torch-") for p in KEYS_DIR.glob("torch-*.txt"))


def recorded(version: str) -> set[str]:
    """The flattened keys recorded for torch ``version`` (major.minor); '#' starts a comment."""
    path = KEYS_DIR / f"torch-{short_version(version)}.txt"
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def fixed_keys(flat: dict[str, Any]) -> set[str]:
    """The keys every device has, whatever pools the job made."""
    return {k for k in flat if not k.startswith(DYNAMIC_PREFIXES)}


def flatten_like_torch(nested: dict[str, Any]) -> dict[str, Any]:
    """``nested`` flattened by the installed torch's own ``torch.cuda.memory_stats`` code (which reads the
    nested dict from ``memory_stats_as_nested_dict``; on a machine without CUDA that returns {}, so it is
    swapped for one call)."""
    import torch.cuda.memory as memory

    real = memory.memory_stats_as_nested_dict
    memory.memory_stats_as_nested_dict = lambda device=None: nested  # type: ignore[assignment]
    try:
        return dict(memory.memory_stats(0))
    finally:
        memory.memory_stats_as_nested_dict = real


def documented_keys(doc: str) -> set[str]:
    """The fixed keys the docstring of ``torch.cuda.memory_stats`` names, braces expanded.

    The docstring calls the count of allocations ``allocated.{...}``; the dict's key is ``allocation``
    (torch's own C++ and the keys measured on an H200): that one name is corrected here.
    """
    out: set[str] = set()
    for pattern in re.findall(r'``"([a-z][a-z_.{},]*)"``', doc):
        keys = [""]
        for part in pattern.split("."):
            alternatives = part[1:-1].split(",") if part.startswith("{") else [part]
            keys = [f"{k}.{a}" if k else a for k in keys for a in alternatives]
        out.update(keys)
    out = {("allocation" + k[len("allocated") :]) if k.startswith("allocated.") else k for k in out}
    return {k for k in out if not (k + ".").startswith(DYNAMIC_PREFIXES)}
