"""Versions of a served model against real processes: control plane, two serving workers (one per package,
both serving the name ``chat``), a router that learns the route from the control plane, and ``pipecast
scaler`` running the canary gate, all on loopback.

The canary is a slower model (12 layers, one sequence at a time) than the stable one (1 layer): at 50% of
a burst's requests its p95 TTFT exceeds the stable version's by more than the gate's 50% margin, and the
scaler rolls it back on its own (recorded in the audit trail with the figures). Then by hand: a canary
again, promoted, and another rolled back, each followed by the router.
"""

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from click.testing import CliRunner

from pipecast.core.credentials import data_plane_key, serving_headers, serving_key
from pipecast.router.app import WORKER_HEADER
from pipecast.router.signals import TTFT_WINDOW_S
from pipecast.scaler.command import scaler_group
from tests.integration.test_cluster import TOKEN, Cluster
from tests.support.agent_processes import free_ports
from tests.support.packages import tiny_package

pytestmark = pytest.mark.timeout(400)
WAIT_S = 90.0
SHAPE = {"hidden_size": 128, "intermediate_size": 256}


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("canary")
    stable = tiny_package(root / "stable", seed=1, layers=1, tokenizer=True, **SHAPE)
    canary = tiny_package(root / "canary", seed=2, layers=12, tokenizer=True, **SHAPE)
    return stable, canary


class CanaryCluster(Cluster):
    """A control plane, two folder-fed serving workers, a router following the control plane, a scaler."""

    def __init__(self, tmp: Path, stable, canary) -> None:
        super().__init__(tmp, stable.path, stable.manifest)
        self.packages = {"stable": stable, "canary": canary}
        ports = free_ports(3)
        self.serve_urls = {name: f"http://127.0.0.1:{p}" for name, p in zip(self.packages, ports)}
        self.router_url = f"http://127.0.0.1:{ports[2]}"

    def start(self) -> None:
        self.start_control_plane()
        for name, package in self.packages.items():
            self.cp("publish", package.path, "--store-node", "store", "--store-address", self.store_address)
            batch = ("--max-batch", "1") if name == "canary" else ()
            self._start(f"{name}-serve", "serve", package.path, "--served-model-name", "chat", "--port",
                        self.serve_urls[name].rsplit(":", 1)[1], *batch, env={"OMP_NUM_THREADS": "1"})
        self._start("router", "router", "--port", self.router_url.rsplit(":", 1)[1], "--control-plane",
                    self.cp_address, *(a for url in self.serve_urls.values() for a in ("--worker", url)),
                    "--health-interval", "0.2", "--discovery-interval", "0.2", env={})

    def id(self, name: str) -> str:
        return self.packages[name].manifest.package_id

    def wait_until(self, check, what: str, wait_s: float = WAIT_S):
        deadline = time.monotonic() + wait_s
        while not (result := check()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n" + "\n".join(
                f"--- {n}\n{self.log(n)[-3000:]}" for n in ("scaler", "router", "canary-serve"))
            time.sleep(0.2)
        return result

    def routed(self) -> dict[str, int]:
        """Package id -> weight of ``chat`` as the router's /v1/models shows it now."""
        async def go():
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{self.router_url}/v1/models") as answer:
                    models = (await answer.json())["data"]
            return {v["package_id"]: v["weight"] for m in models if m["id"] == "chat" for v in m.get("versions", [])}
        try:
            return asyncio.run(go())
        except aiohttp.ClientError:
            return {}


def burst(url: str, count: int, at_once: int = 4) -> list[str]:
    """``count`` non-streaming greedy completions of ``chat`` through the router, ``at_once`` at a time; the
    worker that served each."""
    async def go() -> list[str]:
        keyed = serving_headers(serving_key(data_plane_key(TOKEN)))  # the router names its workers to its holders
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S), headers=keyed) as session:
            async def one(i: int) -> str:
                body = {"model": "chat", "prompt": [5 + i % 50, 6, 7], "max_tokens": 16, "temperature": 0}
                async with session.post(f"{url}/v1/completions", json=body) as answer:
                    assert answer.status == 200, await answer.text()
                    return answer.headers[WORKER_HEADER]
            served = []
            for start in range(0, count, at_once):
                served += await asyncio.gather(*(one(i) for i in range(start, min(count, start + at_once))))
            return served
    return asyncio.run(go())


def audit(cluster: CanaryCluster) -> list[dict]:
    """``pipecast scaler events --json``: the audit trail, route changes included."""
    result = CliRunner().invoke(scaler_group, ["events", "--control-plane", cluster.cp_address, "--json"],
                                env={"PIPECAST_AUTH_TOKEN": TOKEN})
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return [json.loads(line) for line in result.output.splitlines()]


@pytest.fixture
def cluster(tmp_path, packages):
    running = CanaryCluster(tmp_path, *packages)
    yield running
    running.processes.stop(last=["cp"])


def test_the_gate_rolls_a_slow_canary_back_and_promote_and_rollback_move_the_routers_traffic(cluster):
    cluster.start()
    stable, canary = cluster.id("stable"), cluster.id("canary")
    urls = cluster.serve_urls
    cluster.cp("route", "chat", stable)
    cluster.cp("canary", "chat", canary, "--weight", "50", "--gate", "--gate-min-requests", "8")
    cluster.wait_until(lambda: cluster.routed() == {stable: 50, canary: 50}, "the router to learn the route")
    cluster.wait_until(lambda: len(set(burst(cluster.router_url, 4))) == 2, "both versions to serve")
    # The gate reads the routers of the versions' deployments (the scaler's signals).
    for package in (stable, canary):
        cluster.cp("deploy", package, "--router", cluster.router_url, "--min", "0", "--max", "1")
    cluster._start("scaler", "scaler", "run", "--control-plane", cluster.cp_address, "--tick", "0.5", env={})

    def rolled_back() -> list | None:
        burst(cluster.router_url, 8)
        routes = cluster.try_cp("routes")
        return routes if routes and len(routes[0]["versions"]) == 1 else None

    # The gate judges TTFT once the canary was ready for a whole TTFT window (60 s): none of its cold start left.
    [route] = cluster.wait_until(rolled_back, "the gate to roll the canary back", wait_s=TTFT_WINDOW_S + WAIT_S)
    assert route["versions"] == [[stable, 100]]
    [event] = [e for e in audit(cluster) if e["action"] == "rollback"]
    assert event["package_id"] == canary and event["reason"].startswith("gate: canary p95 TTFT "), event
    cluster.wait_until(lambda: cluster.routed() == {stable: 100}, "the router to follow the rollback")
    assert set(burst(cluster.router_url, 8)) == {urls["stable"]}
    # By hand, with the gate off: a canary promoted, then another rolled back.
    cluster.cp("canary", "chat", canary, "--weight", "10", "--no-gate")
    cluster.cp("promote", "chat")
    cluster.wait_until(lambda: cluster.routed() == {canary: 100}, "the router to follow the promotion")
    assert set(burst(cluster.router_url, 4)) == {urls["canary"]}
    cluster.cp("canary", "chat", stable, "--weight", "50")
    cluster.wait_until(lambda: cluster.routed() == {canary: 50, stable: 50}, "the router to follow the canary")
    cluster.cp("rollback", "chat")
    cluster.wait_until(lambda: cluster.routed() == {canary: 100}, "the router to follow the second rollback")
    assert set(burst(cluster.router_url, 4)) == {urls["canary"]}
