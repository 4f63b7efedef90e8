"""The spool: how ranks hand samples to the node's server without sharing its GIL.

The one boundary between the two processes. A rank publishes typed samples
(:mod:`.schema`) through :class:`RankPublisher`; the server reads them back with
:func:`read_samples`. Only this package knows the file names and their format
(:mod:`.files`) and whether they changed (:mod:`.changes`), the JSON encoding and its
version (:mod:`.codec`), and the server's NVML readings file the ranks' status lines read
(:mod:`.readings`).
"""

from __future__ import annotations

from vramwatch.spool.codec import SampleRejected, decode_sample, encode_sample
from vramwatch.spool.files import (
    SERVER_INFO,
    SERVER_LOCK,
    SERVER_LOG,
    ensure_dir,
    hold_lock,
    hold_spawn_lock,
    server_running,
    write_server_info,
)
from vramwatch.spool.publisher import RankPublisher
from vramwatch.spool.reader import (
    Rejected,
    SpoolRead,
    SpoolReader,
    any_rank_files,
    read_samples,
    read_spool,
)
from vramwatch.spool.readings import (
    GpuIdentity,
    GpuReadings,
    NodeReadings,
    read_gpu_identities,
    read_node,
    write_node_readings,
)
from vramwatch.spool.schema import (
    MEMORY_ROLES,
    SCHEMA_VERSION,
    AllocatorInfo,
    CollectorHealth,
    DeviceSample,
    HeartbeatSnapshot,
    OomSnapshot,
    RankSample,
    TrainingState,
)

__all__ = [
    "MEMORY_ROLES",
    "SCHEMA_VERSION",
    "SERVER_INFO",
    "SERVER_LOCK",
    "SERVER_LOG",
    "AllocatorInfo",
    "CollectorHealth",
    "DeviceSample",
    "GpuIdentity",
    "GpuReadings",
    "HeartbeatSnapshot",
    "NodeReadings",
    "OomSnapshot",
    "RankPublisher",
    "RankSample",
    "Rejected",
    "SpoolRead",
    "SpoolReader",
    "SampleRejected",
    "TrainingState",
    "any_rank_files",
    "decode_sample",
    "encode_sample",
    "ensure_dir",
    "hold_lock",
    "hold_spawn_lock",
    "read_gpu_identities",
    "read_node",
    "read_samples",
    "read_spool",
    "server_running",
    "write_node_readings",
    "write_server_info",
]
