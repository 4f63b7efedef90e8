"""The MFU panel's peaks: every default cited, half its datasheet's sparse figure, and each NVML name
finds its own entry (the first match wins, so order matters)."""

from __future__ import annotations

import math
import re

import pytest

from vramwatch.monitoring import peaks
from vramwatch.monitoring.config import DEFAULT


def peak_of(name: str) -> float | None:
    """What the dashboards' ``or`` chain picks for a GPU name: the first pattern matching it fully."""
    for pattern, flops in DEFAULT.gpu_peak_flops:
        if re.fullmatch(pattern, name):  # PromQL's =~ is anchored
            return flops
    return None


def test_every_default_is_cited_and_half_its_sparse_figure():
    assert [p for p, _ in peaks.DENSE_BF16] == list(peaks.SOURCES)
    for pattern, flops in peaks.DENSE_BF16:
        sheet, sparse_tflops = peaks.SOURCES[pattern]
        assert "datasheet" in sheet
        assert flops == math.floor(sparse_tflops / 2) * peaks.TFLOPS, pattern


@pytest.mark.parametrize(
    ("nvml_name", "tflops"),
    [  # device names as NVML reports them
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100-PCIE-40GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
    ],
)
def test_each_gpu_gets_its_own_peak(nvml_name, tflops):
    assert peak_of(nvml_name) == tflops * peaks.TFLOPS


def test_an_unknown_gpu_has_no_peak():
    assert peak_of("NVIDIA L4") is None
