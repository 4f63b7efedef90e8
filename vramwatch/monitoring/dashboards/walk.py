"""Read the built dashboard models back as plain data, and substitute template variables.

The report and the live-data test both run the dashboards' own queries; this module
turns a built ``models.dashboard.Dashboard`` into :class:`DashboardSpec` (rows of
panels, each with its targets, unit, thresholds, axes) and expands Grafana's
template syntax (``$job``, ``${job}``, ``$__rate_interval``, ``$__range``,
``${__from:date:seconds}``) the way Grafana's Prometheus data source does.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from vramwatch.monitoring import promql


@dataclass(frozen=True)
class Target:
    ref: str
    expr: str
    legend: str
    instant: bool

    @property
    def projection(self) -> bool:
        """A forecast (predict_linear, or the leak alert's recorded one), not data: it may run far beyond the
        data's range."""
        return "predict_linear(" in self.expr or promql.LEAK_PROJECTION_RECORD in self.expr


@dataclass(frozen=True)
class Axis:
    unit: str
    min: float | None = None
    max: float | None = None
    thresholds: tuple[tuple[float, str], ...] = ()


@dataclass
class PanelSpec:
    id: int
    title: str
    type: str  # timeseries | table | stat | bargauge
    description: str
    targets: list[Target]
    axis: Axis  # the panel's default unit, min/max and threshold steps (value, colour)
    right: dict[str, Axis] = field(default_factory=dict)  # refId -> right-hand axis
    dashed: set[str] = field(default_factory=set)  # refIds drawn as dashed reference lines
    colors: dict[str, str] = field(default_factory=dict)  # refId -> fixed colour
    bars: bool = False
    stepped: bool = False
    stacked: bool = False  # series drawn on top of one another (Grafana's stacking mode "normal")
    columns: dict[str, str] = field(default_factory=dict)  # refId -> column title (tables)
    hidden: set[str] = field(default_factory=set)  # label columns left out (tables)
    column_units: dict[str, str] = field(default_factory=dict)  # column title -> unit (tables)
    # column title -> threshold steps colouring its cells (tables; else axis.thresholds colour every value)
    column_thresholds: dict[str, tuple[tuple[float, str], ...]] = field(default_factory=dict)
    sort_by: str = ""
    sort_desc: bool = True
    no_value: str = ""
    max_points: int = 0  # the panel's "max data points" (0: the width's): its step is at least range / this


@dataclass
class Row:
    title: str
    panels: list[PanelSpec]


@dataclass(frozen=True)
class Variable:
    name: str
    type: str  # datasource | query
    query: str
    all_value: str


@dataclass(frozen=True)
class Annotation:
    name: str
    expr: str
    title_format: str
    color: str
    step: str


@dataclass
class DashboardSpec:
    uid: str
    title: str
    description: str
    rows: list[Row]
    variables: list[Variable]
    annotations: list[Annotation]

    @property
    def panels(self) -> list[PanelSpec]:
        return [p for r in self.rows for p in r.panels]


def _val(x: Any) -> Any:
    return getattr(x, "value", x)  # enums -> their JSON value


def _steps(thr: Any) -> tuple[tuple[float, str], ...]:
    steps = getattr(thr, "steps", None) or []
    return tuple((float(s.value), s.color) for s in steps if s.value is not None)


def _panel(p: Any) -> PanelSpec:
    fc = p.field_config
    d = fc.defaults if fc is not None else None
    custom = getattr(d, "custom", None)
    spec = PanelSpec(
        id=int(p.id_val or 0),
        title=p.title or "",
        type=p.type_val,
        description=p.description or "",
        max_points=int(getattr(p, "max_data_points", None) or 0),
        targets=[
            Target(t.ref_id or "", t.expr or "", t.legend_format or "", bool(t.instant)) for t in (p.targets or [])
        ],
        axis=Axis(
            unit=(d.unit if d is not None else "") or "",
            min=getattr(d, "min_val", None),
            max=getattr(d, "max_val", None),
            thresholds=_steps(getattr(d, "thresholds", None)),
        ),
        bars=_val(getattr(custom, "draw_style", None)) == "bars",
        stepped=str(_val(getattr(custom, "line_interpolation", None)) or "").startswith("step"),
        stacked=_val(getattr(getattr(custom, "stacking", None), "mode", None)) == "normal",
        no_value=(getattr(d, "no_value", None) or ""),
    )
    for o in (fc.overrides or []) if fc is not None else []:
        props = {pr.id_val: pr.value for pr in o.properties or []}
        if o.matcher.id_val == "byFrameRefID":
            ref = o.matcher.options
            if _val(props.get("custom.axisPlacement")) == "right":
                spec.right[ref] = Axis(
                    unit=props.get("unit", ""),
                    min=props.get("min"),
                    max=props.get("max"),
                    thresholds=_steps(props.get("thresholds")),
                )
            if (props.get("custom.lineStyle") or {}).get("fill") == "dash":
                spec.dashed.add(ref)
            color = props.get("color") or {}
            if color.get("fixedColor"):
                spec.colors[ref] = color["fixedColor"]
        elif o.matcher.id_val == "byName":
            if "unit" in props:
                spec.column_units[o.matcher.options] = props["unit"]
            if "thresholds" in props:
                spec.column_thresholds[o.matcher.options] = _steps(props["thresholds"])
    for tr in p.transformations or []:
        if tr.id_val == "organize":
            spec.hidden = {k for k, v in (tr.options.get("excludeByName") or {}).items() if v}
            for k, v in (tr.options.get("renameByName") or {}).items():
                ref = k[len("Value #") :] if k.startswith("Value #") else (spec.targets[0].ref if spec.targets else "")
                spec.columns[ref] = v
    sort = getattr(getattr(p, "options", None), "sort_by", None) or []
    if sort:
        spec.sort_by, spec.sort_desc = sort[0].display_name, bool(sort[0].desc)
    return spec


def spec(model: Any) -> DashboardSpec:
    """A built dashboard model as rows of panels (panels before the first row go to an untitled row)."""
    rows: list[Row] = []
    for p in model.panels or []:
        if p.type_val == "row":
            rows.append(Row(p.title or "", []))
            continue
        if not rows:
            rows.append(Row("", []))
        rows[-1].panels.append(_panel(p))
    variables = [
        Variable(v.name, str(_val(v.type_val)), v.query if isinstance(v.query, str) else "", v.all_value or "")
        for v in (model.templating.list_val or [])
    ]
    annotations = [
        Annotation(a.name, a.expr or "", a.title_format or "", a.icon_color or "red", a.step or "")
        for a in (model.annotations.list_val or [])
        if a.expr
    ]
    return DashboardSpec(model.uid, model.title, model.description or "", rows, variables, annotations)


def json_variables(d: dict[str, Any]) -> list[Variable]:
    """The template variables of a dashboard's JSON (a generated file, as Grafana loads it), as :func:`spec`
    reads them from the model."""
    return [
        Variable(v["name"], v["type"], v["query"] if isinstance(v.get("query"), str) else "", v.get("allValue") or "")
        for v in d.get("templating", {}).get("list", [])
    ]


# --- template variables ---

_VAR = re.compile(r"\$(?:\{(\w+)(?::([^}]*))?\}|(\w+))")
_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[a-zA-Z_]\w*)\)$")


def regex_escape(value: str) -> str:
    """One value inside a PromQL regex string literal, as Grafana escapes multi-value variables."""
    return _REGEX_SPECIAL.sub(lambda mt: "\\\\" + mt.group(0), value.replace("\\", "\\\\\\\\"))


def format_values(values: list[str] | None, all_value: str) -> str:
    """What ``=~"$var"`` becomes, as Grafana's Prometheus data source interpolates a multi-value variable.

    ``None`` is All with a custom all value: that value, unescaped. A list (the values picked, or every
    value offered when All has no custom value) becomes the escaped values: ``a`` for one, ``(a|b)`` for
    several, ``()`` for none (it matches only a series without the label).
    """
    if values is None:
        if not all_value:
            raise ValueError("All without a custom all value expands to the values offered: pass them")
        return all_value
    esc = [regex_escape(v) for v in values]
    return esc[0] if len(esc) == 1 else "(" + "|".join(esc) + ")"


def duration(seconds: float) -> str:
    return f"{max(1, int(round(seconds)))}s"


@dataclass(frozen=True)
class TimeContext:
    """The time range a query runs over, and Grafana's interval variables for it."""

    start: float
    end: float
    step: float  # $__interval, and the query_range step
    scrape_interval: float = 15.0  # the data source's scrape interval setting

    @property
    def rate_interval(self) -> float:
        # Grafana: max($__interval + scrape interval, 4 x scrape interval)
        return max(self.step + self.scrape_interval, 4 * self.scrape_interval)

    def for_panel(self, max_points: int) -> TimeContext:
        """The context of a panel with "max data points" set (0: none): Grafana steps at least range / that."""
        least = (self.end - self.start) / max_points if max_points else 0.0
        return dataclasses.replace(self, step=max(self.step, least))

    def builtins(self) -> dict[str, str]:
        return {
            "__interval": duration(self.step),
            "__rate_interval": duration(self.rate_interval),
            "__range": duration(self.end - self.start),
        }


def substitute(expr: str, values: dict[str, str], tc: TimeContext) -> str:
    """Expand template variables in ``expr``; ``values`` holds the formatted dashboard variables.

    Raises KeyError naming any variable that is neither a dashboard variable nor a built-in.
    """
    builtins = tc.builtins()

    def one(mt: re.Match) -> str:
        name, fmt = mt.group(1) or mt.group(3), mt.group(2)
        if name in ("__from", "__to"):
            t = tc.start if name == "__from" else tc.end
            if fmt == "date:seconds":
                return str(int(t))
            if fmt in (None, ""):
                return str(int(t * 1000))
            raise KeyError(f"unsupported format {fmt!r} of ${name}")
        if fmt:
            raise KeyError(f"unsupported format {fmt!r} of ${name}")
        if name in builtins:
            return builtins[name]
        if name in values:
            return values[name]
        raise KeyError(f"unknown template variable ${name} in {expr!r}")

    return _VAR.sub(one, expr)


def label_values_query(query: str) -> tuple[str, str]:
    """``label_values(selector, label)`` -> (selector, label)."""
    mt = _LABEL_VALUES.match(query.strip())
    if not mt:
        raise ValueError(f"not a label_values() query: {query!r}")
    return mt.group("selector").strip(), mt.group("label")


def variable_names(expr: str) -> set[str]:
    return {mt.group(1) or mt.group(3) for mt in _VAR.finditer(expr)}
