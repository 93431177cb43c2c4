"""The scaling daemon against real processes: control plane, store, two agents each with a serving worker,
a router and ``pipecast scaler``, all on loopback.

One life of a deployment from zero: a deployment with bad values is refused; a burst at the router scales
the pool up with no manual call, never onto a third agent whose worker serves another package (the scaler
restarted right after its first decision goes on from the control plane's state); every request is answered;
with the router gone the scaler holds the pool (no release on missing data); back, idle replicas are released
after the keep-alive and their workers unload; a second burst cold-starts them again.
"""

import asyncio
import json
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
from click.testing import CliRunner

from control_plane.command import cp_group
from pipecast.scaler.command import scaler_group
from tests.integration.test_cluster import TOKEN, Cluster
from tests.support.agent_processes import free_ports
from tests.support.packages import tiny_package

pytestmark = pytest.mark.timeout(300)
WORKERS = ("w1", "w2")
#: An agent whose serving worker serves another package (`--serve-package`): first by name, it was where the
#: scale-ups went before placement knew a worker's package; no worker answers at its serve URL.
ELSEWHERE = "w0"
KEEP_ALIVE_S = 4.0
BURST = 12
WAIT_S = 90.0


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> tuple[Path, object]:
    root = tmp_path_factory.mktemp("scaler") / "pkg"
    return root, tiny_package(root, seed=3, layers=4, tokenizer=True).manifest


class ScaledCluster(Cluster):
    """The test cluster plus serving workers, a router and the scaler."""

    def __init__(self, tmp: Path, root: Path, manifest) -> None:
        super().__init__(tmp, root, manifest)
        ports = free_ports(len(WORKERS) * 2 + 2)
        self.agent_ports = dict(zip(WORKERS, ports))
        self.serve_urls = {w: f"http://127.0.0.1:{p}" for w, p in zip(WORKERS, ports[len(WORKERS):])}
        self.router_url = f"http://127.0.0.1:{ports[-2]}"
        self.elsewhere_url = f"http://127.0.0.1:{ports[-1]}"

    def start_workers(self) -> None:
        self.start_agent(ELSEWHERE, "--listen", "127.0.0.1:0", "--serve-url", self.elsewhere_url, "--serve-package",
                         "0" * 64)
        for w in WORKERS:
            self.start_agent(w, "--listen", f"127.0.0.1:{self.agent_ports[w]}", "--local-socket",
                             self.tmp / f"{w}.sock", "--serve-url", self.serve_urls[w], "--serve-package",
                             self.manifest.package_id)
            port = self.serve_urls[w].rsplit(":", 1)[1]
            self._start(f"{w}-serve", "serve", self.manifest.package_id, "--agent-socket", self.tmp / f"{w}.sock",
                        "--port", port, "--agent-timeout", "600", env={"OMP_NUM_THREADS": "1"})

    def start_router(self) -> None:
        self._start("router", "router", "--port", self.router_url.rsplit(":", 1)[1],
                    *(a for w in WORKERS for a in ("--worker", self.serve_urls[w])), "--health-interval", "0.2",
                    env={})

        async def answers() -> bool:
            async with aiohttp.ClientSession() as session:
                return bool(await health(session, self.router_url))
        # A request sent before the router listens is refused: nothing else here waits for it.
        self.wait_until(lambda: asyncio.run(answers()), "the router to answer its health")

    def start_scaler(self) -> subprocess.Popen:
        return self._start("scaler", "scaler", "run", "--control-plane", self.cp_address, "--tick", "0.5", env={})

    def events(self, name: str = "", kind: str | None = None) -> list[dict]:
        if name:
            return super().events(name, kind)
        return self.cp_json("scaler", "events")

    def cp_json(self, *args: str) -> list[dict]:
        """``pipecast ARGS --json`` (a command printing JSON lines) against this control plane."""
        result = CliRunner().invoke(scaler_group, [*args[1:], "--control-plane", self.cp_address, "--json"],
                                    env={"PIPECAST_AUTH_TOKEN": TOKEN})
        assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
        return [json.loads(line) for line in result.output.splitlines()]

    def wait_until(self, check, what: str, timeout_s: float = WAIT_S):
        deadline = time.monotonic() + timeout_s
        while not (result := check()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n" + "\n".join(
                f"--- {n}\n{self.log(n)[-3000:]}" for n in ("scaler", "router", "w1-serve", "w2-serve"))
            time.sleep(0.2)
        return result


async def health(session: aiohttp.ClientSession, url: str) -> dict:
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as answer:
            return await answer.json()
    except (aiohttp.ClientError, TimeoutError):
        return {}


async def burst(url: str, count: int) -> list[int]:
    """``count`` greedy completions at once through the router; their HTTP statuses."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as session:
        async def one(i: int) -> int:
            body = {"model": "tiny-llama", "prompt": [5 + i, 6, 7], "max_tokens": 2, "temperature": 0}
            async with session.post(f"{url}/v1/completions", json=body) as answer:
                await answer.read()
                return answer.status
        return await asyncio.gather(*(one(i) for i in range(count)))


def statuses(cluster: ScaledCluster) -> dict[str, dict]:
    async def go():
        async with aiohttp.ClientSession() as session:
            return {w: await health(session, cluster.serve_urls[w]) for w in WORKERS}
    return asyncio.run(go())


@pytest.fixture
def cluster(tmp_path, package):
    running = ScaledCluster(tmp_path, *package)
    yield running
    running.processes.stop(last=["cp"])


def test_a_deployment_scales_from_zero_on_a_burst_holds_without_signals_and_releases_when_idle(cluster):
    package_id = cluster.up(agents=())
    refused = CliRunner().invoke(cp_group, ["--control-plane", cluster.cp_address, "--token", TOKEN, "deploy",
                                            package_id, "--min", "3", "--max", "2"])
    assert "min_replicas (3) must be <= max_replicas (2)" in str(refused.exception), refused.output
    cluster.cp("deploy", package_id, "--max", "2", "--keep-alive", f"{KEEP_ALIVE_S}s", "--scale-down-cooldown", "2s",
               "--scale-up-cooldown", "2s", "--replica-concurrency", "4", "--router", cluster.router_url)
    cluster.start_workers()
    cluster.start_router()
    cluster.wait_until(lambda: all(s.get("stage") == "waiting_for_package" for s in statuses(cluster).values()),
                       "both workers to wait for the package")
    cluster.wait_until(lambda: cluster.alive() >= {"store", ELSEWHERE, *WORKERS}, "the agents to register")
    scaler = cluster.start_scaler()

    # A burst at the router: nothing serves, the queue grows, the scaler sees it and scales up.
    answers = asyncio.run(asyncio.wait_for(_burst_restarting_the_scaler(cluster, scaler), WAIT_S * 2))
    assert answers == [200] * BURST
    ups = [e for e in cluster.events() if e["action"] == "scale_up"]
    assert ups and ups[0]["count"] >= 1 and "queue" in ups[0]["reason"]
    assert sum(e["count"] for e in ups) <= 2  # the restarted scaler did not add what was on its way again

    # The router gone: no signals, the pool is held however long the replicas idle.
    cluster.procs["router"].terminate()
    assert cluster.procs["router"].wait(10) == 0, cluster.log("router")
    cluster.wait_until(lambda: any(e["reason"].startswith("no signals") for e in cluster.events()), "a hold")
    time.sleep(KEEP_ALIVE_S + 2)
    assert not [e for e in cluster.events() if e["action"] == "release"]
    assert all(s.get("status") in ("ready", "partial") for s in statuses(cluster).values() if s.get("model"))

    # Back: idle past the keep-alive, every replica is released and its worker unloads.
    cluster.start_router()
    cluster.wait_until(lambda: sum(e["count"] for e in cluster.events() if e["action"] == "release") == len(ups_nodes(
        cluster)), "the idle replicas to be released")
    cluster.wait_until(lambda: all(s.get("stage") == "waiting_for_package" for s in statuses(cluster).values()),
                       "the workers to unload the released package")
    assert all(cluster.events(w, "dropped") for w in ups_nodes(cluster))

    # A second burst cold-starts the pool again.
    assert asyncio.run(burst(cluster.router_url, 4)) == [200] * 4
    assert len([e for e in cluster.events() if e["action"] == "scale_up"]) >= len(ups) + 1
    assert not cluster.events(ELSEWHERE, "assignment")


def ups_nodes(cluster: ScaledCluster) -> set[str]:
    """The workers that held the package at some point (their agents were assigned it)."""
    return {w for w in WORKERS if cluster.events(w, "assignment")}


async def _burst_restarting_the_scaler(cluster: ScaledCluster, scaler: subprocess.Popen) -> list[int]:
    requests = asyncio.create_task(burst(cluster.router_url, BURST))
    deadline = time.monotonic() + WAIT_S
    while not [e for e in await asyncio.to_thread(cluster.events) if e["action"] == "scale_up"]:
        assert time.monotonic() < deadline, cluster.log("scaler")
        await asyncio.sleep(0.2)
    scaler.terminate()  # mid-surge: the replicas are on their way
    assert await asyncio.to_thread(scaler.wait, 10) == 0, cluster.log("scaler")
    cluster.start_scaler()
    return await requests
