"""``vramwatch alerts``: print the rules, or write / check the generated files under deploy/.

``--config F`` renders from a monitoring config file (the keys of ``MonitoringConfig``); a bad key or
value exits 2 naming it. ``--write``/``--check`` also cover ``monitoring.example.yaml``, the defaults
as a commented file, so the example can never drift from the fields.

The rules and YAML are imported only when the command runs: every ``vramwatch`` command line (the
scrape server's too) builds this parser, and the server needs neither PyYAML nor the rules.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from vramwatch.errors import ConfigError
from vramwatch.monitoring.config import DEFAULT, DEFAULT_RELEASE, EXAMPLE_PATH, MonitoringConfig, validate

RULES_PATH = Path("prometheus") / "rules" / "vramwatch.rules.yml"
PROMETHEUS_RULE_PATH = Path("kubernetes") / "prometheusrule.yaml"
EXAMPLE_CONFIG_PATH = Path(EXAMPLE_PATH)


def add_config_argument(p: argparse.ArgumentParser) -> None:
    """``--config F``, shared with ``vramwatch dashboards``."""
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a YAML monitoring config: any keys of MonitoringConfig (see deploy/monitoring.example.yaml)",
    )


def config_from_args(args: argparse.Namespace) -> MonitoringConfig:
    """The config ``--config`` names (the defaults without one); ConfigError naming a bad key."""
    from vramwatch.monitoring import config_file

    return config_file.load(args.config) if args.config else DEFAULT


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p)
    p.add_argument(
        "--format",
        choices=("rules", "prometheusrule"),
        default="rules",
        help="a Prometheus rule file (default) or a Prometheus Operator PrometheusRule",
    )
    p.add_argument(
        "--release",
        default=DEFAULT_RELEASE,
        help="the PrometheusRule's `release` label, which kube-prometheus-stack selects rules by "
        "(empty: no such label)",
    )
    p.add_argument("--namespace", default=None, help="the PrometheusRule's namespace (default: none set)")
    p.add_argument(
        "--selector",
        default=None,
        help="PromQL label matchers selecting vramwatch's series, e.g. 'job=\"vramwatch\"' (overrides the config's)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--write",
        metavar="DIR",
        help=f"write DIR/{RULES_PATH}, DIR/{PROMETHEUS_RULE_PATH} and DIR/{EXAMPLE_CONFIG_PATH}",
    )
    group.add_argument("--check", metavar="DIR", help="exit 1 if the files under DIR are not what --write writes")


def generated(
    cfg: MonitoringConfig = DEFAULT, release: str = DEFAULT_RELEASE, namespace: str | None = None
) -> dict[Path, str]:
    from vramwatch.monitoring import config_file
    from vramwatch.monitoring.alerts.render import prometheus_rule, rule_file, to_yaml

    return {
        RULES_PATH: to_yaml(rule_file(cfg)),
        PROMETHEUS_RULE_PATH: to_yaml(prometheus_rule(cfg, namespace=namespace, release=release or None)),
        EXAMPLE_CONFIG_PATH: config_file.example_yaml(),  # always the defaults: the file to copy
    }


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        if args.selector is not None:
            cfg = validate(dataclasses.replace(cfg, selector=args.selector), "--selector")
    except ConfigError as e:
        print(f"vramwatch alerts: {e}", file=sys.stderr)
        return 2
    files = generated(cfg, args.release, args.namespace)
    if args.write or args.check:  # and the Helm chart's generated parts, where the directory has the chart
        from vramwatch.monitoring import helm

        files.update(helm.generated(cfg, Path(args.write or args.check)))
    if args.write:
        for rel, text in files.items():
            path = Path(args.write) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
        return 0
    if args.check:
        stale = []
        for rel, text in files.items():
            path = Path(args.check) / rel
            try:
                current = path.read_text(encoding="utf-8")
            except OSError:
                current = None
            if current != text:
                stale.append(str(path))
        for s in stale:
            print(
                f"vramwatch alerts: {s} is out of date (run `vramwatch alerts --write {args.check}`)", file=sys.stderr
            )
        return 1 if stale else 0
    key = RULES_PATH if args.format == "rules" else PROMETHEUS_RULE_PATH
    sys.stdout.write(files[key])
    return 0
