"""One frozen monitoring config feeds the alert rules and the dashboards (the mixin pattern).

Thresholds, windows, selectors and severities live here and nowhere else: the
dashboards draw their threshold lines from the same object, and a test rejects
threshold literals elsewhere. Override by constructing your own
``MonitoringConfig(...)`` (or ``dataclasses.replace(DEFAULT, ...)``), or with a YAML file of the
same keys (:mod:`vramwatch.monitoring.config_file`, ``vramwatch alerts --config F``).

Every field carries its documentation (``metadata["doc"]``) and its check (``metadata["check"]``,
run by :func:`validate`): the example file, the docs and the Helm values are generated from them.

Every time quantity (``*_for``, ``*_window``, ``*_seconds``, ``leak_horizon_hours``) scales
together through :meth:`MonitoringConfig.scaled`: the end-to-end test runs the shipped rules
with ``DEFAULT.scaled(1 / 60)`` (a 5m ``for`` becomes 5s).
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vramwatch.errors import ConfigError, shown
from vramwatch.monitoring import contract, peaks

GIB = 1 << 30

Check = Callable[[Any], None]  # raises ValueError saying what the value must be


def setting(default: Any, doc: str, check: Check | None = None) -> Any:
    return field(default=default, metadata={"doc": doc, "check": check})


# --- checks (each raises ValueError with what the value must be) ---


def _ratio(v: float) -> None:
    if not 0 < v <= 1:
        raise ValueError("must be a ratio above 0 and at most 1")


def _positive(v: float) -> None:
    if not v > 0:
        raise ValueError("must be above 0")


def _non_negative(v: float) -> None:
    if v < 0:
        raise ValueError("must be 0 or more")


def _above_one(v: float) -> None:
    if not v > 1:
        raise ValueError("must be above 1 (a multiple of the median)")


def _window(v: str) -> None:
    if parse_duration(v) <= 0:
        raise ValueError("must be a duration above 0")


def _for(v: str) -> None:
    if v:  # empty or 0s: fire at once
        parse_duration(v)


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\\n]|\\.)*"\s*'
_MATCHERS = re.compile(rf"(?:{_MATCHER}(?:,{_MATCHER})*,?\s*)?")


def _matchers(v: str) -> None:
    if not _MATCHERS.fullmatch(v):
        raise ValueError('must be PromQL label matchers such as job="train", namespace=~"ml-.*"')


def _matcher_list(v: tuple[str, ...]) -> None:
    for m in v:
        if not m.strip():
            raise ValueError("must not hold an empty matcher set (it would match every series)")
        _matchers(m)


def _label_names(v: tuple[str, ...]) -> None:
    for name in v:
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(f"{name!r} is not a Prometheus label name")


def _extra_labels(v: tuple[tuple[str, str], ...]) -> None:
    _label_names(tuple(k for k, _ in v))
    taken = {"severity", "alertname"} & {k for k, _ in v}
    if taken:
        raise ValueError(f"must not set {', '.join(sorted(taken))}: routing and inhibition depend on them")


def _xids(v: tuple[int, ...]) -> None:
    if any(x < 0 for x in v):
        raise ValueError("must be Xid numbers (0 or more)")


def _reasons(v: tuple[str, ...]) -> None:
    for r in v:
        if not re.fullmatch(r"[a-z0-9_]+", r):
            raise ValueError(f"{r!r} is not a throttle reason name (lower case, digits, _)")


def _url(v: str, placeholders: frozenset[str]) -> None:
    if not re.match(r"https?://[^\s/]+", v) or re.search(r"\s", v):
        raise ValueError("must be an http:// or https:// URL without spaces")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
    except ValueError as e:
        raise ValueError(f"has unbalanced braces ({e})") from None
    unknown = fields - placeholders
    if unknown:
        allowed = ", ".join("{" + p + "}" for p in sorted(placeholders)) or "none"
        raise ValueError(f"has unknown placeholder(s) {', '.join(sorted(unknown))}; allowed: {allowed}")


RUNBOOK_PLACEHOLDERS = frozenset({"anchor", "alertname"})


def _runbook_url(v: str) -> None:
    _url(v, RUNBOOK_PLACEHOLDERS)


def _base_url(v: str) -> None:
    if v:
        _url(v, frozenset())
        if v.endswith("/"):
            raise ValueError("must not end with / (paths are appended)")


def _peak_flops(v: tuple[tuple[str, float], ...]) -> None:
    for pattern, flops in v:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{pattern!r} is not a regex ({e})") from None
        if '"' in pattern or "\\" in pattern:
            raise ValueError(f"{pattern!r}: a GPU name pattern must not hold quotes or backslashes")
        if not flops > 0:
            raise ValueError(f"{pattern!r}: the peak must be FLOP/s above 0, not {flops!r}")


def _alert_names(v: tuple[str, ...]) -> None:
    for name in v:
        if not re.fullmatch(r"[A-Z][A-Za-z]+", name):
            raise ValueError(f"{name!r} is not an alert name")  # the rule set checks that it exists


@dataclass(frozen=True)
class MonitoringConfig:
    selector: str = setting(
        "",
        "PromQL label matchers selecting vramwatch's series in every rule and panel, e.g. 'job=\"train\"'. "
        "Empty: all series of vramwatch's metric names.",
        _matchers,
    )
    memory_warning_ratio: float = setting(
        0.85,
        "GPU memory share of the card (NVML used / total) or of a rank's budget (reserved / limit) above "
        "which a step's peak has little room left: a warning.",
        _ratio,
    )
    memory_critical_ratio: float = setting(
        0.95, "The same share above which the next peak is likely an OOM: a page.", _ratio
    )
    memory_warning_for: str = setting("5m", "How long memory must stay above the warning ratio.", _for)
    memory_critical_for: str = setting("1m", "How long memory must stay above the critical ratio.", _for)
    fragmentation_ratio: float = setting(
        0.3,
        "Share of reserved bytes holding no tensor that warns, once memory is also above the warning ratio.",
        _ratio,
    )
    stall_factor: float = setting(
        10.0,
        "A rank stalls when its heartbeat is older than this many times its recent mean step time "
        "(and older than the floors below).",
        _positive,
    )
    stall_min_seconds: float = setting(
        120.0,
        "The no-step floor (seconds) of the idle-stall warning, so 2 ms steps do not warn on a GC pause.",
        _positive,
    )
    stall_for: str = setting("2m", "How long an idle stall must last before it warns.", _for)
    busy_stall_min_seconds: float = setting(
        60.0,
        "The no-step floor (seconds) of the busy-stall page (GPU busy at low power: the hang signature). "
        "Lower than the idle floor: the signature is the evidence, and the page must beat NCCL's watchdog.",
        _positive,
    )
    busy_stall_for: str = setting(
        "1m",
        "How long a busy stall must last before it pages; with the floor, a page comes within "
        "busy_stall_min_seconds + busy_stall_for + one evaluation interval (+ Alertmanager's group_wait).",
        _for,
    )
    busy_utilization_ratio: float = setting(
        0.9, "A stalled rank's GPU reads busy at this utilisation or more ...", _ratio
    )
    busy_power_ratio: float = setting(
        0.35, "... while drawing at most this share of its power limit: the hang signature.", _ratio
    )
    leak_horizon_hours: float = setting(
        4.0, "A leak warns when the per-step peak is projected to exceed the budget within this many hours.", _positive
    )
    sample_stale_seconds: float = setting(
        60.0, "A rank whose newest sample is older than this (seconds) is wedged.", _positive
    )
    xid_critical: tuple[int, ...] = setting(
        contract.XID_CRITICAL,
        "Xids that page whatever their action. Which Xids page follows the `action` label, the bucket of NVIDIA's "
        "Xid catalogue (a GPU reset, a reboot, support: " + ", ".join(contract.XID_PAGE_ACTIONS) + "); the "
        "default lists the pre-initialised codes those actions give, so it only matters once you change it: "
        "add a code to page on it, or move one to xid_warning.",
        _xids,
    )
    xid_warning: tuple[int, ...] = setting(
        contract.XID_WARNING,
        "Xids that only warn whatever their action (the actions that warn: "
        + ", ".join(contract.XID_WARN_ACTIONS)
        + "; a lone Xid 45 warns, `ignore` never alerts); the default lists the pre-initialised codes those "
        "actions give. Move a paging code here to demote it.",
        _xids,
    )
    runbook_url: str = setting(
        "https://github.com/vramwatch/vramwatch/blob/main/docs/runbooks.md#{anchor}",
        "Each alert's runbook_url annotation: {anchor} becomes the lower-case alert name (a Markdown "
        "heading's anchor), {alertname} the alert name. Point it at your own wiki.",
        _runbook_url,
    )
    dashboard_url: str = setting(
        "",
        "Grafana's base URL, e.g. https://grafana.example.com: each alert's dashboard_url annotation opens its "
        "dashboard there, scoped to the alert's node, GPU and rank. Empty (the default): no such annotation, "
        "rather than a link to a Grafana that is not yours.",
        _base_url,
    )
    dashboard_tags: tuple[str, ...] = setting(
        ("vramwatch", "gpu", "pytorch"), "Tags of the generated Grafana dashboards."
    )
    extra_labels: tuple[tuple[str, str], ...] = setting(
        (), "Labels put on every alert, e.g. {team: ml-infra} (a mapping in YAML).", _extra_labels
    )
    disabled_alerts: tuple[str, ...] = setting(
        (), "Alert names left out of the rules (both severities), e.g. [GPUClockThrottled].", _alert_names
    )
    target_selector: str = setting(
        'job=~".*vramwatch.*"',
        "Matchers selecting vramwatch's scrape targets in `up` (`up` exists for every target, so it needs "
        'one). Matches job="vramwatch" (static, compose, the shipped PodMonitor) and "<namespace>/vramwatch" '
        "(a PodMonitor without a job relabeling). Targets of other jobs count too once they served "
        "vramwatch_build_info within target_seen_window.",
        _matchers,
    )
    target_seen_window: str = setting(
        "1h", "How recently a target of another job must have served vramwatch_build_info to count.", _window
    )
    job_labels: tuple[str, ...] = setting(
        ("job", "namespace", "batch_kubernetes_io_job_name", "training_kubeflow_org_job_name", "job_name"),
        "Labels that tell one training job apart across its nodes (the peers of the rank-skew rule). A label "
        "a setup lacks is empty on every series, so the default covers static configs (job), the shipped "
        "PodMonitor (namespace + the pod's job-name labels) and annotation discovery (job_name). The ranks' "
        "own job_id is always added: two jobs on one target are never peers.",
        _label_names,
    )
    job_gpus_only: bool = setting(
        True,
        "Device alerts about memory, throttling and foreign processes only for GPUs a rank of the job uses "
        "(with `gpus: all` the server also reports the node's other GPUs). Xid and lost GPUs: every GPU.",
    )
    alloc_retries_max: float = setting(
        2.0, "More than this many cudaMalloc retries (cache flushes) within alloc_retry_window warn.", _non_negative
    )
    alloc_retry_window: str = setting("15m", "The window of the cudaMalloc retry count.", _window)
    oom_window: str = setting("15m", "An out-of-memory error within this window warns.", _window)
    fragmentation_for: str = setting("15m", "How long fragmentation must stay high before it warns.", _for)
    leak_window: str = setting(
        "1h", "predict_linear's window for the leak projection; the series must be at least this old.", _window
    )
    leak_for: str = setting(
        "30m", "How long the leak projection must hold (so the warm-up ramp does not count as a leak).", _for
    )
    stall_window: str = setting(
        "30m",
        "The mean step time's window (a stall longer than the window falls back to the floors).",
        _window,
    )
    xid_window: str = setting("15m", "Xid events within this window alert (resolves once it has passed).", _window)
    gpu_lost_for: str = setting("1m", "How long a GPU must be lost (gpu_up 0) before it pages.", _for)
    ecc_window: str = setting("15m", "Uncorrected ECC errors within this window warn.", _window)
    remapped_rows_for: str = setting("5m", "How long pending or failed row remaps must show before they warn.", _for)
    throttle_reasons: tuple[str, ...] = setting(
        ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"),
        "Throttle reasons (gpu_clock_throttle{reason}, the NVML collector's names) worth a warning; "
        "sw_power_cap is normal under full load, gpu_idle is no trouble.",
        _reasons,
    )
    throttle_for: str = setting("10m", "How long a throttle reason must hold before it warns.", _for)
    foreign_process_for: str = setting("5m", "How long a foreign process must be on a job GPU to warn.", _for)
    rank_skew_ratio: float = setting(
        1.25,
        "Rank skew: a rank's reserved bytes above this many times the median of its job's ranks ...",
        _above_one,
    )
    rank_skew_min_bytes: float = setting(
        float(2 * GIB), "... and at least this many bytes above it (2 GiB = 2147483648).", _non_negative
    )
    rank_skew_for: str = setting("15m", "How long the skew must stay before it warns.", _for)
    rank_skew_exempt: tuple[str, ...] = setting(
        ('vramwatch_io_rank_skew="off"',),
        "Matcher sets of ranks the skew rule never flags (any set matching exempts): pipeline-parallel "
        "jobs, whose first and last stages are larger by design. The default is the per-job opt-out, "
        'the pod label vramwatch.io/rank-skew: "off" (the shipped PodMonitor copies it); a set such as '
        '\'job="pp-train", rank=~"0|15"\' exempts given ranks.',
        _matcher_list,
    )
    straggler_ratio: float = setting(
        1.2,
        "Straggler: a rank whose own work per step (its step time less its time waiting for peers in "
        "collectives, over straggler_window) is above this many times the median of its job's ranks "
        "(job_labels) warns. In lock-step collectives every rank's step time is equal and the slow rank is "
        "the one that waits least; a rank that does not measure its waits is compared on its step time.",
        _above_one,
    )
    straggler_window: str = setting("10m", "The window of each rank's mean step time (straggler rule).", _window)
    straggler_for: str = setting("15m", "How long a rank must stay a straggler before it warns.", _for)
    throughput_drop_ratio: float = setting(
        0.7,
        "Job throughput: a job whose step rate over throughput_window is below this share of its own rate "
        "over the throughput_baseline_window before it warns (the whole job slowed; no rank to blame).",
        _ratio,
    )
    throughput_window: str = setting("10m", "The window of the job's current step rate.", _window)
    throughput_baseline_window: str = setting(
        "1h", "The window of the job's own earlier step rate (ending where throughput_window begins).", _window
    )
    throughput_for: str = setting("15m", "How long the job's throughput must stay low before it warns.", _for)
    phase_quiet_window: str = setting(
        "30m",
        "A declared non-training phase (vramwatch.phase: eval, save, load, compile) younger than this keeps its "
        "job's stall and throughput alerts quiet; past it the job stalls as usual (a hang inside an "
        "evaluation still pages).",
        _window,
    )
    incident_window: str = setting(
        "30m",
        "How long a rank's abnormal exit, or ranks vanished from a node, stay a cause (TrainingRankExited, "
        "TrainingNodeLost: firing, and muting the job's symptom pages) while the rest of the job runs. At "
        "least NCCL's collective timeout, after which the job's other ranks end too.",
        _window,
    )
    rank_exit_for: str = setting(
        "30s",
        "How long the rest of a job must keep running after a rank ended abnormally before it pages: a job "
        "cancelled or preempted as a whole (every rank signalled at once) ends everywhere within seconds "
        "and does not page.",
        _for,
    )
    node_lost_for: str = setting(
        "1m",
        "How long a node's ranks must be gone (its target down or out of service discovery) while the rest "
        "of their job runs before it pages: longer than a scrape blip.",
        _for,
    )
    loss_nonfinite_for: str = setting(
        "30s",
        "How long the newest loss must read NaN or +-Inf before it pages: two scrape intervals of the shipped "
        "prometheus.yml (15 s). Non-finite grad norms never page (fp16 loss scaling skips those steps).",
        _for,
    )
    gpu_peak_flops: tuple[tuple[str, float], ...] = setting(
        peaks.DENSE_BF16,
        "Peak dense BF16 FLOP/s by GPU name (a regex on gpu_info's name, the first match wins): the rules "
        "record each rank's peak from it, and the MFU panel divides the model's FLOP/s by that. The "
        "defaults are half of NVIDIA's datasheet BF16 figures, "
        "which are printed with 2:4 sparsity (A100, H100 SXM/PCIe/NVL, H200 SXM/NVL; sources in "
        "vramwatch/monitoring/peaks.py). A mapping in YAML (or a list of one-entry mappings, the Helm chart's "
        "form: Helm does not keep a mapping's order); set your own for another GPU or precision.",
        _peak_flops,
    )
    target_down_for: str = setting("5m", "How long a target must fail its scrapes before it warns.", _for)
    target_absent_for: str = setting(
        "",
        "absent(up{target_selector}) for this long warns; empty: no such rule (between jobs no target is "
        "the normal state of a per-job exporter).",
        _for,
    )
    sample_stale_for: str = setting("1m", "How long samples must stay stale before it warns.", _for)
    collector_down_for: str = setting("5m", "How long a collector must fail before it warns.", _for)
    node_label: str = setting(
        "node",
        "The target label naming the Kubernetes node (the shipped PodMonitor's and prometheus.yml's "
        "relabeling); the dashboards' node variable selects on it, a setup without it sees All.",
        lambda v: _label_names((v,)),
    )

    def scaled(self, factor: float) -> MonitoringConfig:
        """The same rules on a faster (factor < 1) or slower clock: every time quantity times factor."""
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.endswith(("_for", "_window")) and v:
                changes[f.name] = format_duration(parse_duration(v) * factor)
            elif f.name.endswith(("_seconds", "_hours")):
                changes[f.name] = v * factor
        return dataclasses.replace(self, **changes)

    @property
    def peer_labels(self) -> tuple[str, ...]:
        """What makes ranks peers of one job: the target's job labels and the ranks' own job_id (always)."""
        return tuple(dict.fromkeys((*self.job_labels, contract.JOB_ID)))

    @property
    def leak_horizon_seconds(self) -> float:
        return self.leak_horizon_hours * 3600.0


DEFAULT = MonitoringConfig()
# the PrometheusRule's `release` label: kube-prometheus-stack selects rules by it
DEFAULT_RELEASE = "kube-prometheus-stack"
# the example monitoring config beside the rendered rules (`vramwatch alerts --write DIR`)
EXAMPLE_PATH = "monitoring.example.yaml"

# pairs that must stay ordered: (lower, higher)
_ORDERED = (("memory_warning_ratio", "memory_critical_ratio"),)


def validate(cfg: MonitoringConfig, source: str = "MonitoringConfig") -> MonitoringConfig:
    """``cfg`` if every value passes its check; else ConfigError naming the first bad key and ``source``.

    Does not check that ``disabled_alerts`` exist (the rule set does, see ``alerts.rules``)."""
    for f in dataclasses.fields(cfg):
        check = f.metadata.get("check")
        v = getattr(cfg, f.name)
        if check is None:
            continue
        try:
            check(v)
        except ValueError as e:
            raise ConfigError(f"invalid monitoring setting {f.name}={shown(v)} (from {source}): {e}") from None
    for low, high in _ORDERED:
        if not getattr(cfg, low) < getattr(cfg, high):
            raise ConfigError(
                f"invalid monitoring setting {low}={shown(getattr(cfg, low))} (from {source}): "
                f"must be below {high} ({shown(getattr(cfg, high))})"
            )
    both = set(cfg.xid_critical) & set(cfg.xid_warning)
    if both:
        raise ConfigError(
            f"invalid monitoring setting xid_warning={shown(cfg.xid_warning)} (from {source}): "
            f"Xid {', '.join(map(str, sorted(both)))} also in xid_critical"
        )
    return cfg


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration such as ``1h30m`` or ``500ms``."""
    parts = _DURATION.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r} (e.g. 90s, 5m, 1h30m)")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    """The shortest Prometheus duration for ``seconds`` (rounded to milliseconds)."""
    ms = round(seconds * 1000)
    if ms <= 0:
        return "0s"
    out = ""
    for unit in ("d", "h", "m", "s", "ms"):
        size = round(_UNITS[unit] * 1000)
        n, ms = divmod(ms, size)
        if n:
            out += f"{n}{unit}"
    return out
