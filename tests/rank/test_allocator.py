from __future__ import annotations

import types

import pytest

from vramwatch.rank.allocator import (
    AllocatorSampler,
    TorchSource,
    alloc_conf,
    segment_summary,
)
from vramwatch.sim import SimAllocator, SimNode, SimOutOfMemoryError

GIB = 1 << 30


def _values(sampler, dev=0):
    (d,) = [x for x in sampler.read() if x.device == dev]
    return d.values


def test_sampler_reads_nothing_before_init_and_labels_by_uuid():
    node = SimNode.default(2)
    sim = SimAllocator(node, visible="1")
    sampler = AllocatorSampler(sim, largest_block_interval=0)
    assert sampler.read() == []  # no device initialised: nothing read, nothing published
    sim.init(0)
    (d,) = sampler.read()
    assert d.device == 0 and d.uuid == node.gpus[1].uuid  # cuda:0 is physical GPU 1


def test_values_fragmentation_and_limits():
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    sim.set_memory_fraction(0.5)
    sim.allocate(4 * GIB)
    sim.allocate(2 * GIB)
    sim.fragment(1 * GIB)
    sampler = AllocatorSampler(sim, largest_block_interval=1)
    v = _values(sampler)
    reserved, allocated = v["torch_cuda_memory_reserved_bytes"], v["torch_cuda_memory_allocated_bytes"]
    assert allocated == 5 * GIB
    assert reserved >= 6 * GIB
    assert v["torch_cuda_memory_fragmentation_ratio"] == pytest.approx((reserved - allocated) / reserved)
    assert v["torch_cuda_memory_inactive_split_bytes"] == 1 * GIB
    assert v["torch_cuda_memory_limit_bytes"] == pytest.approx(0.5 * sim.node.gpus[0].total_bytes, rel=1e-9)
    # the only free block is the 1 GiB split piece; the 5 GiB in use is larger and must not count
    assert v["torch_cuda_memory_largest_free_block_bytes"] == 1 * GIB
    sim.set_memory_fraction(0.25)
    assert _values(sampler)["torch_cuda_memory_limit_bytes"] == pytest.approx(0.25 * sim.node.gpus[0].total_bytes)


def test_active_bytes_count_blocks_awaiting_another_stream():
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    sim.allocate(4 * GIB)
    sim.free_pending(1 * GIB)  # record_stream: freed by the job, still in use on a side stream
    sampler = AllocatorSampler(sim, largest_block_interval=0)
    v = _values(sampler)
    assert v["torch_cuda_memory_allocated_bytes"] == 3 * GIB
    assert v["torch_cuda_memory_active_bytes"] == 4 * GIB
    sim.process_events()
    v = _values(sampler)
    assert v["torch_cuda_memory_active_bytes"] == v["torch_cuda_memory_allocated_bytes"] == 3 * GIB


def test_largest_free_block_counts_only_inactive_blocks():
    segments = [
        {"device": 0, "blocks": [{"size": 8 * GIB, "state": "active_allocated"}, {"size": GIB, "state": "inactive"}]},
        {"device": 0, "blocks": [{"size": 6 * GIB, "state": "active_pending_free"}]},  # in use until its stream syncs
        {"device": 0, "blocks": [{"size": 3 * GIB, "state": "inactive"}]},
        {"device": 1, "blocks": [{"size": 2 * GIB, "state": "active_allocated"}]},
    ]
    assert segment_summary(segments) == {
        0: {"segments": 3, "largest_free": 3 * GIB},
        1: {"segments": 1, "largest_free": 0},
    }


def test_largest_free_block_is_not_a_pending_block():
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    sim.allocate(4 * GIB)
    sim.free_pending(3 * GIB)  # 3 GiB active but not allocated: not reusable yet
    v = _values(AllocatorSampler(sim, largest_block_interval=1))
    assert v["torch_cuda_memory_largest_free_block_bytes"] == 0
    sim.process_events()
    v = _values(AllocatorSampler(sim, largest_block_interval=1))
    assert v["torch_cuda_memory_largest_free_block_bytes"] == 3 * GIB


def test_retry_then_oom_counted_and_observed():
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    sim.set_memory_fraction(8 * GIB / sim.node.gpus[0].total_bytes)
    seen = []
    sim.oom_observers.append(lambda *a: seen.append(a))
    sim.allocate(6 * GIB)
    sim.free(6 * GIB)  # cached, not released
    sim.allocate(1 * GIB)
    sim.fragment(1 * GIB)  # a piece that cannot be released
    sim.allocate(7 * GIB)  # fits only after flushing the cache: one retry
    v = _values(AllocatorSampler(sim, 0))
    assert v["torch_cuda_memory_alloc_retries_total"] == 1
    with pytest.raises(SimOutOfMemoryError):
        sim.allocate(4 * GIB)
    v = _values(AllocatorSampler(sim, 0))
    assert v["torch_cuda_memory_ooms_total"] == 1
    assert v["torch_cuda_memory_alloc_retries_total"] == 2
    assert seen and seen[0][0] == 0 and seen[0][1] == 4 * GIB


def test_window_peak_follows_a_leak_without_resetting_peaks():
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    sampler = AllocatorSampler(sim, 0)
    peaks = []
    for step in range(5):
        sim.allocate((1 + step) * GIB)  # each step leaks a little more ...
        sim.allocate(2 * GIB)  # ... and holds activations briefly
        sim.free(2 * GIB)
        peaks.append(_values(sampler)["torch_cuda_memory_step_peak_allocated_bytes"])
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]
    # the job's own peak is untouched: it equals the true maximum
    assert sim.stats(0)["allocated_bytes"]["all"]["peak"] == (15 + 2) * GIB


def test_cuda_malloc_async_reports_only_what_it_has():
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.backend_name = "cudaMallocAsync"
    sim.init(0)
    sim.allocate(GIB)
    v = _values(AllocatorSampler(sim, largest_block_interval=1))
    assert "torch_cuda_memory_alloc_retries_total" not in v  # always zero there: not a reading
    assert "torch_cuda_memory_largest_free_block_bytes" not in v  # no snapshot under that backend
    assert v["torch_cuda_memory_allocated_bytes"] == GIB


def test_alloc_conf_labels_are_bounded():
    labels = alloc_conf(
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,garbage_collection_threshold:0.8,max_split_size_mb:128"}
    )
    assert labels == {"expandable_segments": "true", "garbage_collection_threshold": "0.8", "max_split_size_mb": "128"}
    assert alloc_conf({"PYTORCH_ALLOC_CONF": "max_split_size_mb:" + "9" * 100})["max_split_size_mb"] == "9" * 16
    assert alloc_conf({})["expandable_segments"] == "false"


class _FakeTorch:
    """Records every torch call the source makes, to prove what it never calls."""

    def __init__(self, initialized: bool, contexts: set[int]):
        calls = self.calls = []
        ctx = contexts

        class cuda:
            @staticmethod
            def is_initialized():
                calls.append("is_initialized")
                return initialized

            @staticmethod
            def device_count():
                calls.append("device_count")
                return 2

            @staticmethod
            def get_device_properties(i):
                calls.append(f"props{i}")
                return types.SimpleNamespace(uuid="abc-123", total_memory=100)

            @staticmethod
            def mem_get_info(*a):  # creates a context: must never be called
                raise AssertionError("mem_get_info called")

            @staticmethod
            def get_allocator_backend():
                return "native"

        class _C:
            @staticmethod
            def _cuda_hasPrimaryContext(i):
                calls.append(f"hasctx{i}")
                return i in ctx

            @staticmethod
            def _cuda_memoryStats(i):
                calls.append(f"stats{i}")
                return {"allocated_bytes": {"all": {"current": 7, "peak": 9}}}

            @staticmethod
            def _cuda_getMemoryFraction(i):
                return 0.5

        self.cuda, self._C = cuda, _C


def test_torch_source_reads_nothing_until_cuda_is_initialised():
    src = TorchSource()
    src._torch = _FakeTorch(initialized=False, contexts={0})
    assert src.devices() == []
    assert src._torch.calls == ["is_initialized"]


def test_torch_source_reads_only_devices_with_a_context():
    fake = _FakeTorch(initialized=True, contexts={1})
    src = TorchSource()
    src._torch = fake
    assert src.devices() == [1]
    (d,) = AllocatorSampler(src, 0).read()
    assert d.device == 1 and d.uuid == "GPU-abc-123"
    assert d.values["torch_cuda_memory_limit_bytes"] == 50
    assert "stats0" not in fake.calls and "props0" not in fake.calls


def test_torch_source_never_imports_torch(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    src = TorchSource()
    assert src.devices() == []
    assert "torch" not in sys.modules


def test_snapshot_cost_is_bounded(monkeypatch):
    import vramwatch.rank.allocator as alloc

    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    calls = []
    real = sim.snapshot

    def slow_snapshot():
        calls.append(1)
        return real()

    sim.snapshot = slow_snapshot
    clock = iter([0.0, 0.5])  # perf_counter before/after: a 0.5 s snapshot
    monkeypatch.setattr(alloc.time, "perf_counter", lambda: next(clock, 1.0))
    sampler = AllocatorSampler(sim, largest_block_interval=30)
    sampler.read(now=0.0)
    sampler.read(now=100.0)  # past the 30 s interval, but a 0.5 s snapshot may run only every 5000 s
    assert len(calls) == 1
    sampler.read(now=5001.0)
    assert len(calls) == 2


def _nested(flat: dict[str, int]) -> dict:
    """A memory_stats() key list, nested back as torch._C._cuda_memoryStats returns it."""
    out: dict = {}
    for key, v in flat.items():
        *path, leaf = key.split(".")
        node = out
        for k in path:
            node = node.setdefault(k, {})
        node[leaf] = v
    return out


@pytest.mark.parametrize("version", __import__("memory_stats_keys").recorded_versions())
def test_each_value_is_its_flat_key_in_each_recorded_torch(version):
    # the sampler reads the nested dict; torch's flat memory_stats() keys name the same numbers
    from memory_stats_keys import recorded

    from vramwatch.rank.allocator import COUNTER_KEYS, GAUGE_KEYS, _read_values

    flat = {k: 1000 + i for i, k in enumerate(sorted(recorded(version)))}
    values = _read_values(_nested(flat))
    want = {name: float(flat[".".join(path)]) for name, path in (GAUGE_KEYS | COUNTER_KEYS).items()}
    assert values == want and list(values) == list(want)
    # a stat this torch lacks (or reports as None) is left out, not zero
    del flat["requested_bytes.all.current"]
    nested = _nested(flat)
    nested["num_ooms"] = None
    got = _read_values(nested)
    assert "torch_cuda_memory_requested_bytes" not in got and "torch_cuda_memory_ooms_total" not in got


@pytest.mark.parametrize("private", [True, False])
def test_torch_source_reads_the_nested_stats_with_or_without_the_private_getter(private):
    fake = _FakeTorch(initialized=True, contexts={0})
    public_calls = []

    def nested_dict(device):
        public_calls.append(device)
        return {"allocated_bytes": {"all": {"current": 7, "peak": 9}}}

    fake.cuda.memory_stats_as_nested_dict = staticmethod(nested_dict)
    if not private:  # a torch without torch._C._cuda_memoryStats: the public function, same dict
        del fake._C._cuda_memoryStats
    src = TorchSource()
    src._torch = fake
    (d,) = AllocatorSampler(src, 0).read()
    assert d.values["torch_cuda_memory_allocated_bytes"] == 7.0
    assert d.values["torch_cuda_memory_peak_allocated_bytes"] == 9.0
    assert ("stats0" in fake.calls) is private and bool(public_calls) is not private


def test_torch_source_asks_only_about_devices_without_a_context(monkeypatch):
    import vramwatch.rank.allocator as alloc

    now = [100.0]
    monkeypatch.setattr(alloc.time, "monotonic", lambda: now[0])
    contexts: set[int] = set()
    fake = _FakeTorch(initialized=True, contexts=contexts)
    src = TorchSource()
    src._torch = fake

    def asked():
        n = [c for c in fake.calls if c.startswith("hasctx")]
        fake.calls.clear()
        return n

    assert src.devices() == [] and asked() == ["hasctx0", "hasctx1"]
    assert src.devices() == [] and asked() == ["hasctx0", "hasctx1"]  # none yet: every sample
    contexts.add(0)
    assert src.devices() == [0] and asked() == ["hasctx0", "hasctx1"]
    contexts.add(1)
    assert src.devices() == [0] and asked() == []  # device 0 keeps its context; 1 is asked about later
    now[0] += alloc.DEVICE_PROBE_GAP
    assert src.devices() == [0, 1] and asked() == ["hasctx1"]
    now[0] += 100
    assert src.devices() == [0, 1] and asked() == []  # all found: never asked again


def test_the_largest_free_block_carries_the_time_of_its_snapshot(monkeypatch):
    """Between snapshots (spaced by cost) the figure repeats; its timestamp says how old it is."""
    sim = SimAllocator(SimNode.default(1), visible="0")
    sim.init(0)
    sim.allocate(2 * GIB)
    sim.fragment(1 * GIB)
    clock = [1_800_000_000.0]
    monkeypatch.setattr("vramwatch.rank.allocator.time.time", lambda: clock[0])
    sampler = AllocatorSampler(sim, largest_block_interval=30)
    v = sampler.read(now=100.0)[0].values
    assert v["torch_cuda_memory_largest_free_block_timestamp_seconds"] == 1_800_000_000.0
    clock[0] += 20
    v = sampler.read(now=120.0)[0].values  # no snapshot yet: the same figure, the same (older) time
    assert v["torch_cuda_memory_largest_free_block_timestamp_seconds"] == 1_800_000_000.0
    clock[0] += 20
    v = sampler.read(now=140.0)[0].values  # due: a new snapshot, a new time
    assert v["torch_cuda_memory_largest_free_block_timestamp_seconds"] == 1_800_000_040.0
