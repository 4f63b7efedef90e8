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

{{/* A Prometheus duration in seconds (config.py parse_duration): 1h30m -> 5400, 500ms -> 0.5. */}}
{{- define "vramwatch.seconds" -}}
{{- $units := dict "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 "d" 86400.0 "w" 604800.0 "y" 31536000.0 -}}
{{- $total := 0.0 -}}
{{- range regexFindAll "[0-9]+(ms|s|m|h|d|w|y)" . -1 -}}
{{- $n := regexFind "^[0-9]+" . -}}
{{- $total = addf $total (mulf (float64 $n) (get $units (trimPrefix $n .))) -}}
{{- end -}}
{{- include "vramwatch.num" $total -}}
{{- end -}}

{{/* A number as Python's format(v, "g") writes it (the rules' descriptions): 6 significant digits. */}}
{{- define "vramwatch.g" -}}
{{- printf "%.6g" (float64 .) -}}
{{- end -}}

{{/* A number as the dashboards print it (vramwatch/monitoring/dashboards/common.py num, Python's repr):
0.85, 120, 1979000000000000.0, 1e+16. */}}
{{- define "vramwatch.pynum" -}}
{{- $v := float64 . -}}
{{- $a := ternary (mulf $v -1.0) $v (lt $v 0.0) -}}
{{- if and (eq $v (floor $v)) (lt $a 1e15) -}}{{ int64 $v }}
{{- else if and (eq $v (floor $v)) (lt $a 1e16) -}}{{ int64 $v }}.0
{{- else if or (ge $a 1e16) (lt $a 0.0001) -}}{{ printf "%g" $v }}
{{- else -}}{{ toJson $v }}
{{- end -}}
{{- end -}}

{{/* A Prometheus duration normalised (config.py format_duration): 90s -> 1m30s, 1h0m -> 1h. */}}
{{- define "vramwatch.duration" -}}
{{- $ms := round (mulf (include "vramwatch.seconds" . | float64) 1000.0) 0 | int64 -}}
{{- if le $ms 0 -}}0s{{- else -}}
{{- range list (list "d" 86400000) (list "h" 3600000) (list "m" 60000) (list "s" 1000) (list "ms" 1) -}}
{{- $n := div $ms (index . 1) -}}
{{- $ms = mod $ms (index . 1) -}}
{{- if $n }}{{ $n }}{{ index . 0 }}{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}
