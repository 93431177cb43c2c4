"""Cross-node pipelines against real processes: control plane, store, two warm sources, two agents each
with a serving worker, and a router learning workers and pipelines from the control plane, on loopback.

The sources send the package in rotated orders (each its egress rate-limited, so a block takes seconds):
w1 gets blocks 0, 1, 2, 3 and w2 gets 2, 3, 0, 1. Halfway, together they hold every layer: the router
sends requests through the pipeline w1 -> w2 before either holds the model; a stage killed mid-request
fails it to the router, which serves it elsewhere; once both hold the model the pipeline dissolves. The
workers take requests and stage calls only with the cluster's serving key (the router's and each other's).
"""

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import pytest

import pipecast
from pipecast.core.credentials import data_plane_key, serving_headers, serving_key
from pipecast.router.discovery import pipeline_key
from pipecast.v1.manifest_pb2 import Manifest
from control_plane.client import ControlPlaneClient
from tests.integration.test_cluster import TOKEN, Cluster
from tests.support.agent_processes import free_ports
from tests.support.packages import tiny_package

pytestmark = pytest.mark.timeout(300)
WORKERS = ("w1", "w2")
SOURCES = ("s1", "s2")
SOURCE_MBIT = "8"  # 1 MB/s each: a 4 MB block takes about 4 s
PROMPT = [5, 6, 7, 8, 9]
WAIT_S = 90.0
#: What the cluster's own components present to read the router's view of the pool.
KEYED = serving_headers(serving_key(data_plane_key(TOKEN)))


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> tuple[Path, Manifest]:
    """4 blocks of one 4 MB layer (hidden 256, MLP 1024, fp32) with a byte-level tokenizer."""
    root = tmp_path_factory.mktemp("pipelines") / "pkg"
    return root, tiny_package(root, seed=9, layers=4, tokenizer=True, hidden_size=256,
                              intermediate_size=1024).manifest


@pytest.fixture(scope="module")
def reference(package):
    with pipecast.load(package[0]) as model:
        yield lambda n: model.generate(PROMPT, max_new_tokens=n, timeout=30)


class PipelineCluster(Cluster):
    def __init__(self, tmp: Path, root: Path, manifest: Manifest) -> None:
        super().__init__(tmp, root, manifest)
        ports = free_ports(len(WORKERS) * 2 + 1)
        self.agent_ports = dict(zip(WORKERS, ports))
        self.serve_urls = {w: f"http://127.0.0.1:{p}" for w, p in zip(WORKERS, ports[len(WORKERS):])}
        self.router_url = f"http://127.0.0.1:{ports[-1]}"

    def start(self) -> str:
        package_id = self.up(store_mbit=SOURCE_MBIT, agents=())  # the store is a holder (a source) too
        for source in SOURCES:  # warm: they hold the package from the start, registered as holders
            self.start_agent(source, "--listen", "127.0.0.1:0", "--seed", self.root,
                             env={"PIPECAST_EGRESS_MBIT": SOURCE_MBIT})
        for w in WORKERS:
            self.start_agent(w, "--listen", f"127.0.0.1:{self.agent_ports[w]}", "--local-socket",
                             self.tmp / f"{w}.sock", "--serve-url", self.serve_urls[w])
            port = self.serve_urls[w].rsplit(":", 1)[1]
            self._start(f"{w}-serve", "serve", package_id, "--agent-socket", self.tmp / f"{w}.sock", "--port", port,
                        "--agent-timeout", "600", env={"OMP_NUM_THREADS": "1"})
        self._start("router", "router", "--port", self.router_url.rsplit(":", 1)[1], "--control-plane",
                    self.cp_address, "--health-interval", "0.1", "--discovery-interval", "0.2", env={})
        self.wait_for(lambda: self.alive() >= {*SOURCES, *WORKERS}, "every agent to register")
        self.wait_for(lambda: asyncio.run(self.served(self.serve_urls.values())) == 2,
                      "both workers to answer their health")
        # The router starts last and nothing else waits for it: a request sent before it listens is refused.
        self.wait_for(lambda: asyncio.run(self.served([self.router_url])) == 1, "the router to answer its health")
        return package_id

    @staticmethod
    async def served(urls) -> int:
        """How many of ``urls`` answer ``GET /health`` with 200."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            count = 0
            for url in urls:
                try:
                    async with http.get(f"{url}/health") as answer:
                        count += answer.status == 200
                except aiohttp.ClientError:
                    pass
            return count

    async def held(self, package_id: str) -> dict[str, int]:
        async with ControlPlaneClient(self.cp_address, token=TOKEN) as client:
            view = await client.availability(package_id)
        return {node: len(blocks) for node, blocks in view.by_worker.items()}

    async def pipelines(self) -> list:
        async with ControlPlaneClient(self.cp_address, token=TOKEN) as client:
            return await client.list_pipelines()


@pytest.fixture
def cluster(tmp_path, package):
    running = PipelineCluster(tmp_path, *package)
    yield running
    running.processes.stop(last=["cp"])


async def complete(http: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[int, str, list[int]]:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    async with http.post(f"{url}/v1/completions", json=body, headers=KEYED) as answer:  # it names its workers
        data = await answer.json()
        tokens = data["choices"][0]["token_ids"] if answer.status == 200 else data
        return answer.status, answer.headers.get("x-pipecast-worker", ""), tokens


def test_pipelines_serve_before_any_worker_holds_the_model_survive_a_killed_stage_and_dissolve(
        cluster, package, reference):
    package_id = cluster.start()
    blocks = len(package[1].blocks)
    plan = cluster.cp("scale-up", package_id, "--worker", "w1", "--worker", "w2")
    assert plan["strategy"] == "rotated" and set(plan["sources"]) >= set(SOURCES)

    async def scenario():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
            # 1. the first request, sent at the scale-up, is answered by the pipeline w1 -> w2
            status, served_by, tokens = await complete(http, cluster.router_url, 8)
            held = await cluster.held(package_id)
            assert status == 200 and served_by == pipeline_key(package_id, ["w1", "w2"]), (status, served_by, tokens)
            assert tokens == reference(8)
            assert all(held.get(w, 0) < blocks for w in WORKERS), held  # nobody holds the whole model yet
            # an outsider (without the serving key the workers learned from their agents) runs nothing
            for url, path in ((cluster.serve_urls["w1"], "/v1/completions"), (cluster.serve_urls["w2"], "/v1/stage")):
                async with http.post(f"{url}{path}", data=b"{}") as answer:
                    assert answer.status == 401, (path, await answer.text())
                    assert (await answer.json())["error"]["message"].endswith("Serving-Key header is missing")
            # nor reads the router's view of the pool (worker URLs and loads)
            async with http.get(f"{cluster.router_url}/v1/workers") as answer:
                assert answer.status == 401, await answer.text()

            # 2. the tail stage's worker dies mid-request: the request is served elsewhere, not lost
            long = asyncio.create_task(complete(http, cluster.router_url, 100))
            deadline = time.monotonic() + WAIT_S
            while True:
                async with http.get(f"{cluster.serve_urls['w2']}/health") as answer:
                    if (await answer.json())["pipeline_sessions"] > 0:
                        break
                assert not long.done() and time.monotonic() < deadline, "the request never reached w2's stage"
                await asyncio.sleep(0.005)
            cluster.procs["w2-serve"].send_signal(signal.SIGKILL)
            status, served_by, tokens = await long
            assert status == 200 and served_by == cluster.serve_urls["w1"], (status, served_by)
            assert tokens == reference(100)

            # 3. once the workers hold the model the pipeline dissolves: the router routes to none
            async def pipelines() -> list:
                async with http.get(f"{cluster.router_url}/v1/workers", headers=KEYED) as answer:
                    return (await answer.json())["pipelines"]
            while (await cluster.held(package_id)).get("w2", 0) < blocks or await pipelines():
                assert time.monotonic() < deadline, (await cluster.held(package_id), await pipelines())
                await asyncio.sleep(0.2)
            assert await cluster.pipelines() == []

    asyncio.run(scenario())
    log = cluster.log("router")
    key = pipeline_key(package_id, ["w1", "w2"])
    assert f"pipeline {key} added" in log and f"pipeline {key} dissolved" in log
    assert "retrying on another worker" in log and "pipeline stage" in cluster.log("w1-serve")
