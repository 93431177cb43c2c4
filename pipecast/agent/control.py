"""The agent under a control plane (``pipecast agent --control-plane``): register, follow the assignments.

The agent registers as a worker (its data-plane address, transports, memory budget, accelerator,
labels, serve URL, and every verified block it holds, so a seed is a source at once), heartbeats, and
reports each block as it verifies (all through :class:`control_plane.worker_session.WorkerSession`).
Each ASSIGN on the assignment stream is the node's whole part in one plan; a :class:`PackageFollower`
per package fetches exactly the blocks the parts name, each from the parent they name, and a re-planned
part replaces the fetches whose parent changed without refetching a verified block or chunk.

Each registration brings the cluster's data-plane key, which the transport's hello uses from then on; and
each part says whom this node serves: the peer server admits only the children the node's current parts
name, and where a plan names it a source, that plan's receivers (a source is the fallback of each of their
fetches).

A parent the fetcher gives up on (dead, silent, or sent a corrupt chunk) is reported to the control
plane, which re-parents its children; only if the control plane cannot be told, or sends no new parts
within ``agent_replan_wait_s``, does the node fetch around that parent from the plan's sources. A peer
that sent corrupt data is never asked again, whatever later parts say. The data path never waits on the
control path: fetches under way go on while the control plane is away, and the session registers again
with everything held once it is back.
"""

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from control_plane.client import ControlPlaneClient
from control_plane.errors import ControlPlaneError
from control_plane.messages import AssignmentUpdate, PeerInfo, UpdateKind, WorkerSpec
from control_plane.planner.plan import Fetch
from control_plane.worker_session import WorkerSession
from packager.manifest import MANIFEST_FILE
from pipecast.agent.budget import MemoryBudget
from pipecast.agent.errors import (
    AgentError,
    CorruptChunkError,
    CorruptFileError,
    FetchFailedError,
    LocalResourceError,
    MemoryBudgetError,
    PeerNotListeningError,
)
from pipecast.agent.events import EventLog
from pipecast.agent.fetcher import ChannelPool, Fetcher, FetchPolicy, PeerFailureCallback
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.store import BlockStore, StoreEvent
from pipecast.agent.transport.base import Transport

log = logging.getLogger(__name__)

DEFAULT_PROGRESS_INTERVAL_S = 0.1


class AgentHost(Protocol):
    """What a :class:`ControlLink` needs from the agent daemon that runs it."""

    peer_server: PeerServer
    events: EventLog
    budget: MemoryBudget

    @property
    def transport(self) -> Transport:
        """The agent's data transport (listening already)."""
        ...

    async def open_store(self, package_id: str, peers: Sequence[PeerInfo], pool: ChannelPool,
                         on_failure: PeerFailureCallback | None = None) -> BlockStore:
        """The store of ``package_id``: the one held, else a new one (disk cache first, manifest from ``peers``),
        with the small files it lacks fetched from ``peers`` and written to the disk cache; a failing peer is
        reported to ``on_failure``."""
        ...

    def peer_failed(self, what: str, peer: PeerInfo, error: Exception) -> None:
        """Record a failed fetch from ``peer``."""
        ...

    async def package_complete(self, store: BlockStore) -> None:
        """Every block of ``store`` is verified (and written to the disk cache)."""
        ...

    async def drop_package(self, package_id: str) -> None:
        """Stop serving ``package_id`` and free its memory."""
        ...

    def disk_cached(self, package_ids: Collection[str] | None = None) -> dict[str, list[int]]:
        """Blocks in the disk cache, per package (of ``package_ids``, or every cached one); none without."""
        ...

    def in_disk_cache(self, package_id: str) -> bool:
        """Whether the disk cache holds ``package_id``'s folder now (a look, no read)."""
        ...


def sender_at_fault(what: str, error: Exception) -> bool:
    """Whether ``error``, from fetching ``what`` (a block or a file path), proves the peer itself sent corrupt
    data, so that it is never asked again. Chunks and manifests are verified before a peer serves them; a
    small file is forwarded range by range before its relay has checked it whole, so a corrupt copy may
    come from the relay's own parent (the relay drops it and fetches it again)."""
    return isinstance(error, CorruptChunkError) or (isinstance(error, CorruptFileError) and what == MANIFEST_FILE)


def merged_fetches(parts: Iterable[AssignmentUpdate],
                   done: Callable[[Fetch[PeerInfo]], bool] = lambda fetch: False) -> list[Fetch[PeerInfo]]:
    """The fetches of every part, in the parts' order, each block from one part only (the first part that
    names it wins, with every unit it has of the block: one plan's units of a block cover it without
    overlap, two plans' units may overlap), without the units that are ``done``."""
    owner: dict[int, str] = {}
    fetches = []
    for part in parts:
        for fetch in part.fetch:
            if owner.setdefault(fetch.block, part.plan_id) == part.plan_id and not done(fetch):
                fetches.append(fetch)
    return fetches


def unit_done(store: BlockStore | None) -> Callable[[Fetch[PeerInfo]], bool]:
    """Whether ``store`` holds every chunk of a fetch's unit (a range outside the block is not done: the
    fetcher refuses it with its own error)."""
    def done(fetch: Fetch[PeerInfo]) -> bool:
        if store is None:
            return False
        first, end = fetch.chunks or (0, None)
        try:
            return store.first_missing_chunk(fetch.block, first, end) is None
        except AgentError:
            return False
    return done


class PackageFollower:
    """This node's parts in the active plans of one package, followed until closed.

    One fetch generation at a time runs the merged parts (:func:`merged_fetches`). When the parts change,
    the generation goes on if it fetches the same blocks from the same parents, else it is replaced
    (blocks resume at their first missing chunk). When it gives up on parents, they are reported and the
    follower waits for new parts; see the module docstring for when it falls back to the sources.
    """

    def __init__(self, package_id: str, host: AgentHost, session: WorkerSession, policy: FetchPolicy,
                 replan_wait_s: float, progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S) -> None:
        self.package_id = package_id
        self.parts: dict[str, AssignmentUpdate] = {}
        self._host = host
        self._session = session
        self._policy = policy
        self._replan_wait_s = replan_wait_s
        self._progress_interval_s = progress_interval_s
        self._pool = ChannelPool(host.transport)
        self._changed = asyncio.Event()
        self._errors: dict[PeerInfo, Exception] = {}
        self._untrusted: set[PeerInfo] = set()  # sent corrupt data of their own: never asked again
        self._watched: BlockStore | None = None  # the store whose verified blocks this follower reports
        self._unreported = False  # the control plane could not be told of the last failed parents: it is away
        held = self._store()
        self._completed = held is not None and held.progress().complete  # a seed: nothing to announce
        self._task = asyncio.get_running_loop().create_task(self._follow(), name=f"follow-{package_id[:12]}")

    def assign(self, part: AssignmentUpdate) -> None:
        """``part`` is this node's whole part in its plan now. A fetch of a block this node holds verified is
        announced again instead: the control plane took the block from this node's availability (a child
        reported this node for it) and plans on until it is reported, which a verified block never is again."""
        self.parts[part.plan_id] = part
        store = self._store()
        held = {f.block for f in part.fetch} & set(store.verified_blocks()) if store is not None else set()
        if held:
            self._session.report_verified(self.package_id, held)
        self._changed.set()

    def cancel(self, plan_id: str) -> None:
        """This node has no part in ``plan_id`` any more."""
        if self.parts.pop(plan_id, None) is not None:
            self._changed.set()

    def retain(self, plan_ids: Collection[str]) -> None:
        """Forget the parts of plans other than ``plan_ids`` (the control plane's list after a reconnect)."""
        for plan_id in [p for p in self.parts if p not in plan_ids]:
            self.cancel(plan_id)

    async def close(self) -> None:
        """Stop fetching and close the channels."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._pool.close()

    def _store(self) -> BlockStore | None:
        return self._host.peer_server.stores.get(self.package_id)

    def _wanted(self) -> list[Fetch[PeerInfo]]:
        return merged_fetches(self.parts.values(), unit_done(self._store()))

    def _sources(self) -> list[PeerInfo]:
        return list(dict.fromkeys(s for part in self.parts.values() for s in part.sources))

    def _peer_failed(self, what: str, peer: PeerInfo, error: Exception) -> None:
        self._errors[peer] = error
        if sender_at_fault(what, error):
            self._untrusted.add(peer)
        self._host.peer_failed(what, peer, error)

    async def _follow(self) -> None:
        """Follow the parts until closed. Failures of peers are handled in :meth:`_follow_parts` (reported,
        fetched around); anything else that escapes it (a bug, a full disk) is logged and recorded, and the
        follower starts again on new parts or after a pause: it never dies while the agent runs."""
        while True:
            try:
                await self._follow_parts()
            except Exception as exc:  # anything at all but cancellation (close)
                pause = self._pause_s
                log.exception("package %s: unexpected %s: %s; starting again on new parts or in %.1f s",
                              self.package_id[:12], type(exc).__name__, exc, pause)
                self._host.events.emit("transfer_failed", package=self.package_id, error=type(exc).__name__,
                                       message=str(exc)[:1000])
                await self._changed_within(pause)

    @property
    def _pause_s(self) -> float:
        """How long to wait for new parts before trying again after a failure that new parts need not cure."""
        return max(self._replan_wait_s, 1.0)

    async def _changed_within(self, seconds: float) -> None:
        """Return once the parts change, or after ``seconds``."""
        try:
            await asyncio.wait_for(self._changed.wait(), seconds)
        except TimeoutError:
            pass

    async def _follow_parts(self) -> None:
        avoid: set[PeerInfo] = set()  # parents the control plane did not replace in time: fetched around
        while True:
            self._changed.clear()
            wanted = self._wanted()
            if not wanted:
                store = self._store()
                if store is not None and not self._completed and store.progress().complete:
                    # Completed once announced: the disk cache written and the event logged.
                    await self._host.package_complete(store)
                    self._completed = True
                await self._changed.wait()
                continue
            self._errors.clear()
            fetcher = None
            try:
                store = await self._open(wanted)
                skipped = avoid | self._untrusted
                fetcher = Fetcher(store, self._pool, self._policy_around(skipped), self._peer_failed)
                fetcher.failed_peers.update(skipped)
                await self._fetch(fetcher, store, self._wanted())
            except FetchFailedError as exc:
                failed = set(fetcher.failed_peers if fetcher is not None else self._errors)
                avoid = await self._after_failure(exc, failed, wanted, avoid)
                continue
            except (LocalResourceError, MemoryBudgetError) as exc:
                # This node's own shortage (e.g. of file descriptors, or of memory while a dropped package's is
                # freed) passes as other transfers end or packages go: new parts need not come (nor would they cure
                # it), so it is tried again after a pause; meanwhile a child asking for the package is told at once
                # that it is not here, not held until its own timeout.
                if isinstance(exc, MemoryBudgetError) and self._store() is None:
                    self._host.peer_server.forget(self.package_id)
                if isinstance(exc, MemoryBudgetError) and not self._host.budget.used_bytes:
                    # Refused with nothing else held: the package is larger than the whole budget, which nothing
                    # ending or going cures. The control plane, which knows the budget, takes this node out.
                    await self._wait_for_new_parts(exc)
                    continue
                pause = self._pause_s
                log.warning("package %s: %s; trying again in %.1f s or on new parts", self.package_id[:12], exc,
                            pause)
                self._host.events.emit("transfer_failed", package=self.package_id, error=type(exc).__name__,
                                       message=str(exc))
                await self._changed_within(pause)
                continue
            except AgentError as exc:  # anything else of this node's: wait for new parts
                await self._wait_for_new_parts(exc)
                continue
            avoid = set()

    async def _wait_for_new_parts(self, error: AgentError) -> None:
        """Log and record ``error``, which only new parts cure, and wait for them: nothing is tried meanwhile."""
        log.error("package %s: %s; waiting for new instructions", self.package_id[:12], error)
        self._host.events.emit("transfer_failed", package=self.package_id, error=type(error).__name__,
                               message=str(error))
        await self._changed.wait()

    def _policy_around(self, skipped: set[PeerInfo]) -> FetchPolicy:
        """Exactly the parents given, unless some are skipped: then the plan's sources are the fallback."""
        return replace(self._policy, fallbacks=tuple(self._sources()) if skipped else ())

    async def _open(self, wanted: list[Fetch[PeerInfo]]) -> BlockStore:
        # The manifest and the small files: not from a peer that sent corrupt data of its own.
        peers = [p for p in dict.fromkeys([*(f.parent for f in wanted), *self._sources()]) if p not in self._untrusted]
        try:
            # The host's own path for a held store too: the small files it fetches go to the disk cache. The
            # follower's own callback: a peer that sent an invalid manifest is never asked again.
            return await self._host.open_store(self.package_id, peers, self._pool, self._peer_failed)
        finally:
            self._watch(self._store())  # a store held before its files failed is watched too

    def _watch(self, store: BlockStore | None) -> None:
        """Report the blocks ``store`` holds (e.g. from the disk cache) and each it verifies from now on; once
        per store."""
        if store is None or store is self._watched:
            return
        self._watched = store
        store.subscribe(self._on_store_event)
        self._session.report_verified(self.package_id, store.verified_blocks())

    def _on_store_event(self, event: StoreEvent) -> None:
        if event.kind == "block_verified":
            self._session.report_verified(self.package_id, [event.block])

    async def _fetch(self, fetcher: Fetcher, store: BlockStore, wanted: list[Fetch[PeerInfo]]) -> None:
        """Run one generation until it ends or the parts change what it fetches; report progress meanwhile if a
        part asks for it."""
        fetching = asyncio.create_task(fetcher.fetch(wanted))
        tasks = [fetching]
        if any(part.report_progress for part in self.parts.values()):
            tasks.append(asyncio.create_task(self._report_progress(store)))
        try:
            while True:
                changed = asyncio.create_task(self._changed.wait())
                try:
                    await asyncio.wait({fetching, changed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                if fetching.done():
                    fetching.result()
                    return
                self._changed.clear()
                done = unit_done(store)
                remaining = {f for f in wanted if not done(f)}
                if set(self._wanted()) != remaining:
                    log.info("package %s: new parts; fetching the %d missing blocks as they say",
                             self.package_id[:12], len(self._wanted()))
                    return
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _report_progress(self, store: BlockStore) -> None:
        """Tell the control plane the bytes held, every interval, stalled or not: it finds stragglers by them."""
        while True:
            self._session.report_progress(self.package_id, store.progress().bytes_present)
            await asyncio.sleep(self._progress_interval_s)

    async def _after_failure(self, error: FetchFailedError, failed: set[PeerInfo], wanted: list[Fetch[PeerInfo]],
                             avoided: set[PeerInfo]) -> set[PeerInfo]:
        """Report the parents given up on; returns the peers to fetch around next (none: new parts came).
        ``avoided``: the peers the failed round fetched around."""
        log.warning("package %s: %s", self.package_id[:12], error)
        if self._changed.is_set():
            return set()
        # A source that failed without corrupting anything is tried again next round (it may be back).
        around = failed - set(self._sources())
        try:
            replanned = await self._report(failed, wanted)
        except ControlPlaneError as exc:
            if not self._unreported:  # once per outage, not once per round
                log.warning("package %s: cannot report failed parents %s (%s); fetching around them from the "
                            "sources until the control plane is back", self.package_id[:12],
                            ", ".join(map(str, failed)), exc)
                self._unreported = True
            if around <= avoided:
                # Nothing new to fetch around (only sources failed, or the round fetched around these already): the
                # next round after a pause, not at once, against the same peers.
                await self._changed_within(self._pause_s)
            return around
        self._unreported = False
        try:
            await asyncio.wait_for(self._changed.wait(), self._replan_wait_s)
            return set()
        except TimeoutError:
            log.warning("package %s: no new parents within %.1f s (re-planned: %s); fetching around %s from the "
                        "sources", self.package_id[:12], self._replan_wait_s, replanned,
                        ", ".join(map(str, failed)))
            return around

    async def _report(self, failed: set[PeerInfo], wanted: list[Fetch[PeerInfo]]) -> bool:
        store = self._store()
        replanned = False
        for peer in sorted(failed, key=str):
            block = next((f.block for f in wanted if f.parent == peer
                          and (store is None or not store.is_block_verified(f.block))), None)
            if block is None:
                continue
            error = self._errors.get(peer)
            reason = f"{type(error).__name__}: {error}" if error is not None else "gave up on it"
            replanned |= await self._session.report_bad_peer(peer.node_id, self.package_id, block, reason,
                                                             gone=isinstance(error, PeerNotListeningError))
            log.info("package %s: reported parent %s (block %d): %s", self.package_id[:12], peer, block, reason)
        return replanned


class ControlLink:
    """An agent's link to the control plane: the worker session and a follower per assigned package."""

    def __init__(self, host: AgentHost, client: ControlPlaneClient, spec: WorkerSpec, policy: FetchPolicy,
                 replan_wait_s: float, progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S) -> None:
        self.host = host
        self.client = client
        # The data-plane key comes with each registration: the transport keys its hello with it from then on.
        self.session = WorkerSession(client, spec, holdings=self._held, on_data_key=host.transport.set_key,
                                     cached=host.disk_cached)
        self._policy = policy
        self._replan_wait_s = replan_wait_s
        self._progress_interval_s = progress_interval_s
        self._followers: dict[str, PackageFollower] = {}
        # package -> plan -> the relay piece the plan asks (a node in two plans of a package, a chain's tail with the
        # chain hung behind it, relays in the smaller)
        self._relay_caps: dict[str, dict[str, int]] = {}

    def _cap_relay(self, package_id: str, caps: dict[str, int]) -> None:
        """Keep ``caps`` (plan -> relay piece asked, 0: none) as ``package_id``'s; its chunks are relayed in the
        smallest piece asked."""
        asked = {plan: cap for plan, cap in caps.items() if cap}
        if asked:
            self._relay_caps[package_id] = asked
        else:
            self._relay_caps.pop(package_id, None)
        self.host.transport.cap_relay(package_id, min(asked.values(), default=0))

    def _held(self) -> Mapping[str, Collection[int]]:
        return {pid: store.verified_blocks() for pid, store in self.host.peer_server.stores.items()}

    async def run(self) -> None:
        """Follow the assignment stream until cancelled; raises ``Unauthenticated`` if the token is refused.
        On the way out every follower stops and the worker deregisters."""
        await self.session.start()
        try:
            async for update in self.session.assignments():
                await self._apply(update)
        finally:
            for follower in self._followers.values():
                await follower.close()
            self._followers.clear()
            await self.session.close()
            await self.client.close()

    async def _apply(self, update: AssignmentUpdate) -> None:
        events, package_id = self.host.events, update.package_id
        if update.kind is UpdateKind.SYNC:
            events.emit("sync", plans=list(update.plan_ids))
            self.host.peer_server.retain_parts(update.plan_ids)
            for package, caps in list(self._relay_caps.items()):
                self._cap_relay(package, {plan: cap for plan, cap in caps.items() if plan in update.plan_ids})
            for follower in self._followers.values():
                follower.retain(update.plan_ids)
        elif update.kind is UpdateKind.ASSIGN:
            events.emit("assignment", plan=update.plan_id, package=package_id, version=update.version,
                        fetch=[[f.block, f.parent.node_id] for f in update.fetch],
                        serve=[[block, child] for block, child in update.serve], priority=update.priority,
                        relay_bytes=update.relay_bytes)
            log.info("plan %s v%d: fetch %d blocks, serve %d transfers of package %s (priority %s)",
                     update.plan_id, update.version, len(update.fetch), len(update.serve), package_id[:12],
                     update.priority)
            self.host.transport.limits.set_priority(package_id, update.priority)  # its share of the link
            self._cap_relay(package_id, {**self._relay_caps.get(package_id, {}), update.plan_id: update.relay_bytes})
            if update.fetch and package_id not in self.host.peer_server.stores:
                self.host.peer_server.expect(package_id)  # children may ask before this node has the manifest
            # Whom this node serves the package: the part's children, and every receiver if it is a source (the
            # fallback of their fetches).
            self.host.peer_server.serve_part(update.plan_id, package_id,
                                             {*(child for _, child in update.serve), *update.receivers})
            follower = self._followers.get(package_id)
            if follower is None:
                follower = self._followers[package_id] = PackageFollower(
                    package_id, self.host, self.session, self._policy, self._replan_wait_s, self._progress_interval_s)
            follower.assign(update)
        elif update.kind is UpdateKind.CANCEL:
            events.emit("plan_cancelled", plan=update.plan_id, package=package_id)
            self.host.peer_server.end_part(update.plan_id)
            self._cap_relay(package_id, {plan: cap for plan, cap in self._relay_caps.get(package_id, {}).items()
                                         if plan != update.plan_id})
            if package_id in self._followers:
                self._followers[package_id].cancel(update.plan_id)
        elif update.kind is UpdateKind.DROP:
            follower = self._followers.pop(package_id, None)
            if follower is not None:
                await follower.close()
            store = self.host.peer_server.stores.get(package_id)
            if store is not None:
                # Unqueues its verified reports, and follows any already sent: its holdings converge on this drop.
                self.session.report_dropped(package_id, store.verified_blocks())
            await self.host.drop_package(package_id)
            self.host.transport.limits.forget(package_id)
            self._cap_relay(package_id, {})
            cached = (await asyncio.to_thread(self.host.disk_cached, [package_id])).get(package_id)
            # A later scale-up of it here is a local load. Looked at again: the cache may have removed it meanwhile,
            # and the registration that tells the control plane so may be done already.
            if cached and self.host.in_disk_cache(package_id):
                self.session.report_cached(package_id, cached)
