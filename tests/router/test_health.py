"""The router's health poller against hostile or broken workers (issue #12, finding 3)."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from pipecast.router.errors import HealthAnswerError
from pipecast.router.health import MAX_HEALTH_BYTES, HealthMonitor, vllm_health
from pipecast.router.pool import WorkerPool
from tests.core.test_httpserve import answer_in_pieces


@asynccontextmanager
async def worker_app(handlers: dict) -> AsyncIterator[tuple[str, WorkerPool]]:
    """A worker's GET ``handlers`` (path -> handler) on a free loopback port, and a pool holding it."""
    app = web.Application()
    for path, handler in handlers.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    pool = WorkerPool()
    pool.sync({url: "w1"})
    try:
        yield url, pool
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("body, problem", [
    (b"[" * 50_000, "no usable JSON"),  # deep enough to blow the recursion limit
    (b'{"status": 1e400}', "no usable JSON"),
    (b" " * (MAX_HEALTH_BYTES + 1), f"more than {MAX_HEALTH_BYTES} bytes"),
])
async def test_a_hostile_health_answer_marks_the_worker_down_and_the_poller_lives_on(body, problem):
    answers = [body]

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=answers[-1], content_type="application/json")

    async with worker_app({"/health": health}) as (url, pool):
        async with aiohttp.ClientSession() as session:
            monitor = HealthMonitor(pool, session, interval_s=0.05, timeout_s=2.0)
            await monitor.poll(url)
            worker = pool.get(url)
            assert worker is not None and problem in worker.problem
            answers.append(b"{}")  # the same poller goes on: a later answer is read and judged on its own
            await monitor.poll(url)
            assert problem not in pool.get(url).problem


VLLM_METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="chat"} 3.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="chat"} 2.0
"""


def test_a_vllm_workers_queue_is_read_from_its_metrics():
    health = vllm_health("w", VLLM_METRICS, "chat")
    assert (health.status, health.queue_depth, health.running, health.model) == ("ready", 3, 2, "chat")
    assert health.can_serve and health.fraction_present == 1.0
    with pytest.raises(HealthAnswerError, match=r"worker w: /metrics has no vllm:num_requests_running \(not a vLLM "
                                                r"worker\?\)"):
        vllm_health("w", VLLM_METRICS.replace("vllm:num_requests_running", "other"), "chat")


async def test_a_vllm_worker_is_polled_at_health_models_and_metrics():
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.path)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "chat", "object": "model"}]})
        return web.Response(text=VLLM_METRICS if request.path == "/metrics" else "")

    async with worker_app(dict.fromkeys(("/health", "/v1/models", "/metrics"), answer)) as (url, pool):
        async with aiohttp.ClientSession() as session:
            monitor = HealthMonitor(pool, session, interval_s=0.02, timeout_s=2.0)
            monitor.sync([url], {url: "vllm"})
            async with asyncio.timeout(5):
                while seen.count("/metrics") < 3:
                    await asyncio.sleep(0.01)
            await monitor.close()
    health = pool.get(url).health
    assert (health.status, health.queue_depth, health.model) == ("ready", 3, "chat")
    assert seen[:3] == ["/health", "/v1/models", "/metrics"] and seen.count("/v1/models") == 1  # asked once


async def test_a_vllm_metrics_page_of_many_tcp_segments_is_read_whole():
    """Review E, finding 2: one ``read(n)`` returned the first segment that arrived, so across hosts a vLLM
    page (tens of kB, its gauges after the process collectors) lacked num_requests_waiting: worker down."""
    page = "".join(f'python_gc_objects_collected_total{{generation="{i}"}} 1.0\n' for i in range(400)) + VLLM_METRICS

    async def answer(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "chat", "object": "model"}]})
        return await answer_in_pieces(request, page.encode() if request.path == "/metrics" else b"", "text/plain")

    async with worker_app(dict.fromkeys(("/health", "/v1/models", "/metrics"), answer)) as (url, pool):
        async with aiohttp.ClientSession() as session:
            monitor = HealthMonitor(pool, session, interval_s=10.0, timeout_s=5.0)
            monitor.sync([url], {url: "vllm"})
            await monitor.poll(url)
            await monitor.close()
    worker = pool.get(url)
    assert (worker.status, worker.problem) == ("ready", ""), worker.problem
    assert (worker.health.queue_depth, worker.health.running) == (3, 2)
