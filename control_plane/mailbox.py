"""What one worker's assignment stream still has to send.

Coalesced: only the latest notice per plan (ASSIGN or CANCEL) and per package (DROP) is kept, since
each ASSIGN carries the worker's whole part, so a slow stream never falls behind by more than one
message per plan. The mailbox outlives streams: notices wait for the worker's next stream, which
starts with a SYNC and the worker's current part in every plan.
"""

import asyncio
from collections import OrderedDict
from collections.abc import Iterable

from control_plane.messages import UpdateKind
from control_plane.state import Notice


def _key(notice: Notice) -> tuple[str, str]:
    if notice.kind is UpdateKind.DROP:
        return "package", notice.package_id
    if notice.kind is UpdateKind.SYNC:
        return "sync", ""
    return "plan", notice.plan_id


class Mailbox:
    """Pending notices of one worker, for at most one stream at a time (a newer stream supersedes)."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        self.closed = False
        self._items: OrderedDict[tuple[str, str], Notice] = OrderedDict()
        self._wake = asyncio.Event()
        self._owner = 0

    def put(self, notice: Notice) -> None:
        """Queue ``notice`` last, replacing a pending one for the same plan (or package, for a DROP)."""
        key = _key(notice)
        self._items.pop(key, None)
        self._items[key] = notice
        self._wake.set()

    def attach(self, plans: Iterable[tuple[str, str]]) -> int:
        """A new stream takes over; returns its owner token. It gets pending DROPs, then a SYNC, then an
        ASSIGN for each ``(plan id, package id)``; plan notices queued before are superseded by those."""
        drops = [(k, n) for k, n in self._items.items() if k[0] == "package"]
        self._items = OrderedDict(drops)
        self.put(Notice(self.node_id, UpdateKind.SYNC, ""))
        for plan_id, package_id in plans:
            self.put(Notice(self.node_id, UpdateKind.ASSIGN, package_id, plan_id))
        self._owner += 1
        return self._owner

    async def next(self, owner: int) -> Notice | None:
        """The next notice for stream ``owner``; None once a newer stream took over or the mailbox closed."""
        while True:
            if self.closed or owner != self._owner:
                return None
            if self._items:
                return self._items.popitem(last=False)[1]
            self._wake.clear()
            await self._wake.wait()

    def close(self) -> None:
        """The worker is gone: its stream ends."""
        self.closed = True
        self._wake.set()
