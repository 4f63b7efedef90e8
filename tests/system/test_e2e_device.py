"""End to end: simulated GPUs -> the server's NVML collector, Xid watcher and process counter -> Prometheus."""

from __future__ import annotations

import pytest

from harness import wait_until
from vramwatch.monitoring import contract
from vramwatch.sim.state import edit

pytestmark = pytest.mark.e2e
GIB = 1 << 30


def _one(result: list) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def test_device_series_join_the_ranks_and_follow_the_simulated_gpu(exporter, prometheus, sim_rank):
    exp = exporter(gpus=2, nvml_slow_interval=1).start()
    [
        sim_rank(exp, r, "--duration", "90", "--fill-gib", str(4 + 4 * r), world_size=2, cuda_visible=str(r))
        for r in range(2)
    ]
    prom = prometheus([f"127.0.0.1:{exp.port}"])
    node = exp.node()
    # the join of the allocator and the device series, by uuid
    joined = prom.wait_for(
        "torch_cuda_memory_reserved_bytes * on(uuid) group_left(name) gpu_info", check=lambda r: len(r) == 2
    )
    by_rank = {r["metric"]["rank"]: r for r in joined}
    for rank in ("0", "1"):
        m = by_rank[rank]["metric"]
        assert m["name"] == node.gpu(int(rank)).name and m["uuid"] == node.gpu(int(rank)).uuid
        assert float(by_rank[rank]["value"][1]) >= (4 + 4 * int(rank)) * GIB
    # every device family the simulated GPU can fill is there (the Xid timestamp comes with an event)
    expected = [
        m.name
        for m in contract.METRICS
        if m.collector in ("nvml", "processes", "xid")
        and m.name != "gpu_last_xid_timestamp_seconds"
        and not m.name.startswith("gpu_mig_")  # a card in MIG mode only: tests/system/test_e2e_mig.py
    ]
    for name in expected:
        prom.wait_for(f"count({name}) > 0", timeout=10)
    assert {r["metric"]["mig_mode"] for r in prom.query("gpu_info")} == {"disabled"}
    # what is on the card besides the ranks' caches: one CUDA context each
    prom.wait_for(
        'gpu_non_torch_memory_bytes{gpu="0"}',
        check=lambda r: r and abs(float(r[0]["value"][1]) - node.context_bytes) < 64 << 20,
    )
    assert _one(prom.query('gpu_foreign_processes{gpu="0"}')) == 0
    # the Xid counters start at 0, scraped before the event, so increase() sees the first one
    prom.wait_for('gpu_xid_errors_total{xid="79"} == 0', check=lambda r: len(r) == 2)

    with edit(exp.spool) as n:
        g = n.gpu(1)
        g.power_w, g.utilization, g.throttle_mask = 95.0, 1.0, 0x4
        n.add_foreign(0, 4242, 6 * GIB)
        n.inject_xid(1, 79)
    prom.wait_for('gpu_power_watts{gpu="1"} == 95')
    prom.wait_for('gpu_utilization_ratio{gpu="1"} == 1')
    prom.wait_for('gpu_clock_throttle{gpu="1",reason="sw_power_cap"} == 1')
    assert _one(prom.query('gpu_clock_throttle{gpu="1",reason="hw_slowdown"}')) == 0
    prom.wait_for('gpu_foreign_processes{gpu="0"} == 1')
    assert _one(prom.query('gpu_foreign_process_memory_bytes{gpu="0"}')) == 6 * GIB
    prom.wait_for('increase(gpu_xid_errors_total{gpu="1",xid="79"}[1m]) > 0')
    assert prom.query('gpu_last_xid_timestamp_seconds{gpu="1",xid="79"}')
    assert _one(prom.query('gpu_xid_errors_total{gpu="0",xid="79"}')) == 0

    # the card falls off the bus: gpu_up 0 for it, collector up 0, allocator series go on
    with edit(exp.spool) as n:
        n.gpu(0).lost = True
    prom.wait_for('gpu_up{gpu="0"} == 0')
    prom.wait_for('vramwatch_collector_up{collector="nvml"} == 0')
    assert _one(prom.query('gpu_up{gpu="1"}')) == 1
    assert not prom.query('gpu_power_watts{gpu="0"}')  # no stale readings for a lost GPU
    prom.wait_for('increase(gpu_xid_errors_total{gpu="0",xid="79"}[1m]) > 0')  # GPU_IS_LOST counts as 79
    assert len(prom.query("torch_cuda_memory_reserved_bytes")) == 2
    prom.wait_for('increase(vramwatch_collector_errors_total{collector="nvml"}[1m]) > 0')


def test_a_node_without_nvml_serves_says_why_and_finds_the_driver_later(exporter, sim_rank):
    exp = exporter()
    node = exp.node()
    node.nvml_absent = "library_not_found"
    exp.save_node(node)
    exp.start()
    sim_rank(exp, 0, "--duration", "60")

    def absent():
        m = exp.metrics()
        return m if m.get("torch_cuda_memory_reserved_bytes") and m.get("vramwatch_nvml_available") else None

    m = wait_until(absent, 15, "allocator series and the NVML state")
    assert m["vramwatch_nvml_available"] == [({"reason": "library_not_found"}, 0.0)]
    up = {lab["collector"]: v for lab, v in m["vramwatch_collector_up"]}
    assert up["nvml"] == 1 and up["xid"] == 1 and up["processes"] == 1 and up["spool"] == 1  # a state, no fault
    assert not m.get("gpu_info") and not m.get("gpu_up")  # no device series
    with edit(exp.spool) as n:
        n.nvml_absent = ""  # the driver arrives: init is retried with back-off
    wait_until(lambda: exp.metrics().get("gpu_up", [({}, 0)])[0][1] == 1.0, 30, "NVML to come up")
    m = exp.metrics()
    assert {lab["collector"]: v for lab, v in m["vramwatch_collector_up"]}["nvml"] == 1
    assert m["vramwatch_nvml_available"] == [({"reason": ""}, 1.0)]
    assert m["gpu_non_torch_memory_bytes"]
