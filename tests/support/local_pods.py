"""The pods of a rendered chart run as local processes on loopback, as a kubelet would run them
(tests/integration/test_chart.py): :class:`LocalPods`.

What a cluster provides is made here. Each pod has an address of its own in 127.0.83.0/24 (a pod on the host
network has its node's); the cluster's DNS names of the chart's Services and StatefulSet replicas resolve to
those addresses, and a listen address of 0.0.0.0 is the pod's own (both replaced in the commands: there is no
DNS to ask). Every volume is a folder: a Secret's holds its keys as files, a hostPath is the node's, a claim is
the test's (``claims``), an emptyDir the pod's. The environment comes from values, Secrets and the pod's own
fields, and ``$(VAR)`` references expand as Kubernetes expands them. A container without a command runs the
image's entry point (deploy/docker/Dockerfile's ENTRYPOINT) from this virtual environment; the image's other
executables too (``python``). Init containers are not run: every folder is the test's already.
"""

import base64
import itertools
import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import dockerfile

from benchmarks.processes import stop_processes, tail
from tests.support import REPO
from tests.support.helm import NAMESPACE, pod_spec

NETWORK = "127.0.83."
ENTRYPOINT = next(c.value for c in dockerfile.parse_file(str(REPO / "deploy/docker/Dockerfile"))
                  if c.cmd == "ENTRYPOINT")
EXECUTABLES = {"pipecast": str(Path(sys.executable).parent / "pipecast"), "python": sys.executable}
REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass(frozen=True)
class Pod:
    """One replica of a workload: its name, its address and its node."""

    name: str
    workload: dict
    address: str
    node: str

    @property
    def spec(self) -> dict:
        return pod_spec(self.workload)

    def container(self, name: str) -> dict:
        [found] = [c for c in self.spec["containers"] if c["name"] == name]
        return found


def expand(text: str, variables: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables replaced, ``$$`` an escaped ``$``, others kept."""
    def one(match: re.Match) -> str:
        if match[0] == "$$":
            return "$"
        return variables.get(match[1], match[0])
    return REFERENCE.sub(one, text)


class LocalPods:
    """The pods of the workloads in ``manifests``: every replica of a StatefulSet, one of any other workload,
    all on the one node ``node``. Each container is a process started by :meth:`start`, its log in ``folder``;
    :meth:`stop` ends them all."""

    def __init__(self, manifests: list[dict], folder: Path, claims: dict[str, Path], node: str = "node-a") -> None:
        self.folder, self.claims = folder, claims
        self.secrets = {m["metadata"]["name"]: {**m.get("stringData", {}),
                                                **{k: base64.b64decode(v).decode()
                                                   for k, v in m.get("data", {}).items()}}
                        for m in manifests if m["kind"] == "Secret"}
        addresses = (f"{NETWORK}{i}" for i in itertools.count(1))
        self.node_address = node_address = next(addresses)
        self.pods: dict[str, Pod] = {}
        for workload in (m for m in manifests if pod_spec(m) is not None):
            name = workload["metadata"]["name"]
            # Every replica of a StatefulSet (each has a name of its own), one of any other workload.
            names = ([f"{name}-{i}" for i in range(workload["spec"]["replicas"])] if workload["kind"] == "StatefulSet"
                     else [name])
            for pod_name in names:
                address = node_address if pod_spec(workload).get("hostNetwork") else next(addresses)
                self.pods[pod_name] = Pod(pod_name, workload, address, node)
        self.hosts = self._dns(manifests)
        self.procs: dict[str, subprocess.Popen] = {}
        self._folders: dict[str, Path] = {}

    def _dns(self, manifests: list[dict]) -> dict[str, str]:
        """Every cluster DNS name of a Service (and of each StatefulSet replica behind one) -> its pod's address."""
        hosts = {}
        for service in (m for m in manifests if m["kind"] == "Service"):
            name, selector = service["metadata"]["name"], service["spec"]["selector"]
            pods = [p for p in self.pods.values()
                    if selector.items() <= p.workload["spec"]["template"]["metadata"]["labels"].items()]
            for suffix in ("", f".{NAMESPACE}", f".{NAMESPACE}.svc", f".{NAMESPACE}.svc.cluster.local"):
                hosts[name + suffix] = pods[0].address
                for pod in pods:
                    hosts[f"{pod.name}.{name}{suffix}"] = pod.address
        return hosts

    def pod(self, workload: str) -> Pod:
        """The pod of the workload named ``workload`` (its first replica)."""
        return next(p for p in self.pods.values() if p.workload["metadata"]["name"] == workload)

    # ----- what a container sees -----

    def _volume_folder(self, pod: Pod, volume: dict) -> Path:
        if "persistentVolumeClaim" in volume:
            return self.claims[volume["persistentVolumeClaim"]["claimName"]]
        key = (f"{pod.node}:{volume['hostPath']['path']}" if "hostPath" in volume else f"{pod.name}:{volume['name']}")
        if key not in self._folders:  # short names: a unix socket's path has at most 107 bytes
            folder = self._folders[key] = self.folder / f"v{len(self._folders)}"
            folder.mkdir(parents=True)
            if "secret" in volume:
                data = self.secrets[volume["secret"]["secretName"]]
                items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    (folder / item["path"]).write_text(data[item["key"]])
        return self._folders[key]

    def mounts(self, pod: Pod, container: dict) -> list[tuple[str, Path]]:
        """(mount path, local folder) of every volume ``container`` mounts, longest path first."""
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for template in pod.workload["spec"].get("volumeClaimTemplates", []):  # a replica's own claim
            volumes[template["metadata"]["name"]] = {"name": template["metadata"]["name"], "emptyDir": {}}
        found = [(m["mountPath"], self._volume_folder(pod, volumes[m["name"]]))
                 for m in container.get("volumeMounts", [])]
        return sorted(found, key=lambda mount: -len(mount[0]))

    def local(self, pod: Pod, container: dict, text: str) -> str:
        """``text`` (an argument, a value, a probe's code) as it must read here: mount paths, DNS names and the
        wildcard listen address replaced."""
        for path, folder in self.mounts(pod, container):
            text = re.sub(re.escape(path) + r"(?=[/\"']|$)", str(folder), text)
        return self.resolve(text).replace("0.0.0.0", pod.address)

    def resolve(self, text: str) -> str:
        """``text`` with the cluster's DNS names replaced by their addresses (what a client outside a pod uses)."""
        names = "|".join(map(re.escape, sorted(self.hosts, key=len, reverse=True)))
        return re.sub(rf"(?<![\w.-])({names})(?=[:/]|$)", lambda m: self.hosts[m[1]], text)

    def _field(self, pod: Pod, path: str) -> str:
        return {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "spec.nodeName": pod.node,
                "status.podIP": pod.address, "status.hostIP": self.node_address}[path]

    def environment(self, pod: Pod, container: dict) -> dict[str, str]:
        """The container's variables, in order, each expanded with those before it, then made local."""
        variables: dict[str, str] = {}
        for env in container.get("env", []):
            source = env.get("valueFrom", {})
            if "fieldRef" in source:
                value = self._field(pod, source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source:
                value = self.secrets[source["secretKeyRef"]["name"]][source["secretKeyRef"]["key"]]
            else:
                value = expand(env["value"], variables)
            variables[env["name"]] = value
        return {name: self.local(pod, container, value) for name, value in variables.items()}

    def argv(self, pod: Pod, container: dict, command: list[str] | None = None) -> list[str]:
        """The container's command and arguments (or ``command``, for an exec), expanded and made local."""
        variables = self.environment(pod, container)
        words = command if command is not None else [*(container.get("command") or ENTRYPOINT),
                                                     *container.get("args", [])]
        words = [self.local(pod, container, expand(w, variables)) for w in words]
        return [EXECUTABLES.get(words[0], words[0]), *words[1:]]

    def _env(self, pod: Pod, container: dict) -> dict[str, str]:
        # This machine's variables but pipecast's own (they would configure every process alike).
        base = {k: v for k, v in os.environ.items() if not k.startswith("PIPECAST_")}
        return {**base, "OMP_NUM_THREADS": "1", **self.environment(pod, container)}  # 2 cores for everything

    # ----- running -----

    def start(self) -> None:
        """Every container of every pod, all at once, as a kubelet starts them."""
        for pod in self.pods.values():
            for container in pod.spec["containers"]:
                name = f"{pod.name}.{container['name']}"
                folder = self.folder / name
                folder.mkdir(parents=True)
                with (self.folder / f"{name}.log").open("w") as log:
                    self.procs[name] = subprocess.Popen(self.argv(pod, container), env=self._env(pod, container),
                                                        cwd=folder, stdin=subprocess.DEVNULL, stdout=log,
                                                        stderr=subprocess.STDOUT, start_new_session=True)

    def exec(self, workload: str, container: str, command: list[str]) -> subprocess.CompletedProcess:
        """``kubectl exec`` of ``command`` in that container: its environment, its folders."""
        pod = self.pod(workload)
        spec = pod.container(container)
        return subprocess.run(self.argv(pod, spec, command), env=self._env(pod, spec), capture_output=True, text=True,
                              timeout=60)

    def check_running(self) -> None:
        """Fail, with its log, if any container exited."""
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{self.log(name)}"

    def log(self, name: str) -> str:
        return tail(self.folder / f"{name}.log")

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{self.log(name)}" for name in self.procs)

    def kill(self, pod: Pod, container: str) -> None:
        """SIGKILL one container's process, as a failing node would; nothing restarts it."""
        proc = self.procs.pop(f"{pod.name}.{container}")
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        stop_processes(list(self.procs.values()))

    # ----- probes -----

    def probe(self, pod: Pod, spec: dict, kind: str) -> bool:
        """Whether the ``kind`` probe (livenessProbe, readinessProbe) of the container ``spec`` passes now."""
        probe = spec[kind]
        timeout = probe.get("timeoutSeconds", 1)
        if "exec" in probe:
            try:
                done = subprocess.run(self.argv(pod, spec, probe["exec"]["command"]), env=self._env(pod, spec),
                                      capture_output=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            return done.returncode == 0
        handler = probe["httpGet"]  # the chart's other probes are exec
        port = handler["port"]
        if isinstance(port, str):  # a named port
            port = next(p["containerPort"] for p in spec["ports"] if p["name"] == port)
        try:
            with urllib.request.urlopen(f"http://{pod.address}:{port}{handler['path']}", timeout=timeout) as answer:
                return 200 <= answer.status < 400
        except OSError:
            return False
