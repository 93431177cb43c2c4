{{/* Names: the release's, or <release>-pipecast when the release name does not say pipecast. At most 38
characters: the control plane's StatefulSet, <fullname>-control-plane, must stay within 52, or its pods'
controller-revision-hash label (<StatefulSet>-<10-character hash>) passes 63 and no pod is ever made
(kubernetes#64023). */}}
{{- define "pipecast.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 38 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 38 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* A byte count as the processes parse it: helm reads a plain number in a values file as a float, which
would print as 1.7179869184e+10; a size in words ("16GiB") as given. */}}
{{- define "pipecast.bytes" -}}
{{- if kindIs "float64" . -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- end -}}

{{/* A size as a number of bytes, for comparing sizes: a size word of pipecast's ("16GiB", "1.5GB", a byte count)
or a Kubernetes quantity in the same units ("18Gi", "18G"). Call with (list "agent.memory" $value). */}}
{{- define "pipecast.sizeBytes" -}}
{{- $text := include "pipecast.bytes" (index . 1) -}}
{{- $pattern := "^([0-9]+(?:\\.[0-9]+)?)\\s*([a-zA-Z]*)$" -}}
{{- $units := dict "" 1 "b" 1 "k" 1e3 "kb" 1e3 "m" 1e6 "mb" 1e6 "g" 1e9 "gb" 1e9 "t" 1e12 "tb" 1e12
  "ki" 1024 "kib" 1024 "mi" 1048576 "mib" 1048576 "gi" 1073741824 "gib" 1073741824
  "ti" 1099511627776 "tib" 1099511627776 -}}
{{- $unit := regexReplaceAll $pattern $text "${2}" | lower -}}
{{- if not (and (regexMatch $pattern $text) (hasKey $units $unit)) -}}
{{- fail (printf "%s is %q: not a size (e.g. 16GiB, 18Gi or a byte count)" (index . 0) $text) -}}
{{- end -}}
{{ mulf (regexReplaceAll $pattern $text "${1}") (get $units $unit) | printf "%.0f" }}
{{- end -}}

{{/* A Kubernetes quantity from the values (emptyDir.sizeLimit, a claim's storage), refused here rather than by
the API server: pipecast's size words ("1GiB") are not quantities ("1Gi"). Call with
(list "agent.shmSize" $value). */}}
{{- define "pipecast.quantity" -}}
{{- $text := include "pipecast.bytes" (index . 1) -}}
{{- if not (regexMatch "^([0-9]+(\\.[0-9]*)?|\\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?$" $text) -}}
{{- fail (printf "%s is %q: not a Kubernetes quantity, which the API server refuses; write e.g. 1Gi, 512Mi or a byte count" (index . 0) $text) -}}
{{- end -}}
{{ $text }}
{{- end -}}

{{- define "pipecast.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "pipecast.selectorLabels" . }}
{{- end -}}

{{- define "pipecast.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of one component: call with (list $ "router"). */}}
{{- define "pipecast.componentLabels" -}}
{{ include "pipecast.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "pipecast.componentSelector" -}}
{{ include "pipecast.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "pipecast.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The agent's pod runs the serving worker on the GPU: without image.tag, with serve.device cuda, it takes the
CUDA build of the appVersion ("<appVersion>-cuda", README): the CPU build's torch has no CUDA. */}}
{{- define "pipecast.agentImage" -}}
{{- $cuda := and .Values.serve.enabled (hasPrefix "cuda" (toString .Values.serve.device)) -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default (printf "%s%s" .Chart.AppVersion (ternary "-cuda" "" $cuda)) }}
{{- end -}}

{{- define "pipecast.operatorSecret" -}}
{{ .Values.auth.existingSecret | default (printf "%s-operator" (include "pipecast.fullname" .)) }}
{{- end -}}

{{- define "pipecast.nodeTokensSecret" -}}
{{ .Values.auth.nodeTokensSecret | default (printf "%s-node-tokens" (include "pipecast.fullname" .)) }}
{{- end -}}

{{- define "pipecast.controlPlaneService" -}}
{{ include "pipecast.fullname" . }}-control-plane
{{- end -}}

{{/* The domain of the control plane replicas' names, <replica>.<this>: what a TLS certificate must name,
*.<this>. */}}
{{- define "pipecast.controlPlaneDomain" -}}
{{ include "pipecast.controlPlaneService" . }}.{{ .Release.Namespace }}.svc
{{- end -}}

{{/* The control plane as its clients name it: every replica's stable address, comma-separated (a call
follows the leader a standby names, else goes on to the next replica). */}}
{{- define "pipecast.controlPlaneAddress" -}}
{{- $service := include "pipecast.controlPlaneService" . -}}
{{- $domain := include "pipecast.controlPlaneDomain" . -}}
{{- $addresses := list -}}
{{- range $i := until (int .Values.controlPlane.replicas) -}}
{{- $addresses = append $addresses (printf "%s-%d.%s:%d" $service $i $domain (int $.Values.controlPlane.port)) -}}
{{- end -}}
{{ join "," $addresses }}
{{- end -}}

{{/* What every pod spec of the chart holds. */}}
{{- define "pipecast.podSpec" -}}
# No process of pipecast calls the Kubernetes API.
automountServiceAccountToken: false
# No Docker-link variables: named after the namespace's Services, under a release named pipecast they
# are read as settings (PIPECAST_ROUTER_METRICS_PORT=tcp://..., not the int router_metrics_port).
enableServiceLinks: false
# Every pod runs as the image's user; the agent's and the serving worker's must be the same.
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile: {type: RuntimeDefault}
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pipecast.securityContext" -}}
allowPrivilegeEscalation: false
capabilities: {drop: [ALL]}
{{- end -}}

{{/* A token from the operator Secret: (list $ "master-token"). */}}
{{- define "pipecast.tokenEnv" -}}
- name: PIPECAST_AUTH_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "pipecast.operatorSecret" (index . 0) }}, key: {{ index . 1 }}}
{{- end -}}

{{/* The control plane's address and, with TLS, the certificate files: for every process that calls it. */}}
{{- define "pipecast.clientEnv" -}}
- name: PIPECAST_CONTROL_PLANE
  value: {{ include "pipecast.controlPlaneAddress" . | quote }}
{{- with include "pipecast.tlsEnv" . }}
{{ . }}
{{- end }}
{{- end -}}

{{- define "pipecast.tlsEnv" -}}
{{- if .Values.tls.enabled -}}
- {name: PIPECAST_TLS_CERT, value: /etc/pipecast/tls/tls.crt}
- {name: PIPECAST_TLS_KEY, value: /etc/pipecast/tls/tls.key}
- {name: PIPECAST_TLS_CA, value: /etc/pipecast/tls/ca.crt}
{{- end -}}
{{- end -}}

{{- define "pipecast.tlsMount" -}}
{{- if .Values.tls.enabled -}}
- {name: tls, mountPath: /etc/pipecast/tls, readOnly: true}
{{- end -}}
{{- end -}}

{{- define "pipecast.tlsVolume" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  secret: {secretName: {{ required "tls.enabled needs tls.existingSecret (keys tls.crt, tls.key, ca.crt)" .Values.tls.existingSecret }}}
{{- end -}}
{{- end -}}

{{/* "true" where the cluster serves the prometheus-operator's ServiceMonitor API (`helm template`: with
--api-versions monitoring.coreos.com/v1), else "". */}}
{{- define "pipecast.serviceMonitorApi" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end -}}
{{- end -}}

{{/* The data transport of every agent and the store (--transport): one for all, since each agent registers only
its own and the control plane offers a receiver only the store's; never `auto`, which takes UCX on a node with
an RDMA device or a GPU and TCP elsewhere (the store's pod), so no receiver would share the store's. Under TLS
TCP, the only one that encrypts. */}}
{{- define "pipecast.transport" -}}
{{- $transport := toString .Values.agent.transport -}}
{{- if not (has $transport (list "tcp" "ucx")) -}}
{{- fail (printf "agent.transport is %q: set tcp or ucx, the one transport of every agent and the store (auto takes UCX on nodes with an RDMA device or a GPU and TCP elsewhere, and agents on different transports exchange no blocks)" $transport) -}}
{{- end -}}
{{- if and .Values.tls.enabled (ne $transport "tcp") -}}
{{- fail (printf "agent.transport is %q with tls.enabled: TLS needs tcp, the transport that runs the data plane's mutual TLS (UCX does not encrypt)" $transport) -}}
{{- end -}}
{{ $transport }}
{{- end -}}

{{/* The node tokens as files "<node id>.toml" (PIPECAST_CONFIG names a process's own). Agents read them from
the Secret, where every agent pod could read every node's token, or from a folder of the host that holds its
node's token only (auth.nodeTokensHostPath); the store reads its own key of the Secret. Call with
(list $ "agent") or (list $ "store"). */}}
{{- define "pipecast.nodeTokenVolume" -}}
{{- $ := index . 0 -}}
- name: node-tokens
{{- if and (eq (index . 1) "agent") $.Values.auth.nodeTokensHostPath }}
  hostPath: {path: {{ $.Values.auth.nodeTokensHostPath | quote }}, type: Directory}
{{- else }}
  secret:
    secretName: {{ include "pipecast.nodeTokensSecret" $ }}
    # Root's and the pod's group's (fsGroup) to read, no one else's: a token file others may read is warned of.
    defaultMode: 0440
    {{- if eq (index . 1) "store" }}
    {{- $file := printf "%s.toml" (toString $.Values.store.nodeId) }}
    items: [{key: {{ $file | quote }}, path: {{ $file | quote }}}]
    {{- end }}
{{- end }}
{{- end -}}

{{/* An agent's probe: its local API answers a status request (agents have no HTTP endpoint). */}}
{{- define "pipecast.agentProbe" -}}
exec:
  command:
    - python
    - -c
    - |
      import json, socket, sys
      with socket.socket(socket.AF_UNIX) as agent:
          agent.settimeout(5)
          agent.connect("/run/pipecast/agent.sock")
          agent.sendall(b'{"op": "status"}\n')
          sys.exit(0 if json.loads(agent.makefile().readline())["ok"] else 1)
periodSeconds: 10
timeoutSeconds: 5
{{- end -}}

{{/* The agent's startup probe: its local socket opens only once a --seed is verified (every block re-hashed,
about a minute for 16 GB, longer on slow disks), and the liveness probe alone (3 misses, 10 s apart) would
kill it in a loop: up to an hour before liveness takes over. */}}
{{- define "pipecast.agentStartupProbe" -}}
{{ include "pipecast.agentProbe" . }}
failureThreshold: 360
{{- end -}}

{{/* The control plane's probe: its gRPC health service answers (no token needed), SERVING from the leader,
NOT_SERVING from a standby: both are alive, and ready to point callers at the leader (a standby never Ready
would stall every rolling update). kubelet's own gRPC probe fails on NOT_SERVING and speaks plaintext only,
so the check runs in the container; under TLS with the replica's own certificate (mTLS) and the name that
certificate holds for it. */}}
{{- define "pipecast.controlPlaneProbe" -}}
exec:
  command:
    - python
    - -c
    - |
      import os, grpc
      from grpc_health.v1 import health_pb2, health_pb2_grpc
      address = os.environ["POD_IP"] + ":{{ .Values.controlPlane.port }}"
      {{- if .Values.tls.enabled }}
      def read(variable):
          with open(os.environ[variable], "rb") as f:
              return f.read()
      credentials = grpc.ssl_channel_credentials(read("PIPECAST_TLS_CA"), read("PIPECAST_TLS_KEY"), read("PIPECAST_TLS_CERT"))
      name = os.environ["POD_NAME"] + ".{{ include "pipecast.controlPlaneDomain" . }}"
      channel = grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", name)])
      {{- else }}
      channel = grpc.insecure_channel(address)
      {{- end }}
      with channel:
          health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
periodSeconds: 10
timeoutSeconds: 10
{{- end -}}

{{/* The dotted names of a map's leaves, comma-separated: what `--set` split at the dots into nested maps. Call
with (list "ip-10-0-0-1" (dict "ec2" (dict "internal" "t"))): ip-10-0-0-1.ec2.internal. */}}
{{- define "pipecast.dottedKeys" -}}
{{- $value := index . 1 -}}
{{- if kindIs "map" $value -}}
{{- $names := list -}}
{{- range $key, $inner := $value -}}
{{- $names = append $names (include "pipecast.dottedKeys" (list (printf "%s.%s" (index $ 0) $key) $inner)) -}}
{{- end -}}
{{ join ", " $names }}
{{- else -}}
{{ index . 0 }}
{{- end -}}
{{- end -}}
