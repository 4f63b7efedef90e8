"""Peak dense BF16 tensor-core FLOP/s by GPU name: the denominator of the MFU panel.

NVIDIA's datasheets list BF16 tensor-core throughput "with sparsity" (2:4 structured); dense math, what
training runs, is half of it. From the NVIDIA A100, H100 and H200 Tensor Core GPU datasheets:

- A100 (SXM4 and PCIe): 624 TFLOPS with sparsity -> 312 dense
- H100 SXM: 1,979 -> 989; H100 PCIe: 1,513 -> 756
- H200 SXM: 1,979 -> 989; H200 NVL: 1,671 -> 835

Patterns are RE2 regexes on NVML's device name (``gpu_info{name}``), tried in order: the first match
wins, so a specific name comes before its family. A GPU missing here shows no MFU; add it through
``MonitoringConfig.gpu_peak_flops``. Sustained clocks under a power cap are lower than the boost clock
these figures assume, so measured MFU stays below 1 by a margin.
"""

from __future__ import annotations

DENSE_BF16: tuple[tuple[str, float], ...] = (
    ("NVIDIA H200 NVL.*", 835e12),
    ("NVIDIA H200.*", 989e12),
    ("NVIDIA H100 PCIe.*", 756e12),
    ("NVIDIA H100.*", 989e12),
    ("NVIDIA A100.*", 312e12),
)
