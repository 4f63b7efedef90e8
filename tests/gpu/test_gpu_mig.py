"""On a real NVIDIA GPU: the MIG enumeration reads the mode, finds what nvidia-smi finds, and changes nothing.

    python3 -m pytest -m gpu tests/gpu/test_gpu_mig.py      (skipped without a GPU; see conftest.py)

Read-only: it never sets a MIG mode and never creates or destroys an instance (that needs root, a GPU reset
and an idle card: not for a shared test machine). On a card not in MIG mode (an H200 as lent) it checks
that the enumeration reports MIG off, asks nothing beyond the mode and leaves the mode as it was; on a card
already in MIG mode it checks the instances against ``nvidia-smi -L``.
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import Any

import pytest
from jobs import job_env, run_job

from harness.nvml_calls import CountingNvml
from vramwatch.config import Settings
from vramwatch.server import nvml_backend as nb
from vramwatch.server.collectors import Runner, ScrapeContext
from vramwatch.server.collectors.nvml import NvmlCollector

pytestmark = pytest.mark.gpu
_MIG_LINE = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+\d+:\s+\(UUID:\s+(MIG-[0-9a-f-]+)\)", re.M)


def _modes(nv: Any) -> dict[str, tuple[int, int] | str]:
    out: dict[str, tuple[int, int] | str] = {}
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        uuid = nb.text(nv.nvmlDeviceGetUUID(h))
        try:
            current, pending = nv.nvmlDeviceGetMigMode(h)
            out[uuid] = (int(current), int(pending))
        except nv.NVMLError as e:
            out[uuid] = nb.error_name(e)
    return out


def _smi_mig() -> dict[str, str]:
    """MIG uuid -> profile, as ``nvidia-smi -L`` lists them (none on a card not in MIG mode)."""
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    return {uuid: profile for profile, uuid in _MIG_LINE.findall(out)}


def test_enumeration_reads_the_mode_and_changes_nothing(tmp_path):
    import pynvml

    nv = CountingNvml(pynvml)
    before = _modes(pynvml)
    settings = Settings(spool_dir=str(tmp_path), nvml_interval=1.0, nvml_slow_interval=2.0)
    session = nb.NvmlSession(settings, module=nv)
    runner = Runner(NvmlCollector(settings, session), settings)
    t0 = time.perf_counter()
    for _ in range(3):
        runner.poll_once()  # the first is a slow read: the enumeration runs
    elapsed = time.perf_counter() - t0
    assert runner.health.up == 1, session.last_error
    fams = {f.name: f for f in runner.collect(ScrapeContext((), time.time(), "gpu-test"))}
    info = {s.labels["uuid"]: s.labels["mig_mode"] for s in fams["gpu_info"].samples}
    # (a node without a card in MIG mode has no gpu_mig_* family at all)
    mig = {s.labels["uuid"]: s.labels for s in fams["gpu_mig_info"].samples} if "gpu_mig_info" in fams else {}
    totals = {
        s.labels["uuid"]: s.value
        for s in fams.get("gpu_mig_memory_total_bytes", ()) and fams["gpu_mig_memory_total_bytes"].samples
    }
    card_totals = {s.labels["uuid"]: s.value for s in fams["gpu_memory_total_bytes"].samples}
    print(f"MIG modes {before}; 3 reads {elapsed * 1000:.1f} ms; calls {dict(nv.calls)}")

    for uuid, mode in before.items():
        expected = "unsupported" if isinstance(mode, str) else ("enabled" if mode[0] else "disabled")
        assert info[uuid] == expected, (uuid, mode, info)
    if all(isinstance(m, str) or not m[0] for m in before.values()):
        # no card in MIG mode: no instance series, and nothing asked beyond the mode
        assert mig == {} and totals == {} and not [n for n in fams if n.startswith("gpu_mig_")]
        assert nv.calls["nvmlDeviceGetMaxMigDeviceCount"] == 0
        assert nv.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == 0
        assert _smi_mig() == {}
    else:
        # a card already in MIG mode (set up by its owner): the instances nvidia-smi lists, within their card
        assert {u: lab["profile"] for u, lab in mig.items()} == _smi_mig()
        for u, lab in mig.items():
            assert u.startswith("MIG-") and lab["parent_uuid"].startswith("GPU-")
            assert 0 < totals[u] <= card_totals.get(lab["parent_uuid"], float("inf"))
    assert _modes(pynvml) == before  # current and pending: nothing was changed


def test_torch_uuid_rule_gives_nvmls_uuid():
    """The rank's rule on this card: torch's bare uuid and name -> NVML's uuid (MIG- on an instance)."""
    pytest.importorskip("torch")
    res = run_job(
        """
        import torch
        from vramwatch.rank.device_uuid import device_uuid
        p = torch.cuda.get_device_properties(0)   # no context (torch-nvml.md B4)
        ours = device_uuid(str(p.uuid), p.name, 0, os.environ.get("CUDA_VISIBLE_DEVICES"))
        import pynvml as n
        n.nvmlInit()
        names = [_s(n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i))) for i in range(n.nvmlDeviceGetCount())]
        done({"ours": ours, "raw": str(p.uuid), "name": p.name, "nvml": names,
              "context": bool(torch._C._cuda_hasPrimaryContext(0))})
        """,
        env=job_env(one_device=True),
    )
    print(res)
    assert res["ours"] in res["nvml"], res
    assert not res["context"]
