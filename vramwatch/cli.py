"""``vramwatch`` command line: parses, then dispatches to functions taking Settings.

Subcommands: serve, demo, config, docs, and (from their own modules) alerts,
dashboards, report, deploy. Every setting is also a flag (``--port``, ``--web.config.file``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from vramwatch import config
from vramwatch.config import ConfigError, Settings

# subcommand -> module providing add_arguments(parser) and run(args) -> int
_PLUGINS = {
    "alerts": ("vramwatch.monitoring.alerts.cli", "print the alert rules (Prometheus rule file or PrometheusRule)"),
    "dashboards": ("vramwatch.monitoring.dashboards.cli", "write the Grafana dashboards as JSON"),
    "report": ("vramwatch.report", "render the dashboards from a Prometheus into one HTML file"),
    "deploy": (
        "vramwatch.shipped",
        "write the shipped deploy files: Helm chart, manifests, systemd unit, alertmanager.yml",
    ),
}
_FLAG_ALIASES = {"web_config_file": ["--web.config.file"]}


def _add_settings_flags(p: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    g = p.add_argument_group("settings (override VRAMWATCH_* and the config file)")
    for f in dataclasses.fields(Settings):
        if only is not None and f.name not in only:
            continue
        flags = ["--" + f.name.replace("_", "-")] + _FLAG_ALIASES.get(f.name, [])
        g.add_argument(
            *flags,
            dest="setting_" + f.name,
            default=None,
            metavar=type(f.default).__name__.upper(),
            help=f"{f.metadata.get('doc', '')} (default: {f.default!r})",
        )


def settings_from_args(args: argparse.Namespace, **fixed: Any) -> tuple[Settings, dict[str, str]]:
    kwargs = {k[len("setting_") :]: v for k, v in vars(args).items() if k.startswith("setting_") and v is not None}
    kwargs.update(fixed)
    return config.load(kwargs)


def version() -> str:
    """The installed distribution's version; a source tree without one reports the package's own."""
    from importlib import metadata

    try:
        return metadata.version("vramwatch")
    except metadata.PackageNotFoundError:
        from vramwatch._version import __version__

        return f"{__version__} (source tree)"


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked (every command line, the server's too, builds the parser)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"vramwatch {version()}")
        parser.exit()


def _builtin_command(argv: Sequence[str]) -> str | None:
    """The command of a command line when it is one of this module's own (serve, demo, config, docs):
    the first word that is no option, as the top-level parser has no option that takes a value."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in ("serve", "demo", "config", "docs") else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; for one of the built-in ``command`` s the plugins' modules stay unimported
    (``vramwatch serve`` holds only what serving needs), their subcommands listed without their flags."""
    p = argparse.ArgumentParser(prog="vramwatch", description="PyTorch GPU memory telemetry for Prometheus.")
    p.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the node's scrape server")
    s.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="exit once no rank has published for --linger seconds (how ranks start it)",
    )
    s.add_argument(
        "--node",
        action="store_true",
        help="run as the node's daemon for every user's ranks, on the node_dir spool (deploy/systemd/)",
    )
    _add_settings_flags(s)

    d = sub.add_parser("demo", help="a short training job with the exporter (simulated GPU without CUDA)")
    d.add_argument("--duration", type=float, default=0.0, help="seconds to run (0: until interrupted)")
    d.add_argument("--ranks", type=int, default=2, help="simulated ranks (simulated GPU only)")
    d.add_argument("--cycle", type=float, default=0.0, help="seconds of one turn of the simulated story (default: 120)")
    d.add_argument(
        "--real",
        choices=("auto", "yes", "no"),
        default="auto",
        help="train on a real CUDA GPU (auto: when one is present)",
    )
    _add_settings_flags(d)

    c = sub.add_parser("config", help="show each setting's value and where it came from")
    _add_settings_flags(c)

    doc = sub.add_parser("docs", help="regenerate the metric tables (README.md, docs/METRICS.md)")
    doc.add_argument("--check", action="store_true", help="fail if they are out of date")

    for name, (module, help_) in _PLUGINS.items():
        sp = sub.add_parser(name, help=help_)
        if command is not None:
            continue
        try:
            importlib.import_module(module).add_arguments(sp)
        except Exception as e:  # noqa: BLE001 - a broken optional part must never break `serve`
            sp.set_defaults(_missing=f"{module} ({e})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader that left early (`vramwatch config | head`) shows here, not at exit
        return code
    except BrokenPipeError:
        # as `cat` does: stop quietly; stdout goes to /dev/null so the interpreter's last flush cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser(_builtin_command(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "serve":
            from vramwatch.server.main import serve

            settings, _ = settings_from_args(args)
            logging.getLogger("vramwatch").setLevel(min(logging.INFO, logging.getLevelName(settings.log_level)))
            return serve(settings, exit_when_idle=args.exit_when_idle, node_daemon=args.node)
        if args.command == "demo":
            from vramwatch import demo

            real = demo.use_real_gpu(args.real)
            settings, _ = settings_from_args(args, simulate=not real)
            if not args.cycle >= 0:  # NaN too
                print(f"vramwatch demo: --cycle wants seconds (0: the story's), got {args.cycle!r}", file=sys.stderr)
                return 2
            return demo.run_demo(settings, real=real, ranks=args.ranks, duration=args.duration, cycle=args.cycle)
        if args.command == "config":
            settings, sources = settings_from_args(args)
            for f in dataclasses.fields(settings):
                print(f"{f.name:24} {getattr(settings, f.name)!r:32} {sources[f.name]}")
            return 0
        if args.command == "docs":
            from vramwatch.docs import regenerate

            return regenerate(check=args.check)
        if getattr(args, "_missing", None):
            print(f"vramwatch {args.command}: unavailable: {args._missing}; is its extra installed?", file=sys.stderr)
            return 2
        return importlib.import_module(_PLUGINS[args.command][0]).run(args)
    except ConfigError as e:
        print(f"vramwatch: {e}", file=sys.stderr)
        return 2
