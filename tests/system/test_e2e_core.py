"""End to end: simulated ranks -> spool -> `vramwatch serve` -> a real Prometheus."""

from __future__ import annotations

import os
import signal
import time

import pytest

from harness import http_get, wait_until

pytestmark = pytest.mark.e2e


def _ranks_in(exp) -> set[str]:
    m = exp.metrics()
    return {labels["rank"] for labels, _ in m.get("torch_cuda_memory_allocated_bytes", [])}


def test_prometheus_scrapes_two_ranks_through_one_target(exporter, prometheus, sim_rank):
    exp = exporter(gpus=2).start()
    [
        sim_rank(exp, r, "--duration", "60", "--fill-gib", str(4 + 4 * r), world_size=2, cuda_visible=str(r))
        for r in range(2)
    ]
    prom = prometheus([f"127.0.0.1:{exp.port}"])
    res = prom.wait_for("torch_cuda_memory_allocated_bytes", check=lambda r: len(r) == 2)
    by_rank = {r["metric"]["rank"]: r["metric"] for r in res}
    node = exp.node()
    for rank in ("0", "1"):
        m = by_rank[rank]
        assert m["local_rank"] == rank
        assert m["device"] == "0"  # each rank sees its one GPU as cuda:0 ...
        assert m["uuid"] == node.gpus[int(rank)].uuid  # ... joined to the physical GPU by UUID
        assert m["job"] == "vramwatch" and m["instance"] == f"127.0.0.1:{exp.port}"
    values = {r["metric"]["rank"]: float(r["value"][1]) for r in res}
    assert values["0"] >= 4 * 2**30 and values["1"] >= 8 * 2**30
    reserved = prom.wait_for("torch_cuda_memory_reserved_bytes", check=lambda r: len(r) == 2)
    assert all(float(r["value"][1]) >= values[r["metric"]["rank"]] for r in reserved)
    prom.wait_for('vramwatch_training_steps_total{rank="1"} > 5')
    prom.wait_for("torch_cuda_allocator_info", check=lambda r: len(r) == 2)
    frag = prom.query("torch_cuda_memory_fragmentation_ratio")
    assert all(0 <= float(r["value"][1]) < 1 for r in frag)


@pytest.mark.timing
def test_metrics_answer_while_a_rank_holds_the_gil(exporter, sim_rank):
    exp = exporter().start()
    sim_rank(exp, 0, "--duration", "40", "--wedge-after", "1", "--wedge-seconds", "20")
    wait_until(lambda: "0" in _ranks_in(exp), 15, "the rank's first sample")
    time.sleep(2.0)  # the rank is now inside libc sleep(), holding its GIL
    ages = []
    for _ in range(8):
        t0 = time.perf_counter()
        code, body = http_get(exp.url + "/metrics", timeout=2)
        elapsed = time.perf_counter() - t0
        assert code == 200
        assert elapsed < 0.1, f"/metrics took {elapsed * 1000:.0f} ms while the rank was wedged"
        from harness import parse_metrics

        m = parse_metrics(body.decode())
        ages.append(m["vramwatch_sample_age_seconds"][0][1])
        assert m["torch_cuda_memory_allocated_bytes"], "a wedged rank keeps its series"
        time.sleep(0.5)
    assert ages[-1] > ages[0] + 2.5, f"sample age should grow while wedged: {ages}"
    assert ages[-1] > 3


def test_killed_rank_series_vanish(exporter, prometheus, sim_rank):
    exp = exporter(gpus=2, dead_rank_grace_seconds=2).start()
    sim_rank(exp, 0, "--duration", "60", world_size=2, cuda_visible="0")
    r1 = sim_rank(exp, 1, "--duration", "60", world_size=2, cuda_visible="1")
    prom = prometheus([f"127.0.0.1:{exp.port}"], scrape_interval="1s")
    prom.wait_for("torch_cuda_memory_allocated_bytes", check=lambda r: len(r) == 2)
    os.kill(r1.pid, signal.SIGKILL)
    r1.wait(timeout=5)
    killed = time.monotonic()
    # its memory and liveness series are gone from the target at once ...
    wait_until(lambda: _ranks_in(exp) == {"0"}, 2.0, "rank 1 to vanish from /metrics")
    # ... its final counters after the grace window (2 s), and from Prometheus two scrape intervals later
    prom.wait_for('vramwatch_training_steps_total{rank="1"}', timeout=15, check=lambda r: not r)
    assert time.monotonic() - killed < 2 + 5
    assert prom.query('vramwatch_training_steps_total{rank="0"}')
    assert not [f for f in os.listdir(exp.spool) if f.startswith("rank-1-")], "dead rank's files reaped"


def test_landing_page_links_metrics(exporter):
    exp = exporter().start()
    code, body = http_get(exp.url + "/")
    assert code == 200 and b'href="/metrics"' in body
    assert http_get(exp.url + "/nope")[0] == 404


def test_a_dead_ranks_final_counters_are_served_for_the_grace_window_not_one_scrape(exporter, sim_rank):
    exp = exporter(dead_rank_grace_seconds=3).start()
    rank = sim_rank(exp, 0, "--duration", "60")
    wait_until(lambda: "0" in _ranks_in(exp), 15, "the rank's first sample")
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait(timeout=5)
    died = time.monotonic()

    def steps() -> list[float]:
        return [v for lab, v in exp.metrics().get("vramwatch_training_steps_total", []) if lab["rank"] == "0"]

    served = 0
    while time.monotonic() - died < 1.5:  # every scrape of the window carries them, however many there are
        assert len(steps()) == 1, "a dead rank's final counters, once per label set"
        served += 1
    assert served >= 3
    wait_until(lambda: steps() == [], 10, "the final counters to leave after the grace window")
