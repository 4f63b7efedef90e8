"""One chart per panel, drawn from the data Prometheus returned (the ``report`` extra): a matplotlib PNG, or
for a table panel an HTML table."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: render to PNG only

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from vramwatch.monitoring.dashboards.walk import Axis, PanelSpec, TimeContext
from vramwatch.report.data import AnnotationResult, PanelResult, legend

DPI = 100
WIDTH_IN = 6.4  # 640 px: two charts side by side on a laptop screen
# Grafana's named colours, as its dark/light themes render them
COLORS = {
    "green": "#56a64b",
    "orange": "#ff9830",
    "red": "#e02f44",
    "yellow": "#fade2a",
    "blue": "#3274d9",
    "purple": "#a352cc",
    "text": "#222222",
}
PALETTE = [
    "#3274d9",
    "#56a64b",
    "#ff9830",
    "#a352cc",
    "#e02f44",
    "#37872d",
    "#8ab8ff",
    "#fade2a",
    "#c4162a",
    "#1f60c4",
    "#ffb357",
    "#ca95e5",
]
MAX_LEGEND = 12
MAX_ROWS = 40
LABEL_ORDER = (
    "alertname",
    "severity",
    "job",
    "instance",
    "hostname",
    "gpu",
    "uuid",
    "rank",
    "local_rank",
    "device",
    "xid",
    "reason",
    "type",
    "kind",
)


@dataclass
class Chart:
    png: bytes
    width: int
    height: int
    series: int  # series Prometheus returned
    points: int  # values drawn
    note: str = ""  # "no data", errors
    table: str = ""  # a table panel: its HTML table (and no PNG)


def color(name: str) -> str:
    return COLORS.get(name, name)


# --- units (Grafana's unit ids) ---

_IEC = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]


def _scaled(v: float, base: float, names: list[str]) -> str:
    i = 0
    while abs(v) >= base and i < len(names) - 1:
        v /= base
        i += 1
    return f"{v:.3g} {names[i]}".strip()


def fmt(v: float, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if unit == "bytes":
        return _scaled(v, 1024.0, _IEC)
    if unit == "percentunit":
        return f"{v * 100:.3g}%"
    if unit == "percent":
        return f"{v:.3g}%"
    if unit == "watt":
        return _scaled(v, 1000.0, ["W", "kW", "MW"])
    if unit == "celsius":
        return f"{v:.3g} °C"
    if unit == "hertz":
        return _scaled(v, 1000.0, ["Hz", "kHz", "MHz", "GHz"])
    if unit == "s":
        a = abs(v)
        if a == 0:
            return "0 s"
        if a < 1e-3:
            return f"{v * 1e6:.3g} µs"
        if a < 1:
            return f"{v * 1e3:.3g} ms"
        if a < 120:
            return f"{v:.3g} s"
        if a < 7200:
            return f"{v / 60:.3g} min"
        return f"{v / 3600:.3g} h"
    if unit.startswith("dateTime"):
        return datetime.fromtimestamp(v / 1000.0, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
    if unit == "short":
        return _scaled(v, 1000.0, ["", "k", "M", "G", "T"]) if abs(v) >= 1000 else f"{v:.4g}"
    return f"{v:.4g}"


def _formatter(unit: str) -> FuncFormatter:
    return FuncFormatter(lambda v, _pos: fmt(v, unit))


def _figure(height_in: float) -> tuple[Figure, plt.Axes]:
    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI)
    ax = fig.add_subplot()
    return fig, ax


def _png(fig: Figure) -> tuple[bytes, int, int]:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    w, h = fig.canvas.get_width_height()
    return buf.getvalue(), int(w), int(h)


def _no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#888888", fontsize=11)
    ax.set_xticks([])
    ax.set_yticks([])
    for s in ax.spines.values():
        s.set_visible(False)


def _dt(ts: list[float]) -> Any:
    # Typed Any: matplotlib's stubs take floats, though its unit registry plots datetimes.
    return [datetime.fromtimestamp(t, tz=UTC) for t in ts]


MARGIN = 0.05  # of the data's span, above and below (matplotlib's own autoscale margin)


def y_range(values: Sequence[float], axis: Axis, bars: bool = False) -> tuple[float, float]:
    """The y-axis for ``values`` (the data, not forecasts) and the axis' threshold lines and fixed ends.

    A projection far beyond the data does not stretch the axis: it is drawn up to the edge.
    """
    finite = [v for v in values if math.isfinite(v)] + [v for v, _ in axis.thresholds]
    if bars:
        finite.append(0.0)  # bars grow from zero
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    pad = (hi - lo) * MARGIN or abs(hi) * MARGIN or 1.0
    lo, hi = lo - pad if lo < 0 or lo - pad >= 0 else 0.0, hi + pad  # a positive series keeps a 0 floor
    if axis.min is not None:
        lo = axis.min
    if axis.max is not None:
        hi = axis.max
    if hi <= lo:  # a fixed end on the wrong side of the data
        hi = lo + pad
    return lo, hi


def _limits(ax: Axes, axis: Axis, values: Sequence[float], bars: bool) -> None:
    ax.set_ylim(*y_range(values, axis, bars))
    for value, col in axis.thresholds:
        ax.axhline(value, color=color(col), linestyle="--", linewidth=1.0, alpha=0.9)


# --- panel types ---


def timeseries(res: PanelResult, tc: TimeContext, annotations: Sequence[AnnotationResult] = ()) -> Figure:
    p = res.panel
    fig, ax = _figure(3.1)
    right = ax.twinx() if p.right else None
    handles: list[Artist | BarContainer] = []
    data: dict[bool, list[float]] = {False: [], True: []}  # values that size the left / right axis
    forecasts: list[tuple[Artist | BarContainer, bool, list[float]]] = []
    n = 0
    bar_series = sum(len(r.series) for r in res.results) if p.bars else 0
    stack: dict[float, float] = {}  # time -> the top of the stack so far (a stacked panel's left axis)
    for r in res.results:
        target_ax = right if (right is not None and r.target.ref in p.right) else ax
        for s in r.series:
            col = color(p.colors[r.target.ref]) if r.target.ref in p.colors else PALETTE[n % len(PALETTE)]
            n += 1
            x, y = _dt(s.times), s.values
            name = legend(r.target, s.labels)
            style = "--" if r.target.ref in p.dashed else "-"
            if p.stacked and target_ax is ax and not r.target.projection and not p.bars:
                # on top of the series before, as the caption says: the line is the running sum, filled down
                lower = [stack.get(t, 0.0) for t in s.times]
                y = [lo + v if math.isfinite(v) else math.nan for lo, v in zip(lower, s.values, strict=True)]
                stack.update((t, top) for t, top in zip(s.times, y, strict=True) if math.isfinite(top))
                ax.fill_between(x, lower, y, color=col, alpha=0.35, linewidth=0, step="post" if p.stepped else None)
            if p.bars:  # side by side within each step (matplotlib dates are days)
                width = tc.step / 86400.0 * 0.9 / bar_series
                h: Artist | BarContainer = target_ax.bar(
                    [mdates.date2num(t) + (n - 1) * width for t in x],
                    y,
                    width=width,
                    color=col,
                    label=name,
                    align="edge",
                )
            else:
                (h,) = target_ax.plot(
                    x,
                    y,
                    style,
                    color=col,
                    linewidth=1.3,
                    label=name,
                    drawstyle="steps-post" if p.stepped else "default",
                )
            handles.append(h)
            on_right = target_ax is right
            if r.target.projection:
                forecasts.append((h, on_right, y))
            else:
                data[on_right] += y
    if not handles:
        _no_data(ax, p.no_value or "No data")
        if right is not None:
            right.set_axis_off()
        return fig
    marked = set()
    for a in annotations:  # a line where each event starts, titled once per time and title
        for start, _end, title in a.events:
            x = _dt([start])[0]
            ax.axvline(x, color=color(a.annotation.color), linewidth=0.9, alpha=0.8)
            if (start, title) not in marked:
                marked.add((start, title))
                ax.text(
                    x,
                    1.0,
                    " " + title,
                    transform=ax.get_xaxis_transform(),
                    fontsize=6,
                    va="top",
                    color=color(a.annotation.color),
                )
    ax.set_xlim(_dt([tc.start])[0], _dt([tc.end])[0])
    ax.yaxis.set_major_formatter(_formatter(p.axis.unit))
    _limits(ax, p.axis, data[False], p.bars)
    if right is not None:
        ax_r = next(iter(p.right.values()))
        right.yaxis.set_major_formatter(_formatter(ax_r.unit))
        _limits(right, ax_r, data[True], p.bars)
    for h, on_right, y in forecasts:  # say where a forecast leaves the chart
        top = (right if on_right and right is not None else ax).get_ylim()[1]
        beyond = [v for v in y if math.isfinite(v) and v > top]
        if beyond:
            unit = (next(iter(p.right.values())) if on_right else p.axis).unit
            h.set_label(f"{h.get_label()} (up to {fmt(max(beyond), unit)}, beyond the axis)")
    loc = mdates.AutoDateLocator(minticks=3, maxticks=7, tz=UTC)
    ax.xaxis.set_major_locator(loc)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc, tz=UTC, show_offset=False))
    for axes in (ax, right):
        if axes is not None:
            axes.tick_params(labelsize=7)
    ax.grid(True, alpha=0.25)
    shown = handles[:MAX_LEGEND]
    labels = [str(h.get_label()) for h in shown]
    if len(handles) > MAX_LEGEND:
        labels[-1] += f" (+{len(handles) - MAX_LEGEND} more)"
    ncol = 2 if len(shown) > 3 else 1
    rows = math.ceil(len(shown) / ncol)
    fig.set_figheight(2.4 + 0.17 * rows)
    ax.legend(shown, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=ncol, fontsize=7, frameon=False)
    fig.subplots_adjust(
        left=0.11,
        right=0.89 if right is not None else 0.97,
        top=0.96,
        bottom=(0.2 + 0.17 * rows) / fig.get_figheight() + 0.05,
    )
    return fig


def _label_columns(keys: set[str], hidden: set[str]) -> list[str]:
    keys = {k for k in keys if k not in hidden and k != "__name__"}
    return [k for k in LABEL_ORDER if k in keys] + sorted(keys - set(LABEL_ORDER))


def table_rows(res: PanelResult) -> tuple[list[str], list[list[str]], list[list[float | None]]]:
    """Grafana's merge: one row per label set across the panel's queries, one column per query."""
    p = res.panel
    value_cols = [
        (r.target.ref, p.columns.get(r.target.ref, "Value" if len(res.results) == 1 else f"Value #{r.target.ref}"))
        for r in res.results
    ]
    value_cols = [(ref, title) for ref, title in value_cols if title not in p.hidden]
    rows: dict[tuple, dict] = {}
    for r in res.results:
        for s in r.series:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "__name__"))
            rows.setdefault(key, {})[r.target.ref] = s.values[-1] if s.values else None
    labels = _label_columns({k for key in rows for k, _ in key}, p.hidden)
    header = labels + [title for _, title in value_cols]
    out, nums = [], []
    for key, vals in rows.items():
        d = dict(key)
        nums.append([vals.get(ref) for ref, _ in value_cols])
        out.append([d.get(k, "") for k in labels])
    order = list(range(len(out)))
    if p.sort_by in header:
        i = header.index(p.sort_by)
        if i >= len(labels):
            j = i - len(labels)
            order.sort(key=lambda k: (nums[k][j] is None, -(nums[k][j] or 0) if p.sort_desc else (nums[k][j] or 0)))
        else:
            order.sort(key=lambda k: out[k][i], reverse=p.sort_desc)
    text = []
    for k in order:
        cells = list(out[k])
        for (_ref, title), v in zip(value_cols, nums[k], strict=True):
            cells.append("" if v is None else fmt(v, p.column_units.get(title, p.axis.unit)))
        text.append(cells)
    return header, text, [nums[k] for k in order]


def table_html(res: PanelResult) -> str:
    """A table panel as an HTML table (text to select and search, sharp at any zoom; drawing the same cells
    with matplotlib took ~0.3 s a table), its thresholds as cell colours, at most MAX_ROWS rows."""
    p = res.panel
    header, text, nums = table_rows(res)
    if not text:
        return f'<p class="nodata">{escape(p.no_value or "No data")}</p>'
    n_labels = len(header) - len(nums[0])
    steps = [p.column_thresholds.get(h, () if p.column_thresholds else p.axis.thresholds) for h in header]
    out = ["<table><thead><tr>", *(f"<th>{escape(h)}</th>" for h in header), "</tr></thead><tbody>"]
    for cells, values in zip(text[:MAX_ROWS], nums, strict=False):
        out.append("<tr>")
        for col, cell in enumerate(cells):
            if col < n_labels:
                out.append(f"<td>{escape(cell)}</td>")
                continue
            c = _threshold_color(values[col - n_labels], Axis(p.axis.unit, thresholds=steps[col]))
            # the threshold colour at 55% opacity (alpha 0x8c), light enough to read the value on
            style = f' style="background:{c}8c"' if c.startswith("#") and len(c) == 7 else ""
            out.append(f'<td class="num"{style}>{escape(cell)}</td>')
        out.append("</tr>")
    out.append("</tbody></table>")
    if len(text) > MAX_ROWS:
        out.append(f'<p class="more">... {len(text) - MAX_ROWS} more rows</p>')
    return "".join(out)


def _threshold_color(v: float | None, axis: Axis) -> str:
    if v is None or not axis.thresholds:
        return ""
    out = ""
    for value, col in axis.thresholds:
        if v >= value:
            out = color(col)
    return out


def stat(res: PanelResult) -> Figure:
    p = res.panel
    fig = Figure(figsize=(WIDTH_IN / 2, 1.3), dpi=DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    values = [s.values[-1] for r in res.results for s in r.series if s.values]
    if not values:
        _no_data(ax, p.no_value or "No data")
        return fig
    v = values[0]
    bg = _threshold_color(v, p.axis) or COLORS["green"]
    fig.patch.set_facecolor(bg)
    ax.text(0.5, 0.42, fmt(v, p.axis.unit), ha="center", va="center", fontsize=30, color="white", weight="bold")
    ax.text(0.5, 0.86, p.title, ha="center", va="center", fontsize=9, color="white")
    return fig


def bargauge(res: PanelResult) -> Figure:
    p = res.panel
    items = [(legend(r.target, s.labels), s.values[-1]) for r in res.results for s in r.series if s.values]
    items = items[:MAX_ROWS]
    fig, ax = _figure(0.6 + 0.3 * max(1, len(items)))
    if not items:
        _no_data(ax, p.no_value or "No data")
        return fig
    names, vals = [n for n, _ in items][::-1], [v for _, v in items][::-1]
    cols = [_threshold_color(v, p.axis) or COLORS["green"] for v in vals]
    ax.barh(names, vals, color=cols)
    hi = max([v for v in vals if v == v] + [1.0])
    ax.set_xlim(p.axis.min if p.axis.min is not None else 0, hi * 1.15)
    for i, v in enumerate(vals):
        ax.text(v, i, " " + fmt(v, p.axis.unit), va="center", fontsize=8)
    ax.xaxis.set_major_formatter(_formatter(p.axis.unit))
    ax.tick_params(labelsize=7)
    fig.subplots_adjust(left=0.3, right=0.97, top=0.95, bottom=0.5 / fig.get_figheight())
    return fig


def draw(res: PanelResult, tc: TimeContext, annotations: Sequence[AnnotationResult] = ()) -> Figure:
    """The figure of a panel drawn as a picture (a table panel is HTML: :func:`table_html`)."""
    p: PanelSpec = res.panel
    if p.type == "timeseries":
        return timeseries(res, tc, annotations)
    if p.type == "stat":
        return stat(res)
    if p.type == "bargauge":
        return bargauge(res)
    fig, ax = _figure(1.5)
    _no_data(ax, f"panel type {p.type!r} is not drawn in reports")
    return fig


def chart(res: PanelResult, tc: TimeContext, annotations: Sequence[AnnotationResult] = ()) -> Chart:
    notes = "; ".join(res.errors or ([] if res.series_count else ["no data"]))
    if res.panel.type == "table":
        return Chart(b"", 0, 0, res.series_count, res.point_count, notes, table_html(res))
    png, w, h = _png(draw(res, tc, annotations))
    return Chart(png, w, h, res.series_count, res.point_count, notes)
