"""What the router forgets over a long life: the counters of versions no longer routed or served, and the
metric series of workers that left the pool (with the fake workers of test_app)."""

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pipecast.router.app import Router, RouterConfig
from pipecast.router.discovery import DiscoveredWorker
from pipecast.router.signals import MAX_VERSIONS, VERSION_IDLE_S
from pipecast.scaler.signals import add_up, parse_stats
from tests.router.test_app import BODY, CLIENT_TIMEOUT, FAST, FakeWorker, eventually, serving_router, workers

pytestmark = pytest.mark.timeout(30)


def package(name: object) -> str:
    return hashlib.sha256(str(name).encode()).hexdigest()


class Source:
    """A discovery source whose workers and routes the test sets."""

    name = "test"
    serving_key = b""

    def __init__(self) -> None:
        self.workers: list[DiscoveredWorker] = []
        self.routes: dict = {}

    async def list_workers(self) -> list[DiscoveredWorker]:
        return list(self.workers)

    async def list_pipelines(self) -> list:
        return []

    async def list_routes(self) -> dict:
        return dict(self.routes)


def count(instance: Router, version: str) -> None:
    """Count a request for ``version`` that arrived and was admitted, as the router does."""
    instance.signals.admission(instance.signals.arrived("t", 1, version), True, version)


async def stream(session: aiohttp.ClientSession, url: str) -> int:
    """A streamed request's status, once read whole."""
    async with session.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
        await response.read()
        return response.status


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client:
        yield client


async def test_versions_neither_routed_nor_served_are_forgotten_so_new_ones_are_counted(session):
    """Found in review: counters were kept for every version a router ever routed, and past MAX_VERSIONS a new
    one got none: absent from /stats, its waiting request counted in an old deployment's queue."""
    now = [time.monotonic()]
    source = Source()
    instance = Router(RouterConfig(**FAST), [source], clock=lambda: now[0])
    stable = package("stable")
    async with serving_router(instance) as url:
        for i in range(MAX_VERSIONS - 1):  # rollouts over the router's life, each version asked once
            source.routes = {"m": ((package(i), 100),), "kept": ((stable, 100),)}
            await instance.refresh_workers()
            count(instance, stable if i == 0 else package(i))
            now[0] += 1.0
        now[0] += VERSION_IDLE_S
        source.routes = {"m": ((package("new"), 100),), "kept": ((stable, 100),)}
        await instance.refresh_workers()
        count(instance, package("new"))
        async with session.get(f"{url}/stats") as response:
            stats = await response.json()
        async with session.get(f"{url}/metrics") as response:
            metrics = await response.text()
    assert set(stats["versions"]) == {stable, package("new")}  # the stable version is still routed
    assert add_up(0.0, [parse_stats(url, stats)], {}, package("new")).arrived == 1
    assert metrics.count("pipecast_router_version_requests_total{") == 2 * 3


async def test_the_series_of_workers_that_left_the_pool_are_dropped(session):
    """Found in review: counters labelled by worker URL stayed for good after the worker left (pod addresses
    change with every generation)."""
    source = Source()
    instance = Router(RouterConfig(**FAST), [source])
    go = asyncio.Event()  # both hold their request until then: one each
    async with serving_router(instance) as url:
        async with workers(FakeWorker(behaviour="die_before", gate=go), FakeWorker(gate=go)) as fakes:
            source.workers = [DiscoveredWorker(node_id=f"n{i}", url=fake.url) for i, fake in enumerate(fakes)]
            await instance.refresh_workers()
            await eventually(lambda: instance.pool.serving(instance.clock()) == 2)
            requests = [asyncio.create_task(stream(session, url)) for _ in fakes]
            await eventually(lambda: all(fake.bodies for fake in fakes))
            go.set()
            assert await asyncio.gather(*requests) == [200, 200]  # the failed one retried on the other
        before = instance.metrics.render()[0].decode()
        source.workers = []
        await instance.refresh_workers()
        after = instance.metrics.render()[0].decode()
    assert f'pipecast_router_retries_total{{worker="{fakes[0].url}"}}' in before and fakes[1].url in before
    assert not any(fake.url in after for fake in fakes)
