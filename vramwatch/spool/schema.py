"""What a rank publishes: one typed sample per interval, versioned.

The rank builds a :class:`RankSample`; the server reads one back per live rank. Both sides use
these types and nothing else: the JSON they travel as is :mod:`.codec`'s business alone.
Bump :data:`SCHEMA_VERSION` when a field changes meaning or a required one is added; a reader
rejects samples of any other version (logged and counted), so a job and a server of different
vramwatch versions never misread each other.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

SCHEMA_VERSION = 1  # optional fields (absent in older samples, ignored by older readers) keep the version

# A rank's job id (vramwatch.rank.identity) is a label value and part of its spool file names: at most
# this long, of these characters (a Kubernetes Job name, a SLURM id, a UUID and a host name all fit).
JOB_ID_MAX = 64
JOB_ID = re.compile(rf"[A-Za-z0-9_.-]{{1,{JOB_ID_MAX}}}")

# What the bytes of a watched model's device memory hold (vramwatch.watch): its parameters, their
# gradients, the optimizer's state, and the allocated rest (activations, autograd's saved tensors,
# workspaces, temporaries). The allocator's cache (reserved - allocated) is not a role.
MEMORY_ROLES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "other")

# How a rank ended (vramwatch_rank_exits_total's `reason`): killed = its process is gone with no final word.
EXIT_REASONS: tuple[str, ...] = ("finished", "exception", "oom", "signal", "killed")
# What the training thread waited for (vramwatch_training_wait_seconds_total's `kind`).
WAIT_KINDS: tuple[str, ...] = ("collective", "data")
# Declared non-training phases (vramwatch.phase(...)); any other name is published as `other`.
PHASES: tuple[str, ...] = ("eval", "save", "load", "compile", "other")
# The values counted when non-finite (vramwatch_training_nonfinite_total's `value`).
NONFINITE_VALUES: tuple[str, ...] = ("loss", "grad_norm")
# A bounded exit detail: an exception's class name or a signal's name (longer or other characters: "other").
EXIT_DETAIL = re.compile(r"[A-Za-z0-9_.]{0,64}")
NONFINITE_KINDS: tuple[str, ...] = ("nan", "inf", "-inf")  # how a non-finite loss / grad norm travels


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One CUDA device of the rank, as its allocator saw it."""

    device: int  # CUDA index inside the process
    uuid: str  # GPU-... or MIG-...: the join key with NVML's series
    values: Mapping[str, float]  # contract family name -> value
    roles: Mapping[str, float] = field(default_factory=dict)  # MEMORY_ROLES name -> bytes; empty: not watched


@dataclass(frozen=True, slots=True)
class AllocatorInfo:
    """The allocator settings in force (labels of ``torch_cuda_allocator_info``)."""

    backend: str
    expandable_segments: str
    garbage_collection_threshold: str
    max_split_size_mb: str

    def labels(self) -> tuple[str, str, str, str]:
        """The label values, in the contract's order."""
        return (self.backend, self.expandable_segments, self.garbage_collection_threshold, self.max_split_size_mb)


@dataclass(frozen=True, slots=True)
class HeartbeatSnapshot:
    """The job's steps: count, last step time, step-duration histogram, last loss and grad norm."""

    steps: int = 0
    last_step_time: float = 0.0
    buckets: tuple[float, ...] = ()  # upper bounds, +Inf left out
    counts: tuple[int, ...] = ()  # one per bucket, then the +Inf one
    sum: float = 0.0
    loss: float | None = None
    grad_norm: float | None = None
    tokens: float | None = None  # totals the job passed to step(tokens=, samples=); None: it passes none
    samples: float | None = None


@dataclass(frozen=True, slots=True)
class CollectorHealth:
    """Self-health of a collector that runs inside the rank (the allocator sampler)."""

    up: int
    errors: int
    duration: float


@dataclass(frozen=True, slots=True)
class OomSnapshot:
    """The newest memory snapshot the rank wrote after an OOM."""

    path: str
    time: float


@dataclass(frozen=True, slots=True)
class TrainingState:
    """What the rank says of its training beyond the heartbeat; every field optional (empty: not known)."""

    exit_reason: str = ""  # EXIT_REASONS but killed (the server's word for no final sample); "": not ended
    exit_detail: str = ""  # EXIT_DETAIL: the exception's class or the signal's name
    collectives: int | None = None  # the default process group's collective sequence number
    waits: Mapping[str, float] = field(default_factory=dict)  # WAIT_KINDS -> seconds
    phase: str = ""  # PHASES, "": training
    phase_start: float = 0.0  # unix seconds the phase began
    nonfinite: Mapping[str, int] = field(default_factory=dict)  # NONFINITE_VALUES -> count
    loss: str = ""  # NONFINITE_KINDS: the newest loss read as such (the heartbeat's loss is then None)
    grad_norm: str = ""

    def __bool__(self) -> bool:
        return self != _NO_TRAINING_STATE


_NO_TRAINING_STATE = TrainingState()


@dataclass(frozen=True, slots=True)
class RankSample:
    """One rank's state at ``time``."""

    rank: int
    local_rank: int
    world_size: int
    hostname: str
    pid: int
    time: float  # unix seconds when it was taken
    devices: tuple[DeviceSample, ...] = ()
    allocator_info: AllocatorInfo | None = None
    heartbeat: HeartbeatSnapshot = HeartbeatSnapshot()
    collectors: Mapping[str, CollectorHealth] = field(default_factory=dict)
    oom_snapshot: OomSnapshot | None = None
    flops_per_token: float | None = None  # the model's, as vramwatch.watch() was told; None: not told
    job_id: str = ""  # the job the rank belongs to (rank.identity); "": a rank of a version before it

    training: TrainingState | None = None  # how it ended, collectives, waits, phase, non-finite values

    def age(self, now: float) -> float:
        return max(0.0, now - self.time)
