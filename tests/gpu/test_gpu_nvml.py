"""On a real NVIDIA GPU: our NVML figures against nvidia-smi, the Xid watcher registered, no CUDA context.

    python3 -m pytest -m gpu tests/gpu      (skipped without a GPU; see conftest.py)

Never provokes an Xid: the watcher is only registered and left waiting. Safe on a shared card: it reads,
and the one CUDA context it makes is a small torch rank of its own (to prove the check can see one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import Exporter, free_port, http_get, parse_metrics, stop_proc, vramwatch_env, wait_until
from vramwatch.config import Settings
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import Runner
from vramwatch.server.collectors.xid import PREINIT, XidCollector, XidLedger, XidWatcher

pytestmark = pytest.mark.gpu
MIB = 1 << 20
SMI_FIELDS = (
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "driver_version",
    "memory.total",
    "memory.used",
    "power.draw",
    "enforced.power.limit",
    "temperature.gpu",
    "clocks.sm",
    "clocks.mem",
    "utilization.gpu",
    "mig.mode.current",
)


def smi() -> dict[str, dict[str, str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    rows = {}
    for line in out.strip().splitlines():
        values = dict(zip(SMI_FIELDS, (v.strip() for v in line.split(",")), strict=True))
        rows[values["uuid"]] = values
    return rows


def number(v: str) -> float | None:
    try:
        return float(v)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def by_uuid(metrics: dict, name: str) -> dict[str, float]:
    return {lab["uuid"]: v for lab, v in metrics.get(name, [])}


@pytest.fixture
def server(tmp_path):
    exp = Exporter(tmp_path, simulate=False, nvml_slow_interval=1, xid=True)
    exp.start()
    count = len(smi())
    wait_until(lambda: len(exp.metrics().get("gpu_up", [])) == count, 20, "every GPU in gpu_up")
    time.sleep(1.5)  # one slow round too
    yield exp
    exp.stop()


def test_power_follows_nvidia_smi(server):
    """Power moves within a second (an idle H200 swings 80-120 W as contexts come and go), and our
    snapshot may be a second older than nvidia-smi's reading: compare the median gap of paired reads."""
    gaps: dict[str, list[float]] = {}
    for _ in range(6):
        ours = by_uuid(server.metrics(), "gpu_power_watts")
        for uuid, r in smi().items():
            want = number(r["power.draw"])
            if want is not None and uuid in ours:
                gaps.setdefault(uuid, []).append(abs(ours[uuid] - want))
        time.sleep(1.0)
    for uuid, g in gaps.items():
        g.sort()
        assert g[len(g) // 2] <= 25.0, f"power of {uuid}: gaps to nvidia-smi {g} W"


def test_figures_match_nvidia_smi(server):
    before = server.metrics()
    ref = smi()
    after = server.metrics()
    assert set(by_uuid(before, "gpu_up")) == set(ref), "the same GPUs as nvidia-smi, by uuid"
    info = {lab["uuid"]: lab for lab, _ in after["gpu_info"]}

    def near(name: str, uuid: str, want: float | None, tol: float, scale: float = 1.0) -> None:
        if want is None:
            return  # nvidia-smi has no figure (N/A): nothing to compare
        got = [by_uuid(m, name).get(uuid) for m in (before, after)]
        got = [g / scale for g in got if g is not None]
        assert got, f"{name} missing for {uuid} while nvidia-smi reports {want}"
        lo, hi = min(got) - tol, max(got) + tol
        assert lo <= want <= hi, f"{name} {uuid}: ours {got}, nvidia-smi {want} (tolerance {tol})"

    for uuid, r in ref.items():
        i = info[uuid]
        assert i["gpu"] == r["index"] and i["name"] == r["name"] and i["driver_version"] == r["driver_version"]
        assert i["pci_bus_id"].lower() == r["pci.bus_id"].lower()
        assert i["mig_mode"] in ("enabled", "disabled", "unsupported")
        if r["mig.mode.current"] in ("Enabled", "Disabled"):
            assert i["mig_mode"] == r["mig.mode.current"].lower()
        assert by_uuid(after, "gpu_up")[uuid] == 1.0
        total = number(r["memory.total"])
        near("gpu_memory_total_bytes", uuid, total, 1.0, MIB)
        near("gpu_memory_used_bytes", uuid, number(r["memory.used"]), max(256.0, 0.02 * (total or 0)), MIB)
        near("gpu_power_limit_watts", uuid, number(r["enforced.power.limit"]), 1.0)
        near("gpu_temperature_celsius", uuid, number(r["temperature.gpu"]), 3.0)
        near("gpu_sm_clock_hertz", uuid, number(r["clocks.sm"]), 150.0, 1e6)
        near("gpu_memory_clock_hertz", uuid, number(r["clocks.mem"]), 150.0, 1e6)
        util = number(r["utilization.gpu"])
        near("gpu_utilization_ratio", uuid, None if util is None else util / 100.0, 0.35)
        for name in ("gpu_utilization_ratio", "gpu_memory_utilization_ratio"):
            v = by_uuid(after, name).get(uuid)
            assert v is None or 0.0 <= v <= 1.0, f"{name} is a ratio: {v}"
        # one NVML call: total = used + free (+ the driver's reservation with the v2 call)
        t, u, f = (
            by_uuid(after, n)[uuid]
            for n in ("gpu_memory_total_bytes", "gpu_memory_used_bytes", "gpu_memory_free_bytes")
        )
        assert t == u + f + by_uuid(after, "gpu_memory_reserved_bytes").get(uuid, 0.0)
        energy = by_uuid(after, "gpu_energy_joules_total").get(uuid)
        assert energy is None or energy > 0
        reasons = [lab["reason"] for lab, _ in after.get("gpu_clock_throttle", []) if lab["uuid"] == uuid]
        assert len(reasons) in (0, 11)
    up = {lab["collector"]: v for lab, v in after["vramwatch_collector_up"]}
    assert up["nvml"] == 1 and up["xid"] == 1 and up["processes"] == 1
    dur = {lab["collector"]: v for lab, v in after["vramwatch_collector_duration_seconds"]}
    print(
        f"\nmeasured on {len(ref)} GPU(s): nvml read {dur['nvml'] * 1e3:.2f} ms, "
        f"processes {dur['processes'] * 1e3:.2f} ms"
    )
    assert dur["nvml"] < 0.25


def test_the_recovery_action_matches_nvml_or_is_absent(server):
    """Where the driver has NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: one state at 1 per GPU, the one NVML
    reports (a healthy card: none); where it lacks it: no series, and the collector stays up."""
    import pynvml

    from vramwatch.monitoring import xid_catalogue

    pynvml.nvmlInit()
    want: dict[str, str | None] = {}
    for uuid in smi():
        h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        (v,) = pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
        want[uuid] = xid_catalogue.recovery_action(v.value.uiVal) if v.nvmlReturn == pynvml.NVML_SUCCESS else None
    m = server.metrics()
    got: dict[str, list[str]] = {}
    for lab, value in m.get("gpu_recovery_action", []):
        got.setdefault(lab["uuid"], [])
        if value == 1.0:
            got[lab["uuid"]].append(lab["action"])
    for uuid, state in want.items():
        assert got.get(uuid) == ([state] if state else None), (uuid, state, got.get(uuid))
    up = {lab["collector"]: v for lab, v in m["vramwatch_collector_up"] if not lab.get("rank")}
    assert up["nvml"] == 1.0


def test_xid_watcher_registers_and_waits_without_errors(tmp_path):
    settings = Settings(simulate=False, spool_dir=str(tmp_path))
    session = nb.NvmlSession(settings)
    ledger = XidLedger()
    watcher = XidWatcher(session, ledger, settings, wait_ms=1000)
    assert watcher.step() == 0.0  # registration, then one 1 s wait
    if not watcher.registered:
        pytest.skip("no GPU here offers Xid events through NVML")
    for _ in range(2):
        t0 = time.monotonic()
        assert watcher.step() == 0.0
        assert time.monotonic() - t0 < 1.6  # the wait is bounded (it may return early on an event)
    assert watcher.health.up == 1 and watcher.health.errors == 0
    rows = [r for r in ledger.counts() if r.uuid in watcher.registered]
    assert {r[2] for r in rows} >= {str(x) for x in PREINIT}  # pre-initialised on every watched GPU
    watcher.close()
    # the collector's thread stops within one wait
    xid = XidCollector(settings, session, wait_ms=2000)
    c = Runner(xid, settings)
    c.start()
    wait_until(lambda: xid.watcher.registered, 10, "the watcher thread to register")
    t0 = time.monotonic()
    c.stop()
    assert time.monotonic() - t0 < 4.0 and not c.running


PROBE = r"""
import json, logging, os, signal, sys, threading, time
logging.basicConfig(level=logging.INFO)
from vramwatch import config
from vramwatch.server.main import Server
settings, _ = config.load()
server = Server(settings)
assert server.open()
def report():
    while True:
        time.sleep(1.0)
        maps = open(f"/proc/{os.getpid()}/maps").read()
        out = {"pid": os.getpid(), "torch": "torch" in sys.modules,
               "libcuda": "libcuda.so" in maps, "libtorch": "libtorch" in maps}
        with open(sys.argv[1] + ".tmp", "w") as fh:
            json.dump(out, fh)
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
threading.Thread(target=report, daemon=True).start()
signal.signal(signal.SIGTERM, lambda *_: server.stop())
server.run()
"""

RANK = r"""
import sys, time
import torch
import vramwatch
vramwatch.start(serve="external", interval=0.2)
x = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
end = time.time() + float(sys.argv[1])
while time.time() < end:
    vramwatch.step()
    time.sleep(0.05)
vramwatch.stop()
"""


def test_server_creates_no_cuda_context(tmp_path):
    pytest.importorskip("torch")
    import pynvml

    spool, port = str(tmp_path / "spool"), free_port()
    os.makedirs(spool)
    env = vramwatch_env(spool, port, nvml_slow_interval=1)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    report = tmp_path / "server-report.json"
    log = open(tmp_path / "logs.txt", "ab")
    server = subprocess.Popen([sys.executable, "-c", PROBE, str(report)], env=env, stdout=log, stderr=log)
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, "60"],
        env=dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"),
        stdout=log,
        stderr=log,
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"

        def joined():
            code, body = http_get(url, 2)
            m = parse_metrics(body.decode()) if code == 200 else {}
            ranks = {lab["uuid"] for lab, _ in m.get("torch_cuda_memory_reserved_bytes", [])}
            return m if ranks and ranks <= {lab["uuid"] for lab, _ in m.get("gpu_info", [])} else None

        m = wait_until(joined, 90, "the torch rank's series, joined to gpu_info by uuid")
        wait_until(report.exists, 10, "the server's report")
        time.sleep(2.5)  # a few more NVML and process reads with the rank's context on the card
        probe = json.loads(report.read_text())
        assert probe["torch"] is False, "the server imported torch"
        # libcuda.so is mapped by nvmlInit itself on driver 580 (measured: any NVML user maps it); a
        # mapped library is not a context: NVML's process list below is what shows a context
        assert probe["libtorch"] is False, "the server loaded torch"
        pynvml.nvmlInit()
        pids: dict[str, set[int]] = {}
        for _ in range(5):  # a few looks over two seconds of NVML and process reads
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                pids[pynvml.nvmlDeviceGetUUID(h)] = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
            everyone = set().union(*pids.values())
            assert server.pid not in everyone and probe["pid"] not in everyone, "the server holds a CUDA context"
            time.sleep(0.5)
        rank_uuid = next(lab["uuid"] for lab, _ in m["torch_cuda_memory_reserved_bytes"])
        if rank.pid not in pids[rank_uuid]:
            pytest.skip("NVML reports pids of another pid namespace here; the maps check above still holds")
        # the rank is the job's, not a foreign process; its context shows as non-torch memory
        m = parse_metrics(http_get(url, 2)[1].decode())
        foreign = by_uuid(m, "gpu_foreign_processes").get(rank_uuid)
        assert foreign is not None and foreign <= len(pids[rank_uuid]) - 1
        assert by_uuid(m, "gpu_non_torch_memory_bytes")[rank_uuid] > 0
    finally:
        stop_proc(rank)
        stop_proc(server)
        log.close()
