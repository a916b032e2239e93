{{- define "vllm-steer.labels" -}}
app.kubernetes.io/name: {{ .Release.Name }}
{{- end -}}
