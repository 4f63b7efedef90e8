"""Shared pieces of the dashboards: variables, label matchers, panel helpers.

Every metric name goes through :func:`m`, which looks it up in
:mod:`vramwatch.monitoring.contract` (a typo fails at build time), and every threshold
comes from a :class:`~vramwatch.monitoring.config.MonitoringConfig` passed in.
"""

from __future__ import annotations

import warnings
from typing import TypeVar

from vramwatch.monitoring import contract, promql
from vramwatch.monitoring.config import MonitoringConfig

with warnings.catch_warnings():
    # the classic (v1) dashboard model and builder warn "Prefer using dashboardv2" from their class
    # bodies, i.e. on import; v1 JSON is what file provisioning and the Grafana sidecar load
    warnings.simplefilter("ignore", DeprecationWarning)
    from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, table, timeseries
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models import units
    from grafana_foundation_sdk.models.common import DataSourceRef
    from grafana_foundation_sdk.models.dashboard import (
        DashboardCursorSync,
        DashboardLinkType,
        DataTransformerConfig,
        DynamicConfigValue,
        Threshold,
        ThresholdsMode,
        VariableOption,
        VariableRefresh,
        VariableSort,
    )
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

__all__ = [
    "PROM",
    "Scope",
    "m",
    "variables",
    "ts",
    "table_panel",
    "stat_panel",
    "bar_panel",
    "q",
    "qt",
    "thresholds",
    "right_axis",
    "units",
    "timeseries",
    "dashboard",
    "base_dashboard",
    "dashboard_links",
    "xid_annotation",
    "memory_pressure",
    "JSONEncoder",
]

PROM = DataSourceRef(type_val="prometheus", uid="${datasource}")

# Display names of the variables; a variable for a label not named here is titled with the label.
# The values are regexes (multi-select), so every matcher uses =~. The job labels, job_id, node and gpu
# keep the custom All ".*", which also matches a series without the label: a variable whose label a
# setup lacks offers only All and narrows nothing. The host variable (instance, on every target) has no
# custom All: Grafana expands its All to the hosts it offers, "(a|b|c)", and it offers only the hosts of
# the chosen job's ranks, so a GPU family (which has no job_id) is read for those hosts alone.
TITLES = {
    "datasource": "Data source",
    "job": "Scrape job",
    "namespace": "Namespace",
    "batch_kubernetes_io_job_name": "Job",
    "training_kubeflow_org_job_name": "Kubeflow job",
    "job_name": "Job (annotation)",
    "node": "Node",
    "host": "Target",
    "gpu": "GPU (UUID)",
    "job_id": "Job ID",
    "rank": "Rank",
}
ALL = ".*"
# variables of vramwatch's own labels (instance, uuid, job_id, rank)
HOST, GPU, JOB, RANK = "host", "gpu", contract.JOB_ID, "rank"


def m(name: str) -> str:
    """A metric name, checked against the contract, or a series the shipped rules record (promql.RECORDS)."""
    return name if name in promql.RECORDS else contract.spec(name).name


def target_variables(cfg: MonitoringConfig) -> list[tuple[str, str]]:
    """(variable, label) for the labels a target carries, in order: the job labels, the node, the target.

    Label names come from the config (``job_labels``, ``node_label``); each variable is named after
    its label, except ``host`` (instance).
    """
    out: list[tuple[str, str]] = []
    for label in (*cfg.job_labels, cfg.node_label):
        if label and label != "instance" and label not in (lab for _, lab in out):
            out.append(("node" if label == cfg.node_label else label, label))
    return [*out, (HOST, "instance")]


class Scope:
    """Label matchers for the dashboard variables, optionally narrowed by the config's selector.

    ``node`` for per-target series, ``gpu`` for NVML series (uuid), ``rank`` for heartbeat
    series, ``device`` for allocator series (uuid and rank). ``alerts`` for ALERTS, whose labels
    are the alert's own: a firing alert without one of the labels still shows.
    """

    def __init__(self, cfg: MonitoringConfig) -> None:
        base = [cfg.selector] if cfg.selector else []
        targets = target_variables(cfg)
        node = base + [f'{label}=~"${var}"' for var, label in targets]
        self.node = "{" + ", ".join(node) + "}"
        self.gpu = "{" + ", ".join(node + [f'uuid=~"${GPU}"']) + "}"
        job = f'{contract.JOB_ID}=~"${JOB}"'
        self.job = "{" + ", ".join([*node, job]) + "}"
        self.rank = "{" + ", ".join([*node, job, f'rank=~"${RANK}"']) + "}"
        self.device = "{" + ", ".join([*node, f'uuid=~"${GPU}"', job, f'rank=~"${RANK}"']) + "}"
        self.alerts = ", ".join(f'{label}=~"${var}|"' for var, label in targets if var != HOST)


def _query_variable(name: str, query: str, all_value: str | None = ALL) -> dashboard.QueryVariable:
    """A multi-value variable with All; ``all_value`` None leaves Grafana to expand All to the values offered."""
    v = (
        dashboard.QueryVariable(name)
        .label(TITLES.get(name, name))
        .datasource(PROM)
        .query(query)
        .definition(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
        .current(VariableOption(selected=True, text="All", value="$__all"))
    )
    return v.all_value(all_value) if all_value is not None else v


def _label_values(names: tuple[str, ...], matchers: list[str], label: str) -> str:
    """``label_values(selector, label)`` over the series of ``names`` that ``matchers`` select."""
    if len(names) == 1:
        selector = names[0] + ("{" + ", ".join(matchers) + "}" if matchers else "")
    else:
        selector = "{" + ", ".join([f'__name__=~"{"|".join(names)}"', *matchers]) + "}"
    return f"label_values({selector}, {label})"


def variables(cfg: MonitoringConfig) -> list:
    """datasource, the job labels, job_id, node, host, gpu, rank: each narrowed by those before it.

    node and host list the targets of the chosen jobs' ranks: with job_id at All (".*") the selector
    matches every target's build_info (which has no job_id: ``=~".*"`` matches the absent label),
    with jobs chosen only their ranks' rank_info. host expands its All to those targets (see TITLES);
    gpu lists the cards and MIG instances of the hosts left, rank the chosen jobs' ranks on them.
    """
    s = Scope(cfg)
    build_info, rank_info = m("vramwatch_build_info"), m("vramwatch_rank_info")
    targets = target_variables(cfg)
    job_labels = [(var, label) for var, label in targets if var not in ("node", HOST)]
    narrowed = [(var, label) for var, label in targets if var in ("node", HOST)]
    chain = [cfg.selector] if cfg.selector else []
    out: list = [dashboard.DatasourceVariable("datasource").label(TITLES["datasource"]).type("prometheus")]
    for var, label in job_labels:
        out.append(_query_variable(var, _label_values((build_info,), chain, label)))
        chain.append(f'{label}=~"${var}"')
    out.append(_query_variable(JOB, _label_values((rank_info,), chain, contract.JOB_ID)))
    chain.append(f'{contract.JOB_ID}=~"${JOB}"')
    for var, label in narrowed:
        query = _label_values((build_info, rank_info), chain, label)
        out.append(_query_variable(var, query, all_value=None if var == HOST else ALL))
        chain.append(f'{label}=~"${var}"')
    # the cards and their MIG instances: a rank on an instance carries the instance's uuid (docs/MIG.md)
    out.append(_query_variable(GPU, _label_values((m("gpu_info"), m("gpu_mig_info")), [s.node[1:-1]], "uuid")))
    out.append(_query_variable(RANK, f"label_values({rank_info}{s.job}, rank)"))
    return out


def dashboard_links(uid: str, titles: dict[str, str]) -> list[dashboard.DashboardLink]:
    """A link to each other dashboard of ``titles`` (uid -> title), keeping the time range and every variable."""
    return [
        dashboard.DashboardLink(title.removeprefix("vramwatch / "))
        .type(DashboardLinkType.LINK)
        .url(f"/d/{other}")
        .icon("dashboard")
        .tooltip(f"{title}: the same time range and selection")
        .include_vars(True)
        .keep_time(True)
        .target_blank(False)
        for other, title in titles.items()
        if other != uid
    ]


def base_dashboard(uid: str, title: str, description: str, cfg: MonitoringConfig) -> dashboard.Dashboard:
    d = (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(list(cfg.dashboard_tags))
        .timezone("browser")
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .editable()
    )
    for v in variables(cfg):
        d = d.with_variable(v)
    return d


def xid_annotation(s: Scope) -> dashboard.AnnotationQuery:
    """Xid events as annotations: a region from each event's time, for a minute.

    Built from the timestamp gauge, which also shows the first event of an Xid that was
    not pre-initialised (``increase()`` of its counter would miss it).
    """
    return (
        dashboard.AnnotationQuery()
        .name("Xid events")
        .datasource(PROM)
        .enable(True)
        .icon_color("red")
        .expr(f"{m('gpu_last_xid_timestamp_seconds')}{s.gpu} > time() - 60")
        .step("60s")
        .title_format("Xid {{xid}}")
        .text_format("GPU {{gpu}} ({{uuid}}) on {{instance}}")
        .tag_keys("xid,gpu,instance")
    )


# --- queries ---


def q(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    """A range query, as a time series panel runs it."""
    d = prometheus.Dataquery().expr(expr).ref_id(ref).range().datasource(PROM)
    return d.legend_format(legend) if legend else d


def qt(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    """An instant query in table format, as a table or stat panel runs it."""
    d = prometheus.Dataquery().expr(expr).ref_id(ref).instant().format(PromQueryFormat.TABLE).datasource(PROM)
    return d.legend_format(legend) if legend else d


# --- panels ---


def thresholds(*steps: tuple[float, str], base: str = "green") -> dashboard.ThresholdsConfig:
    return (
        dashboard.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=None, color=base)] + [Threshold(value=float(v), color=c) for v, c in steps])
    )


P = TypeVar("P", timeseries.Panel, table.Panel, stat.Panel, bargauge.Panel)


def _panel(p: P, title: str, description: str, unit: str, span: int, height: int) -> P:
    """What every panel sets: its title, description, data source, unit and place in the grid."""
    return p.title(title).description(description).datasource(PROM).unit(unit).span(span).height(height)


def _legend() -> cb.VizLegendOptions:
    return (
        cb.VizLegendOptions()
        .show_legend(True)
        .display_mode(cm.LegendDisplayMode.LIST)
        .placement(cm.LegendPlacement.BOTTOM)
    )


def ts(
    title: str,
    description: str,
    unit: str,
    targets: list[prometheus.Dataquery],
    *,
    span: int = 12,
    height: int = 8,
    min_: float | None = 0,
    max_: float | None = None,
    limits: dashboard.ThresholdsConfig | None = None,
    bars: bool = False,
    stepped: bool = False,
    stack: bool = False,
    dashed: dict[str, str | None] | None = None,
    max_points: int | None = None,
) -> timeseries.Panel:
    """A time series panel from 0 (``min_``); ``dashed`` draws queries (refId -> a fixed colour or None) as
    dashed reference lines (a limit, a projection); ``max_points``: Grafana's "max data points", so that its
    queries step at least range / max_points apart (for a panel whose every step reads a whole selection: the
    fleet's ranking, every bucket of a job's histograms)."""
    p = (
        _panel(timeseries.Panel(), title, description, unit, span, height)
        .legend(_legend())
        .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
        .line_width(1)
        .fill_opacity(10 if not bars else 80)
        .show_points(cm.VisibilityMode.NEVER)
    )
    if max_points:
        p = p.max_data_points(max_points)
    if bars:
        p = p.draw_style(cm.GraphDrawStyle.BARS)
    if stepped:
        p = p.line_interpolation(cm.LineInterpolation.STEP_AFTER)
    if stack:
        p = p.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
    if min_ is not None:
        p = p.min(min_)
    if max_ is not None:
        p = p.max(max_)
    if limits is not None:
        p = p.thresholds(limits).thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)
        )
    for t in targets:
        p = p.with_target(t)
    for ref, color in (dashed or {}).items():
        p = _dashed(p, ref, color)
    return p


def right_axis(
    p: timeseries.Panel,
    ref: str,
    unit: str,
    *,
    min_: float | None = None,
    max_: float | None = None,
    limits: dashboard.ThresholdsConfig | None = None,
    dashed: bool = False,
) -> timeseries.Panel:
    """Move query ``ref``'s series to a right-hand axis with its own unit (and threshold lines)."""
    props = [
        DynamicConfigValue(id_val="custom.axisPlacement", value=cm.AxisPlacement.RIGHT),
        DynamicConfigValue(id_val="unit", value=unit),
    ]
    if min_ is not None:
        props.append(DynamicConfigValue(id_val="min", value=min_))
    if max_ is not None:
        props.append(DynamicConfigValue(id_val="max", value=max_))
    if limits is not None:
        props.append(DynamicConfigValue(id_val="thresholds", value=limits.build()))
        props.append(DynamicConfigValue(id_val="custom.thresholdsStyle", value={"mode": "dashed"}))
    if dashed:
        props.append(DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}))
    return p.override_by_query(ref, props)


def _dashed(p: timeseries.Panel, ref: str, color: str | None) -> timeseries.Panel:
    props = [
        DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
        DynamicConfigValue(id_val="custom.fillOpacity", value=0),
    ]
    if color:
        props.append(DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": color}))
    return p.override_by_query(ref, props)


def table_panel(
    title: str,
    description: str,
    targets: list[prometheus.Dataquery],
    *,
    unit: str = units.Short,
    span: int = 12,
    height: int = 8,
    sort_by: str | None = None,
    sort_desc: bool = True,
    limits: dashboard.ThresholdsConfig | None = None,
    columns: dict[str, str] | None = None,
    hide: tuple[str, ...] = (),
    no_value: str = "",
    column_units: dict[str, str] | None = None,
    color_columns: tuple[str, ...] = (),
) -> table.Panel:
    """A table of instant queries; several queries are merged into one row per label set.

    ``columns`` maps a query's refId to its column title (``Value #A`` in Grafana's frames);
    ``hide`` names label columns to leave out; ``column_units`` sets a unit per column title;
    ``limits`` colours the cells of every value column, or only of ``color_columns`` when given.
    """
    p = _panel(table.Panel(), title, description, unit, span, height).show_header(True).filterable(True)
    if no_value:
        p = p.no_value(no_value)
    for t in targets:
        p = p.with_target(t)
    renames = {}
    if len(targets) > 1:
        p = p.with_transformation(DataTransformerConfig(id_val="merge", options={}))
        renames = {f"Value #{ref}": name for ref, name in (columns or {}).items()}
    elif columns:
        renames = {"Value": next(iter(columns.values()))}
    p = p.with_transformation(
        DataTransformerConfig(
            id_val="organize",
            options={"excludeByName": {c: True for c in ("Time", "__name__", *hide)}, "renameByName": renames},
        )
    )
    for col, unit in (column_units or {}).items():
        p = p.override_by_name(col, [DynamicConfigValue(id_val="unit", value=unit)])
    cell = cm.TableColoredBackgroundCellOptions(mode=cm.TableCellBackgroundDisplayMode.BASIC)
    if limits is not None and not color_columns:
        p = p.thresholds(limits).cell_options(cell)
    if limits is not None:
        for col in color_columns:
            p = p.override_by_name(
                col,
                [
                    DynamicConfigValue(id_val="thresholds", value=limits.build()),
                    DynamicConfigValue(id_val="custom.cellOptions", value=cell),
                ],
            )
    if sort_by:
        p = p.sort_by([cb.TableSortByFieldState().display_name(sort_by).desc(sort_desc)])
    return p


def stat_panel(
    title: str,
    description: str,
    target: prometheus.Dataquery,
    *,
    unit: str = units.Short,
    span: int = 6,
    height: int = 4,
    limits: dashboard.ThresholdsConfig | None = None,
) -> stat.Panel:
    p = (
        _panel(stat.Panel(), title, description, unit, span, height)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(cm.BigValueGraphMode.NONE)
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .with_target(target)
    )
    return p.thresholds(limits) if limits is not None else p


def bar_panel(
    title: str,
    description: str,
    target: prometheus.Dataquery,
    *,
    unit: str = units.Short,
    span: int = 12,
    height: int = 8,
    limits: dashboard.ThresholdsConfig | None = None,
) -> bargauge.Panel:
    p = (
        _panel(bargauge.Panel(), title, description, unit, span, height)
        .orientation(cm.VizOrientation.HORIZONTAL)
        .display_mode(cm.BarGaugeDisplayMode.BASIC)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .min(0)
        .with_target(target)
    )
    return p.thresholds(limits) if limits is not None else p


# --- expressions shared by several panels ---


def heartbeat_age(s: Scope) -> str:
    return f"time() - {m('vramwatch_training_last_step_timestamp_seconds')}{s.rank}"


def mean_step_seconds(s: Scope, window: str) -> str:
    h = m("vramwatch_training_step_duration_seconds")
    return f"rate({h}_sum{s.rank}[{window}]) / rate({h}_count{s.rank}[{window}])"


def memory_pressure(s: Scope) -> str:
    """NVML used / total of every card and MIG instance (recorded by the memory rules)."""
    return f"{m(promql.MEMORY_RATIO_RECORD)}{s.gpu}"


def stall_bound(cfg: MonitoringConfig, s: Scope) -> str:
    """How old a rank's heartbeat may get: the stall alert's own bound, with the dashboard's variables."""
    return promql.stall_bound(cfg, lambda name: f"{name}{s.rank}").replace("\n ", "")


def memory_limits(cfg: MonitoringConfig) -> dashboard.ThresholdsConfig:
    return thresholds((cfg.memory_warning_ratio, "orange"), (cfg.memory_critical_ratio, "red"))


_ON_RANK = "job, instance, " + ", ".join(contract.RANK)  # a rank's series: the target's labels and contract.RANK


def tokens_per_gpu(s: Scope) -> str:
    """Tokens/s of the ranks on each GPU (uuid), through the allocator series that carry rank and uuid."""
    tokens = f"rate({m('vramwatch_training_tokens_total')}{s.rank}[$__rate_interval])"
    alloc = f"{m('torch_cuda_memory_allocated_bytes')}{s.device}"
    return f"sum by (job, instance, uuid) ({tokens} * on({_ON_RANK}) group_right() ({alloc} * 0 + 1))"


def rank_mfu(s: Scope) -> str:
    """Per rank: tokens/s x the model's FLOPs per token / the peak of the GPUs the rank uses (recorded by
    the rules: the GPU families carry no job, so computing it here read every GPU of the fleet)."""
    tokens = f"rate({m('vramwatch_training_tokens_total')}{s.rank}[$__rate_interval])"
    fpt = f"{m('vramwatch_model_flops_per_token')}{s.rank}"
    return f"{tokens} * on({_ON_RANK}) {fpt}\n/ on({_ON_RANK}) {promql.PEAK_FLOPS_RECORD}{s.rank}"


def step_skew(cfg: MonitoringConfig, s: Scope) -> str:
    """The straggler rule's skew, with the dashboard's variables (the median over the selected ranks)."""
    mean = promql.step_mean(cfg, lambda name: f"{name}{s.rank}")
    return promql.step_skew(cfg, mean)
