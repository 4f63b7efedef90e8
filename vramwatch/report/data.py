"""Run a dashboard's queries against Prometheus, as Grafana would for one time range."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vramwatch.monitoring.dashboards.walk import (
    Annotation,
    DashboardSpec,
    PanelSpec,
    Target,
    TimeContext,
    Variable,
    format_values,
    label_values_query,
    substitute,
)
from vramwatch.report.prom import PromClient, PromError, Series

_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def legend(target: Target, labels: dict[str, str]) -> str:
    """Grafana's legend: ``{{label}}`` replaced by the series' value, or the label set when unset."""
    if target.legend:
        return _LEGEND.sub(lambda mt: labels.get(mt.group(1), ""), target.legend).strip()
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return labels.get("__name__", "") + ("{" + inner + "}" if inner else "")


@dataclass
class TargetResult:
    target: Target
    expr: str  # after substitution
    series: list[Series] = field(default_factory=list)
    error: str = ""


@dataclass
class PanelResult:
    panel: PanelSpec
    results: list[TargetResult]

    @property
    def series_count(self) -> int:
        return sum(len(r.series) for r in self.results)

    @property
    def point_count(self) -> int:
        return sum(len(s.values) for r in self.results for s in r.series)

    @property
    def errors(self) -> list[str]:
        return [f"{r.target.ref}: {r.error}" for r in self.results if r.error]


@dataclass
class AnnotationResult:
    annotation: Annotation
    events: list[tuple[float, float, str]]  # (start, end, title)
    error: str = ""


def variable_options(client: PromClient, var: Variable, values: dict[str, str], tc: TimeContext) -> list[str]:
    """The values a query variable offers, given the variables before it (``label_values()`` queries)."""
    selector, label = label_values_query(var.query)
    series = client.series(substitute(selector, values, tc), tc.start, tc.end)
    return sorted({s[label] for s in series if s.get(label)})


@dataclass(frozen=True)
class VariableQuery:
    """One variable's own query, as it ran when the dashboard opened."""

    name: str
    selector: str  # with the variables before it substituted
    options: int  # the values it offered
    seconds: float


def variable_values(
    spec: DashboardSpec | Sequence[Variable],
    chosen: dict[str, list[str]],
    client: PromClient | None = None,
    tc: TimeContext | None = None,
    first: bool = False,
    queries: list[VariableQuery] | None = None,
) -> dict[str, str]:
    """Formatted values for every query variable, in the dashboard's order: the chosen ones, else All.

    All is the variable's custom all value; a variable without one (host) expands to every value its own
    query offers given the variables before it, as Grafana does (this needs ``client`` and ``tc``).
    ``spec`` is a dashboard, or its variables alone (:func:`~vramwatch.monitoring.dashboards.walk.json_variables`).
    ``first=True`` picks each variable's first offered value instead of All, so that every query also runs
    with concrete values, as a person who picked one job would. ``queries``, when given, receives every
    variable's own query with its time: all of them run, as Grafana runs them when the dashboard opens.
    """
    values: dict[str, str] = {}
    for v in spec.variables if isinstance(spec, DashboardSpec) else spec:
        if v.type != "query":
            continue
        picked = chosen.get(v.name)
        offered: list[str] | None = None
        if queries is not None or (picked is None and (first or not v.all_value)):
            if client is None or tc is None:
                raise ValueError(f"variable {v.name}: filling it runs its own query: pass a client and a time range")
            t0 = time.perf_counter()
            offered = variable_options(client, v, values, tc)
            if queries is not None:
                selector = substitute(label_values_query(v.query)[0], values, tc)
                queries.append(VariableQuery(v.name, selector, len(offered), time.perf_counter() - t0))
        if picked is None and first and offered:
            picked = offered[:1]
        elif picked is None and not v.all_value:
            picked = offered
        values[v.name] = format_values(picked, v.all_value)
    return values


def run_target(client: PromClient, target: Target, values: dict[str, str], tc: TimeContext) -> TargetResult:
    expr = substitute(target.expr, values, tc)
    res = TargetResult(target, expr)
    try:
        res.series = (
            client.query(expr, tc.end) if target.instant else client.query_range(expr, tc.start, tc.end, tc.step)
        )
    except PromError as e:
        res.error = str(e)
    return res


def run_panel(client: PromClient, panel: PanelSpec, values: dict[str, str], tc: TimeContext) -> PanelResult:
    tc = tc.for_panel(panel.max_points)
    return PanelResult(panel, [run_target(client, t, values, tc) for t in panel.targets])


def run_annotation(client: PromClient, ann: Annotation, values: dict[str, str], tc: TimeContext) -> AnnotationResult:
    """Events of an annotation query: one per run of consecutive points of a series."""
    expr = substitute(ann.expr, values, tc)
    step = tc.step
    try:
        series = client.query_range(expr, tc.start, tc.end, step)
    except PromError as e:
        return AnnotationResult(ann, [], str(e))
    events: list[tuple[float, float, str]] = []
    title_target = Target("", "", ann.title_format, False)
    for s in series:
        run_start: float | None = None
        prev = 0.0  # set with run_start
        for t in s.times:
            if run_start is None:
                run_start = prev = t
            elif t - prev > step * 1.5:
                events.append((run_start, prev, legend(title_target, s.labels)))
                run_start = t
            prev = t
        if run_start is not None:
            events.append((run_start, prev, legend(title_target, s.labels)))
    return AnnotationResult(ann, events)
