"""The Helm chart (deploy/helm/pipecast), rendered by a real helm for each setup's values file: `helm lint`
passes, every manifest is valid for every Kubernetes version the chart supports (kubernetes-validate, strict:
no unknown field), and the rules of a pipecast pod hold (probes, resources, no RBAC, secrets only through
Secrets, the agent and its serving worker sharing what the zero-copy path needs, TLS for every client).
tests/integration/test_chart.py runs the rendered commands."""

import json
import re
import tempfile
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions
from packaging.version import Version

from tests.support.helm import (CHART, NAMESPACE, SETUPS, HelmError, containers, helm, lint, pod_spec, render,
                                 value_args, workload)

# What an operator passes at install time (README), with tokens no template could produce by itself.
MASTER, ROUTER, NODE_TOKEN, STORE_TOKEN = "master-3f9c", "router-77ab", "node-c0d1", "store-e5f6"
INSTALL = {"auth": {"masterToken": MASTER, "routerToken": ROUTER,
                    "nodeTokens": {"gpu-1": NODE_TOKEN, "store": STORE_TOKEN}},
           "serve": {"package": "9d3c1f"}, "store": {"seed": "smollm2"}}
# Each values file alone, HA with mTLS, and every option off by default switched on over the defaults.
CASES = {name: ((name,), {}) for name in SETUPS}
CASES["ha+mtls"] = (("values-ha.yaml", "values-mtls.yaml"), {})
CASES["everything"] = ((), {"store": {"enabled": True, "packagesClaim": "packages"},
                            "serviceMonitor": {"enabled": True},
                            "auth": {"nodeTokensHostPath": "/etc/pipecast/node-tokens"},
                            "router": {"apiKeysSecret": "pipecast-api-keys"}, "agent": {"labels": {"rack": "r1"}},
                            "serve": {"servedModelName": "smollm2-chat"}})
SECRET_ENV = ("PIPECAST_AUTH_TOKEN", "PIPECAST_CONTROL_DB", "PIPECAST_ROUTER_API_KEYS")
# What the API server parses a quantity with (k8s.io/apimachinery/pkg/api/resource): "1GiB" is none.
QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
RBAC = {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
# What `helm template` needs to be told of a cluster with the prometheus-operator's CRDs (a ServiceMonitor's API).
MONITORING = ("--api-versions", "monitoring.coreos.com/v1")


def merged(*layers: dict) -> dict:
    """The values layers deep-merged, later ones winning."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def containers_named(manifests: list[dict], name: str) -> dict[str, dict]:
    """The containers of the workload ``name``, by their names."""
    return {c["name"]: c for m, c in containers(manifests) if m["metadata"]["name"] == name}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request) -> tuple[str, list[dict]]:
    """(case name, the manifests helm renders for it)."""
    files, values = CASES[request.param]
    return request.param, render(files, merged(INSTALL, values))


def supported_versions() -> list[str]:
    """Every Kubernetes version kubernetes-validate has schemas for, from the chart's kubeVersion floor on."""
    floor = Version(re.search(r"\d+\.\d+", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"])[0])
    return [v for v in all_versions() if Version(v) >= floor]


@pytest.mark.parametrize("name", sorted(CASES))
def test_helm_lint_passes(name):
    files, values = CASES[name]
    assert "0 chart(s) failed" in lint(files, merged(INSTALL, values))


def test_every_manifest_is_valid_for_every_supported_kubernetes_version(case):
    name, manifests = case
    versions = supported_versions()
    assert len(versions) >= 5, versions  # 1.27 to the newest kubernetes-validate knows
    problems, unchecked = [], set()
    for manifest in manifests:
        for version in versions:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unchecked.add(manifest["kind"])
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                problems.append(f"{version} {manifest['kind']}/{manifest['metadata']['name']}: {path}: {exc.message}")
    assert not problems, "\n".join(problems)
    assert unchecked <= {"ServiceMonitor"}, f"{name}: kinds without a Kubernetes schema: {unchecked}"


def test_every_container_has_probes_and_resources(case):
    _, manifests = case
    for manifest, container in containers(manifests, init=False):
        where = f"{manifest['metadata']['name']}/{container['name']}"
        assert container.get("livenessProbe") and container.get("readinessProbe"), where
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where
        assert "memory" in container["resources"]["limits"], where
    for manifest, container in containers(manifests):
        assert container["resources"]["limits"], f"{manifest['metadata']['name']}/{container['name']}"


def test_an_agent_verifying_a_large_seed_is_not_killed_by_its_liveness_probe(case):
    """Found in review: the agent opens its local socket (which its probes ask) only once its --seed is verified,
    about 64 s for 16 GB, and the liveness probe (3 misses, 10 s apart) killed the store in a loop. A startup probe
    asking the same gives it an hour first."""
    name, manifests = case
    agents = [(m, c) for m, c in containers(manifests, init=False) if c.get("args", [""])[0] == "agent"]
    assert {m["metadata"]["name"] for m, _ in agents} >= {"pipecast-agent"}
    if name in ("values-single-node.yaml", "everything"):
        assert "pipecast-store" in {m["metadata"]["name"] for m, _ in agents}
    for manifest, container in agents:
        where = f"{manifest['metadata']['name']}/{container['name']}"
        startup, liveness = container.get("startupProbe"), container["livenessProbe"]
        assert startup and startup["exec"] == liveness["exec"], where
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600, where


def test_pods_run_unprivileged_without_kubernetes_api_access(case):
    """No RBAC object: no process calls the Kubernetes API, so no pod gets a service account token. Every
    container runs as the image's user, without privilege escalation; the one exception is the init container
    that hands the agent's host cache folder to that user (with CHOWN alone)."""
    _, manifests = case
    assert not RBAC & {m["kind"] for m in manifests}
    for manifest in manifests:
        spec = pod_spec(manifest)
        if spec is not None:
            assert spec["automountServiceAccountToken"] is False, manifest["metadata"]["name"]
            assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001
    for manifest, container in containers(manifests):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        if container["name"] == "cache-owner":
            assert context["capabilities"]["add"] == ["CHOWN"] and container["command"][0] == "chown"
        else:
            assert "runAsUser" not in context and "add" not in context["capabilities"], container["name"]


def test_secrets_reach_processes_only_through_secrets(case):
    name, manifests = case
    plain = yaml.safe_dump([m for m in manifests if m["kind"] != "Secret"])
    for token in (MASTER, ROUTER, NODE_TOKEN, STORE_TOKEN):
        assert token not in plain, f"{name}: a token outside a Secret"
    for manifest, container in containers(manifests):
        for env in container.get("env", []):
            if env["name"] in SECRET_ENV:
                assert set(env) == {"name", "valueFrom"} and "secretKeyRef" in env["valueFrom"], env


def test_every_client_of_the_control_plane_names_every_replica_and_uses_tls_when_on(case):
    name, manifests = case
    statefulset = workload(manifests, "StatefulSet", "pipecast-control-plane")
    service = statefulset["spec"]["serviceName"]
    assert workload(manifests, "Service", service)["spec"]["clusterIP"] == "None"
    port = statefulset["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    replicas = [f"pipecast-control-plane-{i}.{service}.{NAMESPACE}.svc:{port}"
                for i in range(statefulset["spec"]["replicas"])]
    tls = "mtls" in name
    clients = [(m, c) for m, c in containers(manifests) if c.get("args", [""])[0] in ("agent", "router", "scaler")]
    assert len(clients) >= 3
    for manifest, container in clients:
        env = {e["name"]: e for e in container["env"]}
        assert env["PIPECAST_CONTROL_PLANE"]["value"].split(",") == replicas
        files = [env[f"PIPECAST_TLS_{part}"]["value"] for part in ("CERT", "KEY", "CA")
                 if f"PIPECAST_TLS_{part}" in env]
        assert len(files) == (3 if tls else 0), container["name"]
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod_spec(manifest).get("volumes", [])}
        for path in files:
            folder, _, key = path.rpartition("/")
            assert volumes[mounts[folder]]["secret"]["secretName"] == "pipecast-tls" and key in (
                "tls.crt", "tls.key", "ca.crt")


def test_the_serving_worker_shares_the_agents_socket_memory_and_cache(case):
    """The worker maps blocks zero-copy: by /proc/<agent pid>/fd (one process namespace, one user), from the
    agent's socket, and cached blocks by their path in the agent's disk cache."""
    _, manifests = case
    daemonset = workload(manifests, "DaemonSet", "pipecast-agent")
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["hostNetwork"] and spec["dnsPolicy"] == "ClusterFirstWithHostNet" and spec["shareProcessNamespace"]
    by_name = {c["name"]: c for c in spec["containers"]}
    agent, serve = by_name["agent"], by_name["serve"]

    def arg(container: dict, flag: str) -> str:
        [value] = [a.split("=", 1)[1] for a in container["args"] if a.startswith(f"--{flag}=")]
        return value

    def volume_at(container: dict, path: str) -> str:
        [name] = [m["name"] for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")
                  or path == m["mountPath"]]
        return name

    socket = arg(serve, "agent-socket")
    assert socket == arg(agent, "local-socket") and volume_at(serve, socket) == volume_at(agent, socket)
    cache = arg(agent, "cache-dir")
    assert volume_at(serve, cache) == volume_at(agent, cache)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "hostPath" in volumes[volume_at(agent, cache)]
    # Bounded (found in review: nothing ever left it, the node's disk filled).
    assert {e["name"]: e.get("value") for e in agent["env"]}["PIPECAST_AGENT_CACHE_MAX_BYTES"] == "200GiB"
    assert volumes[volume_at(agent, "/dev/shm")]["emptyDir"]["medium"] == "Memory"
    assert volume_at(serve, "/dev/shm") == volume_at(agent, "/dev/shm")
    assert arg(agent, "serve-url") == f"http://$(NODE_IP):{serve['ports'][0]['containerPort']}"
    # Found in review: nothing told the control plane which package the worker serves, and the scaling daemon
    # placed another deployment's package here (held, never served).
    assert arg(agent, "serve-package") == INSTALL["serve"]["package"] and INSTALL["serve"]["package"] in serve["args"]


def test_the_serving_worker_is_told_where_the_agents_disk_cache_is():
    """Found in review: the agent's disk cache was mounted into the serve container, "read by the worker itself when
    the agent does not answer", but the worker looks for a cached copy in its setting agent_cache_dir, which nothing
    set: the mount did nothing. PIPECAST_AGENT_CACHE_DIR names the mount (the agent's --cache-dir); without a cache
    there is neither."""
    pod = containers_named(render((), INSTALL), "pipecast-agent")
    serve = pod["serve"]
    cache = {e["name"]: e.get("value") for e in serve["env"]}["PIPECAST_AGENT_CACHE_DIR"]
    assert cache == "/var/cache/pipecast" and f"--cache-dir={cache}" in pod["agent"]["args"]
    assert [m for m in serve["volumeMounts"] if m["mountPath"] == cache and m["name"] == "cache"]
    pod = containers_named(render((), merged(INSTALL, {"agent": {"cacheHostPath": ""}})), "pipecast-agent")
    serve = pod["serve"]
    assert "PIPECAST_AGENT_CACHE_DIR" not in {e["name"] for e in serve["env"]}
    assert not [m for m in serve["volumeMounts"] if m["name"] == "cache"]


def test_every_router_is_listed_by_a_headless_service_for_the_scaler(case):
    """Review E, finding 4: with two routers, a poll of the router Service reaches one of them (each keeps its
    own queue and counts); the scaler polls every address of the headless Service's name."""
    _, manifests = case
    services = {m["metadata"]["name"]: m["spec"] for m in manifests if m["kind"] == "Service"}
    front, headless = services["pipecast-router"], services["pipecast-router-headless"]
    assert headless["clusterIP"] == "None" and "type" not in headless
    assert headless["selector"] == front["selector"] and headless["ports"] == front["ports"]
    router = workload(manifests, "Deployment", "pipecast-router")
    assert headless["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()


def test_a_terminating_router_accepts_connections_until_its_service_forgets_it_then_drains(case):
    """Found in review: the router closed its listener at SIGTERM, while Kubernetes still sent it new connections
    (its endpoints are updated apart from the signal): refused on every rolling update or scale-down."""
    _, manifests = case
    pod = workload(manifests, "Deployment", "pipecast-router")["spec"]["template"]["spec"]
    (router,) = pod["containers"]
    assert router["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}
    drain = 30  # the router's --drain-timeout default
    assert pod["terminationGracePeriodSeconds"] >= 5 + drain + 5


def test_the_service_monitor_scrapes_every_metrics_endpoint():
    manifests = render((), merged(INSTALL, CASES["everything"][1]), *MONITORING)
    [monitor] = [m for m in manifests if m["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    wanted = monitor["spec"]["selector"]["matchLabels"]
    names = {e["port"] for e in monitor["spec"]["endpoints"]}
    scraped = {}
    for service in (m for m in manifests if m["kind"] == "Service"):
        if wanted.items() <= service["metadata"]["labels"].items():
            if ports := [p for p in service["spec"]["ports"] if p["name"] in names]:
                scraped[service["metadata"]["name"]] = {p["port"] for p in ports}
    # /metrics: the --metrics-port of the control plane and of the routers, the workers' HTTP port, the scaler's
    # port; never the routers' main Service, which may face clients (there /metrics needs the serving key).
    assert scraped == {"pipecast-control-plane": {9100}, "pipecast-router-metrics": {9103},
                       "pipecast-workers": {8000}, "pipecast-scaler": {9102}}
    [router] = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "pipecast-router"]
    [container] = router["spec"]["template"]["spec"]["containers"]
    assert "--metrics-port=9103" in container["args"]
    assert {"name": "metrics", "containerPort": 9103} in container["ports"]
    assert "ServiceMonitor" not in {m["kind"] for m in render((), INSTALL)}


def test_a_cluster_without_the_prometheus_operator_gets_no_service_monitor_and_is_told_so():
    """Found in review: values-ha.yaml turns serviceMonitor.enabled on, and on a cluster without the
    prometheus-operator's CRD the API server refused the ServiceMonitor: the whole install failed. The chart makes
    it only where the cluster serves monitoring.coreos.com/v1, and the install's notes say when it was left out."""
    def kinds(*extra: str) -> list[str]:
        return [m["kind"] for m in render(("values-ha.yaml",), INSTALL, *extra)]

    assert "ServiceMonitor" not in kinds() and "Service" in kinds()
    assert kinds(*MONITORING).count("ServiceMonitor") == 1
    with tempfile.TemporaryDirectory() as folder:
        out = helm("install", "pipecast", CHART, "--dry-run=client", "--namespace", NAMESPACE, "--output", "json",
                   *value_args(("values-ha.yaml",), INSTALL, Path(folder)))
    installed = json.loads(out)
    assert "ServiceMonitor" not in {d["kind"] for d in yaml.safe_load_all(installed["manifest"]) if d}
    assert ("serviceMonitor.enabled, but this cluster has no monitoring.coreos.com/v1 API"
            in installed["info"]["notes"])
    assert "ServiceMonitor" not in json.loads(helm("install", "pipecast", CHART, "--dry-run=client", "--output",
                                                   "json", "--set", "auth.masterToken=m,auth.routerToken=r",
                                                   "--set", "auth.nodeTokens.a=t,serve.package=p"))["info"]["notes"]


@pytest.mark.parametrize("files, values, message", [
    ((), {"auth": {"masterToken": ""}}, "set auth.masterToken or auth.existingSecret"),
    ((), {"auth": {"nodeTokens": None}}, "set auth.nodeTokens"),
    ((), {"serve": {"package": ""}}, "serve.enabled needs serve.package"),
    (("values-single-node.yaml",), {"store": {"seed": ""}}, "store.enabled needs store.seed"),
    ((), {"controlPlane": {"replicas": 3}}, "controlPlane.replicas > 1 needs controlPlane.database.existingSecret"),
    (("values-mtls.yaml",), {"tls": {"existingSecret": ""}}, "tls.enabled needs tls.existingSecret"),
    # Found in review: these rendered; the API server refused the pod or the claim.
    ((), {"agent": {"shmSize": "1GiB"}}, 'agent.shmSize is "1GiB": not a Kubernetes quantity'),
    ((), {"controlPlane": {"persistence": {"size": "2GiB"}}},
     'controlPlane.persistence.size is "2GiB": not a Kubernetes quantity'),
    # Found in review: these rendered; the agent was OOM-killed loading a package, or refused to start.
    ((), {"agent": {"memory": "32GiB"}}, "agent.memory (32GiB) must be below agent.resources.limits.memory (18Gi)"),
    ((), {"agent": {"memory": "18Gi"}}, "agent.memory (18Gi) must be below agent.resources.limits.memory (18Gi)"),
    ((), {"agent": {"reserve": "24GiB"}}, "agent.reserve (24GiB) must be at most agent.memory (16GiB)"),
    ((), {"agent": {"memory": "16 lots"}}, 'agent.memory is "16 lots": not a size'),
])
def test_incomplete_values_are_refused_with_what_to_set(files, values, message):
    with pytest.raises(HelmError, match=re.escape(message)):
        render(files, merged(INSTALL, values))


def test_the_single_node_agent_runs_on_a_node_without_gpu_labels():
    """Found in review: `nodeSelector: {}` in values-single-node.yaml was merged into the default's GPU label
    selector, so on a k3s box without GPU Feature Discovery no agent pod was scheduled."""
    def selector(files: tuple[str, ...]) -> dict | None:
        return pod_spec(workload(render(files, INSTALL), "DaemonSet", "pipecast-agent")).get("nodeSelector")

    assert selector(()) == {"nvidia.com/gpu.present": "true"}
    assert selector(("values-single-node.yaml",)) is None


def transports(files: tuple[str, ...], values: dict | None = None) -> dict[str, list[str]]:
    """The --transport arguments of every agent container (the agents' and the store's), by workload."""
    return {m["metadata"]["name"]: [a for a in c["args"] if a.startswith("--transport")]
            for m, c in containers(render(files, merged(INSTALL, values or {})), init=False) if c["args"][0] == "agent"}


def test_under_tls_every_agent_runs_the_encrypted_tcp_data_plane():
    """Found in review: with values-mtls.yaml agents took `auto`, UCX on GPU/RDMA nodes, which does not encrypt."""
    assert transports(("values-single-node.yaml", "values-mtls.yaml")) == {
        "pipecast-agent": ["--transport=tcp"], "pipecast-store": ["--transport=tcp"]}
    with pytest.raises(HelmError, match=re.escape('agent.transport is "ucx" with tls.enabled: TLS needs tcp')):
        render(("values-mtls.yaml",), merged(INSTALL, {"agent": {"transport": "ucx"}}))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_agent_and_the_store_run_one_named_transport(name):
    """Found in review: without TLS agents and the store took `auto`, which picks UCX where /sys/class/infiniband
    is not empty (GPU nodes, on the host network) and TCP in the store's pod: an agent registers one transport and
    the control plane offers a receiver only the store's, so no GPU node could receive (InsufficientWorkers on
    every scale-up). Every agent and the store get agent.transport, tcp by default; `auto` is refused."""
    files, values = CASES[name]
    found = transports(files, values)
    assert "pipecast-agent" in found and set(map(tuple, found.values())) == {("--transport=tcp",)}, found
    if "mtls" not in name:
        values = merged(values, {"agent": {"transport": "ucx"}})
        assert set(map(tuple, transports(files, values).values())) == {("--transport=ucx",)}
    with pytest.raises(HelmError, match=re.escape('agent.transport is "auto": set tcp or ucx, the one transport of '
                                                  'every agent and the store')):
        transports(files, merged(values, {"agent": {"transport": "auto"}}))


def test_values_with_yaml_syntax_reach_the_command_lines_as_written():
    """Found in review: the agent's --label and the worker's --served-model-name were written unquoted into the
    args, so a label `rack=r1: a` rendered as a map (the API server refuses the pod) and a served name
    `llama 3 #chat` lost `#chat` as a comment. Every value of an argument (and a host path) is quoted."""
    odd = {"agent": {"labels": {"rack": "r1: a", "zone": "eu #1", "tier": 2},
                     "cacheHostPath": "/var/cache/pipecast #a, b: c"},
           "serve": {"servedModelName": "llama 3 #chat", "device": "cuda:1"},
           "store": {"seed": "models: v1 #2"}, "auth": {"nodeTokensHostPath": "/etc/tok #1"}}
    manifests = render(("values-single-node.yaml",), merged(INSTALL, odd))
    pod = containers_named(manifests, "pipecast-agent")
    assert {"--label=rack=r1: a", "--label=zone=eu #1", "--label=tier=2"} <= set(pod["agent"]["args"])
    assert {"--served-model-name=llama 3 #chat", "--device=cuda:1"} <= set(pod["serve"]["args"])
    volumes = {v["name"]: v for v in pod_spec(workload(manifests, "DaemonSet", "pipecast-agent"))["volumes"]}
    assert volumes["cache"]["hostPath"]["path"] == "/var/cache/pipecast #a, b: c"
    assert volumes["node-tokens"]["hostPath"]["path"] == "/etc/tok #1"
    store = workload(manifests, "Deployment", "pipecast-store")
    [container] = pod_spec(store)["containers"]
    assert {"--seed=/packages/models: v1 #2", "--node-id=store"} <= set(container["args"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PIPECAST_CONFIG"] == "/etc/pipecast/node-tokens/store.toml"
    volumes = {v["name"]: v for v in pod_spec(store)["volumes"]}
    assert volumes["node-tokens"]["secret"]["items"] == [{"key": "store.toml", "path": "store.toml"}]
    for manifest in manifests:
        kubernetes_validate.validate(manifest, supported_versions()[-1], strict=True)


def test_agents_reading_their_token_from_the_host_need_no_node_token_secret():
    """Found in review: with auth.nodeTokensHostPath the chart still demanded auth.nodeTokens or
    auth.nodeTokensSecret, though without the store nothing mounts that Secret."""
    values = merged(INSTALL, {"auth": {"existingSecret": "o", "nodeTokensHostPath": "/etc/tok", "nodeTokens": None}})
    manifests = render((), values)
    assert not [m for m in manifests if m["kind"] == "Secret"]
    volumes = {v["name"]: v for v in pod_spec(workload(manifests, "DaemonSet", "pipecast-agent"))["volumes"]}
    assert volumes["node-tokens"] == {"name": "node-tokens", "hostPath": {"path": "/etc/tok", "type": "Directory"}}
    # The store reads its own token from the Secret still.
    with pytest.raises(HelmError, match=re.escape("set auth.nodeTokens (node id -> `pipecast cp issue-token NODE`) "
                                                  "or auth.nodeTokensSecret: the store, and agents without "
                                                  "auth.nodeTokensHostPath, read their token there")):
        render(("values-single-node.yaml",), values)


def test_gpu_nodes_run_the_cuda_build_of_the_image_by_default():
    """Found in review: the default image (the appVersion, the README's CPU build) went to GPU nodes with
    --device=cuda. Without image.tag, the agent pod, whose worker runs on cuda, takes the CUDA build the README
    tags `<appVersion>-cuda`; every other pod the CPU build."""
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    readme = (CHART.parents[2] / "README.md").read_text()
    assert re.search(rf"docker build -f deploy/docker/Dockerfile --build-arg TORCH_INDEX=\S+/cu\d+ "
                     rf"-t pipecast:{re.escape(version)}-cuda \.", readme)

    def images(values: dict) -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for manifest, container in containers(render((), merged(INSTALL, values))):
            found.setdefault(manifest["metadata"]["name"], set()).add(container["image"])
        return found

    def every(found: dict[str, set[str]]) -> set[str]:
        return set().union(*found.values())

    default = images({})
    assert default.pop("pipecast-agent") == {f"pipecast:{version}-cuda"}
    assert every(default) == {f"pipecast:{version}"}
    assert images({"serve": {"device": "cpu"}})["pipecast-agent"] == {f"pipecast:{version}"}
    assert every(images({"image": {"tag": "mine"}})) == {"pipecast:mine"}


def test_a_dotted_node_name_given_with_set_is_refused_naming_how_to_escape_it():
    """Found in review: `--set auth.nodeTokens.ip-10-0-0-1.ec2.internal=...` (a node name as EKS gives them) nests
    at the dots, and the chart wrote the token file ip-10-0-0-1.toml holding a map (no TOML) while that node's
    agent looked for ip-10-0-0-1.ec2.internal.toml: it never started. The chart refuses it, saying how to escape
    the dots; escaped, or from a values file, the node's file holds its token."""
    files = ("values-single-node.yaml",)
    with pytest.raises(HelmError, match=re.escape(
            "auth.nodeTokens.ip-10-0-0-1 is a map, not a token: --set splits a node name at its dots "
            "(ip-10-0-0-1.ec2.internal). Escape them (--set 'auth.nodeTokens.ip-10-0-0-1\\.ec2\\.internal=...') "
            "or set auth.nodeTokens in a values file")):
        render(files, INSTALL, "--set", "auth.nodeTokens.ip-10-0-0-1.ec2.internal=node-9a1b")
    with pytest.raises(HelmError, match=re.escape("auth.nodeTokens.gpu-2 is not a string")):
        render(files, INSTALL, "--set", "auth.nodeTokens.gpu-2=12345")
    escaped = render(files, INSTALL, "--set", r"auth.nodeTokens.ip-10-0-0-1\.ec2\.internal=node-9a1b")
    in_file = render(files, merged(INSTALL, {"auth": {"nodeTokens": {"ip-10-0-0-1.ec2.internal": "node-9a1b"}}}))
    for manifests in (escaped, in_file):
        files_of = workload(manifests, "Secret", "pipecast-node-tokens")["stringData"]
        assert {k: tomllib.loads(v) for k, v in files_of.items()} == {
            "gpu-1.toml": {"auth_token": NODE_TOKEN}, "store.toml": {"auth_token": STORE_TOKEN},
            "ip-10-0-0-1.ec2.internal.toml": {"auth_token": "node-9a1b"}}
    assert r"'auth.nodeTokens.ip-10-0-0-1\.ec2\.internal=...'" in (CHART / "values-single-node.yaml").read_text()


@pytest.mark.parametrize("release", ["team-inference-staging-eu-west", "pipecast-inference-staging-eu-west-1a-2",
                                     "a" * 53, "pipecast-" + "b" * 44])
def test_a_long_release_name_still_gets_control_plane_pods(release):
    """Found in review: fullname was cut to 40 characters, so the StatefulSet <fullname>-control-plane reached 54;
    above 52 its pods' controller-revision-hash label (<name>-<10-character hash>) passes 63 characters and the
    StatefulSet never makes a pod (kubernetes#64023). Up to helm's longest release name (53), every name fits,
    and the clients still name the StatefulSet's pods through its Service."""
    with tempfile.TemporaryDirectory() as folder:
        out = helm("template", release, CHART, "--namespace", NAMESPACE,
                   *value_args((), merged(INSTALL, CASES["everything"][1]), Path(folder)))
    manifests = [doc for doc in yaml.safe_load_all(out) if doc]
    [statefulset] = [m for m in manifests if m["kind"] == "StatefulSet"]
    name = statefulset["metadata"]["name"]
    assert len(f"{name}-5d8f7c9b6f") <= 63, name
    assert all(len(m["metadata"]["name"]) <= 63 for m in manifests)
    service = statefulset["spec"]["serviceName"]
    replica = f"{name}-0.{service}.{NAMESPACE}.svc:7000"
    for manifest, container in containers(manifests):
        if container.get("args", [""])[0] in ("agent", "router", "scaler"):
            assert {e["name"]: e.get("value") for e in container["env"]}["PIPECAST_CONTROL_PLANE"] == replica


def test_byte_counts_from_a_values_file_reach_the_processes_as_integers():
    """Found in review: helm reads a plain number of a values file as a float, and the agent got
    --memory=1.7179869184e+10 and PIPECAST_AGENT_CACHE_MAX_BYTES=2.147483648e+11, which it refuses. (render's
    values go through a file, as an operator's would.)"""
    sizes = {"agent": {"memory": 17179869184, "reserve": 2147483648, "cacheMaxBytes": 214748364800,
                       "shmSize": 1073741824},
             "controlPlane": {"persistence": {"size": 1073741824}}}
    manifests = render((), merged(INSTALL, sizes))
    daemonset = workload(manifests, "DaemonSet", "pipecast-agent")
    agent = {c["name"]: c for c in pod_spec(daemonset)["containers"]}["agent"]
    assert {"--memory=17179869184", "--reserve=2147483648"} <= set(agent["args"])
    assert {e["name"]: e.get("value") for e in agent["env"]}["PIPECAST_AGENT_CACHE_MAX_BYTES"] == "214748364800"
    volumes = {v["name"]: v for v in pod_spec(daemonset)["volumes"]}
    assert str(volumes["shm"]["emptyDir"]["sizeLimit"]) == "1073741824"
    [claim] = workload(manifests, "StatefulSet", "pipecast-control-plane")["spec"]["volumeClaimTemplates"]
    assert str(claim["spec"]["resources"]["requests"]["storage"]) == "1073741824"
    # Sizes in words stay as written.
    assert "--memory=16GiB" in containers_named(render((), INSTALL), "pipecast-agent")["agent"]["args"]


def test_the_values_say_the_chart_is_for_ipv4():
    """Found in review: on IPv6 the chart's addresses ($(NODE_IP):port, http://$(NODE_IP):port, the probe's
    POD_IP:port) lack brackets, which Kubernetes' $(VAR) expansion cannot add, and the servers listen on
    0.0.0.0. The values say so: IPv4, and dual-stack with IPv4 as the primary family."""
    text = (CHART / "values.yaml").read_text()
    assert "IPv4 only" in text and "IPv4 must be its primary family" in text


def test_the_docs_say_who_reads_a_host_token_file_and_when_a_new_node_needs_its_token():
    """Found in review: with auth.nodeTokensHostPath the token file must be readable by the containers' user (a
    hostPath gets no fsGroup), and a node added after the install (the cluster autoscaler's) needs its token issued
    and its file in the Secret or on the node before its agent starts; the README described install time only. The
    values and the README say both, and the uid they name is the one the pods run as."""
    uid = pod_spec(workload(render((), INSTALL), "DaemonSet", "pipecast-agent"))["securityContext"]["runAsUser"]
    text = (CHART.parents[2] / "README.md").read_text()
    [row] = [line for line in text.splitlines() if line.startswith("| `auth.nodeTokensHostPath` |")]
    assert f"readable by the containers' user, uid {uid}" in row
    readme = " ".join(text.split())
    assert ("A node added later (by the cluster autoscaler, say) starts its agent pod as soon as it joins" in readme
            and "issue its token and add its file to the Secret before the agent starts" in readme)
    values = " ".join(line.strip("# ") for line in (CHART / "values.yaml").read_text().splitlines())
    assert f"readable by the containers' user, uid {uid}" in values
    assert "A node added later (the cluster autoscaler's) needs its token issued" in values


def test_a_worker_on_the_cpu_asks_for_no_gpu():
    """Found in review: with serve.device=cpu the agent's pod still asked for nvidia.com/gpu: 1 and for a node
    labelled with a GPU, so it waited for a GPU it never used (or took one). Only the chart's GPU defaults go:
    other selectors stay; with any cuda device everything stays."""
    def agent_pod(values: dict) -> tuple[dict, dict]:
        spec = pod_spec(workload(render((), merged(INSTALL, values)), "DaemonSet", "pipecast-agent"))
        return spec, {c["name"]: c for c in spec["containers"]}["serve"]

    spec, serve = agent_pod({"serve": {"device": "cpu"}})
    assert "nvidia.com/gpu" not in serve["resources"]["limits"] and serve["resources"]["limits"]["memory"] == "16Gi"
    assert "nodeSelector" not in spec and "tolerations" not in spec
    spec, _ = agent_pod({"serve": {"device": "cpu"}, "agent": {"nodeSelector": {"pool": "cpu"}}})
    assert spec["nodeSelector"] == {"pool": "cpu"}
    for device in ("cuda", "cuda:1"):
        spec, serve = agent_pod({"serve": {"device": device}})
        assert serve["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_replicated_control_planes_and_routers_are_drained_one_at_a_time(case):
    """Without a disruption budget a node drain could evict every control-plane replica (anti-affinity is only
    preferred) or every router at once."""
    name, manifests = case
    budgets = {m["metadata"]["name"]: m["spec"] for m in manifests if m["kind"] == "PodDisruptionBudget"}
    replicated = {m["metadata"]["name"]: m for m in manifests if m["kind"] in ("StatefulSet", "Deployment")
                  and m["spec"].get("replicas", 1) > 1}
    assert budgets.keys() == replicated.keys(), name
    for workload_name, budget in budgets.items():
        assert budget["maxUnavailable"] == 1
        labels = replicated[workload_name]["spec"]["template"]["metadata"]["labels"]
        assert budget["selector"]["matchLabels"].items() <= labels.items()


def test_no_pod_gets_the_link_variables_of_the_namespaces_services(case):
    """Found in review: the kubelet gives every container Docker-link variables named after each Service of the
    namespace, upper-cased: under a release named pipecast, PIPECAST_ROUTER_PORT=tcp://... (warned as unknown
    settings) and, with values-ha.yaml's ServiceMonitor, PIPECAST_ROUTER_METRICS_PORT=tcp://10.96.0.11:9103, the
    setting router_metrics_port (an int): every process but the router refused its settings at start."""
    name, manifests = case
    specs = {m["metadata"]["name"]: pod_spec(m) for m in manifests if pod_spec(m) is not None}
    if name == "everything":
        assert specs.keys() == {f"pipecast-{c}" for c in ("agent", "control-plane", "router", "scaler", "store")}
    assert {n: spec.get("enableServiceLinks") for n, spec in specs.items()} == dict.fromkeys(specs, False), name


def test_every_size_kubernetes_reads_is_a_kubernetes_quantity(case):
    """Every resource, /dev/shm's sizeLimit and the claim's storage as the API server parses them (words such as
    "1GiB", which pipecast's own sizes take, are refused: see test_incomplete_values_are_refused_with_what_to_set)."""
    name, manifests = case
    found = [str(claim["spec"]["resources"]["requests"]["storage"])
             for m in manifests for claim in m.get("spec", {}).get("volumeClaimTemplates", [])]
    for manifest in manifests:
        spec = pod_spec(manifest) or {}
        found += [str(v["emptyDir"]["sizeLimit"]) for v in spec.get("volumes", [])
                  if "sizeLimit" in v.get("emptyDir", {})]
    for _, container in containers(manifests):
        found += [str(q) for part in container["resources"].values() for q in part.values()]
    assert len(found) > 10 and not [q for q in found if not QUANTITY.match(q)], (name, found)


def test_the_agent_registers_the_serving_workers_device():
    """Found in review: only the serving worker was told serve.device (--device); the agent, without
    PIPECAST_DEVICE, took the setting's default, cpu, and GPU nodes registered as CPU nodes."""
    for device in ("cuda", "cuda:1", "cpu"):
        manifests = render((), merged(INSTALL, {"serve": {"device": device}}))
        agent = containers_named(manifests, "pipecast-agent")["agent"]
        assert {e["name"]: e.get("value") for e in agent["env"]}["PIPECAST_DEVICE"] == device


def test_the_control_plane_name_a_certificate_must_hold_is_the_one_documented_and_printed():
    """Found in review: values-mtls.yaml said the certificate names *.<release>-control-plane.<namespace>.svc,
    but the Service is <fullname>-control-plane, <release>-pipecast for a release named prod: a certificate made
    as told failed every client's TLS check. What the values file says, what the install prints and what the
    clients and the probe dial agree."""
    release, namespace = "prod", "ml"
    with tempfile.TemporaryDirectory() as folder:
        out = helm("install", release, CHART, "--dry-run=client", "--namespace", namespace, "--output", "json",
                   *value_args(("values-mtls.yaml",), INSTALL, Path(folder)))
    installed = json.loads(out)
    manifests = [doc for doc in yaml.safe_load_all(installed["manifest"]) if doc]
    documented = "*.<fullname>-control-plane.<namespace>.svc"
    assert documented in (CHART / "values-mtls.yaml").read_text()
    wildcard = documented.replace("<fullname>", f"{release}-pipecast").replace("<namespace>", namespace)
    assert f"must name {wildcard}\n" in installed["info"]["notes"]
    domain = wildcard.removeprefix("*.")
    hosts = [address.rsplit(":", 1)[0] for _, c in containers(manifests) if c.get("args", [""])[0] != "serve"
             for e in c.get("env", []) if e["name"] == "PIPECAST_CONTROL_PLANE" for address in e["value"].split(",")]
    statefulset = workload(manifests, "StatefulSet", f"{release}-pipecast-control-plane")
    [control_plane] = pod_spec(statefulset)["containers"]
    hosts += [a.split("=", 1)[1].rsplit(":", 1)[0] for a in control_plane["args"] if a.startswith("--advertise=")]
    assert len(hosts) >= 4 and {host.split(".", 1)[1] for host in hosts} == {domain}, hosts
    assert f'+ ".{domain}"' in control_plane["livenessProbe"]["exec"]["command"][-1]
