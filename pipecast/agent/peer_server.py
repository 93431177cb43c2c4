"""What an agent serves to its peers: every package it holds, chunk by chunk as chunks are verified."""

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable

from packager.manifest import MANIFEST_FILE
from pipecast.agent.errors import PeerNotAllowedError, UnknownPackageError
from pipecast.agent.store import BlockStore
from pipecast.agent.transport.base import ChunkRelay

log = logging.getLogger(__name__)

# Requesters remembered per package (the most recent ones): enough for any plan's children, bounded
# whatever names unauthenticated or misbehaving peers make up.
MAX_REQUESTERS_PER_PACKAGE = 1024


class PeerServer:
    """The :class:`~pipecast.agent.transport.base.ServedPackages` of an agent, over its block stores.

    A chunk is served as soon as the store holds it verified (cut-through), even while the rest of its
    block is still arriving; a range of a small file as soon as its bytes are here (each receiver checks
    the whole file against the manifest). A request for a package this agent is about to receive (:meth:`expect`)
    waits for it instead of being refused: children may ask before their parent has the manifest. It
    also remembers which nodes asked (the last :data:`MAX_REQUESTERS_PER_PACKAGE` per package), so a node
    knows when the children its plan gave it have come.

    With ``plan_gated`` (an agent under a control plane) a node serves a package only to the peers its
    current parts name (:meth:`serve_part`): its children, and, for a plan's source, every receiver of that
    plan (the sources are every receiver's fallback). A requester it does not know yet gets ``grace_s`` for the part
    that names it to arrive (the control plane tells a parent and its child at once, in no particular order). Without
    ``plan_gated`` (a static plan) every requester the transport let in is served.
    """

    def __init__(self, plan_gated: bool = False, grace_s: float = 0.0) -> None:
        self.stores: dict[str, BlockStore] = {}
        self.expected: set[str] = set()
        self.requesters: dict[str, OrderedDict[str, None]] = {}
        self.plan_gated = plan_gated
        self.grace_s = grace_s
        self._parts: dict[str, tuple[str, frozenset[str]]] = {}  # plan -> (package, the peers it may serve)
        self._added = asyncio.Event()  # set as a store is added or an expected package forgotten
        self._parts_changed = asyncio.Event()

    def add(self, store: BlockStore) -> None:
        """Serve ``store`` from now on."""
        self.stores[store.package_id] = store
        self._added.set()

    def expect(self, package_id: str) -> None:
        """This agent will hold ``package_id`` soon: hold requests for it until then."""
        self.expected.add(package_id)

    def forget(self, package_id: str) -> None:
        """This agent will not hold ``package_id`` after all (it was dropped): the peers' requests waiting for it
        are refused now, not left to their I/O timeout (which blames this node)."""
        self.expected.discard(package_id)
        self._added.set()

    # -- whom to serve (plan_gated) ----------------------------------------------------------------------

    def serve_part(self, plan_id: str, package_id: str, peers: Iterable[str]) -> None:
        """This node's current part in ``plan_id`` lets it serve ``peers`` (its children; for a source, every
        receiver of the plan)."""
        self._parts[plan_id] = (package_id, frozenset(peers))
        self._parts_changed.set()

    def end_part(self, plan_id: str) -> None:
        """This node has no part in ``plan_id`` any more."""
        self._parts.pop(plan_id, None)

    def retain_parts(self, plan_ids: Collection[str]) -> None:
        """Forget the parts of plans other than ``plan_ids``."""
        for plan_id in [p for p in self._parts if p not in plan_ids]:
            del self._parts[plan_id]

    def end_package(self, package_id: str) -> None:
        """Forget every part of ``package_id`` and who asked for it (the package is dropped)."""
        for plan_id in [p for p, (pid, _) in self._parts.items() if pid == package_id]:
            del self._parts[plan_id]
        self.requesters.pop(package_id, None)

    def _allowed(self, requester: str, package_id: str) -> bool:
        return any(pid == package_id and requester in peers for pid, peers in self._parts.values())

    async def admit(self, requester: str, package_id: str) -> None:
        if not self.plan_gated or self._allowed(requester, package_id):
            return
        deadline = time.monotonic() + self.grace_s
        while not self._allowed(requester, package_id):
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerNotAllowedError(f"node {requester} is not named to this node in any current plan of "
                                          f"package {package_id[:12]} (neither a child nor, for a source, a receiver)")
            self._parts_changed.clear()
            try:
                await asyncio.wait_for(self._parts_changed.wait(), left)
            except TimeoutError:
                pass

    # -- what to serve -----------------------------------------------------------------------------------

    async def wait_store(self, package_id: str | None) -> BlockStore:
        """The store of ``package_id`` (None: the only one held), once this agent has it.

        No deadline here: callers wrap it in theirs (a peer's I/O timeout, a local client's timeout).
        """
        while True:
            if package_id is not None and package_id in self.stores:
                return self.stores[package_id]
            if package_id is None and len(self.stores) == 1:
                return next(iter(self.stores.values()))
            if package_id is None and len(self.stores) > 1:
                raise UnknownPackageError(f"this agent holds {len(self.stores)} packages; name one")
            self._added.clear()
            await self._added.wait()

    async def _store(self, package_id: str) -> BlockStore:
        """The store of ``package_id`` for a peer's request: waited for while it is expected; refused
        (:class:`UnknownPackageError`) once it is neither held nor expected, before or during the wait."""
        while package_id not in self.stores:
            if package_id not in self.expected:
                raise UnknownPackageError(f"package {package_id[:12]} is not held here")
            self._added.clear()
            await self._added.wait()
        return self.stores[package_id]

    async def chunk_count(self, package_id: str, block: int) -> int:
        return (await self._store(package_id)).chunk_count(block)

    async def wait_chunk(self, package_id: str, block: int, chunk: int) -> memoryview:
        return await (await self._store(package_id)).wait_chunk(block, chunk)

    async def relay_chunk(self, package_id: str, block: int, chunk: int) -> ChunkRelay:
        return (await self._store(package_id)).relay_chunk(block, chunk)

    async def file_bytes(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        store = await self._store(package_id)
        if path == MANIFEST_FILE:  # made once, in a thread: the event loop serves chunks meanwhile
            data = await asyncio.to_thread(lambda: store.manifest_json)
            if not length:
                return data
            # Refused as a small file's range is (store.wait_file_range), not answered short.
            if offset < 0 or length < 0 or offset + length > len(data):
                raise UnknownPackageError(f"file {path!r} of package {package_id[:12]} has {len(data)} bytes: "
                                          f"no range of {length} at {offset}")
            return data[offset:offset + length]
        if length:
            return await store.wait_file_range(path, offset, length)
        return await store.wait_file(path)

    # -- who asked -----------------------------------------------------------------------------------------

    def peer_requested(self, requester: str, package_id: str, block: int | None) -> None:
        known = self.requesters.get(package_id)
        if known is None:
            known = self.requesters[package_id] = OrderedDict()
        if requester in known:
            known.move_to_end(requester)
            return
        log.info("serving %s (package %s)", requester, package_id[:12])
        known[requester] = None
        if len(known) > MAX_REQUESTERS_PER_PACKAGE:
            known.popitem(last=False)

    def have_requested(self, package_id: str, nodes: Collection[str]) -> bool:
        """Whether every node of ``nodes`` has asked for ``package_id``."""
        known = self.requesters.get(package_id, {})
        return all(node in known for node in nodes)
