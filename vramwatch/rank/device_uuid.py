"""The uuid a rank labels a CUDA device's series with: NVML's spelling, so they join the device series.

NVML names a whole GPU ``GPU-<uuid>`` and, since R470, a MIG device ``MIG-<uuid>`` ("Updated
nvmlDeviceGetUUID to return MIG UUIDs in the canonical format, 'MIG-UUID'", NVML API change log,
docs.nvidia.com/deploy/nvml-api/change-log.html). torch's ``get_device_properties(i).uuid`` prints the 16
bytes bare, without a prefix (measured on an H200: ``5fda456a-…`` for NVML's ``GPU-5fda456a-…``,
reference torch-nvml.md B4). On a MIG device the CUDA driver's ``cuDeviceGetUuid_v2`` "returns its MIG UUID
which uniquely identifies the subscribed MIG compute instance" (CUDA driver API, Device Management), and
its name ends in the profile ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", as ``torch.cuda.get_device_name``
prints it). Whether torch's ``uuid`` holds those instance bytes is UNCONFIRMED (no MIG card to measure),
so the surest source comes first:

1. ``CUDA_VISIBLE_DEVICES`` naming a MIG device: CUDA enumerates a single MIG instance ("Only single MIG
   instance enumeration is supported", CUDA C Programming Guide, CUDA Environment Variables), so it is
   CUDA device 0 and the entry, in NVML's ``MIG-<uuid>`` form, is its uuid (vllm-project/vllm PR #6582
   relies on the same). The legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` form is no uuid: it falls through.
2. A uuid that already has a prefix is kept.
3. A device named ``... MIG <profile>``, with ``CUDA_VISIBLE_DEVICES`` unset and ``NVIDIA_VISIBLE_DEVICES``
   naming one MIG device: that one. The NVIDIA container runtime exposes to the container the GPUs that
   variable lists (container-toolkit docs, "GPU Enumeration"; the Kubernetes device plugin sets it to the
   MIG uuids it allocates), so a container with one MIG device sees it as CUDA device 0. Outside such a
   container the variable does nothing, hence the name check.
4. A device named ``... MIG <profile>``: ``MIG-`` + the bare uuid.
5. Else ``GPU-`` + the bare uuid.
"""

from __future__ import annotations

import re

_CANONICAL = re.compile(r"^(GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def mig_entry(cuda_visible_devices: str | None) -> str:
    """The MIG device CUDA_VISIBLE_DEVICES makes visible, in NVML's ``MIG-<uuid>`` form ("" if none)."""
    for part in (cuda_visible_devices or "").split(","):
        part = part.strip()
        if part.startswith("MIG-"):
            return part if _CANONICAL.match(part) else ""  # the first MIG entry is the one CUDA enumerates
    return ""


def device_uuid(
    raw: str, name: str, device: int, cuda_visible_devices: str | None, nvidia_visible_devices: str | None = None
) -> str:
    """NVML's uuid of CUDA device ``device``, from torch's ``uuid`` and ``name`` and the environment."""
    if device == 0:
        mig = mig_entry(cuda_visible_devices)
        if mig:
            return mig
    if raw.startswith(("GPU-", "MIG-")):
        return raw
    if " MIG " in f" {name} ":
        parts = [p.strip() for p in (nvidia_visible_devices or "").split(",") if p.strip()]
        if device == 0 and cuda_visible_devices is None and len(parts) == 1 and mig_entry(parts[0]):
            return parts[0]
        return "MIG-" + raw
    return "GPU-" + raw
