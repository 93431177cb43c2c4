"""The router's health poller against hostile or broken workers (issue #12, finding 3)."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from pipecast.router import health as health_module
from pipecast.router.errors import HealthAnswerError
from pipecast.router.health import MAX_HEALTH_BYTES, MAX_MODEL_CHARS, HealthMonitor, parse_health, vllm_health
from pipecast.router.pool import WorkerPool
from pipecast.serve.health import MAX_COUNT, WorkerHealth
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


async def test_a_vllm_workers_model_name_is_read_again_after_a_failed_poll():
    """Found in review: the served name was read once per URL for good, so a vLLM worker restarted at the same URL
    with another model kept the old name in the router (requests for the new one found no worker)."""
    served = {"id": "model-a", "up": True}

    async def answer(request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": served["id"], "object": "model"}]})
        if request.path == "/health" and not served["up"]:
            return web.Response(status=503)
        return web.Response(text=VLLM_METRICS if request.path == "/metrics" else "")

    async with worker_app(dict.fromkeys(("/health", "/v1/models", "/metrics"), answer)) as (url, pool):
        async with aiohttp.ClientSession() as session:
            monitor = HealthMonitor(pool, session, interval_s=10.0, timeout_s=2.0)
            monitor.sync([url], {url: "vllm"})
            try:
                await monitor.poll(url)
                assert pool.get(url).health.model == "model-a"
                served["up"] = False  # restarting
                await monitor.poll(url)
                assert pool.get(url).status == "down"
                served.update(id="model-b", up=True)
                await monitor.poll(url)
                assert pool.get(url).health.model == "model-b"
            finally:
                await monitor.close()


async def test_a_vllm_metrics_page_of_many_tcp_segments_is_read_whole():
    """Review E, finding 2: one ``read(n)`` returned the first segment that arrived, so across hosts a vLLM
    page (tens of kB, its gauges after the process collectors) lacked num_requests_waiting: worker down."""
    page = "".join(f'python_gc_objects_collected_total{{generation="{i}"}} 1.0\n' for i in range(400)) + VLLM_METRICS

    async def answer(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "chat", "object": "model"}]})
        return await answer_in_pieces(request, page.encode() if request.path == "/metrics" else b"", "text/plain")

    async with worker_app(dict.fromkeys(("/health", "/v1/models", "/metrics"), answer)) as (url, pool):
        await poll_vllm_once(url, pool, timeout_s=5.0)
    worker = pool.get(url)
    assert (worker.status, worker.problem) == ("ready", ""), worker.problem
    assert (worker.health.queue_depth, worker.health.running) == (3, 2)


async def poll_vllm_once(url: str, pool: WorkerPool, *, timeout_s: float) -> None:
    """One health poll of the vLLM worker at ``url`` (the monitor's own timer far off), its result in ``pool``."""
    async with aiohttp.ClientSession() as session:
        monitor = HealthMonitor(pool, session, interval_s=10.0, timeout_s=timeout_s)
        monitor.sync([url], {url: "vllm"})
        await monitor.poll(url)
        await monitor.close()


def metrics_with(waiting: str) -> str:
    """A vLLM /metrics page whose num_requests_waiting gauge reads ``waiting``."""
    return VLLM_METRICS.replace("model_name=\"chat\"} 3.0", f"model_name=\"chat\"}} {waiting}")


@pytest.mark.parametrize("waiting, total", [("NaN", "nan"), ("+Inf", "inf"), ("-Inf", "-inf"),
                                            ("3e12", "3000000000000.0")])
def test_a_vllm_gauge_that_is_no_count_marks_the_worker_down(waiting, total):
    """Found in review: int() of NaN or inf raised ValueError or OverflowError, which ended the worker's poller."""
    with pytest.raises(HealthAnswerError) as info:
        vllm_health("w", metrics_with(waiting), "chat")
    assert str(info.value) == f"worker w: /metrics vllm:num_requests_waiting adds up to {total}, not a count of at " \
                              f"most {MAX_COUNT}"


@asynccontextmanager
async def vllm_worker(page: list[str], model_id: object = "chat") -> AsyncIterator[tuple[str, WorkerPool]]:
    """A vLLM worker serving ``model_id`` whose /metrics answers ``page[-1]`` (append to change it)."""
    async def answer(request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": model_id, "object": "model"}]})
        return web.Response(text=page[-1] if request.path == "/metrics" else "")

    async with worker_app(dict.fromkeys(("/health", "/v1/models", "/metrics"), answer)) as (url, pool):
        yield url, pool


async def watched_until(url: str, pool: WorkerPool, condition) -> None:
    """Wait until ``condition(worker)`` holds of the worker at ``url`` (its poller runs meanwhile)."""
    async with asyncio.timeout(5):
        while not condition(pool.get(url)):
            await asyncio.sleep(0.01)


async def test_a_nan_gauge_marks_a_vllm_worker_down_and_its_poller_reads_the_next_page():
    """Found in review: a NaN gauge ended the worker's poller, so the router kept the worker ready for ever (even
    once it was gone)."""
    page = [metrics_with("NaN")]
    async with vllm_worker(page) as (url, pool):
        async with aiohttp.ClientSession() as session:
            monitor = HealthMonitor(pool, session, interval_s=0.02, timeout_s=2.0)
            monitor.sync([url], {url: "vllm"})
            try:
                await watched_until(url, pool, lambda worker: worker.status == "down")
                assert pool.get(url).problem == f"worker {url}: /metrics vllm:num_requests_waiting adds up to nan, " \
                                                f"not a count of at most {MAX_COUNT}"
                page.append(VLLM_METRICS)
                await watched_until(url, pool, lambda worker: worker.status == "ready")
                assert pool.get(url).health.queue_depth == 3
            finally:
                await monitor.close()


async def test_a_poll_that_fails_as_no_check_foresaw_marks_the_worker_down_and_polling_goes_on(monkeypatch):
    """Found in review: any exception but the foreseen ones ended the worker's poller: the worker kept its last
    answer for ever."""
    failures = [RuntimeError("unforeseen")]

    def parse_once_failing(worker: str, answer: object) -> WorkerHealth:
        if failures:
            raise failures.pop()
        return parse_health(worker, answer)

    monkeypatch.setattr(health_module, "parse_health", parse_once_failing)
    answers = [{"status": "ready", "blocks_present": 1, "blocks_total": 1, "queue_depth": 0, "running": 0,
                "max_queue": 0}]

    async def health(request: web.Request) -> web.Response:
        return web.json_response(answers[-1])

    async with worker_app({"/health": health}) as (url, pool):
        async with aiohttp.ClientSession() as session:
            monitor = HealthMonitor(pool, session, interval_s=0.02, timeout_s=2.0)
            monitor.sync([url])
            try:
                await watched_until(url, pool, lambda worker: worker.problem)
                assert pool.get(url).problem == f"worker {url}: health poll failed: RuntimeError: unforeseen"
                await watched_until(url, pool, lambda worker: worker.status == "ready")
            finally:
                await monitor.close()


async def test_a_worker_whose_poller_ended_is_polled_again_at_the_next_sync():
    """Found in review: sync started pollers only for the URLs it had none for, an ended one included."""
    answers: list[str] = []

    async def health(request: web.Request) -> web.Response:
        answers.append(request.path)
        return web.json_response({"status": "ready", "blocks_present": 1, "blocks_total": 1, "queue_depth": 0,
                                  "running": 0, "max_queue": 0})

    async with worker_app({"/health": health}) as (url, pool):
        async with aiohttp.ClientSession() as session:
            monitor = HealthMonitor(pool, session, interval_s=0.02, timeout_s=2.0)
            monitor.sync([url])
            ended = monitor._tasks[url]
            ended.cancel()
            await asyncio.gather(ended, return_exceptions=True)
            polled = len(answers)
            monitor.sync([url])
            try:
                async with asyncio.timeout(5):
                    while len(answers) < polled + 2:
                        await asyncio.sleep(0.01)
                assert monitor._tasks[url] is not ended
            finally:
                await monitor.close()


@pytest.mark.parametrize("model_id", [{"name": "chat"}, 7, None, "", "chat\nx", "m" * (MAX_MODEL_CHARS + 1)])
async def test_a_vllm_worker_naming_no_usable_model_is_down(model_id):
    """Found in review: a model id that was not text was stored, and the router's GET /v1/models failed (500) for
    every client."""
    async with vllm_worker([VLLM_METRICS], model_id) as (url, pool):
        await poll_vllm_once(url, pool, timeout_s=2.0)
    worker = pool.get(url)
    assert (worker.status, worker.problem) == ("down", f"worker {url}: /v1/models names no model")
