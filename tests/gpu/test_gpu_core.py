"""Core promises on a real GPU: no CUDA context of our own, the allocator as torch sees it, answers while wedged.

    python3 -m pytest -m gpu tests/gpu/test_gpu_core.py -q

Each case runs in a fresh Python process (the job), so no state leaks from one
to the next and the pytest process itself never touches CUDA (it only reads
NVML). Skipped without a GPU (tests/gpu/conftest.py) or without torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
from jobs import PRELUDE, job_env, run_job

from harness import free_port, http_get, parse_metrics

pytestmark = pytest.mark.gpu
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _need_torch():
    try:
        import torch  # noqa: F401 - only to know whether the jobs can run; CUDA is never touched here
    except ImportError:
        pytest.skip("torch is not installed")


# ------------------------------------------------------------------------------------------------
NO_CONTEXT_JOB = r"""
case, port, spool = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch = None
if case != "no_torch":
    import torch
if case == "torch_cuda_init":
    torch.cuda.init()  # the job initialised CUDA but made no tensor: still no context
before = nvml_state()
import vramwatch
h = vramwatch.start(port=port, spool_dir=spool, interval=0.2, largest_block_interval=0.5, linger=0)
m = wait(lambda: (lambda m: m if m.get("vramwatch_ranks", [({}, 0)])[0][1] >= 1 else None)(scrape(port)),
         30, "the rank-spawned server to list this rank")
for _ in range(20):  # ~2 s: ten samples, four snapshot deadlines
    vramwatch.step()
    time.sleep(0.1)
after = nvml_state()
res = {"pid": os.getpid(), "before": before, "after": after, "torch_loaded": "torch" in sys.modules,
       "cuda_initialized": torch.cuda.is_initialized() if torch is not None else None,
       "allocator_series": len(rank0(scrape(port), "torch_cuda_memory_allocated_bytes"))}
with open(os.path.join(spool, "server.json")) as fh:
    res["server_pid"] = json.load(fh)["pid"]
if torch is not None:  # only now (it runs cuInit): does this process hold a primary context?
    res["has_primary_context"] = [bool(torch._C._cuda_hasPrimaryContext(i)) for i in range(torch.cuda.device_count())]
vramwatch.stop()
done(res)
"""


@pytest.mark.parametrize("case", ["no_torch", "torch_imported", "torch_cuda_init"])
def test_start_creates_no_cuda_context(case, tmp_path):
    port = free_port()
    r = run_job(NO_CONTEXT_JOB, case, str(port), str(tmp_path / "spool"))
    print(
        json.dumps({k: r[k] for k in r if k not in ("before", "after")}),
        [(b["index"], a["used"] - b["used"]) for b, a in zip(r["before"], r["after"], strict=True)],
    )
    if case == "no_torch":
        assert not r["torch_loaded"], "vramwatch imported torch into a job that had not"
    else:
        assert r["cuda_initialized"] is (case == "torch_cuda_init"), "vramwatch initialised CUDA"
        assert not any(r["has_primary_context"]), f"a primary context exists: {r['has_primary_context']}"
    assert r["allocator_series"] == 0, "allocator series for a device the job never used"
    for b, a in zip(r["before"], r["after"], strict=True):
        for pid, who in ((r["pid"], "the job"), (r["server_pid"], "the server")):
            assert pid not in a["pids"], f"{who} (pid {pid}) is a compute process on GPU {a['index']}"
        assert len(a["pids"]) <= len(b["pids"]), f"a compute process appeared on GPU {a['index']}: {b} -> {a}"
        delta = a["used"] - b["used"]
        assert abs(delta) <= 2 * MIB, (
            f"NVML used memory on GPU {a['index']} moved by {delta / MIB:.2f} MiB "
            "(cuInit alone is ~3 MiB, a context ~500 MiB)"
        )


# ------------------------------------------------------------------------------------------------
SERIES_JOB = r"""
port, spool = int(sys.argv[1]), sys.argv[2]
import torch
import vramwatch
vramwatch.start(port=port, spool_dir=spool, interval=0.2, linger=0)
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")   # large pool
y = torch.empty(300 << 10, dtype=torch.uint8, device="cuda:0")  # small pool
torch.cuda.synchronize()
want = {"allocated": torch.cuda.memory_allocated(0), "reserved": torch.cuda.memory_reserved(0)}
props = torch.cuda.get_device_properties(0)
pci = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
state = nvml_state()
by_pci = [g["uuid"] for g in state if g["pci"] == pci]

def matching():
    m = scrape(port)
    a = rank0(m, "torch_cuda_memory_allocated_bytes")
    return m if a and a[0][1] == want["allocated"] else None

m = wait(matching, 20, "the allocator series to reach torch's figures")
names = ("torch_cuda_memory_allocated_bytes", "torch_cuda_memory_reserved_bytes",
         "torch_cuda_memory_fragmentation_ratio", "torch_cuda_memory_limit_bytes",
         "torch_cuda_memory_largest_free_block_bytes")
series = {n: rank0(m, n) for n in names}
done({"want": want, "series": series, "uuid_by_pci": by_pci, "torch_uuid": str(props.uuid),
      "total": props.total_memory, "pid": os.getpid(), "nvml": state,
      "rank_info": rank0(m, "vramwatch_rank_info")})
"""


def test_allocator_series_match_torch_and_join_by_uuid(tmp_path):
    r = run_job(SERIES_JOB, str(free_port()), str(tmp_path / "spool"))
    s = r["series"]
    for name in ("torch_cuda_memory_allocated_bytes", "torch_cuda_memory_reserved_bytes"):
        assert len(s[name]) == 1, f"{name}: one series for the one device: {s[name]}"
    labels, allocated = s["torch_cuda_memory_allocated_bytes"][0]
    reserved = s["torch_cuda_memory_reserved_bytes"][0][1]
    assert allocated == r["want"]["allocated"]
    assert reserved == r["want"]["reserved"]
    assert labels["device"] == "0"
    if r["uuid_by_pci"]:  # joined independently through the PCI address
        assert labels["uuid"] == r["uuid_by_pci"][0], (labels, r["uuid_by_pci"])
    assert labels["uuid"] in {g["uuid"] for g in r["nvml"]}, "uuid must be NVML's (GPU-... form)"
    assert labels["uuid"].endswith(r["torch_uuid"].removeprefix("GPU-"))
    frag = s["torch_cuda_memory_fragmentation_ratio"][0][1]
    assert frag == pytest.approx((reserved - allocated) / reserved, abs=1e-9)
    assert s["torch_cuda_memory_limit_bytes"][0][1] == r["total"]
    own = [g for g in r["nvml"] if g["uuid"] == labels["uuid"]][0]
    if any(r["pid"] in g["pids"] for g in r["nvml"]):  # NVML sees this PID namespace
        assert r["pid"] in own["pids"], "the job's context is on the GPU its series name"


# ------------------------------------------------------------------------------------------------
WEDGE_JOB = r"""
import ctypes
port, spool, seconds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
import torch
import vramwatch
vramwatch.start(port=port, spool_dir=spool, interval=0.2, linger=0)
x = torch.ones(16 << 20, device="cuda:0")
wait(lambda: rank0(scrape(port), "torch_cuda_memory_allocated_bytes"), 20, "the first sample")
vramwatch.step()
print("WEDGING", flush=True)
ctypes.PyDLL(None).sleep(ctypes.c_uint(seconds))   # a long C call that keeps the GIL
done({"woke": True})
"""


def test_metrics_answer_within_100ms_while_the_training_thread_holds_the_gil(tmp_path):
    port = free_port()
    code = PRELUDE + textwrap.dedent(WEDGE_JOB)
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(port), str(tmp_path / "spool"), "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=job_env(),
    )
    try:
        deadline = time.monotonic() + 60
        for line in p.stdout:
            if line.startswith("WEDGING") or time.monotonic() > deadline:
                break
        assert p.poll() is None, p.stderr.read()
        time.sleep(1.0)  # now inside sleep(), GIL held
        url = f"http://127.0.0.1:{port}/metrics"
        took, ages = [], []
        for _ in range(10):
            t0 = time.perf_counter()
            code_, body = http_get(url, timeout=2)
            took.append(time.perf_counter() - t0)
            assert code_ == 200
            m = parse_metrics(body.decode())
            ages += [v for lab, v in m["vramwatch_sample_age_seconds"] if lab["rank"] == "0"]
            assert [v for lab, v in m["torch_cuda_memory_allocated_bytes"] if lab["rank"] == "0"], (
                "a wedged rank keeps its series"
            )
            time.sleep(0.4)
        print("scrape ms:", [round(t * 1000, 1) for t in took], "ages:", ages)
        assert max(took) < 0.1, f"/metrics took {max(took) * 1000:.0f} ms while the job held its GIL"
        assert ages[-1] > ages[0] + 3, f"the sample age must grow while wedged: {ages}"
    finally:
        p.kill()
        p.wait(timeout=10)


# ------------------------------------------------------------------------------------------------
SNAPSHOT_JOB = r"""
import random, statistics
history = sys.argv[1] == "history"
import torch
from vramwatch.rank.allocator import AllocatorSampler, TorchSource, segment_summary
if history:
    torch.cuda.memory._record_memory_history(max_entries=100_000)
rng = random.Random(0)
keep, drop = [], []
for i in range(3000):  # a fragmented cache: many segments, split blocks
    t = torch.empty(rng.randint(1, 24) << 20 if i % 3 else rng.randint(1, 900) << 10, dtype=torch.uint8,
                    device="cuda:0")
    (keep if i % 2 else drop).append(t)
del drop
torch.cuda.synchronize()
src = TorchSource()
assert src.devices() == [0], src.devices()

def timed(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out

snap = timed(lambda: segment_summary(src.snapshot()), 15)
with_snap = AllocatorSampler(src, largest_block_interval=1e-9)
no_snap = AllocatorSampler(src, largest_block_interval=0)
clock = iter(range(10**9, 10**12, 10**8))  # far-apart "now"s: every read is due a snapshot
read_with = timed(lambda: with_snap.read(now=float(next(clock))), 15)
read_without = timed(no_snap.read, 15)
segs = src.snapshot()
dev = with_snap.read(now=float(next(clock)))[0].values
done({"segments": len(segs), "blocks": sum(len(s["blocks"]) for s in segs),
      "snapshot_ms": [t * 1000 for t in snap], "read_with_ms": [t * 1000 for t in read_with],
      "read_without_ms": [t * 1000 for t in read_without],
      "largest_free": dev.get("torch_cuda_memory_largest_free_block_bytes"),
      "reserved": dev.get("torch_cuda_memory_reserved_bytes"),
      "allocated": dev.get("torch_cuda_memory_allocated_bytes")})
"""


@pytest.mark.parametrize("history", ["plain", "history"])
def test_largest_free_block_snapshot_cost_is_bounded(history):
    r = run_job(SNAPSHOT_JOB, history, timeout=300)
    med = sorted(r["snapshot_ms"])[len(r["snapshot_ms"]) // 2]
    read_with = sorted(r["read_with_ms"])[len(r["read_with_ms"]) // 2]
    read_without = sorted(r["read_without_ms"])[len(r["read_without_ms"]) // 2]
    print(
        f"{history}: {r['segments']} segments, {r['blocks']} blocks; snapshot+summary median {med:.2f} ms, "
        f"max {max(r['snapshot_ms']):.2f} ms; sampler read {read_with:.2f} ms with snapshot, "
        f"{read_without:.3f} ms without"
    )
    assert r["segments"] > 100, "the job should have fragmented the cache"
    bound = 50.0 if history == "plain" else 100.0
    assert med < bound, f"a largest-free-block snapshot took {med:.1f} ms (bound {bound} ms)"
    assert read_without < 1.0, f"a sampler read without a snapshot took {read_without:.2f} ms"
    assert 0 < r["largest_free"] <= r["reserved"] - r["allocated"]


# ------------------------------------------------------------------------------------------------
ASYNC_JOB = r"""
port, spool = int(sys.argv[1]), sys.argv[2]
import torch
import vramwatch
vramwatch.start(port=port, spool_dir=spool, interval=0.2, largest_block_interval=0.5, linger=0)
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
want = {"allocated": torch.cuda.memory_allocated(0), "reserved": torch.cuda.memory_reserved(0),
        "backend": torch.cuda.get_allocator_backend()}

def matching():
    m = scrape(port)
    a = rank0(m, "torch_cuda_memory_allocated_bytes")
    return m if a and a[0][1] == want["allocated"] else None

m = wait(matching, 20, "the allocator series to reach torch's figures")
time.sleep(1.0)  # past a snapshot deadline: the sampler must not try one on this backend
m = scrape(port)
fams = sorted({n for n, rows in m.items()
               if n.startswith("torch_cuda_") and any(l.get("rank") == "0" for l, _ in rows)})

def allocator_health(name):
    return [v for l, v in m.get(name, []) if l.get("collector") == "allocator" and l.get("rank") == "0"]

up = allocator_health("vramwatch_collector_up")
errors = allocator_health("vramwatch_collector_errors_total")
done({"want": want, "families": fams, "up": up, "errors": errors,
      "allocated": rank0(m, "torch_cuda_memory_allocated_bytes")[0][1],
      "reserved": rank0(m, "torch_cuda_memory_reserved_bytes")[0][1],
      "info": rank0(m, "torch_cuda_allocator_info")})
"""


def test_cuda_malloc_async_backend_reports_what_it_can(tmp_path):
    env = job_env(PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    r = run_job(ASYNC_JOB, str(free_port()), str(tmp_path / "spool"), env=env)
    print(r["families"])
    assert r["want"]["backend"] == "cudaMallocAsync"
    assert r["allocated"] == r["want"]["allocated"] > 0
    assert r["reserved"] == r["want"]["reserved"] >= r["allocated"]
    assert r["info"] and r["info"][0][0]["backend"] == "cudaMallocAsync"
    assert r["up"] == [1.0] and r["errors"] == [0.0], "the sampler must not fail on this backend"
    fams = set(r["families"])
    for absent in (
        "torch_cuda_memory_inactive_split_bytes",
        "torch_cuda_memory_alloc_retries_total",
        "torch_cuda_memory_largest_free_block_bytes",
        "torch_cuda_memory_segments",
    ):
        assert absent not in fams, f"{absent}: this backend reports it as zero; it must be absent, not 0"


# ------------------------------------------------------------------------------------------------
LOSS_BEHIND_GPU_WORK_JOB = r"""
import threading
port, spool = int(sys.argv[1]), sys.argv[2]
import torch
import vramwatch
x = torch.ones((), device="cuda")
torch.cuda._sleep(1000)
torch.cuda.synchronize()
t0 = time.perf_counter(); torch.cuda._sleep(100_000_000); torch.cuda.synchronize()
cycles_per_s = 100_000_000 / (time.perf_counter() - t0)
vramwatch.start(port=port, spool_dir=spool, interval=0.2, linger=0)
vramwatch.step(loss=x * 1.5)
def loss_is(v):
    return lambda: rank0(scrape(port), "vramwatch_training_loss")[0][1] == v
wait(loss_is(1.5), 20, "the first loss")
sampler = next(t for t in threading.enumerate() if t.name == "vramwatch-sampler")
clock = time.pthread_getcpuclockid(sampler.ident)
torch.cuda._sleep(int(4 * cycles_per_s))  # ~4 s of GPU work queued; the next loss lies behind it
vramwatch.step(loss=x * 7.0)
busy = []
cpu0, w0 = time.clock_gettime(clock), time.monotonic()
while time.monotonic() - w0 < 2.5:  # the GPU is still asleep: the sampler must go on publishing
    m = scrape(port)
    busy.append({"gpu_busy": not torch.cuda.current_stream().query(),
                 "age": rank0(m, "vramwatch_sample_age_seconds")[0][1],
                 "loss": rank0(m, "vramwatch_training_loss")[0][1],
                 "steps": rank0(m, "vramwatch_training_steps_total")[0][1]})
    time.sleep(0.25)
sampler_cpu_share = (time.clock_gettime(clock) - cpu0) / (time.monotonic() - w0)
torch.cuda.synchronize()
wait(loss_is(7.0), 10, "the loss once the GPU got there")
final = rank0(scrape(port), "vramwatch_training_loss")[0][1]
vramwatch.stop()
done({"busy": busy, "sampler_cpu_share": sampler_cpu_share, "final": final, "cycles_per_s": cycles_per_s})
"""


def test_loss_behind_queued_gpu_work_never_stalls_the_sampler(tmp_path):
    """The loss of a step the GPU has not finished is read later, not waited for: while ~4 s of GPU work
    sit ahead of it, samples keep coming, the sampler thread stays idle (a wait would spin a core), the
    last loss read stands, and the new one appears once the GPU gets there."""
    r = run_job(LOSS_BEHIND_GPU_WORK_JOB, str(free_port()), str(tmp_path / "spool"))
    print(json.dumps(r)[:2000])
    busy = [b for b in r["busy"] if b["gpu_busy"]]
    assert len(busy) >= 5, f"the GPU work ended too soon to show anything: {r}"
    assert all(b["age"] < 1.0 for b in busy), f"samples stopped while the GPU was busy: {busy}"
    assert all(b["loss"] == 1.5 for b in busy), "the last loss read stands until the new one is ready"
    assert busy[-1]["steps"] == 2
    assert r["sampler_cpu_share"] < 0.05, f"the sampler thread spun: {r['sampler_cpu_share']:.1%} of a core"
    assert r["final"] == 7.0
