"""The router's /stats and per-tenant admission over real sockets, with the fake workers of test_app."""

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pipecast.core.settings import MIN_TENANT_RATE, TenantLimit
from pipecast.router.admission import AdmissionConfig
from pipecast.scaler.signals import add_up, parse_stats
from pipecast.serve.health import MAX_COUNT
from tests.router.test_app import BODY, CLIENT_TIMEOUT, FakeWorker, eventually, post, router, workers

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client:
        yield client


async def stats_of(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/stats") as response:
        assert response.status == 200 and response.content_type == "application/json"
        return await response.json()


async def post_as(session: aiohttp.ClientSession, url: str, key: str) -> tuple[int, str | None, dict]:
    """POST the test body with API key ``key``: its status, Retry-After and JSON answer."""
    async with session.post(f"{url}/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}) as response:
        return response.status, response.headers.get("Retry-After"), await response.json()


async def post_tenant(session: aiohttp.ClientSession, url: str, tenant: str) -> int:
    """POST the test body as ``tenant`` (its header): the status."""
    async with session.post(f"{url}/v1/completions", json=BODY, headers={"x-pipecast-tenant": tenant}) as response:
        await response.read()
        return response.status


async def test_stats_count_requests_and_show_each_worker(session):
    gate = asyncio.Event()
    async with workers(FakeWorker(gate=gate), FakeWorker(status="loading")) as (ready, loading):
        async with router([ready.url, loading.url]) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            assert (await post(session, url))[0] == 200
            assert (await post(session, url, prompt="abcdefghijkl"))[0] == 200  # ~3 tokens of text
            async with session.post(f"{url}/v1/completions", data=b"{not json") as response:
                assert response.status == 400  # not counted: no valid body
            async with session.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                await response.content.readuntil(b"\n\n")  # the first event; the worker waits at the gate
                during = await stats_of(session, url)
                gate.set()
                await response.read()
            after = await stats_of(session, url)
    assert during["in_flight"] == 1 and during["queue_depth"] == 0
    workers_during = {worker["url"]: worker for worker in during["workers"]}
    assert workers_during[ready.url] == {"url": ready.url, "node_id": ready.url, "status": "ready", "in_flight": 1,
                                         "queue_depth": 0, "idle_s": None}
    assert workers_during[loading.url]["status"] == "loading" and workers_during[loading.url]["idle_s"] > 0
    assert during["counters"] == {"arrived": 3, "prompt_tokens": 9, "admitted": 3, "answered": 2, "rejected": 0,
                                  "failed": 0}
    assert during["ttft"]["count"] == 3  # the stream's first event has reached the client
    assert after["counters"] == {"arrived": 3, "prompt_tokens": 9, "admitted": 3, "answered": 3, "rejected": 0,
                                 "failed": 0}
    assert after["in_flight"] == 0
    assert after["tenants"] == {"default": {"arrived": 3, "admitted": 3, "rejected": 0, "queued": 0}}
    ttft = after["ttft"]
    assert ttft["window_s"] == 60.0 and ttft["count"] == 3 and 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"] < 5
    assert {worker["url"]: worker["idle_s"] for worker in after["workers"]}[ready.url] >= 0
    assert after["started_unix"] <= after["now_unix"]


async def test_stats_count_the_routers_429s_and_5xx(session):
    async with workers(FakeWorker(status="loading")) as (worker,):
        async with router([worker.url], max_queue=1, queue_timeout_s=0.3) as (url, instance):
            queued = asyncio.create_task(post(session, url))
            await eventually(lambda: instance.dispatcher.waiting == 1)
            assert (await stats_of(session, url))["queue_depth"] == 1
            assert (await post(session, url))[0] == 429  # queue full
            assert (await queued)[0] == 503  # its deadline
            stats = await stats_of(session, url)
    # The queue's 429 was admitted (by its tenant's limit): demand the pool did not meet.
    assert stats["counters"] == {"arrived": 2, "prompt_tokens": 6, "admitted": 2, "answered": 0, "rejected": 1,
                                 "failed": 1}
    assert stats["ttft"] == {"window_s": 60.0, "count": 0, "p50": None, "p95": None, "p99": None}
    assert stats["queue_depth"] == 0


async def test_a_worker_reporting_a_queue_beyond_any_real_one_is_down_and_the_stats_stay_readable(session):
    """Found in review: the router copied a worker's queue_depth of 2**60 into its /stats, which the scaler then
    refused whole: every deployment behind the router lost its signals."""
    async with workers(FakeWorker(queue_depth=2 ** 60), FakeWorker()) as (huge, fine):
        async with router([huge.url, fine.url]) as (url, instance):
            await eventually(lambda: instance.pool.get(huge.url).problem and instance.pool.serving(instance.clock()))
            stats = await stats_of(session, url)
    assert instance.pool.get(huge.url).problem == (f"worker {huge.url}: /health field 'queue_depth' is {2 ** 60}, "
                                                   f"more than {MAX_COUNT}")
    assert {worker["url"]: worker["status"] for worker in stats["workers"]} == {huge.url: "down", fine.url: "ready"}
    assert parse_stats(url, stats)["workers"]


async def test_a_request_refused_for_its_tenants_rate_arrived_but_was_not_admitted(session):
    """Found in review: the scaler took its arrival rate from ``arrived``, refusals included (1 admitted, 93
    refused for the tenant's rate: 7 replicas added for requests no replica would serve). ``admitted`` counts
    those the tenant's limit let through, in the totals and per version, and the scaler reads it. A refused
    request counts for no version: it is refused before its body, which names the model, is read."""
    package = "p" * 64
    admission = AdmissionConfig(limits={"a": TenantLimit(rate=0.01, burst=1)})
    async with workers(FakeWorker(model="m", package_id=package)) as (worker,):
        async with router([worker.url], admission=admission) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            statuses = [await post_tenant(session, url, "a") for _ in range(4)]
            stats = await stats_of(session, url)
    assert statuses == [200, 429, 429, 429]
    assert (stats["counters"]["arrived"], stats["counters"]["admitted"]) == (4, 1)
    assert {k: stats["versions"][package]["counters"][k] for k in ("arrived", "admitted")} == {"arrived": 1,
                                                                                                "admitted": 1}
    assert add_up(0.0, [parse_stats(url, stats)], {}).arrived == 1
    assert add_up(0.0, [parse_stats(url, stats)], {}, package).arrived == 1


async def test_a_tenant_over_its_limit_is_refused_before_its_body_is_read(session):
    """Found in review: the limit was checked once the whole body was read (up to 16 MiB, for up to the upstream
    deadline) and decoded, so a tenant over it cost the router as much as an admitted one. Now its 429 leaves
    at its headers, closing the connection (the body is never read), and it counts no prompt tokens."""
    admission = AdmissionConfig(limits={"a": TenantLimit(rate=0.01, burst=1)})
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url], admission=admission) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            assert await post_tenant(session, url, "a") == 200
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nx-pipecast-tenant: a\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{")
                async with asyncio.timeout(2):
                    head = await reader.readuntil(b"\r\n\r\n")
            finally:
                writer.close()
            stats = await stats_of(session, url)
    assert head.startswith(b"HTTP/1.1 429 ") and b"\r\nConnection: close\r\n" in head
    assert stats["counters"] | {"answered": 0} == {"arrived": 2, "prompt_tokens": 3, "admitted": 1, "answered": 0,
                                                   "rejected": 1, "failed": 0}


async def test_a_versions_ready_s_runs_from_when_a_worker_of_it_turned_ready(session):
    """So that the canary gate does not judge a version's TTFT on the requests that waited for its cold start
    (``pipecast.scaler.gate``)."""
    package = "p" * 64
    async with workers(FakeWorker(model="m", package_id=package, status="loading")) as (worker,):
        async with router([worker.url]) as (url, instance):
            await eventually(lambda: package in instance.pool.serving_packages())
            waiting = asyncio.create_task(post(session, url))  # counted for the version; waits for its worker
            await eventually(lambda: instance.waiting == 1)
            loading = await stats_of(session, url)
            worker.status = "ready"
            assert (await waiting)[0] == 200
            ready = await stats_of(session, url)
            instance.pool.record_unreachable(worker.url, "connection refused")
            down = await stats_of(session, url)
    assert loading["versions"][package]["ready_s"] is None
    assert 0 <= ready["versions"][package]["ready_s"] < 5
    assert down["versions"][package]["ready_s"] is None


async def test_a_versions_in_flight_counts_its_requests_while_their_workers_health_polls_fail(session):
    """Found in review: a version's in_flight was read of its workers' last health answer, None after one failed
    poll (a worker short of CPU mid-request), so its requests vanished from /stats, and a scaler could release the
    replica serving them. It is counted as requests are dispatched and released."""
    package, gate = "p" * 64, asyncio.Event()
    async with workers(FakeWorker(model="m", package_id=package, gate=gate)) as (worker,):
        async with router([worker.url]) as (url, instance):
            await eventually(lambda: package in instance.pool.serving_packages())
            async with session.post(f"{url}/v1/completions", json=BODY | {"stream": True}) as response:
                await response.content.readuntil(b"\n\n")  # the first event; the worker waits at the gate
                worker.health_code = 503  # its polls fail while it serves the request
                await eventually(lambda: instance.pool.get(worker.url).health is None)
                during = await stats_of(session, url)
                worker.health_code = 200
                gate.set()
                await response.read()
            after = await stats_of(session, url)
    assert (during["in_flight"], during["versions"][package]["in_flight"]) == (1, 1)
    assert (after["in_flight"], after["versions"][package]["in_flight"]) == (0, 0)


async def test_a_tenant_over_its_limit_gets_429_while_another_passes(session):
    admission = AdmissionConfig(limits={"a": TenantLimit(rate=0.5, burst=2)})
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url], admission=admission) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            tenant_a, tenant_b = {"x-pipecast-tenant": "a"}, {"x-pipecast-tenant": "b"}
            answers = []
            for headers in (tenant_a, tenant_a, tenant_a, tenant_b, tenant_b, tenant_b):
                async with session.post(f"{url}/v1/completions", json=BODY, headers=headers) as response:
                    answers.append((response.status, response.headers.get("Retry-After"), await response.json()))
            stats = await stats_of(session, url)
            async with session.get(f"{url}/metrics") as response:
                metrics = await response.text()
    assert [status for status, _, _ in answers] == [200, 200, 429, 200, 200, 200]
    _, retry_after, refusal = answers[2]
    assert retry_after == "2"  # one token back at 0.5/s: just under 2 s, rounded up
    assert refusal == {"error": {"message": "tenant 'a' is over its rate of 0.5 requests/s (burst 2); retry after 2 s",
                                 "type": "rate_limit_error", "param": None, "code": "rate_limited"}}
    assert len(worker.bodies) == 5
    assert stats["tenants"] == {"a": {"arrived": 3, "admitted": 2, "rejected": 1, "queued": 0},
                                "b": {"arrived": 3, "admitted": 3, "rejected": 0, "queued": 0}}
    assert stats["counters"]["rejected"] == 1 and stats["counters"]["answered"] == 5
    assert 'pipecast_router_tenant_rejected_total{tenant="a"} 1.0' in metrics
    assert 'pipecast_router_requests_rejected_total{reason="rate_limited"} 1.0' in metrics


async def test_a_tenant_at_the_slowest_rate_is_told_to_retry_within_an_hour_not_a_day(session):
    """Found in review: a rate of 1e-320/s made every refusal a 500 (after /stats counted it), and 1e-9/s a
    Retry-After of 31 years. The settings take one request a day at the slowest, and Retry-After is capped."""
    admission = AdmissionConfig(limits={"a": TenantLimit(rate=MIN_TENANT_RATE, burst=1)})
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url], admission=admission) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            answers = []
            for _ in range(2):
                async with session.post(f"{url}/v1/completions", json=BODY,
                                        headers={"x-pipecast-tenant": "a"}) as response:
                    answers.append((response.status, response.headers.get("Retry-After"), await response.json()))
            stats = await stats_of(session, url)
    assert [status for status, _, _ in answers] == [200, 429]
    assert answers[1][1:] == ("3600", {"error": {"message": "tenant 'a' is over its rate of 1.15741e-05 requests/s "
                                                            "(burst 1); retry after 3600 s", "type": "rate_limit_error",
                                                 "param": None, "code": "rate_limited"}})
    assert stats["tenants"] == {"a": {"arrived": 2, "admitted": 1, "rejected": 1, "queued": 0}}


async def test_with_api_keys_a_request_needs_a_known_key_which_names_its_tenant(session):
    admission = AdmissionConfig(api_keys={"key-of-a": "a"}, limits={"a": TenantLimit(rate=1.0, burst=1)})
    async with workers(FakeWorker()) as (worker,):
        async with router([worker.url], admission=admission) as (url, instance):
            await eventually(lambda: instance.pool.serving(instance.clock()) == 1)
            refusals = []
            for headers in ({"x-pipecast-tenant": "a"}, {"Authorization": "Bearer key-of-b"}):
                async with session.post(f"{url}/v1/completions", json=BODY, headers=headers) as response:
                    refusals.append((response.status, response.headers.get("WWW-Authenticate"),
                                     await response.json()))
            accepted, _, _ = await post_as(session, url, "key-of-a")
            limited, _, answer = await post_as(session, url, "key-of-a")
            stats = await stats_of(session, url)
    hint = "send `Authorization: Bearer <key>` with a key the router knows"
    assert refusals == [
        (401, "Bearer", {"error": {"message": f"missing API key: {hint}", "type": "authentication_error",
                                   "param": None, "code": "invalid_api_key"}}),
        (401, "Bearer", {"error": {"message": f"unknown API key: {hint}", "type": "authentication_error",
                                   "param": None, "code": "invalid_api_key"}}),
    ]
    assert (accepted, limited) == (200, 429) and answer["error"]["message"].startswith("tenant 'a' is over")
    assert len(worker.bodies) == 1
    assert stats["tenants"] == {"a": {"arrived": 2, "admitted": 1, "rejected": 1, "queued": 0}}
    assert stats["counters"]["arrived"] == 2  # the 401s are nobody's requests


async def test_stats_show_each_tenants_requests_waiting_in_the_router(session):
    async with workers(FakeWorker(status="loading")) as (worker,):
        async with router([worker.url], queue_timeout_s=0.5) as (url, instance):
            waiting = [asyncio.create_task(post_tenant(session, url, tenant)) for tenant in ("a", "a", "b")]
            await eventually(lambda: instance.dispatcher.waiting == 3)
            stats = await stats_of(session, url)
            assert await asyncio.gather(*waiting) == [503] * 3
    assert stats["queue_depth"] == 3
    assert {name: counts["queued"] for name, counts in stats["tenants"].items()} == {"a": 2, "b": 1}
