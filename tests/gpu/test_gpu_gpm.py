"""On a real GPU: the server's GPM collector while a real torch load runs, against nvidia-smi.

    python3 -m pytest -m gpu tests/gpu/test_gpu_gpm.py -q -s

A job process (the pytest process never touches CUDA) runs two phases on one GPU: bf16 matmuls
(compute-bound: tensor cores busy) and then large device-to-device copies (memory-bound: DRAM
bandwidth high, no tensor work). The test reads the server's own ``GpmCollector`` through the framework's
``Runner`` once a second, keeps the readings whose whole interval fell inside one phase, and samples
``nvidia-smi --query-gpu=utilization.gpu,utilization.memory`` (and ``nvidia-smi dmon -s u``) meanwhile.

Checked (loose bounds, since the sources sample differently):
- every ratio is within [0, 1.01] and every throughput >= 0 (PCIe below 128 GB/s, a Gen5 x16 link);
- SM activity rises under the matmuls by at least 0.3 over idle, and tensor activity is higher in the
  matmul phase than in the copy phase by at least 0.2; DRAM bandwidth peaks higher in the copy phase than
  in the matmul phase (the "compute- or memory-bound?" panel's reading);
- where GPM and nvidia-smi overlap: SM activity (share of SMs busy) cannot exceed the share of time
  any kernel ran (utilization.gpu) by more than 0.15, and under load both are high.

If the GPU has no GPM here (an older part, MIG, a VM that hides the counters), the NVML error code is
recorded and the test skips with it in the reason. With ``OUT`` set, everything measured (values per
phase, nvidia-smi's figures, the cost of each GPM read) is written to ``$OUT/gpm.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jobs import PRELUDE, job_env

from vramwatch.config import Settings
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import Runner
from vramwatch.server.collectors.gpm import FAMILIES, GpmCollector
from vramwatch.server.collectors.nvlink import NvlinkCollector

pytestmark = pytest.mark.gpu
PHASE_SECONDS = 6.0
RATIO_MAX = 1.01  # GPM reports percentages; a rounding step above 100 is not a fault
PCIE_MAX = 128e9

LOAD = r"""
phase_file, seconds = sys.argv[1], float(sys.argv[2])
import torch
props = torch.cuda.get_device_properties(0)
pci = [props.pci_domain_id, props.pci_bus_id, props.pci_device_id]
uuid = next(g["uuid"] for g in nvml_state() if g["pci"] == pci)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
for _ in range(3):
    a @ b
    dst.copy_(src)
torch.cuda.synchronize()

def mark(phase):
    with open(phase_file, "a") as fh:
        fh.write(f"{time.time()} {phase} {uuid}\n")

counts = {}
for phase in ("matmul", "copy"):
    mark(phase)
    end, n, t0 = time.time() + seconds, 0, time.time()
    while time.time() < end:
        for _ in range(8):
            if phase == "matmul":
                a @ b
            else:
                dst.copy_(src)
        torch.cuda.synchronize()
        n += 8
    el = time.time() - t0
    counts[phase] = {"ops": n, "seconds": el}
mark("end")
flops = 2 * 8192**3 * counts["matmul"]["ops"] / counts["matmul"]["seconds"]
copy_bw = 2 * (4 << 30) * counts["copy"]["ops"] / counts["copy"]["seconds"]  # read + write
done({"uuid": uuid, "counts": counts, "matmul_tflops": flops / 1e12, "copy_bytes_per_second": copy_bw})
"""


def smi_util(uuid: str) -> tuple[float, float] | None:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid,utilization.gpu,utilization.memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0] == uuid:
            try:
                return float(parts[1]) / 100.0, float(parts[2]) / 100.0
            except ValueError:
                return None  # [N/A]
    return None


def write_out(result: dict) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpm.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    print("\nGPM on the GPU: " + json.dumps(result, sort_keys=True)[:3000])


def phases(path: Path) -> list[tuple[float, str]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        t, name, _ = line.split(" ", 2)
        rows.append((float(t), name))
    return rows


def phase_at(marks: list[tuple[float, str]], t: float) -> str:
    current = "idle"
    for start, name in marks:
        if start <= t:
            current = name
    return current


def test_gpm_follows_a_real_load(tmp_path):
    pytest.importorskip("torch")
    settings = Settings(simulate=False, spool_dir=str(tmp_path / "spool"))
    session = nb.NvmlSession(settings)
    assert session.ensure(), f"NVML: {session.last_error}"
    gpm = GpmCollector(settings, session)
    runner = Runner(gpm, settings)
    nvlink = Runner(NvlinkCollector(settings, session), settings)
    result: dict = {"driver": session.driver_version, "gpus": [d.name for d in session.devices]}

    # --- idle: prime, then two readings ---
    costs: list[float] = []
    readings: list[dict] = []

    def poll() -> None:
        t = time.time()  # when this read's sample is taken: its interval ends here and began at the last one
        runner.poll_once()
        costs.append(runner.health.duration)
        snap = runner.snapshot or ()
        readings.append({"t": t, "values": {g.uuid: dict(g.values) for g in snap}})

    poll()
    nvlink.poll_once()
    assert isinstance(nvlink.collector, NvlinkCollector)
    result["nvlink"] = {
        "up": nvlink.health.up,
        "unavailable": nvlink.collector.unavailable,
        "links": {g.uuid: sorted({link for link, _, _ in g.counts}) for g in (nvlink.snapshot or ())},
        "read_seconds": nvlink.health.duration,
    }
    if gpm.unavailable and len(gpm.unavailable) == len(session.devices):
        result.update(gpm_supported=False, unavailable=gpm.unavailable, collector_up=runner.health.up)
        write_out(result)
        assert runner.health.up == 1, "a GPU without GPM keeps the collector up"
        pytest.skip(f"GPM is unavailable here: {sorted(set(gpm.unavailable.values()))}")
    result.update(gpm_supported=True, unavailable=gpm.unavailable)
    for _ in range(2):
        time.sleep(1.0)
        poll()

    # --- the load, read once a second while it runs ---
    phase_file = tmp_path / "phases.txt"
    code = PRELUDE + textwrap.dedent(LOAD)
    job = subprocess.Popen(
        [sys.executable, "-c", code, str(phase_file), str(PHASE_SECONDS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=job_env(one_device=True),
    )
    smi: list[dict] = []
    dmon = None
    try:
        deadline = time.monotonic() + 120
        while not phases(phase_file) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        marks = phases(phase_file)
        assert marks, f"the load never started: {job.communicate(timeout=30)}"
        uuid = Path(phase_file).read_text().split()[2]
        index = next(d.index for d in session.devices if d.uuid == uuid)
        dmon = subprocess.Popen(
            ["nvidia-smi", "dmon", "-s", "u", "-i", str(index), "-c", str(int(2 * PHASE_SECONDS))],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        poll()  # the interval before the load started: mixed, dropped below
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)
            poll()
            u = smi_util(uuid)
            if u is not None:
                smi.append({"t": time.time(), "gpu": u[0], "memory": u[1]})
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
        dmon_text = ""
        if dmon is not None:
            try:
                dmon_text = dmon.communicate(timeout=20)[0]
            except subprocess.TimeoutExpired:
                dmon.kill()
        runner.collector.close()
    assert job.returncode == 0, f"the load failed: {err[-3000:]}"
    load = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    marks = phases(phase_file)

    # --- sort the readings by phase (only intervals wholly inside one phase) ---
    by_phase: dict[str, list[dict[str, float]]] = {}
    for prev, r in zip(readings, readings[1:], strict=False):
        a, b = phase_at(marks, prev["t"]), phase_at(marks, r["t"])
        if a == b and r["values"].get(uuid):  # phases never repeat: the same at both ends is one phase
            by_phase.setdefault(a, []).append(r["values"][uuid])
    smi_phase: dict[str, list[dict]] = {}
    for s in smi:
        smi_phase.setdefault(phase_at(marks, s["t"] - 0.5), []).append(s)

    def peak(phase: str, name: str) -> float:
        return max((v.get(name, 0.0) for v in by_phase.get(phase, [])), default=0.0)

    result.update(
        uuid=uuid,
        load=load,
        readings_by_phase=by_phase,
        nvidia_smi_by_phase=smi_phase,
        nvidia_smi_dmon=dmon_text.strip().splitlines()[-16:],
        read_cost_seconds={
            "median": statistics.median(costs),
            "max": max(costs),
            "count": len(costs),
            "gpus_read": len(session.devices) - len(gpm.unavailable),
        },
        families_seen=sorted({n for vs in by_phase.values() for v in vs for n in v}),
        collector={"up": runner.health.up, "errors": runner.health.errors, "last_failure": gpm.last_failure},
    )
    write_out(result)

    # --- in range ---
    for phase, values in by_phase.items():
        for v in values:
            for name, x in v.items():
                assert x >= 0.0, f"{name} negative in {phase}: {x}"
                if name.endswith("_ratio"):
                    assert x <= RATIO_MAX, f"{name} above 1 in {phase}: {x}"
                if name.startswith("gpu_pcie"):
                    assert x <= PCIE_MAX, f"{name} beyond a PCIe Gen5 x16 link in {phase}: {x}"
    assert set(FAMILIES[:4]) <= set(result["families_seen"]), result["families_seen"]
    assert by_phase.get("idle") and by_phase.get("matmul") and by_phase.get("copy"), (
        {k: len(v) for k, v in by_phase.items()},
        result["collector"],
    )

    # --- it follows the load ---
    idle_sm = min(v.get("gpu_sm_activity_ratio", 1.0) for v in by_phase["idle"])
    assert peak("matmul", "gpu_sm_activity_ratio") >= idle_sm + 0.3, by_phase
    assert peak("matmul", "gpu_tensor_activity_ratio") >= peak("copy", "gpu_tensor_activity_ratio") + 0.2, by_phase
    copy_dram = peak("copy", "gpu_dram_bandwidth_utilization_ratio")
    assert copy_dram > peak("idle", "gpu_dram_bandwidth_utilization_ratio"), by_phase
    assert copy_dram > peak("matmul", "gpu_dram_bandwidth_utilization_ratio"), by_phase  # memory- vs compute-bound

    # --- against nvidia-smi where they overlap ---
    busy = [s["gpu"] for s in smi_phase.get("matmul", [])]
    if busy:
        assert max(busy) >= 0.5, f"nvidia-smi sees no load: {smi_phase}"
        assert peak("matmul", "gpu_sm_activity_ratio") <= max(busy) + 0.15, (by_phase, smi_phase)

    # --- the cost of one read (every GPU of the node) ---
    assert statistics.median(costs) < 0.05 * max(1, len(session.devices)), costs
