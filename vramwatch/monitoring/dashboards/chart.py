"""The Helm chart's dashboards ConfigMap template, derived from the Python dashboards.

The same technique as the rule template (:mod:`vramwatch.monitoring.helm`): the dashboards are built
once with a distinct *sentinel* per config key, and every place a sentinel shows up in their JSON
becomes the Helm action that renders the value the same way, JSON-escaped where it lands inside a
string. Keys that change the dashboards' shape: the target variables (``job_labels`` and
``node_label``: one variable each, and one matcher each in every query) become a ``range`` over the
list the chart computes as :func:`~.common.target_variables` does; ``gpu_peak_flops`` becomes a
``range`` over its entries (a list of one-entry mappings in the chart: a mapping's order is lost in
Helm, and the first matching pattern wins); an empty ``selector`` drops its matchers. A sentinel left
behind fails generation naming its key; tests/deploy/test_helm.py renders the chart with a
non-default value of every key and compares with ``vramwatch dashboards --config F``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any

from vramwatch.monitoring import contract
from vramwatch.monitoring.config import DEFAULT, format_duration, parse_duration
from vramwatch.monitoring.dashboards import build_all
from vramwatch.monitoring.dashboards.common import HOST, TITLES, JSONEncoder, num
from vramwatch.monitoring.helm import _TYPES, FIELDS, ref, value_key

TEMPLATE_PATH = "helm/vramwatch/templates/dashboards-configmap.yaml"

_SEL = 'vwsel_q="s"'
_JL = ("vwjla", "vwjlb")
_NODE = "vwnode"
_XC = (90011, 90012)
_XW = (90021, 90022)
_TAGS = ("vwtaga", "vwtagb")
_PEAKS = (("vwpeaka", 0.6110173), ("vwpeakb", 0.6120173))
_LEAK_HOURS = 7.0160173
_NODE_VAR = "node"  # the node label's variable (common.target_variables)

_TAGS_SLOT = "@@vw-tags@@"
_TARGETS_SLOT = "@@vw-targets@@"


def _js(action: str) -> str:
    """A Helm action whose string value lands inside a JSON string: escaped (quotes, backslashes)."""
    return "{{ " + action + ' | toJson | trimPrefix "\\"" | trimSuffix "\\"" }}'


def _sentinels() -> tuple[Any, dict[str, Any]]:
    """The config with a sentinel per key, and the plain numbers' and durations' sentinels."""
    simple: dict[str, Any] = {}
    i = 0
    for name in FIELDS:
        kind = _TYPES[name]
        if name in ("leak_horizon_hours", "target_absent_for"):
            continue
        if kind is float:
            simple[name] = round(0.7 + i * 0.001 + 0.0000173, 7)
            i += 1
        elif kind is str and name.endswith(("_for", "_window")):
            # in hours, so that the text as given (1001h) differs from its normalised form (41d17h)
            simple[name] = f"{1001 + i}h"
            i += 1
    cfg = dataclasses.replace(
        DEFAULT,
        **simple,
        leak_horizon_hours=_LEAK_HOURS,
        selector=_SEL,
        job_labels=_JL,
        node_label=_NODE,
        xid_critical=_XC,
        xid_warning=_XW,
        dashboard_tags=_TAGS,
        gpu_peak_flops=_PEAKS,
    )
    return cfg, simple


def _escaped(text: str) -> str:
    return json.dumps(text)[1:-1]  # as the text shows inside a JSON string


# the target variables' matchers, in the order common.Scope writes them (var, label)
_TARGETS = ((_JL[0], _JL[0]), (_JL[1], _JL[1]), (_NODE_VAR, _NODE), (HOST, "instance"))


def _targets_var(model: dict[str, Any]) -> str:
    """The templating list's target variables -> one slot; returns the JSON of one, with Helm actions."""
    items = model["templating"]["list"]
    names = [v.get("name") for v in items]
    at = names.index(_TARGETS[0][0])
    if names[at : at + len(_TARGETS)] != [v for v, _ in _TARGETS] or at + len(_TARGETS) == len(items):
        raise ValueError(f"helm: {model['uid']}'s target variables are not where the chart expects them")
    block = items[at : at + len(_TARGETS)]
    items[at : at + len(_TARGETS)] = [_TARGETS_SLOT]
    generic = []
    for (var, label), v in zip(_TARGETS, block, strict=True):
        v = copy.deepcopy(v)
        if v["label"] != TITLES.get(var, var):
            raise ValueError(f"helm: the {var} variable's title is not TITLES'")
        query = v["query"]
        if v["definition"] != query or not (query.startswith("label_values(") and query.endswith(f", {label})")):
            raise ValueError(f"helm: the {var} variable's query is not label_values(..., {label})")
        v.update(name="@@vw-var@@", label="@@vw-title@@", query="@@vw-query@@", definition="@@vw-query@@")
        generic.append(json.dumps(v, indent=2, sort_keys=True))
    if len(set(generic)) != 1:
        raise ValueError("helm: the target variables differ in more than their name, title and query")
    query = (
        "label_values(" + contract.spec("vramwatch_build_info").name + '{{ if $b }}{{ "{" }}{{ join ", " $b }}'
        '{{ "}" }}{{ end }}, {{ index $t 1 }})'
    )
    before = (
        "{{- $b := list }}{{ with " + ref("selector") + " }}{{ $b = append $b (toJson . | trimPrefix "
        '"\\"" | trimSuffix "\\"") }}{{ end }}{{ range $j, $u := $vwTargets }}{{ if lt $j $i }}'
        '{{ $b = append $b (printf "%s=~\\\\\\"$%s\\\\\\"" (index $u 1) (index $u 0)) }}{{ end }}{{ end }}\n'
    )
    text = (
        generic[0]
        .replace('"@@vw-var@@"', '"{{ index $t 0 }}"')
        .replace('"@@vw-title@@"', '"{{ get $vwTitles (index $t 0) | default (index $t 0) }}"')
        .replace('"@@vw-query@@"', '"' + query + '"')
    )
    return "{{- range $i, $t := $vwTargets }}\n" + before + text + ",\n{{- end }}\n"


def _peaks(text: str) -> str:
    """``(gpu_info{..name=~"a"} * 0 + Fa) or (..b.. Fb)`` -> a range over gpuPeakFlops' entries."""
    (pa, fa), (pb, fb) = _PEAKS
    pattern = re.compile(
        r"\(([^()]*?)" + pa + r"([^()]*?)" + re.escape(num(fa)) + r"\) or \(([^()]*?)" + pb + r"([^()]*?)"
        r"" + re.escape(num(fb)) + r"\)"
    )

    def sub(m: re.Match[str]) -> str:
        before, mid, before_b, mid_b = m.groups()
        if (before, mid) != (before_b, mid_b):
            raise ValueError("helm: gpu_peak_flops' entries are not rendered alike")
        return (
            "{{ range $pi, $pe := "
            + ref("gpu_peak_flops")
            + " }}{{ range $pp, $pf := $pe }}{{ if $pi }} or {{ end }}("
            + before
            + _js("$pp")
            + mid
            + '{{ include "vramwatch.pynum" $pf }}){{ end }}{{ end }}'
        )

    return pattern.sub(sub, text)  # a dashboard without the MFU panel has none (a leftover fails)


_BOUNDED = r"(?<![\w.]){}(?!\d|\.\d)"


def _sub(text: str, piece: str, action: str, field: str, *, bounded: bool = False, required: bool = False) -> str:
    pattern = _BOUNDED.format(re.escape(piece)) if bounded else re.escape(piece)
    new = re.sub(pattern, lambda _m: action, text)
    if required and new == text:
        raise ValueError(f"helm: the dashboards do not show MonitoringConfig.{field} as {piece!r}")
    return new


def _substitute(text: str, simple: dict[str, Any]) -> str:
    text = _peaks(text)
    # the target matchers (every query) and the alert matchers (ALERTS{...}: the host apart)
    matchers = ", ".join(f'{label}=~"${var}"' for var, label in _TARGETS)
    each = '{{ range $j, $u := $vwTargets }}{{ if $j }}, {{ end }}{{ index $u 1 }}=~\\"${{ index $u 0 }}\\"{{ end }}'
    text = _sub(text, _escaped(matchers), each, "job_labels")
    alerts = ", ".join(f'{label}=~"${var}|"' for var, label in _TARGETS if var != HOST)
    each = (
        '{{ range $j, $u := $vwTargets }}{{ if ne (index $u 0) "'
        + HOST
        + '" }}{{ if $j }}, {{ end }}{{ index $u 1 }}=~\\"${{ index $u 0 }}|\\"{{ end }}{{ end }}'
    )
    text = _sub(text, _escaped(alerts), each, "job_labels")
    text = _sub(text, ", ".join((*_JL, contract.JOB_ID)), '{{ join ", " $vwPeers }}', "job_labels")
    sel = _escaped(_SEL)
    text = _sub(
        text,
        "{" + sel + "}",
        "{{ with " + ref("selector") + ' }}{{ "{" }}' + _js(".") + '{{ "}" }}{{ end }}',
        "selector",
        required=False,
    )
    text = _sub(text, sel + ", ", "{{ with " + ref("selector") + " }}" + _js(".") + ", {{ end }}", "selector")
    for items, field in ((_XC, "xid_critical"), (_XW, "xid_warning")):
        text = _sub(text, ", ".join(map(str, items)), '{{ join ", " ' + ref(field) + " }}", field)
    text = text.replace('"' + _TAGS_SLOT + '"', "{{ toJson " + ref("dashboard_tags") + " }}")
    for field, s in simple.items():
        r = ref(field)
        if isinstance(s, str):
            normal = format_duration(parse_duration(s))
            text = _sub(text, s, "{{ " + r + " }}", field, bounded=True, required=False)
            text = _sub(
                text, normal, '{{ include "vramwatch.duration" ' + r + " }}", field, bounded=True, required=False
            )
        else:
            text = _sub(text, num(s), '{{ include "vramwatch.pynum" ' + r + " }}", field, bounded=True, required=False)
    leak = ref("leak_horizon_hours")
    text = _sub(
        text,
        num(_LEAK_HOURS * 3600),
        '{{ include "vramwatch.pynum" (mulf ' + leak + " 3600.0) }}",
        "leak_horizon_hours",
        bounded=True,
    )
    text = _sub(
        text, num(_LEAK_HOURS), '{{ include "vramwatch.pynum" ' + leak + " }}", "leak_horizon_hours", bounded=True
    )
    return text.replace("{{{", '{{ "{" }}{{')  # a PromQL brace right before an action


def _leftovers(text: str, simple: dict[str, Any]) -> None:
    pieces = [
        ("vwsel_q", "selector"),
        *((s, "job_labels") for s in _JL),
        (_NODE, "node_label"),
        *((str(s), "xid_critical") for s in _XC),
        *((str(s), "xid_warning") for s in _XW),
        *((s, "dashboard_tags") for s in _TAGS),
        *((p, "gpu_peak_flops") for p, _ in _PEAKS),
        *((num(f), "gpu_peak_flops") for _, f in _PEAKS),
        ("7.016", "leak_horizon_hours"),
        ("@@vw", "the chart's slots"),
    ]
    for field, s in simple.items():
        pieces.append((s if isinstance(s, str) else num(s), field))
        if isinstance(s, str):
            pieces.append((format_duration(parse_duration(s)), field))
    for piece, field in pieces:
        if re.search(_BOUNDED.format(re.escape(piece)), text):
            raise ValueError(f"helm: the dashboards use MonitoringConfig.{field} in a way the chart cannot template")


def dashboard_templates() -> dict[str, str]:
    """File name -> the dashboard's JSON with Helm actions (for the ConfigMap's data)."""
    cfg, simple = _sentinels()
    out = {}
    for model in build_all(cfg):
        data = json.loads(JSONEncoder().encode(model))  # as render.dashboard_json, parsed
        if data.get("tags") != list(_TAGS):
            raise ValueError("helm: the dashboards' tags are not dashboard_tags")
        data["tags"] = _TAGS_SLOT
        block = _targets_var(data)
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
        text = text.replace("{{", '{{ "{{" }}')  # Grafana's legend templates ({{instance}}), for Helm
        slot = re.search(r'^ *"' + _TARGETS_SLOT + '",\n', text, flags=re.M)
        if slot is None:
            raise ValueError("helm: the target variables' slot is gone")
        text = text[: slot.start()] + block + text[slot.end() :]
        text = _substitute(text, simple)
        _leftovers(text, simple)
        out[f"{model.uid}.json"] = text
    return out


HEAD = (
    """{{- if .Values.dashboards.enabled }}
# Generated by `vramwatch dashboards --write deploy` from vramwatch/monitoring/dashboards/ (vramwatch/
# monitoring/dashboards/chart.py: every monitoring config key the dashboards use is a value under
# `monitoring:`). Do not edit: change the Python. The dashboards are for Grafana's dashboard sidecar,
# which loads ConfigMaps labelled dashboards.label (kube-prometheus-stack: grafana_dashboard "1"; it
# must search this namespace, or set dashboards.namespace to Grafana's).
{{- $m := .Values.monitoring }}
{{- $vwPeers := uniq (append $m.jobLabels \""""
    + contract.JOB_ID
    + """\") }}
{{- /* the target variables (common.target_variables): [variable, label], the job labels, the node, the target */}}
{{- $vwTargets := list }}
{{- $vwSeen := list }}
{{- range (append $m.jobLabels $m.nodeLabel) }}
{{- if and . (ne . "instance") (not (has . $vwSeen)) }}
{{- $vwSeen = append $vwSeen . }}
{{- $vwTargets = append $vwTargets (list (ternary \""""
    + _NODE_VAR
    + """\" . (eq . $m.nodeLabel)) .) }}
{{- end }}
{{- end }}
{{- $vwTargets = append $vwTargets (list \""""
    + HOST
    + """\" "instance") }}
{{- $vwTitles := dict """
    + " ".join(f"{json.dumps(k)} {json.dumps(v)}" for k, v in TITLES.items())
    + """ }}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "vramwatch.fullname" . }}-dashboards
  namespace: {{ .Values.dashboards.namespace | default .Release.Namespace }}
  labels:
    {{- include "vramwatch.labels" (dict "ctx" . "component" "dashboards") | nindent 4 }}
    {{ .Values.dashboards.label }}: {{ .Values.dashboards.labelValue | quote }}
  {{- with .Values.dashboards.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
data:
"""
)


def configmap_template() -> str:
    out = [HEAD]
    for name, text in sorted(dashboard_templates().items()):
        out.append(f"  {name}: |\n")
        # the JSON indented into the block scalar; the range's own lines ({{- ...) trim, so they stay
        out += [("    " + ln if ln.strip() and not ln.startswith("{{-") else ln) for ln in text.splitlines(True)]
    out.append("{{- end }}\n")
    return "".join(out)


__all__ = ["TEMPLATE_PATH", "configmap_template", "dashboard_templates", "value_key"]
