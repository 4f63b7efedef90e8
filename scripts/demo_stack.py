#!/usr/bin/env python3
"""`make demo`: Prometheus and Alertmanager from Debian's packages on loopback, beside `vramwatch demo`.

    python scripts/demo_stack.py [--prometheus-port 9090] [--alertmanager-port 9093] [DEMO ARGS ...]

Uses the repository's own deploy files, rewriting only what must differ on loopback:
deploy/prometheus/prometheus.yml gets 127.0.0.1 target and Alertmanager addresses, an absolute rule_files
path and loses its Kubernetes job (no cluster here; Debian's build has no Kubernetes discovery);
deploy/alertmanager/alertmanager.yml is used as it is. Both keep their data in a temporary directory.
Prints the URLs, runs the demo job (every argument this script does not know goes to `vramwatch demo`),
and on exit, Ctrl-C or SIGTERM stops both servers and removes the directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
EXPORTER_JOB = "vramwatch"


class StackError(RuntimeError):
    pass


def find_tool(*names: str) -> str:
    """A binary of Debian's prometheus packages: TEST_TOOLS_DIR, .cache/debian (make tools), then PATH."""
    dirs = [os.environ.get("TEST_TOOLS_DIR", ""), str(ROOT / ".cache" / "debian" / "usr" / "bin")]
    for name in names:
        for d in dirs:
            if d and os.access(os.path.join(d, name), os.X_OK):
                return os.path.join(d, name)
        found = shutil.which(name)
        if found:
            return found
    raise StackError(f"{names[0]} not found: `make tools` unpacks Debian's packages into .cache/debian")


def loopback_prometheus_config(
    src: dict[str, Any], exporter: str, alertmanager: str, scrape_interval: str | None = None
) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml for loopback: only addresses, rule paths and the cluster job change."""
    cfg = yaml.safe_load(yaml.safe_dump(src))  # a deep copy
    base = PROMETHEUS_YML.parent
    cfg["rule_files"] = [str(base / r) if not os.path.isabs(r) else r for r in cfg.get("rule_files", [])]
    for am in cfg.get("alerting", {}).get("alertmanagers", []):
        am["static_configs"] = [{"targets": [alertmanager]}]
    jobs = []
    for job in cfg.get("scrape_configs", []):
        if "kubernetes_sd_configs" in job:
            continue
        if job["job_name"] == EXPORTER_JOB:
            job["static_configs"] = [{"targets": [exporter]}]
        jobs.append(job)
    if not any(j["job_name"] == EXPORTER_JOB for j in jobs):
        raise StackError(f"{PROMETHEUS_YML} has no {EXPORTER_JOB!r} scrape job")
    cfg["scrape_configs"] = jobs
    if scrape_interval:  # tests only: the file's 15 s would make them wait
        cfg.setdefault("global", {})["scrape_interval"] = scrape_interval
        cfg["global"]["evaluation_interval"] = scrape_interval
        cfg["global"]["scrape_timeout"] = scrape_interval
    return cfg


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _wait_ready(name: str, proc: subprocess.Popen, url: str, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            hint = (
                "\n(`make tools` installs the templates Debian's alertmanager reads)" if "default.tmpl" in tail else ""
            )
            raise StackError(f"{name} exited with {proc.returncode}:\n{tail}{hint}")
        if _get(url) == 200:
            return
        time.sleep(0.2)
    raise StackError(f"{name} not ready at {url} after {timeout:.0f} s (log: {log})")


def _stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _die_with(sig: int) -> Any:
    """For preexec_fn (Linux): the child gets ``sig`` when this script dies, even by SIGKILL."""

    def set_death_signal() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    return set_death_signal


class _Terminated(KeyboardInterrupt):
    """SIGTERM: handled like Ctrl-C."""


def _on_sigterm(*_: Any) -> None:
    raise _Terminated()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _stop_group(proc: subprocess.Popen | None, first: int, timeout: float) -> None:
    """Stop the demo: ``first`` to its leader (it stops its own ranks), then SIGTERM and SIGKILL to
    whatever is left of its process group; reap the leader."""
    if proc is None:
        return
    for sig, wait in ((first, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if not _group_alive(proc.pid):
            break
        try:
            if sig == first and proc.poll() is None:
                proc.send_signal(sig)
            else:
                os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(proc.pid):
            proc.poll()  # reap the leader, or the group stays alive as a zombie
            time.sleep(0.1)
    proc.poll()


def _exporter_address(port: int | None, host: str | None) -> tuple[int, str]:
    from vramwatch import config

    kwargs = {k: v for k, v in (("port", port), ("host", host)) if v}
    settings, _ = config.load(kwargs)  # VRAMWATCH_* env and the config file count too
    host = settings.host if settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
    return settings.port, f"[{host}]:{settings.port}" if ":" in host else f"{host}:{settings.port}"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--prometheus-port", type=int, default=9090)
    p.add_argument("--alertmanager-port", type=int, default=9093)
    p.add_argument("--port", type=int, default=None, help="the exporter's port (passed on to the demo)")
    p.add_argument("--host", default=None, help="the exporter's bind address (passed on to the demo)")
    p.add_argument("--scrape-interval", default=None, help="override the file's scrape interval (tests)")
    p.add_argument("--alertmanager-config", type=Path, default=ALERTMANAGER_YML, help=argparse.SUPPRESS)
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (configs, data, logs)")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, demo_args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    signal.signal(signal.SIGTERM, _on_sigterm)  # like Ctrl-C: everything stopped, directory removed
    work = Path(tempfile.mkdtemp(prefix="vramwatch-stack-"))
    procs: dict[str, subprocess.Popen] = {}
    demo: subprocess.Popen | None = None
    logs: list[Any] = []
    code = 0
    try:
        prometheus, alertmanager = find_tool("prometheus"), find_tool("prometheus-alertmanager", "alertmanager")
        port, exporter = _exporter_address(args.port, args.host)
        am_addr, prom_addr = f"127.0.0.1:{args.alertmanager_port}", f"127.0.0.1:{args.prometheus_port}"
        if not args.alertmanager_config.exists():
            raise StackError(f"{args.alertmanager_config} is missing: `make generate` writes it")
        cfg = loopback_prometheus_config(
            yaml.safe_load(PROMETHEUS_YML.read_text()), exporter, am_addr, args.scrape_interval
        )
        config_file = work / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(cfg, sort_keys=False))

        am_log, prom_log = work / "alertmanager.log", work / "prometheus.log"
        logs += [open(am_log, "ab"), open(prom_log, "ab")]
        # Every child runs in its own session, so a terminal's Ctrl-C reaches only this script, which then
        # stops them in order; each also gets a signal should this script die without cleaning up.
        procs["alertmanager"] = subprocess.Popen(
            [
                alertmanager,
                f"--config.file={args.alertmanager_config}",
                f"--storage.path={work / 'alertmanager'}",
                f"--web.listen-address={am_addr}",
                "--cluster.listen-address=",
            ],  # no gossip port on 0.0.0.0
            stdin=subprocess.DEVNULL,
            stdout=logs[0],
            stderr=logs[0],
            start_new_session=True,
            preexec_fn=_die_with(signal.SIGTERM),
        )
        procs["prometheus"] = subprocess.Popen(
            [
                prometheus,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={work / 'prometheus'}",
                f"--web.listen-address={prom_addr}",
                "--storage.tsdb.retention.time=1d",
            ],
            stdin=subprocess.DEVNULL,
            stdout=logs[1],
            stderr=logs[1],
            start_new_session=True,
            preexec_fn=_die_with(signal.SIGTERM),
        )
        _wait_ready("Alertmanager", procs["alertmanager"], f"http://{am_addr}/-/ready", am_log)
        _wait_ready("Prometheus", procs["prometheus"], f"http://{prom_addr}/-/ready", prom_log)
        print(f"vramwatch stack: Prometheus   http://{prom_addr}  (targets: /targets, alerts: /alerts)", flush=True)
        print(f"vramwatch stack: Alertmanager http://{am_addr}", flush=True)
        print(f"vramwatch stack: scraping {exporter} as job {EXPORTER_JOB!r}; files and logs in {work}", flush=True)
        host_args = ["--host", args.host] if args.host else []
        # the demo stops its ranks on SIGINT (KeyboardInterrupt); its group holds them all
        demo = subprocess.Popen(
            [sys.executable, "-m", "vramwatch", "demo", "--port", str(port), *host_args, *demo_args],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with(signal.SIGINT),
        )
        code = demo.wait()
    except KeyboardInterrupt:
        code = 130
    except StackError as e:
        print(f"vramwatch stack: {e}", file=sys.stderr)
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        _stop_group(demo, signal.SIGINT, 20.0)
        for name in ("prometheus", "alertmanager"):
            _stop(procs.get(name))
        for fh in logs:
            fh.close()
        if args.keep:
            print(f"vramwatch stack: kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
        print("vramwatch stack: stopped Prometheus and Alertmanager", flush=True)
    return code


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
