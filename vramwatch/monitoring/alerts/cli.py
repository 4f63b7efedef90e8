"""``vramwatch alerts``: print the rules, or write / check the generated files under deploy/.

The rules and YAML are imported only when the command runs: every ``vramwatch`` command line (the
scrape server's too) builds this parser, and the server needs neither PyYAML nor the rules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vramwatch.monitoring.config import DEFAULT, DEFAULT_RELEASE, MonitoringConfig

RULES_PATH = Path("prometheus") / "rules" / "vramwatch.rules.yml"
PROMETHEUS_RULE_PATH = Path("kubernetes") / "prometheusrule.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
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
        "--selector", default=None, help="PromQL label matchers selecting vramwatch's series, e.g. 'job=\"vramwatch\"'"
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="DIR", help=f"write DIR/{RULES_PATH} and DIR/{PROMETHEUS_RULE_PATH}")
    group.add_argument("--check", metavar="DIR", help="exit 1 if the files under DIR are not what --write writes")


def generated(
    cfg: MonitoringConfig = DEFAULT, release: str = DEFAULT_RELEASE, namespace: str | None = None
) -> dict[Path, str]:
    from vramwatch.monitoring.alerts.render import prometheus_rule, rule_file, to_yaml

    return {
        RULES_PATH: to_yaml(rule_file(cfg)),
        PROMETHEUS_RULE_PATH: to_yaml(prometheus_rule(cfg, namespace=namespace, release=release or None)),
    }


def run(args: argparse.Namespace) -> int:
    cfg = DEFAULT if args.selector is None else MonitoringConfig(selector=args.selector)
    files = generated(cfg, args.release, args.namespace)
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
