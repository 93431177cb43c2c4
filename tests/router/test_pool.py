"""The router's pure logic: health parsing, worker choice, availability, the bounded queue, discovery."""

import asyncio
import dataclasses
import json
import pytest

from pipecast.router.app import complete_events_end, ends_done, has_error_event, retry_after_seconds
from pipecast.router.discovery import (
    SERVE_URL_LABEL,
    ControlPlaneDiscovery,
    DiscoveredPipeline,
    DiscoveredWorker,
    StaticDiscovery,
)
from pipecast.router.errors import (
    HealthAnswerError,
    QueueFullError,
    QueueTimeoutError,
    RouterClosedError,
    WorkerUrlError,
)
from pipecast.router.health import parse_health
from pipecast.router.pool import (
    LOADING_STALL_S,
    MAX_REMEMBERED_NAMES,
    PIPELINE_RETRY_S,
    UNANSWERED_GRACE_S,
    Dispatcher,
    WorkerPool,
)
from pipecast.serve.health import WorkerHealth
from pipecast.v1.control_pb2 import PackageBlocks, Peer, WorkerSpec, WorkerState

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def health(status="ready", queue_depth=0, present=8, total=8, max_queue=16, running=0,
           max_batch=0, package_id=None) -> WorkerHealth:
    return WorkerHealth(status=status, blocks_present=present, blocks_total=total, queue_depth=queue_depth,
                        running=running, max_queue=max_queue, max_batch=max_batch, package_id=package_id)


def pool_of(**states: WorkerHealth) -> WorkerPool:
    """A pool of workers named by keyword (a, b, c) with the given health, polled at time 0 (its clock's
    only time: equally loaded workers are then told apart by their url)."""
    pool = WorkerPool(clock=lambda: 0.0)
    urls = {name: f"http://{name}:1" for name in states}
    pool.sync({url: name for name, url in urls.items()})
    for name, state in states.items():
        pool.record_health(urls[name], state, polled_at=0.0)
    return pool


# --- health answers ---------------------------------------------------------------------------------

def test_health_answer_is_parsed():
    answer = {"status": "partial", "blocks_present": 3, "blocks_total": 8, "queue_depth": 2, "running": 1,
              "max_queue": 64}
    assert parse_health(A, answer) == WorkerHealth("partial", 3, 8, 2, 1, 64, max_batch=0)  # an older worker
    assert parse_health(A, {**answer, "max_batch": 16}).max_batch == 16


@pytest.mark.parametrize("answer, message", [
    ([], "worker http://a:1: /health answered list, not a JSON object"),
    ({"status": "warming"}, "worker http://a:1: /health status 'warming' is not one of loading, partial, ready"),
    ({"status": "ready", "blocks_present": -1},
     "worker http://a:1: /health field 'blocks_present' is -1, not a count"),
    ({"status": "ready", "blocks_present": True},
     "worker http://a:1: /health field 'blocks_present' is True, not a count"),
    ({"status": "ready", "blocks_present": 1, "blocks_total": 2, "queue_depth": 0, "running": 0},
     "worker http://a:1: /health field 'max_queue' is None, not a count"),
])
def test_bad_health_answers_are_the_workers_fault(answer, message):
    with pytest.raises(HealthAnswerError) as info:
        parse_health(A, answer)
    assert str(info.value) == message
    assert info.value.worker == A


# --- choice -----------------------------------------------------------------------------------------

def test_least_loaded_worker_is_chosen_counting_in_flight_and_reported_queue():
    pool = pool_of(a=health(queue_depth=2), b=health(queue_depth=0), c=health(queue_depth=1))
    assert pool.choose(now=1.0).url == B
    pool.begin(B)
    pool.begin(B)  # b: 2 in flight -> c (1 queued) is now least loaded
    assert pool.choose(now=1.0).url == C
    pool.finish(pool.get(B))
    pool.finish(pool.get(B))
    assert pool.choose(now=1.0).url == B


def test_ready_beats_partial_at_equal_load_but_an_idle_partial_beats_a_busy_ready():
    pool = pool_of(a=health("partial", present=7), b=health("ready"))
    assert pool.choose(now=1.0).url == B
    pool.begin(B)
    assert pool.choose(now=1.0).url == A


def test_among_partial_workers_the_one_holding_more_blocks_wins():
    pool = pool_of(a=health("partial", present=6, total=7), b=health("partial", present=7, total=8))
    assert pool.choose(now=1.0).url == B


def test_a_partial_worker_is_offered_requests_only_once_it_lacks_at_most_one_block():
    pool = pool_of(a=health("partial", present=6, total=8))
    assert pool.choose(now=1.0) is None  # it can start, but may well finish after another worker
    pool.record_health(A, health("partial", present=7, total=8), polled_at=1.0)
    assert pool.choose(now=1.0).url == A


def test_a_partial_worker_takes_one_batch_then_requests_wait_for_a_worker_that_can_serve_sooner():
    pool = pool_of(a=health("partial", present=7, max_batch=2), b=health("loading", present=5))
    for _ in range(2):
        pool.begin(pool.choose(now=1.0).url)
    assert pool.choose(now=1.0) is None  # a third would wait for a's transfer and its batch
    pool.record_health(B, health("partial", present=7, max_batch=2), polled_at=1.0)
    assert pool.choose(now=1.0).url == B
    pool.record_health(A, health("ready", max_batch=2, running=2), polled_at=1.0)
    pool.begin(B)
    pool.begin(B)
    assert pool.choose(now=1.0).url == A  # a ready worker queues more itself: it runs them as slots free


def test_while_tenants_share_the_pool_a_request_goes_apart_from_the_others_and_beside_its_own():
    pool = pool_of(a=health(), b=health(), c=health())
    pool.begin(pool.choose(now=1.0, tenant="burst").url, "burst")  # a
    # its next goes beside it (not to an idle worker): the idle ones stay free for the other tenants
    assert pool.choose(now=1.0, tenant="burst").url == A
    pool.begin(A, "burst")
    assert pool.choose(now=1.0, tenant="steady").url == B
    pool.begin(B, "steady")
    pool.begin(C, "steady")
    pool.begin(C, "steady")  # c has more requests in flight than a, but all of steady's own
    assert pool.choose(now=1.0, tenant="steady").url == C
    assert pool.choose(now=1.0, tenant="other").url == B  # fewest of other tenants' (1, then least loaded)
    assert pool.choose(now=1.0).url == B  # no tenant given (one active): least loaded only
    pool.finish(pool.get(A), "burst")
    pool.finish(pool.get(A), "burst")
    assert pool.workers()[0].tenants == {} and pool.choose(now=1.0, tenant="steady").url == C
    assert pool.choose(now=1.0, tenant="burst").url == A


def test_light_traffic_stays_on_the_worker_used_last_so_the_others_go_idle():
    now = [0.0]
    pool = WorkerPool(clock=lambda: now[0])
    pool.sync({A: "a", B: "b", C: "c"})
    for url, at in ((A, 0.0), (B, 1.0), (C, 2.0)):  # c began to serve last: idle for the shortest time
        now[0] = at
        pool.record_health(url, health(), polled_at=at)
    chosen = []
    for step in range(6):  # one request at a time: always the same worker, the others' idle time grows
        now[0] = 10.0 + step
        worker = pool.choose(now=now[0])
        pool.finish(pool.begin(worker.url))
        chosen.append(worker.url)
    assert chosen == [C] * 6
    assert [round(w.idle_s(20.0), 1) for w in pool.workers()] == [20.0, 19.0, 5.0]
    pool.begin(C)  # two at once: the second goes to the idle worker used most recently, then the next
    assert pool.choose(now=20.0).url == B
    pool.begin(B)
    assert pool.choose(now=20.0).url == A


def test_workers_unable_to_serve_are_skipped():
    pool = pool_of(a=health("loading", present=0), b=health(queue_depth=16, max_queue=16), c=health())
    assert pool.choose(now=1.0).url == C
    pool.record_unreachable(C, "worker http://c:1: /health failed: refused")
    assert pool.choose(now=1.0) is None
    assert pool.serving(now=1.0) == 0
    assert [worker.status for worker in pool.workers()] == ["loading", "ready", "down"]


def test_a_failed_worker_waits_for_a_poll_sent_after_its_failure():
    pool = pool_of(a=health())
    pool.record_failure(A, "worker http://a:1: no answer", at=10.0)
    assert pool.choose(now=10.5) is None
    assert pool.get(A).problem == "worker http://a:1: no answer"
    pool.record_health(A, health(), polled_at=9.9)  # sent before the failure: proves nothing
    assert pool.choose(now=10.5) is None
    pool.record_health(A, health(), polled_at=10.1)
    assert pool.choose(now=10.5).url == A
    assert pool.get(A).problem == ""


def test_a_busy_worker_is_skipped_until_retry_after_or_a_newer_poll_with_room():
    pool = pool_of(a=health(), b=health())
    pool.record_busy(A, "worker http://a:1: queue full (429), retry after 2 s", at=10.0, retry_after_s=2.0)
    pool.begin(B)
    pool.begin(B)
    assert pool.choose(now=11.0).url == B
    assert pool.choose(now=12.0).url == A  # retry-after elapsed
    pool.record_busy(A, "busy", at=20.0, retry_after_s=5.0)
    pool.record_health(A, health(queue_depth=1, max_queue=16), polled_at=19.9)  # room, but sent before the 429
    assert pool.choose(now=21.0).url == B
    pool.record_health(A, health(queue_depth=16, max_queue=16), polled_at=20.5)  # newer, but still full
    assert pool.choose(now=21.0).url == B
    pool.record_health(A, health(queue_depth=1, max_queue=16), polled_at=21.0)
    assert pool.choose(now=21.5).url == A


def test_avoided_workers_come_last_not_never():
    pool = pool_of(a=health(), b=health(queue_depth=5))
    assert pool.choose(now=1.0, avoid={A}).url == B
    pool.record_unreachable(B, "down")
    assert pool.choose(now=1.0, avoid={A}).url == A


def test_sync_adds_and_removes_workers_and_ignores_late_finishes():
    pool = pool_of(a=health(), b=health())
    removed_worker = pool.begin(A)
    added, removed = pool.sync({B: "b", C: "c"})
    assert (added, removed) == ([C], [A])
    pool.finish(removed_worker)  # a request that was in flight on a removed worker ends
    assert [worker.url for worker in pool.workers()] == [B, C]
    assert pool.get(C).status == "unknown"


async def test_a_worker_removed_and_listed_again_mid_request_counts_only_its_own_requests():
    now = [0.0]
    pool = WorkerPool(clock=lambda: now[0])
    pool.sync({A: "a"})
    pool.record_health(A, health(), polled_at=0.0)
    dispatcher = Dispatcher(pool, max_queue=4, queue_timeout_s=1.0, clock=lambda: now[0])
    first = await dispatcher.acquire(arrival=0.0)
    pool.sync({})  # discovery misses it once (a slow control plane answer)...
    pool.sync({A: "a"})  # ...and lists it again while its request runs: a new Worker
    pool.record_health(A, health(), polled_at=1.0)
    second = await dispatcher.acquire(arrival=1.0)
    assert second is pool.get(A) is not first
    now[0] = 2.0
    dispatcher.release(first)
    assert (second.in_flight, second.load, second.idle_s(2.0)) == (1, 1, None)  # its own request still runs
    now[0] = 3.0
    dispatcher.release(second)
    assert (second.in_flight, second.tenants, second.idle_s(5.0), pool.in_flight) == (0, {}, 2.0, 0)
    assert first.in_flight == 0


# --- the queue --------------------------------------------------------------------------------------

async def test_a_request_gets_an_able_worker_at_once_and_counts_in_flight():
    pool = pool_of(a=health())
    dispatcher = Dispatcher(pool, max_queue=4, queue_timeout_s=1.0)
    worker = await dispatcher.acquire(arrival=dispatcher.clock())
    assert worker.url == A and worker.in_flight == 1 and dispatcher.waiting == 0
    dispatcher.release(worker)
    assert worker.in_flight == 0


async def test_waiting_requests_are_served_in_arrival_order_when_a_worker_becomes_able():
    pool = pool_of(a=health("loading"))
    dispatcher = Dispatcher(pool, max_queue=4, queue_timeout_s=5.0)
    order = []

    async def request(name):
        worker = await dispatcher.acquire(dispatcher.clock())
        order.append((name, worker.url))

    tasks = [asyncio.create_task(request(name)) for name in ("first", "second", "third")]
    await asyncio.sleep(0.01)
    assert dispatcher.waiting == 3 and order == []
    pool.record_health(A, health("partial"), polled_at=dispatcher.clock())
    await asyncio.gather(*tasks)
    assert order == [("first", A), ("second", A), ("third", A)]
    assert pool.get(A).in_flight == 3


def test_while_a_worker_loads_its_package_the_backlog_is_shared_over_the_workers_that_serve_soon():
    pool = pool_of(a=health("ready", package_id="p1"), b=health("loading"))
    assert pool.share(waiting=8) is None  # b names no package: it was given none (an idle or released worker)
    pool.record_health(B, health("loading", present=2, package_id="p2"), polled_at=0.0)
    assert pool.share(8, "p1") is None  # nothing of p1 loads: no cap
    assert pool.share(8, "p2") == 8  # b loads p2 but holds too little to serve soon: counted as one
    assert pool.share(8) == 8  # any package: a serves, b holds too little of p2 to count
    pool.record_health(B, health("loading", present=4, package_id="p1"), polled_at=0.0)
    pool.begin(A)
    assert pool.share(7, "p1") == 4  # half its blocks: b counts; (7 waiting + 1 in flight) / 2
    pool.record_failure(B, "connection reset", at=0.5)
    assert pool.share(7, "p1") is None  # a worker that failed a request may never finish loading
    pool.record_health(B, health("partial", present=7, package_id="p1"), polled_at=1.0)
    assert pool.share(7, "p1") == 4
    pool.record_unreachable(B, "timed out")
    assert pool.share(7, "p1") == 4  # a missed poll: counted by its last answer (next test)
    pool.record_health(B, health("ready", package_id="p1"), polled_at=2.0)
    assert pool.share(7, "p1") is None


def test_a_loading_worker_that_misses_health_polls_counts_by_its_last_answer_for_a_grace_period():
    now = [0.0]
    pool = WorkerPool(clock=lambda: now[0])
    pool.sync({A: "a", B: "b", C: "c"})
    pool.record_health(A, health("ready", package_id="p"), polled_at=0.0)
    pool.record_health(B, health("partial", present=2, package_id="p"), polled_at=0.0)
    pool.record_health(C, health("partial", present=3, package_id="p"), polled_at=0.0)
    assert pool.share(9, "p") == 3
    now[0] = 1.0
    pool.record_unreachable(B, "no answer within 1 s")  # binding blocks on a busy CPU
    pool.record_unreachable(C, "no answer within 1 s")
    assert pool.share(9, "p") == 3  # still loading, still coming: a does not take the whole backlog
    now[0] = UNANSWERED_GRACE_S + 0.1
    assert pool.share(9, "p") is None  # silent past the grace: not waited for
    pool.record_health(C, health("partial", present=4, package_id="p"), polled_at=now[0])
    assert pool.share(9, "p") == 5  # (9 waiting) over a and c


def test_a_loading_worker_whose_blocks_stop_growing_no_longer_holds_the_others_at_their_share():
    now = [0.0]
    pool = WorkerPool(clock=lambda: now[0])
    pool.sync({A: "a", B: "b"})
    pool.record_health(A, health("ready", package_id="p"), polled_at=0.0)
    pool.record_health(B, health("loading", present=4, package_id="p"), polled_at=0.0)
    pool.begin(A)
    assert pool.share(7, "p") == 4
    now[0] = LOADING_STALL_S
    pool.record_health(B, health("loading", present=4, package_id="p"), polled_at=now[0])
    assert pool.share(7, "p") == 4  # no new block for LOADING_STALL_S: still waited for
    now[0] += 0.1
    assert pool.share(7, "p") is None  # longer: its loader may hang; a serves without a cap
    pool.record_unreachable(B, "timed out")
    pool.record_health(B, health("loading", present=4, package_id="p"), polled_at=now[0])
    assert pool.share(7, "p") is None  # answering again after a failed poll is no progress
    pool.record_health(B, health("loading", present=5, package_id="p"), polled_at=now[0])
    assert pool.share(7, "p") == 4  # a block came: loading again


def test_a_worker_loading_its_package_again_is_loading_not_stalled():
    # Found in review: the most blocks ever seen was kept, so a worker restarted at the same URL, loading the
    # package it had held, never grew past it and counted as stalled: the ready ones took the backlog uncapped.
    now = [0.0]
    pool = WorkerPool(clock=lambda: now[0])
    pool.sync({A: "a", B: "b"})
    pool.record_health(A, health("ready", package_id="p"), polled_at=0.0)
    pool.record_health(B, health("ready", package_id="p"), polled_at=0.0)
    now[0] = 100.0
    pool.record_unreachable(B, "connection refused")
    for present in (1, 3, 6):
        now[0] += 1.0
        pool.record_health(B, health("loading", present=present, package_id="p"), polled_at=now[0])
    assert pool.share(8, "p") == 4


def test_a_missed_poll_within_the_grace_does_not_restart_an_idle_spell():
    # Found in review: any failed poll made the next answer "began to serve", and the idle spell began again.
    now = [0.0]
    pool = WorkerPool(clock=lambda: now[0])
    pool.sync({A: "a"})
    pool.record_health(A, health("ready"), polled_at=0.0)
    now[0] = 600.0
    pool.record_health(A, health("ready"), polled_at=now[0])
    now[0] += 1.0
    pool.record_unreachable(A, "no answer within 1 s")
    now[0] += 1.0  # the next answer within the grace of the last
    pool.record_health(A, health("ready"), polled_at=now[0])
    assert pool.get(A).idle_s(now[0]) == now[0]
    pool.record_unreachable(A, "connection refused")
    now[0] += UNANSWERED_GRACE_S * 2  # silent for longer: it may have restarted, idle from when it serves again
    pool.record_health(A, health("ready"), polled_at=now[0])
    assert pool.get(A).idle_s(now[0]) == 0.0


@pytest.mark.parametrize("lifted", ["removed", "failed"])
def test_a_loader_gone_or_failed_wakes_the_listeners(lifted):
    # Found in review: the ready workers' share was lifted but no one was told until the next health answer.
    pool = pool_of(a=health("ready", package_id="p"), b=health("loading", present=6, package_id="p"))
    calls = []
    pool.subscribe(lambda: calls.append(pool.share(8, "p")))
    if lifted == "removed":
        pool.sync({A: "a"})
    else:
        pool.record_failure(B, "500", at=0.0)
    assert calls == [None]


async def test_a_surge_backlog_goes_to_the_workers_as_they_come_to_serve_not_all_to_the_first():
    loading = health("loading", present=5, max_batch=8, package_id="p")
    pool = pool_of(a=health("partial", present=7, max_batch=8, package_id="p"), b=loading, c=loading)
    dispatcher = Dispatcher(pool, max_queue=16, queue_timeout_s=5.0)
    got = []

    async def request():
        got.append((await dispatcher.acquire(dispatcher.clock())).url)

    tasks = [asyncio.create_task(request()) for _ in range(8)]
    await asyncio.sleep(0.01)
    assert got == [A, A, A] and dispatcher.waiting == 5  # its share, ceil(8 / 3), not a whole batch of 8
    pool.record_health(A, health("ready", max_batch=8, package_id="p"), polled_at=dispatcher.clock())
    await asyncio.sleep(0.01)
    assert got == [A, A, A]  # ready now, and still its share while the others load
    pool.record_health(B, health("partial", present=7, max_batch=8, package_id="p"), polled_at=dispatcher.clock())
    await asyncio.sleep(0.01)
    assert got[3:] == [B, B, B]
    dispatcher.release(pool.get(A))
    await asyncio.sleep(0.01)
    assert got[6:] == [A]  # a slot freed: the backlog does not wait for c while a can take it
    pool.record_health(C, health("ready", max_batch=8, package_id="p"), polled_at=dispatcher.clock())
    await asyncio.gather(*tasks)  # nothing loads now: no share, no batch cap
    assert got[7:] == [C]


async def test_the_queue_is_bounded():
    pool = pool_of(a=health("loading"))
    dispatcher = Dispatcher(pool, max_queue=2, queue_timeout_s=5.0)
    waiting = [asyncio.create_task(dispatcher.acquire(dispatcher.clock())) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFullError) as info:
        await dispatcher.acquire(dispatcher.clock())
    assert str(info.value) == "router queue is full (2 requests waiting); retry later"
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert dispatcher.waiting == 0  # cancelled waiters leave the queue


async def test_a_queued_request_gives_up_at_its_deadline():
    pool = pool_of(a=health("loading"), b=health())
    pool.record_unreachable(B, "down")
    dispatcher = Dispatcher(pool, max_queue=2, queue_timeout_s=0.05)
    with pytest.raises(QueueTimeoutError) as info:
        await dispatcher.acquire(dispatcher.clock())
    assert str(info.value) == "no worker could take the request within 0.05 s (2 workers known, 0 able to serve)"
    assert dispatcher.waiting == 0


async def test_the_deadline_counts_from_arrival_not_from_each_wait():
    pool = pool_of(a=health("loading"))
    dispatcher = Dispatcher(pool, max_queue=2, queue_timeout_s=0.05)
    with pytest.raises(QueueTimeoutError):
        # Arrived long ago (e.g. before a 429 sent it back): no wait is left.
        await asyncio.wait_for(dispatcher.acquire(dispatcher.clock() - 10.0), timeout=0.02)


async def test_closing_fails_waiting_requests_and_refuses_new_ones():
    pool = pool_of(a=health("loading"))
    dispatcher = Dispatcher(pool, max_queue=2, queue_timeout_s=5.0)
    waiter = asyncio.create_task(dispatcher.acquire(dispatcher.clock()))
    await asyncio.sleep(0.01)
    dispatcher.close()
    with pytest.raises(RouterClosedError, match="^router is shutting down$"):
        await waiter
    with pytest.raises(RouterClosedError):
        await dispatcher.acquire(dispatcher.clock())


async def test_a_worker_assigned_to_a_cancelled_waiter_is_handed_back():
    pool = pool_of(a=health("loading"))
    dispatcher = Dispatcher(pool, max_queue=2, queue_timeout_s=5.0)
    waiter = asyncio.create_task(dispatcher.acquire(dispatcher.clock()))
    await asyncio.sleep(0.01)
    pool.record_health(A, health(), polled_at=dispatcher.clock())  # assigns a to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool.get(A).in_flight == 0


# --- helpers of the HTTP side -----------------------------------------------------------------------

@pytest.mark.parametrize("buffer, end", [
    (b"", 0), (b"data: {\"a\"", 0), (b"data: 1\n\n", 9), (b"data: 1\n\ndata: 2", 9),
    (b"data: 1\n\ndata: 2\n\n", 18), (b"data: 1\r\n\r\ndata", 11),
])
def test_only_whole_events_are_relayed(buffer, end):
    assert complete_events_end(buffer) == end


@pytest.mark.parametrize("events, error, done", [
    (b'data: {"choices": [{"text": "t"}]}\n\ndata: [DONE]\n\n', False, True),
    (b'data: {"choices": [{"text": "t"}]}\n\ndata: {"error": {"message": "boom"}}\n\n', True, False),
    (b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n', True, True),  # as vLLM ends a failed stream
    (b'data: {"choices": []}\r\n\r\ndata: [DONE]', False, True),
    # a token's text can fake neither: JSON escapes its newlines and quotes
    (b'data: {"choices": [{"text": "\\ndata: {\\"error\\": 1}\\ndata: [DONE]"}]}\n\n', False, False),
])
def test_a_streams_outcome_is_read_from_its_events(events, error, done):
    assert (has_error_event(events), ends_done(events)) == (error, done)


@pytest.mark.parametrize("value, seconds", [("3", 3.0), ("0.5", 0.5), (None, 1.0), ("-1", 1.0),
                                            ("Wed, 21 Oct 2015 07:28:00 GMT", 1.0), ("inf", 1.0), ("1e400", 1.0),
                                            ("nan", 1.0), ("-inf", 1.0), ("86400000", 30.0), ("30", 30.0)])
def test_retry_after_of_a_worker(value, seconds):
    """Found in review: inf, and values of days, were taken as they came (a pipeline's is cleared by no poll)."""
    assert retry_after_seconds(value) == seconds


def test_a_pipeline_whose_head_said_retry_after_inf_or_days_serves_again_after_the_default_or_capped_wait():
    pool = pool_of(a=health("partial", present=4), b=health("loading", present=4))
    pool.sync_pipelines([pipeline("a", "b")])
    pool.record_busy("pipeline:a+b", "queue full (429)", 0.0, retry_after_seconds("inf"))
    assert pool.choose(0.5) is None
    assert pool.choose(1.0).url == "pipeline:a+b"
    pool.record_busy("pipeline:a+b", "queue full (429)", 1.0, retry_after_seconds("86400000"))
    assert pool.choose(PIPELINE_RETRY_S) is None
    assert pool.choose(1.0 + PIPELINE_RETRY_S).url == "pipeline:a+b"


# --- discovery --------------------------------------------------------------------------------------

async def test_static_discovery_normalizes_and_deduplicates_urls():
    discovery = StaticDiscovery(["http://a:1/", "http://a:1", " https://b:2/api/ "])
    assert await discovery.list_workers() == [DiscoveredWorker("http://a:1", "http://a:1"),
                                              DiscoveredWorker("https://b:2/api", "https://b:2/api")]


# The last three found in review: kept as base URLs with the space, the NUL or the empty port.
@pytest.mark.parametrize("url", ["a:1", "ftp://a:1", "http://", "http://a:1/?x=1", "http://a:port", "http://ho st/",
                                 "http://h\x00/", "http://h:"])
def test_static_discovery_refuses_urls_that_are_not_http_base_urls(url):
    with pytest.raises(WorkerUrlError) as info:
        StaticDiscovery([url])
    assert str(info.value) == f"--worker: worker URL {url!r} is not an http:// or https:// base URL"


def worker_state(node_id: str, serve_url: str | None, alive: bool = True) -> WorkerState:
    labels = {"rack": "r1"} | ({SERVE_URL_LABEL: serve_url} if serve_url is not None else {})
    return WorkerState(worker=WorkerSpec(peer=Peer(node_id=node_id, address="10.0.0.9:7070"), labels=labels),
                       alive=alive)


async def test_control_plane_discovery_lists_alive_workers_with_a_serve_url():
    states = [worker_state("n1", "http://10.0.0.1:8000/"), worker_state("n2", "http://10.0.0.2:8000", alive=False),
              worker_state("store", None), worker_state("n3", "10.0.0.3:8000")]

    class Client:
        async def list_workers_keyed(self):
            return states, b"k" * 32

    discovery = ControlPlaneDiscovery(Client(), "cp:7000")
    assert discovery.name == "control plane cp:7000"
    assert await discovery.list_workers() == [DiscoveredWorker("n1", "http://10.0.0.1:8000", serving_key=b"k" * 32)]
    states[0].worker.engine = "vllm"  # registered with `pipecast agent --engine vllm`: not given the key
    assert await discovery.list_workers() == [DiscoveredWorker("n1", "http://10.0.0.1:8000", "vllm")]
    assert [(w.engine, w.serving_key) for w in await StaticDiscovery(["http://a:1"], "vllm", b"k").list_workers()] \
        == [("vllm", b"")]
    assert [w.serving_key for w in await StaticDiscovery(["http://a:1"], serving_key=b"k").list_workers()] == [b"k"]


async def test_control_plane_discovery_gives_a_vllm_worker_the_one_package_its_agent_holds():
    """Found in review: a vLLM worker's health names no package, so no version's request was ever sent to it."""
    state = worker_state("n1", "http://10.0.0.1:8000")
    state.worker.engine = "vllm"
    state.held.extend([PackageBlocks(package_id="a" * 64, blocks=[0, 1]), PackageBlocks(package_id="b" * 64)])

    class Client:
        async def list_workers_keyed(self):
            return [state], b"k" * 32

    discovery = ControlPlaneDiscovery(Client(), "cp:7000")
    assert await discovery.list_workers() == [DiscoveredWorker("n1", "http://10.0.0.1:8000", "vllm", b"", "a" * 64)]
    state.held.append(PackageBlocks(package_id="c" * 64, blocks=[3]))  # which of two it serves, nobody says
    assert [w.package_id for w in await discovery.list_workers()] == [""]
    state.worker.engine = ""  # a pipecast worker names its package in its own health answers
    assert [w.package_id for w in await discovery.list_workers()] == [""]


# --- cross-node pipelines ----------------------------------------------------------------------------

def pipeline(*names: str) -> DiscoveredPipeline:
    urls = tuple(f"http://{n}:1" for n in names)
    return DiscoveredPipeline("pipeline:" + "+".join(names), urls[0], urls, "[route]")


def test_a_pipeline_serves_while_no_ready_worker_has_room_and_its_members_answer():
    # a and b hold halves (loading: b lacks the embeddings), c is a worker still far from the whole model
    pool = pool_of(a=health("partial", present=4), b=health("loading", present=4), c=health("partial", present=2))
    pool.sync_pipelines([pipeline("a", "b")], max_in_flight=2)
    chosen = pool.choose(0.0)
    assert chosen.url == "pipeline:a+b" and chosen.endpoint == "http://a:1"
    assert chosen.headers == {"x-pipecast-pipeline": "[route]"}
    pool.begin(chosen.url)
    pool.begin(chosen.url)
    assert pool.choose(0.0) is None  # at its max in flight; c still lacks two blocks
    pool.finish(chosen)
    assert pool.choose(0.0).url == "pipeline:a+b"
    pool.record_unreachable("http://b:1", "connection refused")  # a member stops answering
    assert pool.choose(0.0) is None


def test_a_ready_worker_with_room_goes_first_and_a_full_one_after_an_idle_pipeline():
    pool = pool_of(a=health("partial", present=4), b=health("partial", present=4),
                   c=health("ready", max_batch=2))
    pool.sync_pipelines([pipeline("a", "b")])
    assert pool.choose(0.0).url == "http://c:1"
    pool.begin("http://c:1")
    pool.begin("http://c:1")  # c's batch is full: the idle pipeline serves now
    assert pool.choose(0.0).url == "pipeline:a+b"


def test_a_ready_worker_held_at_its_share_with_room_in_its_batch_keeps_requests_off_the_pipelines():
    """While b and c load, a ready at its share of the surge took none, yet the rule was judged only over
    workers within their share: the requests went through the b+c pipeline (each token over the hops) while a's
    batch had room. Now they wait in the router (for a's share to grow, or for b and c) until a's batch is full."""
    loading = health("loading", present=5, max_batch=8, package_id="p")
    pool = pool_of(a=health("ready", max_batch=8, package_id="p"), b=loading, c=loading)
    pool.sync_pipelines([dataclasses.replace(pipeline("b", "c"), package_id="p")])
    assert pool.share(1, "p") == 1
    assert pool.choose(0.0, one_batch=True, package="p", share=1).url == A
    pool.begin(A)
    share = pool.share(1, "p")
    assert share == 1 and pool.choose(0.0, one_batch=True, package="p", share=share) is None
    assert pool.choose(0.0, package="p").url == A  # not held at a share, a takes it
    pool.record_health(A, health("ready", queue_depth=7, max_batch=8, package_id="p"), polled_at=0.0)
    assert pool.choose(0.0, one_batch=True, package="p", share=share).url == "pipeline:b+c"  # a's batch is full


def test_the_share_of_a_surge_counts_the_requests_in_flight_through_pipelines():
    """The share counted the pipelines' members among the workers that serve soon, but none of the requests
    in flight through them: each ready worker was held to a share of too few."""
    loading = health("loading", present=5, max_batch=8, package_id="p")
    pool = pool_of(a=health("ready", max_batch=8, package_id="p"), b=loading, c=loading)
    pool.sync_pipelines([dataclasses.replace(pipeline("b", "c"), package_id="p")])
    for _ in range(3):
        pool.begin("pipeline:b+c")
    assert pool.share(3, "p") == 2  # (3 waiting + 3 through b+c) over a, b and c
    assert pool.share(3) == 2
    assert pool.share(3, "q") is None


def test_a_dissolved_pipeline_takes_nothing_new_and_its_requests_finish():
    pool = pool_of(a=health("partial", present=4), b=health("partial", present=4))
    pool.sync_pipelines([pipeline("a", "b")])
    dissolved = pool.begin("pipeline:a+b")
    assert pool.sync_pipelines([]) == ([], ["pipeline:a+b"])
    assert pool.choose(0.0) is None and pool.in_flight == 1
    pool.finish(dissolved)
    assert pool.in_flight == 0
    pool.sync_pipelines([pipeline("a", "b")])
    pool.record_failure("pipeline:a+b", "answered 503", at=1.0)  # failed: out for a while
    assert pool.choose(2.0) is None


def test_a_pipeline_unlisted_and_listed_again_still_counts_its_requests_in_flight():
    """Found in review: listed again it was a new unit with none in flight while its stages still ran the old
    unit's requests, so the router sent it max_in_flight more."""
    pool = pool_of(a=health("partial", present=4), b=health("partial", present=4))
    pool.sync_pipelines([pipeline("a", "b")], max_in_flight=2)
    first, second = pool.begin("pipeline:a+b"), pool.begin("pipeline:a+b")
    pool.sync_pipelines([])  # discovery misses it once...
    pool.sync_pipelines([pipeline("a", "b")], max_in_flight=2)  # ...and lists it again
    assert pool.choose(0.0) is None  # still two in flight through it
    pool.finish(first)
    assert pool.choose(0.0).url == "pipeline:a+b"
    pool.sync_pipelines([])
    pool.finish(second)  # the last one ends while it is not listed: nothing kept for it
    assert pool.sync_pipelines([pipeline("a", "b")]) == (["pipeline:a+b"], [])
    assert pool.choose(0.0).in_flight == 0 and pool.in_flight == 0 and not pool._retired


def test_a_pipeline_listed_with_new_cuts_is_routed_so_at_once_and_a_failed_one_is_tried_again_later():
    """Its key is its nodes: listed again with new layer cuts (a stage holds more blocks now) it is routed with
    the new route (it kept the first one, and a failure shut it out for as long as it was listed)."""
    pool = pool_of(a=health("partial", present=4), b=health("partial", present=4))
    now = [0.0]
    pool.clock = lambda: now[0]
    first = pipeline("a", "b")
    pool.sync_pipelines([first])
    pool.record_failure("pipeline:a+b", "stage http://b:1 failed: no answer within the step's deadline", at=0.0)
    now[0] = 10.0
    pool.sync_pipelines([first])  # listed as before, soon after: still out
    assert pool.choose(10.0) is None
    now[0] = PIPELINE_RETRY_S
    pool.sync_pipelines([first])
    assert pool.choose(now[0]).url == "pipeline:a+b"
    pool.record_failure("pipeline:a+b", "answered 503", at=now[0])
    pool.sync_pipelines([dataclasses.replace(first, header="[new route]")])
    chosen = pool.choose(now[0])
    assert chosen.url == "pipeline:a+b" and chosen.headers == {"x-pipecast-pipeline": "[new route]"}


def test_a_pipeline_is_not_chosen_while_a_member_serves_another_package():
    """A version rollout: b's worker serves v2 while its agent still holds v1's blocks, so the control plane may
    list b in a v1 pipeline; b would run v2's weights for v1's layers and answer wrong tokens."""
    pool = pool_of(a=health("partial", present=4, package_id="v1"), b=health("partial", present=4, package_id="v2"))
    pool.sync_pipelines([dataclasses.replace(pipeline("a", "b"), package_id="v1")])
    assert pool.choose(0.0) is None
    pool.record_health("http://b:1", health("partial", present=4, package_id="v1"), polled_at=0.0)
    assert pool.choose(0.0).url == "pipeline:a+b"


def test_a_pipeline_whose_head_answered_429_waits_its_retry_after_instead_of_being_chosen_at_once():
    pool = pool_of(a=health("partial", present=4), b=health("partial", present=4))
    pool.sync_pipelines([pipeline("a", "b")])
    pool.record_busy("pipeline:a+b", "worker pipeline:a+b: queue full (429), retry after 1 s", at=10.0,
                     retry_after_s=1.0)
    assert pool.choose(now=10.5) is None  # the router re-dispatching the request finds no candidate
    pool.record_health(A, health("partial", present=4), polled_at=10.6)  # its members' polls do not clear it
    assert pool.choose(now=10.9) is None
    assert pool.choose(now=11.0).url == "pipeline:a+b"


async def test_control_plane_discovery_turns_pipelines_into_routes():
    from pipecast.v1.control_pb2 import PipelineInfo, PipelineStage

    class Client:
        async def list_pipelines(self):
            return [PipelineInfo(package_id="p", stages=[
                PipelineStage(node_id="n1", serve_url="http://10.0.0.1:8000/", layer_start=0, layer_end=3),
                PipelineStage(node_id="n2", serve_url="http://10.0.0.2:8000", layer_start=3, layer_end=8)]),
                PipelineInfo(package_id="p", stages=[
                    PipelineStage(node_id="n3", serve_url="10.0.0.3:8000", layer_start=0, layer_end=8)])]

    [found] = await ControlPlaneDiscovery(Client(), "cp:7000").list_pipelines()
    assert found.key == "pipeline:n1+n2@p" and found.head_url == "http://10.0.0.1:8000"
    assert found.member_urls == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert json.loads(found.header) == [{"url": "http://10.0.0.1:8000", "layers": [0, 3]},
                                        {"url": "http://10.0.0.2:8000", "layers": [3, 8]}]
    assert await StaticDiscovery([A]).list_pipelines() == []


async def test_pipelines_whose_node_ids_join_alike_or_of_two_packages_on_the_same_nodes_are_all_routed_to():
    from pipecast.v1.control_pb2 import PipelineInfo, PipelineStage

    def info(package: str, *stages: tuple[str, int]) -> PipelineInfo:
        return PipelineInfo(package_id=package * 64, stages=[
            PipelineStage(node_id=n, serve_url=f"http://10.0.0.{host}:8000", layer_start=i * 3, layer_end=i * 3 + 3)
            for i, (n, host) in enumerate(stages)])

    class Client:
        async def list_pipelines(self):
            # disjoint pipelines whose node ids joined by '+' read alike; the same nodes for two packages (a rollout)
            return [info("a", ("a+b", 1), ("c", 2)), info("a", ("a", 3), ("b+c", 4)),
                    info("b", ("n1", 5), ("n2", 6)), info("c", ("n1", 5), ("n2", 6))]

    pool = WorkerPool()
    pool.sync_pipelines(await ControlPlaneDiscovery(Client(), "cp:7000").list_pipelines())
    assert {u.url: (u.member_urls, u.package_id[0]) for u in pool.pipelines()} == {
        f"pipeline:a%2Bb+c@{'a' * 16}": (("http://10.0.0.1:8000", "http://10.0.0.2:8000"), "a"),
        f"pipeline:a+b%2Bc@{'a' * 16}": (("http://10.0.0.3:8000", "http://10.0.0.4:8000"), "a"),
        f"pipeline:n1+n2@{'b' * 16}": (("http://10.0.0.5:8000", "http://10.0.0.6:8000"), "b"),
        f"pipeline:n1+n2@{'c' * 16}": (("http://10.0.0.5:8000", "http://10.0.0.6:8000"), "c")}


def test_the_names_a_pool_remembers_are_the_most_recently_named_and_bounded():
    pool = pool_of(a=health())
    url = "http://a:1"
    for i in range(MAX_REMEMBERED_NAMES + 5):  # a worker that names another model every poll
        pool.record_health(url, WorkerHealth("ready", 8, 8, 0, 0, 16, model=f"m{i}", package_id=f"{i:064x}"),
                           polled_at=0.0)
    pool.record_unreachable(url, "gone")
    assert pool.packages_named("m0") == set()  # the oldest are forgotten
    last = MAX_REMEMBERED_NAMES + 4
    assert pool.packages_named(f"m{last}") == {f"{last:064x}"}
    assert len(pool._last_named) == MAX_REMEMBERED_NAMES


def test_a_worker_of_no_package_serves_a_routed_name_of_one_version_only():
    """Found in review: a vLLM worker nobody told the router the package of took both versions of a name with a
    canary, answering the canary's requests with whatever model it runs (counted as the canary's, gate included)."""
    from dataclasses import replace

    pool = pool_of(a=replace(health(), model="llama"))
    worker = pool._workers["http://a:1"]
    stable, canary = "s" * 64, "c" * 64
    pool.route({"llama": ((stable, 100),)})
    assert pool.serves(worker, stable)
    pool.route({"llama": ((stable, 90), (canary, 10))})
    assert not pool.serves(worker, stable) and not pool.serves(worker, canary)
