"""Soak: 8 simulated ranks, one server, scraped from a few threads at ~30 scrapes/s (Prometheus: 1 per 15 s).

Bounded (about 80 s, loopback only). Asserts zero failed scrapes, the latency p99, and that the server's RSS,
file descriptors and threads stay flat. The figures go to a temporary file, and to
``benchmarks/results/soak.json`` with ``VRAMWATCH_RECORD_BENCHMARKS=1`` (see benchmarks/SOAK.md).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from harness import ROOT, start_sim_rank, stop_proc, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

RANKS = 8
CLIENTS = 4
RATE = 32.0  # scrapes per second, all clients together
WARMUP = 10.0
SOAK = float(os.environ.get("VRAMWATCH_SOAK_SECONDS", "60"))
P99_LIMIT = 0.3  # seconds, 90 KB bodies on a loaded 2-core machine (guarantee 3's 100 ms: one scrape at a time)
RSS_GROWTH_LIMIT = 6 << 20


def _proc(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            out[key] = int(value.split()[0]) * (1024 if key == "VmRSS" else 1)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def test_soak_eight_ranks_many_scrapes(exporter, tmp_path):
    exp = exporter(gpus=RANKS, nvml_interval=1.0).start()
    ranks = [
        start_sim_rank(
            exp,
            r,
            "--duration",
            str(WARMUP + SOAK + 60),
            "--fill-gib",
            str(4 + r),
            world_size=RANKS,
            cuda_visible=str(r),
        )
        for r in range(RANKS)
    ]
    pid = exp.proc.pid
    try:
        wait_until(lambda: len(exp.metrics().get("vramwatch_rank_info", [])) == RANKS, 30, "all ranks")
        url = exp.url + "/metrics"
        latencies: list[float] = []
        failures: list[str] = []
        sizes: list[int] = []
        stop = threading.Event()
        lock = threading.Lock()

        def client() -> None:
            period = CLIENTS / RATE
            next_t = time.monotonic()
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    with urllib.request.urlopen(url, timeout=5) as r:
                        body = r.read()
                        ok = r.status == 200 and b"torch_cuda_memory_allocated_bytes" in body
                except Exception as e:  # noqa: BLE001 - counted, reported
                    ok, body = False, repr(e).encode()
                took = time.perf_counter() - t0
                with lock:
                    if ok:
                        latencies.append(took)
                        sizes.append(len(body))
                    else:
                        failures.append(body[:200].decode(errors="replace"))
                next_t += period
                stop.wait(max(0.0, next_t - time.monotonic()))

        def run_clients(seconds: float) -> None:
            stop.clear()
            threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
            for t in threads:
                t.start()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(2.0)
                samples.append((time.monotonic(), _proc(pid)))
            stop.set()
            for t in threads:
                t.join(10)

        samples: list[tuple[float, dict[str, int]]] = []
        run_clients(WARMUP)  # caches, lazy imports, allocator arenas
        latencies.clear()
        time.sleep(1.0)
        quiet_before = _proc(pid)
        samples.clear()
        t_start = time.monotonic()
        run_clients(SOAK)
        elapsed = time.monotonic() - t_start
        time.sleep(1.0)
        quiet_after = _proc(pid)
        assert all(p.poll() is None for p in ranks), "the ranks ran throughout"
    finally:
        for p in ranks:
            stop_proc(p)

    n = len(latencies)
    rss = [s["VmRSS"] for _, s in samples]
    third = max(1, len(rss) // 3)
    figures = {
        "what": "soak: 8 simulated ranks, one vramwatch serve, scraped over loopback from 4 client threads",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "vramwatch_commit": _commit(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.platform()},
        "ranks": RANKS,
        "clients": CLIENTS,
        "target_rate_per_s": RATE,
        "seconds": round(elapsed, 1),
        "scrapes": n,
        "failed": len(failures),
        "rate_per_s": round(n / elapsed, 1),
        "body_bytes_median": int(statistics.median(sizes)) if sizes else 0,
        "latency_ms": {
            k: round(1000 * _pct(latencies, q), 2) for k, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
        },
        "rss_mib": {
            "start_of_soak": round(quiet_before["VmRSS"] / 2**20, 2),
            "end_of_soak": round(quiet_after["VmRSS"] / 2**20, 2),
            "max": round(max(rss) / 2**20, 2),
            "first_third_median": round(statistics.median(rss[:third]) / 2**20, 2),
            "last_third_max": round(max(rss[-third:]) / 2**20, 2),
        },
        "fds": {"before": quiet_before["fds"], "after": quiet_after["fds"], "max": max(s["fds"] for _, s in samples)},
        "threads": {
            "before": quiet_before["Threads"],
            "after": quiet_after["Threads"],
            "max": max(s["Threads"] for _, s in samples),
        },
    }
    (tmp_path / "soak.json").write_text(json.dumps(figures, indent=1) + "\n")
    if os.environ.get("VRAMWATCH_RECORD_BENCHMARKS") == "1":
        out = ROOT / "benchmarks" / "results" / "soak.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))

    assert not failures, f"{len(failures)} failed scrapes, e.g. {failures[:3]}"
    assert n >= 0.8 * RATE * SOAK, f"only {n} scrapes in {elapsed:.0f} s"
    assert figures["latency_ms"]["p99"] / 1000 < P99_LIMIT, figures["latency_ms"]
    growth = max(rss[-third:]) - statistics.median(rss[:third])
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth / 2**20:.1f} MiB during the soak: {figures['rss_mib']}"
    assert quiet_after["fds"] <= quiet_before["fds"] + 1, figures["fds"]
    assert figures["fds"]["max"] <= quiet_before["fds"] + CLIENTS + 4, figures["fds"]  # + files being read
    assert quiet_after["Threads"] <= quiet_before["Threads"] + 1, figures["threads"]
    assert figures["threads"]["max"] <= quiet_before["Threads"] + CLIENTS + 1, figures["threads"]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
