"""The agent daemon: serves what the node holds, follows a static plan or the control plane, feeds the
local engine.

One asyncio loop per agent process. On start it opens the seed package (if any), listens for peers,
opens the local API, and with a plan fetches this node's assignments (resuming from the disk cache),
forwarding every verified chunk to its own children as it lands. With a control plane it registers and
fetches what the assignment stream says instead (:mod:`pipecast.agent.control`). SIGTERM, SIGINT or SIGHUP
stops it cleanly.
"""

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from control_plane.messages import PeerInfo, WorkerSpec
from pipecast.agent.budget import MemoryBudget
from pipecast.agent.buffers import SharedMemoryAllocator
from pipecast.agent.cache import BlockCache
from pipecast.agent.errors import MemoryBudgetError, PlanFileError, TransportUnavailableError
from pipecast.agent.events import EventLog
from pipecast.agent.fetcher import (
    ChannelPool,
    Fetcher,
    FetchPolicy,
    PeerFailureCallback,
    fetch_files,
    fetch_manifest,
)
from pipecast.agent.host import advertised_address, detect_accelerator, host_memory
from pipecast.agent.local_api import LocalApiServer
from pipecast.agent.local_package import LocalPackageFolder
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.plan_file import StaticPlan, read_plan_file
from pipecast.agent.ratelimit import format_rate
from pipecast.agent.reserve import MemoryReserve
from pipecast.agent.store import BlockStore, StoreEvent
from pipecast.agent.transport.base import Listener, PeerAuth, Transport, split_address
from pipecast.agent.transport.registry import select_transport
from pipecast.core.credentials import check_master_token, parse_node_token
from pipecast.core.engines import DEFAULT_ENGINE
from pipecast.core.errors import PipecastError
from pipecast.core.settings import Settings
from pipecast.core.signals import on_stop_signals
from pipecast.core.units import format_bytes
from pipecast.v1.manifest_pb2 import Manifest

if TYPE_CHECKING:
    from pipecast.agent.control import ControlLink

log = logging.getLogger(__name__)
T = TypeVar("T")

PROGRESS_LOG_S = 5.0
# --exit-when-complete waits this long with no peer connected, so a child between two requests is not
# left behind.
EXIT_LINGER_S = 0.5
# Under a control plane, how long a request for a package this node has not heard of waits for the
# node's own assignment before it is refused (the control plane tells a parent and its child at once).
UNASSIGNED_GRACE_S = 2.0
#: After a drop, the longest the package's memory stays counted in the budget while an engine still maps it (s): a
#: released serving worker drains its running requests for up to 30 s, then closes its model.
DROP_UNMAP_WAIT_S = 35.0


@dataclass(frozen=True)
class AgentOptions:
    """What one agent process does (the ``pipecast agent`` flags, resolved)."""

    node_id: str
    listen: str | None = None  # host:port; None: the plan's address for this node, else the settings'
    seed: Path | None = None
    plan: Path | None = None
    events: Path | None = None
    exit_when_complete: bool = False
    start_at: float | None = None  # time.time() at which to begin fetching (synchronised starts); None: at once
    policy: FetchPolicy = field(default_factory=FetchPolicy)
    control_plane: str | None = None  # host:port: register there and follow its assignments
    labels: Mapping[str, str] = field(default_factory=dict)  # topology labels registered with the control plane
    serve_url: str = ""  # HTTP base URL of this node's serving worker, registered for the router
    engine: str = DEFAULT_ENGINE  # what answers at serve_url (control_plane.messages.SERVING_ENGINES)
    serve_package: str = ""  # the package id the worker at serve_url serves ("": not said, any)
    #: Told the line saying where it listens, as the other servers print it (the entry point prints it).
    announce: Callable[[str], None] | None = None


class _AgentPeerServer(PeerServer):
    """The agent's :class:`PeerServer`: records every admitted request in the event log (what it served to
    whom), and gives a package it has not heard of ``grace_s`` to be assigned (expected) before refusing
    it; under a control plane (``plan_gated``) it serves only the children its parts name."""

    def __init__(self, events: EventLog, grace_s: float, plan_gated: bool) -> None:
        super().__init__(plan_gated=plan_gated, grace_s=grace_s)
        self._events = events
        self._heard = asyncio.Event()

    def add(self, store: BlockStore) -> None:
        super().add(store)
        self._heard.set()

    def expect(self, package_id: str) -> None:
        super().expect(package_id)
        self._heard.set()

    async def _heard_of(self, package_id: str) -> None:
        deadline = time.monotonic() + self.grace_s
        while package_id not in self.stores and package_id not in self.expected:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._heard.clear()
            try:
                await asyncio.wait_for(self._heard.wait(), left)
            except TimeoutError:
                return

    async def chunk_count(self, package_id: str, block: int) -> int:
        await self._heard_of(package_id)
        return await super().chunk_count(package_id, block)

    async def file_bytes(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        await self._heard_of(package_id)
        return await super().file_bytes(package_id, path, offset, length)

    def peer_requested(self, requester: str, package_id: str, block: int | None) -> None:
        super().peer_requested(requester, package_id, block)
        self._events.emit("peer_request", requester=requester, package=package_id, block=block)


async def _open_in_thread(manifest: Manifest, **options: Any) -> BlockStore:
    """:meth:`BlockStore.open` in a worker thread (re-hashing local blocks takes a while: not on the loop); cancelled,
    the thread stops verifying at its next chunk."""
    cancel = threading.Event()
    opening = asyncio.ensure_future(asyncio.to_thread(BlockStore.open, manifest, cancel=cancel, **options))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        # Cancelled (the agent stopping, the package dropped meanwhile): the thread stops verifying, or, past its
        # verifying, still opens the store, which holds its memory budget and buffers: whoever would have held it
        # is gone, so it is closed as it comes. Without the flag the agent's exit waited for the whole re-hash.
        cancel.set()
        opening.add_done_callback(_close_opened)
        raise


def _close_opened(opening: asyncio.Future) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


class AgentDaemon:
    """One node agent. ``await run()`` until stopped."""

    def __init__(self, options: AgentOptions, settings: Settings) -> None:
        self.options = options
        self.settings = settings
        self.node_id = options.node_id
        self.events = EventLog(options.events, options.node_id)
        under_control = options.control_plane is not None
        self.peer_server = _AgentPeerServer(self.events, UNASSIGNED_GRACE_S if under_control else 0.0,
                                            plan_gated=under_control)
        self.budget = MemoryBudget(settings.agent_memory_bytes)
        if settings.agent_reserve_bytes > settings.agent_memory_bytes:
            raise MemoryBudgetError(
                f"the memory reserve ({format_bytes(settings.agent_reserve_bytes)}, --reserve / "
                f"PIPECAST_AGENT_RESERVE_BYTES) is larger than the memory budget "
                f"({format_bytes(settings.agent_memory_bytes)}, --memory): it holds memory for the blocks the "
                "budget admits, so it can be at most the budget")
        self._check_host_memory(settings)
        self.reserve = MemoryReserve(settings.agent_reserve_bytes) if settings.agent_reserve_bytes else None
        self.allocator = SharedMemoryAllocator(self.reserve)
        self._filling: asyncio.Task | None = None
        # Packages whose stores are opening (once per open under way): one opened from the disk cache is read, and
        # its blocks re-hashed, for a while before it is held; removed for room meanwhile, it lost those blocks.
        self._opening: list[str] = []
        self.cache = (BlockCache(settings.agent_cache_dir, settings.agent_cache_max_bytes,
                                 in_use=lambda: [*self.peer_server.stores, *self._opening],
                                 on_removed=self._removed_from_cache)
                      if settings.agent_cache_dir else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._control: "ControlLink | None" = None
        self.listener: Listener | None = None
        self.transport: Transport | None = None
        self._stop = asyncio.Event()
        self._cache_writes: dict[asyncio.Task, BlockStore] = {}  # each write under way, and whose block it is
        self._freeing: set[asyncio.Task] = set()  # dropped packages' memory, freed once no engine maps it
        self._local_api: LocalApiServer | None = None
        self._from_cache: dict[str, int] = {}  # package -> blocks its store opened with from the disk cache

    @staticmethod
    def _check_host_memory(settings: Settings) -> None:
        """Refuse a reserve larger than the memory this host (and its memory cgroup) has available: populating it
        would get the agent killed for want of memory, without a word; warn of a budget above the host's memory."""
        memory = host_memory()
        reserve = settings.agent_reserve_bytes
        if reserve and memory.available is not None and reserve > memory.available:
            raise MemoryBudgetError(
                f"the memory reserve ({format_bytes(reserve)}, --reserve / PIPECAST_AGENT_RESERVE_BYTES) is larger "
                f"than the memory this host has available ({format_bytes(memory.available)}, "
                f"{memory.available_from}): populating it would get the agent killed for want of memory")
        if memory.limit is not None and settings.agent_memory_bytes > memory.limit:
            log.warning("the memory budget (%s, --memory / PIPECAST_AGENT_MEMORY_BYTES) is larger than this host's "
                        "memory (%s, %s): packages it admits can get the agent killed for want of memory",
                        format_bytes(settings.agent_memory_bytes), format_bytes(memory.limit), memory.limit_from)

    def stop(self) -> None:
        """Ask the daemon to shut down (signal-safe from the loop)."""
        self._stop.set()

    async def run(self) -> None:
        """Serve until stopped; raises the typed error that made the agent give up (e.g. FetchFailedError)."""
        loop = self._loop = asyncio.get_running_loop()
        on_stop_signals(loop, self.stop)
        plan = read_plan_file(self.options.plan) if self.options.plan else None
        if plan is not None and self.node_id not in plan.nodes:
            raise PlanFileError(f"{self.options.plan}: node {self.node_id!r} is not in the plan's 'nodes'")
        work: asyncio.Task | None = None
        reporter = loop.create_task(self._report_progress())
        self._fill_reserve()
        try:
            # Built before the seed is verified (minutes for a large one): a bad TLS file fails at once.
            self.transport = select_transport(self.settings.agent_transport, self.node_id, self.settings,
                                              self._peer_auth())
            if self.options.seed is not None:
                seed = LocalPackageFolder(self.options.seed)
                # Raced against SIGTERM: verifying a large seed takes minutes, which a stop must not wait out.
                store = await self._unless_stopped(_open_in_thread(seed.manifest, allocator=self.allocator,
                                                                   budget=self.budget, local=seed,
                                                                   require_complete=True))
                if store is None:
                    return
                self._hold(store, cache=False)
                if plan is not None and store.package_id != plan.package_id:
                    raise PlanFileError(f"{self.options.plan}: the plan is for package {plan.package_id[:12]} "
                                        f"but --seed {self.options.seed} holds {store.package_id[:12]}")
                log.info("seeding package %s (%d blocks, %s) from %s", store.package_id[:12],
                         len(store.manifest.blocks), format_bytes(store.manifest.total_bytes), self.options.seed)
            host, port = self._listen_address(plan)
            try:
                self.listener = await self.transport.listen(host, port, self.peer_server)
            except TransportUnavailableError as exc:  # found only at its start (e.g. UCX with no usable device)
                if self.settings.agent_transport != "auto" or self.transport.name == "tcp":
                    raise
                log.warning("transport %s unusable (%s); using tcp: this node exchanges blocks only with agents on "
                            "tcp", self.transport.name, exc)
                await self.transport.close()
                self.transport = select_transport("tcp", self.node_id, self.settings, self._peer_auth())
                self.listener = await self.transport.listen(host, port, self.peer_server)
            log.info("agent %s listening on %s (%s)", self.node_id, self.listener.address, self.transport.name)
            if self.options.announce is not None:
                self.options.announce(f"pipecast agent: node {self.node_id} listening on {self.listener.address} "
                                      f"({self.transport.name})")
            self.events.emit("listening", address=self.listener.address, transport=self.transport.name)
            if self.settings.agent_local_socket is not None:
                self._local_api = LocalApiServer(self.peer_server, self.status, self.transport.auth)
                await self._local_api.start(self.settings.agent_local_socket)
                log.info("local API on %s", self.settings.agent_local_socket)
            control = self._control = await self._control_link() if self.options.control_plane is not None else None
            work = loop.create_task(control.run() if control is not None else self._work(plan))
            stop = loop.create_task(self._stop.wait())
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if work.done():
                try:
                    work.result()
                except PipecastError as exc:  # a fatal error (e.g. a refused token) ends the agent
                    self.events.emit("failed", error=type(exc).__name__, message=str(exc))
                    raise
                await self._stop.wait()
        finally:
            log.info("agent %s stopping", self.node_id)
            for task in (work, reporter):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (work, reporter) if t is not None), return_exceptions=True)
            await self._shutdown()

    async def _unless_stopped(self, work: Awaitable[T]) -> T | None:
        """What ``work`` gives, or None once the agent is asked to stop first (``work`` is cancelled then)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None

    def _peer_auth(self) -> PeerAuth:
        """This node's data-plane credentials: under a control plane the key comes with the registration
        (unknown until then); in static-plan mode it derives from the cluster's master token (the
        ``auth_token`` setting; empty: auth off)."""
        if self.options.control_plane is not None:  # given a token, it will not take "auth off" from the control plane
            return PeerAuth(self.node_id, None, require_key=bool(self.settings.auth_token))
        token = self.settings.auth_token
        if token and parse_node_token(token) is not None:
            raise PlanFileError("auth_token holds a node token: without a control plane an agent derives the "
                                "data-plane key from the cluster's master token, so every agent of a static plan is "
                                "given the master token")
        return PeerAuth.from_token(self.node_id, check_master_token(token))

    def _listen_address(self, plan: StaticPlan | None) -> tuple[str, int]:
        if self.options.listen is not None:
            return split_address(self.options.listen)
        if plan is not None:
            return split_address(plan.nodes[self.node_id])
        return self.settings.agent_host, self.settings.agent_port

    async def _work(self, plan: StaticPlan | None) -> None:
        if plan is not None:
            if self.options.start_at is not None:
                # Listening already, so peers can connect; the fetching waits for the common start.
                wait_s = max(self.options.start_at - time.time(), 0.0)
                log.info("agent %s: begins fetching in %.1f s (--start-at)", self.node_id, wait_s)
                await asyncio.sleep(wait_s)
            await self._follow_plan(plan)
        if self.options.exit_when_complete:
            await self._wait_children_served(plan)
            log.info("agent %s: complete, children served; exiting", self.node_id)
            self.stop()

    async def _follow_plan(self, plan: StaticPlan) -> None:
        self.transport.cap_relay(plan.package_id, plan.relay_bytes)
        fetches = plan.fetches_of(self.node_id)
        if plan.package_id in self.peer_server.stores or not fetches:
            if self.node_id in plan.plan.sources and plan.package_id not in self.peer_server.stores:
                log.warning("node %s is a source in the plan but seeds no package %s (use --seed)",
                            self.node_id, plan.package_id[:12])
            return
        self.peer_server.expect(plan.package_id)
        pool = ChannelPool(self.transport)
        try:
            sources = plan.sources()
            store = await self.open_store(plan.package_id, [*(f.parent for f in fetches), *sources], pool)
            policy = replace(self.options.policy, fallbacks=tuple(sources))
            fetcher = Fetcher(store, pool, policy, self.peer_failed)
            await fetcher.fetch(fetches)
        finally:
            await pool.close()
        await self.package_complete(store)

    async def package_complete(self, store: BlockStore) -> None:
        """Log and record that the blocks this node fetches of ``store`` (a static plan's part of them, else every
        block) are verified, once the disk cache has them too."""
        # This store's writes only, shielded: a cancelled wait (its package dropped) must cancel no write, least
        # of all another package's, whose own wait would then end in a CancelledError of nobody's asking.
        writes = [task for task, owner in self._cache_writes.items() if owner is store]
        if writes:
            await asyncio.shield(asyncio.gather(*writes))
        # The blocks verified here, not the package: a static plan may give this node a part of it only (the
        # package's size was logged then, and no time: the package's is unset until it is whole here).
        verified = [b for b in store.progress().blocks if b.verified_at is not None]
        size = sum(store.manifest.blocks[b.index].bytes for b in verified)
        seconds = max(b.verified_at for b in verified) - min(b.started_at for b in verified) if verified else 0.0
        log.info("agent %s: package %s complete: %d blocks (%d from the disk cache), %s in %.3f s (%s)",
                 self.node_id, store.package_id[:12], len(verified), self._from_cache.pop(store.package_id, 0),
                 format_bytes(size), seconds, format_rate(size / seconds) if seconds else "-")
        self.events.emit("complete", package=store.package_id, bytes=size, seconds=seconds)

    async def open_store(self, package_id: str, peers: Sequence[PeerInfo], pool: ChannelPool,
                         on_failure: PeerFailureCallback | None = None) -> BlockStore:
        """The store of ``package_id`` with all its small files: the one held, else a new one (its verified
        blocks from the disk cache, its manifest from the cache or the first of ``peers`` that has it).
        The small files it lacks are fetched from ``peers`` and written to the disk cache (a held store's too:
        an earlier call may have failed on them). A peer that fails is reported to ``on_failure`` (default
        :meth:`peer_failed`)."""
        report = on_failure or self.peer_failed
        silent: set[PeerInfo] = set()  # peers silent for the manifest: asked last for the files
        store = self.peer_server.stores.get(package_id)
        if store is None:
            self._opening.append(package_id)  # not removed from the disk cache for room until held
            try:
                store = await self._open_receiving_store(package_id, peers, pool, report, silent)
            finally:
                self._opening.remove(package_id)
        missing = store.missing_files()
        if missing:
            await fetch_files(pool, store, peers, report, self.options.policy, silent)
            if self.cache is not None:
                for path in missing:
                    await asyncio.to_thread(self.cache.write_file, store.package_id, path, store.files[path])
        return store

    async def _open_receiving_store(self, package_id: str, peers: Sequence[PeerInfo], pool: ChannelPool,
                                    report: PeerFailureCallback, silent: set[PeerInfo]) -> BlockStore:
        # Reading a cached manifest (10 MB for a large model) takes ~0.6 s: not on the loop, which forwards chunks.
        cached = (await asyncio.to_thread(self.cache.local_package, package_id, use=True) if self.cache is not None
                  else None)
        if cached is not None:
            manifest, origin = cached.manifest, cached.description
        else:
            manifest, peer = await fetch_manifest(pool, package_id, peers, report, self.options.policy, silent)
            origin = f"peer {peer}"
            if self.cache is not None:
                await asyncio.to_thread(self.cache.write_manifest, manifest)
        store = await _open_in_thread(manifest, allocator=self.allocator, budget=self.budget, local=cached,
                                      manifest_origin=origin)
        if cached is not None:
            log.info("disk cache: %d of %d blocks of %s verified and served from %s",
                     len(store.verified_blocks()), len(manifest.blocks), package_id[:12], cached.root)
        self._hold(store, cache=True)
        self._from_cache[package_id] = len(store.verified_blocks())
        return store

    def in_disk_cache(self, package_id: str) -> bool:
        """Whether the disk cache holds ``package_id``'s folder now (a look, no read)."""
        return self.cache is not None and self.cache.holds(package_id)

    def disk_cached(self, package_ids: Collection[str] | None = None) -> dict[str, list[int]]:
        """Blocks in the disk cache, per package (of ``package_ids``, or every cached one); none without."""
        if self.cache is None:
            return {}
        ids = self.cache.packages() if package_ids is None else package_ids
        return {pid: self.cache.cached_blocks(pid) for pid in ids}

    async def drop_package(self, package_id: str) -> None:
        """Stop serving ``package_id`` and free its memory (the disk cache keeps its blocks)."""
        self.peer_server.forget(package_id)  # a child's request waiting for it is refused now, not at its timeout
        self.peer_server.end_package(package_id)
        store = self.peer_server.stores.pop(package_id, None)
        free = store.detach() if store is not None else None
        mappers = set()
        if self._local_api is not None:  # engines learn it at once, not once gigabytes are unmapped
            self._local_api.publish_dropped(package_id)
            mappers = self._local_api.mapped_by(package_id)
        if free is not None and mappers:
            # An engine still maps the memory (a released worker drains its requests first): it stays counted in
            # the budget, and out of the reserve's refill, until the engine lets go (its client closes with its
            # model) or DROP_UNMAP_WAIT_S passes.
            task = asyncio.get_running_loop().create_task(self._free_once_unmapped(package_id, mappers, free))
            self._freeing.add(task)
            task.add_done_callback(self._freeing.discard)
        elif free is not None:
            await asyncio.to_thread(free)  # unmapping off the loop: it forwards other packages' chunks
            self._fill_reserve()  # from the pages the package freed, while they are still backed
        log.info("agent %s: dropped package %s", self.node_id, package_id[:12])
        self.events.emit("dropped", package=package_id)

    async def _free_once_unmapped(self, package_id: str, mappers: set[asyncio.Task],
                                  free: Callable[[], None]) -> None:
        _, left = await asyncio.wait(mappers, timeout=DROP_UNMAP_WAIT_S)
        if left:
            log.warning("agent %s: package %s dropped, but an engine still maps its memory after %.0f s: freed "
                        "(counted out of the budget) all the same", self.node_id, package_id[:12], DROP_UNMAP_WAIT_S)
        await asyncio.to_thread(free)
        self._fill_reserve()

    def _fill_reserve(self) -> None:
        """Fill the memory reserve, if any, in the background (a fill under way goes on to the end)."""
        if self.reserve is None or (self._filling is not None and not self._filling.done()):
            return
        self._filling = asyncio.get_running_loop().create_task(self._fill(self.reserve))

    async def _fill(self, reserve: MemoryReserve) -> None:
        started, before = time.monotonic(), reserve.held_bytes
        # What the budget has free: the reserve holds memory for the blocks the budget admits, so while packages
        # are held it holds no more than the rest (filled whole, it took as much again as they hold).
        free = self.budget.limit_bytes - self.budget.used_bytes
        held = await asyncio.to_thread(reserve.fill, free)
        seconds = time.monotonic() - started
        log.info("agent %s: memory reserve holds %s of %s (%s populated in %.2f s)", self.node_id,
                 format_bytes(held), format_bytes(reserve.size), format_bytes(held - before), seconds)
        self.events.emit("reserve_filled", bytes=held, size=reserve.size, seconds=round(seconds, 3))

    def _removed_from_cache(self, package_id: str) -> None:
        """The disk cache removed ``package_id`` to make room (on a writing thread): the control plane, which
        places scale-ups on nodes caching the package first, is told (a registration replaces what it knew)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._cache_removed, package_id)

    def _cache_removed(self, package_id: str) -> None:
        self.events.emit("cache_removed", package=package_id)
        if self._control is not None:
            log.info("disk cache: package %s removed to make room; registering again so that the control plane "
                     "forgets it", package_id[:12])
            self._control.session.holdings_changed(removed=[package_id])

    async def _control_link(self) -> "ControlLink":
        """The link to the control plane named in the options, for this agent as it listens now."""
        # Imported here: the control link needs grpc, which an agent without a control plane never loads.
        from control_plane.client import ControlPlaneClient
        from pipecast.agent.control import ControlLink

        settings = self.settings.model_copy(update={"control_plane": self.options.control_plane})
        accelerator = await asyncio.to_thread(detect_accelerator, settings.device)
        peer = PeerInfo(self.node_id, advertised_address(self.listener.address), (self.transport.name,))
        # The rate the data plane may take of the link: a receiver far below it is a straggler.
        link_mbit = settings.agent_link_mbit * settings.multicast_share
        spec = WorkerSpec(peer, settings.agent_memory_bytes, accelerator, dict(self.options.labels),
                          self.options.serve_url, self.options.engine, link_mbit, self.options.serve_package)
        log.info("agent %s: control plane %s, registering as %s (%s) labels=%s", self.node_id,
                 settings.control_plane, peer.address, accelerator.kind, dict(spec.labels))
        return ControlLink(self, ControlPlaneClient.from_settings(settings), spec, self.options.policy,
                           settings.agent_replan_wait_s, settings.agent_progress_interval_s)

    def _hold(self, store: BlockStore, cache: bool) -> None:
        """Serve ``store`` and wire its events to the event log, the local API and the disk cache."""
        self.peer_server.add(store)

        def on_event(event: StoreEvent) -> None:
            if self._local_api is not None:
                self._local_api.publish(event, store)
            if event.kind == "prefix_verified":
                return  # one a chunk: for the engine (above), not for the record
            self.events.emit(event.kind, at=event.at, package=store.package_id, block=event.block,
                             peer=event.peer)
            if event.kind == "block_verified":
                log.debug("block %d verified (from %s)", event.block, event.peer)
                if cache and self.cache is not None:
                    self._write_to_cache(store, event.block)

        store.subscribe(on_event)
        if self._local_api is not None:  # held again after a drop: engines that heard of the drop learn its blocks
            self._local_api.publish_held(store)

    def _write_to_cache(self, store: BlockStore, block: int) -> None:
        # BlockCache logs and counts a failed write itself (ENOSPC, EIO): the block stays in memory only.
        # A view of its own (a slice): the package may be dropped, its views released, while the write runs.
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(self.cache.write_block, store.manifest, block, store.block_view(block)[:]))
        self._cache_writes[task] = store
        task.add_done_callback(self._cache_writes.pop)

    def peer_failed(self, what: str, peer: PeerInfo, error: Exception) -> None:
        """Record a failed fetch from ``peer`` in the event log."""
        self.events.emit("peer_failed", what=what, peer=peer.node_id, address=peer.address,
                         error=type(error).__name__, message=str(error))

    async def _wait_children_served(self, plan: StaticPlan | None) -> None:
        """Return once every child the plan gives this node has come and no peer is connected; or, with
        children yet to come, once no peer has been connected for ``agent_idle_timeout_s`` (a child that died, or
        fetched around this node, never comes: the warning names them)."""
        children = plan.children_of(self.node_id) if plan is not None else set()
        quiet_since = None
        while True:
            served = plan is None or self.peer_server.have_requested(plan.package_id, children)
            now = time.monotonic()
            quiet_since = (quiet_since or now) if self.listener.open_connections == 0 else None
            if quiet_since is not None and now - quiet_since >= EXIT_LINGER_S:
                if served:
                    return
                if now - quiet_since >= self.settings.agent_idle_timeout_s:
                    missing = sorted(c for c in children if not self.peer_server.have_requested(plan.package_id, [c]))
                    log.warning("agent %s: no peer for %g s and children %s never came; exiting without them",
                                self.node_id, self.settings.agent_idle_timeout_s, ", ".join(missing))
                    return
            await asyncio.sleep(0.05)

    async def _report_progress(self) -> None:
        last_in = last_out = 0
        present: dict[str, int] = {}  # per package, the bytes held at the last line
        while True:
            await asyncio.sleep(PROGRESS_LOG_S)
            if self.transport is None:
                continue
            stats = self.transport.stats
            if (stats.bytes_received, stats.bytes_sent) == (last_in, last_out):
                continue  # nothing moved: say nothing
            rates = (format_rate((stats.bytes_received - last_in) / PROGRESS_LOG_S),
                     format_rate((stats.bytes_sent - last_out) / PROGRESS_LOG_S))
            # A line per package still arriving, not per package held (found in review: a store seeding ten
            # packages logged ten lines every 5 s while it served one).
            said = False
            for store in self.peer_server.stores.values():
                p = store.progress()
                if present.get(store.package_id) == p.bytes_present:
                    continue
                present[store.package_id], said = p.bytes_present, True
                log.info("agent %s: %s %d/%d blocks, %s of %s; in %s, out %s", self.node_id, store.package_id[:12],
                         p.blocks_verified, p.blocks_total, format_bytes(p.bytes_present), format_bytes(p.bytes_total),
                         *rates)
            if not said:
                log.info("agent %s: serving; in %s, out %s", self.node_id, *rates)
            present = {k: v for k, v in present.items() if k in self.peer_server.stores}
            last_in, last_out = stats.bytes_received, stats.bytes_sent

    def status(self) -> dict:
        """The agent's state for the local API: bytes moved, and per package and block what is held."""
        stats = self.transport.stats if self.transport is not None else None
        return {
            "node": self.node_id,
            "address": self.listener.address if self.listener is not None else None,
            "bytes_received": stats.bytes_received if stats else 0,
            "bytes_sent": stats.bytes_sent if stats else 0,
            "cache_write_errors": self.cache.write_errors if self.cache is not None else 0,
            "cache_skipped_writes": self.cache.skipped_writes if self.cache is not None else 0,
            "reserve": None if self.reserve is None else {
                "bytes": self.reserve.size, "held_bytes": self.reserve.held_bytes,
                "handed_over_bytes": self.reserve.handed_over_bytes},
            "packages": {
                pid: {"blocks_verified": p.blocks_verified, "blocks_total": p.blocks_total,
                      "bytes_present": p.bytes_present, "bytes_total": p.bytes_total, "complete": p.complete,
                      "goodput_bytes_per_s": p.bytes_total / p.elapsed_s if p.elapsed_s else None,
                      "blocks": [vars(b) for b in p.blocks]}
                for pid, p in ((pid, s.progress()) for pid, s in self.peer_server.stores.items())
            },
        }

    async def _shutdown(self) -> None:
        if self._local_api is not None:
            await self._local_api.close()  # its connections end: drops waiting for engines to unmap go on
        if self._freeing:
            await asyncio.gather(*self._freeing, return_exceptions=True)
        if self.listener is not None:
            await self.listener.close()
        if self.transport is not None:
            await self.transport.close()
        if self._cache_writes:
            await asyncio.gather(*self._cache_writes, return_exceptions=True)
        for store in self.peer_server.stores.values():
            store.close()
        if self.cache is not None:
            self.cache.close()  # after its writes: another agent may take the folder now
        if self.reserve is not None:
            self.reserve.close()  # waits for a fill's step under way; the fill then ends
            if self._filling is not None:
                await asyncio.gather(self._filling, return_exceptions=True)
        stats = self.transport.stats if self.transport is not None else None
        self.events.emit("stopped", bytes_sent=stats.bytes_sent if stats else 0,
                         bytes_received=stats.bytes_received if stats else 0)
        self.events.close()
