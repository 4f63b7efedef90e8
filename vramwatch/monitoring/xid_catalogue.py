"""What each Xid means and what to do about it, from NVIDIA's Xid catalogue.

Source: NVIDIA, "Analyzing Xid Errors with the Xid Catalog"
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), its "Resolution Bucket (Immediate
Action)" per code, in the version mirrored from NVIDIA's spreadsheet on 2025-10-29 (see
``scripts/xid-catalog.tsv``, from which :mod:`~vramwatch.monitoring.xid_catalogue_data` is generated).

Each bucket becomes an ``action`` (lower case): the label on the Xid families and what splits the Xid
alerts into pages and warnings. ``unknown`` is a code the catalogue lacks (a newer driver's), ``unspecified``
a code it lists without a bucket.
"""

from __future__ import annotations

from vramwatch.monitoring.xid_catalogue_data import CATALOGUE

SOURCE_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
SOURCE_VERSION = "2025-10-29"

UNKNOWN = "unknown"

# action -> what the person on call does (alert text, runbook, the server's log line)
ADVICE: dict[str, str] = {
    "restart_app": "restart the application (the job, from its last checkpoint); the GPU needs nothing",
    "reset_gpu": "stop the GPU's processes and reset it (drain the node, nvidia-smi -r), then restart the job",
    "restart_bm": "drain the node and reboot it (restart bare metal), then restart the job",
    "restart_vm": "drain the node and restart the VM",
    "contact_support": "drain the node and contact NVIDIA support (attach nvidia-bug-report.sh output)",
    "workflow_xid_48": "double-bit ECC error: reset the GPU (drain the node, then reset; with Xid 63/64 the "
    "reset also retires the row); the process that held the memory was killed",
    "workflow_nvlink_err": "NVLink error: drain the node and reset the GPUs on the link; collectives over it hang",
    "workflow_nvlink5_err": "NVLink5 error, fatal or not by its details: follow the GPU's recovery action "
    "(gpu_recovery_action, Xid 154); restart the job if it stopped",
    "workflow_xid_45": "cleanup after another error: follow that Xid; alone (no other Xid on the GPU) restart "
    "Fabric Manager and the job",
    "xid_154": "the GPU's recovery action changed: do what gpu_recovery_action says",
    "check_mechanicals": "the board lacks auxiliary power: drain the node and check its power cables",
    "update_swfw": "update the driver / firmware (vGPU start error)",
    "check_uvm": "check the application's unified-memory use, then restart it",
    "ignore": "nothing (informational)",
    "unspecified": "the catalogue names no action for this code: read its entry and the driver's log",
    UNKNOWN: "a code NVIDIA's catalogue here lacks (a newer driver's?): look it up in the current catalogue",
}

# The split of the alerts: these actions page; the warned ones ticket; workflow_xid_45 warns only alone
# (a flood of Xid 45 follows another error, which alerts on its own); ignore never alerts.
PAGE_ACTIONS: tuple[str, ...] = (
    "reset_gpu",
    "restart_bm",
    "restart_vm",
    "contact_support",
    "workflow_xid_48",
    "workflow_nvlink_err",
)
WARN_ACTIONS: tuple[str, ...] = (
    "restart_app",
    "workflow_nvlink5_err",
    "xid_154",
    "check_mechanicals",
    "update_swfw",
    "check_uvm",
    "unspecified",
    UNKNOWN,
)
SOLO_ACTION = "workflow_xid_45"
SILENT_ACTIONS: tuple[str, ...] = ("ignore",)

ACTIONS: tuple[str, ...] = (*PAGE_ACTIONS, *WARN_ACTIONS, SOLO_ACTION, *SILENT_ACTIONS)

# NVML's GPU recovery action (nvmlDeviceGpuRecoveryAction_t, field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230):
# state -> what to do, in the order of the states' values; one series per state on gpu_recovery_action
RECOVERY_ADVICE: dict[str, str] = {
    "none": "nothing: new processes can use the GPU",
    "gpu_reset": "stop the GPU's processes and reset it (nvidia-smi -r)",
    "node_reboot": "drain the node and reboot it",
    "drain_p2p": "stop peer-to-peer traffic to the GPU (drain its jobs), then it recovers without a reset",
    "drain_and_reset": "drain the GPU's jobs, then reset it",
    "recover_imex_domain": "recover the IMEX domain (multi-node NVLink)",
    "bus_reset": "reset the GPU's PCIe bus",
    "system_reboot": "drain the node and reboot it",
}
RECOVERY_ACTIONS: tuple[str, ...] = tuple(RECOVERY_ADVICE)


def action(xid: int | str) -> str:
    """The action of an Xid code (``unknown`` for one the catalogue lacks or a label such as ``other``)."""
    try:
        code = int(xid)
    except (TypeError, ValueError):
        return UNKNOWN
    row = CATALOGUE.get(code)
    return row[2] if row else UNKNOWN


def meaning(xid: int) -> str:
    """The catalogue's short description of ``xid`` ("" when it lacks the code)."""
    row = CATALOGUE.get(int(xid))
    return row[1] if row else ""


def recovery_action(value: int) -> str:
    """NVML's recovery-action value as a state name; ValueError for one this table lacks."""
    if not 0 <= value < len(RECOVERY_ACTIONS):
        raise ValueError(f"unknown GPU recovery action {value}")
    return RECOVERY_ACTIONS[value]
