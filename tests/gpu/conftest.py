"""The GPU suite runs only where NVML finds an NVIDIA GPU (and nvidia-smi is there to compare with).

Run it with ``pytest -m gpu tests/gpu``; elsewhere every test here is skipped with the reason.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_reason: str | None = None


def gpu_missing() -> str:
    """Why the GPU suite cannot run here ('' when it can)."""
    global _reason
    if _reason is None:
        _reason = _probe()
    return _reason


def _probe() -> str:
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()  # never shut down: NVML is refcounted and torch shares it
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as e:
        return f"NVML is unavailable: {e}"
    if count == 0:
        return "NVML sees no NVIDIA GPU"
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi is not on PATH"
    return ""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents and gpu_missing():
            item.add_marker(pytest.mark.skip(reason=gpu_missing()))
