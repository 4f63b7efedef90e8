#!/usr/bin/env python3
"""Prometheus file_sd targets for the vramwatch node daemons of a SLURM cluster, from its node list.

    scontrol show hostnames "$(sinfo -h -o %N)" \\
        | python3 vramwatch_file_sd.py --port 9488 --label cluster=hpc1 --output /etc/prometheus/file_sd/vramwatch.json

Reads host names one per line (what ``scontrol show hostnames`` prints; blank lines and ``#`` comments are
skipped, repeats kept once) and writes one target group, ``[{"targets": ["node001:9488", ...], "labels":
{...}}]``. The file is replaced whole (Prometheus re-reads it when it changes and must never see half of
it). An empty list leaves the file as it was and exits 1: a failed ``sinfo`` must not drop every target.
Standard library only: it runs on the Prometheus host, where vramwatch need not be installed.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence

_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class NodeListError(ValueError):
    """The node list or a label is unusable; the message names the line or the label."""


def _host(text: str) -> str:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
        if len(text) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
            raise NodeListError(f"not a host name: {text!r}") from None
        return text
    return f"[{ip}]" if ip.version == 6 else str(ip)


def hosts(lines: Iterable[str]) -> list[str]:
    """The host names of a node list, in order, each once."""
    out: dict[str, None] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            out.setdefault(_host(line), None)
        except NodeListError as e:
            raise NodeListError(f"line {n}: {e}") from None
    return list(out)


def parse_labels(pairs: Sequence[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise NodeListError(f"--label {pair!r}: want name=value, name a Prometheus label name not starting __")
        labels[name] = value
    return labels


def target_groups(nodes: Sequence[str], port: int, labels: dict[str, str]) -> list[dict[str, object]]:
    return [{"targets": [f"{h}:{port}" for h in nodes], "labels": dict(labels)}]


def write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".vramwatch-file-sd.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # Prometheus runs as its own user
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=9488, help="the node daemon's port (VRAMWATCH_PORT; default 9488)")
    p.add_argument("--label", action="append", default=[], help="name=value added to every target (repeatable)")
    p.add_argument("--output", default="-", help="the file_sd file to replace (default: standard output)")
    p.add_argument("input", nargs="?", default="-", help="the node list (default: standard input)")
    args = p.parse_args(argv)
    if not 1 <= args.port <= 65535:
        p.error(f"--port {args.port}: must be 1-65535")
    try:
        labels = parse_labels(args.label)
        if args.input == "-":
            nodes = hosts(sys.stdin)
        else:
            with open(args.input, encoding="utf-8") as fh:
                nodes = hosts(fh)
    except (NodeListError, OSError) as e:
        print(f"vramwatch_file_sd: {e}", file=sys.stderr)
        return 2
    if not nodes:
        print("vramwatch_file_sd: the node list is empty; the targets are left as they were", file=sys.stderr)
        return 1
    text = json.dumps(target_groups(nodes, args.port, labels), indent=2) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        write_atomically(args.output, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
