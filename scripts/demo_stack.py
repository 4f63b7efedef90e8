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
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the harness package, and this checkout's vramwatch

import yaml  # noqa: E402 - after the path

from harness import Alertmanager, Prometheus, ToolMissing, die_with, stop_group  # noqa: E402 - after the path
from harness.servers import EXPORTER_JOB, StackError, loopback_prometheus_config  # noqa: E402 - after the path

PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"


class _Terminated(KeyboardInterrupt):
    """SIGTERM: handled like Ctrl-C."""


def _on_sigterm(*_: Any) -> None:
    raise _Terminated()


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
    servers: list[Prometheus | Alertmanager] = []
    demo: subprocess.Popen | None = None
    code = 0
    try:
        port, exporter = _exporter_address(args.port, args.host)
        if not args.alertmanager_config.exists():
            raise StackError(f"{args.alertmanager_config} is missing: `make generate` writes it")
        # Each server runs in its own session (detach), so a terminal's Ctrl-C reaches only this script,
        # which then stops them in order; each also gets SIGTERM should this script die without cleaning up.
        am = Alertmanager(work, args.alertmanager_config, port=args.alertmanager_port, detach=True)
        cfg = loopback_prometheus_config(
            yaml.safe_load(PROMETHEUS_YML.read_text()),
            PROMETHEUS_YML.parent,
            exporter,
            am.address,
            args.scrape_interval,
        )
        prom = Prometheus(work, config=cfg, port=args.prometheus_port, retention="1d", lifecycle=False, detach=True)
        servers += [am, prom]
        for server in servers:
            server.launch()
        for server in servers:
            try:
                server.wait_ready(60.0)
            except StackError as e:
                hint = "\n(`make tools` installs the templates Debian's alertmanager reads)"
                raise StackError(f"{e}{hint if 'default.tmpl' in str(e) else ''}") from None
        print(f"vramwatch stack: Prometheus   {prom.url}  (targets: /targets, alerts: /alerts)", flush=True)
        print(f"vramwatch stack: Alertmanager {am.url}", flush=True)
        print(f"vramwatch stack: scraping {exporter} as job {EXPORTER_JOB!r}; files and logs in {work}", flush=True)
        host_args = ["--host", args.host] if args.host else []
        # the demo stops its ranks on SIGINT (KeyboardInterrupt); its group holds them all
        demo = subprocess.Popen(
            [sys.executable, "-m", "vramwatch", "demo", "--port", str(port), *host_args, *demo_args],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with(signal.SIGINT),
        )
        code = demo.wait()
    except KeyboardInterrupt:
        code = 130
    except (StackError, ToolMissing) as e:
        print(f"vramwatch stack: {e}", file=sys.stderr)
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        stop_group(demo, signal.SIGINT, 20.0)
        for server in reversed(servers):  # Prometheus first: it would page an Alertmanager that is gone
            server.stop()
        if args.keep:
            print(f"vramwatch stack: kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
        print("vramwatch stack: stopped Prometheus and Alertmanager", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
