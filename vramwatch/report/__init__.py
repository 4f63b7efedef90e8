"""``vramwatch report``: the dashboards rendered from a Prometheus into one self-contained HTML file.

    vramwatch report --prometheus http://localhost:9090 --last 6h --out report.html
    vramwatch report --prometheus URL --start 2026-12-01T08:00:00Z --end 2026-12-01T20:00:00Z \\
        --var job=train-llama --var rank=0,1

It walks the same dashboard models the Grafana JSON is generated from, runs each panel's
queries through Prometheus's HTTP API (``query_range`` for time series, ``query`` at the end of
the range for tables and stats), and draws one PNG per panel with matplotlib, embedded in the
page. Needs the ``report`` extra (it brings the ``dashboards`` one); imports them only when it runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from datetime import UTC, datetime

NEEDS = "grafana-foundation-sdk==0.0.21 and matplotlib (pip install 'vramwatch[report]')"


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration (``90s``, ``1h30m``), as the rules and promtool read them."""
    from vramwatch.monitoring.config import parse_duration as prometheus_duration

    try:
        return prometheus_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration (like 90s, 30m, 6h, 2d): {text!r}") from None


def parse_time(text: str) -> float:
    """Unix seconds, RFC 3339 / ISO 8601 (naive times are UTC), or ``now``."""
    if text == "now":
        return time.time()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time (unix seconds or 2026-12-01T08:00:00Z): {text!r}") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prometheus",
        required=True,
        metavar="URL",
        help="Prometheus base URL (http://user:password@host:9090 for basic auth; the page shows it without)",
    )
    a = p.add_argument_group(
        "credentials and TLS (Prometheus' http_config; secrets go into requests only, never into the page or logs)"
    )
    a.add_argument(
        "--http-config-file",
        metavar="FILE",
        help="a Prometheus HTTP client config (promtool's --http.config.file): basic_auth, authorization, "
        "tls_config, http_headers",
    )
    a.add_argument("--bearer-token-file", metavar="FILE", help="send 'Authorization: Bearer <the file's content>'")
    a.add_argument(
        "--bearer-token", metavar="TOKEN", help="the token itself (visible to other users in ps: prefer the file)"
    )
    a.add_argument("--basic-auth-user", metavar="USER", help="basic auth user (or http://USER@host)")
    a.add_argument("--basic-auth-password-file", metavar="FILE", help="basic auth password, read from FILE")
    a.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="an extra request header, e.g. 'X-Scope-OrgID: team-a' (repeatable; values are treated as secrets)",
    )
    a.add_argument("--ca-file", metavar="FILE", help="CA certificate(s) to verify an https:// Prometheus with")
    a.add_argument("--cert-file", metavar="FILE", help="client certificate, for a Prometheus that asks for one")
    a.add_argument("--key-file", metavar="FILE", help="the client certificate's key")
    a.add_argument(
        "--insecure-skip-verify", action="store_true", help="do not verify the server certificate (tls_config's)"
    )
    p.add_argument("--start", type=parse_time, help="range start: unix seconds or RFC 3339 (default: end - last)")
    p.add_argument("--end", type=parse_time, help="range end (default: now)")
    p.add_argument(
        "--last",
        type=parse_duration,
        default=None,
        metavar="DURATION",
        help="range length when --start is not given (default: 1h)",
    )
    p.add_argument(
        "--step",
        type=parse_duration,
        default=None,
        metavar="DURATION",
        help="query_range step (default: range / 300, at least the scrape interval)",
    )
    p.add_argument(
        "--scrape-interval",
        type=parse_duration,
        default=15.0,
        metavar="DURATION",
        help="the targets' scrape interval, for $__rate_interval as Grafana computes it (default: 15s)",
    )
    p.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=V1[,V2]",
        help="a dashboard variable (job, namespace, node, host, gpu, rank, the job-name labels); default: All",
    )
    p.add_argument("--dashboard", action="append", default=[], metavar="UID", help="only these dashboards")
    p.add_argument("--out", default="report.html", help="HTML file to write (default: report.html)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per Prometheus request")
    p.add_argument("--strict", action="store_true", help="exit 1 if any query failed or returned nothing")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _say(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


def _needs_extras(e: ImportError) -> int:
    print(f"vramwatch report: needs {NEEDS}: {e}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        from vramwatch import __version__
        from vramwatch.errors import ConfigError
        from vramwatch.monitoring.dashboards import build_all
        from vramwatch.monitoring.dashboards.walk import TimeContext, spec
        from vramwatch.report.data import run_annotation, run_panel, variable_values
        from vramwatch.report.httpconfig import http_config, redact_url
        from vramwatch.report.prom import PromClient, PromError

        for module in ("grafana_foundation_sdk", "matplotlib"):  # build_all() and the charts import them late
            if importlib.util.find_spec(module) is None:
                raise ImportError(f"No module named {module!r}")
    except ImportError as e:
        return _needs_extras(e)

    end = args.end if args.end is not None else time.time()
    start = args.start if args.start is not None else end - (args.last or 3600.0)
    if args.start is not None and args.last is not None:
        print("vramwatch report: give --start or --last, not both", file=sys.stderr)
        return 2
    if start >= end:
        print("vramwatch report: the range start must be before its end", file=sys.stderr)
        return 2
    step = args.step or max(args.scrape_interval, round((end - start) / 300.0))
    tc = TimeContext(start=start, end=end, step=step, scrape_interval=args.scrape_interval)

    chosen: dict[str, list[str]] = {}
    for item in args.var:
        name, sep, value = item.partition("=")
        if not sep or not name:
            print(f"vramwatch report: --var wants NAME=VALUE, got {item!r}", file=sys.stderr)
            return 2
        chosen[name] = [v for v in value.split(",") if v]

    specs = [spec(m) for m in build_all()]
    if args.dashboard:
        unknown = set(args.dashboard) - {s.uid for s in specs}
        if unknown:
            print(f"vramwatch report: no dashboard {sorted(unknown)}; known: {[s.uid for s in specs]}", file=sys.stderr)
            return 2
        specs = [s for s in specs if s.uid in args.dashboard]
    known = {v.name for s in specs for v in s.variables if v.type == "query"}
    if set(chosen) - known:
        print(
            f"vramwatch report: unknown variable {sorted(set(chosen) - known)}; known: {sorted(known)}", file=sys.stderr
        )
        return 2

    try:
        url, http = http_config(
            args.prometheus,
            config_file=args.http_config_file or "",
            bearer_token=args.bearer_token or "",
            bearer_token_file=args.bearer_token_file or "",
            basic_auth_user=args.basic_auth_user or "",
            basic_auth_password_file=args.basic_auth_password_file or "",
            headers=args.header,
            ca_file=args.ca_file or "",
            cert_file=args.cert_file or "",
            key_file=args.key_file or "",
            insecure_skip_verify=args.insecure_skip_verify,
        )
        client = PromClient(url, timeout=args.timeout, http=http)
    except ConfigError as e:
        print(f"vramwatch report: {e}", file=sys.stderr)
        return 2
    shown_url = redact_url(url)
    try:
        client.query("vector(1)", end)
    except PromError as e:
        print(f"vramwatch report: {e}", file=sys.stderr)
        return 1
    when = (
        f"{datetime.fromtimestamp(start, tz=UTC):%Y-%m-%d %H:%M:%S} to "
        f"{datetime.fromtimestamp(end, tz=UTC):%Y-%m-%d %H:%M:%S} UTC"
    )
    _say(args, f"vramwatch report: {shown_url}, {when}, step {step:g}s")
    try:  # matplotlib's import is most of a second: only once Prometheus has answered
        from vramwatch.report import charts, html
    except ImportError as e:
        return _needs_extras(e)

    rendered, charts_n, empty, failed = [], 0, 0, 0
    for i, d in enumerate(specs, start=1):
        try:  # the host variable's All expands to the hosts it offers, as Grafana expands it
            values = variable_values(d, chosen, client, tc)
        except PromError as e:
            print(f"vramwatch report: {d.uid}'s variables: {e}", file=sys.stderr)
            return 1
        _say(args, f"[{i}/{len(specs)}] {d.title}: {len(d.panels)} panels")
        anns = [run_annotation(client, a, values, tc) for a in d.annotations]
        for a in anns:
            if a.error:
                _say(args, f"  annotation {a.annotation.name}: {a.error}")
        rows = []
        for row in d.rows:
            panels = []
            for p in row.panels:
                res = run_panel(client, p, values, tc)
                c = charts.chart(res, tc, anns)
                charts_n += 1
                empty += not res.series_count
                failed += bool(res.errors)
                panels.append(html.RenderedPanel(p, c, [r.expr for r in res.results]))
                _say(args, f"  {row.title} / {p.title}: {res.series_count} series" + (f" ({c.note})" if c.note else ""))
            rows.append((row.title, panels))
        rendered.append((d, rows))
    shown_vars = {name: ",".join(chosen[name]) if name in chosen else "All" for name in sorted(known)}
    text = html.page(shown_url, tc, shown_vars, rendered, __version__)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(text)
    _say(
        args,
        f"wrote {args.out}: {charts_n} charts, {len(text.encode()) / 1e6:.1f} MB"
        f" ({empty} without data, {failed} with failed queries)",
    )
    return 1 if args.strict and (empty or failed) else 0
