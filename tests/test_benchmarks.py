"""The benchmark harness on CPU: the scripts run, their JSON has every figure the results need, the A/B runs
are what they claim (A without vramwatch, B with it and its server), and run_gpu.sh drives them end to end.

The figures here mean nothing (a loaded 2-core VM, simulated GPU); only the plumbing is under test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import overhead
import pytest

ROOT = Path(__file__).resolve().parent.parent


# --- pure helpers ---
def test_paired_stats_ratios_and_null():
    st = common.paired_stats([1.0, 2.0, 4.0], [1.1, 2.0, 3.0])
    assert st["ratios"] == pytest.approx([1.1, 1.0, 0.75])
    assert st["null_ratios"] == pytest.approx([2.0, 2.0])  # each baseline over the next one
    assert st["median_ratio"] == pytest.approx(1.0)
    assert (st["min_ratio"], st["max_ratio"]) == pytest.approx((0.75, 1.1))
    assert st["null_median_ratio"] == pytest.approx(2.0) and st["pairs"] == 3
    assert common.paired_stats([], [])["median_ratio"] is None


def test_concurrent_and_mixed_clients_are_processes_of_their_own(tmp_path, monkeypatch):
    import scrape

    # each scrape notes the process that sent it: clients in threads of this process would all note ours
    def fake_get(port, timeout=10.0, request=scrape.PROMETHEUS_REQUEST):
        with open(tmp_path / str(os.getpid()), "ab") as fh:
            fh.write(b"p" if request == scrape.PROMETHEUS_REQUEST else b"x")
        time.sleep(0.01)
        return (200 if request == scrape.PROMETHEUS_REQUEST else 503), 10, 0.001

    monkeypatch.setattr(scrape, "raw_get", fake_get)
    c = scrape.measure_concurrent(0, os.getpid(), 3, 0.3)
    pids = {p.name for p in tmp_path.iterdir()}
    assert len(pids) == 3 and str(os.getpid()) not in pids
    assert c["client_processes"] and c["ok"] == c["scrapes"] == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert c["status_503"] == 0 and c["p99_ms"] == pytest.approx(1.0) and c["seconds"] > 0.25
    for p in tmp_path.iterdir():
        p.unlink()
    m = scrape.measure_mixed(0, os.getpid(), 4, 0.3)
    assert len({p.name for p in tmp_path.iterdir()} - {str(os.getpid())}) == 4
    assert m["prometheus"]["clients"] == m["plain"]["clients"] == 2
    assert m["prometheus"]["ok"] == m["prometheus"]["requests"] > 0 and m["prometheus"]["status_503"] == 0
    assert m["plain"]["status_503"] == m["plain"]["requests"] > 0 and m["plain"]["ok"] == 0


def test_percentile_interpolates():
    assert common.percentile([], 50) is None
    assert common.percentile([3.0], 99) == 3.0
    assert common.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert common.percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_thread_cpu_clock_sees_a_busy_thread():
    import threading
    import time

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin, name="vramwatch-bench-spin", daemon=True)
    t.start()
    before = common.thread_cpu_seconds("vramwatch-bench")
    time.sleep(0.3)
    after = common.thread_cpu_seconds("vramwatch-bench")
    stop.set()
    t.join()
    spent = common.cpu_delta(before, after)["vramwatch-bench-spin"]
    assert 0.02 < spent < 0.5, spent  # it ran (shared with the GIL holder), and the clock is per thread
    assert "MainThread" not in after


def _part(**kw):
    pair = {k: 1.0 for k in overhead.PAIR_KEYS}
    base = {
        "metadata": {
            "date": "d",
            "gpu_name": "g",
            "driver": "v",
            "torch": "t",
            "python": "p",
            "vramwatch_commit": "c",
            "workloads": list(kw),
        }
    }
    base.update({k: (dict(pair) if isinstance(v, str) else v) for k, v in kw.items()})
    return base


def test_merge_parts_into_the_issue_layout(tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    common.write_json(a, _part(in_process_cpu_share=0.0001, step_call_us=0.7, launch_bound="x"))
    common.write_json(b, _part(transformer="x", transformer_full="x"))
    assert overhead.missing_keys(common.read_json(a))  # one part alone is incomplete
    out = tmp_path / "all.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--merge", str(a), str(b), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    merged = common.read_json(out)
    assert overhead.missing_keys(merged) == []
    assert [p["file"] for p in merged["metadata"]["parts"]] == ["a.json", "b.json"]
    check = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--check", str(out)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout
    del merged["transformer"]["null_min_ratio"]
    common.write_json(out, merged)
    check = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--check", str(out)], capture_output=True, text=True
    )
    assert check.returncode == 1 and "transformer.null_min_ratio" in check.stdout


def test_run_gpu_plan_splits_the_work_into_parts(tmp_path):
    def plan(*args):
        p = subprocess.run(
            ["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), "--plan", *args],
            capture_output=True,
            text=True,
            env=dict(os.environ, OUT=str(tmp_path)),
            check=True,
        )
        return p.stdout

    one, two, three = plan("--full", "part1"), plan("--full", "part2"), plan("--full", "part3")
    assert "pytest -m gpu tests/gpu" in one and "scrape.py" not in one
    assert "--workloads direct,launch_bound,launch_bound_fresh --pairs 20" in one and "--direct-seconds 60" in one
    assert "--direct-parts-seconds 30" in one
    assert "--step-calls 1000000" in one and "fragmentation.py" not in one and "transformer" not in one
    assert "--workloads transformer,transformer_full --pairs 20" in two and "scrape.py" in two
    assert "-m pytest" not in two and "launch_bound" not in two and "fragmentation.py" not in two
    assert "fragmentation.py" in three and "overhead.py" not in three and "scrape.py" not in three
    for line in one.splitlines()[1:] + two.splitlines()[1:] + three.splitlines()[1:]:
        assert f"--out {tmp_path}/" in line or f"--junitxml={tmp_path}/" in line, line
    assert "--pairs 4" in plan("--quick", "all")


# --- the whole pipeline, tiny, on the CPU ---
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("run_gpu")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    env.update(OUT=str(out), PYTHON=sys.executable, BUDGET="300")
    before = _frag_spools()
    p = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), "--smoke", "all", "part4", "rss"],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    # each variant's spool goes with it: its rank-started server is stopped first (it would make it again)
    assert _frag_spools() <= before, f"left behind: {sorted(_frag_spools() - before)}"
    return out, p.stdout


def _frag_spools() -> set[str]:
    return {str(p) for d in ("/dev/shm", tempfile.gettempdir()) for p in Path(d).glob("vwbench-frag-*")}


@pytest.mark.slow
def test_smoke_every_phase_ran(smoke):
    out, stdout = smoke
    phases = dict(line.split(": ", 1) for line in (out / "phases.txt").read_text().splitlines())
    for name in (
        "pytest-gpu",
        "overhead-part1",
        "overhead-part2",
        "scrape",
        "fragmentation",
        "overhead-direct-nopin",
        "overhead-short",
        "rss",
    ):
        assert phases.get(name, "").startswith("rc=0"), (name, phases, stdout[-3000:])
    assert "=== summary ===" in stdout and "in_process_cpu_share" in stdout
    # the GPU suite skips cleanly without a GPU
    text = (out / "pytest-gpu.txt").read_text()
    assert re.search(r"\d+ skipped", text) and not re.search(r"\d+ (failed|errors?)\b", text), text[-2000:]
    assert (out / "environment.txt").exists()
    rss = json.loads((out / "rss_floor.json").read_text())
    steps = {s["step"]: s["rss_mb"] for s in rss["steps"]}
    assert 0 < steps["bare interpreter"] < steps["+ the server's imports"], rss["steps"]
    assert [v["variant"] for v in rss["serve"]] == ["defaults", "MALLOC_ARENA_MAX=1"] and all(
        v["rss_mb"] > steps["bare interpreter"] and v["bytes"] > 0 for v in rss["serve"]
    ), rss["serve"]


@pytest.mark.slow
def test_smoke_overhead_json_has_the_required_layout(smoke):
    out, _ = smoke
    data = common.read_json(out / "overhead.json")
    # without a GPU only the GPU's name and driver can be missing
    assert set(overhead.missing_keys(data)) <= {"metadata.gpu_name", "metadata.driver"}
    assert 0 <= data["in_process_cpu_share"] < 0.05 and 0 < data["step_call_us"] < 100
    direct = data["direct"]
    assert direct["vramwatch_loaded"] and "vramwatch-sampler" in direct["vramwatch_threads_cpu_s"]
    assert direct["scrapes"]["ok"] >= 1, "the 1 Hz scraper hit the direct run's server"
    assert direct["step_call"]["number"] == 20000 and len(direct["step_call"]["step_us"]) == 3
    # the guarantee's figure comes from an uninstrumented run with watch() and tokens; one without them beside it
    assert 0 <= data["in_process_cpu_share_plain"] < 0.05 and data["direct_plain"]["vramwatch_loaded"]
    assert "step_call" not in data["direct_plain"] and "sample_parts_cpu_share" not in data["direct_plain"]
    # the parts are timed in a run of their own (its clock reads cost CPU too) and copied here for readers
    assert direct["sample_parts_from"] == "direct_parts" and "step_call" not in data["direct_parts"]
    parts = direct["sample_parts_cpu_share"]  # where a sample's CPU goes, for attributing the share
    assert parts == data["direct_parts"]["sample_parts_cpu_share"]
    assert {"tick", "allocator_read", "heartbeat_and_loss", "publish", "memory_by_role_walk"} <= set(parts)
    inside = ("allocator_read", "heartbeat_and_loss", "publish")  # the snapshot is part of allocator_read
    assert 0 < parts["publish"] <= parts["tick"] and sum(parts[k] for k in inside) <= parts["tick"]
    pin = data["metadata"]["pinned_core"]
    assert pin is None or pin == max(os.sched_getaffinity(0)), "smoke mode pins the training thread when it can"
    for w in ("launch_bound", "launch_bound_fresh", "transformer", "transformer_full"):
        o = data[w]
        assert o["pairs"] == 2 and o["errors"] == 0
        assert len(o["step_times"]["without"]) == len(o["step_times"]["with"]) == 2
        assert len(o["null_ratios"]) == 1 and o["null_min_ratio"] == o["null_max_ratio"]
        for r in o["runs"]["without"]:
            if w != "launch_bound":
                assert not r["vramwatch_loaded"], f"{w}: an A run had vramwatch loaded"
                assert not any(t.startswith("vramwatch") for t in r["threads"])
            assert r["pinned_core"] == pin
        for r in o["runs"]["with"]:
            assert r["vramwatch_loaded"] and r["server_up"] and "vramwatch-sampler" in r["threads"]
            assert r["steps"] >= 1 and r["wall_s"] >= 0.2 and r["pinned_core"] == pin
            if pin is not None:  # vramwatch never shares the training thread's CPU
                assert pin not in r["server_cpus"] and pin not in r["sampler_cpus"], r
    # segments: one process per pair here (--pairs-per-process 1), each A segment with vramwatch not running
    seg = data["launch_bound"]
    assert seg["design"] == "segments" and len(seg["processes"]) == 2
    for r in seg["runs"]["without"]:
        assert r["pair_in_process"] == 0 and r["vramwatch_threads"] == []
        assert not r["vramwatch_loaded"], "the first A segment of a process runs before vramwatch is imported"
    assert data["launch_bound_fresh"]["design"] == "fresh processes"
    assert data["transformer"]["baseline_shared_with"] == ["transformer_full"]
    full = data["transformer_full"]["settings"]
    assert full["status_every"] > 0 and full["oom_history_entries"] > 0
    assert data["transformer"]["settings"] == {}


@pytest.mark.slow
def test_smoke_scrape_json(smoke):
    out, _ = smoke
    data = common.read_json(out / "scrape.json")
    one, two = data["vramwatch"]["1"], data["vramwatch"]["2"]
    for r in (one, two):
        for k in ("p50_ms", "p99_ms", "bytes", "bytes_gzip", "cpu_per_scrape_s", "cpu_per_scrape_net_s"):
            assert r[k] is not None, k
        assert r["errors"] == 0 and r["p50_ms"] <= r["p99_ms"]
        assert r["bytes_gzip"] < r["bytes"]
        assert 5 < r["rss_mb"] <= r["hwm_mb"] < 500
        assert r["paced_raw"]["errors"] == 0 and r["paced_raw"]["p50_ms"] <= r["paced_raw"]["p99_ms"]
        b = r["back_to_back"]  # one scraper back to back: the CPU per scrape without the idle share's weight
        assert b["scrapes"] > 0 and b["errors"] == 0 and b["cpu_per_scrape_s"] is not None
        # the server names its event loop's thread, and the benchmark finds it: its CPU alone
        assert 0 < b["loop_cpu_per_scrape_s"] <= b["cpu_per_scrape_s"]
        assert r["paced_raw"]["loop_cpu_per_scrape_s"] > 0
        k = r["paced_keepalive"]  # one connection for every scrape, as Prometheus keeps it: all answered on it
        assert k["errors"] == 0 and k["scrapes"] == r["paced_raw"]["scrapes"] and k["loop_cpu_per_scrape_s"] > 0
        assert r["rss_by_mapping_mb"] and all(v > 0 for v in r["rss_by_mapping_mb"].values())
        c = r["concurrent"]
        assert c["clients"] == 4 and c["ok"] > 0 and c["scrapes"] == sum(c["statuses"].values())
        assert c["p50_ms"] <= c["p99_ms"] and c["cpu_per_scrape_s"] is not None
        m = r["mixed"]  # overload: 2 x max_connections, half with Prometheus' scrape headers
        assert m["clients"] == 16 and m["prometheus"]["clients"] == m["plain"]["clients"] == 8
        for h in (m["prometheus"], m["plain"]):
            assert h["requests"] == sum(h["statuses"].values()) and h["ok"] + h["status_503"] <= h["requests"]
        assert m["prometheus"]["ok"] > 0 and m["prometheus"]["p50_ms"] <= m["prometheus"]["p99_ms"]
    assert two["bytes"] > one["bytes"] and two["series"] > one["series"], "a second rank adds its series"
    assert "skipped" in data["nvitop_exporter"]


def test_scrape_scale_sweeps_ranks_and_gpus(tmp_path):
    out = tmp_path / "scale.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scrape_scale.py"), "--gpus", "1,2", "--ranks", "1,3"]
    r = subprocess.run(cmd + ["--quick", "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    data = common.read_json(out)
    points = {(p["gpus"], p["ranks"]): p["result"] for p in data["points"]}
    assert set(points) == {(1, 1), (1, 3), (2, 1), (2, 3)}
    for m in points.values():
        assert m["errors"] == 0 and m["p50_ms"] <= m["p99_ms"] and m["bytes_gzip"] < m["bytes"]
    # every rank and every GPU adds its series (the ranks are this process's synthetic ones)
    assert points[(1, 3)]["series"] > points[(1, 1)]["series"] < points[(2, 1)]["series"]
    assert "| 2 | 3 |" in r.stdout  # the table docs/scale.md carries


@pytest.mark.slow
def test_smoke_fragmentation_json(smoke):
    out, _ = smoke
    data = common.read_json(out / "fragmentation.json")
    assert set(data["variants"]) == {"default", "gc_threshold_0.8", "expandable_segments"}
    for name, v in data["variants"].items():
        assert "error" not in v["run"], v["run"]
        assert v["series"], name
        row = v["series"][-1]
        for k in ("allocated", "reserved", "fragmentation", "inactive_split", "retries", "ooms", "steps", "t"):
            assert k in row, (name, k)
        s = v["summary"]
        assert s["samples"] == len(v["series"]) and s["peak_reserved_bytes"] >= s["final_allocated_bytes"] > 0
        assert s["limit_bytes"] == 8 * 2**30, "the 8 GiB cap shows as the limit"
    # the settings in force are visible in each run's own series
    info = {n: v["allocator_info"] for n, v in data["variants"].items()}
    assert info["gc_threshold_0.8"]["garbage_collection_threshold"] == "0.8"
    assert info["expandable_segments"]["expandable_segments"] == "true"
    assert info["default"]["expandable_segments"] == "false"
    assert set(data["comparison"]) == set(data["variants"])


def test_fragmentation_row_parser_reads_one_rank():
    text = "\n".join(
        [
            "# TYPE torch_cuda_memory_allocated_bytes gauge",
            'torch_cuda_memory_allocated_bytes{uuid="GPU-a",device="0",rank="0",local_rank="0"} 10',
            'torch_cuda_memory_allocated_bytes{uuid="GPU-b",device="0",rank="1",local_rank="1"} 99',
            "# TYPE torch_cuda_memory_reserved_bytes gauge",
            'torch_cuda_memory_reserved_bytes{uuid="GPU-a",device="0",rank="0",local_rank="0"} 40',
            "# TYPE gpu_memory_used_bytes gauge",
            'gpu_memory_used_bytes{gpu="0",uuid="GPU-a"} 1000',
            'gpu_memory_used_bytes{gpu="1",uuid="GPU-b"} 2000',
            "",
        ]
    )
    import fragmentation

    row = fragmentation.row_from_scrape(text)
    assert row == {"allocated": 10.0, "reserved": 40.0, "gpu_memory_used": 1000.0}
    assert fragmentation.row_from_scrape(text.replace('rank="0"', 'rank="7"')) is None


def test_overhead_check_reads_json_strictly(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"launch_bound": {"pairs": 3}}))
    assert "step_call_us" in overhead.missing_keys(common.read_json(bad))


@pytest.mark.slow
def test_smoke_fragmentation_recording_becomes_a_report(smoke, tmp_path):
    """The recorded scrape backfills into Prometheus and `vramwatch report` draws it (where the run is reviewed)."""
    from harness import tool

    tools = os.path.dirname(tool("promtool"))
    tool("prometheus")
    out, _ = smoke
    data = common.read_json(out / "fragmentation.json")
    assert all((out / v["openmetrics_file"]).exists() for v in data["variants"].values())
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fragmentation.py"),
            "--report",
            str(out / "fragmentation.json"),
            "--report-dir",
            str(tmp_path),
            "--variants",
            "default",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TEST_TOOLS_DIR=tools),
    )
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    html = (tmp_path / "fragmentation-default.html").read_text()
    assert "vramwatch report" in html and "job = vramwatch-fragmentation" in html
    assert html.count("<img") > 10


def test_fragmentation_training_loop_runs_on_the_cpu(tmp_path):
    """The GPU run's torch loop (frozen base, trainable blocks, kept slices, big requests), on the CPU."""
    out = tmp_path / "f.json"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fragmentation.py"),
            "--device",
            "cpu-torch",
            "--variants",
            "default",
            "--seconds",
            "1",
            "--hidden",
            "64",
            "--vocab",
            "100",
            "--min-len",
            "8",
            "--max-len",
            "64",
            "--batch",
            "2",
            "--frozen-layers",
            "1",
            "--trainable-layers",
            "1",
            "--big-every",
            "2",
            "--big-gib",
            "0.001",
            "--keep-steps",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = common.read_json(out)["variants"]["default"]["run"]
    assert "error" not in run, run
    assert run["steps"] >= 2 and run["big_requests"] >= 1 and run["caught_ooms"] == 0


def test_short_segments_against_one_sidecar_server(tmp_path):
    """--segment-server external: one `vramwatch serve` beside the process; B segments start in milliseconds."""
    out = tmp_path / "o.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "overhead.py"),
            "--device",
            "cpu",
            "--workloads",
            "launch_bound",
            "--pairs",
            "3",
            "--pairs-per-process",
            "3",
            "--run-seconds",
            "0.3",
            "--segment-warmup-seconds",
            "0",
            "--segment-server",
            "external",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    o = common.read_json(out)["launch_bound"]
    assert o["pairs"] == 3 and o["errors"] == 0 and o["processes"][0]["segment_server"] == "external"
    b = o["runs"]["with"]
    assert len({r["server_pid"] for r in b}) == 1, "one server for every B segment of the process"
    assert all(r["server_up"] and r["vramwatch_start_s"] < 0.5 for r in b)
    assert all(r["warmup_steps"] == o["runs"]["without"][0]["warmup_steps"] for r in b)
    assert all(r["vramwatch_threads"] == [] for r in o["runs"]["without"]), "A segments: nothing of ours running"


@pytest.mark.slow
def test_smoke_part4_attribution_and_short_segments(smoke):
    out, stdout = smoke
    nopin = common.read_json(out / "overhead-direct-nopin.json")
    assert nopin["metadata"]["pinned_core"] is None and nopin["direct"]["pinned_core"] is None
    assert "publish" in nopin["direct"]["sample_parts_cpu_share"] and "by part" in stdout
    short = common.read_json(out / "overhead-short.json")["launch_bound"]
    assert short["pairs"] == 2 and short["errors"] == 0
    assert all(p["segment_server"] == "external" for p in short["processes"])
    servers = {}  # one sidecar server per process, whatever its segments
    for r in short["runs"]["with"]:
        servers.setdefault(r["pid"], set()).add(r["server_pid"])
    assert len(servers) == len(short["processes"]) and all(len(v) == 1 for v in servers.values())


def test_scrape_floor_measures_both_servers_cold_and_warm_new_and_kept_alive(tmp_path):
    out = tmp_path / "floor.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scrape_floor.py"), "--rate", "50", "--scrapes", "10"]
    cmd += ["--busy", "50", "--repeats", "2", "--bytes", "1000", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    for name in ("floor", "http", "floor_kept", "epoll_kept", "http_kept"):  # the kept ones over one connection each
        for path in ("cold", "warm"):
            v = data[name][path]
            assert 0 < v["min_ms"] <= v["median_ms"] <= v["max_ms"], (name, path, v)
    assert "to floor's" in r.stdout and "to floor_kept's" in r.stdout and "to epoll_kept's" in r.stdout
    bad = subprocess.run(cmd[:2] + ["--rate", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--rate" in bad.stderr


def test_cpu_windows_subtracts_each_threads_own_idle_rate_and_says_how_far_the_windows_disagree():
    import scrape

    def reading(at: float, process: float, **threads: float) -> scrape.Reading:
        r = object.__new__(scrape.Reading)
        r.at, r.process, r.threads = at, process, threads
        return r

    # idle 0-2 s, 10 scrapes 2-4 s, idle 4-6 s: the loop thread works only while scraped (1 ms a scrape);
    # the background thread burns 10 ms/s before and 30 ms/s after (a render burst), 20 ms/s meanwhile;
    # a worker that ended during the scrapes spent 2 ms
    w = scrape.cpu_windows(
        reading(0.0, 0.0, loop=0.0, bg=0.0),
        reading(2.0, 0.020, loop=0.0, bg=0.020),
        reading(4.0, 0.072, loop=0.010, bg=0.060),
        reading(6.0, 0.132, loop=0.010, bg=0.120),
        10,
    )
    assert w["threads_marginal"]["loop"] == {"marginal_s": pytest.approx(1e-3), "noise_s": pytest.approx(0.0)}
    assert w["threads_marginal"]["bg"]["marginal_s"] == pytest.approx(0.0, abs=1e-12)
    assert w["threads_marginal"]["bg"]["noise_s"] == pytest.approx(2e-3)  # (30 - 10) / 2 ms/s x 2 s / 10
    assert w["ended_threads_cpu_per_scrape_s"] == pytest.approx(0.2e-3)
    assert w["cpu_per_scrape_marginal_s"] == pytest.approx(1.2e-3)  # 52 ms - 20 ms/s x 2 s, over 10
    assert w["cpu_per_scrape_marginal_noise_s"] == pytest.approx(2e-3)
    assert (w["idle_cpu_share_before"], w["idle_cpu_share_after"]) == (pytest.approx(0.010), pytest.approx(0.030))
