"""A worker's mailbox (:mod:`control_plane.mailbox`), without a server: coalescing, what a new stream gets
first, and how a superseded stream or a closed mailbox ends."""

import asyncio

from control_plane.mailbox import Mailbox
from control_plane.messages import UpdateKind
from control_plane.state import Notice

NODE = "w1"


def assign(plan_id: str, package_id: str = "pkg") -> Notice:
    return Notice(NODE, UpdateKind.ASSIGN, package_id, plan_id)


def cancel(plan_id: str, package_id: str = "pkg") -> Notice:
    return Notice(NODE, UpdateKind.CANCEL, package_id, plan_id)


def drop(package_id: str) -> Notice:
    return Notice(NODE, UpdateKind.DROP, package_id)


async def drain(mailbox: Mailbox, owner: int, count: int) -> list[Notice]:
    return [await asyncio.wait_for(mailbox.next(owner), 1.0) for _ in range(count)]


async def test_only_the_latest_notice_per_plan_and_per_package_is_kept_in_the_order_last_put():
    mailbox = Mailbox(NODE)
    owner = mailbox.attach([])
    assert await drain(mailbox, owner, 1) == [Notice(NODE, UpdateKind.SYNC, "")]
    for notice in (assign("p1"), drop("old"), assign("p2"), cancel("p1"), drop("old")):
        mailbox.put(notice)
    assert await drain(mailbox, owner, 3) == [assign("p2"), cancel("p1"), drop("old")]


async def test_a_new_stream_gets_pending_drops_then_a_sync_then_every_current_part():
    mailbox = Mailbox(NODE)
    for notice in (assign("p1"), drop("old"), cancel("p9")):
        mailbox.put(notice)
    owner = mailbox.attach([("p1", "pkg"), ("p2", "other")])
    assert await drain(mailbox, owner, 4) == [drop("old"), Notice(NODE, UpdateKind.SYNC, ""), assign("p1"),
                                              assign("p2", "other")]


async def test_next_waits_for_a_put():
    mailbox = Mailbox(NODE)
    owner = mailbox.attach([])
    await drain(mailbox, owner, 1)
    waiting = asyncio.create_task(mailbox.next(owner))
    await asyncio.sleep(0)
    assert not waiting.done()
    mailbox.put(assign("p1"))
    assert await asyncio.wait_for(waiting, 1.0) == assign("p1")


async def test_a_newer_stream_ends_the_older_one():
    mailbox = Mailbox(NODE)
    old = mailbox.attach([])
    new = mailbox.attach([])
    assert new != old
    assert await mailbox.next(old) is None
    assert await drain(mailbox, new, 1) == [Notice(NODE, UpdateKind.SYNC, "")]


async def test_closing_ends_a_waiting_stream():
    mailbox = Mailbox(NODE)
    owner = mailbox.attach([])
    await drain(mailbox, owner, 1)
    waiting = asyncio.create_task(mailbox.next(owner))
    await asyncio.sleep(0)
    mailbox.close()
    assert await asyncio.wait_for(waiting, 1.0) is None
    assert mailbox.closed
