"""Where the scrape server's resident memory goes: each step of its start-up in a fresh interpreter, then the
server itself with one part switched off at a time (issue 19: server RSS <= 40 MB).

    python3 benchmarks/rss_floor.py --out rss.json             # on a GPU machine: NVML steps and variants
    python3 benchmarks/rss_floor.py --simulate --out rss.json  # no GPU: the import steps and a simulated server

Steps (one child each, cumulative): a bare interpreter; the server's imports; nvmlInit; every device's
handle and one read of what the fast collector reads; the Xid event set; one GPM sample per device; then
glibc's malloc_trim(0), which hands freed heap back (what is left after it is live, not garbage).
Variants: `vramwatch serve` at defaults, then with `xid`, `gpm`, `nvlink` or `nvml` off, and with
MALLOC_ARENA_MAX=1; each read settles for --settle seconds and is scraped once first, as a server is.
RSS is VmRSS; "anon" is the sum of the anonymous mappings' Rss in /proc/PID/smaps (heap included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # puts the repository root on sys.path too

# Each step's code runs after the previous steps' code, in one fresh interpreter per step.
STEPS: list[tuple[str, str]] = [
    ("bare interpreter", "pass"),
    ("+ the server's imports", "import vramwatch.server.main, pynvml"),
    ("+ nvmlInit", "pynvml.nvmlInit()"),
    (
        "+ handles and one fast read",
        "hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]\n"
        "for h in hs:\n"
        "    pynvml.nvmlDeviceGetMemoryInfo(h); pynvml.nvmlDeviceGetUtilizationRates(h)\n"
        "    pynvml.nvmlDeviceGetPowerUsage(h); pynvml.nvmlDeviceGetTemperature(h, 0)\n"
        "    pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)\n"
        "    pynvml.nvmlDeviceGetComputeRunningProcesses(h)",
    ),
    (
        "+ the Xid event set",
        "es = pynvml.nvmlEventSetCreate()\n"
        "for h in hs:\n"
        "    try: pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)\n"
        "    except pynvml.NVMLError: pass",
    ),
    (
        "+ one GPM sample per device",
        "gs = []\n"
        "for h in hs:\n"
        "    try: gs.append(pynvml.nvmlGpmSampleGet(h, pynvml.nvmlGpmSampleAlloc()))\n"
        "    except (pynvml.NVMLError, AttributeError): pass",
    ),
    ("+ malloc_trim(0)", "import ctypes; ctypes.CDLL('libc.so.6').malloc_trim(0)"),
]

MEASURE = """
import json, sys
def _mem():
    rss = anon = 0
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'): rss = int(line.split()[1])
    name = ''
    for line in open('/proc/self/smaps'):
        parts = line.split()
        if '-' in parts[0] and not parts[0].endswith(':'):
            name = parts[5] if len(parts) > 5 else '[anon]'
        elif parts[0] == 'Rss:' and name in ('[anon]', '[heap]'):
            anon += int(parts[1])
    return {'rss_mb': rss * 1024 / 1e6, 'anon_mb': anon * 1024 / 1e6, 'modules': len(sys.modules)}
print(json.dumps(_mem()))
"""


def mem_of(pid: int) -> dict[str, float]:
    rss = anon = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    name = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif parts[0] == "Rss:" and name in ("[anon]", "[heap]"):
                anon += int(parts[1])
    return {"rss_mb": rss * 1024 / 1e6, "anon_mb": anon * 1024 / 1e6}


def run_steps(steps: list[tuple[str, str]], repeats: int) -> list[dict[str, Any]]:
    out = []
    for i, (name, _) in enumerate(steps):
        code = "\n".join(c for _, c in steps[: i + 1]) + "\n" + MEASURE
        reads: list[dict[str, Any]] = []
        for _ in range(repeats):
            r = subprocess.run([sys.executable, "-c", code], env=common.child_env(), capture_output=True, text=True)
            if r.returncode != 0:
                reads = []
                out.append({"step": name, "error": r.stderr.strip().splitlines()[-1:]})
                break
            reads.append(json.loads(r.stdout.strip().splitlines()[-1]))
        if not reads:
            common.progress(f"{name}: failed ({out[-1]['error']}); the later steps build on it, stopping")
            return out
        best = min(reads, key=lambda m: m["rss_mb"])  # the least: import order and ASLR add noise, never take it
        out.append({"step": name, **best, "reads_rss_mb": [round(m["rss_mb"], 2) for m in reads]})
        common.progress(f"{name}: RSS {best['rss_mb']:.1f} MB, anonymous {best['anon_mb']:.1f} MB")
    return out


VARIANTS: list[tuple[str, dict[str, str]]] = [
    ("defaults", {}),
    ("xid off", {"VRAMWATCH_XID": "false"}),
    ("gpm off", {"VRAMWATCH_GPM": "false"}),
    ("nvlink off", {"VRAMWATCH_NVLINK": "false"}),
    ("nvml off", {"VRAMWATCH_NVML": "false"}),
    ("MALLOC_ARENA_MAX=1", {"MALLOC_ARENA_MAX": "1"}),
]


def run_variant(name: str, extra: dict[str, str], simulate: bool, settle: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        spool = os.path.join(tmp, "spool")
        os.makedirs(spool)
        port = common.free_port()
        env = {"VRAMWATCH_PORT": str(port), "VRAMWATCH_SPOOL_DIR": spool, **extra}
        if simulate:
            from vramwatch.sim.state import SimNode, state_path

            SimNode.default(1).save(state_path(spool))
            env["VRAMWATCH_SIMULATE"] = "true"
        with open(os.path.join(tmp, "serve.log"), "wb") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", "vramwatch", "serve"],
                env=common.child_env(**env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
            try:
                if not common.wait_http(f"http://127.0.0.1:{port}/-/healthy", timeout=30):
                    return {"variant": name, "error": "did not come up"}
                time.sleep(settle)
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                    size = len(r.read())
                time.sleep(0.5)
                m = mem_of(p.pid)
            finally:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
    common.progress(f"serve, {name}: RSS {m['rss_mb']:.1f} MB, anonymous {m['anon_mb']:.1f} MB, {size} bytes")
    return {"variant": name, **m, "bytes": size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simulate", action="store_true", help="no GPU: the import steps and a simulated server")
    ap.add_argument("--repeats", type=int, default=3, help="children per step; the least RSS is kept (default 3)")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds a server runs before it is read")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, not {args.repeats}")
    steps = STEPS[:2] if args.simulate else STEPS
    variants = VARIANTS[:1] + VARIANTS[-1:] if args.simulate else VARIANTS
    res = {
        "metadata": common.metadata(),
        "simulate": args.simulate,
        "steps": run_steps(steps, args.repeats),
        "serve": [run_variant(n, e, args.simulate, args.settle) for n, e in variants],
    }
    text = json.dumps(res, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
