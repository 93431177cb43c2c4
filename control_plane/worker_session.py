"""A worker agent's link to the control plane, kept up across restarts of either side.

The agent gives its spec and a function returning every verified block it holds; the session registers
(again whenever the control plane says it does not know the worker), heartbeats at the interval the
server asks for, batches block reports (one RPC per ``report_delay_s`` window at most, retried until
delivered), and yields the assignment stream, reconnecting after failures. Packages it holds that the control
plane answered as unknown (e.g. a store seeded before the package was published) are reported again with each
heartbeat until the control plane knows them, so that either order of start-up and publish works. The control
plane being down never stops the agent: calls fail with typed errors that are logged, and the session retries.
After any failed call the next contact is a full registration, so reports a crashed control plane had
acknowledged but not yet written to its database are restored. A refused token is fatal: it ends
:meth:`WorkerSession.assignments` with :class:`Unauthenticated`, or :class:`PermissionDenied` for a node token
of another node; so is a refused registration: :class:`InvalidRequest` (the agent's configuration) or
:class:`NodeIdInUse` (another live agent has its node id). Retrying can fix none of them.

Each registration brings the data-plane key (:attr:`WorkerSession.data_key`; b"" with auth off): the
agent keys its data-plane hello with it, and ``on_data_key`` is called whenever it changes (the first
registration, a control plane restarted with another master token).

    session = WorkerSession(client, spec, holdings=store.holdings, on_data_key=transport.set_key)
    await session.start()
    session.report_verified(package_id, [block])
    async for update in session.assignments(): ...
    await session.close()
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping

from control_plane.client import ControlPlaneClient, ReportStream
from control_plane.errors import (
    ChangeNotStored, ControlPlaneError, InvalidRequest, NodeIdInUse, PermissionDenied, Unauthenticated, UnknownWorker)
from control_plane.messages import AssignmentUpdate, WorkerSpec

log = logging.getLogger(__name__)

Holdings = Callable[[], Mapping[str, Collection[int]]]
#: Errors no retry can fix: the token is refused, or it is not this node's.
REFUSED = (Unauthenticated, PermissionDenied)
#: A registration refused for what the agent was given (a serve URL on another host): as fatal.
REGISTRATION_REFUSED = (*REFUSED, InvalidRequest)
#: How long a registration refused as :class:`NodeIdInUse` is retried before it is as fatal: the live worker may be
#: this agent's own former process at its old address (a reboot, a new pod IP), whose lease (10 s by default) ends.
NODE_ID_WAIT_S = 60.0


class WorkerSession:
    """Registration, heartbeats, batched reports and the assignment stream of one worker."""

    def __init__(self, client: ControlPlaneClient, spec: WorkerSpec, holdings: Holdings, *,
                 report_delay_s: float = 0.05, retry_s: float = 1.0, heartbeat_s: float = 2.0,
                 on_data_key: Callable[[bytes], None] | None = None, cached: Holdings | None = None,
                 node_id_wait_s: float = NODE_ID_WAIT_S):
        """``holdings`` gives the blocks held in memory, ``cached`` those in the disk cache, per package: each
        registration carries both (a package held in memory counts as held only). ``holdings`` runs on the
        event loop; ``cached`` in a thread, as it may read the disk (a large package's manifest: ~0.6 s)."""
        self.client = client
        self.spec = spec
        self.node_id = spec.node_id
        self.report_delay_s = report_delay_s
        self.retry_s = retry_s
        self.node_id_wait_s = node_id_wait_s
        self.heartbeat_s = heartbeat_s  # replaced by the server's at registration
        self.registered = asyncio.Event()
        self._holdings = holdings
        self._disk_holdings = cached
        self._verified: dict[str, set[int]] = {}
        self._dropped: dict[str, set[int]] = {}
        self._cached: dict[str, set[int]] = {}
        self._progress: dict[str, int] = {}  # the latest bytes held per package being received
        self._unknown: set[str] = set()  # package ids the control plane answered as unknown: reported again
        self._report_wake = asyncio.Event()
        self._kick = asyncio.Event()  # set: re-register now
        self._wanted = 0  # registrations asked for (one asked for while another runs makes it run again)
        self._refused: Exception | None = None  # why no registration comes (a refusal, or an error unforeseen)
        self._data_key: bytes | None = None
        self._on_data_key = on_data_key
        self._refused_event = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Start registering, heartbeating and reporting in the background; await :attr:`registered`
        to know the control plane has the worker."""
        self._tasks = [asyncio.create_task(self._keep_registered(), name=f"cp-lease-{self.node_id}"),
                       asyncio.create_task(self._report_loop(), name=f"cp-report-{self.node_id}")]
        self._tasks[0].add_done_callback(self._lease_ended)

    def _lease_ended(self, task: asyncio.Task) -> None:
        """An error nothing expected ended the registration: the assignment stream raises it, not waits for a
        registration that no task makes any more."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("registration of node=%s with control plane %s stopped: %r", self.node_id, self.client.target,
                  task.exception())
        self._refused = task.exception()
        self._refused_event.set()

    async def close(self) -> None:
        """Stop the background work and deregister (best effort, within the client's deadline)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        # Registered once (it may be registering again, e.g. after its disk cache changed): it leaves all the same.
        if self._data_key is not None:
            try:
                await self.client.deregister(self.node_id)
            except ChangeNotStored as exc:  # made (the control plane's store writes it later): not a failure
                log.info("deregistered node=%s, not stored yet: %s", self.node_id, exc)
            except ControlPlaneError as exc:
                log.warning("deregister failed node=%s: %s", self.node_id, exc)
            self.registered.clear()

    @property
    def data_key(self) -> bytes | None:
        """The data-plane key of the last registration (b"": auth is off), None before the first."""
        return self._data_key

    def report_verified(self, package_id: str, blocks: Iterable[int]) -> None:
        """Queue verified blocks for the next batched report."""
        blocks = set(blocks)
        self._dropped.get(package_id, set()).difference_update(blocks)
        self._verified.setdefault(package_id, set()).update(blocks)
        self._report_wake.set()

    def report_dropped(self, package_id: str, blocks: Iterable[int]) -> None:
        """Queue evicted blocks for the next batched report."""
        blocks = set(blocks)
        self._verified.get(package_id, set()).difference_update(blocks)
        self._dropped.setdefault(package_id, set()).update(blocks)
        self._report_wake.set()

    def report_cached(self, package_id: str, blocks: Iterable[int]) -> None:
        """Queue blocks now in the disk cache only (e.g. after a drop) for the next batched report."""
        self._cached.setdefault(package_id, set()).update(blocks)
        self._report_wake.set()

    def report_progress(self, package_id: str, bytes_present: int) -> None:
        """Queue how many bytes of ``package_id`` this node holds now, for the next batched report (only the
        latest counts: a report that fails is not sent again)."""
        self._progress[package_id] = bytes_present
        self._report_wake.set()

    async def report_bad_peer(self, peer_id: str, package_id: str, block: int, reason: str, *,
                              gone: bool = False) -> bool:
        """Report a parent that served bad data or failed (``gone``: nothing listens where it was); True if the
        control plane gave new parents."""
        try:
            return await self.client.report_bad_peer(self.node_id, peer_id, package_id, block, reason, gone=gone)
        except UnknownWorker:
            self._need_registration()  # e.g. a control plane restarted since: register before the next report
            raise

    async def assignments(self) -> AsyncIterator[AssignmentUpdate]:
        """The assignment stream, for as long as the caller iterates: each (re)connection starts with a
        SYNC naming the plans the worker is in, then an ASSIGN for each. Raises :class:`Unauthenticated`
        once the control plane refuses the token, :class:`PermissionDenied` if it is another node's, and
        :class:`InvalidRequest` or :class:`NodeIdInUse` if it refuses the registration."""
        while True:
            await self._until_registered()
            try:
                async for update in self.client.watch_assignments(self.node_id):
                    yield update
                log.info("assignment stream ended node=%s; reconnecting", self.node_id)
            except UnknownWorker:
                self._need_registration()
                continue
            except REFUSED:
                raise
            except ControlPlaneError as exc:
                log.warning("assignment stream failed node=%s: %s; registering again, reconnecting in %.1f s",
                            self.node_id, exc, self.retry_s)
                # The control plane may have restarted, having acknowledged reports it never stored.
                self._need_registration()
            await asyncio.sleep(self.retry_s)

    async def _until_registered(self) -> None:
        waiters = [asyncio.ensure_future(self.registered.wait()), asyncio.ensure_future(self._refused_event.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        if self._refused is not None:
            raise self._refused

    def holdings_changed(self, removed: Collection[str] = ()) -> None:
        """Register again, with every block held and cached: what the control plane knows of this node's disk cache
        changes only so (reports add to it), e.g. once the cache removed the packages ``removed`` to make room
        (their cached blocks still queued are not reported)."""
        for package_id in removed:
            self._cached.pop(package_id, None)
        self._need_registration()

    def _need_registration(self) -> None:
        self._wanted += 1
        self.registered.clear()
        self._kick.set()

    async def _nap(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._kick.wait(), seconds)
        except TimeoutError:
            pass

    async def _keep_registered(self) -> None:
        failing = False
        in_use_since: float | None = None  # when a registration was first refused as NodeIdInUse
        while True:
            self._kick.clear()
            fatal = REFUSED if self.registered.is_set() else REGISTRATION_REFUSED
            try:
                if self.registered.is_set():
                    await self.client.heartbeat(self.node_id)
                    self._report_unknown_again()
                else:
                    wanted = self._wanted
                    held, cached = await self._registration_holdings()
                    registration = await self.client.register(self.spec, held, cached)
                    self.heartbeat_s = registration.heartbeat_s
                    self._set_data_key(registration.data_key)
                    self._unknown = set(registration.unknown_packages)
                    if self._wanted != wanted:  # wanted again meanwhile (the disk cache changed): its holdings are old
                        continue
                    self.registered.set()
                    log.info("registered node=%s with control plane %s packages=%d unknown=%s (reported again until "
                             "published)", self.node_id, self.client.target, len(held),
                             list(registration.unknown_packages))
                if failing:
                    log.info("control plane %s reachable again node=%s", self.client.target, self.node_id)
                failing, in_use_since = False, None
            except NodeIdInUse as exc:
                now = asyncio.get_running_loop().time()
                in_use_since = now if in_use_since is None else in_use_since
                if now - in_use_since >= self.node_id_wait_s:
                    log.error("control plane %s refused node=%s for %.0f s: %s", self.client.target, self.node_id,
                              now - in_use_since, exc)
                    self._refused = exc
                    self._refused_event.set()
                    return
                if now == in_use_since:
                    log.warning("%s; retrying every %.1f s for up to %.0f s", exc, self.retry_s, self.node_id_wait_s)
                await self._nap(self.retry_s)
                continue
            except UnknownWorker:
                log.warning("control plane %s no longer knows node=%s: registering again", self.client.target,
                            self.node_id)
                self.registered.clear()
                continue
            except fatal as exc:
                log.error("control plane %s refused node=%s: %s", self.client.target, self.node_id, exc)
                self._refused = exc
                self._refused_event.set()
                return
            except ControlPlaneError as exc:
                if not failing:
                    log.warning("control plane call failed node=%s: %s; retrying every %.1f s", self.node_id, exc,
                                self.retry_s)
                failing = True
                # It may have crashed after acknowledging reports it never stored: register afresh.
                self.registered.clear()
                await self._nap(self.retry_s)
                continue
            await self._nap(self.heartbeat_s)

    async def _registration_holdings(self) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
        """Every block held and cached, for a registration; the reports queued so far are part of it."""
        disk = await asyncio.to_thread(self._disk_holdings) if self._disk_holdings else {}
        # From here on no await: a report queued now is either in these sets or after the registration.
        held = {package_id: set(blocks) for package_id, blocks in self._holdings().items()}
        cached = {p: set(b) for p, b in disk.items() if p not in held and b}
        for package_id, blocks in self._cached.items():
            if package_id not in held and blocks:
                cached.setdefault(package_id, set()).update(blocks)
        self._verified, self._dropped, self._cached = {}, {}, {}
        return held, cached

    def _report_unknown_again(self) -> None:
        """Queue every block held of the packages the control plane did not know: published since, they count.
        Only packages still held in memory are kept (a cached-only one comes with the next registration)."""
        if not self._unknown:  # the usual case: no need to list what is held at every heartbeat
            return
        held = self._holdings()
        self._unknown = {package_id for package_id in self._unknown if held.get(package_id)}
        for package_id in sorted(self._unknown):
            self.report_verified(package_id, held[package_id])

    def _set_data_key(self, key: bytes) -> None:
        if key == self._data_key:
            return
        self._data_key = key
        if self._on_data_key is not None:
            self._on_data_key(key)

    async def _report_loop(self) -> None:
        stream: ReportStream | None = None
        try:
            while True:
                await self._report_wake.wait()
                await asyncio.sleep(self.report_delay_s)  # the batching window
                self._report_wake.clear()
                await self.registered.wait()
                if stream is None or stream.closed:
                    stream = self.client.open_report_stream()
                await self._report_once(stream)
        finally:
            if stream is not None:
                stream.close()

    async def _report_once(self, stream: ReportStream) -> None:
        verified = {p: b for p, b in self._verified.items() if b}
        dropped = {p: b for p, b in self._dropped.items() if b}
        cached = {p: b for p, b in self._cached.items() if b}
        progress, self._progress = self._progress, {}
        if verified or dropped or cached or progress:
            self._verified, self._dropped, self._cached = {}, {}, {}
            try:
                unknown = await stream.report(self.node_id, verified, dropped, cached, progress)
                self._unknown = (self._unknown - {*verified, *dropped, *cached}) | set(unknown)
            except UnknownWorker:
                self._need_registration()  # the registration will carry these blocks
            except ControlPlaneError as exc:
                log.warning("block report failed node=%s: %s; registering again, reporting in %.1f s", self.node_id,
                            exc, self.retry_s)
                self._requeue(verified, dropped, cached)
                # The control plane may have restarted, having acknowledged earlier reports it never stored: the
                # registration carries every block held (and these).
                self._need_registration()
                await asyncio.sleep(self.retry_s)
                self._report_wake.set()

    def _requeue(self, verified: Mapping[str, set[int]], dropped: Mapping[str, set[int]],
                 cached: Mapping[str, set[int]]) -> None:
        # Reports queued since the failed one are newer: they win over the requeued ones.
        for package_id, blocks in verified.items():
            newer = self._dropped.get(package_id, set())
            self._verified.setdefault(package_id, set()).update(blocks - newer)
        for package_id, blocks in dropped.items():
            newer = self._verified.get(package_id, set())
            self._dropped.setdefault(package_id, set()).update(blocks - newer)
        for package_id, blocks in cached.items():  # a hint that only adds: nothing newer contradicts it
            self._cached.setdefault(package_id, set()).update(blocks)
