{{/* The objects' base name: the release name, or fullnameOverride. */}}
{{- define "vramwatch.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object: (dict "ctx" . "component" "<what>" "extra" <map of more labels>); "selected"
true for the objects kube-prometheus-stack's Prometheus selects by `release` (monitors, rules). */}}
{{- define "vramwatch.labels" -}}
app.kubernetes.io/name: vramwatch
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version }}
app.kubernetes.io/component: {{ .component }}
{{- if and .selected .ctx.Values.release }}
release: {{ .ctx.Values.release | quote }}
{{- end }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The scrape selector: the pod label the PodMonitor, the Service and the NetworkPolicy select. */}}
{{- define "vramwatch.scrapeSelector" -}}
{{ .Values.scrape.podLabel.key }}: {{ .Values.scrape.podLabel.value | quote }}
{{- end -}}

{{/* A threshold as the Python rules print it (vramwatch/monitoring/alerts/promql.py num): 0.85, 120, 4294967296. */}}
{{- define "vramwatch.num" -}}
{{- $v := float64 . -}}
{{- if eq $v (floor $v) -}}{{ int64 $v }}{{- else -}}{{ $v }}{{- end -}}
{{- end -}}

{{/* A ratio as a percentage (promql.py percent): 0.85 -> 85%, 0.355 -> 35.5%. */}}
{{- define "vramwatch.percent" -}}
{{- $p := round (mulf (float64 .) 100.0) 4 -}}
{{- include "vramwatch.num" $p -}}%
{{- end -}}
