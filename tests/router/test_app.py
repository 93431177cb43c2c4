"""The router over real sockets: real aiohttp servers on loopback, with small fake workers.

A fake worker speaks the serving worker's protocol (``GET /health``, ``POST /v1/completions`` with
JSON or Server-Sent Events, 429 when full) and can be told to stall, to die before answering or to die
mid-stream (its connection is aborted, as when the process is killed).
"""

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from click.testing import CliRunner

from control_plane.client import ControlPlaneClient
from control_plane.deployments import Deployment, ScalingPolicy
from control_plane.messages import PeerInfo
from control_plane.messages import WorkerSpec as RegisteredSpec
from control_plane.routes import RouteChange
from control_plane.server import ControlPlaneServer, ServerConfig
from packager.manifest import seal_manifest
from pipecast.core.credentials import SERVING_KEY_HEADER, data_plane_key, issue_node_token, serving_key
from pipecast.core.httpserve import RUNNER_OPTIONS
from pipecast.router.app import QUEUE_HEADER, WORKER_HEADER, Router, RouterConfig, build_app, build_metrics_app
from pipecast.router.command import router_command, static_serving_key
from pipecast.serve.app import error_response
from pipecast.serve.errors import ServeError, ServingKeyError, StageFailedError
from pipecast.serve.openai_api import error_body as worker_error_body, sse
from pipecast.router.discovery import (SERVE_URL_LABEL, ControlPlaneDiscovery, DiscoveredPipeline, DiscoveredWorker,
                                      StaticDiscovery, pipeline_key)
from pipecast.v1 import control_pb2 as pb
from tests.control_plane.test_service import STORE, manifest
from tests.core.test_httpserve import stalled_body_answer

pytestmark = pytest.mark.timeout(30)

FAILED_STAGE = "http://10.0.0.9:8000"  # the stage a fake pipeline head says failed
FAST = dict(health_interval_s=0.02, health_timeout_s=0.5, connect_timeout_s=1.0, upstream_timeout_s=5.0,
            discovery_interval_s=0.05)
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=10)
BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "stop": None}
#: What a serving worker's engine says when a request fails in it (pipecast.engine.batching).
ENGINE_FAILURE = "the engine failed while running this request: CUDA error: an illegal memory access"


@dataclass
class FakeWorker:
    """A serving worker's HTTP surface with scriptable health and behaviour."""

    status: str = "ready"
    queue_depth: int = 0
    health_code: int = 200
    #: "answer", "busy" (429), "invalid" (400), "die_before" (abort without answering),
    #: "die_mid_stream" (after 2 events; its /health then answers 503, as a dead worker's would fail),
    #: "endless_event" (a stream of bytes that never ends an event), "huge_answer" (8 MiB of JSON),
    #: "no_read" (takes a request's headers and never reads its body), "engine_error" (a stream ended after
    #: its tokens by the serving worker's error event, as when its engine fails), "no_done" (a stream that
    #: ends cleanly after its tokens without ``data: [DONE]``), "torn_end" (one that ends cleanly in the middle
    #: of an event after its tokens), "die_after_headers" (a stream's headers, then the connection aborted),
    #: "done_unterminated" (``data: [DONE]`` last, with no blank line after it), "open_after_done" (the whole
    #: stream, then the connection held open), "slow" (nothing until the gate is set, then the whole answer) or
    #: "engine_failed" (a 500, as a serving worker's whose engine fails the request) or "stage_failed" (a stream
    #: ended after its tokens by a pipeline head's error event naming :data:`FAILED_STAGE`)
    behaviour: str = "answer"
    #: Engine steps its /health reports (a serving worker's; None: none reported, as a vLLM worker's).
    steps: int | None = None
    tokens: int = 3
    #: When set, a stream pauses after its first event until the test sets it.
    gate: asyncio.Event | None = None
    bodies: list[bytes] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    url: str = ""
    model: str = ""  # named in its /health when set
    max_batch: int = 0  # its /health's
    package_id: str = "p" * 64  # named with the model
    finished: bool = False
    serving_key: bytes = b""  # required of requests when set, as a serving worker of a cluster does
    presented: list[str | None] = field(default_factory=list)  # each request's serving key header

    async def health(self, request: web.Request) -> web.Response:
        present = {"ready": 4, "partial": 3}.get(self.status, 1)  # a partial worker in its last block
        named = {"model": self.model, "package_id": self.package_id} if self.model else {}
        steps = {} if self.steps is None else {"steps": self.steps}
        return web.json_response({"status": self.status, "blocks_present": present,
                                  "blocks_total": 4, "queue_depth": self.queue_depth, "running": 0,
                                  "max_queue": 8, "max_batch": self.max_batch, **named, **steps},
                                 status=self.health_code)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        if self.behaviour == "no_read":
            self.paths.append(request.path)
            await asyncio.Event().wait()  # never reads the body: a stalled process
        body = await request.read()
        self.bodies.append(body)
        self.paths.append(request.path)
        self.presented.append(request.headers.get(SERVING_KEY_HEADER))
        if self.serving_key and self.presented[-1] != self.serving_key.hex():
            return error_response(ServingKeyError(self.presented[-1] is not None))
        if self.behaviour == "busy":
            # Its queue is full, as its next /health says: a poll after the 429 must not clear it (it did
            # with room reported, a race the test lost once in CI).
            self.queue_depth = 8
            return web.json_response({"error": {"message": "full"}}, status=429, headers={"Retry-After": "5"})
        if self.behaviour == "invalid":
            return web.json_response({"error": {"message": "max_tokens too large"}}, status=400)
        if self.behaviour == "engine_failed":  # every request fails in its engine: a sticky device fault
            return error_response(ServeError(ENGINE_FAILURE))
        if self.behaviour == "slow":
            await self.gate.wait()
        if self.behaviour == "die_before":
            if self.gate is not None:
                await self.gate.wait()
            request.transport.abort()
            return web.Response()
        if self.behaviour == "huge_answer":
            return web.json_response({"choices": [{"text": "t" * (8 << 20)}]})
        if self.behaviour == "die_after_headers":  # killed in its prefill
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await asyncio.sleep(0.05)
            request.transport.abort()
            return response
        if self.behaviour == "endless_event":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"text": "t0"}]}\n\n')
            for _ in range(64):  # 4 MiB without a blank line
                await response.write(b"data: " + b"x" * (64 << 10))
            return response
        payload = json.loads(body)
        if payload.get("stream") is not True:
            return web.json_response({"choices": [{"text": "t" * self.tokens}], "worker": self.url})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(self.tokens):
            if self.behaviour == "die_mid_stream" and index == 2:
                # Half an event, then the connection goes: as when the process is killed mid-write.
                await response.write(b'data: {"choices": [{"te')
                await asyncio.sleep(0.05)
                self.health_code = 503
                request.transport.abort()
                return response
            await response.write(b"data: " + json.dumps({"choices": [{"text": f"t{index}"}]}).encode() + b"\n\n")
            if index == 0 and self.gate is not None:
                await self.gate.wait()
        if self.behaviour == "engine_error":
            await response.write(sse(worker_error_body(ServeError(ENGINE_FAILURE))))
            return response
        if self.behaviour == "stage_failed":
            failed = StageFailedError(FAILED_STAGE, f"answered 500: {ENGINE_FAILURE}")
            await response.write(sse(worker_error_body(failed)))
            return response
        if self.behaviour == "torn_end":
            await response.write(b'data: {"choices": [{"te')
        elif self.behaviour == "done_unterminated":
            await response.write(b"data: [DONE]")
        elif self.behaviour != "no_done":
            await response.write(b"data: [DONE]\n\n")
        self.finished = True
        if self.behaviour == "open_after_done":
            await asyncio.Event().wait()
        return response


@asynccontextmanager
async def serving(app: web.Application, **runner_options) -> AsyncIterator[str]:
    """Serve ``app`` on a free loopback port (``runner_options`` go to aiohttp's ``AppRunner``); yield its base
    URL; clean up after."""
    runner = web.AppRunner(app, shutdown_timeout=0.25, **runner_options)  # a fake's stalled handler is cut after this
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def serving_router(instance: Router) -> AsyncIterator[str]:
    """:func:`serving` ``instance``'s app as the router command does (with :data:`RUNNER_OPTIONS`)."""
    async with serving(build_app(instance), **RUNNER_OPTIONS) as url:
        yield url


@asynccontextmanager
async def workers(*fakes: FakeWorker) -> AsyncIterator[list[FakeWorker]]:
    """Start every fake worker on its own port."""
    async with AsyncExitStack() as stack:
        for fake in fakes:
            app = web.Application(client_max_size=64 << 20)  # the worker's own limit is not under test
            app.add_routes([web.get("/health", fake.health), web.post("/v1/completions", fake.complete),
                            web.post("/v1/chat/completions", fake.complete)])
            fake.url = await stack.enter_async_context(serving(app))
        yield list(fakes)


@asynccontextmanager
async def router(urls: list[str], serving_key: bytes = b"", **config) -> AsyncIterator[tuple[str, Router]]:
    """A router over the workers at ``urls`` (fast polling), served on a free port."""
    instance = Router(RouterConfig(**(FAST | config)), [StaticDiscovery(urls, serving_key=serving_key)])
    async with serving_router(instance) as url:
        yield url, instance


async def eventually(condition, timeout_s: float = 5.0) -> None:
    """Wait until ``condition()`` holds (polled every 10 ms)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def post(client: aiohttp.ClientSession, url: str, **extra) -> tuple[int, Mapping[str, str], dict]:
    async with client.post(f"{url}/v1/completions", json=BODY | extra) as response:
        return response.status, response.headers.copy(), await response.json()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
        yield session


async def read_events(response: aiohttp.ClientResponse) -> list[str]:
    """Every ``data:`` payload of an event stream, to its end."""
    text = (await response.read()).decode()
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


async def test_a_request_queued_while_every_worker_loads_is_served_once_one_is_partial(client):
    async with workers(FakeWorker(status="loading"), FakeWorker(status="loading")) as (first, second):
        async with router([first.url, second.url]) as (url, instance):
            pending = asyncio.create_task(post(client, url))
            await eventually(lambda: instance.dispatcher.waiting == 1)
            await asyncio.sleep(0.1)  # several health polls: still nobody to serve
            assert not pending.done() and first.bodies == second.bodies == []
            second.status = "partial"
            status, headers, answer = await pending
            assert status == 200
            assert answer["worker"] == second.url == headers[WORKER_HEADER]
            assert float(headers[QUEUE_HEADER]) >= 0.1
            assert first.bodies == []


async def test_requests_go_only_to_workers_able_to_serve(client):
    dead = f"http://127.0.0.1:{free_port()}"
    async with workers(FakeWorker(status="loading"), FakeWorker(), FakeWorker(health_code=503)) as fakes:
        loading, ready, unhealthy = fakes
        async with router([loading.url, ready.url, unhealthy.url, dead]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            answers = await asyncio.gather(*(post(client, url) for _ in range(4)))
            assert [(status, headers[WORKER_HEADER]) for status, headers, _ in answers] == [(200, ready.url)] * 4
            assert len(ready.bodies) == 4 and loading.bodies == unhealthy.bodies == []
            async with client.get(f"{url}/v1/workers") as response:
                pool = {worker["url"]: worker for worker in (await response.json())["workers"]}
            assert {u: pool[u]["status"] for u in pool} == {loading.url: "loading", ready.url: "ready",
                                                           unhealthy.url: "down", dead: "down"}
            assert pool[unhealthy.url]["problem"] == f"worker {unhealthy.url}: /health answered HTTP 503"
            assert pool[dead]["problem"].startswith(f"worker {dead}: /health failed: ClientConnectorError")


async def test_a_chat_request_goes_to_the_workers_chat_endpoint_and_its_stream_is_relayed(client):
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], "stream": True}
    async with workers(FakeWorker()) as (worker,), router([worker.url]) as (url, instance):
        await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
        async with client.post(f"{url}/v1/chat/completions", json=chat) as response:
            assert response.status == 200 and await read_events(response) == [
                '{"choices": [{"text": "t0"}]}', '{"choices": [{"text": "t1"}]}', '{"choices": [{"text": "t2"}]}',
                "[DONE]"]
        assert worker.paths == ["/v1/chat/completions"] and json.loads(worker.bodies[0]) == chat
        async with client.get(f"{url}/stats") as response:
            assert (await response.json())["counters"]["prompt_tokens"] == 10  # 40 characters of messages


async def test_the_router_lists_the_models_its_workers_name_with_their_workers(client):
    async with workers(FakeWorker(model="chat"), FakeWorker(model="chat", status="loading"), FakeWorker()) as fakes, \
            router([f.url for f in fakes]) as (url, instance):
        await eventually(lambda: all(w.health is not None for w in instance.pool.workers()))
        async with client.get(f"{url}/v1/models") as response:
            listed = (await response.json())["data"]
        assert [(m["id"], m["root"], m["workers"]) for m in listed] == [
            ("chat", "p" * 64, sorted(f.url for f in fakes[:2]))]


async def test_the_request_body_reaches_the_worker_unchanged(client):
    raw = b'{"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "stream": false, "extra": {"x": 1}}'
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            async with client.post(f"{url}/v1/completions", data=raw,
                                   headers={"Content-Type": "application/json"}) as response:
                assert response.status == 200
    assert worker.bodies == [raw]


async def test_a_full_router_queue_answers_429_with_retry_after(client):
    async with workers(FakeWorker(status="loading")) as (worker,):
        async with router([worker.url], max_queue=1) as (url, instance):
            queued = asyncio.create_task(post(client, url))
            await eventually(lambda: instance.dispatcher.waiting == 1)
            status, headers, answer = await post(client, url)
            assert status == 429 and headers["Retry-After"] == "1"
            assert answer == {"error": {"message": "router queue is full (1 requests waiting); retry later",
                                        "type": "rate_limit_error", "param": None, "code": "queue_full"}}
            worker.status = "ready"
            assert (await queued)[0] == 200
            async with client.get(f"{url}/metrics") as response:
                metrics = await response.text()
            assert 'pipecast_router_requests_rejected_total{reason="queue_full"} 1.0' in metrics


async def test_a_request_nobody_can_take_gets_503_at_its_deadline(client):
    async with workers(FakeWorker(status="loading")) as (worker,):
        async with router([worker.url], queue_timeout_s=0.2) as (url, instance):
            status, _, answer = await post(client, url)
    assert status == 503
    assert answer == {"error": {"type": "server_error", "param": None, "code": "queue_timeout", "message": (
        "no worker could take the request within 0.2 s (1 workers known, 0 able to serve)")}}


async def test_streaming_relays_each_event_as_it_arrives(client):
    gate = asyncio.Event()
    async with workers(FakeWorker(gate=gate)) as (worker,):
        async with router([worker.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                assert response.status == 200
                assert response.headers[WORKER_HEADER] == worker.url
                assert response.content_type == "text/event-stream"
                first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), timeout=5)
                # The worker is still blocked after its first token: the router did not wait for the end.
                assert not worker.finished
                assert first == b'data: {"choices": [{"text": "t0"}]}\n\n'
                gate.set()
                rest = await read_events(response)
            assert rest == ['{"choices": [{"text": "t1"}]}', '{"choices": [{"text": "t2"}]}', "[DONE]"]
            async with client.get(f"{url}/metrics") as response:
                metrics = await response.text()
            assert "pipecast_router_ttft_seconds_count 1.0" in metrics
            assert 'pipecast_router_ttft_seconds_bucket{le="600.0"} 1.0' in metrics
            assert f'pipecast_router_requests_routed_total{{worker="{worker.url}"}} 1.0' in metrics
            # a whole answer's time counts too, as /stats counts it (the histogram left it out)
            assert (await post(client, url))[0] == 200
            async with client.get(f"{url}/metrics") as response:
                assert "pipecast_router_ttft_seconds_count 2.0" in await response.text()


async def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error_event(client):
    async with workers(FakeWorker(behaviour="die_mid_stream", tokens=5), FakeWorker(queue_depth=3)) as fakes:
        dying, other = fakes
        async with router([dying.url, other.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
            async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                assert response.headers[WORKER_HEADER] == dying.url
                events = await read_events(response)
            assert events[:2] == ['{"choices": [{"text": "t0"}]}', '{"choices": [{"text": "t1"}]}']
            # The torn third event is not relayed; the error event names the worker and ends the stream.
            assert len(events) == 3
            error = json.loads(events[2])["error"]
            assert error["code"] == "worker_failed" and error["worker"] == dying.url
            assert error["message"].startswith(f"worker {dying.url}: failed mid-stream: ClientPayloadError")
            async with client.get(f"{url}/metrics") as response:
                metrics = await response.text()
            assert (f'pipecast_router_requests_failed_total{{stage="mid_stream",worker="{dying.url}"}} 1.0'
                    in metrics)
            async with client.get(f"{url}/v1/workers") as response:
                view = {worker["url"]: worker for worker in (await response.json())["workers"]}
            assert not view[dying.url]["available"]
            assert (await post(client, url))[1][WORKER_HEADER] == other.url


@pytest.mark.parametrize("tokens", [0, 2])
async def test_a_stream_the_worker_ends_with_its_error_event_counts_as_failed_not_answered(client, tokens):
    """The worker's headers left before its engine failed the request: the failure arrives as the stream's
    last event. The canary gate reads these counters: a failing version must not look answered (or fast)."""
    async with workers(FakeWorker(behaviour="engine_error", tokens=tokens, model="m")) as (worker,):
        async with router([worker.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                events = await read_events(response)
            async with client.get(f"{url}/stats") as response:
                stats = await response.json()
            async with client.get(f"{url}/metrics") as response:
                metrics = await response.text()
    # the worker's own error event reaches the client once, and the router adds none
    assert len(events) == tokens + 1 and json.loads(events[-1])["error"]["message"] == ENGINE_FAILURE
    assert (stats["counters"]["answered"], stats["counters"]["failed"]) == (0, 1)
    version = stats["versions"][worker.package_id]
    assert (version["counters"]["answered"], version["counters"]["failed"]) == (0, 1)
    # an error before any token is no first token: no TTFT sample (a broken version would look fast)
    assert stats["ttft"]["count"] == version["ttft"]["count"] == (1 if tokens else 0)
    assert f'pipecast_router_requests_failed_total{{stage="error_event",worker="{worker.url}"}} 1.0' in metrics
    assert instance.pool.get(worker.url).failed_at is None  # the worker answered for itself: it stays available


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_that_waited_for_its_worker_to_load_counts_in_the_routers_ttft_not_its_versions(
        client, stream):
    """The canary gate compares versions' serving, not a new version's first load: a request that arrived
    while the worker loaded and was answered once it was ready is no TTFT sample of the version."""
    async with workers(FakeWorker(status="loading", model="m")) as (worker,):
        async with router([worker.url]) as (url, instance):
            await eventually(lambda: instance.pool.packages_named("m") == {worker.package_id})

            async def answered() -> int:
                async with client.post(f"{url}/v1/completions", json=BODY | {"stream": stream}) as response:
                    await response.read()
                    return response.status

            pending = asyncio.create_task(answered())
            await eventually(lambda: instance.waiting == 1)
            worker.status = "ready"
            assert await pending == 200
            assert await answered() == 200  # one that arrived once it was ready counts in both
            async with client.get(f"{url}/stats") as response:
                stats = await response.json()
    version = stats["versions"][worker.package_id]
    assert (stats["counters"]["answered"], version["counters"]["answered"]) == (2, 2)
    assert (stats["ttft"]["count"], version["ttft"]["count"]) == (2, 1)


async def test_a_stream_that_ends_without_done_is_a_failure_of_the_worker(client):
    async with workers(FakeWorker(behaviour="no_done", model="m")) as (worker,):
        async with router([worker.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                events = await read_events(response)
            async with client.get(f"{url}/stats") as response:
                stats = await response.json()
    assert events[:3] == ['{"choices": [{"text": "t0"}]}', '{"choices": [{"text": "t1"}]}',
                          '{"choices": [{"text": "t2"}]}']
    assert json.loads(events[3])["error"] == {"message": f"worker {worker.url}: ended its stream without data: [DONE]",
                                              "type": "server_error", "param": None, "code": "worker_failed",
                                              "worker": worker.url}
    assert len(events) == 4
    assert (stats["counters"]["answered"], stats["counters"]["failed"]) == (0, 1)
    assert stats["versions"][worker.package_id]["counters"]["failed"] == 1


async def test_a_stream_that_ends_cleanly_mid_event_drops_the_torn_event_before_the_error_event(client):
    """Found in review: a worker's stream ending cleanly (a close-delimited body, or a chunked one ended) in the
    middle of an event had its torn half passed on with the router's error event glued to it: one garbled
    event, the error lost to the client's parser."""
    async with workers(FakeWorker(behaviour="torn_end", tokens=1)) as (worker,):
        async with router([worker.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                raw = await response.read()
    error = {"error": {"message": f"worker {worker.url}: ended its stream without data: [DONE]",
                       "type": "server_error", "param": None, "code": "worker_failed", "worker": worker.url}}
    assert raw == b'data: {"choices": [{"text": "t0"}]}\n\ndata: ' + json.dumps(error).encode() + b"\n\n"


async def test_a_stream_ends_at_its_done_whether_the_worker_ends_it_cleanly_or_keeps_its_connection_open(client):
    """Found in review: a worker holding its connection open after ``data: [DONE]`` held the client's answer until
    the upstream deadline, then failed it (an error event after [DONE]); a [DONE] with no blank line after it
    was passed on so, which an SSE client drops."""
    for behaviour in ("open_after_done", "done_unterminated"):
        async with workers(FakeWorker(behaviour=behaviour, tokens=1)) as (worker,):
            async with router([worker.url], upstream_timeout_s=3.0) as (url, instance):
                await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
                async with asyncio.timeout(2.0):
                    async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                        raw = await response.read()
                async with client.get(f"{url}/stats") as response:
                    stats = await response.json()
        assert raw == b'data: {"choices": [{"text": "t0"}]}\n\ndata: [DONE]\n\n', behaviour
        assert (stats["counters"]["answered"], stats["counters"]["failed"]) == (1, 0), behaviour


async def test_a_refused_body_is_read_on_after_its_answer_for_a_second_at_most(client):
    """Found in review: a request refused before its body was read (401, 413, 429) had the rest of its body read
    and dropped for 10 s more (aiohttp's lingering close): ~20 GiB from one client sending on loopback."""
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url], max_body_bytes=1 << 20) as (url, _):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            answer = asyncio.create_task(reader.read(1024))  # read as it comes, as the body goes on
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b"a" * (1 << 20))
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                while loop.time() - started < 4.0:  # bounded: the router before read on for 10 s
                    writer.write(chunk)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()
            assert loop.time() - started < 3.0
            assert b" 413 " in await answer
            status, _, _ = await post(client, url)  # the router goes on
            assert status == 200


async def test_a_connection_whose_request_headers_never_end_is_closed_at_the_keep_alive_deadline(monkeypatch):
    """Found in review: a client sending half of a request's headers, or nothing, held its connection for an hour
    (aiohttp's default keep-alive), one file descriptor each. The deadline is the runner's keep-alive, shortened
    here to run fast."""
    assert RUNNER_OPTIONS["keepalive_timeout"] <= 120
    monkeypatch.setitem(RUNNER_OPTIONS, "keepalive_timeout", 0.5)
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url]) as (url, _):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            for sent in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(sent)
                async with asyncio.timeout(3.0):
                    assert await reader.read() == b""  # closed by the router
                writer.close()


# A worker process that streams one event and then stays silent; the test kills it with SIGKILL.
STREAM_ONE_AND_WAIT = r"""
import asyncio, sys
from aiohttp import web

async def health(request):
    return web.json_response({"status": "ready", "blocks_present": 1, "blocks_total": 1, "queue_depth": 0,
                              "running": 0, "max_queue": 8})

async def complete(request):
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"text": "t0"}]}\n\n')
    await asyncio.sleep(60)
    return response

async def main():
    app = web.Application()
    app.add_routes([web.get("/health", health), web.post("/v1/completions", complete)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_a_killed_worker_process_ends_the_stream_with_an_error_event(client):
    process = subprocess.Popen([sys.executable, "-c", STREAM_ONE_AND_WAIT], stdout=subprocess.PIPE, text=True)
    try:
        worker = f"http://127.0.0.1:{int(process.stdout.readline())}"
        async with router([worker]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                first = await response.content.readuntil(b"\n\n")
                process.kill()
                events = await read_events(response)
        assert first == b'data: {"choices": [{"text": "t0"}]}\n\n'
        assert len(events) == 1
        assert json.loads(events[0])["error"]["message"].startswith(f"worker {worker}: failed mid-stream: ")
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


async def test_a_worker_silent_mid_stream_is_cut_off_at_the_deadline(client):
    async with workers(FakeWorker(gate=asyncio.Event())) as (stalled,):  # the gate is never set
        async with router([stalled.url], upstream_timeout_s=0.3) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                events = await read_events(response)
    assert events[0] == '{"choices": [{"text": "t0"}]}'
    assert json.loads(events[1])["error"]["message"] == (
        f"worker {stalled.url}: failed mid-stream: silent for more than 0.3 s")
    assert len(events) == 2


async def test_a_worker_that_stops_reading_a_large_body_is_given_up_at_the_deadline(client):
    async with workers(FakeWorker(behaviour="no_read"), FakeWorker(queue_depth=3)) as (stuck, other):
        async with router([stuck.url, other.url], upstream_timeout_s=0.5) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
            # Far more than the socket buffers between router and worker hold: the write itself stalls.
            status, headers, _ = await post(client, url, prompt="x" * (12 << 20))
            async with client.get(f"{url}/metrics") as response:
                metrics = await response.text()
    assert status == 200 and headers[WORKER_HEADER] == other.url
    assert stuck.paths == ["/v1/completions"]  # tried first (less loaded), given up, then other served
    assert len(other.bodies[0]) > 12 << 20
    assert f'pipecast_router_retries_total{{worker="{stuck.url}"}} 1.0' in metrics


async def test_a_worker_dying_before_it_answers_is_retried_on_another(client):
    async with workers(FakeWorker(behaviour="die_before"), FakeWorker(queue_depth=3)) as (dying, other):
        async with router([dying.url, other.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
            for stream in (False, True):
                dying.bodies.clear()
                await eventually(lambda: instance.pool.serving(instance.clock()) == 2)  # dying recovered
                async with client.post(f"{url}/v1/completions", json=BODY | {"stream": stream}) as response:
                    assert response.status == 200
                    assert response.headers[WORKER_HEADER] == other.url
                    await response.read()
                assert len(dying.bodies) == 1  # it was tried first (less loaded), then other served
            async with client.get(f"{url}/metrics") as response:
                metrics = await response.text()
            assert f'pipecast_router_retries_total{{worker="{dying.url}"}} 2.0' in metrics


async def test_a_streaming_worker_dying_before_its_first_event_is_retried_on_another(client):
    """Found in review: the router's own response began with the worker's headers, so a worker killed after them
    (in a cold start's prefill) ended the stream with an error event, though nothing but headers had reached
    the client. Now the response begins with the first whole event, and a worker failing before it is retried."""
    async with workers(FakeWorker(behaviour="die_after_headers"), FakeWorker(queue_depth=3)) as (dying, other):
        async with router([dying.url, other.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
            async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                assert response.status == 200 and response.headers[WORKER_HEADER] == other.url
                events = await read_events(response)
            async with client.get(f"{url}/stats") as response:
                counters = (await response.json())["counters"]
            async with client.get(f"{url}/metrics") as response:
                metrics = await response.text()
    assert events == ['{"choices": [{"text": "t0"}]}', '{"choices": [{"text": "t1"}]}',
                      '{"choices": [{"text": "t2"}]}', "[DONE]"]
    assert len(dying.bodies) == 1  # tried first (less loaded), then other served
    assert f'pipecast_router_retries_total{{worker="{dying.url}"}} 1.0' in metrics
    assert (counters["answered"], counters["failed"]) == (1, 0)
    # its wait counted once, for the answer it got, not once per attempt
    assert "pipecast_router_queue_seconds_count 1.0" in metrics


async def test_a_retry_is_served_by_its_packages_queue_kept_while_the_request_was_at_a_worker(client):
    """A request for a model one package serves (no route) queues in that package's dispatcher, which a
    route sync detaches only once no tenant is active in it. It was detached while the request was at a
    worker (its retry then got 503 "shutting down" from the closed queue); now it is kept for the retry."""
    gate = asyncio.Event()
    async with workers(FakeWorker(behaviour="die_before", gate=gate, model="m"),
                       FakeWorker(queue_depth=3, model="m")) as (dying, other):
        async with router([dying.url, other.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
            request = asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY))
            await eventually(lambda: len(dying.bodies) == 1)
            queue = instance.version_dispatchers[dying.package_id]
            instance._sync_routes()
            assert instance.version_dispatchers == {dying.package_id: queue}
            gate.set()
            async with await request as response:
                assert response.status == 200 and response.headers[WORKER_HEADER] == other.url


async def test_a_tenants_request_at_a_worker_keeps_its_share_across_discovery_syncs(client):
    """Found in review: a package's queue with nobody waiting was detached at every discovery sync, its tenants'
    records with it, so another tenant's burst was taken for a tenant alone and queued at the worker, ahead of
    the first tenant's next request. With a tenant at the worker, the burst now waits in the router."""
    gate = asyncio.Event()
    async with workers(FakeWorker(model="m", gate=gate, max_batch=1)) as (worker,):
        async with router([worker.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True},
                                   headers={"x-pipecast-tenant": "interactive"}) as stream:
                await stream.content.readuntil(b"\n\n")  # at the worker, held at its gate
                await asyncio.sleep(0.2)  # discovery syncs every 0.05 s
                burst = [asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY,
                                                         headers={"x-pipecast-tenant": "bulk"})) for _ in range(3)]
                await eventually(lambda: instance.waiting == 3, timeout_s=2)
                assert len(worker.bodies) == 1  # the worker holds one batch: the rest wait where slots go fairly
                gate.set()
                await stream.read()
            for response in await asyncio.gather(*burst):
                assert response.status == 200
                response.release()


async def test_the_router_presents_the_serving_key_and_a_refusal_is_the_workers_failure(client):
    """Workers of a cluster take requests only with its serving key: the router presents its key to each;
    a worker that refuses it (another cluster's credentials, or none) fails the attempt (retried elsewhere
    like any failed attempt) and the client never sees the worker's 401."""
    master = "router-test-master-token"
    key = serving_key(data_plane_key(master))
    assert static_serving_key(master) == key
    assert static_serving_key(issue_node_token(master, "router")) == b"" and static_serving_key("") == b""
    mine, other = FakeWorker(serving_key=key), FakeWorker(serving_key=serving_key(data_plane_key("another")))
    async with workers(mine, other):
        async with router([mine.url], serving_key=key) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            status, headers, _ = await post(client, url)
        assert status == 200 and mine.presented == [key.hex()]
        for presented, words in ((key, "holds another key"), (b"", "is missing")):
            async with router([other.url], serving_key=presented, max_retries=0) as (url, instance):
                await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
                status, _, answer = await post(client, url)
            assert status == 502 and other.presented[-1] == (presented.hex() or None)
            assert answer["error"]["message"] == (
                f"request failed on 1 attempt(s): worker {other.url}: refused the router's credentials: this "
                "worker takes requests only from its cluster's router and serving workers: the "
                f"X-Pipecast-Serving-Key header {words}")


async def test_the_pools_views_answer_only_the_serving_key_where_the_router_has_credentials(client):
    """/stats, /v1/workers and /metrics show tenants, worker URLs and loads: with credentials only a caller
    holding the cluster's serving key (the scaling daemon) reads them, and while the router has not learned the
    key nobody does; the metrics port serves /metrics alone to anyone (Prometheus); /health and /v1/models
    answer anyone, /v1/models with its workers' URLs only to the key's holders."""
    key = serving_key(data_plane_key("master"))
    async with workers(FakeWorker(serving_key=key, model="chat")) as (worker,):
        async with router([worker.url], serving_key=key, views_need_key=True) as (url, instance):
            await eventually(lambda: all(w.health is not None for w in instance.pool.workers()))
            for headers, listed in (({}, {}), ({SERVING_KEY_HEADER: key.hex()}, {"workers": [worker.url]})):
                async with client.get(f"{url}/v1/models", headers=headers) as response:
                    assert [(m["id"], m["root"]) for m in (await response.json())["data"]] == [("chat", "p" * 64)]
                    assert {k: v for k, v in (await response.json())["data"][0].items() if k == "workers"} == listed
            assert (await post(client, url, model="chat"))[0] == 200
            for path in ("/stats", "/v1/workers", "/metrics"):
                scrape = "; Prometheus scrapes the router's --metrics-port" if path == "/metrics" else ""
                for presented, words in ((None, "is missing"), (bytes(32).hex(), "holds another key")):
                    async with client.get(f"{url}{path}", headers={SERVING_KEY_HEADER: presented} if presented
                                          else {}) as response:
                        assert response.status == 401 and (await response.json())["error"] == {
                            "message": f"{path} answers only the cluster's own components (the scaling daemon, "
                                       f"operators holding the serving key): the X-Pipecast-Serving-Key header "
                                       f"{words}{scrape}", "type": "authentication_error",
                            "param": None, "code": "invalid_serving_key"}
                async with client.get(f"{url}{path}", headers={SERVING_KEY_HEADER: key.hex()}) as response:
                    assert response.status == 200 and worker.url in await response.text()
            for path in ("/health", "/v1/models"):
                async with client.get(f"{url}{path}") as response:
                    assert response.status == 200, path
            async with serving(build_metrics_app(instance)) as metrics_url:
                async with client.get(f"{metrics_url}/metrics") as response:
                    assert response.status == 200 and response.content_type == "text/plain"
                    routed = f'pipecast_router_requests_routed_total{{worker="{worker.url}"}} 1.0'
                    assert routed in await response.text()
                async with client.get(f"{metrics_url}/stats") as response:
                    assert response.status == 404  # the metrics port serves nothing else
        async with router([worker.url], serving_key=key) as (url, _):  # no credentials: open, as before
            async with client.get(f"{url}/stats") as response:
                assert response.status == 200

    learned = b""

    class Lister:  # a control plane that has not answered with the key yet
        async def list_workers_keyed(self):
            return [], learned

        async def list_routes(self):
            return []

    source = ControlPlaneDiscovery(Lister(), "cp:1")
    instance = Router(RouterConfig(**(FAST | {"views_need_key": True})), [source])
    async with serving_router(instance) as url:
        async with client.get(f"{url}/stats", headers={SERVING_KEY_HEADER: key.hex()}) as response:
            assert (response.status, response.headers["Retry-After"]) == (503, "1")
            assert (await response.json())["error"]["code"] == "credentials_pending"
        learned = key
        await eventually(lambda: source.serving_key == key)
        async with client.get(f"{url}/stats", headers={SERVING_KEY_HEADER: key.hex()}) as response:
            assert response.status == 200


async def test_answers_name_their_workers_only_to_the_callers_the_views_answer(client):
    """Where /v1/workers refuses a caller, its completions named the worker URLs all the same: the
    x-pipecast-worker header of every answer, a 502's worker and attempts, a stream's error event. Now only
    a caller presenting the serving key sees them (or anyone, without credentials)."""
    key = serving_key(data_plane_key("master"))
    mine = {SERVING_KEY_HEADER: key.hex()}
    async with workers(FakeWorker(serving_key=key), FakeWorker(serving_key=key, behaviour="die_before"),
                       FakeWorker(serving_key=key, behaviour="die_mid_stream")) as (good, dying, torn):
        for urls, check in (([good.url], "answer"), ([dying.url], "502"), ([torn.url], "stream")):
            async with router(urls, serving_key=key, views_need_key=True, max_retries=0) as (url, instance):
                for headers in ({}, {SERVING_KEY_HEADER: bytes(32).hex()}, mine):
                    torn.health_code = 200  # back up after its last death
                    await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
                    shown = headers is mine
                    async with client.post(f"{url}/v1/completions", json=BODY | {"stream": check == "stream"},
                                           headers=headers) as response:
                        assert (WORKER_HEADER in response.headers) is shown
                        text = (await response.read()).decode()
                    assert (urls[0] in text) is shown or check == "answer", text  # a fake names itself in its answer
                    if check == "502":
                        error = json.loads(text)["error"]
                        assert response.status == 502 and ("attempts" in error and "worker" in error) is shown
                        if not shown:
                            assert error == {"type": "server_error", "param": None, "code": "worker_failed",
                                             "message": "request failed on 1 attempt(s) at the router's workers"}
                    if check == "stream":
                        error = json.loads(text.split("data: ")[-1])["error"]
                        failed = {"type": "server_error", "param": None, "code": "worker_failed"}
                        assert error == (failed | {"worker": torn.url, "message": error["message"]} if shown else
                                         failed | {"message": "the worker serving this request failed mid-stream"})
        async with router([good.url], serving_key=key) as (url, _):  # no credentials: shown to anyone, as before
            assert (await post(client, url))[1][WORKER_HEADER] == good.url


async def test_a_pipeline_a_stage_failed_mid_stream_gets_nothing_for_a_while_and_names_the_stage_to_keyed_callers(
        client):
    """Found in review: a pipeline whose stage failed mid-stream was not held back (only a failure before the answer
    was), so every request went on to it and failed; and its head's error event, naming the stage's URL, reached
    callers that may not see the workers."""
    key = serving_key(data_plane_key("master"))
    package = "p" * 64
    async with workers(FakeWorker(status="loading", behaviour="stage_failed", model="tiny", package_id=package),
                       FakeWorker(status="loading", model="tiny", package_id=package)) as (head, member):
        class Source:
            name = "control plane (stub)"
            serving_key = key

            async def list_workers(self):
                return [DiscoveredWorker("na", head.url, serving_key=key),
                        DiscoveredWorker("nb", member.url, serving_key=key)]

            async def list_pipelines(self):
                return [DiscoveredPipeline(pipeline_key(package, ["na", "nb"]), head.url, (head.url, member.url),
                                           "[route]", 0, package)]

            async def list_routes(self):
                return {}

        instance = Router(RouterConfig(**(FAST | {"views_need_key": True, "max_retries": 0})), [Source()])

        def takes() -> bool:
            return any(p.can_take([instance.pool.get(u) for u in p.member_urls], instance.clock())
                       for p in instance.pool.pipelines())

        async with serving_router(instance) as url:
            for headers in ({}, {SERVING_KEY_HEADER: key.hex()}):
                await eventually(lambda: instance.pool.pipelines())
                [pipeline] = instance.pool.pipelines()
                pipeline.failed_at = None  # the first round's failure held it back: sent nothing (below)
                await eventually(takes)
                async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True},
                                       headers=headers) as response:
                    text = (await response.read()).decode()
                error = json.loads(text.split("data: ")[-1])["error"]
                assert error["code"] == "pipeline_stage_failed" and (FAILED_STAGE in text) is bool(headers), text
                if not headers:
                    assert error["message"] == "a stage of the pipeline serving this request failed"
                assert pipeline.failed_at is not None and not takes()


def test_a_router_given_a_guessable_master_token_refuses_to_start_as_the_agents_do(monkeypatch, capsys):
    """Found in review: the agents and the control plane refused `PIPECAST_AUTH_TOKEN=short`, the router served with
    it (its serving key as guessable as the token)."""
    from pipecast.cli import main

    monkeypatch.setenv("PIPECAST_AUTH_TOKEN", "short")
    assert main(["router", "--worker", "http://127.0.0.1:1", "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: auth_token: the master token has 5 characters")


def test_a_router_given_a_node_token_and_no_control_plane_is_a_usage_error():
    """No serving key derives from a node token: such a router could neither call pipecast's workers nor
    answer its own /stats, so it refuses to start, saying what to give it."""
    result = CliRunner().invoke(router_command, ["--worker", "http://127.0.0.1:1"],
                                env={"PIPECAST_AUTH_TOKEN": issue_node_token("master", "router")})
    assert result.exit_code == 2 and ("the auth_token is a node token, from which no serving key derives: give the "
                                      "router the cluster's master token, or --control-plane to learn the key from"
                                      ) in " ".join(result.output.split())


@pytest.mark.parametrize(("name", "value"), [("queue_timeout_s", float("nan")), ("upstream_timeout_s", float("inf")),
                                             ("health_interval_s", float("nan")), ("health_timeout_s", 0.0),
                                             ("connect_timeout_s", -1.0), ("discovery_interval_s", float("inf")),
                                             ("discovery_timeout_s", float("nan"))])
def test_a_router_config_without_a_finite_positive_deadline_is_refused_naming_it(name, value):
    """Found in review: nan and inf were taken, and the router ran without the deadline (a queued request never
    answered, a stalled worker holding its slot for good, health polls practically stopped)."""
    with pytest.raises(ValueError) as info:
        RouterConfig(**{name: value})
    assert str(info.value) == f"RouterConfig.{name} must be a finite number of seconds > 0, got {value!r}"


async def test_a_silent_worker_whose_engine_steps_is_answered_504_not_retried_and_a_hung_one_retried(client):
    """Found in review: a worker silent for the upstream timeout failed, though busy: a long non-streaming
    generation, or a request queued behind full batches, was generated again on other workers, then 502. Silent
    while its health answers and shows its engine stepping, it now gets the request a 504, done once; down, or its
    engine stopped (a later review: one step in the window was taken for work), it has failed, as before, and the
    request goes to another."""
    async with workers(FakeWorker(behaviour="slow", gate=asyncio.Event(), steps=0), FakeWorker(queue_depth=3)) as (
            slow, other):
        async with router([slow.url, other.url], upstream_timeout_s=0.6) as (url, instance):

            async def sent(until=lambda: False):
                await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
                pending = asyncio.create_task(post(client, url))
                while not pending.done():  # its engine works on
                    await asyncio.sleep(0.05)
                    slow.steps += 1
                    if until():
                        slow.health_code = 503  # down from now on, its engine still stepping
                return await pending

            status, headers, answer = await sent()
            assert (status, headers[WORKER_HEADER]) == (504, slow.url) and not other.bodies
            assert answer["error"] == {"type": "server_error", "param": None, "code": "worker_timeout",
                                       "worker": slow.url, "message": (
                f"worker {slow.url}: no answer to POST /v1/completions within 0.6 s while its engine was working: "
                "not retried (the work would be done again); give the router a longer --upstream-timeout "
                "(streaming helps a long generation, not a long wait in the worker's queue)")}
            assert instance.pool.get(slow.url).failed_at is None
            status, headers, _ = await sent(until=lambda: len(slow.bodies) == 2)
            assert (status, headers[WORKER_HEADER]) == (200, other.url) and len(other.bodies) == 1
            slow.health_code = 200
            await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
            await asyncio.sleep(2.0)  # its engine stopped: a hung one
            status, headers, _ = await post(client, url)
            async with client.get(f"{url}/metrics") as response:
                metrics = await response.text()
    assert status == 200 and headers[WORKER_HEADER] == other.url and len(slow.bodies) == 3
    assert f'pipecast_router_retries_total{{worker="{slow.url}"}} 2.0' in metrics


async def test_a_worker_failing_every_request_is_passed_over_after_three_in_a_row(client):
    """Found in review: a worker whose engine fails every request (a sticky device fault, its health still ready)
    answers at once, so it was always the idle one and took nearly every request. Its 500s still go to their
    clients (one request's own failure is not retried), but three in a row put it after every other worker for a
    while; not out (a later review): the errors may be the requests' own, and a pool of one must go on serving."""
    async with workers(FakeWorker(behaviour="engine_failed"), FakeWorker(queue_depth=3)) as (failing, other):
        async with router([failing.url, other.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
            answers = [await post(client, url) for _ in range(6)]
            problem = instance.pool.get(failing.url).problem
        async with router([failing.url]) as (url, instance):  # alone: it still gets the requests, at once
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            for _ in range(3):
                await post(client, url)
            failing.behaviour = "answer"  # it serves well again: a good answer ends the row
            status, headers, _ = await post(client, url)
            assert (status, headers[WORKER_HEADER]) == (200, failing.url)
            assert instance.pool.get(failing.url).errors_in_row == 0
    assert [(status, headers[WORKER_HEADER]) for status, headers, _ in answers] == (
        [(500, failing.url)] * 3 + [(200, other.url)] * 3)
    assert answers[0][2] == {"error": {"message": ENGINE_FAILURE, "type": "server_error", "param": None,
                                       "code": None}}
    assert problem == (f"worker {failing.url}: 3 errors in a row (last: answered 500); sent requests only when no "
                       "other worker can take them, for 10 s")


async def test_retries_are_bounded_and_end_in_502_naming_the_workers(client):
    async with workers(FakeWorker(behaviour="die_before"), FakeWorker(behaviour="die_before")) as fakes:
        urls = sorted(fake.url for fake in fakes)
        async with router(urls, max_retries=1) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
            status, headers, answer = await post(client, url)
    assert status == 502
    error = answer["error"]
    assert error["code"] == "worker_failed"
    assert sorted(error["attempts"]) == urls and error["worker"] == error["attempts"][-1]
    assert headers[WORKER_HEADER] == error["worker"]
    assert error["message"].startswith(f"request failed on 2 attempt(s): worker {error['attempts'][0]}: "
                                       "no answer to POST /v1/completions: ")
    assert sum(len(fake.bodies) for fake in fakes) == 2


async def test_a_retry_past_the_queue_deadline_is_a_502_naming_the_failed_worker_not_a_queue_timeout(client):
    # Found in review: the queue deadline counts from arrival, so after a worker that stayed silent longer than
    # the queue timeout (300 s of silence against 120 s by default) the retry's wait ended at once in a 503 "no
    # worker could take the request", the worker's failure dropped.
    async with workers(FakeWorker(behaviour="die_before", gate=asyncio.Event())) as (silent,):
        async with router([silent.url], queue_timeout_s=0.2, upstream_timeout_s=0.5) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            pending = asyncio.create_task(post(client, url))
            await eventually(lambda: silent.bodies)
            silent.health_code = 503  # down from now on: the retry finds no worker
            status, headers, answer = await pending
            async with client.get(f"{url}/metrics") as response:
                metrics = await response.text()
    assert status == 502 and headers[WORKER_HEADER] == silent.url
    assert answer == {"error": {"type": "server_error", "param": None, "code": "worker_failed", "worker": silent.url,
                                "attempts": [silent.url], "message": (
        f"request failed on 1 attempt(s): worker {silent.url}: no answer to POST /v1/completions: silent for more "
        "than 0.5 s; then no worker could take the request within 0.2 s (1 workers known, 0 able to serve)")}}
    assert f'pipecast_router_requests_failed_total{{stage="before_response",worker="{silent.url}"}} 1.0' in metrics
    assert 'reason="queue_timeout"' not in metrics


async def test_a_busy_worker_sends_the_request_back_to_the_queue_not_to_an_error(client):
    async with workers(FakeWorker(behaviour="busy"), FakeWorker(queue_depth=3)) as (busy, other):
        async with router([busy.url, other.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
            status, headers, _ = await post(client, url)
            assert status == 200 and headers[WORKER_HEADER] == other.url
            assert len(busy.bodies) == 1
            assert instance.pool.get(busy.url).problem == f"worker {busy.url}: queue full (429), retry after 5 s"


async def test_client_and_worker_refusals_keep_their_status(client):
    async with workers(FakeWorker(behaviour="invalid")) as (worker,):
        async with router([worker.url]) as (url, instance):
            async with client.post(f"{url}/v1/completions", data=b"{not json") as response:
                assert response.status == 400
                assert (await response.json())["error"]["message"].startswith("request body is not JSON: ")
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            status, headers, answer = await post(client, url)
            assert (status, answer) == (400, {"error": {"message": "max_tokens too large"}})
            assert headers[WORKER_HEADER] == worker.url
            assert instance.pool.get(worker.url).can_take(instance.clock())  # the client's fault, not its


async def test_max_queue_bounds_the_requests_waiting_in_the_router_whatever_they_wait_for(client):
    """Found in review: each version's queue had a bound of its own, so a router whose workers serve N models
    held N + 1 times --max-queue requests."""
    fakes = [FakeWorker(status="loading", model=f"model-{i}", package_id=f"{i}" * 64) for i in range(2)]
    async with workers(*fakes):
        async with router([fake.url for fake in fakes], max_queue=1, queue_timeout_s=0.5) as (url, instance):
            await eventually(lambda: len(instance.pool.serving_packages()) == 2)
            queued = asyncio.create_task(post(client, url, model="model-0"))
            await eventually(lambda: instance.waiting == 1)
            for model in ("model-1", "other"):
                status, _, answer = await post(client, url, model=model)
                assert status == 429 and answer["error"]["code"] == "queue_full"
            assert (await queued)[0] == 503  # its deadline: nobody serves model-0


async def test_shutdown_fails_queued_requests_at_once(client):
    async with workers(FakeWorker(status="loading")) as (worker,):
        instance = Router(RouterConfig(**FAST), [StaticDiscovery([worker.url])])
        async with serving_router(instance) as url:
            pending = asyncio.create_task(post(client, url))
            await eventually(lambda: instance.dispatcher.waiting == 1)
        status, _, answer = await pending
    assert (status, answer) == (503, {"error": {"message": "router is shutting down", "type": "server_error",
                                                "param": None, "code": "shutting_down"}})


async def test_once_shutting_down_a_request_waiting_for_a_new_versions_queue_gets_503(client):
    """Found in review: stopping closed the queues there were; one made afterwards (the first request for a
    model, or a retry of one whose idle queue was detached) was open, and its request waited for a worker."""
    async with workers(FakeWorker(model="m")) as (worker,):
        async with router([worker.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            assert instance.version_dispatchers == {}
            instance.stop_accepting()
            status, _, answer = await post(client, url)
    assert (status, answer) == (503, {"error": {"message": "router is shutting down", "type": "server_error",
                                                "param": None, "code": "shutting_down"}})
    assert worker.bodies == []


async def test_workers_are_learned_from_the_control_plane_and_kept_while_it_fails(client):
    listed: list = []
    failing = False

    class Lister:
        async def list_workers_keyed(self):
            if failing:
                raise ConnectionError("control plane restarting")
            return list(listed), b""

        async def list_routes(self):
            return []

        async def list_deployments(self):
            return []

    async with workers(FakeWorker()) as (worker,):
        instance = Router(RouterConfig(**FAST), [ControlPlaneDiscovery(Lister(), "cp:7000")])
        async with serving_router(instance) as url:
            pending = asyncio.create_task(post(client, url))
            await eventually(lambda: instance.dispatcher.waiting == 1)
            listed.append(pb.WorkerState(worker=pb.WorkerSpec(peer=pb.Peer(node_id="n1"),
                                                              labels={SERVE_URL_LABEL: worker.url}), alive=True))
            assert (await pending)[0] == 200
            failing = True
            await asyncio.sleep(0.2)  # several failed discoveries
            async with client.get(f"{url}/health") as response:
                assert await response.json() == {"status": "ready", "workers": 1, "serving": 1,
                                                 "queue_depth": 0, "max_queue": 256}
            failing = False
            listed[0].alive = False
            await eventually(lambda: not instance.pool.workers())
            async with client.get(f"{url}/health") as response:
                assert (await response.json())["status"] == "waiting"


async def test_workers_registered_at_the_real_control_plane_are_routed_to(client, tmp_path):
    control = ControlPlaneServer(ServerConfig(host="127.0.0.1", port=0, db_path=tmp_path / "cp.sqlite3"))
    await control.start()
    try:
        async with workers(FakeWorker()) as (worker,), ControlPlaneClient(control.address) as cp:
            await cp.register(RegisteredSpec(PeerInfo("n1", "127.0.0.1:7071"), 1 << 30,
                                              labels={SERVE_URL_LABEL: worker.url}))
            instance = Router(RouterConfig(**FAST), [ControlPlaneDiscovery(cp, control.address)])
            async with serving_router(instance) as url:
                status, headers, _ = await post(client, url)
                assert (status, headers[WORKER_HEADER]) == (200, worker.url)
                assert [(w.node_id, w.url) for w in instance.pool.workers()] == [("n1", worker.url)]
    finally:
        await control.stop(grace_s=0)


@dataclass
class FakeVllm:
    """A vLLM worker's HTTP surface (``vllm serve ... --served-model-name``): an empty 200 at /health, its served
    name at /v1/models, its queue at /metrics, and JSON answers to completions."""

    model: str = "smol"
    bodies: list[bytes] = field(default_factory=list)
    url: str = ""

    async def answer(self, request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})
        if request.path == "/metrics":
            return web.Response(text=f'vllm:num_requests_waiting{{model_name="{self.model}"}} 0.0\n'
                                     f'vllm:num_requests_running{{model_name="{self.model}"}} 0.0\n')
        if request.method == "POST":
            self.bodies.append(await request.read())
            return web.json_response({"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}})
        return web.Response()


@asynccontextmanager
async def vllm_serving(fake: FakeVllm) -> AsyncIterator[FakeVllm]:
    """Serve ``fake`` on a free loopback port (its ``url`` set)."""
    app = web.Application()
    app.add_routes([web.get(path, fake.answer) for path in ("/health", "/v1/models", "/metrics")]
                   + [web.post("/v1/completions", fake.answer)])
    async with serving(app) as fake.url:
        yield fake


async def test_a_vllm_worker_of_the_control_plane_serves_its_deployed_packages_model_name(client, tmp_path):
    """Found in review: a vLLM worker's health named no package, so a request for a deployed package's model name
    (routed to that package) never went to it: 503 at its deadline, though /stats counted it for the package. Its
    package is now the one its agent holds, as the control plane lists it."""
    control = ControlPlaneServer(ServerConfig(host="127.0.0.1", port=0, db_path=tmp_path / "cp.sqlite3"))
    await control.start()
    smol = manifest("smol")
    try:
        async with vllm_serving(FakeVllm()) as vllm, ControlPlaneClient(control.address) as cp:
            await cp.publish_package(smol, STORE)
            await cp.put_deployment(Deployment(smol.package_id, ScalingPolicy()))
            await cp.register(RegisteredSpec(PeerInfo("n1", "127.0.0.1:7071"), 1 << 30, serve_url=vllm.url,
                                             engine="vllm"), held={smol.package_id: range(len(smol.blocks))})
            instance = Router(RouterConfig(**FAST, queue_timeout_s=3.0), [ControlPlaneDiscovery(cp, control.address)])
            async with serving_router(instance) as url:
                await eventually(lambda: instance.routes == {"smol": ((smol.package_id, 100),)})
                status, headers, answer = await post(client, url, model="smol")
                assert (status, headers[WORKER_HEADER], answer["choices"]) == (200, vllm.url, [{"text": "ok"}])
                async with client.get(f"{url}/stats") as response:
                    stats = await response.json()
        version = stats["versions"][smol.package_id]
        assert (version["counters"]["answered"], version["queue_depth"]) == (1, 0)
        assert version["ready_s"] is not None and stats["workers"][0]["status"] == "ready"
    finally:
        await control.stop(grace_s=0)


async def test_a_vllm_worker_given_by_url_serves_the_routed_name_it_serves_and_no_other(client):
    """A ``--vllm-worker`` URL comes with no package: a request of a routed name goes to it where it serves that
    name, and one of another routed name waits for that name's package."""
    class Routes:
        name, serving_key = "routes", b""

        async def list_workers(self):
            return []

        async def list_pipelines(self):
            return []

        async def list_routes(self):
            return {"smol": (("a" * 64, 100),), "other": (("b" * 64, 100),)}

    async with vllm_serving(FakeVllm()) as vllm:
        instance = Router(RouterConfig(**FAST, queue_timeout_s=1.0), [Routes(), StaticDiscovery([vllm.url], "vllm")])
        async with serving_router(instance) as url:
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            status, headers, _ = await post(client, url, model="smol")
            assert (status, headers[WORKER_HEADER]) == (200, vllm.url)
            status, _, answer = await post(client, url, model="other")
            assert (status, answer["error"]["code"]) == (503, "queue_timeout")
    assert [json.loads(body)["model"] for body in vllm.bodies] == ["smol"]


async def test_a_routed_name_is_split_by_the_control_planes_weights_and_follows_promote_and_rollback(client, tmp_path):
    control = ControlPlaneServer(ServerConfig(host="127.0.0.1", port=0, db_path=tmp_path / "cp.sqlite3"))
    await control.start()
    a, b = manifest("a"), manifest("b")
    fakes = (FakeWorker(model="chat", package_id=a.package_id), FakeWorker(model="chat", package_id=b.package_id),
             FakeWorker(model="other", package_id="o" * 64))
    try:
        async with workers(*fakes) as (wa, wb, wo), ControlPlaneClient(control.address) as cp:
            for m in (a, b):
                await cp.publish_package(m, STORE)
            await cp.change_route(RouteChange("chat", "route", a.package_id))
            await cp.change_route(RouteChange("chat", "canary", b.package_id, 25))
            instance = Router(RouterConfig(**FAST), [ControlPlaneDiscovery(cp, control.address),
                                                     StaticDiscovery([wa.url, wb.url, wo.url])])
            async with serving_router(instance) as url:
                await eventually(lambda: len(instance.pool.serving_packages()) == 3)

                async def served_by(n: int) -> list[str]:
                    return [(await post(client, url, model="chat"))[1][WORKER_HEADER] for _ in range(n)]

                assert sorted(await served_by(8)) == sorted([wa.url] * 6 + [wb.url] * 2)
                others = [(await post(client, url, model="other"))[1][WORKER_HEADER] for _ in range(3)]
                assert set(others) == {wo.url}  # no route: the one package whose workers name it
                async with client.get(f"{url}/v1/models") as response:
                    models = (await response.json())["data"]
                assert models[0] | {"created": 0} == {
                    "id": "chat", "object": "model", "created": 0, "owned_by": "pipecast", "root": a.package_id,
                    "workers": sorted([wa.url, wb.url]),
                    "versions": [{"package_id": a.package_id, "weight": 75, "workers": [wa.url]},
                                 {"package_id": b.package_id, "weight": 25, "workers": [wb.url]}]}
                assert [m["id"] for m in models] == ["chat", "other"]
                async with client.get(f"{url}/stats") as response:
                    versions = (await response.json())["versions"]
                assert {p: v["counters"]["answered"] for p, v in versions.items()} == {
                    a.package_id: 6, b.package_id: 2, "o" * 64: 3}
                async with client.get(f"{url}/metrics") as response:
                    assert (f'pipecast_router_version_requests_total{{outcome="answered",version="{b.package_id}"}} '
                            "2.0") in await response.text()
                await cp.change_route(RouteChange("chat", "promote"))
                await eventually(lambda: instance.routes["chat"] == ((b.package_id, 100),))
                assert set(await served_by(4)) == {wb.url}
                await cp.change_route(RouteChange("chat", "canary", a.package_id, 50))
                await eventually(lambda: len(instance.routes["chat"]) == 2)
                assert sorted(await served_by(4)) == sorted([wa.url, wb.url] * 2)
                await cp.change_route(RouteChange("chat", "rollback"))
                await eventually(lambda: len(instance.routes["chat"]) == 1)
                assert set(await served_by(4)) == {wb.url}
                # a's queue went with its version (and the unrouted other's) once no tenant was active in it
                await eventually(lambda: list(instance.version_dispatchers) == [b.package_id])
    finally:
        await control.stop(grace_s=0)


async def test_after_a_scale_to_zero_a_request_waits_for_its_models_package_not_for_another_models_worker(client):
    """Two models behind one router, no route: once chat's workers name nothing (released, as after a scale to
    zero) a chat request must not go to the other model's worker (which would refuse it) but wait for chat's
    package, and /stats must count it in that version's queue, where a scaler sees it."""
    chat, other = FakeWorker(model="chat", package_id="c" * 64), FakeWorker(model="other", package_id="o" * 64)
    async with workers(chat, other) as (wc, wo), router([wc.url, wo.url]) as (url, instance):
        await eventually(lambda: len(instance.pool.serving_packages()) == 2)
        assert (await post(client, url, model="chat"))[1][WORKER_HEADER] == wc.url
        wc.model, wc.status = "", "loading"  # released: it names no package while it waits for one
        await eventually(lambda: instance.pool.serving_packages() == {"o" * 64})
        pending = asyncio.create_task(post(client, url, model="chat"))
        await eventually(lambda: instance.waiting == 1)
        async with client.get(f"{url}/stats") as response:
            stats = await response.json()
        assert (stats["queue_depth"], stats["versions"]["c" * 64]["queue_depth"]) == (1, 1)
        assert not pending.done() and len(wo.bodies) == 0
        wc.model, wc.status = "chat", "ready"  # scaled up again
        status, headers, _ = await pending
        assert (status, headers[WORKER_HEADER]) == (200, wc.url) and len(wo.bodies) == 0


async def test_a_request_for_a_deployed_model_counts_for_its_deployment_before_any_worker_names_it(client, tmp_path):
    """A router that learns the control plane's deployments routes a request for a deployed package's model
    name to that package from the first request on, while its only worker waits for the package and names
    nothing: /stats counts it in that version's queue (where that deployment's scaling daemon, and no
    other's, sees it). A name that two deployed packages share, or that none has, stays unattributed."""
    control = ControlPlaneServer(ServerConfig(host="127.0.0.1", port=0, db_path=tmp_path / "cp.sqlite3"))
    await control.start()
    chat = manifest("chat")
    twins = [seal_manifest(m) for m in (manifest("t1"), manifest("t2"))]
    for twin in twins:
        twin.model_name = "twin"
        seal_manifest(twin)
    waiting = FakeWorker(status="loading")  # names no model and no package yet
    try:
        async with workers(waiting) as (worker,), ControlPlaneClient(control.address) as cp:
            for m in (chat, *twins):
                await cp.publish_package(m, STORE)
                await cp.put_deployment(Deployment(m.package_id, ScalingPolicy()))
            instance = Router(RouterConfig(**FAST), [ControlPlaneDiscovery(cp, control.address),
                                                     StaticDiscovery([worker.url])])
            async with serving_router(instance) as url:
                await eventually(lambda: "chat" in instance.routes)
                assert instance.routes == {"chat": ((chat.package_id, 100),)}  # "twin" is ambiguous
                pending = [asyncio.create_task(post(client, url, model=name)) for name in ("chat", "twin", "none")]
                await eventually(lambda: instance.waiting == 3)
                async with client.get(f"{url}/stats") as response:
                    stats = await response.json()
                assert stats["queue_depth"] == 3
                assert {p: v["queue_depth"] for p, v in stats["versions"].items()} == {chat.package_id: 1}
                waiting.model, waiting.package_id, waiting.status = "chat", chat.package_id, "ready"
                status, headers, _ = await pending[0]
                assert (status, headers[WORKER_HEADER]) == (200, worker.url)
                for task in pending[1:]:
                    task.cancel()
                await asyncio.gather(*pending[1:], return_exceptions=True)
    finally:
        await control.stop(grace_s=0)


async def test_the_router_command_routes_to_static_and_control_plane_workers_until_sigterm(client, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    control = ControlPlaneServer(ServerConfig(host="127.0.0.1", port=0, db_path=tmp_path / "cp.sqlite3"))
    await control.start()
    code = "import sys; from pipecast.router.command import router_command; sys.exit(router_command())"
    process = None
    try:
        async with workers(FakeWorker()) as (worker,), ControlPlaneClient(control.address) as cp:
            await cp.register(RegisteredSpec(PeerInfo("n1", "127.0.0.1:7071"), 1 << 30,
                                             labels={SERVE_URL_LABEL: worker.url}))
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, "--port", "0", "--worker", dead, "--control-plane", control.address,
                "--health-interval", "0.05", "--metrics-port", "0", stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            lines = [(await asyncio.wait_for(process.stdout.readline(), timeout=20)).decode() for _ in range(2)]
            assert lines[0].startswith("router metrics on http://127.0.0.1:"), await process.stderr.read()
            assert lines[1].startswith("router listening on http://127.0.0.1:"), lines
            metrics, url = (line.split()[-1] for line in lines)
            status, headers, _ = await post(client, url)
            assert (status, headers[WORKER_HEADER]) == (200, worker.url)
            async with client.get(metrics) as response:
                assert f'pipecast_router_requests_routed_total{{worker="{worker.url}"}} 1.0' in await response.text()
            async with client.get(f"{url}/v1/workers") as response:
                pool = [(w["node_id"], w["url"]) for w in (await response.json())["workers"]]
            assert sorted(pool) == sorted([(dead, dead), ("n1", worker.url)])
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), timeout=10) == 0
    finally:
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()
        await control.stop(grace_s=0)


async def test_a_queued_request_whose_client_leaves_gives_its_place_up_at_once(client):
    # Found in review: the router command served without handler cancellation, so a request whose client had
    # disconnected held its place in the queue until its deadline (120 s by default), a full queue answering 429.
    code = "import sys; from pipecast.router.command import router_command; sys.exit(router_command())"
    async with workers(FakeWorker(status="loading")) as (worker,):
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, "--port", "0", "--worker", worker.url, "--health-interval", "0.05",
            "--max-queue", "1", "--queue-timeout", "25", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            line = (await asyncio.wait_for(process.stdout.readline(), timeout=20)).decode()
            assert line.startswith("router listening on http://127.0.0.1:"), await process.stderr.read()
            url = line.split()[-1]

            async def queue_depth_becomes(depth: int) -> None:
                async with asyncio.timeout(5):  # well before the queue deadline
                    while True:
                        async with client.get(f"{url}/stats") as response:
                            if (await response.json())["queue_depth"] == depth:
                                return
                        await asyncio.sleep(0.02)

            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as leaving:
                left = asyncio.create_task(post(leaving, url))
                await queue_depth_becomes(1)
                left.cancel()
                await asyncio.gather(left, return_exceptions=True)
            await queue_depth_becomes(0)
            served = asyncio.create_task(post(client, url))  # the place is free: queued, not refused with 429
            await queue_depth_becomes(1)
            worker.status = "ready"
            assert (await served)[0] == 200 and len(worker.bodies) == 1
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), timeout=10) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


# --- hostile input and output (issue #12, findings 3 and 8) ------------------------------------------

@pytest.mark.parametrize("data, problem", [
    (b"[" * 100_000, "nested too deeply"),
    (b'{"model": "m", "model": "n"}', "duplicate key 'model'"),
    (b'{"model": "m", "temperature": 1e400}', "out of range"),
    (b'{"model": "m", "top_p": NaN}', "NaN is not a JSON number"),
    (b"\xff", "not UTF-8"),
])
async def test_hostile_json_is_a_400_with_a_json_error(client, data, problem):
    """Finding 3: a body nested 100000 deep raised RecursionError in the router (a 500); now 400."""
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url]) as (url, _):
            async with client.post(f"{url}/v1/completions", data=data) as response:
                assert response.status == 400
                error = (await response.json())["error"]
            assert error["type"] == "invalid_request_error" and problem in error["message"], error
            assert worker.bodies == []


async def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(client):
    """Finding 8: the router read any body up to 64 MiB whole before looking at it; now the
    Content-Length is checked first, and a chunked body is cut as soon as it passes the limit."""
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url], max_body_bytes=1 << 20) as (url, _):
            big = b'{"model": "m", "prompt": "' + b"a" * (4 << 20) + b'"}'

            async def chunked():
                for start in range(0, len(big), 64 << 10):
                    yield big[start:start + (64 << 10)]

            for data in (big, chunked()):
                async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as own:
                    async with own.post(f"{url}/v1/completions", data=data) as response:
                        assert response.status == 413
                        error = (await response.json())["error"]
                assert error["code"] == "request_too_large" and "limit of 1048576 bytes" in error["message"]
            status, _, _ = await post(client, url)  # the router goes on
            assert status == 200 and len(worker.bodies) == 1


async def test_a_client_that_stalls_mid_body_is_answered_408_at_the_upstream_deadline(client):
    """Review E, finding 3: the body was read with no deadline, so a client that declared 16 MiB and stalled
    held its handler and the bytes read so far for good; now it has ``upstream_timeout_s`` for the whole body."""
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url], upstream_timeout_s=0.3) as (url, _):
            status, answer = await stalled_body_answer(url, "/v1/completions")
            assert status == 408 and answer["error"]["code"] == "request_timeout", answer
            assert answer["error"]["message"] == ("the request body did not arrive within this server's deadline "
                                                  "of 0.3 s (500 of 1000 bytes received)")
            status, _, _ = await post(client, url)  # the router goes on
            assert status == 200 and len(worker.bodies) == 1


async def test_health_answers_within_a_second_while_huge_bodies_come_in(client):
    """Finding 8: decoding a body is bounded (the size limit) and done off the event loop when large."""
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url]) as (url, _):
            latencies: list[float] = []
            done = asyncio.Event()

            async def watch():
                while not done.is_set():
                    start = asyncio.get_running_loop().time()
                    async with client.get(f"{url}/health") as response:
                        assert response.status == 200
                    latencies.append(asyncio.get_running_loop().time() - start)
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch())
            try:
                over = b'{"model": "m", "prompt": "' + b"a" * (64 << 20) + b'"}'
                under = json.dumps({"model": "m", "prompt": list(range(1_000_000, 1_000_000 + (14 << 20) // 9))})
                async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as own:
                    async with own.post(f"{url}/v1/completions", data=over) as response:
                        assert response.status == 413
                    async with own.post(f"{url}/v1/completions", data=under.encode()) as response:
                        assert response.status == 200
            finally:
                done.set()
                await watcher
            assert len(latencies) > 3 and max(latencies) < 1.0, sorted(latencies)[-5:]


async def test_a_worker_answer_over_the_limit_fails_the_request_instead_of_filling_memory(client):
    """Finding 8: a worker's whole answer was read into memory however large; now at most
    max_answer_bytes of it, and the request fails (502) naming the worker."""
    async with workers(FakeWorker(behaviour="huge_answer")) as (worker,):
        async with router([worker.url], max_answer_bytes=1 << 20, max_retries=0) as (url, _):
            status, headers, answer = await post(client, url)
    assert status == 502 and headers[WORKER_HEADER] == worker.url
    assert "over the router's limit" in answer["error"]["message"]


async def test_a_stream_event_over_the_limit_ends_the_stream_with_an_error_event(client):
    """Finding 8: bytes of a worker's stream without an event end were buffered without bound; now the
    router holds at most max_event_bytes, then ends the stream with an error event."""
    async with workers(FakeWorker(behaviour="endless_event")) as (worker,):
        async with router([worker.url], max_event_bytes=256 << 10) as (url, instance):
            async with client.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                assert response.status == 200
                events = await read_events(response)
    assert json.loads(events[0]) == {"choices": [{"text": "t0"}]}
    error = json.loads(events[-1])["error"]
    assert error["code"] == "worker_failed" and "sent an event of more than 262144 bytes" in error["message"]
    assert len(events) == 2


async def test_a_slow_pipeline_listing_holds_back_neither_workers_nor_routes():
    """Found in review: workers, pipelines and routes shared one deadline, so a pipeline forming slower than it
    (thousands of receivers mid-transfer) kept every route change from the routers for the whole multicast."""
    class SlowPipelines:
        name = "control plane (stub)"
        serving_key = b""

        async def list_workers(self):
            return []

        async def list_pipelines(self):
            await asyncio.sleep(1.0)
            return []

        async def list_routes(self):
            return {"chat": (("a" * 64, 90), ("b" * 64, 10))}

    router = Router(RouterConfig(discovery_timeout_s=0.3), [SlowPipelines()])
    await router.start()
    try:
        assert router.routes == {"chat": (("a" * 64, 90), ("b" * 64, 10))}
    finally:
        await router.close()


async def test_a_discovery_source_that_fails_is_warned_of_once_an_outage(caplog):
    """Found in review: a control plane down logged three warnings every discovery interval for the whole outage
    (workers, routes and pipelines, each after its own deadline)."""
    class Down:
        name = "control plane (stub)"
        serving_key = b""
        up = False
        asked = 0

        async def list_workers(self):
            self.asked += 1
            if not self.up:
                raise ConnectionRefusedError(111, "Connection refused")
            return []

        async def list_pipelines(self):
            return []

        async def list_routes(self):
            return {}

    source = Down()
    router = Router(RouterConfig(discovery_timeout_s=0.3, discovery_interval_s=3600), [source])
    await router.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="pipecast.router.app"):
            for _ in range(3):
                await router.refresh_workers()
            source.up = True
            await router.refresh_workers()
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 2 and source.asked == 5, warned  # at the start, then once it answers again
        assert warned[0].startswith("discovery of workers from control plane (stub) failed, keeping its last 0")
        assert warned[1] == "discovery of workers from control plane (stub) answers again"
    finally:
        await router.close()


async def test_a_router_stopped_while_it_waits_on_its_control_plane_closes_its_session():
    """Found in review: Ctrl-C while the router waited for its control plane's first answer left its upstream session
    open ("Unclosed client session" at exit)."""
    class Silent:
        name = "control plane (stub)"
        serving_key = b""

        async def list_workers(self):
            await asyncio.sleep(3600)

        list_pipelines = list_routes = list_workers

    router = Router(RouterConfig(discovery_timeout_s=3600), [Silent()])
    starting = asyncio.ensure_future(router.start())
    await asyncio.sleep(0.1)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert router._session.closed


async def test_a_router_whose_token_its_control_plane_refuses_does_not_start():
    """Found in an operator's walk: it started, and logged a warning a discovery interval for good; no retry mends
    a wrong token."""
    from control_plane.errors import Unauthenticated

    class Refusing:
        name = "control plane (stub)"
        serving_key = b""

        async def list_workers(self):
            raise Unauthenticated("control plane at cp:1 refused ListWorkers: missing or wrong token")

        list_pipelines = list_routes = list_workers

    router = Router(RouterConfig(), [Refusing()])
    with pytest.raises(Unauthenticated, match="missing or wrong token"):
        await router.start()
    assert router._session.closed


async def test_a_source_that_fails_otherwise_is_warned_of_again(caplog):
    """Found in review: a control plane down at the router's start, then up and refusing its token, was warned of
    once (down) and its refusal only at debug level: the router served nothing, and said nothing why."""
    from control_plane.errors import Unauthenticated

    class DownThenRefusing:
        name = "control plane (stub)"
        serving_key = b""
        up = False

        async def list_workers(self):
            if not self.up:
                raise ConnectionRefusedError(111, "Connection refused")
            raise Unauthenticated("control plane at cp:1 refused ListWorkers: missing or wrong token")

        list_pipelines = list_routes = list_workers

    source = DownThenRefusing()
    router = Router(RouterConfig(discovery_timeout_s=0.3, discovery_interval_s=3600), [source])
    await router.start()
    try:
        source.up = True
        with caplog.at_level(logging.WARNING, logger="pipecast.router.app"):
            for _ in range(2):
                await router.refresh_workers()
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert "Connection refused" in warned[0] and len(warned) == 2, warned  # at the start, then the refusal once
        assert "missing or wrong token" in warned[1]
    finally:
        await router.close()
