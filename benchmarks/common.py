"""Shared helpers for the benchmarks: progress, timed HTTP, /proc CPU clocks, statistics, metadata. The
processes (ports, environments, stopping them) come from the repository's harness/ package, which the tests
and `make demo` use too.

Imports neither torch nor vramwatch at module level (nor does harness/): overhead.py forks its
runs from a parent that must not have loaded vramwatch, and a scraper process
built from this file must stay small.

    python3 benchmarks/common.py scrape-loop --url-file F --out scrapes.jsonl --interval 1

runs the 1 Hz scraper that overhead.py keeps beside its runs (a separate
process, so its CPU is not counted as the training process's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the harness package

import harness  # noqa: E402 - after the path

# the benchmarks call these as common.NAME
from harness import free_port as free_port  # noqa: E402 - after the path
from harness import parse_metrics as parse_metrics  # noqa: E402 - after the path
from harness import pid_alive as pid_alive  # noqa: E402 - after the path
from harness import read_answer as read_answer  # noqa: E402 - after the path
from harness import stop_pid as stop_pid  # noqa: E402 - after the path
from harness import wait_http as wait_http  # noqa: E402 - after the path

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_T0 = time.monotonic()


# --- progress ---


def server_pid_in(spool_dir: str) -> int | None:
    """The pid in a spool's ``server.json`` (the server its ranks started), or None."""
    try:
        with open(os.path.join(spool_dir, "server.json"), encoding="utf-8") as fh:
            return int(json.load(fh)["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def progress(msg: str) -> None:
    """One progress line on stderr, with seconds since the script started."""
    sys.stderr.write(f"[{time.monotonic() - _T0:7.1f}s] {msg}\n")
    sys.stderr.flush()


# --- files ---
def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write atomically, so a run killed mid-write leaves the previous complete file."""
    path = str(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, sort_keys=False, default=_json_default)
        fh.write("\n")
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


# --- network ---
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def http_get(url: str, timeout: float = 5.0, gzip: bool = False, accept: str = "") -> tuple[int, bytes, float]:
    """(status, body, seconds from request to the last byte); status 0 on a connection error."""
    headers = {"Accept-Encoding": "gzip"} if gzip else {}
    if accept:
        headers["Accept"] = accept
    t0 = time.perf_counter()
    try:
        status, body = harness.http_get(url, timeout=timeout, headers=headers)
        return status, body, time.perf_counter() - t0
    except (OSError, ValueError):
        return 0, b"", time.perf_counter() - t0


class OpenMetricsRecorder:
    """Polls of one target, merged into one OpenMetrics file with timestamps (for ``promtool tsdb
    create-blocks-from openmetrics``, so a recorded run can be queried and reported later).

    Keeps gauges and counters (histograms' points would need regrouping), adds ``job`` and
    ``instance`` labels, and groups each series' samples in time order, as OpenMetrics wants.
    """

    KINDS = ("gauge", "counter", "unknown")

    def __init__(self, job: str, instance: str) -> None:
        self.extra = f'job="{job}",instance="{instance}"'
        self.meta: dict[str, list[str]] = {}
        self.kind: dict[str, str] = {}
        self.series: dict[str, dict[str, list[str]]] = {}

    def add(self, text: str, t: float) -> None:
        fam = None
        for line in text.splitlines():
            if not line or line == "# EOF":
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE", "UNIT"):
                    fam = parts[2]
                    if parts[1] == "TYPE":
                        self.kind[fam] = parts[3].strip() if len(parts) > 3 else "unknown"
                    meta = self.meta.setdefault(fam, [])
                    if not any(m.split(" ", 2)[1] == parts[1] for m in meta):
                        meta.append(line)
                continue
            if fam is None or self.kind.get(fam, "unknown") not in self.KINDS:
                continue
            key, _, value = line.rpartition(" ")
            if "{" in key:
                name, labels = key.split("{", 1)
                key = f"{name}{{{self.extra},{labels}" if labels != "}" else f"{name}{{{self.extra}}}"
            else:
                key = f"{key}{{{self.extra}}}"
            self.series.setdefault(fam, {}).setdefault(key, []).append(f"{key} {value} {t:.3f}")

    def write(self, path: str | os.PathLike) -> int:
        """Write the file (gzip-compressed when the name ends in .gz); returns the number of samples."""
        import gzip as gz

        n = 0
        opener = gz.open if str(path).endswith(".gz") else open
        with opener(path, "wt", encoding="utf-8") as fh:
            for fam, rows in self.series.items():
                for m in self.meta.get(fam, []):
                    fh.write(m + "\n")
                for lines in rows.values():
                    fh.write("\n".join(lines) + "\n")
                    n += len(lines)
            fh.write("# EOF\n")
        return n


# --- CPU clocks ---
def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a whole process (all its threads) from /proc, in seconds (10 ms ticks)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def thread_cpu_seconds(prefix: str = "") -> dict[str, float]:
    """CPU seconds of each live thread of this process whose name starts with ``prefix``.

    Uses the per-thread CPU clock (``pthread_getcpuclockid``), nanosecond
    resolution, not /proc's 10 ms ticks. Same-named threads get ``#n`` suffixes.
    """
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if not t.name.startswith(prefix) or t.ident is None:
            continue
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, AttributeError, OverflowError):
            continue
        name, n = t.name, 1
        while name in out:
            n += 1
            name = f"{t.name}#{n}"
        out[name] = cpu
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-thread CPU spent between two readings; threads born in between count whole."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


# --- statistics ---
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no data."""
    if not values:
        return None
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_stats(without: Sequence[float], with_: Sequence[float]) -> dict[str, Any]:
    """Ratios of interleaved runs: with[i] / without[i]; the A/A null: without[i+1] / without[i].

    ``without[i]`` ran just before ``with_[i]``; the null compares each
    baseline to the next one, so it spans the same drift a pair does (or more).
    """
    n = min(len(without), len(with_))
    ratios = [with_[i] / without[i] for i in range(n) if without[i] > 0]
    null = [without[i + 1] / without[i] for i in range(len(without) - 1) if without[i] > 0]
    r, z = spread(ratios), spread(null)
    return {
        "median_ratio": r["median"],
        "min_ratio": r["min"],
        "max_ratio": r["max"],
        "null_median_ratio": z["median"],
        "null_min_ratio": z["min"],
        "null_max_ratio": z["max"],
        "pairs": n,
        "ratios": ratios,
        "null_ratios": null,
    }


# --- metadata ---
def source_digest(root: Path = ROOT) -> str:
    """sha256 over vramwatch/**/*.py: names the code measured even where .git did not travel."""
    h = hashlib.sha256()
    for p in sorted((root / "vramwatch").rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def vramwatch_commit(root: Path = ROOT) -> str:
    env = os.environ.get("VW_BENCH_COMMIT")  # not VRAMWATCH_*: unknown settings are rejected there
    if env:
        return env
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--", "vramwatch"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


_GPU_INFO = r"""
import json
out = {}
try:
    import pynvml as n
    n.nvmlInit()
    out["driver"] = n.nvmlSystemGetDriverVersion()
    out["nvml_version"] = n.nvmlSystemGetNVMLVersion()
    out["gpus"] = []
    for i in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(i)
        out["gpus"].append({"index": i, "name": n.nvmlDeviceGetName(h), "uuid": n.nvmlDeviceGetUUID(h),
                            "memory_total_bytes": n.nvmlDeviceGetMemoryInfo(h).total})
    try:
        out["persistence_mode"] = n.nvmlDeviceGetPersistenceMode(n.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        pass
except Exception as e:
    out["error"] = repr(e)
print(json.dumps(out))
"""


def gpu_info() -> dict[str, Any]:
    """NVML's view of the node, read in a short-lived subprocess (nothing stays initialised here)."""
    try:
        out = subprocess.run([sys.executable, "-c", _GPU_INFO], capture_output=True, text=True, timeout=30)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"error": repr(e)}


def metadata(**extra: Any) -> dict[str, Any]:
    gi = gpu_info()
    gpus = gi.get("gpus") or []
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "gpu_name": gpus[0]["name"] if gpus else None,
        "gpu_count": len(gpus),
        "driver": gi.get("driver"),
        "nvml": gi,
        "vramwatch_commit": vramwatch_commit(),
        "vramwatch_source_sha256": source_digest(),
        "argv": sys.argv,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        meta["torch"] = torch.__version__
        meta["torch_cuda"] = getattr(torch.version, "cuda", None)
    try:
        from importlib.metadata import version

        meta["nvidia_ml_py"] = version("nvidia-ml-py")
        meta["prometheus_client"] = version("prometheus-client")
    except Exception:  # noqa: BLE001 - metadata is best effort
        pass
    try:  # read the version file as text: importing it would load the vramwatch package here
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", (ROOT / "vramwatch" / "_version.py").read_text())
        meta["vramwatch_version"] = m.group(1) if m else None
    except OSError:
        pass
    meta.update(extra)
    return meta


def child_env(**extra: str) -> dict[str, str]:
    """harness.child_env, offline for Hugging Face (a benchmark never downloads)."""
    env = harness.child_env()
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.update(extra)
    return env


# --- the 1 Hz scraper (a process of its own) ---
def write_url_file(path: str, url: str) -> None:
    """Point the scraper at ``url`` ("" for none); atomic, so it never reads half a URL. A run may call it too."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(url)
    os.replace(tmp, path)


class Scraper:
    """Scrapes whatever URL the control file names, every ``interval`` s (at once on a new URL)."""

    def __init__(self, workdir: str, interval: float = 1.0) -> None:
        self.url_file = os.path.join(workdir, "scrape-url")
        self.out = os.path.join(workdir, "scrapes.jsonl")
        self.interval = interval
        self.set_url("")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "scrape-loop",
                "--url-file",
                self.url_file,
                "--out",
                self.out,
                "--interval",
                str(interval),
                "--parent",
                str(os.getpid()),
            ],
            stdin=subprocess.DEVNULL,
            env=child_env(),
        )
        deadline = time.monotonic() + 15  # up before the first run, so its start-up overlaps none
        while not os.path.exists(self.out) and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def set_url(self, url: str) -> None:
        write_url_file(self.url_file, url)

    def records(self, url: str | None = None, since: float = 0.0, until: float = float("inf")) -> list[dict]:
        rows = []
        try:
            with open(self.out, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if (url is None or r["url"] == url) and since <= r["t"] <= until:
                        rows.append(r)
        except OSError:
            pass
        return rows

    def close(self) -> None:
        self.set_url("")
        harness.stop_proc(self.proc, timeout=5)


def scrape_loop(url_file: str, out: str, interval: float, parent: int) -> int:
    last_url, next_due = "", 0.0
    with open(out, "a", encoding="utf-8") as fh:
        while True:
            if parent and os.getppid() != parent:
                return 0  # the benchmark is gone
            try:
                with open(url_file, encoding="utf-8") as uf:
                    url = uf.read().strip()
            except OSError:
                url = ""
            now = time.monotonic()
            if url and (url != last_url or now >= next_due):
                status, body, elapsed = http_get(url, timeout=max(2.0, interval))
                fh.write(
                    json.dumps({"t": time.time(), "url": url, "status": status, "seconds": elapsed, "bytes": len(body)})
                    + "\n"
                )
                fh.flush()
                next_due = now + interval
            last_url = url
            time.sleep(0.05)


def summarize_scrapes(rows: Iterable[dict]) -> dict[str, Any]:
    rows = list(rows)
    ok = [r["seconds"] for r in rows if r["status"] == 200]
    return {
        "count": len(rows),
        "ok": len(ok),
        "p50_ms": _ms(percentile(ok, 50)),
        "p99_ms": _ms(percentile(ok, 99)),
        "max_ms": _ms(max(ok, default=None)),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/common.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scrape-loop", help="scrape the URL named in --url-file every --interval seconds")
    s.add_argument("--url-file", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--parent", type=int, default=0)
    sub.add_parser("metadata", help="print the run metadata as JSON")
    args = p.parse_args(argv)
    if args.cmd == "scrape-loop":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        return scrape_loop(args.url_file, args.out, args.interval, args.parent)
    print(json.dumps(metadata(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
