{{/*
The readout workers' container, volumes and pod annotations: rendered in the readout
Deployment (placement apart) or beside the capture in its pods (placement pod), from the
same templates. In a shared pod the containers share one network and one volume list, so
the readout's port names and its NATS user's volume name carry a "readout-" prefix there.
*/}}

{{- define "stateblock.sharedPod" -}}
{{- if eq .Values.placement "pod" }}true{{ end }}
{{- end }}

{{/* STATEBLOCK_DATA_PLANE of capture and readout: in a shared pod podDataPlane (host: the
/dev/shm; ipc: the capture's GPU memory), else bus. */}}
{{- define "stateblock.dataPlane" -}}
{{- if include "stateblock.sharedPod" . }}{{ .Values.podDataPlane | default "host" }}{{ else }}bus{{ end }}
{{- end }}

{{- define "stateblock.readoutPortPrefix" -}}
{{- if include "stateblock.sharedPod" . }}readout-{{ end }}
{{- end }}

{{- define "stateblock.readoutNatsVolume" -}}
{{- include "stateblock.readoutPortPrefix" . }}nats-user
{{- end }}

{{/* The in-memory /dev/shm both containers of a shared pod mount: one placement (shm.py). */}}
{{- define "stateblock.shmMount" -}}
{{- if include "stateblock.sharedPod" . }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- end }}

{{- define "stateblock.shmVolume" -}}
{{- if include "stateblock.sharedPod" . }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSizeLimit }}
{{- end }}
{{- end }}

{{/* Checksums of the key Secrets the readout mounts: its pods roll when they change. */}}
{{- define "stateblock.readoutAnnotations" -}}
{{- $ann := dict }}
{{- if or .Values.keys.create .Values.readoutKeys.create }}
{{- $_ := set $ann "checksum/trusted-keys" (include (print .Template.BasePath "/trusted-keys-secret.yaml") . | sha256sum) }}
{{- end }}
{{- if .Values.readoutKeys.create }}
{{- $_ := set $ann "checksum/signing-key" (include (print .Template.BasePath "/signing-key-secret.yaml") . | sha256sum) }}
{{- end }}
{{- toYaml $ann }}
{{- end }}

{{- define "stateblock.readoutContainer" -}}
{{- $v := .Values.readout }}
{{- $p := include "stateblock.readoutPortPrefix" . }}
- name: readout
  image: {{ include "stateblock.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python", "-m", "readout_svc"]
  env:
    {{- include "stateblock.env" (dict "ctx" . "component" "readout" "extra" $v.env "vars" (dict
        "STATEBLOCK_ENGINE" $v.engine
        "STATEBLOCK_DEVICE" (include "stateblock.readoutDevice" .)
        "STATEBLOCK_DATA_PLANE" (include "stateblock.dataPlane" .)
        "STATEBLOCK_TRUSTED_KEYS_DIR" (include "stateblock.trustedKeysDir" .)
        "STATEBLOCK_READOUT_KEY_DIR" (include "stateblock.readoutSigningKeyDir" .)
        "STATEBLOCK_READOUT_TRUSTED_KEYS_DIR" (include "stateblock.readoutTrustedKeysDir" .)
        "STATEBLOCK_WORKERS" (ternary ($v.workers | int | toString) "" (gt ($v.workers | int) 0))
        "STATEBLOCK_LEASE_S" $v.leaseSeconds
        "STATEBLOCK_ACK_WAIT_S" $v.ackWaitSeconds
        "STATEBLOCK_MAX_DELIVER" ($v.maxDeliver | int)
        "STATEBLOCK_READOUT_METRICS_PORT" ($v.ports.metrics | int)
        "STATEBLOCK_READOUT_HEALTH_PORT" ($v.ports.health | int)
        "STATEBLOCK_METRICS_HOST" "0.0.0.0"
        "STATEBLOCK_DUPLICATE_WINDOW_S" .Values.serving.duplicateWindowSeconds
      )) | trim | nindent 4 }}
  ports:
    - name: {{ $p }}metrics
      containerPort: {{ $v.ports.metrics }}
      protocol: TCP
    - name: {{ $p }}health
      containerPort: {{ $v.ports.health }}
      protocol: TCP
  # The workers' own gRPC health check, served by their event loop: it opens once the
  # model and engine are loaded, and says NOT_SERVING while NATS is unreachable or the
  # engine keeps failing (a /metrics probe, served from another thread, would not).
  startupProbe:
    {{- include "stateblock.probe" (dict "handler" (dict "grpc" (dict "port" ($v.ports.health | int))) "timing" $v.startupProbe) | nindent 4 }}
  livenessProbe:
    {{- include "stateblock.probe" (dict "handler" (dict "grpc" (dict "port" ($v.ports.health | int) "service" "liveness")) "timing" $v.livenessProbe) | nindent 4 }}
  readinessProbe:
    {{- include "stateblock.probe" (dict "handler" (dict "grpc" (dict "port" ($v.ports.health | int))) "timing" $v.readinessProbe) | nindent 4 }}
  resources:
    {{- include "stateblock.resources" (dict "resources" $v.resources "gpus" (include "stateblock.readoutGpus" .) "resourceName" $v.gpu.resourceName) | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "stateblock.modelMount" . | trim | nindent 4 }}
    {{- include "stateblock.shmMount" . | nindent 4 }}
    # its own NATS user's password, no other component's
    {{- include "stateblock.natsUserMount" (dict "ctx" . "component" "readout" "volume" (include "stateblock.readoutNatsVolume" .)) | nindent 4 }}
    # The capture's public keys only: its signing Secret is not referenced here.
    - name: trusted-keys
      mountPath: {{ include "stateblock.trustedKeysDir" . }}
      readOnly: true
    - name: readout-signing-key
      mountPath: {{ include "stateblock.readoutSigningKeyDir" . }}
      readOnly: true
    - name: readout-trusted-keys
      mountPath: {{ include "stateblock.readoutTrustedKeysDir" . }}
      readOnly: true
{{- end }}

{{/* The readout's own volumes; the model, /tmp and shared ones come from stateblock.modelVolume. */}}
{{- define "stateblock.readoutVolumes" -}}
{{- include "stateblock.natsUserVolume" (dict "ctx" . "component" "readout" "volume" (include "stateblock.readoutNatsVolume" .)) }}
- name: trusted-keys
  secret:
    secretName: {{ include "stateblock.trustedSecretName" . }}
    defaultMode: 0444
- name: readout-signing-key
  secret:
    secretName: {{ include "stateblock.keySecretName" (dict "ctx" . "set" "readoutKeys" "kind" "signing") }}
    defaultMode: 0400
- name: readout-trusted-keys
  secret:
    secretName: {{ include "stateblock.keySecretName" (dict "ctx" . "set" "readoutKeys" "kind" "trusted") }}
    defaultMode: 0444
{{- end }}

{{/* placement pod: what one pod of both containers needs; each check names the value to fix. */}}
{{- define "stateblock.validatePlacement" -}}
{{- $v := .Values }}
{{- if and (eq ($v.podDataPlane | default "host") "ipc") (not (include "stateblock.sharedPod" .)) }}
{{- fail "podDataPlane ipc keeps the rows in the capture pod's GPU memory: it needs placement pod" }}
{{- end }}
{{- if and (eq ($v.podDataPlane | default "host") "ipc") (include "stateblock.sharedPod" .) }}
{{- if or (ne $v.capture.device "cuda") (lt (include "stateblock.readoutGpus" . | int) 1) }}
{{- fail "podDataPlane ipc reads the rows on the capture's GPU: set capture.device cuda and readout.gpu.count 1 (a time-sliced share of that GPU)" }}
{{- end }}
{{- end }}
{{- if include "stateblock.sharedPod" . }}
{{- $scaling := $v.readout.autoscaling }}
{{- if or $scaling.enabled $scaling.keda.enabled }}
{{- fail "placement pod runs the readout workers in the capture's pods, and capture.autoscaling scales those: set readout.autoscaling.enabled and readout.autoscaling.keda.enabled to false" }}
{{- end }}
{{- $ports := dict }}
{{- range $name, $port := dict "capture.ports.grpc" $v.capture.ports.grpc "capture.ports.metrics" $v.capture.ports.metrics "readout.ports.metrics" $v.readout.ports.metrics "readout.ports.health" $v.readout.ports.health }}
{{- $key := toString ($port | int) }}
{{- if hasKey $ports $key }}
{{- fail (printf "placement pod: %s and %s are both port %s, and the containers of one pod share its network" (index $ports $key) $name $key) }}
{{- end }}
{{- $_ := set $ports $key $name }}
{{- end }}
{{- end }}
{{- end }}
