"""The report page: one section per dashboard, one per row, a PNG (or a table's HTML) per panel, nothing fetched
from outside."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape

from vramwatch.monitoring.dashboards.walk import DashboardSpec, PanelSpec, TimeContext
from vramwatch.report.charts import Chart

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#222;background:#f7f7f8}
header{background:#1f2329;color:#eee;padding:16px 24px}
header h1{margin:0 0 6px;font-size:20px}
header p{margin:2px 0;font-size:13px;color:#bbb}
nav a{color:#8ab8ff;margin-right:14px;font-size:13px}
main{padding:8px 24px 32px}
section.dashboard h2{margin:24px 0 4px;font-size:18px}
section.dashboard>p{margin:0 0 8px;color:#555;font-size:13px}
section.row h3{margin:16px 0 8px;font-size:15px;border-bottom:1px solid #ddd;padding-bottom:4px}
div.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:12px}
figure{margin:0;background:#fff;border:1px solid #e3e3e6;border-radius:4px;padding:8px}
figure.stat{max-width:340px}
figure img{max-width:100%;height:auto;display:block}
figcaption{font-size:12px;color:#444;margin-top:4px}
figcaption b{font-size:13px;color:#222}
figcaption .note{color:#c4162a}
details pre{white-space:pre-wrap;word-break:break-all;font-size:11px;background:#f4f4f4;padding:6px}
div.table{overflow-x:auto;max-height:520px;overflow-y:auto}
div.table table{border-collapse:collapse;font-size:12px;width:100%}
div.table th{background:#f0f0f0;text-align:left;position:sticky;top:0}
div.table th,div.table td{border:1px solid #dddddd;padding:2px 6px;white-space:nowrap}
div.table td.num{text-align:right;font-variant-numeric:tabular-nums}
p.nodata{color:#888888;text-align:center;margin:16px 0}
p.more{font-size:11px;color:#555;margin:4px 0 0}
"""


@dataclass
class RenderedPanel:
    panel: PanelSpec
    chart: Chart
    exprs: list[str]


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def page(
    prometheus: str,
    tc: TimeContext,
    variables: dict[str, str],
    dashboards: list[tuple[DashboardSpec, list[tuple[str, list[RenderedPanel]]]]],
    version: str,
) -> str:
    out = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>vramwatch report {escape(_when(tc.start))} to {escape(_when(tc.end))}</title>",
        f"<style>{CSS}</style></head><body>",
        "<header><h1>vramwatch report</h1>",
        f"<p>{escape(_when(tc.start))} to {escape(_when(tc.end))} &middot; step {tc.step:g} s &middot; "
        f"Prometheus {escape(prometheus)}</p>",
        "<p>" + " &middot; ".join(f"{escape(k)} = {escape(v)}" for k, v in variables.items()) + "</p>",
        f"<p>generated {escape(_when(datetime.now(UTC).timestamp()))} by vramwatch {escape(version)} "
        "from the same dashboard definitions as the Grafana JSON</p><nav>",
    ]
    out += [f'<a href="#{escape(d.uid)}">{escape(d.title)}</a>' for d, _ in dashboards]
    out.append("</nav></header><main>")
    for d, rows in dashboards:
        out.append(
            f'<section class="dashboard" id="{escape(d.uid)}"><h2>{escape(d.title)}</h2><p>{escape(d.description)}</p>'
        )
        for title, panels in rows:
            out.append(f'<section class="row"><h3>{escape(title)}</h3><div class="grid">')
            for rp in panels:
                out.append(_figure(d, rp))
            out.append("</div></section>")
        out.append("</section>")
    out.append("</main></body></html>\n")
    return "\n".join(out)


def _figure(d: DashboardSpec, rp: RenderedPanel) -> str:
    p, c = rp.panel, rp.chart
    if c.table:
        body = f'<div class="table">{c.table}</div>'
    else:
        src = "data:image/png;base64," + base64.b64encode(c.png).decode("ascii")
        body = f'<img src="{src}" width="{c.width}" height="{c.height}" alt="{escape(p.title)}">'
    note = f' <span class="note">({escape(c.note)})</span>' if c.note else ""
    queries = "\n".join(escape(e) for e in rp.exprs)
    return (
        f'<figure class="panel {escape(p.type)}" id="{escape(d.uid)}-{p.id}" data-panel-id="{p.id}" '
        f'data-type="{escape(p.type)}" data-series="{c.series}" data-points="{c.points}">'
        f"{body}<figcaption><b>{escape(p.title)}</b>{note}<br>{escape(p.description)}"
        f"<details><summary>queries</summary><pre>{queries}</pre></details></figcaption></figure>"
    )
