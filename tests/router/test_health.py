"""The router's health poller against hostile or broken workers (issue #12, finding 3)."""

import aiohttp
import pytest
from aiohttp import web

from pipecast.router.health import MAX_HEALTH_BYTES, HealthMonitor
from pipecast.router.pool import WorkerPool


@pytest.mark.parametrize("body, problem", [
    (b"[" * 50_000, "no usable JSON"),  # deep enough to blow the recursion limit
    (b'{"status": 1e400}', "no usable JSON"),
    (b" " * (MAX_HEALTH_BYTES + 1), f"more than {MAX_HEALTH_BYTES} bytes"),
])
async def test_a_hostile_health_answer_marks_the_worker_down_and_the_poller_lives_on(body, problem):
    answers = [body]

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=answers[-1], content_type="application/json")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    pool = WorkerPool()
    pool.sync({url: "w1"})
    try:
        async with aiohttp.ClientSession() as session:
            monitor = HealthMonitor(pool, session, interval_s=0.05, timeout_s=2.0)
            await monitor.poll(url)
            worker = pool.get(url)
            assert worker is not None and problem in worker.problem
            answers.append(b"{}")  # the same poller goes on: a later answer is read and judged on its own
            await monitor.poll(url)
            assert problem not in pool.get(url).problem
    finally:
        await runner.cleanup()
