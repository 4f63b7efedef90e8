"""Rank identity from the launcher's environment (torchrun, accelerate, DeepSpeed, SLURM, MPI)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# First variable present wins; torchrun/accelerate/DeepSpeed all set the torch names.
_RANK = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_LOCAL_RANK = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_WORLD_SIZE = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


@dataclass(frozen=True)
class RankIdentity:
    rank: int
    local_rank: int
    world_size: int


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is not None:
            try:
                return int(raw)
            except ValueError:
                continue
    return None


def identify(
    rank: int = -1, local_rank: int = -1, world_size: int = -1, env: Mapping[str, str] | None = None
) -> RankIdentity:
    """Explicit values (>= 0) win over the environment; a lone process is rank 0 of 1."""
    env = os.environ if env is None else env
    r = rank if rank >= 0 else _first_int(env, _RANK)
    lr = local_rank if local_rank >= 0 else _first_int(env, _LOCAL_RANK)
    ws = world_size if world_size >= 0 else _first_int(env, _WORLD_SIZE)
    r = 0 if r is None or r < 0 else r
    lr = r if lr is None or lr < 0 else lr
    ws = max(ws or 1, r + 1)
    return RankIdentity(r, lr, ws)
