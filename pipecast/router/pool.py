"""The router's view of its workers and its queue of waiting requests: pure logic, no sockets.

Which worker gets a request (:meth:`WorkerPool.choose`):

- Only workers that can serve are candidates: health ``ready`` or ``partial`` (a partial worker runs
  prefill layer by layer as blocks arrive), not marked failed, not busy after a 429, and not reporting a
  full queue. A partial worker is a candidate only once it lacks at most one block, and then for at most
  one batch (its ``max_batch``) of this router's requests. Binding a request to a partial worker early
  gains only the prefill that overlaps the transfer, which one block's transfer already covers, while
  binding it to a worker that finishes late costs the gap to the first one to finish: in a multicast
  plan the first workers holding the embeddings (able to start) are often the last to hold every block
  (measured, surge over a binomial plan, 3 repeats each: first-100 p99 10.6 s binding at the embeddings,
  8.9 s binding in the last block). So requests wait in the router, bound late, for whichever worker
  can serve them first.
- A ready worker queues requests beyond its batch itself, except while the dispatcher asks for
  ``one_batch``: then it too takes at most one batch of this router's requests, so that the rest wait
  in the router. The dispatcher asks for it while several tenants are active (the next free slot is then
  handed out fairly across tenants, :mod:`pipecast.router.fairness`) and while a worker of the same
  package is still loading: in a surge the first worker to hold the model would otherwise take the whole
  backlog into its own queue, and the workers ready a moment later would find none of it. Then each
  worker also takes at most its share of the backlog (:meth:`WorkerPool.share`): the requests waiting
  and in flight spread over the workers that serve or soon will, so that the surge's first requests,
  which all waited for the model, are not all prefilled one after another by the first worker.
- While several tenants are active, apart from the others first: a request goes to the worker with the
  fewest requests of *other* tenants in flight from this router, then the most of its own tenant, so
  that a bursting tenant's admitted requests batch with each other on some workers and the other
  tenants' requests find the rest free (a shared batch or core slows each of its requests; measured
  under "Tenants" in docs/benchmarks.md). A worker then takes one batch at most, so a tenant's requests spill
  over to the next worker once a batch is full. With one tenant active this rule does not apply.
- Then least loaded. Load is the requests this router has in flight there plus the worker's reported
  queue depth (this router's requests still queued there count twice, which only steers harder away
  from deep queues). Load comes before readiness on purpose: a request queued behind k others waits k
  generations on any worker, while a partial worker's extra wait is only the part of the remaining
  transfer that its prefill cannot overlap, and that transfer happens whether or not it has work.
  So an idle partial worker beats a busy ready one; this is how a burst is absorbed while new workers
  load.
- At equal load, ``ready`` beats ``partial`` (no wait for blocks at all), and a partial worker holding
  more of its blocks beats one holding fewer (its transfer ends sooner).
- Then the worker used most recently (busy now, or idle for the shortest time), so that light traffic
  keeps as few replicas busy as it needs and the others stay idle: an autoscaler releases a replica
  only after a keep-alive of idleness (``idle_s`` in ``/stats``), which requests spread evenly over every
  replica would never leave it (measured in docs/benchmarks.md's long surge run). Pipelines: the one given fewer
  requests so far.
- A retried request names the workers that failed it (``avoid``): they come last, not never, so a
  request can still go back to a worker that has recovered when it is the only one left.

Cross-node pipelines (:class:`PipelineUnit`, from the control plane through discovery) are candidates
too, as one unit each: the request goes to the head stage's worker with the route in a header. A pipeline
is a candidate only while no ready worker has room in its batch, even one held at its share of a surge (a
full worker serves each token without the hops), every member answers its health polls and none failed a
request, its head's last 429 (the head's queue was full) is past its retry-after, and for at most
``max_in_flight`` requests of this router.
Among candidates it ranks after ready and partial workers of the same load, one whose stages hold their
blocks before one still waiting for some: an idle pipeline beats a worker with a queue, which is how
capacity appears before any node holds the whole model. A pipeline the control plane no longer lists (its
members now hold the model) takes no new requests; those in flight finish on it.

A worker that failed a request stays unavailable until a health poll *started after* the failure says
it can serve: an answer to a poll sent before the failure proves nothing about the worker now.

A request for one version of a served model (:mod:`pipecast.router.versions`) has candidates only among
the workers whose health names that package, and the pipelines of it; each version waits in a
:class:`Dispatcher` of its own. A worker whose health names no package but a served name routed to the
version (a ``--vllm-worker`` URL: nobody told the router its package) is a candidate too.
"""

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pipecast.router.admission import DEFAULT_TENANT
from pipecast.router.discovery import DiscoveredPipeline, RouteTable
from pipecast.router.errors import QueueFullError, QueueTimeoutError, RouterClosedError
from pipecast.router.fairness import FairQueue, QueueBound
from pipecast.serve.health import SERVING, WorkerHealth
from pipecast.serve.pipeline import PIPELINE_HEADER

#: Names (served names and package ids) whose last packages the pool remembers once no worker names them.
MAX_REMEMBERED_NAMES = 1000
#: A loading worker holding at least this share of its blocks counts among those that will soon serve
#: when a surge's backlog is shared out (:meth:`WorkerPool.share`).
SOON_FRACTION = 0.5
#: The health statuses of a worker whose package is still arriving.
LOADING = ("loading", "partial")
#: A loading worker whose blocks have not grown for this long (s) is not waited for when a backlog is shared
#: out: a loader that hangs must not hold its package's ready workers at one batch and their share for good.
LOADING_STALL_S = 30.0
#: A loading worker whose health polls fail counts for this long (s) after its last answer when a backlog is
#: shared out: a loader short of CPU, binding blocks, misses polls (measured in the surge bench: a quarter-core
#: worker answered no poll within 1 s for 1-2 s at a time). Dropping it at once gave the first ready worker the
#: whole backlog, prefilled one request after another while the others came to serve a second later.
UNANSWERED_GRACE_S = 3.0
#: A worker whose answers were its own errors this many times in a row comes after every other worker for
#: ERROR_BACKOFF_S (s), and again after each further one until it answers well (WorkerPool.record_errors).
ERRORS_IN_ROW = 3
ERROR_BACKOFF_S = 10.0


@dataclass
class Worker:
    """What the router knows about one serving worker, keyed by its base URL."""

    url: str
    node_id: str
    #: The last health answer; None until one arrives, and again once a poll fails.
    health: WorkerHealth | None = None
    #: Why the worker is unavailable now (the failed poll, request or 429), "" when it is not.
    problem: str = ""
    in_flight: int = 0
    #: Tenant -> requests of that tenant in flight from this router (tenants with none left out).
    tenants: dict[str, int] = field(default_factory=dict)
    routed: int = 0
    #: Clock time of the last request failure; set until a later-started poll says the worker serves.
    failed_at: float | None = None
    #: Clock time of the last 429, and until when the worker is not sent more.
    busy_at: float | None = None
    busy_until: float = 0.0
    #: Clock time the worker joined the pool, began to serve (ready or partial) or its in-flight count last
    #: dropped to 0, whichever is latest; None while it has requests in flight (``pipelined`` ones too).
    idle_since: float | None = None
    #: Requests of this router in flight through pipelines this worker is a stage of: it serves them as much
    #: as its own (a pipeline's head prefills and decodes), so it is not idle while any runs.
    pipelined: int = 0
    #: Clock time its health last turned ``ready`` (None while it is not): how long its package has had a
    #: whole worker, so the canary gate does not judge a version's TTFT on requests that waited for its cold start.
    ready_since: float | None = None
    #: The (package id, blocks present) of its furthest health answer, and the clock time it was reached:
    #: more blocks of the package, or another package begun (see LOADING_STALL_S). Kept across failed polls,
    #: so a loader that hangs is not taken for a new one each time its health answers again.
    progress: tuple[str | None, int] | None = None
    progressed_at: float | None = None
    #: Answers in a row that were its own errors (a 5xx, a stream ended by its error event), and until when it comes
    #: after every other worker for them (see ERRORS_IN_ROW).
    errors_in_row: int = 0
    erring_until: float = 0.0
    #: The engine steps of its last health answer that reported them, and the clock time they last changed.
    steps: int | None = None
    stepped_at: float = -math.inf
    #: The last health answer and the clock time it came, kept when a later poll fails (see
    #: UNANSWERED_GRACE_S).
    answered: WorkerHealth | None = None
    answered_at: float = -math.inf

    @property
    def endpoint(self) -> str:
        """The base URL requests are sent to."""
        return self.url

    @property
    def reports_work(self) -> bool:
        """Whether its health answers say when its engine works (its steps): a pipecast worker's do, a vLLM
        worker's do not."""
        return self.answered is not None and self.answered.steps is not None

    @property
    def headers(self) -> dict[str, str]:
        """Headers a request sent here carries besides the client's."""
        return {}

    @property
    def status(self) -> str:
        """``unknown`` before the first poll, ``down`` after a failed one, else the reported state."""
        if self.health is not None:
            return self.health.status
        return "down" if self.problem else "unknown"

    @property
    def load(self) -> int:
        """Requests in flight from this router plus the worker's reported queue depth."""
        return self.in_flight + (self.health.queue_depth if self.health else 0)

    def can_take(self, now: float, one_batch: bool = False, share: int | None = None) -> bool:
        """Whether a new request may be sent to this worker at clock time ``now``; with ``one_batch``, a
        ready worker too takes at most one batch (its ``max_batch``) of this router's requests; with
        ``share``, at most that many of them."""
        health = self.health
        if health is None or not health.can_serve or self.failed_at is not None:
            return False
        if health.status == "partial" and health.blocks_present < health.blocks_total - 1:
            return False
        if ((health.status == "partial" or one_batch) and health.max_batch
                and self.in_flight >= health.max_batch):
            return False
        if share is not None and self.in_flight >= share:
            return False
        return self.busy_at is None or now >= self.busy_until

    def idle_s(self, now: float) -> float | None:
        """Seconds without requests of this router at clock time ``now``; None while it has some."""
        return None if self.idle_since is None else now - self.idle_since

    def describe(self, now: float) -> dict:
        """A JSON-ready view for ``GET /v1/workers``."""
        health = self.health
        return {
            "url": self.url, "node_id": self.node_id, "status": self.status,
            "available": self.can_take(now), "problem": self.problem,
            "in_flight": self.in_flight, "routed": self.routed, "load": self.load,
            "queue_depth": health.queue_depth if health else None,
            "running": health.running if health else None,
            "max_queue": health.max_queue if health else None,
            "max_batch": health.max_batch if health else None,
            "blocks_present": health.blocks_present if health else None,
            "blocks_total": health.blocks_total if health else None,
        }


#: Requests of this router at once on one pipeline: each runs token by token through every stage, and a
#: stage serves its pipelined sessions one call at a time.
PIPELINE_MAX_IN_FLIGHT = 4
#: A pipeline a request failed on is sent nothing until discovery lists it with new stages, or this long (s):
#: a pipeline has no health of its own to say it works again (a stage still waiting for a slow block timed out).
PIPELINE_RETRY_S = 30.0


@dataclass
class PipelineUnit:
    """A cross-node pipeline as the router routes to it: keyed by ``url`` (``pipeline:n1+n2@<package>``, see
    :func:`pipecast.router.discovery.pipeline_key`), sent to its head stage's worker with the route header."""

    url: str
    head_url: str
    member_urls: tuple[str, ...]
    header: str
    waiting_blocks: int = 0
    max_in_flight: int = PIPELINE_MAX_IN_FLIGHT
    package_id: str = ""
    erring_until: float = 0.0  # a worker's back-off (WorkerPool.record_errors), never set for a pipeline
    in_flight: int = 0
    #: The member workers each request in flight was counted at (``Worker.pipelined``), oldest first: the
    #: very ones, which stay busy with it even after the pipeline is relaid or dissolved.
    counted: list[tuple[Worker, ...]] = field(default_factory=list, repr=False)
    tenants: dict[str, int] = field(default_factory=dict)
    routed: int = 0
    failed_at: float | None = None
    problem: str = ""
    #: Until when (clock time) it is sent nothing after its head answered 429; no poll clears it early, as a
    #: pipeline has no health of its own.
    busy_until: float = 0.0

    @property
    def endpoint(self) -> str:
        return self.head_url

    @property
    def headers(self) -> dict[str, str]:
        return {PIPELINE_HEADER: self.header}

    @property
    def load(self) -> int:
        return self.in_flight

    def can_take(self, members: Iterable["Worker | None"], now: float) -> bool:
        """Whether a new request may go through this pipeline at clock time ``now``, given its members' state
        in the pool."""
        if self.failed_at is not None or self.in_flight >= self.max_in_flight or now < self.busy_until:
            return False
        # A member's health is None unless its last poll was a 200 (failed or draining workers answer 503). A member
        # serving another package (a version rollout: its agent still holds this one's blocks) would run its own
        # weights for this pipeline's layers.
        return all(m is not None and m.health is not None and m.failed_at is None and
                   (not self.package_id or m.health.package_id == self.package_id) for m in members)

    def describe(self) -> dict:
        """A JSON-ready view for ``GET /v1/workers``."""
        return {"key": self.url, "stages": list(self.member_urls), "in_flight": self.in_flight,
                "routed": self.routed, "problem": self.problem}


class WorkerPool:
    """The workers the router knows, their health and load, and the choice among them.

    Listeners (see :meth:`subscribe`) are called after every change that can make a worker able to
    take a request, so a queue of waiting requests can be served at once. ``clock`` times each worker's
    idle spells (:meth:`Worker.idle_s`).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._workers: dict[str, Worker] = {}
        self._pipelines: dict[str, PipelineUnit] = {}
        #: Pipelines no longer listed with requests still in flight through them: one listed again is the same
        #: unit (its stages still run those requests, which count against its max_in_flight).
        self._retired: dict[str, PipelineUnit] = {}
        self._listeners: list[Callable[[], None]] = []
        self._in_flight = 0
        # Served name or package id -> packages that answer it, derived from the workers' health and the
        # pipelines; rebuilt only after one of them changes (not per request, not per poll).
        self._named: dict[str, set[str]] | None = None
        #: Model name or package id -> the packages that named it the last time any did; the most recently
        #: named MAX_REMEMBERED_NAMES only (a worker whose health names a new model every poll must not grow it).
        self._last_named: dict[str, set[str]] = {}
        #: Package id -> the served names routed to it (:meth:`route`).
        self._routed: dict[str, set[str]] = {}

    def route(self, routes: RouteTable) -> None:
        """Take the served names' ``routes`` now: a worker naming no package serves a version whose served name
        it names (:meth:`serves`)."""
        routed: dict[str, set[str]] = {}
        for name, versions in routes.items():
            # Only a name with one version: a worker whose package is unknown cannot tell a canary's requests from
            # the stable version's, and its answers would count as the wrong version's (the canary gate's too).
            if len(versions) == 1:
                routed.setdefault(versions[0][0], set()).add(name)
        if routed != self._routed:
            self._routed = routed
            self._changed()  # a version's waiting requests may have a worker now

    def serves(self, worker: Worker, package: str) -> bool:
        """Whether ``worker``'s last health answer says it serves version ``package``: it names the package, or it
        names no package (a vLLM worker nobody told the router the package of) and a served name routed to it alone
        (a name with a canary has no such worker in either version)."""
        health = worker.health
        return health is not None and (health.package_id == package or health.package_id is None
                                       and health.model is not None and health.model in self._routed.get(package, ()))

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after each change that may free capacity."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        """Stop calling ``listener``."""
        self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def workers(self) -> list[Worker]:
        """Every known worker, by URL."""
        return [self._workers[url] for url in sorted(self._workers)]

    def get(self, url: str) -> Worker | None:
        """The worker at ``url``, or None when it is not (or no longer) in the pool."""
        return self._workers.get(url)

    def pipelines(self) -> list[PipelineUnit]:
        """Every pipeline the pool routes to now, by key."""
        return [self._pipelines[key] for key in sorted(self._pipelines)]

    def sync_pipelines(self, found: Iterable[DiscoveredPipeline],
                       max_in_flight: int = PIPELINE_MAX_IN_FLIGHT) -> tuple[list[str], list[str]]:
        """Make the pool route to exactly the pipelines ``found``, each as listed now (its stages' layer cuts
        change as they hold more blocks); return the keys added and removed. A removed pipeline's requests in
        flight finish undisturbed (its stages keep their sessions), and count if it is listed again."""
        found = {p.key: p for p in found}
        added = sorted(set(found) - set(self._pipelines))
        removed = sorted(set(self._pipelines) - set(found))
        for key in removed:
            unit = self._pipelines.pop(key)
            if unit.in_flight:
                self._retired[key] = unit
        for key in added:
            p = found[key]
            unit = self._retired.pop(key, None)
            if unit is None:
                unit = PipelineUnit(key, p.head_url, p.member_urls, p.header, package_id=p.package_id)
            unit.max_in_flight = max_in_flight
            self._pipelines[key] = unit
        freed = relaid = False
        for key, p in found.items():
            unit = self._pipelines[key]
            unit.waiting_blocks = p.waiting_blocks
            layout = (p.head_url, p.member_urls, p.header, p.package_id)
            changed = (unit.head_url, unit.member_urls, unit.header, unit.package_id) != layout
            if changed:  # the same nodes with new layer cuts (one holds more blocks now), or moved: as listed
                unit.head_url, unit.member_urls, unit.header, unit.package_id = layout
                relaid = True
            if unit.failed_at is not None and (changed or self.clock() - unit.failed_at >= PIPELINE_RETRY_S):
                unit.failed_at, unit.problem = None, ""
                freed = True
        if added or removed or relaid:
            self._named = None
        if added or freed:
            self._changed()
        return added, removed

    def sync(self, members: Mapping[str, str]) -> tuple[list[str], list[str]]:
        """Make the pool hold exactly ``members`` (URL -> node id); return the URLs added and removed.

        A removed worker's requests in flight finish undisturbed; it is only no longer chosen.
        """
        added = sorted(set(members) - set(self._workers))
        removed = sorted(set(self._workers) - set(members))
        for url in removed:
            del self._workers[url]
        if removed:
            self._named = None
        for url in added:
            self._workers[url] = Worker(url=url, node_id=members[url], idle_since=self.clock())
        for url, node_id in members.items():
            self._workers[url].node_id = node_id
        if added or removed:  # a loader gone can lift the share the ready workers were held to
            self._changed()
        return added, removed

    def record_health(self, url: str, health: WorkerHealth, polled_at: float) -> None:
        """Store a health answer to a poll sent at clock time ``polled_at``."""
        worker = self._workers.get(url)
        if worker is None:
            return
        # A poll missed within the grace is no break in serving: an idle spell goes on (restarted at each missed
        # poll, a replica on a lossy network might never stay idle for a scaler's keep-alive).
        last = worker.health or (worker.answered if self.clock() - worker.answered_at <= UNANSWERED_GRACE_S else None)
        was_serving = last is not None and last.status in SERVING
        was_ready = worker.health is not None and worker.health.status == "ready"
        # Any change is progress: fewer blocks than before is a new load (a worker restarted at the same URL),
        # whose count then grows from there (kept as the most ever, its reload looked stalled for good).
        if worker.progress is None or worker.progress != (health.package_id, health.blocks_present):
            worker.progress, worker.progressed_at = (health.package_id, health.blocks_present), self.clock()
        if health.steps is not None and health.steps != worker.steps:
            worker.steps, worker.stepped_at = health.steps, self.clock()
        renamed = worker.health is None or (worker.health.model, worker.health.package_id) != (health.model,
                                                                                                health.package_id)
        worker.health = worker.answered = health
        worker.answered_at = self.clock()
        if renamed:
            self._named = None
            if health.package_id:
                self._names()  # remembered at once, even if the worker goes before the next request
        if health.status in SERVING and not was_serving and worker.in_flight == 0 and worker.pipelined == 0:
            # Idle counts from when it could serve: a replica just loaded is not "idle" since it joined.
            worker.idle_since = self.clock()
        if health.status != "ready":
            worker.ready_since = None
        elif not was_ready:
            worker.ready_since = self.clock()
        if worker.failed_at is not None and polled_at >= worker.failed_at and health.status in SERVING:
            worker.failed_at = None
        if worker.busy_at is not None and polled_at >= worker.busy_at and health.can_serve:
            worker.busy_at = None
        if worker.failed_at is None and worker.busy_at is None and self.clock() >= worker.erring_until:
            worker.problem = ""
        self._changed()

    def record_unreachable(self, url: str, problem: str) -> None:
        """A health poll failed (error, timeout, 503, bad answer): the worker is down until one works."""
        worker = self._workers.get(url)
        if worker is not None:
            if worker.health is not None:
                self._named = None
            worker.health = None
            worker.ready_since = None
            worker.problem = problem

    def record_failure(self, url: str, problem: str, at: float) -> None:
        """A request failed on the worker (or pipeline) at clock time ``at``: unavailable until a newer poll
        says it serves (a pipeline: until discovery lists it with new stages, or :data:`PIPELINE_RETRY_S`)."""
        worker = self._workers.get(url) or self._pipelines.get(url)
        if worker is not None:
            worker.failed_at = at
            worker.problem = problem
            self._changed()  # a failed loader no longer holds the ready workers to a share

    def record_errors(self, unit: "Worker | PipelineUnit", error: str | None, at: float) -> None:
        """The answer of ``unit`` at clock time ``at`` was its own ``error`` (a 5xx, a stream ended by its error
        event), or was not (None). :data:`ERRORS_IN_ROW` in a row with no good answer between put the worker after
        every other able to take a request for :data:`ERROR_BACKOFF_S`, and each further one for as long again: a
        worker failing every request (a sticky device fault, its health still ready) is always idle, and so would
        take most requests. It is not refused: the errors may be the requests' own (a prompt out of memory, sent
        again by its client), and a pool of one would then serve nobody. The very unit, as for :meth:`finish`: one
        listed again since is a new worker."""
        worker = unit
        if not isinstance(worker, Worker) or self._workers.get(worker.url) is not worker:
            return
        if error is None:
            worker.errors_in_row = 0
            return
        worker.errors_in_row += 1
        if worker.errors_in_row >= ERRORS_IN_ROW:
            worker.erring_until = at + ERROR_BACKOFF_S
            worker.problem = (f"worker {worker.url}: {worker.errors_in_row} errors in a row (last: {error}); sent "
                              f"requests only when no other worker can take them, for {ERROR_BACKOFF_S:g} s")
            self._changed()

    def record_busy(self, url: str, problem: str, at: float, retry_after_s: float) -> None:
        """The worker at ``url``, or the head of the pipeline keyed ``url``, answered 429 at ``at``: send it
        nothing for ``retry_after_s`` (a worker: or until a newer poll shows room)."""
        worker = self._workers.get(url)
        if worker is not None:
            worker.busy_at = at
            worker.busy_until = at + retry_after_s
            worker.problem = problem
        elif (pipeline := self._pipelines.get(url)) is not None:
            pipeline.busy_until = at + retry_after_s

    def _names(self) -> dict[str, set[str]]:
        if self._named is None:
            named: dict[str, set[str]] = {}
            for w in self._workers.values():
                if w.health and w.health.package_id:
                    for key in {w.health.model, w.health.package_id} - {None}:
                        named.setdefault(key, set()).add(w.health.package_id)
            for p in self._pipelines.values():
                if p.package_id:
                    named.setdefault(p.package_id, set()).add(p.package_id)
            self._named = named
            for key, packages in named.items():  # most recently named last
                self._last_named.pop(key, None)
                self._last_named[key] = packages
            while len(self._last_named) > MAX_REMEMBERED_NAMES:
                del self._last_named[next(iter(self._last_named))]
        return self._named

    def serving_packages(self) -> set[str]:
        """The packages that some worker's last health answer names, or some pipeline runs."""
        return {package for packages in self._names().values() for package in packages}

    def packages_named(self, model: str) -> set[str]:
        """The packages of the workers whose last health answer names ``model`` (served name or package id);
        while none does, the packages that named it last (after a scale to zero: a request for it then waits
        for a worker of its package, which a scaler sees and which another model's worker would refuse)."""
        return set(self._names().get(model) or self._last_named.get(model, ()))

    def choose(self, now: float, avoid: Iterable[str] = (), one_batch: bool = False,
               tenant: str | None = None, package: str | None = None,
               share: int | None = None) -> "Worker | PipelineUnit | None":
        """The best worker for a new request at clock time ``now`` (module docstring), or None;
        ``one_batch`` and ``share`` as for :meth:`Worker.can_take`; ``tenant``: the request's, given while
        several tenants are active (it then goes apart from the others' requests); ``package``: only
        workers and pipelines of this version."""
        avoid = frozenset(avoid)
        able = [worker for worker in self._workers.values() if worker.can_take(now)
                and (package is None or self.serves(worker, package))]
        candidates = [worker for worker in able if worker.can_take(now, one_batch, share)]
        # Room in a ready worker's batch is judged before its share: a worker held at its share while others
        # load still serves each token without the hops, so the request waits for it (or them) instead.
        if not any(w.health.status == "ready" and w.load < (w.health.max_batch or 1) for w in able):
            candidates += [p for p in self._pipelines.values()
                           if (package is None or p.package_id == package)
                           and p.can_take((self._workers.get(url) for url in p.member_urls), now)]
        if not candidates:
            return None
        def apart(unit: "Worker | PipelineUnit") -> tuple[int, int]:
            if tenant is None:
                return (0, 0)
            own = unit.tenants.get(tenant, 0)
            return (unit.in_flight - own, -own)

        # A worker erring lately (record_errors) comes last, not never: its errors may have been the requests' own.
        return min(candidates, key=lambda unit: (unit.url in avoid, now < unit.erring_until,
                                                 *apart(unit), unit.load) + (
            (2, unit.waiting_blocks, unit.routed) if isinstance(unit, PipelineUnit) else
            (unit.health.status != "ready", -unit.health.fraction_present, _idle_order(unit))) + (unit.url,))

    def begin(self, url: str, tenant: str = DEFAULT_TENANT) -> "Worker | PipelineUnit":
        """Count a request of ``tenant`` sent to ``url`` (a worker's, or a pipeline's key); return the unit
        counted, which :meth:`finish` takes when the request ends."""
        unit = self._workers.get(url) or self._pipelines[url]
        unit.in_flight += 1
        unit.tenants[tenant] = unit.tenants.get(tenant, 0) + 1
        unit.routed += 1
        if isinstance(unit, Worker):
            unit.idle_since = None
        else:
            members = tuple(w for member in unit.member_urls if (w := self._workers.get(member)) is not None)
            unit.counted.append(members)
            for worker in members:
                worker.pipelined += 1
                worker.idle_since = None
        self._in_flight += 1
        return unit

    def finish(self, unit: "Worker | PipelineUnit", tenant: str = DEFAULT_TENANT) -> None:
        """Count a request of ``tenant`` that :meth:`begin` counted at ``unit`` as done. The very unit, not
        the one at its URL now: a worker removed and listed again mid-request is a new one, which never
        counted the request (its count would go negative and it would never turn idle)."""
        self._in_flight -= 1
        unit.in_flight -= 1
        left = unit.tenants.get(tenant, 0) - 1
        if left > 0:
            unit.tenants[tenant] = left
        else:
            unit.tenants.pop(tenant, None)
        # Which of a pipeline's requests ended is not known: each frees the oldest's members (the same ones unless
        # it was relaid meanwhile).
        members = (unit,) if isinstance(unit, Worker) else unit.counted.pop(0) if unit.counted else ()
        if not unit.in_flight and self._retired.get(unit.url) is unit:
            del self._retired[unit.url]
        for worker in members:
            if worker is not unit:
                worker.pipelined -= 1
            if worker.in_flight == 0 and worker.pipelined == 0:
                worker.idle_since = self.clock()
        self._changed()

    @property
    def in_flight(self) -> int:
        """Requests of this router at workers now, those at workers removed since included."""
        return self._in_flight

    def share(self, waiting: int, package: str | None = None) -> int | None:
        """While some worker that has not failed is loading a package (``package``, if given; health
        ``loading`` or ``partial`` naming it): how many of this router's requests each of its workers
        should hold at most, the ``waiting`` ones and those in flight at its workers spread over the
        workers that serve it or soon will (``ready``, ``partial``, or ``loading`` with at least
        :data:`SOON_FRACTION` of its blocks). None while none is loading: no cap. A loading worker whose
        blocks have not grown for :data:`LOADING_STALL_S` counts for neither; one whose health polls fail
        counts by its last answer for :data:`UNANSWERED_GRACE_S`. Requests in flight through the package's
        pipelines count among those in flight: the pipelines' members are among the workers counted."""
        now = self.clock()
        mine = []
        for w in self._workers.values():
            health = w.health if w.health is not None else \
                w.answered if now - w.answered_at <= UNANSWERED_GRACE_S else None
            if health is not None and w.failed_at is None and health.package_id is not None \
                    and (package is None or health.package_id == package) \
                    and not (health.status in LOADING and now - w.progressed_at > LOADING_STALL_S):
                mine.append((w, health))
        if not any(health.status in LOADING for _, health in mine):
            return None
        soon = sum(health.status in SERVING or (health.status == "loading" and health.fraction_present >= SOON_FRACTION)
                   for _, health in mine)
        pipelined = sum(p.in_flight for p in self._pipelines.values() if package is None or p.package_id == package)
        return max(1, math.ceil((waiting + pipelined + sum(w.in_flight for w, _ in mine)) / max(1, soon)))

    def serving(self, now: float) -> int:
        """How many workers can take a request now."""
        return sum(worker.can_take(now) for worker in self._workers.values())


def _idle_order(worker: Worker) -> float:
    """Most recently used first: a busy worker, then the one idle since the latest time."""
    return -math.inf if worker.idle_since is None else -worker.idle_since


def _assigned(future: asyncio.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


@dataclass(eq=False)
class _Waiter:
    avoid: frozenset[str]
    future: asyncio.Future = field(repr=False)


class Dispatcher:
    """The router's bounded queue of admitted requests waiting for a worker, served fairly across tenants;
    with ``package``, the queue of one version's requests (only its workers serve them).

    Requests wait in one queue per tenant (:class:`~pipecast.router.fairness.FairQueue`: the next one is
    the tenant's furthest below its share, a tenant alone gets every worker, a tenant with a rate may be
    paced while others are active). A request that can go at once gets a worker at once; otherwise it
    waits, at most ``queue_timeout_s`` after its arrival. Waiters are served whenever the pool reports a
    change (health answers arrive every poll interval, so the end of a worker's 429 back-off is noticed
    within one interval), a request ends, a paced tenant's next dispatch is due, or a tenant turns inactive.

    While more than one tenant is active, a ready worker takes at most one batch (its ``max_batch``) of
    this router's requests, as a partial one always does: the rest wait here, where the next free slot
    goes to the tenant below its share, instead of in the worker's own first-come-first-served queue.
    So too while a worker of this queue's package is loading, and then each worker takes at most its
    share of the requests waiting and in flight (:meth:`WorkerPool.share`): a surge's backlog goes to the
    workers as they come to serve, not all into the first one's queue. Otherwise ready workers queue more
    themselves (their batches never wait for a round trip to the router).

    ``max_queue`` bounds the requests waiting here, or all those waiting in the queues sharing it (a
    :class:`~pipecast.router.fairness.QueueBound`: a router's, one queue per version).
    """

    def __init__(self, pool: WorkerPool, max_queue: int | QueueBound, queue_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 rate_of: Callable[[str], float | None] = lambda tenant: None,
                 default_weight: float = 1.0, pacing: float = 0.0, package: str | None = None) -> None:
        self.pool = pool
        self.package = package
        self.queue_timeout_s = queue_timeout_s
        self.clock = clock
        self._queue: FairQueue[_Waiter] = FairQueue(max_queue, rate_of, default_weight, pacing)
        self.max_queue = self._queue.max_queue
        self._closed = False
        self._wake: asyncio.TimerHandle | None = None
        pool.subscribe(self._assign)

    @property
    def waiting(self) -> int:
        """Requests waiting for a worker now."""
        return self._queue.waiting

    def waiting_by_tenant(self) -> dict[str, int]:
        """Tenant -> requests waiting for a worker now (tenants with none left out)."""
        return self._queue.waiting_by_tenant()

    def idle(self) -> bool:
        """Whether no tenant is active here now (none waiting, none in flight, none recently): a queue made
        afresh would dispatch as this one does (but for a slowly paced tenant, whose pacing starts afresh)."""
        return self._queue.active_tenants(self.clock()) == 0

    async def acquire(self, arrival: float, avoid: Iterable[str] = (), tenant: str = DEFAULT_TENANT) -> Worker:
        """Wait for a worker for a request of ``tenant`` that arrived at clock time ``arrival``; count it
        as busy there.

        The caller must :meth:`release` the worker (with the same tenant) when the request ends. Raises
        :class:`QueueFullError` when ``max_queue`` requests already wait (also later, to a waiting
        request pushed out by a request of a tenant with fewer waiting), :class:`QueueTimeoutError` past
        the deadline and :class:`RouterClosedError` once the router shuts down.
        """
        if self._closed:
            raise RouterClosedError()
        self._assign()  # those already waiting go first, if they may
        if self._queue.full and self.clock() >= arrival + self.queue_timeout_s:
            # A request past its deadline (a retry) would push another out only to give up at once.
            raise self._timeout()
        waiter = _Waiter(frozenset(avoid), asyncio.get_running_loop().create_future())
        evicted = self._queue.push(tenant, waiter, self.clock())
        if evicted is not None and not evicted.future.done():
            evicted.future.set_exception(QueueFullError(self.max_queue))
        self._assign()
        try:
            async with asyncio.timeout(arrival + self.queue_timeout_s - self.clock()):
                return await waiter.future
        except TimeoutError:
            # A worker assigned in the same loop turn as the deadline still counts.
            if _assigned(waiter.future):
                return waiter.future.result()
            raise self._timeout() from None
        except asyncio.CancelledError:
            if _assigned(waiter.future):
                self.release(waiter.future.result(), tenant)
            raise
        finally:
            self._queue.remove(tenant, waiter)
            waiter.future.cancel()

    def _timeout(self) -> QueueTimeoutError:
        return QueueTimeoutError(self.queue_timeout_s, len(self.pool.workers()), self.pool.serving(self.clock()))

    def release(self, worker: Worker, tenant: str = DEFAULT_TENANT) -> None:
        """The request of ``tenant`` that :meth:`acquire` gave ``worker`` to has ended."""
        self._queue.finished(tenant, self.clock())
        self.pool.finish(worker, tenant)  # calls _assign: the slot goes to whoever is next

    def close(self) -> None:
        """Refuse new requests and fail every waiting one with :class:`RouterClosedError`."""
        self._closed = True
        if self._wake is not None:
            self._wake.cancel()
        for waiter in self._queue.clear():
            if not waiter.future.done():
                waiter.future.set_exception(RouterClosedError())

    def detach(self) -> None:
        """Close this queue, stop following the pool and leave the bound it shares (a version no longer
        routed)."""
        self.close()
        self.pool.unsubscribe(self._assign)
        self._queue.leave()

    def _assign(self) -> None:
        if not self._queue.waiting:
            return
        now = self.clock()
        # Several tenants: a ready worker takes one batch, so the next slot is handed out here, fairly, and
        # each request goes apart from the other tenants' where it can. A worker still loading: one batch
        # too, so the backlog waits here for whichever worker frees a slot or holds the model next.
        several_tenants = self._queue.active_tenants(now) > 1
        share = self.pool.share(self._queue.waiting, self.package)
        one_batch = several_tenants or share is not None
        while self._queue.waiting and self.pool.choose(now, one_batch=one_batch, package=self.package,
                                                       share=share) is not None:
            picked = self._queue.pick(now)
            if picked is None:
                break
            tenant, waiter = picked
            if waiter.future.done():  # cancelled or timed out in this loop turn: its slot goes on
                continue
            worker = self.pool.choose(now, waiter.avoid, one_batch=one_batch,
                                      tenant=tenant if several_tenants else None, package=self.package, share=share)
            self.pool.begin(worker.url, tenant)
            self._queue.started(tenant, now)
            waiter.future.set_result(worker)
        self._schedule_wake(now)

    def _schedule_wake(self, now: float) -> None:
        """Come back when a paced tenant's next dispatch is due, or a tenant turns inactive (nothing else would
        call :meth:`_assign`)."""
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        due = self._queue.wake_at(now)
        if due is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: nobody can be waiting
            return
        self._wake = loop.call_later(max(0.0, due - now), self._assign)
