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

{{/* Refuses a GPU (any extended resource, a name with a "/") whose request differs from its
  limit: Kubernetes requires them equal, and Helm merges `resources` into the defaults, so
  raising only limits."nvidia.com/gpu" would keep the default request of 1. */}}
{{- define "vllm-steer.checkResources" -}}
{{- $requests := .Values.resources.requests | default dict -}}
{{- $limits := .Values.resources.limits | default dict -}}
{{- range $name, $request := $requests -}}
{{- if and (contains "/" $name) (ne (toString $request) (toString (get $limits $name))) -}}
{{- fail (printf "resources: requests.%s is %v but limits.%s is %v; Kubernetes requires the request of %s equal to its limit: set both to the same value, e.g. --set resources.requests.%s=2 --set resources.limits.%s=2" $name $request $name (get $limits $name | default "not set") $name ($name | replace "." "\\.") ($name | replace "." "\\.")) -}}
{{- end -}}
{{- end -}}
{{- end -}}
