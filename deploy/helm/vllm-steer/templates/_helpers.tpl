{{- define "vllm-steer.labels" -}}
app.kubernetes.io/name: {{ .Release.Name }}
{{- end -}}

{{/* The claim the model is read from: an existing one, or the chart's. */}}
{{- define "vllm-steer.modelsClaim" -}}
{{- .Values.existingModelsClaim | default (printf "%s-models" .Release.Name) -}}
{{- end -}}

{{/* The claim the steers are read from: an existing one, or the chart's. */}}
{{- define "vllm-steer.steersClaim" -}}
{{- .Values.existingSteersClaim | default (printf "%s-steers" .Release.Name) -}}
{{- end -}}

{{/* imagePullSecrets of a pod spec, if any (indent 6: under a pod template's spec). */}}
{{- define "vllm-steer.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
