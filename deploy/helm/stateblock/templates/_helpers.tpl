{{/* Names */}}
{{- define "stateblock.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stateblock.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>", e.g. stateblock-capture. Call with (dict "ctx" $ "component" "capture"). */}}
{{- define "stateblock.componentName" -}}
{{- printf "%s-%s" (include "stateblock.fullname" .ctx) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stateblock.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels. Selector labels never include the version, so upgrades keep selecting the same pods. */}}
{{- define "stateblock.labels" -}}
helm.sh/chart: {{ include "stateblock.chart" . }}
app.kubernetes.io/name: {{ include "stateblock.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: stateblock
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "stateblock.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stateblock.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "stateblock.componentLabels" -}}
{{ include "stateblock.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "stateblock.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* Copies of every stream and bucket: nats.replicas, else the bundled cluster's size. */}}
{{- define "stateblock.natsReplicas" -}}
{{- $n := .Values.nats }}
{{- if gt ($n.replicas | int) 0 }}{{ $n.replicas | int }}
{{- else if and $n.enabled (dig "config" "cluster" "enabled" false $n) }}{{ dig "config" "cluster" "replicas" 3 $n | int }}
{{- else }}1{{ end }}
{{- end }}

{{/* NATS: the bundled chart's client Service (named as that chart names it), or nats.url. */}}
{{- define "stateblock.natsUrl" -}}
{{- if .Values.nats.enabled }}
{{- $name := "" }}
{{- if .Values.nats.fullnameOverride }}
{{- $name = .Values.nats.fullnameOverride }}
{{- else }}
{{- $chart := default "nats" .Values.nats.nameOverride }}
{{- if contains $chart .Release.Name }}
{{- $name = .Release.Name }}
{{- else }}
{{- $name = printf "%s-%s" .Release.Name $chart }}
{{- end }}
{{- end }}
{{- printf "nats://%s.%s.svc:4222" ($name | trunc 63 | trimSuffix "-") .Release.Namespace }}
{{- else }}
{{- required "nats.url is required when nats.enabled is false" .Values.nats.url }}
{{- end }}
{{- end }}

{{/* Model paths inside the containers. */}}
{{- define "stateblock.modelPath" -}}
{{- if isAbs .dir }}{{ clean .dir }}{{ else }}{{ clean (printf "%s/%s" .ctx.Values.model.mountPath .dir) }}{{ end }}
{{- end }}

{{- define "stateblock.signingKeyDir" -}}/var/run/stateblock/signing-key{{- end }}
{{- define "stateblock.trustedKeysDir" -}}/var/run/stateblock/trusted-keys{{- end }}
{{- define "stateblock.readoutSigningKeyDir" -}}/var/run/stateblock/readout-signing-key{{- end }}
{{- define "stateblock.readoutTrustedKeysDir" -}}/var/run/stateblock/readout-trusted-keys{{- end }}

{{/* The two key sets: the capture's (block headers) and the readout's (outcomes). */}}
{{- define "stateblock.keySets" -}}
keys: {prefix: "", signedBy: capture, trustedBy: readout}
readoutKeys: {prefix: "readout-", signedBy: readout, trustedBy: gateway}
{{- end }}

{{/* A key set's Secret name; dict: ctx, set ("keys" | "readoutKeys"), kind ("signing" | "trusted"). */}}
{{- define "stateblock.keySecretName" -}}
{{- $set := index .ctx.Values .set }}
{{- $prefix := (index (include "stateblock.keySets" .ctx | fromYaml) .set).prefix }}
{{- if $set.create }}{{ include "stateblock.componentName" (dict "ctx" .ctx "component" (printf "%s%s-key%s" $prefix .kind (ternary "s" "" (eq .kind "trusted")))) }}{{ else }}{{ index $set (printf "%sSecret" .kind) }}{{ end }}
{{- end }}

{{- define "stateblock.signingSecretName" -}}
{{ include "stateblock.keySecretName" (dict "ctx" . "set" "keys" "kind" "signing") }}
{{- end }}

{{- define "stateblock.trustedSecretName" -}}
{{ include "stateblock.keySecretName" (dict "ctx" . "set" "keys" "kind" "trusted") }}
{{- end }}

{{/* The readout GPU count: explicit, or 1 for the torch engine (its GPU fast path). */}}
{{- define "stateblock.readoutGpus" -}}
{{- if kindIs "invalid" .Values.readout.gpu.count }}{{ if eq .Values.readout.engine "torch" }}1{{ else }}0{{ end }}{{ else }}{{ .Values.readout.gpu.count | int }}{{ end }}
{{- end }}

{{- define "stateblock.readoutDevice" -}}
{{- if .Values.readout.device }}{{ .Values.readout.device }}{{ else if gt (include "stateblock.readoutGpus" . | int) 0 }}cuda{{ else }}cpu{{ end }}
{{- end }}

{{/* One env entry; every value a string, integers never in float notation. */}}
{{- define "stateblock.envVar" -}}
- name: {{ .name }}
  value: {{ .value | toString | quote }}
{{- end }}

{{/*
The variables every service reads (the request limits included: a readout worker refuses
a signed block over its own), then the component's own, then its `env` passthrough.
Call with (dict "ctx" $ "vars" (dict NAME VALUE ...) "extra" .Values.<component>.env "component" NAME).
A passthrough name must be STATEBLOCK_* and must not override one the chart sets.
*/}}
{{- define "stateblock.env" -}}
{{- $ctx := .ctx }}
{{- $vars := merge (dict
    "STATEBLOCK_NATS_URL" (include "stateblock.natsUrl" $ctx)
    "STATEBLOCK_NATS_REPLICAS" (include "stateblock.natsReplicas" $ctx | int)
    "STATEBLOCK_MODEL_NAME" $ctx.Values.model.name
    "STATEBLOCK_BASE_DIR" (include "stateblock.modelPath" (dict "ctx" $ctx "dir" $ctx.Values.model.baseDir))
    "STATEBLOCK_DECODER_DIR" (include "stateblock.modelPath" (dict "ctx" $ctx "dir" $ctx.Values.model.decoderDir))
    "STATEBLOCK_GRACE_S" $ctx.Values.graceSeconds
    "STATEBLOCK_LOG_LEVEL" $ctx.Values.logLevel
    "STATEBLOCK_MAX_LANES" ($ctx.Values.serving.maxLanes | int)
    "STATEBLOCK_PROMPT_LEN_MAX" ($ctx.Values.serving.promptLenMax | int)
    "STATEBLOCK_ANSWER_DEPTH_MAX" ($ctx.Values.serving.answerDepthMax | int)
  ) .vars (include "stateblock.natsUserVars" (dict "ctx" $ctx "component" .component) | fromYaml) }}
{{- range $name, $value := .extra }}
{{- if not (hasPrefix "STATEBLOCK_" $name) }}
{{- fail (printf "%s.env.%s: only STATEBLOCK_* variables configure the services" $.component $name) }}
{{- end }}
{{- if hasKey $vars $name }}
{{- fail (printf "%s.env.%s is set by the chart; use its value in values.yaml instead" $.component $name) }}
{{- end }}
{{- end }}
{{- range $name, $value := merge $vars (.extra | default dict) }}
{{ include "stateblock.envVar" (dict "name" $name "value" $value) }}
{{- end }}
{{- include "stateblock.clientEnv" $ctx }}
{{- if and (eq .component "gateway") $ctx.Values.auth.apiKeySecret.name }}
- name: STATEBLOCK_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $ctx.Values.auth.apiKeySecret.name }}
      key: {{ $ctx.Values.auth.apiKeySecret.key }}
{{- end }}
{{- with $ctx.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "stateblock.natsCredsDir" -}}/var/run/stateblock/nats-creds{{- end }}
{{- define "stateblock.natsTlsDir" -}}/var/run/stateblock/nats-tls{{- end }}

{{/* NATS credentials and TLS files, from Secrets, for every connection of every service. */}}
{{- define "stateblock.clientEnv" -}}
{{- $n := .Values.natsClient }}
{{- if $n.credsSecret }}
{{ include "stateblock.envVar" (dict "name" "STATEBLOCK_NATS_CREDS" "value" (printf "%s/%s" (include "stateblock.natsCredsDir" .) $n.credsKey)) }}
{{- end }}
{{- if $n.tlsSecret }}
{{ include "stateblock.envVar" (dict "name" "STATEBLOCK_NATS_TLS_CA" "value" (printf "%s/ca.crt" (include "stateblock.natsTlsDir" .))) }}
{{- if $n.tlsClientCert }}
{{ include "stateblock.envVar" (dict "name" "STATEBLOCK_NATS_TLS_CERT" "value" (printf "%s/tls.crt" (include "stateblock.natsTlsDir" .))) }}
{{ include "stateblock.envVar" (dict "name" "STATEBLOCK_NATS_TLS_KEY" "value" (printf "%s/tls.key" (include "stateblock.natsTlsDir" .))) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Mounts every service container gets beside its own: NATS client files, extraVolumeMounts. */}}
{{- define "stateblock.sharedMounts" -}}
{{- if .Values.natsClient.credsSecret }}
- name: nats-creds
  mountPath: {{ include "stateblock.natsCredsDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.natsClient.tlsSecret }}
- name: nats-tls
  mountPath: {{ include "stateblock.natsTlsDir" . }}
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "stateblock.sharedVolumes" -}}
{{- if .Values.natsClient.credsSecret }}
- name: nats-creds
  secret:
    secretName: {{ .Values.natsClient.credsSecret }}
    defaultMode: 0400
{{- end }}
{{- if .Values.natsClient.tlsSecret }}
- name: nats-tls
  secret:
    secretName: {{ .Values.natsClient.tlsSecret }}
    defaultMode: 0400
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The NATS subject / consumer token of model.name: stateblock.protocol.streams.model_token. */}}
{{- define "stateblock.modelToken" -}}
{{- $m := .Values.model.name }}
{{- if regexMatch "^[A-Za-z0-9_-]+$" $m }}{{ $m }}{{ else }}{{ printf "%s-%s" (regexReplaceAll "[^A-Za-z0-9_-]" $m "_" | trunc 64) (sha256sum $m | trunc 8) }}{{ end }}
{{- end }}

{{/* Probe = chart-chosen handler + timings from values. */}}
{{- define "stateblock.probe" -}}
{{- toYaml (merge (deepCopy .handler) (.timing | default dict)) }}
{{- end }}

{{/* Pod-level settings shared by all three Deployments. */}}
{{- define "stateblock.podCommon" -}}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
# No service-link variables: Kubernetes would inject e.g. STATEBLOCK_GATEWAY_HOST for a
# Service named stateblock-gateway, a name the gateway reads as its bind address.
enableServiceLinks: false
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ .ctx.Values.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml .ctx.Values.podSecurityContext | nindent 2 }}
{{- with .values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if and .ctx.Values.model.fillFromImage (ne .ctx.Values.model.source "image") }}
# The image carries the reference model at /models: copied into an empty model volume once,
# before the service starts (a volume that already holds base/config.json is left alone).
initContainers:
  - name: fill-models
    image: {{ include "stateblock.image" .ctx }}
    imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
    command:
      - sh
      - -c
      - 'test -f /fill/{{ .ctx.Values.model.baseDir }}/config.json || cp -a /models/. /fill/'
    securityContext:
      {{- toYaml .ctx.Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: /fill
{{- end }}
{{- end }}

{{- define "stateblock.modelVolume" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: {{ not $m.fillFromImage }}
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{ include "stateblock.sharedVolumes" . }}
{{- end }}

{{- define "stateblock.modelMount" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
{{ include "stateblock.sharedMounts" . }}
{{- end }}

{{/* Resources, with the GPU as an extended-resource limit when count > 0. */}}
{{- define "stateblock.resources" -}}
{{- $res := deepCopy (.resources | default dict) }}
{{- if gt (.gpus | int) 0 }}
{{- $limits := $res.limits | default dict }}
{{- $_ := set $limits .resourceName (.gpus | int) }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Cross-field checks the schema cannot express; each fails with the value to fix. */}}
{{- define "stateblock.validate" -}}
{{- $v := .Values }}
{{- if not (has $v.readout.engine (list "reference" "onnx" "torch")) }}
{{- fail (printf "readout.engine %q is not one of reference, onnx, torch" $v.readout.engine) }}
{{- end }}
{{- if ge ($v.graceSeconds | float64) ($v.terminationGracePeriodSeconds | float64) }}
{{- fail (printf "graceSeconds (%v) must be below terminationGracePeriodSeconds (%v): the rest is headroom for draining NATS" $v.graceSeconds $v.terminationGracePeriodSeconds) }}
{{- end }}
{{- if gt (mulf 2 ($v.readout.ackWaitSeconds | float64)) ($v.gateway.requestTimeoutSeconds | float64) }}
{{- fail (printf "readout.ackWaitSeconds (%v) must be at most half of gateway.requestTimeoutSeconds (%v): a block a dead worker held must be redelivered and read while its request still waits" $v.readout.ackWaitSeconds $v.gateway.requestTimeoutSeconds) }}
{{- end }}
{{- if le ($v.readout.ackWaitSeconds | float64) ($v.readout.leaseSeconds | float64) }}
{{- fail (printf "readout.ackWaitSeconds (%v) must exceed readout.leaseSeconds (%v): JetStream may redeliver only after a claim could expire" $v.readout.ackWaitSeconds $v.readout.leaseSeconds) }}
{{- end }}
{{- if and $v.readout.autoscaling.enabled $v.readout.autoscaling.keda.enabled }}
{{- fail "readout.autoscaling.enabled (the CPU HPA) and readout.autoscaling.keda.enabled both scale the readout: choose one" }}
{{- end }}
{{- if gt ($v.capture.autoscaling.minReplicas | int) ($v.capture.autoscaling.maxReplicas | int) }}
{{- fail "capture.autoscaling.minReplicas must not exceed maxReplicas" }}
{{- end }}
{{- if and $v.model.fillFromImage (eq $v.model.source "image") }}
{{- fail "model.fillFromImage copies the image's models into a volume: model.source must be pvc or hostPath" }}
{{- end }}
{{- if regexMatch "\\s" $v.model.name }}
{{- fail (printf "model.name %q must have no whitespace (any Hugging Face-style name is served)" $v.model.name) }}
{{- end }}
{{- if and (eq $v.model.source "pvc") (not $v.model.pvc.claimName) }}
{{- fail "model.pvc.claimName is required when model.source is pvc" }}
{{- end }}
{{- if and (eq $v.model.source "hostPath") (not $v.model.hostPath.path) }}
{{- fail "model.hostPath.path is required when model.source is hostPath" }}
{{- end }}
{{- if and (eq $v.capture.device "cuda") (lt ($v.capture.gpu.count | int) 1) }}
{{- fail "capture.device is cuda but capture.gpu.count is 0: give capture a GPU or set capture.device=cpu" }}
{{- end }}
{{- range $name := list "keys" "readoutKeys" }}
{{- $k := index $v $name }}
{{- if $k.create }}
{{- if not (regexMatch "^[0-9a-f]{16}$" $k.keyId) }}
{{- fail (printf "%s.keyId %q must be the 16-hex-digit id `stateblock keys generate` printed (the file stem)" $name $k.keyId) }}
{{- end }}
{{- if not (contains "BEGIN PRIVATE KEY" $k.privateKey) }}
{{- fail (printf "%s.create needs %s.privateKey: --set-file %s.privateKey=keys/<key_id>.key" $name $name $name) }}
{{- end }}
{{- if not (contains "BEGIN PUBLIC KEY" $k.publicKey) }}
{{- fail (printf "%s.create needs %s.publicKey: --set-file %s.publicKey=keys/<key_id>.pub" $name $name $name) }}
{{- end }}
{{- else }}
{{- if or (not $k.signingSecret) (not $k.trustedSecret) }}
{{- fail (printf "%s.signingSecret and %s.trustedSecret name existing Secrets (or set %s.create=true)" $name $name $name) }}
{{- end }}
{{- end }}
{{- range $id, $pem := $k.extraTrustedPublicKeys }}
{{- if not (regexMatch "^[0-9a-f]{16}$" $id) }}
{{- fail (printf "%s.extraTrustedPublicKeys: %q is not a 16-hex-digit key id" $name $id) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $v.readout.autoscaling.enabled (gt ($v.readout.autoscaling.minReplicas | int) ($v.readout.autoscaling.maxReplicas | int)) }}
{{- fail "readout.autoscaling.minReplicas must not exceed maxReplicas" }}
{{- end }}
{{- end }}

{{/* The capture's internal token: a Secret the chart makes, or captureToken.existingSecret. */}}
{{- define "stateblock.captureTokenDir" -}}/var/run/stateblock/capture-token{{- end }}

{{- define "stateblock.captureTokenSecretName" -}}
{{- .Values.captureToken.existingSecret | default (include "stateblock.componentName" (dict "ctx" . "component" "capture-token")) }}
{{- end }}

{{- define "stateblock.captureTokenFile" -}}
{{- printf "%s/%s" (include "stateblock.captureTokenDir" .) .Values.captureToken.key }}
{{- end }}

{{/* Mount and volume of that token, in the gateway (it presents it) and the capture (it checks it). */}}
{{- define "stateblock.captureTokenMount" -}}
- name: capture-token
  mountPath: {{ include "stateblock.captureTokenDir" . }}
  readOnly: true
{{- end }}

{{- define "stateblock.captureTokenVolume" -}}
- name: capture-token
  secret:
    secretName: {{ include "stateblock.captureTokenSecretName" . }}
    items:
      - key: {{ .Values.captureToken.key }}
        path: {{ .Values.captureToken.key }}
    # Group-readable: with fsGroup set, the non-root user reads it through its group.
    defaultMode: 0440
{{- end }}

{{/*
NATS users, one per component (natsAuth): each component's password in a Secret of its own,
mounted into that component's pods only; the server's side (bcrypt hashes and each user's
permissions, files/nats-permissions.json) in <release>-stateblock-nats-auth as auth.conf,
which the bundled NATS includes. Named from the release alone: the NATS chart's values
template it in its own context.
*/}}
{{- define "stateblock.natsUserSecretName" -}}
{{- include "stateblock.componentName" (dict "ctx" .ctx "component" (printf "nats-%s" .component)) }}
{{- end }}

{{- define "stateblock.natsAuthSecretName" -}}
{{- printf "%s-stateblock-nats-auth" .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stateblock.natsUserDir" -}}/var/run/stateblock/nats-user{{- end }}

{{/* STATEBLOCK_NATS_USER and _NATS_PASSWORD_FILE of a component; dict: ctx, component. */}}
{{- define "stateblock.natsUserVars" -}}
{{- if .ctx.Values.natsAuth.enabled }}
{{- dict "STATEBLOCK_NATS_USER" .component "STATEBLOCK_NATS_PASSWORD_FILE" (printf "%s/password" (include "stateblock.natsUserDir" .ctx)) | toYaml }}
{{- else }}{}{{ end }}
{{- end }}

{{/* Mount and volume of that Secret; dict: ctx, component, volume (its name: "nats-user"). */}}
{{- define "stateblock.natsUserMount" -}}
{{- if .ctx.Values.natsAuth.enabled }}
- name: {{ .volume | default "nats-user" }}
  mountPath: {{ include "stateblock.natsUserDir" .ctx }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "stateblock.natsUserVolume" -}}
{{- if .ctx.Values.natsAuth.enabled }}
- name: {{ .volume | default "nats-user" }}
  secret:
    secretName: {{ include "stateblock.natsUserSecretName" . }}
    # Group-readable: with fsGroup set, the non-root user reads it through its group.
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* A NATS configuration list of quoted strings. */}}
{{- define "stateblock.natsList" -}}
[{{ range $i, $s := . }}{{ if $i }}, {{ end }}{{ quote $s }}{{ end }}]
{{- end }}

{{/* A compiled capture's inductor and Triton caches (STATEBLOCK_CAPTURE_COMPILE_CACHE): on
the claim capture.compileCache.claimName names, which a capture started again (a new pod, a
rollout) warms up from; else an emptyDir, kept across the pod's container restarts. None for
an eager capture. */}}
{{- define "stateblock.compileCacheVars" -}}
{{- $v := .Values.capture }}
{{- if ne $v.compile "off" }}
{{- dict "STATEBLOCK_CAPTURE_COMPILE_CACHE" $v.compileCache.mountPath | toYaml }}
{{- else }}{}{{ end }}
{{- end }}

{{- define "stateblock.compileCacheMount" -}}
{{- if ne .Values.capture.compile "off" }}
- name: compile-cache
  mountPath: {{ .Values.capture.compileCache.mountPath }}
{{- end }}
{{- end }}

{{- define "stateblock.compileCacheVolume" -}}
{{- $c := .Values.capture.compileCache }}
{{- if ne .Values.capture.compile "off" }}
- name: compile-cache
{{- if $c.claimName }}
  persistentVolumeClaim:
    claimName: {{ $c.claimName }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $c.sizeLimit }}
{{- end }}
{{- end }}
{{- end }}
