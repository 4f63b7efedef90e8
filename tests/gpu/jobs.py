"""The GPU suite's jobs: each case runs in a fresh Python process, so no CUDA state leaks between cases
and the pytest process itself never touches CUDA (it only reads NVML)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from harness import ROOT

# What every job process starts with: NVML readings and a scrape helper, no torch, no vramwatch.
PRELUDE = r"""
import json, os, sys, time, urllib.request

def _s(v):
    return v.decode() if isinstance(v, bytes) else v

def nvml_state():
    import pynvml as n
    n.nvmlInit()
    out = []
    for i in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(i)
        pi = n.nvmlDeviceGetPciInfo(h)
        out.append({"index": i, "uuid": _s(n.nvmlDeviceGetUUID(h)), "used": int(n.nvmlDeviceGetMemoryInfo(h).used),
                    "pids": sorted(p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)),
                    "pci": [pi.domain, pi.bus, pi.device]})
    return out

def scrape(port):
    from prometheus_client.parser import text_string_to_metric_families
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out

def wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except Exception as e:
            last = e
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}: {last!r}")

def rank0(m, name):
    return [(lab, v) for lab, v in m.get(name, []) if lab.get("rank") == "0"]

def done(res):
    print("RESULT " + json.dumps(res), flush=True)
"""


def job_env(one_device: bool = False, **extra: str) -> dict[str, str]:
    """The job's environment: no VRAMWATCH_* of ours, the repo importable, unbuffered output.

    ``one_device``: unless the caller's environment says otherwise, the job sees GPU 0 only, as a rank does.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMWATCH_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if one_device:
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    env.update(extra)
    return env


def run_job(body: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    """Run PRELUDE + body in a fresh interpreter; return the dict it passed to done()."""
    code = PRELUDE + textwrap.dedent(body)
    p = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env or job_env()
    )
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"job failed (exit {p.returncode}):\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}")
