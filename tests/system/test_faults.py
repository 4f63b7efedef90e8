"""Fault injection on the simulated GPU: whatever breaks, training goes on unchanged and self-health says what.

- every allocator-source call in turn, and all at once (``SimAllocator.faults``), inside a rank that trains a
  deterministic CPU model: the final weights are bit-identical to a run without vramwatch;
- every NVML call in turn, and all at once (``SimNode.errors``), in the server;
- both at once;
- the server SIGKILLed under running ranks: a rank starts a new one (the promise in docs/security.md);
- a rank SIGKILLed: none of its series stay behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest

import vramwatch
from harness import Exporter, free_port, http_get, parse_metrics, start_sim_rank, stop_proc, vramwatch_env, wait_until
from vramwatch import spool
from vramwatch.sim.state import SimNode, state_path

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.e2e

ALLOCATOR_CALLS = ("devices", "stats", "backend", "uuid", "limit_bytes", "snapshot")
UNKNOWN = pynvml.NVML_ERROR_UNKNOWN
# NVML calls made on every read, and the collector whose `up` must show their failure
RUNTIME_CALLS = {
    "nvmlDeviceGetMemoryInfo": "nvml",
    "nvmlDeviceGetPowerUsage": "nvml",
    "nvmlDeviceGetEnforcedPowerLimit": "nvml",
    "nvmlDeviceGetUtilizationRates": "nvml",
    "nvmlDeviceGetTemperatureV": "nvml",
    "nvmlDeviceGetClockInfo": "nvml",
    "nvmlDeviceGetCurrentClocksEventReasons": "nvml",
    "nvmlDeviceGetTotalEnergyConsumption": "nvml",
    "nvmlDeviceGetTotalEccErrors": "nvml",
    "nvmlDeviceGetRemappedRows": "nvml",
    "nvmlDeviceGetPcieReplayCounter": "nvml",
    "nvmlDeviceGetFieldValues": "nvml",  # the GPU recovery action
    "nvmlDeviceGetComputeRunningProcesses": "processes",
    "nvmlEventSetWait": "xid",
}
# NVML calls made when the session (re)opens, and the collectors whose `up` must show their failure
INIT_CALLS = {
    "nvmlInit": {"nvml", "xid", "processes", "gpm", "nvlink"},
    "nvmlDeviceGetCount": {"nvml", "xid", "processes", "gpm", "nvlink"},
    "nvmlDeviceGetHandleByIndex": {"nvml"},
    "nvmlDeviceGetUUID": {"nvml"},
    "nvmlDeviceGetSupportedEventTypes": {"xid"},
    "nvmlDeviceRegisterEvents": {"xid"},
    "nvmlEventSetCreate": {"xid"},
}
# identity getters: a failure leaves that label empty (gpu_info stays) and `up` 0 until a slow-cadence
# re-enumeration reads them; one server for all four
IDENTITY_CALLS = ("nvmlSystemGetDriverVersion", "nvmlDeviceGetName", "nvmlDeviceGetPciInfo", "nvmlDeviceGetMigMode")
# not called while serving: fallbacks for older drivers (only after NOT_SUPPORTED), the lost GPU's probe
# and the Xid event set's release
NOT_ON_THE_READ_PATH = {
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetHandleByUUID",
    "nvmlEventSetFree",
}
# the GPM and NVLink collectors' calls (slow cadence): their failures, NOT_SUPPORTED and lost GPUs are
# injected one by one in tests/server/test_gpm_collector.py
GPM_AND_NVLINK_CALLS = {
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleFree",
    "nvmlGpmSampleGet",
    "nvmlGpmMetricsGet",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkErrorCounter",
}
# the MIG calls: made only for a card in MIG mode (the simulated node here has none); their errors are
# injected one by one in tests/server/test_mig.py
MIG_CALLS = {
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
}
FAST = {"nvml_interval": 0.1, "nvml_slow_interval": 0.3, "dead_rank_grace_seconds": 2}


def test_the_lists_cover_every_simulated_nvml_call():
    from vramwatch.sim.nvml import SimNvml

    calls = {n for n in dir(SimNvml) if n.startswith("nvml")}
    listed = set(RUNTIME_CALLS) | set(INIT_CALLS) | set(IDENTITY_CALLS) | NOT_ON_THE_READ_PATH | GPM_AND_NVLINK_CALLS
    listed |= MIG_CALLS
    assert calls == listed, f"new: {sorted(calls - listed)}, gone: {sorted(listed - calls)}"


# --- a deterministic training loop ---
def train(steps: int = 60, on_step=None) -> str:
    """SGD on a small MLP, CPU, one thread; returns the hash of the final weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(128, 16, generator=g)
        y = (x[:, :4].sum(1, keepdim=True) > 0).float()
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(steps):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if on_step is not None:
                on_step(loss.item())
        return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def baseline() -> str:
    assert vramwatch.current() is None
    return train()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    exp = Exporter(tmp_path_factory.mktemp("faults"), **FAST).start()
    yield exp
    exp.stop()


def _ups(exp: Exporter) -> dict[tuple[str, str], float]:
    m = exp.metrics()
    return {(lab["collector"], lab["rank"]): v for lab, v in m.get("vramwatch_collector_up", [])}


def _set_errors(exp: Exporter, errors: dict[str, int]) -> None:
    node = exp.node()
    node.errors = dict(errors)
    exp.save_node(node)


def _rank_in_process(exp: Exporter, faults: set[str]):
    h = vramwatch.start(
        simulate=True,
        serve="external",
        spool_dir=exp.spool,
        port=exp.port,
        interval=0.05,
        largest_block_interval=0.05,
        rank=0,
        local_rank=0,
        world_size=1,
        hostname="faults",
    )
    assert h.sim is not None
    h.sim.faults.update(faults)  # before the device exists, so nothing is cached from a good read
    h.sim.init(0)
    h.sim.allocate(2 << 30)
    return h


def _train_under_vramwatch(h) -> str:
    def on_step(loss: float) -> None:
        h.sim.allocate(64 << 20)
        h.sim.free(64 << 20)
        vramwatch.step(loss=loss)
        time.sleep(0.004)  # long enough for the sampler to run during training

    return train(on_step=on_step)


@pytest.mark.parametrize("faults", [{c} for c in ALLOCATOR_CALLS] + [{"*"}], ids=lambda f: "+".join(sorted(f)))
def test_allocator_faults_leave_training_identical(server, baseline, faults):
    h = _rank_in_process(server, faults)
    try:
        assert _train_under_vramwatch(h) == baseline
        wait_until(lambda: _ups(server).get(("allocator", "0")) == 0, 10, "allocator up 0 for rank 0")
        m = server.metrics()
        errs = {lab["rank"]: v for lab, v in m["vramwatch_collector_errors_total"] if lab["collector"] == "allocator"}
        assert errs["0"] > 0
        # the heartbeat is not the allocator: still counted, every step
        wait_until(lambda: _steps(server, "0") == 60, 5, "all 60 steps published")
        assert _ups(server)[("spool", "")] == 1 and _ups(server)[("nvml", "")] == 1
        h.sim.faults.clear()
        wait_until(lambda: _ups(server).get(("allocator", "0")) == 1, 10, "allocator up again")
        wait_until(lambda: server.metrics().get("torch_cuda_memory_allocated_bytes"), 10, "allocator series back")
    finally:
        vramwatch.stop()


def test_every_nvml_call_failing_in_turn_shows_in_the_right_collector(server):
    rank = start_sim_rank(server, 1, "--duration", "120", "--steps-per-second", "50")
    try:
        wait_until(lambda: _ups(server).get(("allocator", "1")) == 1, 15, "rank 1 publishing")
        for fn, collector in RUNTIME_CALLS.items():
            steps_before = _steps(server, "1")
            _set_errors(server, {fn: UNKNOWN})
            try:
                wait_until(lambda c=collector: _ups(server)[(c, "")] == 0, 8, f"{collector} up 0 under {fn}")
                ups = _ups(server)
                assert ups[("allocator", "1")] == 1 and ups[("spool", "")] == 1, (fn, ups)
            finally:
                _set_errors(server, {})
            wait_until(lambda: all(v == 1 for v in _ups(server).values()), 15, f"recovery after {fn}")
            # the rank's next sample (every 1 s) shows it trained on; a fault and its recovery can both
            # fall inside one sample interval, so wait for that sample rather than read at once
            wait_until(lambda b=steps_before: _steps(server, "1") > b, 5, f"the rank trains on after {fn}")
        assert rank.poll() is None
    finally:
        stop_proc(rank)


def _steps(exp: Exporter, rank: str) -> float:
    for lab, v in exp.metrics().get("vramwatch_training_steps_total", []):
        if lab["rank"] == rank:
            return v
    return -1.0


@pytest.mark.slow
def test_nvml_calls_failing_at_start(tmp_path):
    servers = {}
    try:
        cases = {**INIT_CALLS, IDENTITY_CALLS: {"nvml"}}
        for fn in cases:  # all at once: they are idle once up, and start in parallel
            exp = Exporter(tmp_path / ("identity" if fn == IDENTITY_CALLS else fn), **FAST)
            node = SimNode.default(1)
            node.errors = {f: UNKNOWN for f in ((fn,) if isinstance(fn, str) else fn)}
            node.save(state_path(exp.spool))
            exp.proc = subprocess.Popen(
                [sys.executable, "-m", "vramwatch", "serve"],
                env=exp.env,
                stdout=exp.log,
                stderr=exp.log,
                stdin=subprocess.DEVNULL,
            )
            servers[fn] = exp
        for fn, exp in servers.items():
            wait_until(lambda e=exp: http_get(e.url + "/-/healthy", 1)[0] == 200, 45, f"server under {fn}")
        time.sleep(1.0)
        for fn, expected in cases.items():
            ups = _ups(servers[fn])
            down = {c for (c, r), v in ups.items() if r == "" and v == 0}
            assert down == expected, f"{fn}: down {down}, expected {expected}"
            assert ups[("spool", "")] == 1
        for exp in servers.values():
            _set_errors(exp, {})
        for fn, exp in servers.items():
            wait_until(lambda e=exp: all(v == 1 for v in _ups(e).values()), 30, f"recovery after {fn}")
            assert servers[fn].metrics().get("gpu_info"), fn
    finally:
        for exp in servers.values():
            exp.stop()


def test_everything_failing_at_once(server, baseline):
    _set_errors(server, {"*": UNKNOWN, "nvmlEventSetWait": UNKNOWN})
    h = _rank_in_process(server, {"*"})
    try:
        assert _train_under_vramwatch(h) == baseline
        wanted = {("allocator", "0"): 0, ("nvml", ""): 0, ("xid", ""): 0, ("processes", ""): 0, ("spool", ""): 1}
        wait_until(lambda: all(_ups(server).get(k) == v for k, v in wanted.items()), 10, f"ups {wanted}")
        wait_until(lambda: _steps(server, "0") == 60, 5, "all 60 steps published")
        assert not server.metrics().get("gpu_power_watts"), "no stale readings while NVML fails"
        _set_errors(server, {})
        h.sim.faults.clear()
        wait_until(lambda: all(v == 1 for v in _ups(server).values()), 20, "everything up again")
    finally:
        vramwatch.stop()
        _set_errors(server, {})


# --- process deaths ---
def _server_pid(spool: str) -> int | None:
    try:
        with open(os.path.join(spool, "server.json")) as fh:
            return int(json.load(fh)["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is dead too
        return fh.read().split(") ", 1)[1][0] != "Z"


def test_a_killed_server_is_restarted_by_a_rank_while_ranks_train(tmp_path):
    spool, port = str(tmp_path / "spool"), free_port()
    os.makedirs(spool)
    SimNode.default(2).save(state_path(spool))
    ranks = []
    for r in range(2):
        env = vramwatch_env(spool, port, simulate=True, serve="auto", interval=0.2, linger=2, **FAST)
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", CUDA_VISIBLE_DEVICES=str(r))
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-m", "vramwatch.sim.worker", "--duration", "90"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    url = f"http://127.0.0.1:{port}/metrics"
    pids: list[int] = []
    try:

        def both_ranks():
            code, body = http_get(url, 1)
            m = parse_metrics(body.decode()) if code == 200 else {}
            return {lab["rank"]: v for lab, v in m.get("vramwatch_training_steps_total", [])}

        wait_until(lambda: len(both_ranks()) == 2, 30, "a rank-started server with both ranks")
        first = _server_pid(spool)
        assert first is not None
        pids.append(first)
        before = both_ranks()
        os.kill(first, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: not _alive(first), 5, "the server to die")
        wait_until(
            lambda: (_server_pid(spool) or first) != first and len(both_ranks()) == 2,
            30,
            "a new server, started by a rank",
        )
        pids.append(_server_pid(spool))
        took = time.monotonic() - killed
        assert took < 20, f"the server came back after {took:.1f} s"
        after = both_ranks()
        assert all(after[r] > before[r] for r in before), "the ranks trained on, and their counters carried over"
        assert all(p.poll() is None for p in ranks)
        # exactly one server: the other rank did not start a second one
        servers = [p for p in os.listdir("/proc") if p.isdigit() and _is_server_for(int(p), spool)]
        assert len(servers) == 1, servers
    finally:
        for p in ranks:
            stop_proc(p)
        for pid in pids:  # servers exit on their own once the ranks are gone; do not wait for the linger
            try:
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, TypeError):
                pass


def _is_server_for(pid: int, spool: str) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in cmd and f"VRAMWATCH_SPOOL_DIR={spool}".encode() in env and _alive(pid)


def test_a_sigkilled_rank_leaves_no_series_behind(server):
    ranks = {r: start_sim_rank(server, r, "--duration", "60", world_size=3) for r in (3, 4, 5)}
    try:
        wait_until(
            lambda: {"3", "4", "5"} <= {lab["rank"] for lab, _ in server.metrics().get("vramwatch_rank_info", [])},
            20,
            "three ranks",
        )
        os.kill(ranks[4].pid, signal.SIGKILL)
        ranks[4].wait(5)

        def rank4_gone(text: str) -> bool:
            return 'rank="4"' not in text and 'rank="3"' in text and 'rank="5"' in text

        # its memory and liveness series at once; its final counters after the grace window (2 s here)
        def memory_ranks() -> set[str]:
            return {lab["rank"] for lab, _ in server.metrics().get("torch_cuda_memory_allocated_bytes", [])}

        wait_until(lambda: memory_ranks() == {"3", "5"}, 3, "rank 4's memory series to go")
        wait_until(lambda: rank4_gone(server.scrape()), 2 + 3, "every rank=4 series to go")
        assert not [f for f in os.listdir(server.spool) if f.startswith("rank-4-")]
    finally:
        for p in ranks.values():
            stop_proc(p)


# --- the OOM snapshot directory broken ---
def _enospc_under(d: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write into a file under ``d`` fails as on a full file system (links planted there are not followed)."""
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(str(d) + os.sep):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("case", ["unwritable", "reported-full", "enospc", "over-cap"])
def test_a_broken_snapshot_directory_leaves_training_untouched(server, baseline, tmp_path, caplog, monkeypatch, case):
    from vramwatch.rank import oom
    from vramwatch.sim.allocator import SimOutOfMemoryError

    snaps = tmp_path / "snaps"
    extra = {}
    if case == "unwritable":
        (tmp_path / "a-file").write_text("")
        snaps = tmp_path / "a-file" / "snaps"  # root ignores permission bits; a file in the path stops anyone
    elif case == "enospc":
        _enospc_under(snaps, monkeypatch)
    elif case == "over-cap":
        extra["oom_snapshot_max_bytes"] = 64
    h = vramwatch.start(
        simulate=True,
        serve="external",
        spool_dir=server.spool,
        port=server.port,
        interval=0.05,
        rank=0,
        local_rank=0,
        world_size=1,
        oom_snapshot_dir=str(snaps),
        **extra,
    )
    try:
        if case == "reported-full":
            h.oom.disk_usage = lambda d: type("U", (), {"total": 1 << 40, "free": 0})()
        h.sim.init(0)
        h.sim.set_memory_fraction(0.1)
        ooms = 0

        def on_step(loss: float) -> None:
            nonlocal ooms
            try:
                h.sim.allocate(100 << 30)  # more than the budget: the job's own retry-smaller logic
            except SimOutOfMemoryError:
                ooms += 1
            vramwatch.step(loss=loss)

        assert train(on_step=on_step) == baseline
        assert ooms == 60 and h.oom.count == 60 and h.oom.snapshots == 0
        wait_until(
            lambda: any(v == 60 for _, v in server.metrics().get("torch_cuda_memory_ooms_total", [])),
            10,
            "all 60 OOMs counted at the server",
        )
        assert not server.metrics().get("vramwatch_oom_snapshot_info")
        left = [p for p in (os.listdir(snaps) if snaps.is_dir() else []) if not os.path.islink(snaps / p)]
        assert not left, f"no snapshot, no partial file: {left}"
        assert oom.snapshot_files(str(snaps)) == []
        why = {
            "unwritable": "cannot write OOM snapshots",
            "reported-full": "nearly full",
            "enospc": "No space left on device",
            "over-cap": "larger than",
        }[case]
        assert why in caplog.text
    finally:
        vramwatch.stop()


def test_a_gpu_lost_before_the_server_starts_reads_gpu_up_0(tmp_path):
    """A server (re)started on a node whose GPU is already lost: the GPU keeps its series, at gpu_up 0, so
    GPULost keeps firing instead of resolving on the missing series."""
    exp = Exporter(tmp_path, gpus=2, **FAST)
    node = exp.node()
    node.gpu(1).lost = True
    exp.save_node(node)
    exp.start()
    try:
        want = {"0": 1.0, "1": 0.0}
        wait_until(lambda: {lab["gpu"]: v for lab, v in exp.metrics().get("gpu_up", [])} == want, 15, f"gpu_up {want}")
        assert _ups(exp)[("nvml", "")] == 0
    finally:
        exp.stop()


# --- the spool removed under a running job ---
def _remove(path: str, then_file: bool = False) -> None:
    """rm -rf under writers (as RemoveIPC does it): a file made while it runs makes rmtree fail, so again;
    with ``then_file`` a file takes the directory's place."""
    for _ in range(50):
        try:
            shutil.rmtree(path)
            if then_file:
                with open(path, "x"):
                    pass
            return
        except OSError:
            continue
    raise AssertionError(f"could not remove {path}")


def _rank_steps(exp: Exporter) -> dict[str, float]:
    return {lab["rank"]: v for lab, v in exp.metrics().get("vramwatch_training_steps_total", [])}


def test_a_spool_removed_under_a_running_job_is_made_again_and_the_rank_seen_again(exporter, sim_rank):
    """systemd-logind's RemoveIPC empties /dev/shm at logout: rank and server both make the spool again; while
    neither can (a file where it was), the spool collector reads up 0, which the collector-down alert sees."""

    exp = exporter(**FAST).start()
    sim_rank(exp, 0, "--duration", "90", "--steps-per-second", "50")
    wait_until(lambda: _rank_steps(exp).get("0", 0) > 0, 20, "rank 0 publishing")
    errors_before = _spool_errors(exp)
    for _ in range(2):  # the second time, the spool the first recovery made
        steps = _rank_steps(exp)["0"]
        _remove(exp.spool)
        wait_until(lambda s=steps: _rank_steps(exp).get("0", 0) > s + 10, 15, "rank 0 seen again, training on")
        info = os.path.join(exp.spool, spool.SERVER_INFO)
        wait_until(lambda i=info: spool.server_running(exp.spool) and os.path.exists(i), 5, "the server's lock, again")
        assert os.stat(exp.spool).st_mode & 0o777 == 0o700
    # counted by the server's guard; a scrape shows it within the cache's freshness (one render gap)
    wait_until(lambda: _spool_errors(exp) >= errors_before + 2, 5, "each vanishing counted")
    # a spool that cannot be made again: an alertable series, then recovery once it can
    _remove(exp.spool, then_file=True)
    wait_until(lambda: _ups(exp)[("spool", "")] == 0, 10, "spool up 0 while it cannot be made again")
    assert "0" not in _rank_steps(exp)
    os.unlink(exp.spool)
    wait_until(lambda: _ups(exp)[("spool", "")] == 1 and "0" in _rank_steps(exp), 15, "spool back, rank back")
    with open(exp.log.name, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    assert "vanished under this rank" in text and "vanished (removed at logout" in text
    assert "cannot be made again" in text


def _spool_errors(exp: Exporter) -> float:
    m = exp.metrics()
    return next(v for lab, v in m["vramwatch_collector_errors_total"] if lab["collector"] == "spool")
