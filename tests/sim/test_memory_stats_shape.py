"""The simulator's memory_stats() shape against torch's, per torch version.

A GPU-less CI cannot call the real ``torch.cuda.memory_stats()`` (it returns {} before CUDA is initialised,
and a CPU build has no CUDA allocator), so each torch version's key list is recorded in
tests/data/memory_stats_keys/ and checked three ways: the installed torch has a list (upgrading torch
without recording one fails here); the installed torch's documentation of ``memory_stats`` names exactly
the list's keys (a key torch adds or drops and documents fails here); and on a GPU
tests/gpu/test_gpu_memory_stats.py compares a live device's keys with the list of the torch there.
"""

from __future__ import annotations

import pytest
from memory_stats_keys import (
    documented_keys,
    fixed_keys,
    flatten_like_torch,
    recorded,
    recorded_versions,
    short_version,
)

from vramwatch.rank.allocator import COUNTER_KEYS, GAUGE_KEYS
from vramwatch.sim import SimAllocator, SimNode
from vramwatch.sim.allocator import DEFAULT_SHAPE, TORCH_SHAPES

torch = pytest.importorskip("torch")


def test_the_installed_torch_has_a_recorded_key_list():
    assert short_version(torch.__version__) in recorded_versions(), (
        f"torch {torch.__version__} has no tests/data/memory_stats_keys/torch-X.Y.txt: record its "
        "memory_stats() keys (tests/gpu/test_gpu_memory_stats.py prints them on a GPU)"
    )


def test_the_recorded_list_is_what_the_installed_torch_documents():
    doc = torch.cuda.memory_stats.__doc__ or ""
    want = recorded(torch.__version__)
    got = documented_keys(doc)
    assert got == want, f"documented only: {sorted(got - want)}; recorded only: {sorted(want - got)}"


def test_every_recorded_version_has_a_simulated_shape():
    assert set(recorded_versions()) == set(TORCH_SHAPES)
    assert DEFAULT_SHAPE == max(TORCH_SHAPES, key=lambda v: tuple(map(int, v.split("."))))


@pytest.mark.parametrize("version", TORCH_SHAPES)
def test_the_simulator_has_the_shape_of_each_torch(version):
    sim = SimAllocator(SimNode.default(1), visible="0", torch_version=version)
    sim.init(0)
    sim.allocate(1 << 30)
    flat = flatten_like_torch(sim.stats(0))
    assert fixed_keys(flat) == recorded(version)
    assert all(isinstance(v, int) for v in flat.values())


@pytest.mark.parametrize("version", recorded_versions())
def test_every_key_the_sampler_reads_is_in_every_torch(version):
    keys = recorded(version)
    for path in list(GAUGE_KEYS.values()) + list(COUNTER_KEYS.values()):
        assert ".".join(path) in keys, f"torch {version} has no {'.'.join(path)}"


def test_an_unknown_torch_shape_is_refused_by_name():
    with pytest.raises(ValueError, match="'1.0'"):
        SimAllocator(SimNode.default(1), visible="0", torch_version="1.0")
