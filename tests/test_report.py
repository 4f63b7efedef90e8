"""`vramwatch report`: one chart per panel drawn from what Prometheus returned, checked in headless Chromium."""

from __future__ import annotations

import dataclasses
import hashlib
import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("grafana_foundation_sdk")
pytest.importorskip("matplotlib")

import live_scenario
from forked_cli import ForkedCLI

from harness import tool
from vramwatch.monitoring.config import DEFAULT
from vramwatch.monitoring.dashboards import build_all
from vramwatch.monitoring.dashboards.walk import TimeContext, spec
from vramwatch.report import charts
from vramwatch.report.data import legend, run_panel, variable_values
from vramwatch.report.prom import PromClient

ROOT = Path(__file__).resolve().parent.parent
SPECS = [spec(m) for m in build_all()]
PANELS = sum(len(d.panels) for d in SPECS)
TABLES = sum(p.type == "table" for d in SPECS for p in d.panels)
IMG = re.compile(
    r'<figure class="panel (\w+)" id="([\w-]+)" data-panel-id="(\d+)" data-type="\w+" '
    r'data-series="(\d+)" data-points="(\d+)"><img src="data:image/png;base64,([A-Za-z0-9+/=]+)" '
    r'width="(\d+)" height="(\d+)"'
)
# a table panel is an HTML table in the page, not a picture
TABLE = re.compile(
    r'<figure class="panel table" id="([\w-]+)" data-panel-id="(\d+)" data-type="table" '
    r'data-series="(\d+)" data-points="(\d+)"><div class="table">(.*?)</div><figcaption>'
)


# --- a fake Prometheus: every query gets its own, known answer ---


def _answer(expr: str, n: int) -> list[float]:
    seed = hashlib.sha256(expr.encode()).digest()
    return [float(seed[i % 32] + i) for i in range(n)]


def _labels(expr: str) -> list[dict[str, str]]:
    # two series per query, with the labels the panels' legends and tables use
    return [
        {
            "job": "vramwatch",
            "instance": "node-a:9400",
            "gpu": str(i),
            "uuid": f"GPU-{i}",
            "rank": str(i),
            "local_rank": str(i),
            "xid": str(79 + i),
            "reason": f"reason{i}",
            "type": f"type{i}",
            "kind": f"kind{i}",
            "role": f"role{i}",
            "device": "0",
            "alertname": f"Alert{i}",
            "severity": "warning",
        }
        for i in range(2)
    ]


class FakeProm(BaseHTTPRequestHandler):
    empty: set[str] = set()  # exprs answered with no series
    seen: list[str] = []
    auth: list[str | None] = []
    headers_seen: list[dict[str, str]] = []
    require: dict[str, str] = {}  # header -> value every request must carry, else 401
    redirect_to = ""  # answer every request with a redirect there

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):
        u = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(u.query))
        expr = q.get("query", q.get("match[]", ""))
        FakeProm.seen.append(expr)
        FakeProm.auth.append(self.headers.get("Authorization"))
        FakeProm.headers_seen.append({k.lower(): v for k, v in self.headers.items()})
        if FakeProm.redirect_to:
            self.send_response(302)
            self.send_header("Location", FakeProm.redirect_to + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if any(self.headers.get(k) != v for k, v in FakeProm.require.items()):
            return self._send(401, {"status": "error", "errorType": "unauthorized", "error": "who are you"})
        if "syntax error" in expr:
            return self._send(400, {"status": "error", "errorType": "bad_data", "error": "parse error"})
        empty = any(e in expr for e in FakeProm.empty)
        if u.path == "/api/v1/query_range":
            start, end, step = float(q["start"]), float(q["end"]), float(q["step"])
            n = int((end - start) // step) + 1
            vals = _answer(expr, n)
            res = (
                []
                if empty
                else [
                    {"metric": lab, "values": [[start + k * step, str(v + 1000 * j)] for k, v in enumerate(vals)]}
                    for j, lab in enumerate(_labels(expr))
                ]
            )
            return self._send(200, {"status": "success", "data": {"resultType": "matrix", "result": res}})
        if u.path == "/api/v1/query":
            v = _answer(expr, 1)[0]
            res = (
                []
                if empty
                else [{"metric": lab, "value": [float(q["time"]), str(v + j)]} for j, lab in enumerate(_labels(expr))]
            )
            return self._send(200, {"status": "success", "data": {"resultType": "vector", "result": res}})
        if u.path == "/api/v1/series":
            return self._send(200, {"status": "success", "data": _labels(expr)})
        self._send(404, {"status": "error", "error": "not found"})

    def _send(self, code, doc):
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve(tls=None):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeProm)
    if tls is not None:
        srv.socket = tls.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    FakeProm.empty, FakeProm.seen, FakeProm.auth, FakeProm.headers_seen = set(), [], [], []
    FakeProm.require, FakeProm.redirect_to = {}, ""
    return srv


@pytest.fixture
def fake_prom():
    srv = _serve()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


# `vramwatch report` runs ~30 times here: each run is forked from one process that has imported the report
# (and matplotlib) once, instead of paying those imports (~1.4 s of CPU) in each.
_forked: list[ForkedCLI] = []
REPORT_MODULES = [f"vramwatch.report.{m}" for m in ("charts", "data", "html", "httpconfig", "prom")]


@pytest.fixture(scope="module", autouse=True)
def _forked_cli():
    yield
    while _forked:
        _forked.pop().close()


def _report(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    if not (_forked and _forked[-1].alive):  # one that timed out or died takes no more runs
        _forked.append(ForkedCLI([*REPORT_MODULES, "vramwatch.monitoring.dashboards"], cwd=ROOT))
    return _forked[-1].run(["report", *args], timeout)


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", png[16:24])


def _figures(html_text: str) -> list[tuple]:
    import base64

    return [
        (t, fid, int(pid), int(series), int(points), base64.b64decode(b64), int(w), int(h))
        for t, fid, pid, series, points, b64, w, h in IMG.findall(html_text)
    ]


# --- charts are drawn from the returned data ---


BEYOND = re.compile(r" \(up to [^)]*, beyond the axis\)$")


def _lines(fig) -> dict[str, list[list[float]]]:
    """Each legend's drawn series (a legend without labels, e.g. a total, may name more than one here:
    the fake answers every query with two series)."""
    out: dict[str, list[list[float]]] = {}
    for ax in fig.axes:
        for ln in ax.get_lines():
            if not ln.get_label().startswith("_"):  # threshold and event lines are unlabelled
                out.setdefault(BEYOND.sub("", ln.get_label()), []).append([float(v) for v in ln.get_ydata()])
        for cont in ax.containers:  # bars
            out.setdefault(BEYOND.sub("", cont.get_label()), []).append([float(r.get_height()) for r in cont])
    return out


def test_every_chart_draws_exactly_what_prometheus_returned(fake_prom):
    client = PromClient(fake_prom)
    tc = TimeContext(start=1_800_000_000, end=1_800_000_600, step=60, scrape_interval=15)
    checked = 0
    for d in SPECS:
        values = variable_values(d, {}, client, tc)
        for p in d.panels:
            res = run_panel(client, p, values, tc)
            assert res.series_count == 2 * len(p.targets) and not res.errors, p.title
            if p.type == "table":
                header, rows, nums = charts.table_rows(res)
                page = charts.table_html(res)
                cells = {c for row in rows for c in row}
                for r in res.results:
                    col = p.columns.get(r.target.ref, "Value")
                    if col in p.hidden:
                        continue
                    unit = p.column_units.get(col, p.axis.unit)
                    for s in r.series:
                        shown = charts.fmt(s.values[-1], unit)
                        assert shown in cells and f">{html.escape(shown)}</td>" in page, (p.title, r.target.ref)
                assert not set(header) & p.hidden
                assert [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", page)] == header, p.title
                assert page.count("<tr>") == len(rows) + 1, p.title
                checked += 1
                continue
            fig = charts.draw(res, tc)
            if p.type == "timeseries":
                drawn = _lines(fig)
                for r, s, shown in _drawn_values(p, res):
                    assert shown in drawn[legend(r.target, s.labels)], (p.title, r.target.ref)
                    assert len(s.values) == 11
            elif p.type in ("stat", "bargauge"):
                texts = {t.get_text().strip() for ax in fig.axes for t in ax.texts}
                v = res.results[0].series[0].values[-1]
                assert charts.fmt(v, p.axis.unit) in texts, p.title
            checked += 1
            import matplotlib.pyplot as plt

            plt.close(fig)
    assert checked == PANELS
    # the queries ran with the template variables substituted (All, Grafana's interval variables)
    ran = [e for e in FakeProm.seen if e != "vector(1)"]
    assert ran and not [e for e in ran if "$" in e]
    assert any('job=~".*"' in e for e in ran) and any("[75s]" in e for e in ran)  # rate interval 60 + 15
    # host has no custom All: it expands to the hosts its own query offers (the fake's one), as Grafana does
    assert any('instance=~"node-a:9400"' in e for e in ran) and not any('instance=~".*"' in e for e in ran)


def _drawn_values(p, res):
    """(result, series, the values drawn): a series' own, or on a stacked panel its running sum over the
    series before it (the left axis; forecasts are never stacked)."""
    stack: dict[float, float] = {}
    out = []
    for r in res.results:
        for s in r.series:
            shown = s.values
            if p.stacked and r.target.ref not in p.right and not r.target.projection:
                shown = [stack.get(t, 0.0) + v for t, v in zip(s.times, s.values, strict=True)]
                stack.update(zip(s.times, shown, strict=True))
            out.append((r, s, shown))
    return out


def test_memory_by_role_is_drawn_stacked_as_its_caption_says(fake_prom):
    client = PromClient(fake_prom)
    tc = TimeContext(start=1_800_000_000, end=1_800_000_600, step=60, scrape_interval=15)
    (d,) = [x for x in SPECS if x.uid == "vramwatch-training-memory"]
    (p,) = [x for x in d.panels if x.title == "Memory by role"]
    assert p.stacked and "stacked" in p.description
    res = run_panel(client, p, variable_values(d, {}, client, tc), tc)
    drawn = _lines(charts.draw(res, tc))
    (*_, (r, s, top)) = _drawn_values(p, res)
    assert top in drawn[legend(r.target, s.labels)] and top != s.values, "the last series is not on top of the rest"
    assert [x for x in SPECS for q in x.panels if q.stacked and q is not p] == [], "another panel stacks: test it"


def _axes_data(fig, res, p):
    """(axes, the values drawn on it that are data, not forecasts, its Axis spec) for each y-axis."""

    main, *rest = fig.axes
    out = []
    for ax, axis in [(main, p.axis)] + [(ax, next(iter(p.right.values()))) for ax in rest]:
        refs = set(p.right) if ax is not main else {r.target.ref for r in res.results} - set(p.right)
        values = [
            v
            for r, _, shown in _drawn_values(p, res)
            if r.target.ref in refs and not r.target.projection
            for v in shown
        ]
        out.append((ax, values, axis))
    return out


def test_every_chart_axis_is_sized_to_its_data(fake_prom):
    client = PromClient(fake_prom)
    tc = TimeContext(start=1_800_000_000, end=1_800_000_600, step=60, scrape_interval=15)
    checked = 0
    for d in SPECS:
        values = variable_values(d, {}, client, tc)
        for p in (p for p in d.panels if p.type in ("timeseries", "bargauge")):
            res = run_panel(client, p, values, tc)
            fig = charts.draw(res, tc)
            if p.type == "bargauge":
                (ax,) = fig.axes
                lo, hi = ax.get_xlim()
                top = max(s.values[-1] for r in res.results for s in r.series)
                assert lo == 0 and top <= hi <= 1.2 * top, (p.title, lo, hi, top)
                checked += 1
                continue
            for ax, data, axis in _axes_data(fig, res, p):
                lo, hi = ax.get_ylim()
                marks = [v for v, _ in axis.thresholds] + ([0.0] if p.bars else [])
                want_lo = axis.min if axis.min is not None else min(data + marks)
                want_hi = axis.max if axis.max is not None else max(data + marks)
                if axis.max is None:
                    assert hi >= max(data + marks), (p.title, "data above the axis")
                if axis.min is None:
                    assert lo <= min(data + marks), (p.title, "data below the axis")
                span = want_hi - want_lo
                # no more room than the margin: the axis fits the data (and the threshold lines, fixed ends)
                assert want_hi <= hi <= want_hi + 0.06 * span + 1e-9, (p.title, hi, want_hi)
                assert want_lo - 0.06 * span - 1e-9 <= lo <= want_lo, (p.title, lo, want_lo)
                checked += 1
            import matplotlib.pyplot as plt

            plt.close(fig)
    assert checked >= sum(1 for d in SPECS for p in d.panels if p.type in ("timeseries", "bargauge"))


def test_the_leak_projection_does_not_flatten_the_peak():
    """A projection tens of TiB out (a steep 4-hour extrapolation) is drawn to the edge, with its reach named."""
    from vramwatch.report.data import PanelResult, TargetResult
    from vramwatch.report.prom import Series

    (d,) = [x for x in SPECS if x.uid == "vramwatch-training-memory"]
    (p,) = [x for x in d.panels if x.title == "Per-step peak and leak projection"]
    refs = {t.ref: t for t in p.targets}
    assert refs["B"].projection and not refs["A"].projection and not refs["C"].projection
    lab = {"job": "j", "instance": "h", "rank": "0", "device": "0", "uuid": "U"}
    ts = [1_800_000_000 + 60.0 * i for i in range(11)]
    gib = float(1 << 30)
    peak = [60 * gib + 0.2 * gib * i for i in range(11)]
    proj = [20 * 1024 * gib * (1 + i) for i in range(11)]  # up to 220 TiB
    res = PanelResult(
        p,
        [
            TargetResult(refs["A"], "", [Series(lab, ts, peak)]),
            TargetResult(refs["B"], "", [Series(lab, ts, proj)]),
            TargetResult(refs["C"], "", [Series(lab, ts, [70 * gib] * 11)]),
        ],
    )
    fig = charts.draw(res, TimeContext(ts[0], ts[-1], 60, 15))
    lo, hi = fig.axes[0].get_ylim()
    assert lo == 0 and 70 * gib <= hi <= 75 * gib  # the peak and the limit fill the chart
    labels = [h.get_label() for h in fig.axes[0].get_lines() if not h.get_label().startswith("_")]
    assert any(lb.endswith("(up to 220 TiB, beyond the axis)") for lb in labels), labels
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("beyond the axis" in t for t in legend), legend


def test_table_sorts_merges_and_formats():
    from vramwatch.monitoring.dashboards.walk import Target
    from vramwatch.report.data import PanelResult, TargetResult
    from vramwatch.report.prom import Series

    (d,) = [x for x in SPECS if x.uid == "vramwatch-fleet"]
    (p,) = [x for x in d.panels if x.title == "GPUs by memory pressure"]
    lab = [{"job": "j", "instance": "h", "gpu": g, "uuid": f"U{g}"} for g in "012"]
    a = TargetResult(Target("A", "", "", True), "", [Series(lab[i], [0], [v]) for i, v in enumerate([0.5, 0.97, 0.9])])
    b = TargetResult(Target("B", "", "", True), "", [Series(lab[1], [0], [0.99])])
    header, rows, nums = charts.table_rows(PanelResult(p, [a, b]))
    assert header == ["job", "instance", "gpu", "uuid", "used / total", "reserved / limit"]
    assert [r[2] for r in rows] == ["1", "2", "0"]  # the fullest first
    assert rows[0][4:] == ["97%", "99%"] and rows[2][5] == ""  # merged on the label set
    assert charts._threshold_color(0.97, p.axis) == charts.COLORS["red"]
    assert charts._threshold_color(0.9, p.axis) == charts.COLORS["orange"]
    assert charts._threshold_color(0.5, p.axis) == ""
    # in the page: the rows in that order, each value's threshold colour as its cell's background
    body = charts.table_html(PanelResult(p, [a, b]))
    red, orange = charts.COLORS["red"], charts.COLORS["orange"]
    assert re.findall(r"<tr>(.*?)</tr>", body)[1:] == [
        f'<td>j</td><td>h</td><td>1</td><td>U1</td><td class="num" style="background:{red}8c">97%</td>'
        f'<td class="num" style="background:{red}8c">99%</td>',
        f'<td>j</td><td>h</td><td>2</td><td>U2</td><td class="num" style="background:{orange}8c">90%</td>'
        '<td class="num"></td>',
        '<td>j</td><td>h</td><td>0</td><td>U0</td><td class="num">50%</td><td class="num"></td>',
    ]
    (hb,) = [x for x in d.panels if x.title == "Ranks by heartbeat age"]
    assert hb.column_thresholds == {"heartbeat age": ((DEFAULT.stall_min_seconds, "red"),)} and not hb.axis.thresholds


@pytest.mark.parametrize(
    "v,unit,text",
    [
        (3 * 2**30, "bytes", "3 GiB"),
        (0.853, "percentunit", "85.3%"),
        (612.0, "watt", "612 W"),
        (1.98e9, "hertz", "1.98 GHz"),
        (0.0042, "s", "4.2 ms"),
        (300.0, "s", "5 min"),
        (71.5, "celsius", "71.5 °C"),
        (1_800_000_000_000, "dateTimeAsIso", "2027-01-15 08:00:00"),
    ],
)
def test_units_read_like_grafana(v, unit, text):
    assert charts.fmt(v, unit) == text


def test_cli_writes_one_chart_per_panel_self_contained(fake_prom, tmp_path):
    out = tmp_path / "r.html"
    r = _report("--prometheus", fake_prom, "--last", "30m", "--out", str(out), "--var", "rank=0,1")
    assert r.returncode == 0, r.stderr
    html_text = out.read_text()
    figs, tables = _figures(html_text), TABLE.findall(html_text)
    assert len(figs) == PANELS - TABLES == html_text.count("<img ") and len(tables) == TABLES > 0
    assert len({f[1] for f in figs} | {t[0] for t in tables}) == PANELS  # one per panel, each once
    for _type, fid, _pid, series, points, png, w, h in figs:
        assert series > 0 and points > 0, fid
        assert _png_size(png) == (w, h), fid
    for fid, _pid, series, points, table in tables:
        assert int(series) > 0 and int(points) > 0 and table.startswith("<table><thead>") and "<td" in table, fid
    sections = re.findall(r'<section class="row"><h3>([^<]*)</h3>', html_text)
    assert sections == [r.title for d in SPECS for r in d.rows]  # one section per dashboard row
    assert not re.search(r'(src|href)="(?!data:|#)', html_text)  # nothing fetched from outside
    assert "<script" not in html_text and "<link" not in html_text
    assert 'rank=~"(0|1)"' in "".join(FakeProm.seen)  # --var reached the queries
    assert "rank = 0,1" in html_text
    # progress on stderr: one line per dashboard and per panel
    assert r.stderr.count("series") == PANELS and "[3/3]" in r.stderr and f"{PANELS} charts" in r.stderr


def test_cli_errors(fake_prom, tmp_path):
    r = _report("--prometheus", f"http://127.0.0.1:{_closed_port()}", "--out", str(tmp_path / "x.html"))
    assert r.returncode == 1 and "did not answer" in r.stderr and not (tmp_path / "x.html").exists()
    r = _report("--prometheus", fake_prom, "--var", "nope=1", "--out", str(tmp_path / "x.html"))
    assert r.returncode == 2 and "unknown variable ['nope']" in r.stderr
    r = _report("--prometheus", fake_prom, "--start", "2026-12-01T10:00:00Z", "--end", "2026-12-01T09:00:00Z")
    assert r.returncode == 2 and "before its end" in r.stderr
    # --strict: a panel without data fails the run, but the page is still written and says so
    FakeProm.empty = {"gpu_up"}
    out = tmp_path / "strict.html"
    r = _report("--prometheus", fake_prom, "--strict", "--dashboard", "vramwatch-gpu-health", "--out", str(out))
    assert r.returncode == 1, r.stderr
    assert "GPU answering: 0 series (no data)" in r.stderr and "(no data)" in out.read_text()


def test_without_matplotlib_it_names_the_extra_before_asking_prometheus(fake_prom, tmp_path):
    """matplotlib is imported only once Prometheus has answered (errors come fast); its absence is still
    told first, with the extra to install, and no query is sent."""
    seen = len(FakeProm.seen)
    hide = "import sys; sys.modules['matplotlib'] = None; from vramwatch.cli import main; sys.exit(main())"
    args = ["report", "--prometheus", fake_prom, "--out", str(tmp_path / "x.html")]
    r = subprocess.run([sys.executable, "-c", hide, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs grafana-foundation-sdk" in r.stderr, r.stderr
    assert "vramwatch[report]" in r.stderr
    assert "matplotlib" in r.stderr and len(FakeProm.seen) == seen and not (tmp_path / "x.html").exists()
    # an error found before any chart is drawn does not pay for matplotlib's import
    probe = "import sys; from vramwatch.cli import main; rc = main(); "
    probe += "print('matplotlib' in sys.modules); sys.exit(rc)"
    r = subprocess.run(
        [sys.executable, "-c", probe, *args, "--var", "nope=1"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "unknown variable" in r.stderr and r.stdout.strip() == "False", (r.stdout, r.stderr)


def test_basic_auth_from_the_url(fake_prom):
    import base64

    url = fake_prom.replace("http://", "http://ml%20ops:s%3Acret@")
    assert PromClient(url).query("vector(1)", 0)[0].values == [_answer("vector(1)", 1)[0]]
    assert FakeProm.auth[-1] == "Basic " + base64.b64encode(b"ml ops:s:cret").decode()


# --- credentials: sent with every request, written nowhere ---

SECRET_PW, SECRET_TOKEN, SECRET_HEADER = "pw-Zq8rT1vX", "tok-9fK2mNp4Lw", "hdr-7Hs3Qe0R"


def _no_secrets(*texts: str, secrets=(SECRET_PW, SECRET_TOKEN, SECRET_HEADER)) -> None:
    import base64

    for text in texts:
        for secret in secrets:
            assert secret not in text, f"{secret!r} written out"
        for token in re.findall(r"[A-Za-z0-9+/]{12,}={0,2}", text):  # base64 of user:password
            try:
                decoded = base64.b64decode(token + "==", validate=False).decode("utf-8", "replace")
            except ValueError:
                continue
            assert SECRET_PW not in decoded, f"{secret!r} written out in base64"


def _secret_file(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text + "\n")
    f.chmod(0o600)
    return str(f)


def _auth_cases(tmp_path, base):
    import base64

    basic = "Basic " + base64.b64encode(f"ml ops:{SECRET_PW}".encode()).decode()
    bearer = f"Bearer {SECRET_TOKEN}"
    config = tmp_path / "http.yml"
    config.write_text(
        "authorization:\n  credentials_file: token\n"
        f"http_headers:\n  X-Api-Key:\n    secrets: [{SECRET_HEADER}]\n  X-Scope-OrgID:\n    values: [team-a]\n"
    )
    (tmp_path / "token").write_text(SECRET_TOKEN + "\n")
    host = base.split("://", 1)[1]
    scheme = base.split("://", 1)[0]
    return {
        "url user info": ([f"{scheme}://ml%20ops:{SECRET_PW}@{host}"], {"Authorization": basic}),
        "user in URL, password file": (
            [f"{scheme}://ml%20ops@{host}", "--basic-auth-password-file", _secret_file(tmp_path, "pw", SECRET_PW)],
            {"Authorization": basic},
        ),
        "bearer token file": (
            [base, "--bearer-token-file", _secret_file(tmp_path, "tok", SECRET_TOKEN)],
            {"Authorization": bearer},
        ),
        "bearer token": ([base, "--bearer-token", SECRET_TOKEN], {"Authorization": bearer}),
        "headers": (
            [base, "--header", f"X-Api-Key: {SECRET_HEADER}", "--header", "X-Scope-OrgID: team-a"],
            {"X-Api-Key": SECRET_HEADER, "X-Scope-OrgID": "team-a"},
        ),
        "http config file": (
            [base, "--http-config-file", str(config)],
            {"Authorization": bearer, "X-Api-Key": SECRET_HEADER, "X-Scope-OrgID": "team-a"},
        ),
    }


def _report_to(tmp_path, name, url_and_flags, *extra):
    out = tmp_path / f"{name.replace(' ', '-')}.html"
    r = _report(
        "--prometheus", *url_and_flags, "--dashboard", "vramwatch-fleet", "--last", "10m", "--out", str(out), *extra
    )
    return r, out


def test_credentials_go_into_requests_and_nowhere_else(fake_prom, tmp_path):
    for name, (args, headers) in _auth_cases(tmp_path, fake_prom).items():
        FakeProm.require, FakeProm.headers_seen = headers, []
        r, out = _report_to(tmp_path, name, args)
        assert r.returncode == 0, (name, r.stderr)
        assert FakeProm.headers_seen and all(
            all(h.get(k.lower()) == v for k, v in headers.items()) for h in FakeProm.headers_seen
        ), name
        page = out.read_text()
        assert f"Prometheus {fake_prom}</p>" in page, name  # the URL, without its user info
        _no_secrets(page, r.stderr, r.stdout)
        # the same credentials, refused: the error says so without repeating them
        FakeProm.require = {k: v + "x" for k, v in headers.items()}
        r, out = _report_to(tmp_path, name + " refused", args)
        assert r.returncode == 1 and "HTTP 401 (check the credentials)" in r.stderr, (name, r.stderr)
        assert not out.exists()
        _no_secrets(r.stderr, r.stdout)


def test_tls_with_a_ca_file_and_a_client_certificate(tmp_path):
    import ssl

    from tlsutil import make_pki

    pki = make_pki(tmp_path / "pki")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.cert, pki.key)
    ctx.load_verify_locations(pki.client_ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    srv = _serve(ctx)
    try:
        base = f"https://127.0.0.1:{srv.server_address[1]}"
        tls = ["--ca-file", str(pki.ca), "--cert-file", str(pki.client_cert), "--key-file", str(pki.client_key)]
        for name, (args, headers) in _auth_cases(tmp_path, base).items():
            FakeProm.require = headers
            r, out = _report_to(tmp_path, "tls " + name, [*args, *tls])
            assert r.returncode == 0, (name, r.stderr)
            assert f"Prometheus {base}</p>" in out.read_text()
            _no_secrets(out.read_text(), r.stderr, r.stdout)
        args, headers = _auth_cases(tmp_path, base)["url user info"]
        FakeProm.require, seen = headers, len(FakeProm.seen)
        # without the CA the server is not trusted; without the client certificate it refuses us
        for name, flags in (("no CA", tls[2:]), ("no client cert", tls[:2])):
            r, out = _report_to(tmp_path, name, [*args, *flags])
            assert r.returncode == 1 and "did not answer" in r.stderr, (name, r.stderr)
            _no_secrets(r.stderr, r.stdout)
        assert "CERTIFICATE_VERIFY_FAILED" in _report_to(tmp_path, "no CA", [*args, *tls[2:]])[0].stderr
        assert len(FakeProm.seen) == seen  # no request got through
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_redirect_elsewhere_does_not_get_the_credentials(fake_prom, tmp_path):
    other = _serve()
    try:
        FakeProm.redirect_to = f"http://localhost:{other.server_address[1]}"  # another origin
        r, _ = _report_to(tmp_path, "redirect", [fake_prom, "--bearer-token", SECRET_TOKEN])
        assert r.returncode == 1 and "HTTP 302, a redirect elsewhere (not followed)" in r.stderr, r.stderr
        assert len(FakeProm.headers_seen) == 1  # the other server never got a request
        _no_secrets(r.stderr)
    finally:
        other.shutdown()
        other.server_close()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--bearer-token", SECRET_TOKEN, "--bearer-token-file", "/nonexistent"], "give one way to authenticate"),
        (["--bearer-token-file", "/nonexistent/tok"], "--bearer-token-file /nonexistent/tok: cannot read it"),
        (["--header", f"Authorization: Bearer {SECRET_TOKEN}"], "header 'Authorization' is set by the client"),
        (["--header", SECRET_HEADER], "--header wants 'Name: value'"),
        (["--ca-file", "HTTP"], "TLS options given for http://"),
        (["--ca-file", "/nonexistent/ca.crt"], "--ca-file /nonexistent/ca.crt: no such file"),
        (["--ca-file", "HTTP", "HTTPS"], "does not load"),  # a file that is no certificate
        (["--http-config-file", "HTTP"], "unknown key 'proxy_url'"),
    ],
)
def test_bad_credential_options_exit_2_naming_them(fake_prom, tmp_path, flags, message):
    (tmp_path / "http.yml").write_text(f"proxy_url: http://x\nauthorization: {{credentials: {SECRET_TOKEN}}}\n")
    url = fake_prom.replace("http://", f"http://u:{SECRET_PW}@") if "--bearer-token" in flags else fake_prom
    if "HTTPS" in flags:
        url, flags = url.replace("http://", "https://"), [f for f in flags if f != "HTTPS"]
    flags = [str(tmp_path / "http.yml") if f == "HTTP" else f for f in flags]
    r = _report("--prometheus", url, *flags, "--out", str(tmp_path / "x.html"))
    assert r.returncode == 2 and message in r.stderr, r.stderr
    _no_secrets(r.stderr, r.stdout)
    assert not FakeProm.seen


def _closed_port() -> int:
    from harness import free_port

    return free_port()


# --- the real thing: a report of a live run, opened in headless Chromium ---


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    lv = live_scenario.start(tmp_path_factory.mktemp("report-live"))
    yield lv
    live_scenario.stop(lv)


# After the load event (which waits for every image), record what the browser decoded. A control
# figure with a corrupt PNG proves the check sees a broken image (naturalWidth 0).
CHECK_SCRIPT = """<figure class="panel control" id="control"><img src="data:image/png;base64,iVBORw0KGgoAAAA"></figure>
<script>
window.addEventListener('load', () => {
  const images = [...document.querySelectorAll('figure.panel img')].map(img =>
    [img.closest('figure').id, img.complete ? img.naturalWidth : -1, img.complete ? img.naturalHeight : -1]);
  const tables = [...document.querySelectorAll('figure.panel table')].map(t =>
    [t.closest('figure').id, t.rows.length, t.getBoundingClientRect().height]);
  const pre = document.createElement('pre'); pre.id = 'render-check';
  pre.textContent = JSON.stringify({images, tables}); document.body.appendChild(pre);
});
</script>"""


def _chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = tool("chromium")
    profile = cwd / f"chromium-profile-{time.monotonic_ns()}"
    profile.mkdir()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
    ]
    return subprocess.run([exe, *flags, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.e2e
@pytest.mark.slow
def test_live_report_renders_in_headless_chromium(live, tmp_path):
    out = tmp_path / "report.html"
    r = _report(
        "--prometheus",
        live.prometheus.url,
        "--start",
        str(live.t0 - 2),
        "--end",
        str(time.time()),
        "--step",
        "1s",
        "--scrape-interval",
        "1s",
        "--strict",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr  # --strict: every query answered with data
    html_text = out.read_text()
    figs, tables = _figures(html_text), TABLE.findall(html_text)
    assert len(figs) + len(tables) == PANELS
    assert all(f[3] > 0 and f[4] > 0 for f in figs), [f[1] for f in figs if not f[3]]

    # every chart decodes in a real browser, at the size the page says
    checked = tmp_path / "check.html"
    checked.write_text(html_text.replace("</body>", CHECK_SCRIPT + "</body>"))
    dom = _chromium("--virtual-time-budget=15000", "--dump-dom", checked.as_uri(), cwd=tmp_path)
    m = re.search(r'<pre id="render-check">(.*?)</pre>', dom.stdout, re.S)
    assert m, f"no render check in the DOM: {dom.stderr[-2000:]}"
    seen = json.loads(m.group(1))
    rendered = {fid: (w, h) for fid, w, h in seen["images"]}
    assert rendered.pop("control") == (0, 0)
    assert rendered == {f[1]: (f[6], f[7]) for f in figs}
    # every table laid out with its rows: the browser's row count is the page's, and it has a height
    want = {fid: table.count("<tr>") for fid, _pid, _s, _p, table in tables}
    assert {fid: rows for fid, rows, _h in seen["tables"]} == want and all(h > 0 for *_, h in seen["tables"])

    # a screenshot of the page as a person sees it
    shot = tmp_path / "report.png"
    res = _chromium("--window-size=1400,2200", f"--screenshot={shot}", out.as_uri(), cwd=tmp_path)
    assert shot.exists(), res.stderr[-2000:]
    import matplotlib.image as mpimg

    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (2200, 1400)
    assert pixels[300:2200].std() > 0.05  # charts, not a blank page
    docs = ROOT / "docs" / "img" / "report.png"
    if os.environ.get("VRAMWATCH_UPDATE_SCREENSHOT") or not docs.exists():
        docs.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, docs)


def test_a_panels_max_data_points_bound_the_steps_of_its_queries():
    steps: list[float] = []

    class Recording:
        def query_range(self, expr: str, start: float, end: float, step: float) -> list:
            steps.append(step)
            return []

    (d,) = [x for x in SPECS if x.uid == "vramwatch-fleet"]
    values = variable_values(d, {"host": ["h:9488"]})
    tc = TimeContext(start=0, end=6 * 3600, step=30, scrape_interval=15)
    (fullest,) = [p for p in d.panels if p.title == "Memory pressure, the ten fullest GPUs"]
    (pressure,) = [p for p in d.panels if p.title == "GPUs by memory pressure"]
    run_panel(Recording(), fullest, values, tc)  # type: ignore[arg-type]
    assert fullest.max_points == 360 and steps == [60]  # 6 h / 360
    steps.clear()
    run_panel(Recording(), dataclasses.replace(fullest, max_points=0), values, tc)  # type: ignore[arg-type]
    assert steps == [30] and pressure.max_points == 0
    steps.clear()  # a short range: the panel's own step
    run_panel(Recording(), fullest, values, dataclasses.replace(tc, end=600))  # type: ignore[arg-type]
    assert steps == [30]
