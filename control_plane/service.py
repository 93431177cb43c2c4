"""The gRPC servicer of the control plane (grpc.aio): requests in, state changes, streams out.

Every handler runs on the event loop and calls the synchronous state model (no locks needed); typed
errors become status codes (see :mod:`control_plane.errors`); notices the state produced are handed to
the workers' mailboxes after each call, and the assignment streams render them when they send, so a
stream always carries the current part.

With auth on, each call runs as the principal the interceptor resolved (:mod:`control_plane.auth`): a
node may register, heartbeat, report, watch and deregister only as itself (another node id is
PERMISSION_DENIED naming both), the operator RPCs (:data:`OPERATOR_RPCS`) need the master token, and the
listings any principal. Input from the network is validated before anything is recorded: a published
manifest and its id, the store's address, a worker's serve URL (on its own data-plane host).
"""

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

import grpc

from control_plane.convert import (
    KIND_TO_PROTO,
    blocks_from_proto,
    blocks_to_proto,
    deployment_from_proto,
    deployment_to_proto,
    part_to_proto,
    peer_from_proto,
    peer_to_proto,
    route_change_from_proto,
    route_to_proto,
    scale_event_from_proto,
    scale_event_to_proto,
    spec_from_proto,
    spec_to_proto,
)
from control_plane.auth import DENIED, current_principal
from control_plane.collector import collector_off
from control_plane.deployments import DeploymentBook
from control_plane.routes import ModelRoute, describe as describe_route
from control_plane.errors import (
    ERROR_TRAILER,
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID_KEY,
    ChangeNotStored,
    Conflict,
    ControlPlaneError,
    DraftStale,
    InvalidRequest,
    PermissionDenied,
    StoreError,
    Unauthenticated,
    UnknownWorker,
)
from control_plane.mailbox import Mailbox
from control_plane.metrics import ControlMetrics
from control_plane.messages import SERVE_URL_LABEL, PeerInfo, UpdateKind, WorkerSpec, serve_url_of
from control_plane.planner.plan import Plan
from control_plane.probe import listens
from control_plane.pipeline_forming import Formed, PipelineFormer, PipelineQuery
from control_plane.state import ActivePlan, ControlState, Notice, ScaleUpDraft
from control_plane.store import FencedError, PendingFlush, Store
from packager.errors import ManifestError
from packager.manifest import HEX_DIGEST, validate_manifest
from pipecast.core.credentials import (
    OPERATOR,
    CredentialError,
    Principal,
    data_plane_key,
    issue_node_token,
    serving_key,
    validate_node_id,
)
from pipecast.core.engines import SERVING_ENGINES
from pipecast.v1 import control_pb2 as pb
from pipecast.v1 import control_pb2_grpc
from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
#: How soon a flush that must be written (a call answering once its change is durable) tries again while
#: another thread holds the store (a lease renewal: one statement).
STORE_BUSY_RETRY_S = 0.005
#: Time between two lease scans that the clock shows and this process did not watch pass, from which on leases
#: and releases are moved by it (see ControlPlaneService.tick): below, the clocks' drift and the scan's jitter.
CLOCK_STEP_S = 1.0
#: Plans a scale-up makes at most, each from a draft of the state then: the cluster may change under one while it is
#: made in a thread (two scale-ups at once, drafted alike, each take the same receivers), and the next is drafted
#: anew (:class:`~control_plane.errors.DraftStale` after the last).
SCALE_UP_TRIES = 3
Handler = Callable[["ControlPlaneService", Req, grpc.aio.ServicerContext], Awaitable[Resp]]

#: RPCs only the operator (the master token) may call.
OPERATOR_RPCS = frozenset({"PublishPackage", "RemovePackage", "ScaleUp", "Release", "IssueToken", "RevokeNode",
                           "PutDeployment", "RemoveDeployment", "AppendScaleEvent", "ChangeRoute"})
#: Who every call is with auth off (dev mode): anyone may do anything, as before auth existed.
ANONYMOUS = Principal("anonymous", OPERATOR)
_PACKAGE_ID = re.compile(r"[0-9a-f]{64}")


#: Operator calls whose answers are kept for a retry of the same call (:data:`REQUEST_ID_KEY`): the latest this many.
ANSWERS_KEPT = 256


#: The longest error message sent back (characters): gRPC carries it in a trailer of at most 16 KiB, and one
#: echoing a client's long field whole would reach the client as RESOURCE_EXHAUSTED instead of its error.
MAX_ERROR_CHARS = 2000


async def _abort(context: grpc.aio.ServicerContext, error: ControlPlaneError) -> None:
    """End the call with ``error``'s status code, message (cut at :data:`MAX_ERROR_CHARS`) and class name (the
    client rebuilds it)."""
    message = str(error)
    if len(message) > MAX_ERROR_CHARS:
        message = f"{message[:MAX_ERROR_CHARS]}... ({len(message)} characters)"
    await context.abort(error.code, message, trailing_metadata=((ERROR_TRAILER, type(error).__name__),))


def _rpc(handler: Handler) -> Handler:
    """Run a unary handler inside :meth:`ControlPlaneService.handling`; an operator call naming its request
    (:data:`REQUEST_ID_KEY`) is made once, its retries answered as it was."""
    name = handler.__name__

    @functools.wraps(handler)
    async def wrapper(self: "ControlPlaneService", request: Req, context: grpc.aio.ServicerContext) -> Resp:
        async with self.handling(name, context):
            if name in OPERATOR_RPCS and (request_id := request_id_of(context)):
                return await self.answer_once((name, request_id), lambda: handler(self, request, context))
            return await handler(self, request, context)

    return wrapper


def request_id_of(context: grpc.aio.ServicerContext) -> str:
    """The call's :data:`REQUEST_ID_KEY` ("" when it names none); raises :class:`InvalidRequest` if too long."""
    request_id = dict(context.invocation_metadata() or ()).get(REQUEST_ID_KEY, "")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"metadata {REQUEST_ID_KEY!r} is {len(request_id)} characters long; at most "
                             f"{MAX_REQUEST_ID_CHARS}")
    return request_id


@dataclass
class _Answer:
    """An operator call's answer, kept for a retry of the same call; ``done`` once it has one."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    reply: object = None
    error: ControlPlaneError | None = None


class ControlPlaneService(control_pb2_grpc.ControlPlaneServicer):
    """The ControlPlane service over one :class:`ControlState`; ``store`` (if any) is flushed by the server
    periodically and here right away for the operator's changes (packages, scale-ups, releases).
    ``on_fenced`` hears of a flush refused because another control plane took the lease (the server steps
    down); the call that flushed fails UNAVAILABLE, so its client retries at the new leader. ``former`` forms
    the pipelines ListPipelines answers with (its process, if it started one, stops at ``await former.close()``).
    ``probe`` tells whether something listens at a worker's address, before one reported gone is taken for dead."""

    def __init__(self, state: ControlState, metrics: ControlMetrics, *, heartbeat_s: float,
                 store: Store | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, master: str = "",
                 book: DeploymentBook | None = None, on_fenced: Callable[[FencedError], None] | None = None,
                 former: PipelineFormer | None = None,
                 probe: Callable[[str, int], Awaitable[bool | None]] = listens):
        self.state = state
        self.probe = probe  # whether something listens at host, port (:func:`~control_plane.probe.listens`)
        self.book = book if book is not None else DeploymentBook()
        self.master = master  # empty: auth off
        self.data_key = data_plane_key(master)
        self.serving_key = serving_key(self.data_key)
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.store = store
        self.clock = clock
        self.monotonic = monotonic  # beside the clock: tells its steps from time passing (tick)
        self._ticked: tuple[float, float] | None = None  # the last tick's clock and monotonic readings
        self.on_fenced = on_fenced
        # Set once this replica stepped down (another leads, or may): its state since its last durable write is
        # not the cluster's, and nothing of it may reach a worker (dispatch).
        self.deposed = False
        self.mailboxes: dict[str, Mailbox] = {}
        self._flushing = asyncio.Lock()
        self._last_commit: asyncio.Future[None] | None = None  # its thread may outlive the call that started it
        # Per package: the last pipeline query and its answer, and the one being answered (off the loop).
        self.former = former if former is not None else PipelineFormer()
        self._pipelines: dict[str, tuple[PipelineQuery, Formed]] = {}
        self._forming: dict[str, asyncio.Future[Formed]] = {}
        self._listed: dict[str, _Listed] = {}  # per worker: what its ListWorkers message was last made of, and it
        self._listing: asyncio.Future[pb.ListWorkersResponse] | None = None
        self._streams: set[asyncio.Task] = set()  # the tasks of the open streams' handlers
        self._answers: dict[tuple[str, str], _Answer] = {}  # (rpc, request id): the latest operator calls' answers
        self._ending_streams = False
        self.state_loaded()

    def state_loaded(self) -> None:
        """Call after loading the state from the store (and at the start): a mailbox for every alive worker of
        the state, where notices for it queue until its assignment stream attaches; the leases loaded count
        from the load, not from this process's last tick (:meth:`tick`), however long ago that was."""
        self._ticked = None
        for node, worker in self.state.workers.items():
            if worker.alive:
                self.mailboxes.setdefault(node, Mailbox(node))

    @contextlib.asynccontextmanager
    async def handling(self, name: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Around each request: operator RPCs are refused to other principals; typed errors become status
        codes, other failures INTERNAL (logged); the notices it produced go to the mailboxes; its latency
        goes to the RPC histogram."""
        start = time.perf_counter()
        try:
            self.caller()  # a revoked node's token is refused, whatever it calls
            if name in OPERATOR_RPCS:
                self.require_operator(name)
            yield
        except ControlPlaneError as exc:
            await _abort(context, exc)
        except Exception as exc:
            log.exception("internal error in %s", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"control plane internal error in {name}: {exc!r}")
        finally:
            self.dispatch()
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - start)

    async def answer_once(self, key: tuple[str, str], make: Callable[[], Awaitable[Resp]]) -> Resp:
        """The answer of the operator call ``key`` (rpc, request id): ``make()``'s, or the one it had when it
        ran before (a retry; one still running is waited for). An UNAVAILABLE error (try another replica) or a
        call ended without an answer (cancelled) is not kept: its retry runs again."""
        while (answer := self._answers.get(key)) is not None:
            await answer.done.wait()
            if self._answers.get(key) is answer:
                log.info("%s retried (request %s): answered as it was", *key)
                if answer.error is not None:
                    raise answer.error
                return answer.reply  # type: ignore[return-value]
        answer = self._answers[key] = _Answer()
        try:
            answer.reply = await make()
        except ControlPlaneError as exc:
            if exc.code == grpc.StatusCode.UNAVAILABLE:
                del self._answers[key]
            else:
                answer.error = exc
            raise
        except BaseException:
            del self._answers[key]
            raise
        finally:
            answer.done.set()
            for old in list(self._answers)[:max(len(self._answers) - ANSWERS_KEPT, 0)]:  # the oldest beyond those kept
                if self._answers[old].done.is_set():
                    del self._answers[old]
        return answer.reply  # type: ignore[return-value]

    # ----- who calls -----

    def caller(self) -> Principal:
        """The principal of the call being handled (:data:`ANONYMOUS` with auth off); UNAUTHENTICATED for a node
        whose token is revoked."""
        principal = current_principal()
        if principal is not None:
            if not principal.is_operator:
                self.state.check_not_revoked(principal.name)
            return principal
        if self.master:  # unreachable behind the interceptor: refuse rather than run as nobody knows whom
            raise Unauthenticated(DENIED)
        return ANONYMOUS

    def require_operator(self, rpc: str) -> None:
        """Refuse (PERMISSION_DENIED) ``rpc`` unless the caller is the operator."""
        caller = self.caller()
        if not caller.is_operator:
            raise PermissionDenied(f"{rpc} needs the operator's token; node {caller.name!r} may not call it")

    def act_for(self, node_id: str) -> None:
        """Refuse (PERMISSION_DENIED, naming both) unless the caller may act for ``node_id``."""
        caller = self.caller()
        if not caller.may_act_for(node_id):
            raise PermissionDenied(f"node {caller.name!r} may not act for node {node_id!r}: a node token acts "
                                   "only for its own node")

    # ----- driven by the server -----

    def tick(self) -> list[str]:
        """Expire leases and due releases now; returns the workers that died. Time this process did not watch
        pass since the last tick (the wall clock stepped, or the process or its host was suspended: more than
        half a lease between ticks, which come every scan period) does not count against leases and releases."""
        now, watch = self.clock(), self.monotonic()
        if self._ticked is not None:
            unseen = (now - self._ticked[0]) - min(watch - self._ticked[1], self.state.lease_s / 2)
            if abs(unseen) >= CLOCK_STEP_S:
                log.warning("%.1f s passed by the clock that this control plane did not watch (its wall clock "
                            "stepped, or it was suspended): leases and keep-alive releases keep the time they had "
                            "left", unseen)
                self.state.shift_deadlines(unseen)
        self._ticked = (now, watch)
        dead = self.state.tick(now)
        for node in dead:
            log.warning("worker lease lapsed node=%s: marked dead, left its plans", node)
            self._close_mailbox(node)
        self.dispatch()
        return dead

    async def flush_encoded(self, *, durable: bool = False) -> None:
        """:meth:`flush`, with the changed plans' stored form made in a thread first (a plan is a value: its
        JSON for thousands of receivers takes ~0.3 s, which the event loop then need not hold) and the
        transaction committed in a thread too (writing a plan of thousands of receivers, ~10 MB, takes tens of
        ms); flushes are written in the order they were taken. The event loop never waits for the store's
        lock: while another thread uses the store (a lease renewal) the changes stay dirty for the next flush,
        or with ``durable`` (a call that answers only once its change is written) this one tries again."""
        for plan_id in list(self.state.dirty.plans):
            active = self.state.plans.get(plan_id)
            if active is not None:
                await asyncio.to_thread(collector_off, active.plan.encoded)
        if self.store is None:
            self.book.written_routes = dict(self.book.routes)  # nothing to write: shown as they are
            self.book.written_seq = self.book.last_seq
            return
        while True:
            async with self._flushing:  # the next flush waits here, not on the store's lock in the loop's thread
                if self._last_commit is not None and not self._last_commit.done():
                    # A commit whose caller was cancelled (its thread runs on) may carry this call's changes, taken
                    # with its own: answered only once it ended; if it failed they are dirty again (checked next).
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self._last_commit)
                if not (self.state.dirty or self.book.dirty):
                    return
                pending = self.store.begin_flush(self.state, self.book, wait=False)
                routes, seq = dict(self.book.routes), self.book.last_seq  # as taken: shown once written
                if pending is not None:
                    shown = self.book.written_routes
                    commit = self._last_commit = asyncio.ensure_future(asyncio.to_thread(pending.commit))
                    try:
                        await asyncio.shield(commit)
                    except asyncio.CancelledError:
                        # The caller is gone (its deadline, a stop), the commit's thread is not: restored now,
                        # its keys would be written twice. They are dirty again only if it fails.
                        commit.add_done_callback(functools.partial(self._committed, pending, routes, seq, shown))
                        raise
                    except BaseException as exc:
                        self._commit_failed(pending, exc)
                        self.dispatch()  # what waited for the commit: dropped if deposed, else handed out
                        # The change stays made: not a refusal; unless this replica was deposed (nothing of it
                        # will be written here: the caller retries with the new leader).
                        if durable and isinstance(exc, StoreError) and not isinstance(exc, FencedError):
                            raise ChangeNotStored(f"the change was made but not stored yet ({exc}); it is written "
                                                  f"with the next flush that succeeds, and lost if the control "
                                                  f"plane stops first") from exc
                        raise
                    self._written(routes, seq)
                    self.dispatch()  # the notices held while it was under way (dispatch)
                    return
            if not durable:
                return
            await asyncio.sleep(STORE_BUSY_RETRY_S)

    def _written(self, routes: dict[str, ModelRoute], seq: int) -> None:
        """A flush that took ``routes`` and the events through ``seq`` is written: they are shown."""
        self.book.written_routes = routes
        self.book.written_seq = max(self.book.written_seq, seq)

    def _committed(self, pending: PendingFlush, routes: dict[str, ModelRoute], seq: int,
                   shown: dict[str, ModelRoute], commit: asyncio.Future[None]) -> None:
        """The end of a commit whose caller was cancelled meanwhile: what the caller would have done."""
        if commit.cancelled():  # the loop stops: written or not, writing it again is harmless
            pending.restore()
        elif (error := commit.exception()) is not None:
            log.warning("a flush whose caller was cancelled failed, its changes stay dirty: %s", error)
            self._commit_failed(pending, error)
        elif self.book.written_routes is shown:  # else a later flush, written after this one, showed its routes
            self._written(routes, seq)
        self.dispatch()  # the notices held while it was under way

    def _commit_failed(self, pending: PendingFlush, error: BaseException) -> None:
        """The keys of ``pending`` are dirty again; a deposed leader steps down."""
        pending.restore()
        if isinstance(error, FencedError):
            self.deposed = True
            if self.on_fenced is not None:
                self.on_fenced(error)

    def flush(self) -> None:
        """Write the state's changes to the store (if any)."""
        if self.store is None:
            return
        try:
            self.store.flush(self.state)
            self.store.flush_book(self.book)
        except FencedError as exc:
            self.deposed = True
            if self.on_fenced is not None:
                self.on_fenced(exc)
            raise

    def dispatch(self) -> None:
        """Hand the state's notices to the workers' mailboxes (notices for nodes without one are moot:
        stores, dead workers), none while a commit is under way; a deposed replica's are dropped (a change whose
        durable write was refused: its streams still open would send it to workers, which would act on a plan the
        cluster never stored)."""
        commit = self._last_commit
        if commit is not None and not commit.done():
            # A commit under way may be refused (this replica deposed): what it carries reaches no worker before it
            # ends (the flush dispatches then).
            return
        if commit is not None and not commit.cancelled() and isinstance(commit.exception(), FencedError):
            # Refused, its caller not resumed yet (a loop turn or two, in which other calls end): deposed now.
            self.deposed = True
        notices, self.state.notices = self.state.notices, []
        if self.deposed:
            return
        for notice in notices:
            mailbox = self.mailboxes.get(notice.node_id)
            if mailbox is not None:
                mailbox.put(notice)

    async def end_streams(self, timeout_s: float) -> None:
        """End every open stream, and those opened from now on, with status OK (the control plane stops): a
        stream still open when grpc's server stops is cancelled there, and grpc logs that as an ERROR."""
        self._ending_streams = True
        for task in self._streams:
            task.cancel()
        if self._streams:
            await asyncio.wait(set(self._streams), timeout=timeout_s)

    @contextlib.contextmanager
    def _open_stream(self) -> Iterator[None]:
        """Around a stream handler's waits: :meth:`end_streams` cancels it there, and it returns."""
        task = asyncio.current_task()
        if self._ending_streams:
            task.cancel()  # opened while the control plane stops: it ends at its first wait
        self._streams.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if not self._ending_streams:
                raise
        finally:
            self._streams.discard(task)

    def _close_mailbox(self, node: str) -> None:
        mailbox = self.mailboxes.pop(node, None)
        if mailbox is not None:
            mailbox.close()

    # ----- workers -----

    @_rpc
    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        spec = spec_from_proto(request.worker)
        self.act_for(spec.node_id)
        if self.master:  # whoever registers it: the operator's token too (auth off, no token is refused)
            self.state.check_not_revoked(spec.node_id)
        check_serve_urls(spec)
        unknown = self.state.register(spec, blocks_from_proto(request.held), self.clock(),
                                      cached=blocks_from_proto(request.cached))
        self.mailboxes.setdefault(spec.node_id, Mailbox(spec.node_id))
        log.info("registered node=%s address=%s transports=%s labels=%s packages=%d", spec.node_id,
                 spec.peer.address, ",".join(spec.peer.transports), dict(spec.labels), len(request.held))
        return pb.RegisterResponse(lease_s=self.state.lease_s, heartbeat_s=self.heartbeat_s, unknown_packages=unknown,
                                   data_key=self.data_key)

    @_rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        self.act_for(request.node_id)
        self.state.heartbeat(request.node_id, self.clock())
        return pb.HeartbeatResponse(lease_s=self.state.lease_s)

    @_rpc
    async def Deregister(self, request: pb.DeregisterRequest,
                         context: grpc.aio.ServicerContext) -> pb.DeregisterResponse:
        self.act_for(request.node_id)
        self.state.deregister(request.node_id)
        self._close_mailbox(request.node_id)
        log.info("deregistered node=%s", request.node_id)
        # Acknowledged, it holds after a crash (found in review: lost, the worker was placed in scale-ups as alive
        # for its lease and more after a restart).
        await self.flush_encoded(durable=True)
        return pb.DeregisterResponse()

    @_rpc
    async def ListWorkers(self, request: pb.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListWorkersResponse:
        # One listing at a time: the calls that come while one is made take its answer (routers poll together,
        # and several threads making messages at once would keep the GIL from the loop's thread for longer).
        if self._listing is None or self._listing.done():
            self._listing = asyncio.ensure_future(self._list_workers())
        return await asyncio.shield(self._listing)

    async def _list_workers(self) -> pb.ListWorkersResponse:
        now = self.clock()
        if len(self._listed) > len(self.state.workers):  # forget the workers gone since
            self._listed = {n: listed for n, listed in self._listed.items() if n in self.state.workers}
        # Copied here, made into messages in a thread: every router lists them every 2 s; a worker's message is
        # made again only when it changed (5,000 workers: 22 ms made anew, 6.5 ms copied, uncontended).
        held: dict[str, dict[str, frozenset[int]]] = {}  # the state's sets: never changed, replaced
        for package_id, availability in self.state.availability.items():
            for node, blocks in availability.by_worker.items():
                held.setdefault(node, {})[package_id] = blocks
        cached: dict[str, dict[str, tuple[int, ...]]] = {}
        for package_id, by_node in self.state.cached.items():
            for node, blocks in by_node.items():
                cached.setdefault(node, {})[package_id] = tuple(blocks)
        rows = [(node, (w.spec, w.alive, held.get(node, {}), cached.get(node, {})), self._listed.get(node),
                 w.lease_expires - now) for node, w in sorted(self.state.workers.items())]
        response, made = await asyncio.to_thread(
            collector_off, functools.partial(_workers_response, rows, self.serving_key))
        self._listed.update(made)
        return response

    # ----- packages -----

    @_rpc
    async def PublishPackage(self, request: pb.PublishPackageRequest,
                             context: grpc.aio.ServicerContext) -> pb.PublishPackageResponse:
        manifest = Manifest()
        manifest.CopyFrom(request.manifest)
        store = peer_from_proto(request.store)
        # Its id is a digest of the manifest's canonical JSON: ~0.2 s for a large model, off the event loop.
        await asyncio.to_thread(check_publish, manifest, store)
        package_id = self.state.publish(manifest, store, self.clock())
        await self.flush_encoded(durable=True)
        log.info("published package=%s model=%s blocks=%d store=%s", package_id, manifest.model_name,
                 len(manifest.blocks), request.store.address)
        return pb.PublishPackageResponse(package_id=package_id)

    @_rpc
    async def GetPackage(self, request: pb.GetPackageRequest,
                         context: grpc.aio.ServicerContext) -> pb.GetPackageResponse:
        package = self.state.package(request.package_id)
        return pb.GetPackageResponse(manifest=package.manifest, store=peer_to_proto(package.store))

    @_rpc
    async def ListPackages(self, request: pb.ListPackagesRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListPackagesResponse:
        out = []
        for package_id, package in sorted(self.state.packages.items()):
            availability = self.state.availability[package_id]
            out.append(pb.PackageSummary(
                package_id=package_id, model_name=package.manifest.model_name, num_blocks=package.num_blocks,
                total_bytes=package.total_bytes, store=peer_to_proto(package.store),
                complete_holders=len(availability.complete_holders()), block_replicas=availability.replicas(),
                published_unix=package.published_at))
        return pb.ListPackagesResponse(packages=out)

    @_rpc
    async def RemovePackage(self, request: pb.RemovePackageRequest,
                            context: grpc.aio.ServicerContext) -> pb.RemovePackageResponse:
        if request.package_id in self.book.deployments:
            raise Conflict(f"package {request.package_id!r} is deployed: remove its deployment first "
                           "(pipecast cp undeploy)")
        if names := self.book.routes_of(request.package_id):
            raise Conflict(f"package {request.package_id!r} answers served model {names[0]!r}: roll it back, route "
                           f"the name elsewhere or remove the route (pipecast cp unroute {names[0]}) first")
        self.state.remove_package(request.package_id, force=request.force)
        await self.flush_encoded(durable=True)
        log.info("removed package=%s force=%s", request.package_id, request.force)
        return pb.RemovePackageResponse()

    # ----- availability -----

    @_rpc
    async def ReportBlocks(self, request: pb.ReportBlocksRequest,
                           context: grpc.aio.ServicerContext) -> pb.ReportBlocksResponse:
        return self._report(request)

    async def StreamReports(self, requests: AsyncIterator[pb.ReportBlocksRequest],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ReportBlocksResponse]:
        with self._open_stream():
            async for request in requests:
                async with self.handling("StreamReports", context):
                    response = self._report(request)
                yield response

    def _report(self, request: pb.ReportBlocksRequest) -> pb.ReportBlocksResponse:
        self.act_for(request.node_id)
        unknown = self.state.report(request.node_id, blocks_from_proto(request.verified),
                                    blocks_from_proto(request.dropped), self.clock(),
                                    cached=blocks_from_proto(request.cached),
                                    progress={p.package_id: p.bytes_present for p in request.progress})
        self.metrics.block_reports.inc(sum(len(r.blocks) for r in request.verified if r.package_id not in unknown))
        return pb.ReportBlocksResponse(unknown_packages=unknown)

    @_rpc
    async def ReportBadPeer(self, request: pb.ReportBadPeerRequest,
                            context: grpc.aio.ServicerContext) -> pb.ReportBadPeerResponse:
        self.act_for(request.node_id)
        # Before the probe, which may take a second: a report of nothing is refused at once.
        self.state.check_bad_peer_report(request.node_id, request.peer_id, request.package_id, request.block)
        gone = request.gone and not await self._still_listens(request.peer_id)
        replanned = self.state.report_bad_peer(request.node_id, request.peer_id, request.package_id, request.block,
                                               request.reason, self.clock(), gone=gone)
        return pb.ReportBadPeerResponse(replanned=replanned)

    async def _still_listens(self, peer: str) -> bool:
        """Whether the registered worker ``peer``, reported gone, still listens at its data-plane address: then
        it is not taken for dead (the report is one of a failed fetch), whoever reported it."""
        worker = self.state.workers.get(peer)
        if worker is None or not worker.alive:
            return False
        try:
            host, port = host_port(worker.spec.peer.address, f"worker {peer!r} address")
        except InvalidRequest:
            return False
        if await self.probe(host, port) is not True:
            return False
        log.warning("peer %s was reported gone but listens at %s: not taken for dead", peer,
                    worker.spec.peer.address)
        return True

    @_rpc
    async def GetAvailability(self, request: pb.GetAvailabilityRequest,
                              context: grpc.aio.ServicerContext) -> pb.GetAvailabilityResponse:
        package = self.state.package(request.package_id)
        availability = self.state.availability[request.package_id]
        return pb.GetAvailabilityResponse(
            package_id=request.package_id, num_blocks=package.num_blocks,
            by_worker=[pb.WorkerBlocks(node_id=node, blocks=sorted(blocks))
                       for node, blocks in sorted(availability.by_worker.items())],
            by_block=[pb.BlockHolders(block=block, node_ids=sorted(nodes))
                      for block, nodes in enumerate(availability.by_block)])

    # ----- scaling -----

    @_rpc
    async def ScaleUp(self, request: pb.ScaleUpRequest, context: grpc.aio.ServicerContext) -> pb.ScaleUpResponse:
        for tries in range(1, SCALE_UP_TRIES + 1):
            draft = self.state.draft_scale_up(request.package_id, node_ids=list(request.node_ids),
                                              count=request.count, strategy=request.strategy, fanout=request.fanout,
                                              serving_only=request.serving_only)
            # Planning thousands of receivers takes long: in a thread, so the event loop keeps serving meanwhile.
            plan = await asyncio.to_thread(_build_plan, draft) if draft.receivers else None
            try:
                result = self.state.install_scale_up(draft, plan, now=self.clock())
                break
            except DraftStale:
                if tries == SCALE_UP_TRIES:
                    raise
                log.info("scale-up of package=%s: the cluster changed while its plan was made; planning it again "
                         "(try %d of %d)", request.package_id, tries + 1, SCALE_UP_TRIES)
        # An acknowledged plan survives a crash (agents drop parts a restarted control plane lacks); its row
        # is written in a thread: thousands of receivers' plan is ~10 MB.
        await self.flush_encoded(durable=True)
        return pb.ScaleUpResponse(plan_id=result.plan_id, strategy=result.strategy, sources=result.sources,
                                  receivers=result.receivers, unchanged=result.unchanged)

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        drop_at = self.state.release(request.package_id, list(request.node_ids), request.keep_alive_s, self.clock())
        await self.flush_encoded(durable=True)
        log.info("release package=%s nodes=%s keep_alive_s=%.1f", request.package_id, list(request.node_ids),
                 request.keep_alive_s)
        return pb.ReleaseResponse(drop_at_unix=drop_at)

    @_rpc
    async def ListPlans(self, request: pb.ListPlansRequest, context: grpc.aio.ServicerContext) -> pb.ListPlansResponse:
        if request.package_id:
            self.state.package(request.package_id)  # one asked for by id must be published
        return pb.ListPlansResponse(plans=[
            _plan_summary(active) for _, active in sorted(self.state.plans.items())
            if not request.package_id or active.package_id == request.package_id])

    @_rpc
    async def ListPipelines(self, request: pb.ListPipelinesRequest,
                            context: grpc.aio.ServicerContext) -> pb.ListPipelinesResponse:
        if request.package_id:
            self.state.package(request.package_id)  # one asked for by id must be published
        packages = [request.package_id] if request.package_id else sorted(self.state.packages)
        found = []
        for package_id in packages:
            # Routers poll the whole listing: a package removed while others were formed is left out, not an error.
            if package_id not in self.state.packages:
                continue
            for pipeline, info in await self._pipelines_of(package_id):  # none without a layout
                if package_id in self.state.packages and all(
                        (w := self.state.workers.get(node)) is not None and w.alive for node in pipeline.nodes):
                    found.append(info)  # else formed a moment ago, and the package was removed or a member died since
        return pb.ListPipelinesResponse(pipelines=found)

    async def _pipelines_of(self, package_id: str) -> Formed:
        """The pipelines of ``package_id`` and their messages, made by the former (a second among 5,000 receivers,
        which the event loop, answering heartbeats, must not hold). One forming at a time per package:
        a call while one runs takes its answer (as old as that forming); unchanged state is answered from the last
        one."""
        forming = self._forming.get(package_id)
        if forming is not None:
            return await asyncio.shield(forming)
        query = self.state.pipeline_query(package_id)
        if query is None:
            return []
        for gone in self._pipelines.keys() - self.state.packages.keys():
            del self._pipelines[gone]
        last = self._pipelines.get(package_id)
        if last is not None and last[0] == query:
            return last[1]
        forming = self._forming[package_id] = asyncio.ensure_future(self.former.form(package_id, query))

        def formed(future: asyncio.Future) -> None:  # whether or not the caller that started it still waits
            del self._forming[package_id]
            if not future.cancelled() and future.exception() is None:
                self._pipelines[package_id] = (query, future.result())
        forming.add_done_callback(formed)
        return await asyncio.shield(forming)

    async def WatchAssignments(self, request: pb.WatchAssignmentsRequest,
                               context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AssignmentUpdate]:
        node = request.node_id
        try:
            self.act_for(node)
            self.state.alive_worker(node)
        except ControlPlaneError as exc:
            await _abort(context, exc)
        mailbox = self.mailboxes.setdefault(node, Mailbox(node))
        owner = mailbox.attach((plan_id, self.state.plans[plan_id].package_id) for plan_id in self.state.plans_of(node))
        log.info("assignment stream opened node=%s", node)
        try:
            with self._open_stream():
                while (notice := await mailbox.next(owner)) is not None:
                    yield self._render(notice)
        finally:
            log.info("assignment stream closed node=%s", node)
        if mailbox.closed:  # the worker died or deregistered: it must register again
            await _abort(context, UnknownWorker.named(node))

    # ----- credentials -----

    @_rpc
    async def IssueToken(self, request: pb.IssueTokenRequest,
                         context: grpc.aio.ServicerContext) -> pb.IssueTokenResponse:
        if not self.master:
            raise Conflict("auth is off (no auth_token set on the control plane): there are no node tokens to issue")
        try:
            token = issue_node_token(self.master, request.node_id)
        except CredentialError as exc:
            raise InvalidRequest(f"cannot issue a token: {exc}") from None
        if request.node_id in self.state.revoked:
            raise Conflict(f"node {request.node_id!r} is revoked: its token would be refused (`pipecast cp revoke-node "
                           f"{request.node_id} --restore` admits it again; a machine replacing it takes another id)")
        log.info("issued a node token node=%s", request.node_id)
        return pb.IssueTokenResponse(token=token)

    @_rpc
    async def RevokeNode(self, request: pb.RevokeNodeRequest,
                         context: grpc.aio.ServicerContext) -> pb.RevokeNodeResponse:
        changed = False
        if request.node_id:
            # With auth off nothing is refused, but a revocation stored before may still be lifted.
            if not self.master and not request.restore:
                raise Conflict("auth is off (no auth_token set on the control plane): there are no node tokens to "
                               "revoke")
            changed = self.state.revoke(request.node_id, restore=request.restore)
            if changed and not request.restore:
                self._close_mailbox(request.node_id)  # its assignment stream ends; registering again is refused
            await self.flush_encoded(durable=True)  # acknowledged, it holds after a restart or a takeover
        return pb.RevokeNodeResponse(revoked=sorted(self.state.revoked), changed=changed)

    # ----- deployments and the scaling daemon's audit trail -----

    @_rpc
    async def PutDeployment(self, request: pb.PutDeploymentRequest,
                            context: grpc.aio.ServicerContext) -> pb.PutDeploymentResponse:
        stored = self.book.put(deployment_from_proto(request.deployment), self.state.packages, self.clock())
        await self.flush_encoded(durable=True)
        log.info("deployment package=%s policy=%s routers=%s", stored.package_id, stored.policy, list(stored.routers))
        return pb.PutDeploymentResponse(deployment=deployment_to_proto(stored))

    @_rpc
    async def ListDeployments(self, request: pb.ListDeploymentsRequest,
                              context: grpc.aio.ServicerContext) -> pb.ListDeploymentsResponse:
        return pb.ListDeploymentsResponse(deployments=[deployment_to_proto(d) for d in self.book.listing()])

    @_rpc
    async def RemoveDeployment(self, request: pb.RemoveDeploymentRequest,
                               context: grpc.aio.ServicerContext) -> pb.RemoveDeploymentResponse:
        self.book.remove(request.package_id)
        await self.flush_encoded(durable=True)
        log.info("deployment removed package=%s", request.package_id)
        return pb.RemoveDeploymentResponse()

    @_rpc
    async def AppendScaleEvent(self, request: pb.AppendScaleEventRequest,
                               context: grpc.aio.ServicerContext) -> pb.AppendScaleEventResponse:
        stored = self.book.append(scale_event_from_proto(request.event))
        await self.flush_encoded(durable=True)  # the audit trail is durable before the daemon acts on the decision
        return pb.AppendScaleEventResponse(seq=stored.seq)

    @_rpc
    async def ListScaleEvents(self, request: pb.ListScaleEventsRequest,
                              context: grpc.aio.ServicerContext) -> pb.ListScaleEventsResponse:
        # Only written events: one a failed flush (a deposed leader) would lose is no part of the trail yet.
        events = self.book.list_events(request.package_id, request.after_seq, request.limit,
                                       through_seq=self.book.written_seq)
        return pb.ListScaleEventsResponse(events=[scale_event_to_proto(e) for e in events])

    @_rpc
    async def ChangeRoute(self, request: pb.ChangeRouteRequest,
                          context: grpc.aio.ServicerContext) -> pb.ChangeRouteResponse:
        change = route_change_from_proto(request)
        route = self.book.change_route(change, self.state.packages, self.clock())
        await self.flush_encoded(durable=True)  # routers are shown it from then on (ListRoutes: written_routes)
        log.info("route %s: %s", change.action, describe_route(route, change.name))
        return pb.ChangeRouteResponse(route=route_to_proto(route) if route else None)

    @_rpc
    async def ListRoutes(self, request: pb.ListRoutesRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListRoutesResponse:
        routes = self.book.written_routes
        return pb.ListRoutesResponse(routes=[route_to_proto(routes[n]) for n in sorted(routes)])

    def _render(self, notice: Notice) -> pb.AssignmentUpdate:
        kind = notice.kind
        if kind is UpdateKind.SYNC:
            return pb.AssignmentUpdate(kind=KIND_TO_PROTO[kind], plan_ids=self.state.plans_of(notice.node_id))
        if kind is UpdateKind.DROP:
            return pb.AssignmentUpdate(kind=KIND_TO_PROTO[kind], package_id=notice.package_id)
        active = self.state.plans.get(notice.plan_id)
        part = active.parts.get(notice.node_id) if active is not None else None
        if part is None:  # the plan ended or moved on without this node since the notice was queued
            return pb.AssignmentUpdate(kind=pb.AssignmentUpdate.CANCEL, plan_id=notice.plan_id,
                                       package_id=notice.package_id)
        def peer(node: str) -> pb.Peer:
            return peer_to_proto(self.state.peer(node))

        # part_to_proto asks for each parent and child once; the sources are a few more.
        fetch, serve, table = part_to_proto(part.fetch, part.serve, peer)
        return pb.AssignmentUpdate(
            kind=pb.AssignmentUpdate.ASSIGN, plan_id=active.plan_id, package_id=active.package_id,
            version=active.version, strategy=active.plan.strategy, fetch=fetch, serve=serve, peers=table,
            sources=[peer(source) for source in active.plan.sources],
            # A source is every receiver's fallback: it may serve each of them, and only them.
            receivers=sorted(active.plan.assignments) if notice.node_id in active.plan.sources else [],
            priority=self.book.priority_of(active.package_id), report_progress=self.state.watches(active),
            relay_bytes=active.relay_bytes)


def _plan_summary(active: ActivePlan) -> pb.PlanSummary:
    return pb.PlanSummary(plan_id=active.plan_id, package_id=active.package_id, strategy=active.plan.strategy,
                          sources=active.plan.sources, receivers=sorted(active.plan.assignments),
                          pending=sorted(active.pending), replans=active.replans, created_unix=active.created_at,
                          demoted=sorted(active.demoted))


def host_port(address: str, what: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as (lower-case host, port 1-65535: one a peer connects to);
    :class:`InvalidRequest` naming ``what`` otherwise."""
    try:
        parts = urlsplit(f"//{address}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if (not host or not port or parts.username is not None or parts.path or parts.query or parts.fragment):
        raise InvalidRequest(f"{what} {address!r} is not a host:port address (port 1-65535)")
    return host, port


def _build_plan(draft: ScaleUpDraft) -> Plan:
    """The draft's plan with its stored form and its nodes' parts made too (all heavy for thousands of
    receivers; in a thread), what it made frozen after (never scanned by the collector again, still freed by
    reference counting: a plan holds no cycles)."""
    def build() -> Plan:
        plan = draft.build()
        plan.encoded()
        plan.parts()
        plan.hops()
        return plan
    return collector_off(build, freeze=True)


def check_serve_urls(spec: WorkerSpec) -> None:
    """A worker's serve URL (and the legacy label the router also reads) must be on the worker's own
    data-plane host: else a worker could send the router's requests anywhere. Its engine must be known, and
    the package it serves a whole package id, said only with a serve URL."""
    if spec.engine not in SERVING_ENGINES:
        raise InvalidRequest(f"worker {spec.node_id!r}: engine {spec.engine!r} is not one of "
                             f"{', '.join(SERVING_ENGINES)}")
    if spec.serve_package and not HEX_DIGEST.fullmatch(spec.serve_package):
        raise InvalidRequest(f"worker {spec.node_id!r}: serve package {spec.serve_package[:80]!r} is not a whole "
                             "package id (64 lowercase hex digits)")
    if spec.serve_package and not serve_url_of(spec):
        raise InvalidRequest(f"worker {spec.node_id!r}: serve package {spec.serve_package[:12]} without a serve URL: "
                             "it names what the serving worker at its serve URL serves")
    host, _ = host_port(spec.peer.address, f"worker {spec.node_id!r} address")
    for url in (spec.serve_url, spec.labels.get(SERVE_URL_LABEL, "")):
        try:
            url_host = urlsplit(url).hostname if url else host
        except ValueError:
            url_host = None
        if url_host != host:
            raise InvalidRequest(f"worker {spec.node_id!r}: serve URL {url!r} is not on its own host {host!r} "
                                 f"(its data-plane address {spec.peer.address!r})")


#: A worker as ListWorkers shows it but for its lease: its spec, alive, held and cached blocks per package.
_Shown = tuple[WorkerSpec, bool, Mapping[str, Collection[int]], Mapping[str, Collection[int]]]
#: What a worker's message was made of, and the message (without its lease).
_Listed = tuple[_Shown, pb.WorkerState]


def _workers_response(rows: list[tuple[str, _Shown, _Listed | None, float]],
                      key: bytes) -> tuple[pb.ListWorkersResponse, dict[str, _Listed]]:
    """The ListWorkers answer of rows (node, the worker now, as last listed, lease left) copied from the state,
    and the workers whose messages were made anew: a worker's message is made again only when what it shows
    changed (the held sets compare by identity first: the state replaces them, never changes them); each call
    copies it and sets the lease. A worker at a time: each a short call that lets the event loop's thread have
    the GIL between (one call with every worker held it ~50 ms at 5,000)."""
    response, made = pb.ListWorkersResponse(serving_key=key), {}
    for node, shown, before, lease in rows:
        if before is None or before[0] != shown:
            spec, alive, held, cached = shown
            spec_message = before[1].worker if before is not None and before[0][0] is spec else spec_to_proto(spec)
            before = made[node] = (shown, pb.WorkerState(worker=spec_message, alive=alive, held=blocks_to_proto(held),
                                                         cached=blocks_to_proto(cached)))
        listed = response.workers.add()
        listed.CopyFrom(before[1])
        listed.lease_remaining_s = lease
    return response, made


def check_publish(manifest: Manifest, store: PeerInfo) -> None:
    """A published package must have a well-formed id, a valid manifest and a store at a host:port."""
    if not _PACKAGE_ID.fullmatch(manifest.package_id):
        raise InvalidRequest(f"published package id {manifest.package_id[:80]!r} is not 64 lower-case hex digits")
    try:
        validate_manifest(manifest, f"published manifest of package {manifest.package_id}")
    except ManifestError as exc:
        raise InvalidRequest(str(exc)) from None
    if not store.node_id:
        raise InvalidRequest(f"package {manifest.package_id} published without a store node id")
    try:  # one no token can name could never register, and would garble every listing it is shown in
        validate_node_id(store.node_id)
    except CredentialError as exc:
        raise InvalidRequest(f"package {manifest.package_id} published with store {exc}") from None
    host_port(store.address, f"store {store.node_id!r} address")
