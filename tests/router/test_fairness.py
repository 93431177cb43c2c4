"""Fair dispatch across tenants: the pure queue (no sockets, no loop), then the dispatcher that uses it."""

import asyncio
from collections import Counter

import pytest

from pipecast.router import fairness
from pipecast.router.errors import QueueFullError, QueueTimeoutError
from pipecast.router.fairness import ACTIVE_S, SWEEP_AT, FairQueue, QueueBound
from pipecast.router.pool import Dispatcher, WorkerPool
from pipecast.serve.health import WorkerHealth

A, B = "http://a:1", "http://b:1"


def drain(queue: FairQueue, now: float = 0.0, finish: bool = False) -> list[str]:
    """Pick until nothing may go, starting each (and finishing it at once with ``finish``: one slot)."""
    order = []
    while (picked := queue.pick(now)) is not None:
        tenant, _ = picked
        queue.started(tenant, now)
        if finish:
            queue.finished(tenant, now)
        order.append(tenant)
    return order


def fill(queue: FairQueue, tenant: str, count: int, now: float = 0.0) -> None:
    for index in range(count):
        queue.push(tenant, f"{tenant}{index}", now)


# --- the pure queue ---------------------------------------------------------------------------------

def test_a_tenant_alone_gets_every_slot_in_arrival_order():
    queue = FairQueue(max_queue=16, rate_of=lambda tenant: 5.0, pacing=1.0)
    fill(queue, "a", 6)
    picked = []
    while (item := queue.pick(0.0)) is not None:  # never paced: nobody else is active
        queue.started(item[0], 0.0)
        picked.append(item)
    assert picked == [("a", f"a{i}") for i in range(6)]
    assert queue.in_flight_of("a") == 6 and queue.waiting == 0


@pytest.mark.parametrize("finish", [False, True], ids=["slots-held", "one-slot"])
def test_two_backlogged_tenants_alternate_by_weight(finish):
    equal = FairQueue(max_queue=64)
    fill(equal, "a", 8)
    fill(equal, "b", 8)
    assert drain(equal, finish=finish)[:8] == ["a", "b"] * 4

    weighted = FairQueue(max_queue=64, rate_of={"a": 2.0, "b": 1.0}.get)
    fill(weighted, "a", 20)
    fill(weighted, "b", 20)
    first = drain(weighted, finish=finish)[:12]
    assert Counter(first) == {"a": 8, "b": 4}
    assert all(Counter(first[i:i + 3])["a"] == 2 for i in range(0, 12, 3))  # 2:1 all along, not in runs


@pytest.mark.parametrize("slots, held", [(2, {"a": 1, "b": 1}), (4, {"a": 3, "b": 1}), (12, {"a": 8, "b": 4})])
def test_backlogged_tenants_hold_the_slots_by_weight_as_far_as_whole_slots_allow(slots, held):
    # As the docs say (review): each holds one before any holds two; then by weight. Slots free one at a time,
    # each taken again at once, for many rounds: the slots held settle where they are.
    queue = FairQueue(max_queue=512, rate_of={"a": 2.0, "b": 1.0}.get)
    fill(queue, "a", 200)
    fill(queue, "b", 200)
    running = [queue.pick(0.0)[0] for _ in range(slots)]
    for tenant in running:
        queue.started(tenant, 0.0)
    for _ in range(100):
        done = running.pop(0)
        queue.finished(done, 0.0)
        tenant, _ = queue.pick(0.0)
        queue.started(tenant, 0.0)
        running.append(tenant)
    assert Counter(running) == held


def test_a_newly_arriving_tenant_goes_before_a_backlogged_tenants_next_requests():
    queue = FairQueue(max_queue=64)
    fill(queue, "a", 10)
    for _ in range(3):  # a is served a while, alone
        tenant, _ = queue.pick(0.0)
        queue.started(tenant, 0.0)
    queue.push("b", "b0", 0.1)
    queue.push("b", "b1", 0.1)
    assert queue.pick(0.1) == ("b", "b0")


def test_idleness_is_not_banked_as_credit():
    queue = FairQueue(max_queue=64)
    fill(queue, "b", 1)
    drain(queue, finish=True)  # b was served once, long ago
    fill(queue, "a", 30)
    assert drain(queue, finish=True)[:20] == ["a"] * 20  # a alone
    fill(queue, "b", 30, now=1.0)
    fill(queue, "a", 30, now=1.0)
    # b is back: it goes first once, then they alternate; b does not get 20 in a row for a's 20 alone.
    assert drain(queue, now=1.0, finish=True)[:6] == ["b", "a", "b", "a", "b", "a"]


def test_no_tenant_starves_whatever_the_weights():
    queue = FairQueue(max_queue=1024, rate_of={"heavy": 100.0, "light": 1.0}.get)
    fill(queue, "heavy", 500)
    fill(queue, "light", 5)
    order = drain(queue, finish=True)
    positions = [index for index, tenant in enumerate(order) if tenant == "light"]
    # light weighs 1/100 of heavy: one of its requests per ~100 of heavy's (float sums: +-2).
    assert len(positions) == 5 and max(b - a for a, b in zip([-1] + positions, positions)) <= 102


def test_a_tenant_with_fewer_in_flight_goes_first():
    queue = FairQueue(max_queue=64)
    fill(queue, "a", 4)
    drain(queue)  # a: 4 in flight
    fill(queue, "a", 4)
    queue.push("b", "b0", 0.0)
    queue.push("b", "b1", 0.0)
    assert [queue.pick(0.0)[0] for _ in range(2)] == ["b", "b"]  # b's 0 in flight, then still 0 (not started)


def test_the_queue_is_bounded_and_a_lighter_tenant_pushes_out_the_heaviest_ones_newest():
    queue = FairQueue(max_queue=4)
    fill(queue, "a", 3)
    queue.push("b", "b0", 0.0)
    with pytest.raises(QueueFullError, match=r"^router queue is full \(4 requests waiting\); retry later$"):
        queue.push("a", "a3", 0.0)  # the heaviest itself: refused
    fill(queue, "c", 1)  # c has none waiting: a's newest goes
    assert queue.waiting_by_tenant() == {"a": 2, "b": 1, "c": 1} and queue.waiting == 4
    with pytest.raises(QueueFullError):
        queue.push("b", "b1", 0.0)  # b would hold 2, as many as a: no push-out
    lone = FairQueue(max_queue=2)
    fill(lone, "a", 2)
    with pytest.raises(QueueFullError):
        lone.push("a", "a2", 0.0)


def test_queues_sharing_a_bound_hold_max_queue_in_all_and_a_lighter_tenant_pushes_out_the_heaviest_anywhere():
    """Found in review: --max-queue bounded each version's queue, so a router with N versions held N times it."""
    bound = QueueBound(3)
    first, second = FairQueue(bound), FairQueue(bound)
    fill(first, "a", 2)
    second.push("a", "a2", 0.0)
    assert first.full and second.full and bound.waiting == 3
    with pytest.raises(QueueFullError, match=r"^router queue is full \(3 requests waiting\); retry later$"):
        second.push("a", "a3", 0.0)  # the heaviest itself, in all the queues: refused
    assert second.push("b", "b0", 0.0) == "a1"  # a's newest of the queue where it waits most
    assert first.waiting_by_tenant() == {"a": 1} and second.waiting_by_tenant() == {"a": 1, "b": 1}
    first.leave()
    assert not second.full and bound.queues == [second]


def test_push_returns_what_it_pushed_out():
    queue = FairQueue(max_queue=2)
    fill(queue, "a", 2)
    assert queue.push("b", "b0", 0.0) == "a1"
    assert queue.pick(0.0) == ("a", "a0") and queue.pick(0.0) == ("b", "b0") and queue.pick(0.0) is None


def test_a_tenant_with_a_rate_is_paced_only_while_another_is_active():
    queue = FairQueue(max_queue=64, rate_of={"a": 10.0}.get, pacing=2.0)  # a: 20/s while b is active
    fill(queue, "a", 5)
    queue.push("b", "b0", 0.0)
    assert drain(queue) == ["a", "b"]  # a's bucket of one, then a waits; b (no rate) never does
    assert queue.wake_at(0.0) == pytest.approx(0.05)
    assert queue.pick(0.04) is None
    assert drain(queue, now=0.05) == ["a"]
    queue.finished("b", 0.06)  # b is still active for ACTIVE_S after its last request
    assert drain(queue, now=0.06 + ACTIVE_S - 0.01) == ["a"]  # a token per 50 ms
    assert drain(queue, now=0.06 + ACTIVE_S + 0.001) == ["a", "a"]  # b gone: a alone is not held back
    assert queue.wake_at(2.0) is None


def test_while_requests_wait_the_queue_wakes_when_a_tenant_turns_inactive():
    """Found in review: nothing called back when a tenant's ACTIVE_S ran out, so the others stayed paced (and a
    dispatcher's workers capped at one batch) until some other event, up to a health poll later."""
    queue = FairQueue(max_queue=8)
    queue.push("b", "b0", 0.0)
    assert queue.pick(0.0) == ("b", "b0")
    queue.started("b", 0.0)
    queue.finished("b", 0.5)
    assert queue.wake_at(0.6) is None  # nothing waits: nobody needs waking
    queue.push("a", "a0", 0.6)
    assert queue.wake_at(0.6) == 0.5 + ACTIVE_S
    assert queue.active_tenants(0.5 + ACTIVE_S) == 1  # a alone, at the very time it wakes


def test_pacing_off_or_without_a_rate_never_holds_back():
    for queue in (FairQueue(max_queue=64, rate_of={"a": 10.0}.get, pacing=0.0), FairQueue(max_queue=64, pacing=2.0)):
        fill(queue, "a", 3)
        queue.push("b", "b0", 0.0)
        assert sorted(drain(queue)) == ["a", "a", "a", "b"]


def test_removed_and_cleared_requests_leave_the_queue():
    queue = FairQueue(max_queue=8)
    fill(queue, "a", 3)
    assert queue.remove("a", "a1") and not queue.remove("a", "a1") and not queue.remove("x", "a0")
    assert queue.waiting == 2 and queue.waiting_of("a") == 2
    assert queue.clear() == ["a0", "a2"] and queue.waiting == 0 and queue.pick(0.0) is None


def test_idle_tenant_records_are_dropped():
    queue = FairQueue(max_queue=8)
    for index in range(SWEEP_AT + 10):
        queue.push(f"t{index}", index, 0.0)
        drain(queue, finish=True)
    assert len(queue._tenants) <= SWEEP_AT


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        FairQueue(max_queue=0)
    with pytest.raises(ValueError):
        FairQueue(max_queue=1, pacing=-1.0)


# --- the dispatcher ---------------------------------------------------------------------------------

def ready(max_batch: int = 1) -> WorkerHealth:
    return WorkerHealth(status="ready", blocks_present=1, blocks_total=1, queue_depth=0, running=0, max_queue=64,
                        max_batch=max_batch)


def pool_with(*urls: str, max_batch: int = 1) -> WorkerPool:
    pool = WorkerPool()
    pool.sync({url: url for url in urls})
    for url in urls:
        pool.record_health(url, ready(max_batch), polled_at=0.0)
    return pool


async def test_one_tenant_fills_ready_workers_beyond_their_batch_as_before():
    pool = pool_with(A, max_batch=1)
    dispatcher = Dispatcher(pool, max_queue=8, queue_timeout_s=5.0)
    workers = [await dispatcher.acquire(dispatcher.clock(), tenant="a") for _ in range(3)]
    assert [w.url for w in workers] == [A] * 3 and dispatcher.waiting == 0
    for worker in workers:
        dispatcher.release(worker, "a")


async def b_was_just_here(dispatcher: Dispatcher) -> None:
    """A request of tenant b that came and went: b is active for ACTIVE_S more."""
    dispatcher.release(await dispatcher.acquire(dispatcher.clock(), tenant="b"), "b")


async def test_the_one_batch_cap_lifts_when_the_other_tenant_turns_inactive(monkeypatch):
    monkeypatch.setattr(fairness, "ACTIVE_S", 0.05)
    pool = pool_with(A, max_batch=1)
    dispatcher = Dispatcher(pool, max_queue=8, queue_timeout_s=5.0)
    await b_was_just_here(dispatcher)
    held = await dispatcher.acquire(dispatcher.clock(), tenant="a")
    waiting = asyncio.create_task(dispatcher.acquire(dispatcher.clock(), tenant="a"))
    await asyncio.sleep(0.01)
    assert dispatcher.waiting == 1  # b still counts: the worker takes one batch
    worker = await asyncio.wait_for(waiting, 1.0)  # b's spell ends: no poll, no release needed
    assert worker.url == A and pool.get(A).in_flight == 2
    dispatcher.release(held, "a")
    dispatcher.release(worker, "a")


async def test_with_several_tenants_a_freed_slot_goes_to_the_tenant_below_its_share():
    pool = pool_with(A, max_batch=2)
    dispatcher = Dispatcher(pool, max_queue=8, queue_timeout_s=5.0)
    await b_was_just_here(dispatcher)
    held = [await dispatcher.acquire(dispatcher.clock(), tenant="a") for _ in range(2)]  # a fills the batch
    order = []

    async def request(tenant):
        worker = await dispatcher.acquire(dispatcher.clock(), tenant=tenant)
        order.append(tenant)
        return worker

    backlog = [asyncio.create_task(request("a")) for _ in range(3)]
    await asyncio.sleep(0.01)
    late = asyncio.create_task(request("b"))
    await asyncio.sleep(0.01)
    assert order == [] and dispatcher.waiting == 4  # two tenants active: the worker takes one batch
    assert dispatcher.waiting_by_tenant() == {"a": 3, "b": 1}
    dispatcher.release(held[0], "a")
    await asyncio.sleep(0)
    assert order == ["b"]  # b arrived last, but has nothing in flight
    dispatcher.release(held[1], "a")
    dispatcher.release(await late, "b")
    for task in backlog:
        dispatcher.release(await task, "a")
    assert order == ["b", "a", "a", "a"] and pool.get(A).in_flight == 0


async def test_a_waiting_request_pushed_out_of_a_full_queue_gets_queue_full():
    pool = pool_with(A, max_batch=1)
    dispatcher = Dispatcher(pool, max_queue=2, queue_timeout_s=5.0)
    await b_was_just_here(dispatcher)
    held = await dispatcher.acquire(dispatcher.clock(), tenant="a")
    waiting = [asyncio.create_task(dispatcher.acquire(dispatcher.clock(), tenant="a")) for _ in range(2)]
    await asyncio.sleep(0.01)
    b = asyncio.create_task(dispatcher.acquire(dispatcher.clock(), tenant="b"))
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFullError):
        await waiting[1]  # a's newest
    assert dispatcher.waiting_by_tenant() == {"a": 1, "b": 1}
    dispatcher.release(held, "a")
    dispatcher.release(await b, "b")
    dispatcher.release(await waiting[0], "a")


async def test_a_retry_past_its_deadline_pushes_nobody_out_of_a_full_queue():
    """Found in review: a retry whose deadline had passed was pushed into the full queue, pushing out another
    tenant's waiting request (429), and then gave up at once itself."""
    pool = pool_with(A, max_batch=1)
    pool.record_unreachable(A, "down")
    dispatcher = Dispatcher(pool, max_queue=2, queue_timeout_s=5.0)
    waiting = [asyncio.create_task(dispatcher.acquire(dispatcher.clock(), tenant="b")) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(QueueTimeoutError):
        await dispatcher.acquire(dispatcher.clock() - 60.0, avoid={A}, tenant="a")
    await asyncio.sleep(0.01)
    assert not any(task.done() for task in waiting) and dispatcher.waiting_by_tenant() == {"b": 2}
    dispatcher.close()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_paced_tenant_is_dispatched_when_its_turn_is_due_without_any_other_event():
    pool = pool_with(A, B, max_batch=8)
    dispatcher = Dispatcher(pool, max_queue=8, queue_timeout_s=5.0, rate_of={"a": 10.0}.get, pacing=2.0)
    b = await dispatcher.acquire(dispatcher.clock(), tenant="b")
    started = dispatcher.clock()
    a = [await dispatcher.acquire(dispatcher.clock(), tenant="a") for _ in range(3)]
    elapsed = dispatcher.clock() - started
    assert 0.09 <= elapsed < 1.0  # the first at once, then one per 50 ms; the workers had room all along
    for worker in a:
        dispatcher.release(worker, "a")
    dispatcher.release(b, "b")


async def test_closing_fails_every_tenants_waiting_requests():
    pool = pool_with(A, max_batch=1)
    dispatcher = Dispatcher(pool, max_queue=8, queue_timeout_s=5.0)
    await b_was_just_here(dispatcher)
    held = await dispatcher.acquire(dispatcher.clock(), tenant="a")
    waiting = [asyncio.create_task(dispatcher.acquire(dispatcher.clock(), tenant=t)) for t in ("a", "b")]
    await asyncio.sleep(0.01)
    dispatcher.close()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert [type(r).__name__ for r in results] == ["RouterClosedError"] * 2 and dispatcher.waiting == 0
    dispatcher.release(held, "a")
