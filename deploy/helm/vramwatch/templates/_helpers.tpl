{{/* The chart's name: vramwatch, or nameOverride. */}}
{{- define "vramwatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The objects' base name: fullnameOverride, else the release name (with the chart's name if it lacks it). */}}
{{- define "vramwatch.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "vramwatch.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The objects' namespace: namespaceOverride, else the release's. */}}
{{- define "vramwatch.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{/* Labels of every object: (dict "ctx" . "component" "<what>" "extra" <map of more labels>); "selected"
true for the objects kube-prometheus-stack's Prometheus selects by `release` (monitors, rules). */}}
{{- define "vramwatch.labels" -}}
app.kubernetes.io/name: {{ include "vramwatch.name" .ctx }}
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

{{/* A monitor's scrape endpoint (podMetricsEndpoints[] / endpoints[]): (dict "ctx" . "monitor" <its values>). */}}
{{- define "vramwatch.endpoint" -}}
{{- $m := .monitor -}}
- port: {{ .ctx.Values.scrape.portName }}
  path: /metrics
  scheme: {{ $m.scheme }}
  interval: {{ $m.interval }}
  scrapeTimeout: {{ $m.scrapeTimeout }}
  honorLabels: {{ $m.honorLabels }}
  {{- with $m.tlsConfig }}
  tlsConfig:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $m.basicAuth }}
  basicAuth:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  relabelings:
    - targetLabel: job
      replacement: {{ .ctx.Values.scrape.jobLabel }}
    - sourceLabels: [__meta_kubernetes_pod_node_name]
      targetLabel: node
    {{- with $m.relabelings }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $m.metricRelabelings }}
  metricRelabelings:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* One rule of the rule file with the chart's values applied, as YAML; empty when its alert is off.
(dict "rule" <the rule> "ctx" .). Recording rules pass unchanged. */}}
{{- define "vramwatch.rule" -}}
{{- $r := deepCopy .rule -}}
{{- $v := .ctx.Values.prometheusRule -}}
{{- if $r.alert -}}
{{- $knobs := get .ctx.Values.alerts $r.alert | default dict -}}
{{- if dig "enabled" true $knobs -}}
{{- $labels := $r.labels | default dict -}}
{{- $shipped := $labels.severity | default "" -}}
{{- /* for and severity: one value for every rule of the name, or a mapping by the shipped severity */ -}}
{{- $for := $knobs.for -}}
{{- if kindIs "map" $for }}{{ $for = get $for $shipped }}{{ end -}}
{{- if $for }}{{ $_ := set $r "for" $for }}{{ end -}}
{{- $severity := $knobs.severity | default $shipped -}}
{{- if kindIs "map" $severity }}{{ $severity = get $severity $shipped | default $shipped }}{{ end -}}
{{- $labels = merge (dict) ($knobs.labels | default dict) $v.additionalRuleLabels $labels -}}
{{- if $severity }}{{ $_ := set $labels "severity" $severity }}{{ end -}}
{{- $_ := set $r "labels" $labels -}}
{{- $annotations := $r.annotations | default dict -}}
{{- with $v.runbookUrl -}}
{{- $url := . | replace "{anchor}" (lower $r.alert) | replace "{alertname}" $r.alert -}}
{{- $_ := set $annotations "runbook_url" $url -}}
{{- end -}}
{{- /* the shipped links point at a placeholder Grafana (vramwatch/monitoring/helm.py) */ -}}
{{- $link := get $annotations "dashboard_url" -}}
{{- if hasPrefix "https://grafana.invalid/" $link -}}
{{- if $v.dashboardUrl -}}
{{- $_ := set $annotations "dashboard_url" (replace "https://grafana.invalid" (trimSuffix "/" $v.dashboardUrl) $link) -}}
{{- else -}}
{{- $_ := unset $annotations "dashboard_url" -}}
{{- end -}}
{{- end -}}
{{- $_ := set $r "annotations" $annotations -}}
{{ toYaml $r }}
{{- end -}}
{{- else -}}
{{ toYaml $r }}
{{- end -}}
{{- end -}}
