"""Peak dense BF16 tensor-core FLOP/s by GPU name: the denominator of the MFU panel.

Every figure is NVIDIA's datasheet "BFLOAT16 Tensor Core" line, which NVIDIA prints *with sparsity*
(2:4 structured sparsity; the datasheets' footnote: "Shown with sparsity. Specifications are one-half
lower without sparsity"). Training runs dense math, so each entry is half the datasheet figure, in
FLOP/s, rounded down to a whole TFLOP/s. BF16 and FP16 tensor-core peaks are equal on these parts; TF32
is half of BF16 and FP8 twice it, so a job training in another precision sets its own figure
(``MonitoringConfig.gpu_peak_flops``). Sources, one per entry (:data:`SOURCES`):

- A100 (SXM4 and PCIe, 40 and 80 GB): "NVIDIA A100 Tensor Core GPU" datasheet (nvidia-a100-datasheet-
  us-nvidia-1758950-r4-web.pdf): BF16 Tensor Core 312 TFLOPS, 624 with sparsity -> 312 dense. The
  A100 is the one datasheet that prints the dense figure too.
- H100 SXM5: "NVIDIA H100 Tensor Core GPU" datasheet: 1,979 TFLOPS with sparsity -> 989 dense.
- H100 PCIe: the same datasheet: 1,513 with sparsity -> 756 dense.
- H100 NVL: the same datasheet's NVL column (94 GB, per GPU): 1,671 with sparsity -> 835 dense. Before
  this entry an H100 NVL matched ``NVIDIA H100.*`` and got the SXM figure, 18% too high.
- H200 SXM: "NVIDIA H200 Tensor Core GPU" datasheet: 1,979 with sparsity -> 989 dense (the GH100 die of
  the H100 SXM at the same clocks; only the memory differs).
- H200 NVL: the same datasheet: 1,671 with sparsity -> 835 dense.

Cross-check of the H100 SXM figure from the architecture: 132 SMs x 4 tensor cores x 1,024 dense BF16
FLOP per clock per tensor core x 1.83 GHz boost = 989.4 TFLOP/s (the SM count and boost clock of
NVIDIA's H100 architecture whitepaper), so the datasheet's sparse figure is indeed twice the dense one.

Checked against stored copies of the tables: the A100 and H100 SXM/PCIe lines (the datasheets' tables
as reproduced at glennklockwood.com/garden/processors/A100 and archive-lib.hpctech.co.jp/gpuproduct/
nvidia-h100.html, footnote included), the H200 SXM's dense 989 (itkb.uw.cz's H200 datasheet reading).
The two NVL lines (1,671 with sparsity) come from the NVL columns of NVIDIA's H100 and H200 datasheets
but were not in those stored copies: confirm them against the current datasheet before relying on them.

Patterns are RE2 regexes on NVML's device name (``gpu_info{name}``, e.g. ``NVIDIA H100 80GB HBM3``,
``NVIDIA H100 NVL``, ``NVIDIA H200``, ``NVIDIA A100-SXM4-80GB``), tried in order: the first match wins,
so a specific name comes before its family. A GPU missing here shows no MFU; add it through
``MonitoringConfig.gpu_peak_flops``. Sustained clocks under a power cap are lower than the boost clock
these figures assume, so measured MFU stays below 1 by a margin.
"""

from __future__ import annotations

TFLOPS = 1e12

# NVML name pattern -> (datasheet, its BF16 tensor-core figure with sparsity in TFLOPS); specific names first
SOURCES: dict[str, tuple[str, float]] = {
    "NVIDIA H200 NVL.*": ("NVIDIA H200 Tensor Core GPU datasheet, H200 NVL", 1671),
    "NVIDIA H200.*": ("NVIDIA H200 Tensor Core GPU datasheet, H200 SXM", 1979),
    "NVIDIA H100 NVL.*": ("NVIDIA H100 Tensor Core GPU datasheet, H100 NVL", 1671),
    "NVIDIA H100 PCIe.*": ("NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe", 1513),
    "NVIDIA H100.*": ("NVIDIA H100 Tensor Core GPU datasheet, H100 SXM", 1979),
    "NVIDIA A100.*": ("NVIDIA A100 Tensor Core GPU datasheet, A100 SXM4 and PCIe", 624),
}
# (pattern, dense BF16 FLOP/s): half the sparse figure, rounded down to a whole TFLOP/s
DENSE_BF16: tuple[tuple[str, float], ...] = tuple((p, sparse // 2 * TFLOPS) for p, (_, sparse) in SOURCES.items())
