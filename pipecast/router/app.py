"""The router's HTTP server (aiohttp): an OpenAI-compatible front for a pool of serving workers.

Endpoints:

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: the body goes to a worker unchanged, at the
  same path. While no worker can take it, the
  request waits in the router's queue (beyond ``max_queue`` waiting in the router, every version's queue
  counted: 429 with ``Retry-After``; past the queue deadline, ``queue_timeout_s`` after its arrival: 503). A
  worker that fails before anything reached the client (a streaming one: before its first whole event)
  is marked unavailable and the request goes to another one (at most ``max_retries`` times, then
  502 naming the workers; also 502 naming them when the retry finds no worker before the queue deadline). A
  worker's 429 sends the request back to the queue. Streaming answers (``text/event-stream``) are
  relayed event by event as they arrive; if the worker fails mid-stream, the client gets a final
  ``data: {"error": {...}}`` event and the stream ends (a stream the worker ends with an error event of
  its own, or without ``data: [DONE]``, counts as failed too; a torn last event is dropped, never passed
  on). Responses carry ``x-pipecast-queue-seconds`` and ``x-pipecast-worker`` (the worker's URL; like the
  workers named by a 502 or a stream's error event, only to the callers that may read the pool's views, below);
  a streaming response's headers leave with the worker's first whole event, not before.
- ``GET /health``: the router's own state; ``GET /v1/workers``: the pool; ``GET /v1/models``: the served
  names of the control plane's routes, each with its versions (package id, weight, workers), then the
  other models its workers serve or load (as their health polls name them), each with its package id and
  workers;
  ``GET /metrics``: Prometheus (also on the ``--metrics-port``: :func:`build_metrics_app`).
- ``GET /stats``: the scaling signals (:mod:`pipecast.router.signals`) as JSON, for autoscalers polling every second
  or so: ``format`` (1), ``instance`` (a random id of this router process: no rate is taken between two answers of
  different ones), ``now_unix``, ``started_unix``, ``queue_depth`` (waiting here for a worker), ``in_flight``
  (at workers), ``workers`` (each ``url``, ``node_id``, ``status``, ``in_flight``, ``queue_depth``: requests waiting
  in its own queue as its last health poll said, and ``idle_s``: seconds since its in-flight count last dropped to 0
  or it joined, null while busy), cumulative ``counters`` (``arrived``, ``prompt_tokens``, ``admitted``: those their
  tenant's limit let through, ``answered``, ``rejected``, ``failed``: take rates by differencing two answers),
  ``ttft`` (``window_s``, ``count``, ``p50``, ``p95``, ``p99`` over the last 60 s), ``tenants`` (each ``arrived``,
  ``admitted``, ``rejected`` and ``queued``: waiting here now) and ``versions`` (by package id, for requests of
  routed names: ``queue_depth`` and ``in_flight`` now, ``ready_s``: seconds since its longest-ready worker turned
  ready, null while none is, ``counters`` with ``arrived``, ``admitted``, ``answered``, ``failed``,
  ``completion_tokens``, and ``ttft`` as above).

``/stats``, ``/v1/workers`` and ``/metrics`` show the pool's insides (tenants, worker URLs and loads): with
credentials (``RouterConfig.views_need_key``, a router given an ``auth_token``) they answer only a request
presenting the cluster's serving key (header ``X-Pipecast-Serving-Key``, as the scaling daemon does): 401
(``invalid_serving_key``) without it or with another, 503 (``credentials_pending``) while the router has not
learned the key. Prometheus scrapes ``/metrics`` on a port of its own instead (:func:`build_metrics_app`, the
``--metrics-port``), which the operator exposes only inside the cluster. ``/health`` and ``/v1/models`` answer
anyone; ``/v1/models`` names its workers' URLs only to the callers ``/stats`` answers, and so do completions
(:meth:`Router.shows_workers`): to anyone else a 502 says only how many attempts failed.

A request whose ``model`` is a served name with a route (:mod:`control_plane.routes`: ``pipecast cp route``,
``canary``, ``promote``, ``rollback``) goes to one of its versions by the route's weights
(:mod:`pipecast.router.versions`) and waits for a worker of that package only; a request for a model that
the workers of one package name (their served name or package id) waits for those; other requests go to
any worker, which refuses a model it does not serve (404).

Before its queue, the router admits each request for its tenant (:mod:`pipecast.router.admission`): with
API keys configured, a request without a known ``Authorization: Bearer`` key gets 401
(``authentication_error``); a tenant over its rate limit gets 429 (``rate_limited``) with ``Retry-After``, its
body unread (the connection closes where the body is not all in, once the client had a second to finish it:
:data:`~pipecast.core.httpserve.RUNNER_OPTIONS`).
Admitted requests wait for a worker in one queue per tenant and are dispatched fairly across tenants
(:mod:`pipecast.router.fairness`): the next free slot goes to the tenant furthest below its share.

Every wait on a worker has a deadline: ``connect_timeout_s`` to connect, ``upstream_timeout_s`` of
silence before its response or between two chunks of it (a worker silent before anything reached the client
while its health showed it working, its engine stepping, gets the request a 504, not a retry that would do the
work again), and as long for each piece of the request's body
that the worker must take (a worker that stops reading a large body holds no request for good). A client
has 75 s to send a request's headers (:data:`~pipecast.core.httpserve.RUNNER_OPTIONS`; an idle connection is
closed after as long) and ``upstream_timeout_s`` to send its whole request body: a body not in by then is answered 408
(``request_timeout``), naming the deadline, and its connection closed.
"""

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from control_plane.errors import PermissionDenied, Unauthenticated
from pipecast.core.credentials import SERVING_KEY_HEADER, presents_key, serving_headers
from pipecast.core.httpserve import BodyTimeoutError, BodyTooLargeError, decode_json_body, read_body
from pipecast.core.settings import Settings
from pipecast.core.strictjson import JSONInputError, loads
from pipecast.router.admission import Admission, AdmissionConfig, AdmissionControl
from pipecast.router.discovery import DiscoveredPipeline, DiscoveredWorker, Discovery, RouteTable
from pipecast.router.errors import (
    QueueFullError,
    QueueTimeoutError,
    RetriesExhaustedError,
    RouterClosedError,
    RouterError,
    TenantAuthError,
    TenantNameError,
    TenantOverLimitError,
    ViewKeyError,
    ViewKeyPendingError,
    WorkerBusyError,
    WorkerError,
    WorkerFailedError,
    WorkerStreamError,
    WorkerTimeoutError,
    describe_exception,
)
from pipecast.router.fairness import QueueBound
from pipecast.router.health import HealthMonitor
from pipecast.router.metrics import RouterMetrics
from pipecast.router.pool import (
    PIPELINE_MAX_IN_FLIGHT,
    PIPELINE_RETRY_S,
    Dispatcher,
    PipelineUnit,
    Worker,
    WorkerPool,
)
from pipecast.router.signals import Signals, answer_tokens, request_prompt_tokens, stream_tokens
from pipecast.router.versions import VersionChooser, route_versions
from pipecast.serve.errors import ServingKeyError, StageFailedError, openai_error_type

log = logging.getLogger(__name__)

WORKER_HEADER = "x-pipecast-worker"
QUEUE_HEADER = "x-pipecast-queue-seconds"
#: A request's body goes to the worker in pieces of this size, each within the upstream deadline.
BODY_PIECE_BYTES = 256 << 10
#: Client headers passed on to the worker; the rest (Host, Content-Length, ...) are per connection.
FORWARDED_HEADERS = ("Content-Type", "Accept", "X-Request-Id")
#: The client's credentials: passed on only with ``RouterConfig.forward_auth``, else any worker (whatever
#: serve URL it registered) would receive what clients authenticate to the router with.
AUTH_HEADER = "Authorization"
#: Retry-After of the router's own 429, and the back-off after a worker's 429 without a usable one.
RETRY_AFTER_S = 1
#: The longest back-off a worker's Retry-After sets (longer ones are cut to it): no health poll clears a pipeline
#: head's, so one of hours, or inf, would shut the pipeline out for good.
MAX_WORKER_RETRY_AFTER_S = PIPELINE_RETRY_S
#: How a worker's stream ends when complete, and how the error event that ends a failed one begins.
DONE_EVENT = b"data: [DONE]"
ERROR_EVENT = b'data: {"error"'
#: A pipeline's error event as callers not shown the workers read it (the head's names the stage that failed).
PIPELINE_ERROR_MESSAGE = "a stage of the pipeline serving this request failed"
#: A worker silent at the upstream deadline is still working if its engine's steps changed within this many health
#: polls (at least WORKING_MIN_S): stepping now, not merely once since the request came.
WORKING_POLLS = 4
WORKING_MIN_S = 2.0


@dataclass(frozen=True)
class RouterConfig:
    """The router's tunables (the ``router`` command's options)."""

    max_queue: int = 256
    queue_timeout_s: float = 120.0
    health_interval_s: float = 0.25
    health_timeout_s: float = 1.0
    connect_timeout_s: float = 5.0
    #: Longest silence tolerated from a worker: before its response headers, and between two chunks; and
    #: longest it may take to read each piece of a request's body (BODY_PIECE_BYTES).
    #: A partial worker may wait for blocks before its first token, hence minutes.
    #: Also the longest a client may take to send its whole request body (else 408, ``request_timeout``): a
    #: client stalled mid-body would else hold its handler and up to ``max_body_bytes`` for good.
    upstream_timeout_s: float = 300.0
    max_retries: int = 2
    discovery_interval_s: float = 2.0
    discovery_timeout_s: float = 5.0
    #: Largest request body accepted (the serving worker's limit; see pipecast.serve.app.MAX_BODY_BYTES):
    #: a larger one is refused with 413 from its Content-Length, unread.
    max_body_bytes: int = 16 << 20
    #: Largest non-streaming answer read from a worker, and largest single event of a streamed one: a
    #: worker sending more (a bug, or not a pipecast worker) fails the request instead of filling memory.
    max_answer_bytes: int = 64 << 20
    max_event_bytes: int = 1 << 20
    #: Pass the client's Authorization header on to the worker (settings: router_forward_auth).
    forward_auth: bool = False
    #: Tenants and their rate limits (settings: router_api_keys, router_tenant_*).
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    #: While other tenants are active, a tenant with a rate limit is dispatched to the workers at most this
    #: many times its rate (0: never paced; settings: router_tenant_pacing; see pipecast.router.fairness).
    tenant_pacing: float = Settings.model_fields["router_tenant_pacing"].default
    #: Route to cross-node pipelines the control plane forms while no worker holds the whole model.
    pipelines: bool = True
    #: Requests of this router at once on one pipeline.
    pipeline_max_in_flight: int = PIPELINE_MAX_IN_FLIGHT
    #: ``/stats``, ``/v1/workers`` and ``/metrics`` answer only requests presenting the cluster's serving key
    #: (set where the router has credentials; the key comes from its discovery sources).
    views_need_key: bool = False

    def __post_init__(self) -> None:
        # A nan or infinite deadline is none: a queued request never answered, a stalled worker holding its slot.
        for name in ("queue_timeout_s", "health_interval_s", "health_timeout_s", "connect_timeout_s",
                     "upstream_timeout_s", "discovery_interval_s", "discovery_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"RouterConfig.{name} must be a finite number of seconds > 0, got {value!r}")

    def tenant_rate(self, tenant: str) -> float | None:
        """``tenant``'s admitted rate (requests/s), its weight in fair dispatch; None when unlimited."""
        limit = self.admission.limit_of(tenant)
        return None if limit is None else limit.rate

    @property
    def unlimited_weight(self) -> float:
        """The weight of a tenant without a rate limit in fair dispatch: the highest configured rate (such a
        tenant is trusted at least as much as any limited one), 1 when no tenant is limited."""
        rates = [limit.rate for limit in self.admission.limits.values()]
        if self.admission.default_limit is not None:
            rates.append(self.admission.default_limit.rate)
        return max(rates, default=1.0)


def complete_events_end(buffer: bytes | bytearray) -> int:
    """The length of the prefix of ``buffer`` made of whole Server-Sent Events (0 when there is none)."""
    ends = [buffer.rfind(separator) + len(separator) for separator in (b"\n\n", b"\r\n\r\n")
            if separator in buffer]
    return max(ends, default=0)


def has_error_event(events: bytes | bytearray) -> bool:
    """Whether whole Server-Sent Events ``events`` hold an error event (``data: {"error": ...}``, as a serving
    worker ends a stream it failed). Token events cannot fake one: their text is JSON-escaped."""
    return events.startswith(ERROR_EVENT) or b"\n" + ERROR_EVENT in events


def error_events(events: bytes | bytearray) -> list[dict]:
    """The error objects of the error events among whole Server-Sent Events ``events`` (those that parse)."""
    found = []
    for line in bytes(events).split(b"\n"):
        if line.startswith(ERROR_EVENT):
            try:
                error = json.loads(line[len(b"data: "):])["error"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(error, dict):
                found.append(error)
    return found


def without_nodes(events: bytes | bytearray) -> bytes:
    """``events`` with each error event's message replaced by :data:`PIPELINE_ERROR_MESSAGE` (its type and code
    kept): what a caller not shown the workers reads of a pipeline's error, whose message names a stage's URL."""
    lines = []
    for line in bytes(events).split(b"\n"):
        if line.startswith(ERROR_EVENT):
            kept = next(iter(error_events(line)), {})
            line = sse_event({"error": {"message": PIPELINE_ERROR_MESSAGE,
                                        **{k: kept[k] for k in ("type", "param", "code") if k in kept}}}).rstrip(b"\n")
        lines.append(line)
    return b"\n".join(lines)


def ends_done(events: bytes | bytearray) -> bool:
    """Whether the last of Server-Sent Events ``events`` is ``data: [DONE]`` (a JSON event ends with ``}``)."""
    return events.rstrip(b"\r\n").endswith(DONE_EVENT)


def whole_last_event(tail: bytes | bytearray) -> bool:
    """Whether ``tail``, what a worker's stream ended with after its last blank line, is a whole event all the
    same: ``data: [DONE]``, or an error event whose JSON is whole (anything else is the torn start of one)."""
    line = bytes(tail).rstrip(b"\r\n")
    if line == DONE_EVENT:
        return True
    if not line.startswith(ERROR_EVENT):
        return False
    try:
        loads(line[len(b"data: "):])
    except JSONInputError:
        return False
    return True


def sse_event(payload: dict) -> bytes:
    """One Server-Sent Event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def error_body(message: str, status: int, code: str | None, **extra: object) -> dict:
    """An OpenAI error object, as a serving worker's: the ``type`` of the HTTP ``status``, ``code`` the reason."""
    return {"error": {"message": message, "type": openai_error_type(status), "param": None, "code": code, **extra}}


def _unread_body(error: Exception, status: int, code: str) -> web.Response:
    """The answer refusing a request's body (too large, too slow), closing the connection: the rest of the body
    is never read (dropped for a second at most as it comes: :data:`~pipecast.core.httpserve.RUNNER_OPTIONS`)."""
    response = web.json_response(error_body(str(error), status, code), status=status)
    response.force_close()
    return response


def retry_after_seconds(value: str | None) -> float:
    """A worker's ``Retry-After`` in seconds, at most :data:`MAX_WORKER_RETRY_AFTER_S` (a missing, HTTP-date,
    negative, infinite or NaN value gives the default, :data:`RETRY_AFTER_S`)."""
    try:
        seconds = float(value) if value is not None else RETRY_AFTER_S
    except ValueError:
        return RETRY_AFTER_S
    return min(seconds, MAX_WORKER_RETRY_AFTER_S) if 0 <= seconds < math.inf else RETRY_AFTER_S


def _package_of(unit: Worker | PipelineUnit) -> str | None:
    """The package ``unit`` serves as last heard: a pipeline's, or its worker's last health answer's (kept when a
    later poll fails)."""
    if isinstance(unit, PipelineUnit):
        return unit.package_id or None
    return unit.answered.package_id if unit.answered is not None else None


def _was_ready(unit: object, arrival: float) -> bool:
    """Whether ``unit`` (a worker; a pipeline never is) was ready when a request arrived at ``arrival``."""
    since = getattr(unit, "ready_since", None)
    return since is not None and since <= arrival


def _serving_key_refusal(answer: bytes) -> str | None:
    """The message of a serving worker's refusal of the router's serving key (a 401 with its code), else None:
    a worker's other 401s (a vLLM worker's API key, with forward_auth) are the client's to read."""
    try:
        error = loads(answer).get("error")
    except (JSONInputError, AttributeError):
        return None
    if isinstance(error, dict) and error.get("code") == ServingKeyError.code:
        return str(error.get("message"))
    return None


class Router:
    """The pool, its queue, health polling, discovery and request forwarding of one router."""

    def __init__(self, config: RouterConfig, sources: Sequence[Discovery],
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.pool = WorkerPool(clock)
        self.admission = AdmissionControl(config.admission, clock)
        self.signals = Signals(clock, wall_clock)
        #: ``max_queue`` bounds the requests waiting in the router, all its queues together.
        self._bound = QueueBound(config.max_queue)
        self._closed = False  # stop_accepting() was called: queues made from now on are closed too
        self.dispatcher = self._new_dispatcher(None)
        #: Package id -> the queue of requests for that version of a routed name.
        self.version_dispatchers: dict[str, Dispatcher] = {}
        self.routes: RouteTable = {}
        self.versions = VersionChooser()
        self.metrics = RouterMetrics(lambda: self.waiting, lambda: self.signals.snapshot_versions())
        self._forwarded = FORWARDED_HEADERS + ((AUTH_HEADER,) if config.forward_auth else ())
        self._sources = list(sources)
        self._discovered: dict[int, list[DiscoveredWorker]] = {}
        self._serving_keys: dict[str, bytes] = {}  # worker URL -> the serving key requests to it present
        self._pipelines: dict[int, list[DiscoveredPipeline]] = {}
        self._failing: dict[tuple[int, str], str] = {}  # (source, what) whose last discovery failed: how
        self._refused: Exception | None = None  # the last discovery's refusal of the router's token, if any
        self._routes: dict[int, RouteTable] = {}
        #: Package id -> requests at its workers now, counted as each is dispatched and released (a worker's
        #: health says its package only while its polls answer: one missed poll hid its requests from /stats).
        self._in_flight_of: dict[str, int] = {}
        self._session: aiohttp.ClientSession | None = None
        self._monitor: HealthMonitor | None = None
        self._discovery_task: asyncio.Task | None = None
        self._upstream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s,
                                                       sock_read=config.upstream_timeout_s)

    def _new_dispatcher(self, package: str | None) -> Dispatcher:
        config = self.config
        dispatcher = Dispatcher(self.pool, self._bound, config.queue_timeout_s, self.clock, rate_of=config.tenant_rate,
                                default_weight=config.unlimited_weight, pacing=config.tenant_pacing, package=package)
        if self._closed:
            dispatcher.close()
        return dispatcher

    def _dispatchers(self) -> list[Dispatcher]:
        return [self.dispatcher, *self.version_dispatchers.values()]

    @property
    def waiting(self) -> int:
        """Requests waiting in the router for a worker now, every version's included."""
        return sum(d.waiting for d in self._dispatchers())

    def _dispatcher_for(self, version: str | None) -> Dispatcher:
        if version is None:
            return self.dispatcher
        dispatcher = self.version_dispatchers.get(version)
        if dispatcher is None:
            dispatcher = self.version_dispatchers[version] = self._new_dispatcher(version)
        return dispatcher

    def choose_version(self, model: object) -> str | None:
        """The package a request for ``model`` goes to: by its route's weights; without a route, the one
        package whose workers name ``model`` (several routers serve several models); None: any worker."""
        versions = route_versions(self.routes, model)
        if versions:
            return self.versions.choose(versions, model, self.pool.serving_packages())
        named = self.pool.packages_named(model) if isinstance(model, str) else set()
        return named.pop() if len(named) == 1 else None

    def _sync_routes(self) -> None:
        routes: RouteTable = {}
        for index in sorted(self._routes):
            routes.update(self._routes[index])
        if routes != self.routes:
            log.info("routes: %s", "; ".join(f"{name} " + ", ".join(f"{p[:12]} {w}%" for p, w in versions)
                                             for name, versions in sorted(routes.items())) or "none")
        self.routes = routes
        self.pool.route(routes)
        self.versions.forget(routes)
        routed = {package for versions in routes.values() for package, _ in versions}
        # Only idle queues go: one with requests in flight or tenants active recently holds the records that
        # dispatch its next requests fairly (a new queue would take a bursting tenant for one alone).
        for package in [p for p, d in self.version_dispatchers.items() if p not in routed and d.idle()]:
            self.version_dispatchers.pop(package).detach()
        for package in self.signals.forget_versions(routed | self.pool.serving_packages()):
            log.info("version %s: neither routed nor served for a while, its counters dropped", package[:12])

    async def start(self) -> None:
        """Open the upstream session, learn the workers once, then keep polling and rediscovering."""
        # No connection limit: the default (100) would make request 101 wait for a socket without deadline.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._monitor = HealthMonitor(self.pool, self._session, self.config.health_interval_s,
                                      self.config.health_timeout_s, self.clock)
        try:
            await self.refresh_workers()
            if self._refused is not None:  # its configuration, which no retry mends (found in an operator's walk)
                raise self._refused
        except BaseException:  # stopped while it waits on its control plane (found in review: its session unclosed)
            await self.close()
            raise
        self._discovery_task = asyncio.create_task(self._rediscover(), name="router discovery")

    def stop_accepting(self) -> None:
        """Fail every queued request and refuse new ones (retries too); requests already at a worker go on."""
        self._closed = True
        for dispatcher in self._dispatchers():
            dispatcher.close()

    async def close(self) -> None:
        """Stop accepting, stop polling and discovery, close the upstream session."""
        self.stop_accepting()
        if self._discovery_task is not None:
            self._discovery_task.cancel()
            await asyncio.gather(self._discovery_task, return_exceptions=True)
        if self._monitor is not None:
            await self._monitor.close()
        if self._session is not None:
            await self._session.close()

    async def refresh_workers(self) -> None:
        """Ask every discovery source for its workers and make the pool hold their union."""
        self._refused = None
        for index, source in enumerate(self._sources):
            # Each list with its own deadline, pipelines last: a slow pipeline forming (thousands of receivers
            # mid-transfer) must not hold back the workers or the routes (a canary's rollback).
            asks = [("workers", source.list_workers, self._discovered), ("routes", source.list_routes, self._routes)]
            if self.config.pipelines:
                asks.append(("pipelines", source.list_pipelines, self._pipelines))
            for what, ask, answers in asks:
                try:
                    async with asyncio.timeout(self.config.discovery_timeout_s):
                        answers[index] = await ask()
                # Any failure of a source (its client may raise anything) must not stop discovery or empty
                # the pool: keep the source's last answer and try again next interval.
                except Exception as exc:
                    # Warned of once an outage (then at debug level): a control plane down for an hour logged
                    # lines every interval; again when it fails otherwise (found in review: down at the router's
                    # start, then refusing its token, it said nothing of the refusal).
                    how = type(exc).__name__
                    log.log(logging.DEBUG if self._failing.get((index, what)) == how else logging.WARNING,
                            "discovery of %s from %s failed, keeping its last %d: %s", what, source.name,
                            len(answers.get(index, ())), describe_exception(exc, self.config.discovery_timeout_s))
                    self._failing[(index, what)] = how
                    if isinstance(exc, (Unauthenticated, PermissionDenied)):
                        self._refused = exc
                    if what == "workers":  # most likely down: the rest would fail alike, each after its deadline
                        break
                else:
                    if self._failing.pop((index, what), None) is not None:
                        log.warning("discovery of %s from %s answers again", what, source.name)
        found_workers = [found for index in sorted(self._discovered) for found in self._discovered[index]]
        members = {found.url: found.node_id for found in found_workers}
        self._serving_keys = {found.url: found.serving_key for found in found_workers}
        added, removed = self.pool.sync(members)
        for url in added:
            log.info("worker %s (%s) added", url, members[url])
        for url in removed:
            log.info("worker %s removed", url)
        self._monitor.sync(members, {found.url: found.engine for found in found_workers},
                           {found.url: found.package_id for found in found_workers})
        added, removed = self.pool.sync_pipelines(
            [p for index in sorted(self._pipelines) for p in self._pipelines[index]],
            self.config.pipeline_max_in_flight)
        for key in added:
            log.info("pipeline %s added", key)
        for key in removed:
            log.info("pipeline %s dissolved: it takes no new requests", key)
        # Also those of a unit gone since its last request ended after its removal.
        self.metrics.forget_workers({unit.url for unit in [*self.pool.workers(), *self.pool.pipelines()]})
        self._sync_routes()

    async def _rediscover(self) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval_s)
            await self.refresh_workers()

    async def complete(self, request: web.Request) -> web.StreamResponse:
        """Handle ``POST /v1/completions`` and ``POST /v1/chat/completions`` (module docstring)."""
        arrival = self.clock()
        try:  # before the body is read: an unknown client costs nothing more
            tenant = self.config.admission.tenant_of(request.headers)
        except TenantAuthError as exc:
            return self._reject(exc, 401, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        except TenantNameError as exc:
            return self._reject(exc, 400, "invalid_tenant")
        admission = self.admission.admit(tenant)
        if not admission.admitted:  # before the body too: a tenant over its limit costs the router its headers only
            return self._over_limit(request, admission)
        try:
            body = await read_body(request, self.config.max_body_bytes, self.config.upstream_timeout_s)
        except BodyTooLargeError as exc:
            return _unread_body(exc, 413, "request_too_large")
        except BodyTimeoutError as exc:
            log.info("client's request body refused: %s", exc)
            return _unread_body(exc, 408, "request_timeout")
        try:
            payload = await decode_json_body(body)
        except JSONInputError as exc:
            return web.json_response(error_body(f"request body is not JSON: {exc}", 400, "invalid_json"),
                                     status=400)
        if not isinstance(payload, dict):
            return web.json_response(error_body("request body must be a JSON object", 400, "invalid_json"),
                                     status=400)
        version = self.choose_version(payload.get("model"))
        counted_as = self.signals.arrived(tenant, request_prompt_tokens(payload), version)
        self.signals.admission(counted_as, True, version)
        headers = {name: request.headers[name] for name in self._forwarded if name in request.headers}
        failures: list[WorkerFailedError] = []
        queued_s = 0.0
        # Kept for every attempt: a queue with this request in flight is not detached (_sync_routes).
        dispatcher = self._dispatcher_for(version)
        while True:
            waiting_since = self.clock()
            try:
                worker = await dispatcher.acquire(arrival, avoid={failure.worker for failure in failures},
                                                  tenant=tenant)
            except QueueFullError as exc:
                return self._reject(exc, 429, "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
            except QueueTimeoutError as exc:
                if failures:  # the deadline counts from arrival: a worker that went silent may have spent it
                    return self._failed_for_good(request, RetriesExhaustedError(failures, exc), version)
                return self._reject(exc, 503, "queue_timeout", version=version)
            except RouterClosedError as exc:
                return self._reject(exc, 503, "shutting_down", version=version)
            queued_s += self.clock() - waiting_since
            counted = version or _package_of(worker)
            self._count_in_flight(counted, 1)
            try:
                if request.transport is None or request.transport.is_closing():
                    log.info("client left while its request was queued (%.3f s)", queued_s)
                    return web.Response(status=499)  # nginx's "client closed request"; nobody reads it
                self.metrics.routed.labels(worker.url).inc()
                return await self._attempt(request, body, headers, worker, arrival, queued_s, version)
            except WorkerTimeoutError as exc:
                return self._timed_out(request, exc, version)
            except WorkerBusyError as exc:
                # At least one poll interval, so a worker saying "Retry-After: 0" is not hammered.
                self.pool.record_busy(worker.url, str(exc), self.clock(),
                                      max(exc.retry_after_s, self.config.health_interval_s))
            except WorkerFailedError as exc:
                self.pool.record_failure(worker.url, str(exc), self.clock())
                failures.append(exc)
                if len(failures) > self.config.max_retries:
                    return self._failed_for_good(request, RetriesExhaustedError(failures), version)
                log.warning("retrying on another worker: %s", exc)
                self.metrics.retried.labels(worker.url).inc()
            finally:
                dispatcher.release(worker, tenant)
                self._count_in_flight(counted, -1)

    def _count_in_flight(self, package: str | None, change: int) -> None:
        """Count ``change`` requests of ``package`` (None: none) more at its workers; a package at 0 is left out."""
        if package:
            left = self._in_flight_of.get(package, 0) + change
            if left:
                self._in_flight_of[package] = left
            else:
                del self._in_flight_of[package]

    def _over_limit(self, request: web.Request, admission: Admission) -> web.Response:
        """The 429 of a request its tenant's limit refused, counted as arrived (for no version: its body, which
        names the model, is not read); the connection closes where the body is not all in, as it is never read."""
        counted_as = self.signals.arrived(admission.tenant, 0)
        self.signals.admission(counted_as, False)
        self.metrics.tenant_rejected.labels(counted_as).inc()
        retry_after = admission.retry_after_header
        error = TenantOverLimitError(admission.tenant, admission.limit.rate, admission.limit.burst, retry_after)
        response = self._reject(error, 429, "rate_limited", {"Retry-After": str(retry_after)})
        if not request.content.is_eof():
            response.force_close()
        return response

    def _failed_for_good(self, request: web.Request, error: RetriesExhaustedError,
                         version: str | None) -> web.Response:
        """The 502 of a request that failed on workers and is not retried, naming them (the last one in the
        ``x-pipecast-worker`` header) to a caller that may see them (:meth:`shows_workers`), else saying only
        how many attempts failed: the failures name the workers' URLs, and their errors may too."""
        log.warning("request failed for good: %s", error)
        then = f"; then {error.then}" if error.then else ""
        return self._workers_failed(request, version, error.failures[-1].worker, 502, "worker_failed", str(error),
                                    f"request failed on {len(error.failures)} attempt(s) at the router's workers{then}",
                                    attempts=[failure.worker for failure in error.failures])

    def _timed_out(self, request: web.Request, error: WorkerTimeoutError, version: str | None) -> web.Response:
        """The 504 of a request its worker was still working on at the upstream deadline, naming the worker to a
        caller that may see it (:meth:`shows_workers`)."""
        log.warning("%s", error)
        message = str(error).removeprefix(f"worker {error.worker}: ")
        return self._workers_failed(request, version, error.worker, 504, "worker_timeout", str(error),
                                    f"the worker serving this request sent {message}")

    def _workers_failed(self, request: web.Request, version: str | None, worker: str, status: int, code: str,
                        named: str, unnamed: str, **fields: Any) -> web.Response:
        """A request the workers failed, counted as such (the last ``worker`` to fail it): its answer names them
        (``named``, ``fields`` and the ``x-pipecast-worker`` header) to a caller that may see them, else says
        ``unnamed``."""
        self.metrics.failed.labels(worker, "before_response").inc()
        self.signals.failed(version)
        if not self.shows_workers(request):
            return web.json_response(error_body(unnamed, status, code), status=status)
        return web.json_response(error_body(named, status, code, worker=worker, **fields), status=status,
                                 headers={WORKER_HEADER: worker})

    def _reject(self, error: RouterError, status: int, reason: str,
                headers: dict[str, str] | None = None, version: str | None = None) -> web.Response:
        self.metrics.rejected.labels(reason).inc()
        if status == 429:
            self.signals.rejected()
        elif status >= 500:
            self.signals.failed(version)
        return web.json_response(error_body(str(error), status, reason), status=status, headers=headers)

    async def _attempt(self, request: web.Request, body: bytes, headers: dict[str, str],
                       worker: Worker | PipelineUnit,
                       arrival: float, queued_s: float, version: str | None = None) -> web.StreamResponse:
        """Send the request to ``worker`` once and relay its answer.

        Raises :class:`WorkerFailedError` when nothing reached the client yet (retryable) and
        :class:`WorkerBusyError` on the worker's 429.
        """
        try:
            # aiohttp's read deadline starts once the body is written: the writing gets one of its own.
            async with asyncio.timeout(None) as writing:
                upstream = await self._session.post(
                    f"{worker.endpoint}{request.path}", data=self._body_pieces(body, writing),
                    headers={**headers, **worker.headers, "Content-Length": str(len(body)),
                             **serving_headers(self._serving_keys.get(worker.endpoint, b""))},
                    timeout=self._upstream_timeout)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if not writing.expired():  # a worker that does not take the body has not begun its work
                self._if_working(worker, exc, request.path)
            problem = f"no answer to POST {request.path}: {self._describe(exc)}"
            raise WorkerFailedError(worker.url, problem) from exc
        async with upstream:
            if upstream.status == 429:
                raise WorkerBusyError(worker.url, retry_after_seconds(upstream.headers.get("Retry-After")))
            if upstream.status == 503:
                raise WorkerFailedError(worker.url, "answered 503 (not serving)")
            timing = {QUEUE_HEADER: f"{queued_s:.6f}"}
            if self.shows_workers(request):
                timing[WORKER_HEADER] = worker.url
            if upstream.status == 200 and upstream.content_type == "text/event-stream":
                return await self._relay_stream(request, upstream, worker, arrival, queued_s, timing, version)
            try:
                answer = await self._read_answer(upstream, worker)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._if_working(worker, exc, request.path)
                problem = f"lost before its answer was complete: {self._describe(exc)}"
                raise WorkerFailedError(worker.url, problem) from exc
            if upstream.status == 401 and (refused := _serving_key_refusal(answer)):
                raise WorkerFailedError(worker.url, f"refused the router's credentials: {refused}")
            self.metrics.queued.observe(queued_s)  # once per request: this answer is the one the client gets
            if upstream.status == 200:
                self._answer_started(arrival, version, worker)
                self.signals.answered(version, answer_tokens(answer) if version else 0)
                self.pool.record_errors(worker, None, self.clock())
            elif upstream.status >= 500:
                self.metrics.failed.labels(worker.url, "error_status").inc()
                self.signals.failed(version)
                self.pool.record_errors(worker, f"answered {upstream.status}", self.clock())
            content_type = upstream.headers.get("Content-Type", "application/json")
            return web.Response(status=upstream.status, body=answer,
                                headers={"Content-Type": content_type, **timing})

    def _answer_started(self, arrival: float, version: str | None, worker: Worker | PipelineUnit) -> None:
        """The answer to a request that arrived at ``arrival`` begins now: its TTFT, in /stats and /metrics."""
        self.metrics.ttft.observe(self.signals.answer_started(arrival, version, warm=_was_ready(worker, arrival)))

    async def _body_pieces(self, body: bytes, writing: asyncio.Timeout) -> AsyncIterator[bytes]:
        """``body`` in pieces, each to be taken by the worker within ``upstream_timeout_s`` (``writing``'s
        deadline, moved on as each piece is asked for and lifted once all are written)."""
        loop = asyncio.get_running_loop()
        for start in range(0, len(body), BODY_PIECE_BYTES):
            writing.reschedule(loop.time() + self.config.upstream_timeout_s)
            yield body[start:start + BODY_PIECE_BYTES]
        writing.reschedule(None)

    async def _read_answer(self, upstream: aiohttp.ClientResponse, worker: Worker) -> bytes:
        """A worker's whole (non-streaming) answer, at most ``max_answer_bytes`` of it held:
        :class:`WorkerFailedError` for a larger one."""
        limit = self.config.max_answer_bytes
        declared = upstream.content_length
        if declared is not None and declared > limit:
            raise WorkerFailedError(worker.url, f"answered {declared} bytes, over the router's limit of {limit}")
        answer = bytearray()
        async for chunk in upstream.content.iter_any():
            answer += chunk
            if len(answer) > limit:
                raise WorkerFailedError(worker.url, f"answered more than the router's limit of {limit} bytes")
        return bytes(answer)

    async def _stream_events(self, upstream: aiohttp.ClientResponse, worker: Worker) -> AsyncIterator[bytes]:
        """A worker's event stream as it arrives, in whole events (one or more at a time); at its clean end, what
        follows its last blank line too if that is a whole event all the same (:func:`whole_last_event`), else
        it is dropped: the torn start of an event, which must not swallow the error event sent after it.

        Raises :class:`WorkerFailedError` when the worker fails before its first whole event (nothing reached the
        client: retryable) and :class:`WorkerStreamError` after it.
        """
        pending = bytearray()
        started = False

        def failure(problem: str) -> WorkerError:
            return (WorkerStreamError if started else WorkerFailedError)(worker.url, problem)

        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                if not started:  # queued behind full batches, say: nothing reached the client
                    self._if_working(worker, exc, upstream.url.path)
                where = "mid-stream" if started else "before its first event"
                raise failure(f"failed {where}: {self._describe(exc)}") from exc
            if not chunk:
                break
            pending += chunk
            end = complete_events_end(pending)
            if end:
                started = True
                yield bytes(pending[:end])
                del pending[:end]
            if len(pending) > self.config.max_event_bytes:  # buffered output stays bounded
                raise failure(f"sent an event of more than {self.config.max_event_bytes} bytes")
        if whole_last_event(pending):  # ended as an event ends: a client would else drop it (the SSE rule)
            yield bytes(pending).rstrip(b"\r\n") + b"\n\n"
        elif not started:
            raise failure("ended its stream before its first event")

    async def _relay_stream(self, request: web.Request, upstream: aiohttp.ClientResponse, worker: Worker,
                            arrival: float, queued_s: float, timing: dict[str, str],
                            version: str | None = None) -> web.StreamResponse:
        """Relay a worker's event stream event by event; end it with an error event if the worker fails.

        The client's response begins with the worker's first whole event: a worker that fails before it (killed
        in its prefill) has sent the client nothing, and raises :class:`WorkerFailedError` to be retried
        elsewhere. Only whole events are passed on, so a worker dying mid-event never leaves the client a torn
        one in front of the error event. A stream is answered only if it ends with ``data: [DONE]`` and holds no
        error event: a worker that fails a request after its headers left (an engine error) ends the stream
        with an error event of its own, which counts as failed and gives no TTFT sample if it came first.
        """
        tokens = 0
        refused = done = False  # an error event of the worker's seen; the last event [DONE]
        stage_failed = False  # a pipeline's error event saying a stage failed
        failure = None
        async with contextlib.aclosing(self._stream_events(upstream, worker)) as stream:
            events: bytes | None = await anext(stream)
            response = web.StreamResponse(headers={"Content-Type": upstream.headers["Content-Type"],
                                                   "Cache-Control": "no-cache", **timing})
            await response.prepare(request)
            self.metrics.queued.observe(queued_s)  # once per request: attempts that failed before are not answers
            if not events.startswith(ERROR_EVENT):  # the worker's error first is no first token
                self._answer_started(arrival, version, worker)
            try:
                while events is not None:
                    erred = has_error_event(events)
                    refused, done = refused or erred, ends_done(events)
                    if version is not None:  # per-version tokens/s: only routed requests pay for decoding events
                        tokens += stream_tokens(events)
                    if erred and isinstance(worker, PipelineUnit):
                        stage_failed = stage_failed or any(
                            e.get("code") == StageFailedError.code for e in error_events(events))
                        if not self.shows_workers(request):
                            events = without_nodes(events)
                    if not await self._send(response, events):
                        return response
                    # Nothing comes after [DONE]: a worker keeping its connection open must not hold the answer.
                    events = None if done else await anext(stream, None)
            except WorkerStreamError as exc:
                failure = exc
        if failure is None and not done and not refused:
            failure = WorkerStreamError(worker.url, "ended its stream without data: [DONE]")
        if failure is not None:
            log.warning("%s", failure)
            self.pool.record_failure(worker.url, str(failure), self.clock())
            self.metrics.failed.labels(worker.url, "mid_stream").inc()
            self.signals.failed(version)
            named = {"worker": worker.url} if self.shows_workers(request) else {}
            message = str(failure) if named else "the worker serving this request failed mid-stream"
            await self._send(response, sse_event(error_body(message, 502, "worker_failed", **named)))
        elif refused:  # the client has the worker's own error event: nothing to add
            log.warning("worker %s ended a stream with an error event", worker.url)
            self.metrics.failed.labels(worker.url, "error_event").inc()
            self.signals.failed(version)
            if stage_failed:  # as a failure before the answer: nothing more goes to the pipeline for a while
                self.pool.record_failure(worker.url, "a stage failed mid-stream", self.clock())
            self.pool.record_errors(worker, "ended a stream with its error event", self.clock())
        else:
            self.signals.answered(version, tokens)
            self.pool.record_errors(worker, None, self.clock())
        try:
            async with asyncio.timeout(self.config.upstream_timeout_s):  # a client that stopped reading
                await response.write_eof()
        except (ConnectionResetError, TimeoutError) as exc:
            log.info("client left before the end of its stream: %s",
                     describe_exception(exc, self.config.upstream_timeout_s))
        return response

    def _if_working(self, worker: Worker | PipelineUnit, exc: BaseException, path: str) -> None:
        """Raise :class:`WorkerTimeoutError` if ``exc`` is the upstream read deadline of a worker whose health
        answers now and shows its engine stepping now (its steps changed within the last few polls): the request is
        long, the worker is not hung, and generating it again elsewhere would only double the work. A worker down,
        or whose engine stopped, has failed: the request is retried."""
        recent = max(WORKING_POLLS * self.config.health_interval_s, WORKING_MIN_S)
        if (isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError)
                and isinstance(worker, Worker) and worker.health is not None and worker.reports_work
                and self.clock() - worker.stepped_at <= recent):
            raise WorkerTimeoutError(worker.url, path, self.config.upstream_timeout_s) from exc

    def _describe(self, exc: BaseException) -> str:
        """Why an exchange with a worker failed, naming the deadline that expired if one did."""
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return f"no connection within {self.config.connect_timeout_s:g} s"
        if isinstance(exc, TimeoutError):
            return f"silent for more than {self.config.upstream_timeout_s:g} s"
        return describe_exception(exc, self.config.upstream_timeout_s)

    async def _send(self, response: web.StreamResponse, data: bytes) -> bool:
        """Write to the client within the upstream deadline; False when the client is gone or stuck."""
        try:
            async with asyncio.timeout(self.config.upstream_timeout_s):
                await response.write(data)
        except (ConnectionResetError, TimeoutError) as exc:
            log.info("client stopped reading a stream: %s",
                     describe_exception(exc, self.config.upstream_timeout_s))
            return False
        return True

    def health(self) -> dict:
        """The router's ``GET /health`` answer."""
        serving = self.pool.serving(self.clock())
        return {"status": "ready" if serving else "waiting", "workers": len(self.pool.workers()),
                "serving": serving, "queue_depth": self.waiting,
                "max_queue": self.dispatcher.max_queue}

    def stats(self) -> dict:
        """The ``GET /stats`` answer (module docstring)."""
        queued: dict[str, int] = {}
        for dispatcher in self._dispatchers():
            for tenant, count in dispatcher.waiting_by_tenant().items():
                queued[tenant] = queued.get(tenant, 0) + count
        ready_since: dict[str, float] = {}  # package -> since when its longest-ready worker is ready
        for unit in self.pool.workers():
            package = unit.health and unit.health.package_id
            if package and unit.ready_since is not None:
                ready_since[package] = min(ready_since.get(package, unit.ready_since), unit.ready_since)
        now = {package: (self.version_dispatchers[package].waiting if package in self.version_dispatchers else 0,
                         self._in_flight_of.get(package, 0)) for package in self.signals.versions}
        return self.signals.snapshot(self.waiting, self.pool.in_flight, self.pool.workers(), queued, now,
                                     ready_since)

    def models(self, with_workers: bool = True) -> dict:
        """The ``GET /v1/models`` answer: each routed name with its versions, then each other model the
        workers' last health answers name (serving or loading); their workers' URLs only ``with_workers``."""
        of_package: dict[str, list[str]] = {}
        served: dict[tuple[str, str], list[str]] = {}
        for worker in self.pool.workers():
            health = worker.health
            if health is not None and health.package_id:
                of_package.setdefault(health.package_id, []).append(worker.url)
            if health is not None and health.model and health.model not in self.routes:
                served.setdefault((health.model, health.package_id or ""), []).append(worker.url)
        created = int(self.signals.started_unix)
        routed = [{"id": name, "object": "model", "created": created, "owned_by": "pipecast", "root": versions[0][0],
                   "workers": sorted(u for p, _ in versions for u in of_package.get(p, ())),
                   "versions": [{"package_id": p, "weight": w, "workers": sorted(of_package.get(p, ()))}
                                for p, w in versions]}
                  for name, versions in sorted(self.routes.items())]
        data = routed + [{"id": name, "object": "model", "created": created, "owned_by": "pipecast",
                          "root": package_id, "workers": sorted(urls)}
                         for (name, package_id), urls in sorted(served.items())]
        if not with_workers:
            for model in data:
                del model["workers"]
                for version in model.get("versions", ()):
                    del version["workers"]
        return {"object": "list", "data": data}

    def view_refusal(self, request: web.Request) -> ViewKeyError | ViewKeyPendingError | None:
        """Why ``request`` may not read the pool's views (``/stats``, ``/v1/workers``, ``/metrics``, ``/v1/models``'
        worker URLs), or None when it may: always without ``views_need_key``, else when it presents a serving key its
        sources know."""
        if not self.config.views_need_key:
            return None
        keys = {source.serving_key for source in self._sources if source.serving_key}
        if not keys:
            return ViewKeyPendingError(request.path)
        presented = request.headers.get(SERVING_KEY_HEADER)
        if any(presents_key(presented, key) for key in keys):
            return None
        return ViewKeyError(request.path, presented is not None)

    def shows_workers(self, request: web.Request) -> bool:
        """Whether the answer to ``request`` may name the workers that served or failed it: their URLs are the
        pool's insides, shown only to the callers that may read its views (:meth:`view_refusal`)."""
        return self.view_refusal(request) is None

    def refuse_view(self, request: web.Request) -> web.Response | None:
        """The answer refusing ``request`` a view of the pool (:meth:`view_refusal`), or None when it may read it."""
        refusal = self.view_refusal(request)
        if isinstance(refusal, ViewKeyPendingError):
            return web.json_response(error_body(str(refusal), 503, "credentials_pending"),
                                     status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        if refusal is not None:
            return web.json_response(error_body(str(refusal), 401, "invalid_serving_key"),
                                     status=401)
        return None

    def describe_workers(self) -> dict:
        """The ``GET /v1/workers`` answer."""
        now = self.clock()
        return {"workers": [worker.describe(now) for worker in self.pool.workers()],
                "pipelines": [pipeline.describe() for pipeline in self.pool.pipelines()],
                "queue_depth": self.waiting, "max_queue": self.dispatcher.max_queue}


ROUTER = web.AppKey("router", Router)


def build_app(router: Router) -> web.Application:
    """The aiohttp application of ``router``, to serve with :data:`~pipecast.core.httpserve.RUNNER_OPTIONS`; it
    starts the router with the app and closes it after.

    On shutdown the queue is failed at once (503 ``shutting_down``), and so is a request that must wait again
    (a retry), while requests already at a worker finish within the runner's shutdown timeout.
    """
    app = web.Application(client_max_size=router.config.max_body_bytes)
    app[ROUTER] = router

    async def lifetime(app: web.Application):
        await router.start()
        yield
        await router.close()

    async def on_shutdown(app: web.Application) -> None:
        router.stop_accepting()

    async def completions(request: web.Request) -> web.StreamResponse:
        return await router.complete(request)

    async def health(request: web.Request) -> web.Response:
        return web.json_response(router.health())

    def view(answer: Callable[[], Any], respond: Callable[[Any], web.Response] = web.json_response
             ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            refusal = router.refuse_view(request)
            return refusal if refusal is not None else respond(answer())
        return handler

    async def models(request: web.Request) -> web.Response:
        return web.json_response(router.models(with_workers=router.view_refusal(request) is None))

    app.cleanup_ctx.append(lifetime)
    app.on_shutdown.append(on_shutdown)
    app.add_routes([web.post("/v1/completions", completions), web.post("/v1/chat/completions", completions),
                    web.get("/health", health), web.get("/v1/models", models),
                    web.get("/v1/workers", view(router.describe_workers)),
                    web.get("/metrics", view(router.metrics.render, metrics_response)),
                    web.get("/stats", view(router.stats))])
    return app


def build_metrics_app(router: Router) -> web.Application:
    """An application serving only ``router``'s ``GET /metrics``, to anyone: the router's ``--metrics-port``,
    for a port only the cluster's Prometheus reaches (the main port's ``/metrics`` needs the serving key
    where the router has credentials)."""
    async def metrics(request: web.Request) -> web.Response:
        return metrics_response(router.metrics.render())

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics)])
    return app


def metrics_response(page: tuple[bytes, str]) -> web.Response:
    """The answer carrying a Prometheus ``page`` (its text and content type)."""
    data, content_type = page
    return web.Response(body=data, headers={"Content-Type": content_type})
