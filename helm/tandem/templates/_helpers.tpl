{{/*
Names, labels and the small computations every template shares. Values consistency checks
that stop a render live here too (tandem.checks), so `helm template`/`install` fail with a
message instead of producing a cluster that cannot work.
*/}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: FULLNAME-COMPONENT (component names are short). */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root | trunc 50 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component: dict "root" $ "component" NAME. */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* All labels of one component's objects. */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" .root }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The tandem image: the tag defaults to the chart's appVersion, never `latest`. */}}
{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) -}}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The served model's directory inside every container. */}}
{{- define "tandem.modelDir" -}}
{{- if .Values.model.dir -}}
{{- .Values.model.dir -}}
{{- else -}}
{{- printf "%s/%s" (.Values.model.mountPath | trimSuffix "/") (include "tandem.pullName" .) -}}
{{- end -}}
{{- end -}}

{{/* The name `tandem model pull` imports (its directory under the models volume). */}}
{{- define "tandem.pullName" -}}
{{- default .Values.model.servedName .Values.model.pull.name -}}
{{- end -}}

{{/*
Init container importing the model into the models volume (`tandem model pull`, which
returns at once when a complete import is already there). Renders `initContainers:`.
*/}}
{{- define "tandem.modelInit" -}}
{{- if .Values.model.pull.enabled }}
initContainers:
  - name: model-pull
    image: {{ include "tandem.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    {{- with .Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    command: [{{ .Values.image.command | quote }}]
    args: [model, pull, {{ include "tandem.pullName" . | quote }}]
    env:
      # `model pull` writes to $TANDEM_HOME/models/NAME: the volume is mounted there.
      - name: TANDEM_HOME
        value: /tandem-home
    {{- with .Values.model.pull.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - name: models
        mountPath: /tandem-home/models
{{- end }}
{{- end -}}

{{/* etcd client URLs (`http://host:port`, `https://` with tls.etcd) as a JSON list: the bundled one or etcd.endpoints. */}}
{{- define "tandem.etcdEndpoints" -}}
{{- if .Values.etcd.bundled.enabled -}}
{{- list (printf "%s://%s.%s.svc:%d" (ternary "https" "http" .Values.tls.etcd.enabled) (include "tandem.componentName" (dict "root" . "component" "etcd")) .Release.Namespace (int .Values.etcd.bundled.clientPort)) | toJson -}}
{{- else -}}
{{- .Values.etcd.endpoints | toJson -}}
{{- end -}}
{{- end -}}

{{/* The workers' --discovery value: etcd://host:port[,host:port] (https URLs kept whole). */}}
{{- define "tandem.workerDiscovery" -}}
{{- $parts := list -}}
{{- range (include "tandem.etcdEndpoints" . | fromJsonArray) -}}
{{- $parts = append $parts (trimPrefix "http://" .) -}}
{{- end -}}
{{- printf "etcd://%s" (join "," $parts) -}}
{{- end -}}

{{/*
Deep merge of two maps as JSON: "over" wins, maps merge key by key, lists and scalars are
replaced whole. (Sprig's merge/mergeOverwrite treat false and 0 as "empty" and would let a
default `true` win over a pool's `false`.)
*/}}
{{- define "tandem.deepMerge" -}}
{{- $out := deepCopy .base -}}
{{- range $k, $v := .over -}}
{{- $b := get $out $k -}}
{{- if and (kindIs "map" $v) (kindIs "map" $b) -}}
{{- $_ := set $out $k (include "tandem.deepMerge" (dict "base" $b "over" $v) | fromJson) -}}
{{- else -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* One worker pool's settings: `workers` defaults under the pool's own keys, as JSON. */}}
{{- define "tandem.pool" -}}
{{- include "tandem.deepMerge" (dict "base" .root.Values.workers "over" (index .root.Values .pool)) -}}
{{- end -}}

{{/* The role flag of a pool. */}}
{{- define "tandem.poolRole" -}}
{{- if eq . "aggregated" -}}both{{- else -}}{{ . }}{{- end -}}
{{- end -}}

{{/* Grace period of a worker pool: terminationGracePeriodSeconds, or drain deadline + margin. */}}
{{- define "tandem.workerGrace" -}}
{{- if kindIs "invalid" .terminationGracePeriodSeconds -}}
{{- add (int .drainDeadlineSeconds) (int .drainMarginSeconds) -}}
{{- else -}}
{{- int .terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/*
Scheduling fields of a pod: a component's own non-empty value replaces the chart-wide one.
Call with dict "root" $ "c" COMPONENT_VALUES.
*/}}
{{- define "tandem.scheduling" -}}
{{- $root := .root -}}
{{- $c := .c -}}
{{- with (default $root.Values.nodeSelector $c.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default $root.Values.affinity $c.affinity) }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default $root.Values.tolerations $c.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default $root.Values.topologySpreadConstraints $c.topologySpreadConstraints) }}
topologySpreadConstraints:
  {{- tpl (toYaml .) $root | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Consistency checks of the values; included once, from the router ConfigMap. */}}
{{- define "tandem.checks" -}}
{{- $v := .Values -}}
{{- if and $v.etcd.bundled.enabled (gt (len $v.etcd.endpoints) 0) -}}
{{- fail "etcd: set either etcd.bundled.enabled or etcd.endpoints, not both" -}}
{{- end -}}
{{- if and (not $v.etcd.bundled.enabled) (eq (len $v.etcd.endpoints) 0) -}}
{{- fail "etcd: workers register in etcd; set etcd.endpoints (an external etcd) or etcd.bundled.enabled=true" -}}
{{- end -}}
{{- range $v.etcd.endpoints -}}
{{- if not (or (hasPrefix "http://" .) (hasPrefix "https://" .)) -}}
{{- fail (printf "etcd.endpoints: %q must be an http:// or https:// URL" .) -}}
{{- end -}}
{{- if and $v.tls.etcd.enabled (not (hasPrefix "https://" .)) -}}
{{- fail (printf "etcd.endpoints: %q must be https:// with tls.etcd.enabled" .) -}}
{{- end -}}
{{- if and (not $v.tls.etcd.enabled) (hasPrefix "https://" .) -}}
{{- fail (printf "etcd.endpoints: %q is https://: set tls.etcd.enabled and tls.etcd.clientSecretName (the CA and the client certificate)" .) -}}
{{- end -}}
{{- end -}}
{{- if and $v.tls.etcd.enabled (not $v.tls.etcd.clientSecretName) -}}
{{- fail "tls.etcd.enabled needs tls.etcd.clientSecretName (the routers' and workers' certificate for etcd)" -}}
{{- end -}}
{{- if and $v.tls.etcd.enabled $v.etcd.bundled.enabled (not $v.tls.etcd.serverSecretName) -}}
{{- fail "tls.etcd.enabled with etcd.bundled.enabled needs tls.etcd.serverSecretName (the bundled etcd's certificate)" -}}
{{- end -}}
{{- if not (hasPrefix "/" $v.discovery.prefix) -}}
{{- fail (printf "discovery.prefix %q must start with /" $v.discovery.prefix) -}}
{{- end -}}
{{- if ne $v.prefill.enabled $v.decode.enabled -}}
{{- fail "prefill.enabled and decode.enabled go together: a prefill worker needs a decode worker to hand its KV cache to (use aggregated.enabled for single-role serving)" -}}
{{- end -}}
{{- if not (or $v.prefill.enabled $v.aggregated.enabled) -}}
{{- fail "no worker pool enabled: enable prefill+decode, aggregated, or both" -}}
{{- end -}}
{{- if eq (toString (default $.Chart.AppVersion $v.image.tag)) "latest" -}}
{{- fail "image.tag: `latest` is not reproducible (pods of one pool could run different builds); pin a release tag" -}}
{{- end -}}
{{- if and $v.router.autoscaling.enabled (not (dig "requests" "cpu" "" $v.router.resources)) -}}
{{- fail "router.autoscaling targets CPU utilisation, which needs router.resources.requests.cpu" -}}
{{- end -}}
{{- if and (gt (int $v.router.preStopSleepSeconds) 0) (le (int $v.router.terminationGracePeriodSeconds) (int $v.router.preStopSleepSeconds)) -}}
{{- fail "router.terminationGracePeriodSeconds must exceed router.preStopSleepSeconds (the sleep counts against the grace period)" -}}
{{- end -}}
{{- if and $v.model.pull.enabled $v.model.dir (ne (trimSuffix "/" $v.model.dir) (printf "%s/%s" (trimSuffix "/" $v.model.mountPath) (include "tandem.pullName" $))) -}}
{{- fail (printf "model.dir %q is not where model.pull puts %q (%s/%s): leave model.dir empty" $v.model.dir (include "tandem.pullName" $) (trimSuffix "/" $v.model.mountPath) (include "tandem.pullName" $)) -}}
{{- end -}}
{{- range $pool := list "prefill" "decode" "aggregated" -}}
{{- $p := include "tandem.pool" (dict "root" $ "pool" $pool) | fromJson -}}
{{- if $p.enabled -}}
{{- $grace := include "tandem.workerGrace" $p | int -}}
{{- $deadline := int $p.drainDeadlineSeconds -}}
{{- if lt $grace (add $deadline 5) -}}
{{- fail (printf "%s: terminationGracePeriodSeconds (%d) must be at least the drain deadline (%ds) + 5s, or the kubelet kills the worker while it is still finishing requests" $pool $grace $deadline) -}}
{{- end -}}
{{- if and (hasPrefix "cuda" (toString $p.device)) (lt (int $p.gpus) 1) -}}
{{- fail (printf "%s: device %s needs gpus >= 1 (the nvidia.com/gpu request is what puts a GPU in the container)" $pool $p.device) -}}
{{- end -}}
{{- if not (regexMatch "^(cpu|cuda|cuda:[0-9]+)$" (toString $p.device)) -}}
{{- fail (printf "%s.device %q: expected cpu, cuda or cuda:N" $pool $p.device) -}}
{{- end -}}
{{- if not (has (toString $p.dtype) (list "f32" "bf16")) -}}
{{- fail (printf "%s.dtype %q: expected f32 or bf16" $pool $p.dtype) -}}
{{- end -}}
{{- if and $p.autoscaling.enabled (gt (int $p.autoscaling.minReplicas) (int $p.autoscaling.maxReplicas)) -}}
{{- fail (printf "%s.autoscaling: minReplicas (%d) exceeds maxReplicas (%d)" $pool (int $p.autoscaling.minReplicas) (int $p.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The router's probe action for `path`: an HTTP(S) GET, or a TCP connect when clients must
present a certificate (the kubelet has none). */}}
{{- define "tandem.routerProbe" -}}
{{- $https := .root.Values.tls.https -}}
{{- if and $https.secretName $https.requireClientCert -}}
tcpSocket:
  port: http
{{- else -}}
httpGet:
  path: {{ .path }}
  port: http
  {{- if $https.secretName }}
  scheme: HTTPS
  {{- end }}
{{- end -}}
{{- end -}}
