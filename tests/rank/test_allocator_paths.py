"""The allocator's edges: the settings labels, snapshot summaries, and TorchSource against a fake torch
(which torch calls it makes, what it reads when a private getter is missing, what it tells the user)."""

from __future__ import annotations

import sys
import types

import pytest

from vramwatch.rank.allocator import (
    AllocatorInfo,
    AllocatorSampler,
    ObserverUnavailable,
    TorchSource,
    alloc_conf,
    segment_summary,
)
from vramwatch.sim import SimAllocator, SimNode

MIG = "MIG-11111111-2222-3333-4444-555555555555"


class _Torch:
    """A fake torch module: per-device properties, a record of every call, private getters removable."""

    def __init__(self, initialized=True, contexts=(0, 1), backend="native", private=("ctx", "stats", "fraction")):
        self.calls: list = []
        self.initialized = initialized
        self.props = {
            0: types.SimpleNamespace(uuid="aaa", name="NVIDIA H200", total_memory=1000),
            1: types.SimpleNamespace(uuid="bbb", name="NVIDIA H200", total_memory=2000),
        }
        calls, me = self.calls, self
        memory = types.SimpleNamespace(
            _snapshot=lambda: {"segments": ["snap"]},
            _record_memory_history=lambda **kw: calls.append(("history", kw)),
        )

        def memory_snapshot(**kw):
            calls.append(("memory_snapshot", kw))
            return [{"device": 0}]

        self.cuda = types.SimpleNamespace(
            is_initialized=lambda: calls.append("is_initialized") or me.initialized,
            device_count=lambda: 2,
            get_device_properties=lambda i: calls.append(("props", i)) or me.props[i],
            get_allocator_backend=lambda: backend,
            memory_stats_as_nested_dict=lambda i: {"allocated_bytes": {"all": {"current": 1 + i}}},
            memory_snapshot=memory_snapshot,
            empty_cache=lambda: calls.append("empty_cache"),
            memory=memory,
        )
        c = types.SimpleNamespace(_cuda_attach_out_of_memory_observer=lambda obs: calls.append(("attach", obs)))
        if "ctx" in private:
            c._cuda_hasPrimaryContext = lambda i: i in contexts
        if "stats" in private:
            c._cuda_memoryStats = lambda i: (
                calls.append(("stats", i)) or {"allocated_bytes": {"all": {"current": 10 + i}}}
            )
        if "fraction" in private:
            c._cuda_getMemoryFraction = lambda i: {0: 0.5, 1: 0.25}[i]
        self._C = c


@pytest.fixture
def torch_mod(monkeypatch):
    """Installs a fake torch in sys.modules (where the source looks for it); returns a factory."""

    def install(**kw):
        fake = _Torch(**kw)
        monkeypatch.setitem(sys.modules, "torch", fake)
        return fake

    return install


# --- alloc_conf and segment_summary ---


def test_a_setting_value_holding_a_colon_is_kept_whole():
    conf = alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:1:2,garbage_collection_threshold:0.6"})
    assert conf["max_split_size_mb"] == "1:2" and conf["garbage_collection_threshold"] == "0.6"


def test_expandable_segments_accepts_1_and_unset_settings_are_empty():
    assert alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:1"})["expandable_segments"] == "true"
    assert alloc_conf({}) == {
        "expandable_segments": "false",
        "garbage_collection_threshold": "",
        "max_split_size_mb": "",
    }


def test_segment_summary_reads_missing_fields_as_device_0_no_blocks_size_0():
    out = segment_summary([{"blocks": [{"state": "inactive"}]}, {"device": 1}])
    assert out == {0: {"segments": 1, "largest_free": 0}, 1: {"segments": 1, "largest_free": 0}}


# --- AllocatorSampler.info ---


def test_info_names_the_backend_once_it_is_known():
    sim = SimAllocator(SimNode.default(1), visible="0")
    sampler = AllocatorSampler(sim, 0)
    before = sampler.info()
    assert isinstance(before, AllocatorInfo) and before.backend == "unknown"
    sim.init(0)
    sampler.read()
    assert sampler.info().backend == "native"
    assert sampler.info() is sampler.info()  # built once per backend


# --- TorchSource ---


def test_torch_imported_after_the_source_was_made_is_found(monkeypatch, torch_mod):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    src = TorchSource()
    assert src.devices() == []
    torch_mod(contexts=(0,))
    assert src.devices() == [0]


def test_cuda_initialisation_is_asked_about_once(torch_mod):
    fake = torch_mod(contexts=(0,))
    src = TorchSource()
    for _ in range(3):
        assert src.devices() == [0]
    assert fake.calls.count("is_initialized") == 1


def test_a_torch_without_the_private_context_getter_reports_no_devices(torch_mod):
    torch_mod(private=("stats", "fraction"))
    assert TorchSource().devices() == []


def test_a_torch_without_the_private_fraction_getter_reports_the_whole_device(torch_mod):
    torch_mod(private=("ctx", "stats"))
    src = TorchSource()
    assert src.devices() == [0, 1]
    assert (src.limit_bytes(0), src.limit_bytes(1)) == (1000, 2000)


def test_limit_is_each_devices_total_times_its_fraction_and_the_total_is_read_once(torch_mod):
    fake = torch_mod()
    src = TorchSource()
    # called before devices(): the source binds torch's getters itself
    assert src.limit_bytes(1) == 500
    assert src.limit_bytes(0) == 500
    assert src.limit_bytes(1) == 500 and src.limit_bytes(0) == 500
    assert [c for c in fake.calls if c[0] == "props"] == [("props", 1), ("props", 0)]


def test_stats_before_devices_binds_the_getter(torch_mod):
    fake = torch_mod()
    src = TorchSource()
    assert src.stats(1) == {"allocated_bytes": {"all": {"current": 11}}}
    assert src.stats(0) == {"allocated_bytes": {"all": {"current": 10}}}
    assert [c for c in fake.calls if c[0] == "stats"] == [("stats", 1), ("stats", 0)]


def test_uuid_is_the_asked_devices(monkeypatch, torch_mod):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    torch_mod()
    src = TorchSource()
    assert (src.uuid(0), src.uuid(1)) == ("GPU-aaa", "GPU-bbb")


def test_uuid_of_properties_without_a_uuid_is_the_bare_prefix(monkeypatch, torch_mod):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = torch_mod()
    fake.props[0] = types.SimpleNamespace(total_memory=1000)  # no uuid, no name
    assert TorchSource().uuid(0) == "GPU-"


def test_uuid_of_a_mig_device_in_a_container_is_the_containers_mig_uuid(monkeypatch, torch_mod):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", MIG)
    fake = torch_mod()
    fake.props[0] = types.SimpleNamespace(uuid="ccc", name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", total_memory=1)
    assert TorchSource().uuid(0) == MIG


def test_snapshot_asks_for_no_traces_and_falls_back_on_an_old_torch(torch_mod):
    fake = torch_mod()
    src = TorchSource()
    assert src.snapshot() == [{"device": 0}]
    assert ("memory_snapshot", {"include_traces": False}) in fake.calls

    def old(**kw):
        if kw:
            raise TypeError("unexpected keyword argument 'include_traces'")
        return [{"device": 1}]

    fake.cuda.memory_snapshot = old
    assert src.snapshot() == [{"device": 1}]


def test_memory_snapshot_is_torchs(torch_mod):
    torch_mod()
    assert TorchSource().memory_snapshot() == {"segments": ["snap"]}


def test_record_memory_history_of_one_entry_records(torch_mod):
    fake = torch_mod()
    src = TorchSource()
    src.record_memory_history(1)
    src.record_memory_history(0)
    assert [c[1] for c in fake.calls if c[0] == "history"] == [
        {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 1},
        {"enabled": None},
    ]


def test_release_cache_empties_only_an_initialised_torchs_cache(monkeypatch, torch_mod):
    fake = torch_mod()
    src = TorchSource()
    src.release_cache((0,))
    assert fake.calls.count("empty_cache") == 1
    fake.initialized = False
    src.release_cache((0,))
    assert fake.calls.count("empty_cache") == 1
    monkeypatch.delitem(sys.modules, "torch")
    src.release_cache((0,))  # no torch: nothing, no error


def test_observer_unavailable_says_why(torch_mod):
    torch_mod(backend="cudaMallocAsync")
    with pytest.raises(ObserverUnavailable) as e:
        TorchSource().attach_oom_observer(lambda *a: None)
    assert str(e.value) == "allocator backend is not native"  # the user reads it in the log line

    fake = torch_mod()
    del fake._C._cuda_attach_out_of_memory_observer
    with pytest.raises(ObserverUnavailable) as e:
        TorchSource().attach_oom_observer(lambda *a: None)
    assert str(e.value).startswith("no OOM observer in this torch (AttributeError(")
    assert "_cuda_attach_out_of_memory_observer" in str(e.value)
