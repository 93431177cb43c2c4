"""Fair dispatch across tenants: which admitted request gets the next worker slot. Pure logic, no sockets.

Admission (:mod:`pipecast.router.admission`) bounds each tenant's rate; this module shares the workers
among the requests admitted. Requests wait in one FIFO per tenant, and when a slot frees the next request
is the head of the tenant that is furthest below its share:

- **Share**: a tenant's weight is its configured rate (``rate_of``); a tenant without a rate weighs
  ``default_weight``. The pick is the eligible tenant with the fewest requests in flight per unit of
  weight, then the lowest virtual time (requests dispatched per unit of weight, start-time fair queueing),
  then the one served least recently. Backlogged tenants so hold the slots in proportion to their weights as
  far as whole slots allow, each holding one before any holds two (with two slots, tenants weighing 2 and 1
  hold one each; with twelve, eight and four), and a tenant that just arrived (nothing in flight, its virtual
  time brought up to the current one so that idleness is not banked as credit) goes before a backlogged
  tenant's next request. No tenant starves: its requests in flight finish, and the others' virtual times grow
  with every request they get.
- **Work conserving**: a tenant alone is never held back; whoever waits gets a free slot.
- **Pacing** (``pacing`` > 0): while another tenant is active, a tenant with a rate is dispatched at most
  ``pacing`` times that rate (a bucket of one request). Its admission bucket lets a burst of BURST
  requests through at once; on workers that batch, those requests share every batch with the other
  tenants' and slow them down, so the burst goes to the workers spread over about BURST / rate seconds
  instead. This holds a tenant's requests back while others are active even if a worker is idle: the
  price of keeping its burst out of their batches, paid only by the tenant that bursts.
- **Active**: a tenant with requests waiting or in flight, or one that sent a request within
  :data:`ACTIVE_S`: a tenant with a steady stream of short requests often has none in flight between two.
- **Bound**: at most ``max_queue`` requests wait in all, in all the queues that share a :class:`QueueBound`
  (a router's: one queue per version, and ``--max-queue`` bounds the router). When full, a request of a
  tenant with fewer waiting (per unit of weight, in all those queues) than the tenant with the most pushes
  out that tenant's newest request (of the queue where it waits most); otherwise the newcomer is refused.
  Either way the one refused gets :class:`QueueFullError`, so one tenant's backlog cannot lock the others
  out of the queue, whichever version it waits for.

The clock is the caller's: every method that depends on time takes ``now``.
"""

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pipecast.router.errors import QueueFullError

#: A token this close to whole is one: a token due "now" must not wait for one more timer turn (or be refused) over
#: float rounding (the time until one is back, added back, can leave 0.9999999999999992).
TOKEN_TOLERANCE = 1e-9

#: Seconds after its last request that a tenant still counts as active (for pacing the others, and for
#: capping workers at one batch): about the gap between two requests of a steady low-rate tenant.
ACTIVE_S = 1.0
#: Tenant records kept before the idle ones are dropped: tenant names come from clients (header), so the
#: records must not grow without bound.
SWEEP_AT = 1024

Item = TypeVar("Item")


@dataclass(eq=False)
class _Tenant(Generic[Item]):
    weight: float
    #: Dispatch rate while paced (requests/s), None: never paced.
    pace_rate: float | None
    waiting: deque = field(default_factory=deque)
    in_flight: int = 0
    #: Requests dispatched per unit of weight, from the virtual time it last became backlogged.
    vtime: float = 0.0
    #: Sequence number of its last dispatch (0: never).
    served: int = 0
    last_seen: float = -math.inf
    pace_tokens: float = 1.0
    pace_updated: float = -math.inf

    def active(self, now: float) -> bool:
        return bool(self.waiting) or self.in_flight > 0 or now < self.last_seen + ACTIVE_S

    def refill(self, now: float) -> None:
        if self.pace_rate is not None:
            elapsed = now - self.pace_updated if self.pace_updated > -math.inf else math.inf
            self.pace_tokens = min(1.0, self.pace_tokens + elapsed * self.pace_rate)
            self.pace_updated = now


class QueueBound:
    """At most ``max_queue`` requests waiting in all the queues made with it (:class:`FairQueue`) together."""

    def __init__(self, max_queue: int) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.queues: list[FairQueue] = []

    @property
    def waiting(self) -> int:
        """Requests waiting now, in all the queues."""
        return sum(queue.waiting for queue in self.queues)

    def push_out(self, tenant: str, weight: float) -> object:
        """Make room for a request of ``tenant`` (of ``weight``) while full: take out and return the newest request
        of the tenant with the most waiting per unit of weight, if ``tenant`` has fewer; else
        :class:`QueueFullError`."""
        waiting: dict[str, int] = {}
        weights: dict[str, float] = {}
        for queue in self.queues:
            for name, count in queue.waiting_by_tenant().items():
                waiting[name] = waiting.get(name, 0) + count
                weights[name] = queue.weight_of(name)
        heaviest = max(waiting, key=lambda name: (waiting[name] / weights[name], waiting[name]))
        if heaviest == tenant or (waiting.get(tenant, 0) + 1) / weight >= waiting[heaviest] / weights[heaviest]:
            raise QueueFullError(self.max_queue)
        # Its newest in the queue where it waits most: the oldest have waited longest.
        return max(self.queues, key=lambda queue: queue.waiting_of(heaviest)).pop_newest(heaviest)


class FairQueue(Generic[Item]):
    """Admitted requests waiting per tenant, picked fairly (module docstring).

    The caller pushes each request (:meth:`push`), and whenever a worker can take one asks for the next
    (:meth:`pick`), tells when it went to a worker (:meth:`started`) and when it ended (:meth:`finished`);
    a request that gives up while waiting is taken out with :meth:`remove`.
    """

    def __init__(self, max_queue: int | QueueBound, rate_of: Callable[[str], float | None] = lambda tenant: None,
                 default_weight: float = 1.0, pacing: float = 0.0) -> None:
        if default_weight <= 0 or pacing < 0:
            raise ValueError(f"default_weight must be > 0 and pacing >= 0, got {default_weight:g}, {pacing:g}")
        #: ``max_queue`` a bound of this queue's own, or the bound it shares with other queues.
        self.bound = max_queue if isinstance(max_queue, QueueBound) else QueueBound(max_queue)
        self.bound.queues.append(self)
        self.max_queue = self.bound.max_queue
        self.rate_of = rate_of
        self.default_weight = default_weight
        self.pacing = pacing
        self._tenants: dict[str, _Tenant] = {}
        self._waiting = 0
        self._served = 0
        #: The virtual time of the last dispatch: where a tenant that becomes backlogged starts.
        self._vclock = 0.0
        self._sweep_at = SWEEP_AT

    @property
    def waiting(self) -> int:
        """Requests waiting now, all tenants together."""
        return self._waiting

    def waiting_of(self, tenant: str) -> int:
        """Requests of ``tenant`` waiting now."""
        record = self._tenants.get(tenant)
        return len(record.waiting) if record else 0

    def waiting_by_tenant(self) -> dict[str, int]:
        """Tenant -> requests waiting now, for the tenants with any."""
        return {name: len(record.waiting) for name, record in self._tenants.items() if record.waiting}

    def weight_of(self, tenant: str) -> float:
        """The weight (module docstring) of ``tenant``, which has requests waiting."""
        return self._tenants[tenant].weight

    @property
    def full(self) -> bool:
        """Whether its bound holds ``max_queue`` requests waiting (this queue's and those sharing the bound)."""
        return self.bound.waiting >= self.max_queue

    def in_flight_of(self, tenant: str) -> int:
        """Requests of ``tenant`` at workers now."""
        record = self._tenants.get(tenant)
        return record.in_flight if record else 0

    def active_tenants(self, now: float) -> int:
        """How many tenants are active at ``now`` (module docstring)."""
        return sum(record.active(now) for record in self._tenants.values())

    def push(self, tenant: str, item: Item, now: float) -> Item | None:
        """Queue ``item`` of ``tenant``, arrived at ``now``; return the request it pushed out, if any.

        Raises :class:`QueueFullError` when ``max_queue`` requests wait and ``item`` may not push one out.
        """
        record = self._record(tenant)
        evicted = self.bound.push_out(tenant, record.weight) if self.full else None
        if not record.waiting:
            record.vtime = max(record.vtime, self._vclock)
        record.waiting.append(item)
        record.last_seen = now
        self._waiting += 1
        return evicted

    def pop_newest(self, tenant: str) -> Item:
        """Take out the request of ``tenant`` that came last (it has one waiting)."""
        self._waiting -= 1
        return self._tenants[tenant].waiting.pop()

    def leave(self) -> None:
        """Stop sharing the bound (this queue is no longer used)."""
        self.bound.queues.remove(self)

    def remove(self, tenant: str, item: Item) -> bool:
        """Take a waiting ``item`` of ``tenant`` out (it gave up); False when it was not waiting."""
        record = self._tenants.get(tenant)
        if record is None:
            return False
        try:
            record.waiting.remove(item)
        except ValueError:
            return False
        self._waiting -= 1
        return True

    def pick(self, now: float) -> tuple[str, Item] | None:
        """Take the next request to dispatch at ``now`` as (tenant, item); None when none may go now.

        The caller must call :meth:`started` once the request is at a worker (or :meth:`push` it back).
        """
        best_name, best_key = None, None
        active = {name for name, record in self._tenants.items() if record.active(now)}
        for name, record in self._tenants.items():
            if not record.waiting or not self._may_go(name, record, active, now):
                continue
            key = (record.in_flight / record.weight, record.vtime, record.served)
            if best_key is None or key < best_key:
                best_name, best_key = name, key
        if best_name is None:
            return None
        record = self._tenants[best_name]
        self._waiting -= 1
        return best_name, record.waiting.popleft()

    def started(self, tenant: str, now: float) -> None:
        """A request of ``tenant`` picked at ``now`` went to a worker."""
        record = self._record(tenant)
        record.in_flight += 1
        self._served += 1
        record.served = self._served
        self._vclock = max(self._vclock, record.vtime)
        record.vtime += 1.0 / record.weight
        record.refill(now)
        record.pace_tokens = max(0.0, record.pace_tokens - 1.0)

    def finished(self, tenant: str, now: float) -> None:
        """A request of ``tenant`` that :meth:`started` has ended at ``now``."""
        record = self._tenants.get(tenant)
        if record is not None and record.in_flight > 0:
            record.in_flight -= 1
            record.last_seen = max(record.last_seen, now)

    def clear(self) -> list[Item]:
        """Take every waiting request out, oldest of each tenant first (the router is shutting down)."""
        items = [item for record in self._tenants.values() for item in record.waiting]
        for record in self._tenants.values():
            record.waiting.clear()
        self._waiting = 0
        return items

    def wake_at(self, now: float) -> float | None:
        """The earliest time after ``now`` when a tenant held back by pacing may go, or, while requests wait,
        when a tenant active only by its last request turns inactive (which can lift the others' pacing and a
        caller's cap for several tenants); None when neither comes."""
        active = {name for name, record in self._tenants.items() if record.active(now)}
        times = []
        for name, record in self._tenants.items():
            if record.waiting and not self._may_go(name, record, active, now):
                times.append(now + (1.0 - record.pace_tokens) / record.pace_rate)
            elif self._waiting and not record.waiting and not record.in_flight and name in active:
                times.append(record.last_seen + ACTIVE_S)
        return min(times, default=None)

    def _may_go(self, name: str, record: _Tenant, active: set[str], now: float) -> bool:
        if record.pace_rate is None or not (active - {name}):
            return True
        record.refill(now)
        return record.pace_tokens >= 1.0 - TOKEN_TOLERANCE

    def _record(self, tenant: str) -> _Tenant:
        record = self._tenants.get(tenant)
        if record is None:
            if len(self._tenants) >= self._sweep_at:
                self._sweep()
            rate = self.rate_of(tenant)
            weight = rate if rate else self.default_weight
            pace_rate = rate * self.pacing if rate and self.pacing > 0 else None
            record = self._tenants[tenant] = _Tenant(weight=weight, pace_rate=pace_rate)
        return record

    def _sweep(self) -> None:
        # Only records holding nothing go; their virtual time would be brought up to the clock anyway.
        # Dropping a recently active one forgets its activity, which at worst un-paces another tenant briefly.
        for name in [name for name, record in self._tenants.items() if not record.waiting and not record.in_flight]:
            del self._tenants[name]
        self._sweep_at = max(SWEEP_AT, 2 * len(self._tenants))
