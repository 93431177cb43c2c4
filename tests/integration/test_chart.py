"""The chart's rendered commands run: the containers helm renders for values-single-node.yaml, started as local
processes on loopback as a kubelet would start them (tests/support/local_pods.py: addresses, DNS names,
volumes, Secrets and $(VAR)s made local; nothing else changed), make a working cluster. The agent and the
store register, a deployment makes the scaling daemon scale up, the package reaches the node from the store,
the serving worker answers through the router, and every container's probes pass. Under mTLS
(values-mtls.yaml) the control plane's exec probe passes with the pod's own certificate."""

import asyncio
import json
import subprocess
import time

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.certs import have_openssl
from pipecast.core.credentials import issue_node_token
from tests.support.helm import NAMESPACE, render
from tests.support.local_pods import LocalPods
from tests.support.packages import tiny_package

pytestmark = pytest.mark.timeout(120)
MASTER = "chart-master-token"
NODE = "node-a"
WAIT_S = 60.0
LEASE_S = 4.0  # the control plane's (and its workers') lease in the HA test: a standby takes over within 5.3 s


def install_values(package_id: str) -> dict:
    """What an operator sets at install: the tokens (node tokens issued for the node and the store), the
    package id, the store's package folder; and the CPU for the worker."""
    return {"auth": {"masterToken": MASTER, "routerToken": issue_node_token(MASTER, "router"),
                     "nodeTokens": {n: issue_node_token(MASTER, n) for n in (NODE, "store")}},
            "serve": {"package": package_id, "device": "cpu"}, "store": {"seed": "tiny"}}


def wait_until(pods: LocalPods, check, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (result := check()):
        pods.check_running()
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{pods.logs()}"
        time.sleep(0.25)
    return result


@pytest.fixture
def pods(tmp_path):
    """The single-node setup's pods, running, with the tiny package in the store's volume."""
    package = tiny_package(tmp_path / "claim" / "tiny", seed=3, layers=4, tokenizer=True)
    manifests = render(("values-single-node.yaml",), install_values(package.manifest.package_id))
    running = LocalPods(manifests, tmp_path / "pods", claims={"pipecast-packages": tmp_path / "claim"}, node=NODE)
    running.start()
    yield running
    running.stop()


def in_scaler(pods: LocalPods, *args: str) -> str:
    """``kubectl exec deploy/pipecast-scaler -- pipecast ARGS`` (README: the operator's console): its output."""
    done = pods.exec("pipecast-scaler", "scaler", ["pipecast", *args])
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def alive(pods: LocalPods) -> dict[str, dict]:
    """The workers alive (`cp workers` rows), by node id; none while the control plane cannot answer."""
    done = pods.exec("pipecast-scaler", "scaler", ["pipecast", "cp", "--json", "workers"])
    workers = json.loads(done.stdout) if done.returncode == 0 else []
    return {w["worker"]["peer"]["node_id"]: w for w in workers if w.get("alive")}


def holds_whole(pods: LocalPods, package_id: str, node: str) -> bool:
    view = json.loads(in_scaler(pods, "cp", "--json", "availability", package_id))
    return len(view["by_worker"].get(node, [])) == view["num_blocks"]


async def complete(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as session:
        body = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        async with session.post(f"{url}/v1/completions", json=body) as answer:
            return answer.status, await answer.json()


def test_the_single_node_chart_runs_as_rendered(pods, tmp_path):
    workers = wait_until(pods, lambda: (w := alive(pods)).keys() >= {NODE, "store"} and w, "the registrations")
    assert workers[NODE]["worker"]["serve_url"] == f"http://{pods.node_address}:8000"  # the agent's --serve-url

    store = pods.pod("pipecast-store")
    published = in_scaler(pods, "cp", "--json", "publish", str(tmp_path / "claim" / "tiny"), "--store-node", "store",
                          "--store-address", f"{store.address}:7070")
    package_id = json.loads(published)["package_id"]
    router = pods.resolve(f"http://pipecast-router.{NAMESPACE}.svc:8080")
    in_scaler(pods, "cp", "deploy", package_id, "--min", "1", "--max", "1", "--router", router)

    def events():
        return [json.loads(line) for line in in_scaler(pods, "scaler", "events", "--json").splitlines()]

    # The daemon brings the one replica the policy asks for: the store multicasts the package to the node.
    wait_until(pods, lambda: any(e["action"] == "scale_up" for e in events()), "the scaler's scale-up")
    wait_until(pods, lambda: holds_whole(pods, package_id, NODE), "the node to hold the package")

    status, answer = asyncio.run(complete(router))
    assert status == 200 and answer["choices"][0]["text"], answer
    for pod in pods.pods.values():
        for container in pod.spec["containers"]:
            for kind in ("livenessProbe", "readinessProbe"):
                assert pods.probe(pod, container, kind), f"{pod.name}/{container['name']} {kind}\n{pods.logs()}"
    pods.check_running()


def make_certificate(folder) -> dict[str, str]:
    """A CA and a certificate it signed for every control plane replica's name, usable as server and client
    (README: what values-mtls.yaml needs), as the Secret's keys."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (folder / "san.ext").write_text(f"subjectAltName=DNS:*.pipecast-control-plane.{NAMESPACE}.svc\n")
    for args in (["req", "-x509", *key, "-days", "1", "-subj", "/CN=ca", "-keyout", "ca.key", "-out", "ca.crt"],
                 ["req", *key, "-subj", "/CN=pipecast", "-keyout", "tls.key", "-out", "tls.csr"],
                 ["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days",
                  "1", "-extfile", "san.ext", "-out", "tls.crt"]):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)
    return {name: (folder / name).read_text() for name in ("tls.crt", "tls.key", "ca.crt")}


@pytest.mark.skipif(not have_openssl(), reason="making certificates needs the openssl command")
def test_under_mtls_the_control_planes_probe_checks_health_with_the_pods_certificate(tmp_path):
    manifests = render(("values-mtls.yaml",), install_values("9d3c1f"))
    only = [m for m in manifests if m["kind"] == "Secret" or m["metadata"]["name"] == "pipecast-control-plane"]
    pods = LocalPods([*only, secret("pipecast-tls", make_certificate(tmp_path))], tmp_path / "pods", claims={})
    pod = pods.pod("pipecast-control-plane")
    probe = lambda: pods.probe(pod, pod.container("control-plane"), "livenessProbe")  # noqa: E731
    assert not probe()  # nothing listens yet
    pods.start()
    try:
        wait_until(pods, probe, "the control plane's probe to pass")
    finally:
        pods.stop()


def secret(name: str, data: dict[str, str]) -> dict:
    """A Secret as an operator makes it (`kubectl create secret generic NAME --from-literal=...`)."""
    return {"kind": "Secret", "metadata": {"name": name}, "stringData": data}


def serving(address: str) -> bool:
    """Whether the control plane at ``address`` leads (its health says SERVING; a standby's NOT_SERVING)."""
    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:  # not listening (yet, or any more)
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def test_the_ha_chart_runs_three_replicas_whose_clients_follow_the_leader(postgres_server, tmp_path):
    """values-ha.yaml with the Secrets it names made first: every replica is live and ready (the standbys
    too), one leads, the agent registers through the replicas' list, and when the leader is killed a standby
    leads and the agent is registered there."""
    values = {"serve": {"enabled": False}, "controlPlane": {"extraArgs": [f"--lease-s={LEASE_S:g}"]}}
    manifests = render(("values-ha.yaml",), values)
    made = [secret("pipecast-operator", {"master-token": MASTER, "router-token": issue_node_token(MASTER, "router")}),
            secret("pipecast-node-tokens", {f"{NODE}.toml": f'auth_token = "{issue_node_token(MASTER, NODE)}"\n'}),
            secret("pipecast-control-db", {"url": postgres_server.database()})]
    pods = LocalPods([*manifests, *made], tmp_path / "pods", claims={}, node=NODE)
    replicas = [p for p in pods.pods.values() if p.workload["kind"] == "StatefulSet"]
    assert len(replicas) == 3
    pods.start()
    try:
        wait_until(pods, lambda: NODE in alive(pods), "the agent to register")
        [leader] = [p for p in replicas if serving(f"{p.address}:7000")]
        for pod in replicas:
            for kind in ("livenessProbe", "readinessProbe"):
                assert pods.probe(pod, pod.container("control-plane"), kind), f"{pod.name} {kind}\n{pods.logs()}"

        pods.kill(leader, "control-plane")
        wait_until(pods, lambda: [p for p in replicas if p is not leader and serving(f"{p.address}:7000")],
                   "a standby to lead")
        # The new leader restored the agent's lease with 10 s of grace; one at most LEASE_S long is its renewal.
        wait_until(pods, lambda: alive(pods).get(NODE, {}).get("lease_remaining_s", LEASE_S + 1) <= LEASE_S,
                   "the agent to renew its lease at the new leader")
    finally:
        pods.stop()
