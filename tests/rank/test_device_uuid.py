"""The uuid a rank labels its series with: NVML's spelling, MIG instances included."""

from __future__ import annotations

import types

import pytest

from vramwatch.rank.allocator import AllocatorSampler, TorchSource
from vramwatch.rank.device_uuid import device_uuid, mig_entry
from vramwatch.sim.allocator import SimAllocator
from vramwatch.sim.state import SimNode

BARE = "5fda456a-1b2c-4d5e-8f90-0123456789ab"
MIG = "MIG-a65afc88-50b5-5ccf-b0a8-f93b3247ae9e"  # the form nvidia-smi -L prints (NVIDIA/go-dcgm#30)


@pytest.mark.parametrize(
    ("raw", "name", "device", "cvd", "expected"),
    [
        (BARE, "NVIDIA H200", 0, None, "GPU-" + BARE),  # torch's bare uuid (measured on an H200)
        (BARE, "NVIDIA H200", 1, "0,1", "GPU-" + BARE),
        ("GPU-" + BARE, "NVIDIA H200", 0, None, "GPU-" + BARE),
        (BARE, "NVIDIA H100 80GB HBM3 MIG 1g.10gb", 0, None, "MIG-" + BARE),  # a MIG device by its name
        (BARE, "NVIDIA H100 80GB HBM3 MIG 1g.10gb", 0, MIG, MIG),  # CUDA_VISIBLE_DEVICES names it: surest
        (BARE, "NVIDIA H200", 0, MIG, MIG),  # whatever torch says about the bytes
        (BARE, "NVIDIA H200", 0, f" {MIG} ,{MIG[:-1]}0", MIG),  # the first MIG entry is the one enumerated
        # the legacy MIG-GPU-<uuid>/<gi>/<ci> form is no uuid: the name decides
        (BARE, "NVIDIA A100-SXM4-40GB MIG 1g.5gb", 0, "MIG-GPU-" + BARE + "/1/0", "MIG-" + BARE),
        (BARE, "NVIDIA H200", 0, "MIG-a65a", "GPU-" + BARE),  # a prefix is no uuid either
    ],
)
def test_device_uuid(raw, name, device, cvd, expected):
    assert device_uuid(raw, name, device, cvd) == expected


def test_a_container_with_one_mig_device_named_by_nvidia_visible_devices():
    other = "MIG-00000000-50b5-5ccf-b0a8-f93b3247ae9e"
    mig_name = "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    assert device_uuid(BARE, mig_name, 0, None, MIG) == MIG
    assert device_uuid(BARE, mig_name, 0, None, f"{MIG},{other}") == "MIG-" + BARE  # which one is device 0?
    assert device_uuid(BARE, mig_name, 0, "0", MIG) == "MIG-" + BARE  # CUDA_VISIBLE_DEVICES rules
    assert device_uuid(BARE, "NVIDIA H200", 0, None, MIG) == "GPU-" + BARE  # no container runtime applied it
    assert device_uuid(BARE, mig_name, 0, None, "all") == "MIG-" + BARE


def test_mig_entry():
    assert mig_entry(None) == "" and mig_entry("") == "" and mig_entry("0,1") == ""
    assert mig_entry("GPU-" + BARE) == ""
    assert mig_entry(MIG) == MIG


def test_torch_source_on_a_mig_instance_labels_with_the_instance_uuid(monkeypatch):
    class cuda:
        @staticmethod
        def get_device_properties(i):
            return types.SimpleNamespace(uuid=BARE, name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", total_memory=10)

    src = TorchSource()
    src._torch = types.SimpleNamespace(cuda=cuda)  # type: ignore[assignment]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG)
    assert src.uuid(0) == MIG
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert src.uuid(0) == "MIG-" + BARE


def test_a_simulated_rank_on_a_mig_instance_sees_that_instance():
    node = SimNode.default(2)
    a, b = node.gpu(1).enable_mig(("3g.71gb", "4g.71gb"))
    sim = SimAllocator(node, visible=b.uuid)
    sim.init(0)
    sim.allocate(1 << 30, 0)
    (d,) = AllocatorSampler(sim, 0).read()
    assert d.uuid == b.uuid
    assert d.values["torch_cuda_memory_limit_bytes"] == b.total_bytes  # the instance's memory, as torch says
    assert SimAllocator(node, visible="1").uuid(0) == node.gpu(1).uuid  # the whole card, by index
    with pytest.raises(ValueError):
        SimAllocator(node, visible=b.uuid)._dev(1)  # one instance is enumerated, no more
    assert SimAllocator(node, visible="MIG-ffffffff-0000-0000-0000-000000000000").physical == []
