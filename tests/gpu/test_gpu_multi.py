"""Several real GPUs in one host: one target for a torchrun job, UUID joins, no stray contexts, a stalled rank.

    python3 -m pytest -m gpu tests/gpu/test_gpu_multi.py -q

Most tests need two or more GPUs and skip otherwise; the CUDA_VISIBLE_DEVICES=GPU-<uuid>
remapping test runs on one. Every rank finds its physical GPU on its own, through
the PCI address torch reports and NVML's PCI info, so the UUID label vramwatch
puts on its series is checked against an independent join. The pytest process
only reads NVML; it never touches CUDA.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness import ROOT, free_port, http_get, parse_metrics, wait_until

pytestmark = pytest.mark.gpu

RANK_SCRIPT = r"""
import json, os, sys, time, threading
import torch
import torch.distributed as dist
import vramwatch

mode, out_dir, port, spool = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
stall_rank = int(sys.argv[5]) if len(sys.argv) > 5 else -1
rank, lr = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
vramwatch.start(port=port, spool_dir=spool, interval=float(os.environ.get("BENCH_INTERVAL", "1.0")))
torch.cuda.set_device(lr)
dev = torch.device("cuda", lr)
try:
    dist.init_process_group("nccl", device_id=dev)
except TypeError:  # older torch: no device_id
    dist.init_process_group("nccl")
hold = torch.ones((rank + 1) * (8 << 20) // 4, device=dev)  # (rank+1) x 8 MiB tells the ranks apart
t = torch.ones(1 << 18, device=dev)
dist.all_reduce(t)
torch.cuda.synchronize()

def _s(v):
    return v.decode() if isinstance(v, bytes) else v

import pynvml as n
n.nvmlInit()
props = torch.cuda.get_device_properties(lr)
pci = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
uuid_pci = nvml_index = None
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    pi = n.nvmlDeviceGetPciInfo(h)
    if [pi.domain, pi.bus, pi.device] == pci:
        uuid_pci, nvml_index = _s(n.nvmlDeviceGetUUID(h)), i
info = {"rank": rank, "local_rank": lr, "pid": os.getpid(), "uuid_pci": uuid_pci, "nvml_index": nvml_index,
        "torch_uuid": str(props.uuid), "pci": pci, "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}

def write(name, obj):
    tmp = os.path.join(out_dir, name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, os.path.join(out_dir, name))

write(f"rank-{rank}.json", info)

def vw_cpu():
    total = 0.0
    for th in threading.enumerate():
        if th.name.startswith("vramwatch") and th.ident:
            total += time.clock_gettime(time.pthread_getcpuclockid(th.ident))
    return total

period = 0.5 if mode == "stall" else 0.05
window = float(os.environ.get("BENCH_CPU_WINDOW", "8"))
step, t0, cpu0 = 0, time.monotonic(), None
while True:
    if mode == "stall" and rank == stall_rank and step >= 6:
        write(f"stalled-{rank}.json", {"steps": step, "time": time.time()})
        time.sleep(3600)  # stuck in Python (GIL free): its sampler keeps publishing, its heartbeat ages
    dist.all_reduce(t)        # peers enqueue the collective ...
    vramwatch.step()
    torch.cuda.synchronize()  # ... and block here once a rank stops joining
    step += 1
    if mode == "steady":
        el = time.monotonic() - t0
        if cpu0 is None and el >= 3.0:
            cpu0 = (vw_cpu(), time.monotonic())
        elif cpu0 is not None and el >= 3.0 + window and not os.path.exists(os.path.join(out_dir, f"cpu-{rank}.json")):
            c1, w1 = vw_cpu(), time.monotonic()
            write(f"cpu-{rank}.json", {"share": (c1 - cpu0[0]) / (w1 - cpu0[1]), "window_s": w1 - cpu0[1]})
    time.sleep(period)
"""


# --- NVML, read from the pytest process (never CUDA) ---
def _s(v):
    return v.decode() if isinstance(v, bytes) else v


def nvml_gpus() -> list[dict]:
    import pynvml as n

    n.nvmlInit()
    out = []
    for i in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(i)
        pi = n.nvmlDeviceGetPciInfo(h)
        out.append(
            {
                "index": i,
                "uuid": _s(n.nvmlDeviceGetUUID(h)),
                "pci": (pi.domain, pi.bus, pi.device),
                "pids": sorted(p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)),
            }
        )
    return out


def gpu_count() -> int:
    try:
        return len(nvml_gpus())
    except Exception:  # noqa: BLE001 - no NVML: conftest skips these anyway
        return 0


def env_for(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("NCCL_DEBUG", "WARN")
    env.update(extra)
    return env


needs_two = pytest.mark.skipif(gpu_count() < 2, reason="needs two or more GPUs in this host")


@pytest.fixture(autouse=True)
def _need_torch():
    try:
        import torch  # noqa: F401 - whether the jobs can run; CUDA is never touched here
    except ImportError:
        pytest.skip("torch is not installed")


class Job:
    """A torchrun job in its own session, killed whole at the end (blocked NCCL ranks ignore SIGTERM)."""

    def __init__(self, tmp: Path, nproc: int, mode: str, *extra: str, **env: str) -> None:
        self.dir = tmp / f"job-{mode}-{free_port()}"
        self.dir.mkdir(parents=True)
        self.port = free_port()
        self.spool = str(self.dir / "spool")
        self.nproc = nproc
        script = self.dir / "rank.py"
        script.write_text(RANK_SCRIPT)
        self.log = open(self.dir / "job.log", "ab")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
            mode,
            str(self.dir),
            str(self.port),
            self.spool,
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd, env=env_for(**env), stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def metrics(self) -> dict:
        code, body = http_get(self.url(), timeout=5)
        assert code == 200, body
        return parse_metrics(body.decode())

    def info(self) -> dict[int, dict]:
        return {r: json.loads((self.dir / f"rank-{r}.json").read_text()) for r in range(self.nproc)}

    def wait_ready(self, timeout: float = 180) -> dict:
        def ready():
            assert self.proc.poll() is None, f"torchrun exited with {self.proc.returncode}:\n{self.tail()}"
            if not all((self.dir / f"rank-{r}.json").exists() for r in range(self.nproc)):
                return None
            m = self.metrics()
            ranks = {lab["rank"] for lab, _ in m.get("torch_cuda_memory_allocated_bytes", [])}
            return m if len(ranks) == self.nproc else None

        return wait_until(ready, timeout, f"{self.nproc} ranks with allocator series")

    def tail(self) -> str:
        self.log.flush()
        return (self.dir / "job.log").read_bytes()[-4000:].decode(errors="replace")

    def kill(self) -> None:
        # torchrun starts each worker in a session of its own: kill the ranks by pid, then the agent's group
        ranks = set(_descendants(self.proc.pid))
        for f in self.dir.glob("rank-*.json"):
            try:
                ranks.add(int(json.loads(f.read_text())["pid"]))
            except (OSError, ValueError, KeyError):
                pass
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.log.close()
        wait_until(lambda: not [p for p in ranks if _alive(p)], 30, "the ranks to be gone")
        # the rank-spawned server lingers a few seconds, then leaves on its own; stop it now
        try:
            pid = json.loads((Path(self.spool) / "server.json").read_text())["pid"]
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError, KeyError):
            pass


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), children first found, grandchildren after."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                raw = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2 :].split()[0] not in ("Z", "X")


def series_by_rank(m: dict, name: str) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list] = {}
    for lab, v in m.get(name, []):
        out.setdefault(lab["rank"], []).append((lab, v))
    return out


def check_join(m: dict, info: dict[int, dict], expected_uuid: dict[int, str] | None = None) -> None:
    """Every rank: one allocator series, on its own CUDA index, labelled with its physical GPU's UUID."""
    alloc = series_by_rank(m, "torch_cuda_memory_allocated_bytes")
    assert set(alloc) == {str(r) for r in info}, f"ranks on the one target: {sorted(alloc)}"
    for r, i in info.items():
        rows = alloc[str(r)]
        assert len(rows) == 1, f"rank {r} publishes series for devices it does not use: {rows}"
        lab, value = rows[0]
        assert lab["local_rank"] == str(i["local_rank"])
        assert lab["device"] == str(i["local_rank"]), "device label = the rank's CUDA index"
        assert value >= (r + 1) * (8 << 20), f"rank {r}'s own tensor is on its series: {value}"
        if i["uuid_pci"]:
            assert lab["uuid"] == i["uuid_pci"], f"rank {r}: label {lab['uuid']}, PCI join {i['uuid_pci']}"
        if expected_uuid is not None:
            assert lab["uuid"] == expected_uuid[r], f"rank {r}: label {lab['uuid']}, expected {expected_uuid[r]}"
    uuids = [alloc[str(r)][0][0]["uuid"] for r in info]
    assert len(set(uuids)) == len(uuids), f"two ranks joined to one GPU: {uuids}"


def check_no_stray_contexts(info: dict[int, dict], job_uuids: set[str]) -> None:
    """NVML's per-process lists: each rank on its own GPU only; no process on a GPU outside the job."""
    gpus = nvml_gpus()
    pids = {i["pid"]: r for r, i in info.items()}
    visible = any(p in g["pids"] for g in gpus for p in pids)
    for g in gpus:
        ours = [pids[p] for p in g["pids"] if p in pids]
        if visible:
            want = [r for r, i in info.items() if i["uuid_pci"] == g["uuid"]]
            assert sorted(ours) == sorted(want), f"GPU {g['index']} ({g['uuid']}) holds contexts of ranks {ours}"
        elif g["uuid"] in job_uuids:  # another PID namespace: count instead
            assert len(g["pids"]) == 1, f"GPU {g['index']}: {len(g['pids'])} compute processes, want 1"
        if g["uuid"] not in job_uuids:
            assert not ours, f"ranks {ours} made a context on GPU {g['index']}, which is not theirs"


@needs_two
def test_torchrun_one_target_every_rank_on_its_gpu(tmp_path):
    n = min(gpu_count(), 8)
    before = {g["uuid"]: len(g["pids"]) for g in nvml_gpus()}
    job = Job(tmp_path, n, "steady", BENCH_INTERVAL="1.0", BENCH_CPU_WINDOW="8")
    try:
        m = job.wait_ready()
        info = job.info()
        check_join(m, info)
        assert m["vramwatch_ranks"][0][1] == n, "one target serves every local rank"
        server = json.loads((Path(job.spool) / "server.json").read_text())
        assert server["port"] == job.port, "the one server the ranks share is the one we scrape"
        check_no_stray_contexts(info, {i["uuid_pci"] for i in info.values()})
        # the direct-cost figure, with every rank publishing (and this test scraping at 1 Hz)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((job.dir / f"cpu-{r}.json").exists() for r in range(n)):
            job.metrics()
            time.sleep(1.0)
        shares = {r: json.loads((job.dir / f"cpu-{r}.json").read_text())["share"] for r in range(n)}
        print(
            "vramwatch thread CPU share per rank:",
            {r: f"{s * 100:.4f}%" for r, s in shares.items()},
            "compute processes before:",
            before,
        )
        assert max(shares.values()) <= 0.0005, f"vramwatch threads above 0.05% of a core: {shares}"
    finally:
        job.kill()


def _pci_order(gpus: list[dict]) -> list[dict]:
    return sorted(gpus, key=lambda g: g["pci"])


@needs_two
@pytest.mark.parametrize("form", ["index", "uuid"])
def test_uuid_join_when_cuda_visible_devices_reorders_and_subsets(form, tmp_path):
    gpus = _pci_order(nvml_gpus())
    # the last GPU then the first: reordered, and a subset when there are three or more
    chosen = [gpus[-1], gpus[0]]
    if form == "index":  # integers count in CUDA's order; PCI_BUS_ID order makes it known
        cvd = ",".join(str(gpus.index(g)) for g in chosen)
        env = {"CUDA_VISIBLE_DEVICES": cvd, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    else:
        cvd = ",".join(g["uuid"] for g in chosen)
        env = {"CUDA_VISIBLE_DEVICES": cvd}
    job = Job(tmp_path, 2, "steady", BENCH_INTERVAL="0.2", **env)
    try:
        m = job.wait_ready()
        info = job.info()
        expected = {r: chosen[r]["uuid"] for r in range(2)}
        check_join(m, info, expected)
        check_no_stray_contexts(info, set(expected.values()))
    finally:
        job.kill()


@needs_two
def test_stalled_rank_heartbeat_ages_while_its_peers_block_in_nccl(tmp_path):
    n = min(gpu_count(), 4)
    stall = n - 1
    job = Job(tmp_path, n, "stall", str(stall), BENCH_INTERVAL="0.2")
    try:
        job.wait_ready()
        wait_until(lambda: (job.dir / f"stalled-{stall}.json").exists(), 60, "the stall")
        time.sleep(2.0)  # the peers are now blocked in the all-reduce the stalled rank never joins
        first = job.metrics()
        time.sleep(4.0)
        second = job.metrics()
        now = time.time()

        def per_rank(m, name):
            return {lab["rank"]: v for lab, v in m.get(name, [])}

        steps1, steps2 = (per_rank(x, "vramwatch_training_steps_total") for x in (first, second))
        last2 = per_rank(second, "vramwatch_training_last_step_timestamp_seconds")
        age2 = per_rank(second, "vramwatch_sample_age_seconds")
        print("steps", steps2, "heartbeat age", {r: round(now - t, 2) for r, t in last2.items()}, "sample age", age2)
        assert steps1 == steps2, f"no rank may advance while one is stalled: {steps1} -> {steps2}"
        s = str(stall)
        others = [r for r in steps2 if r != s]
        # NCCL collectives are asynchronous: a peer reports the step whose all-reduce it then waits on
        assert all(steps2[s] <= steps2[r] for r in others), f"the stalled rank has the fewest steps: {steps2}"
        assert all(last2[s] <= last2[r] for r in others), "the stalled rank's heartbeat is the oldest"
        assert now - max(last2.values()) > 4, "every heartbeat ages: the peers are blocked too"
        assert age2[s] < 2.0, "its sampler still publishes (stuck in Python, not dead): the series stay fresh"
        # who is the culprit: the peers' GPUs spin in the NCCL kernel (busy), the stalled rank's is idle
        uuid_of = {lab["rank"]: lab["uuid"] for lab, _ in second["torch_cuda_memory_allocated_bytes"]}
        util = {lab["uuid"]: v for lab, v in second.get("gpu_utilization_ratio", [])}
        print("utilisation by rank", {r: util.get(u) for r, u in uuid_of.items()})
        if util:
            assert util[uuid_of[s]] < 0.5, f"the stalled rank's GPU should be idle: {util[uuid_of[s]]}"
            assert all(util[uuid_of[r]] >= 0.5 for r in others), "the blocked peers' GPUs read busy"
    finally:
        job.kill()


def test_single_gpu_cuda_visible_devices_by_uuid(tmp_path):
    """CUDA_VISIBLE_DEVICES=GPU-<uuid>: the rank's cuda:0 is that GPU, and the series say so (1 GPU is enough)."""
    gpus = nvml_gpus()
    target = gpus[-1]  # on a multi-GPU host this is not NVML's GPU 0: a real remapping
    port = free_port()
    code = textwrap.dedent(r"""
        import sys, time, urllib.request
        import torch, vramwatch
        vramwatch.start(port=int(sys.argv[1]), spool_dir=sys.argv[2], interval=0.2, linger=0)
        x = torch.ones(4 << 20, device="cuda:0")
        print("count", torch.cuda.device_count(), flush=True)
        time.sleep(30)
    """)
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(port), str(tmp_path / "spool")],
        env=env_for(CUDA_VISIBLE_DEVICES=target["uuid"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline()
        assert line.startswith("count"), p.stderr.read() if p.poll() is not None else line
        assert line.split()[1] == "1", "one visible device"

        def series():
            code_, body = http_get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            rows = parse_metrics(body.decode()).get("torch_cuda_memory_allocated_bytes", []) if code_ == 200 else []
            return rows or None

        rows = wait_until(series, 30, "the allocator series")
        assert len(rows) == 1
        assert rows[0][0]["device"] == "0" and rows[0][0]["uuid"] == target["uuid"], rows
        pids_on = {g["uuid"]: g["pids"] for g in nvml_gpus()}
        if any(p.pid in v for v in pids_on.values()):
            assert [u for u, v in pids_on.items() if p.pid in v] == [target["uuid"]]
    finally:
        p.kill()
        p.wait(timeout=10)
