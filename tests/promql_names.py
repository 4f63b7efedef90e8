"""Metric names in PromQL expressions (no SDK needed: the GPU suite reads the generated JSON with it)."""

from __future__ import annotations

import re

from vramwatch.monitoring import contract, promql

_FUNCS = {
    "abs",
    "absent",
    "avg",
    "ceil",
    "changes",
    "clamp_max",
    "clamp_min",
    "count",
    "delta",
    "deriv",
    "floor",
    "group",
    "histogram_quantile",
    "increase",
    "irate",
    "label_replace",
    "label_values",
    "max",
    "min",
    "predict_linear",
    "quantile",
    "rate",
    "round",
    "scalar",
    "sort",
    "sort_desc",
    "sum",
    "time",
    "topk",
    "bottomk",
    "vector",
    "avg_over_time",
    "max_over_time",
    "min_over_time",
    "stddev",
}
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_PROMETHEUS_OWN = {"ALERTS", "ALERTS_FOR_STATE"}


def metric_names(expr: str) -> set[str]:
    """Identifiers in a PromQL expression that name series (not functions, labels or keywords), and the
    names of a ``__name__`` matcher (``{__name__=~"a|b"}``: an alternation of plain names only)."""
    named = {n for mt in re.finditer(r'__name__\s*=~?\s*"([^"]*)"', expr) for n in mt.group(1).split("|")}
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    e = re.sub(r"\$\{[^}]*\}|\$\w+", "1", e)  # template variables
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for mt in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word, rest = mt.group(0), e[mt.end() :].lstrip()
        if word in _KEYWORDS or (word in _FUNCS and rest.startswith("(")):
            continue
        if re.fullmatch(r"\d*e\d*", word):
            continue
        names.add(word)
    return names | named


def in_contract(name: str) -> bool:
    """A family of the contract, Prometheus' own, or a series the shipped rules record."""
    if name in contract.BY_NAME or name in _PROMETHEUS_OWN or name in promql.RECORDS:
        return True
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)]
        if name.endswith(suffix) and base in contract.BY_NAME and contract.spec(base).type == "histogram":
            return True
    return False
