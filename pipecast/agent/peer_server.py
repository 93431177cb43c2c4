"""What an agent serves to its peers: every package it holds, chunk by chunk as chunks are verified."""

import asyncio
import logging

from packager.manifest import MANIFEST_FILE, manifest_to_json
from pipecast.agent.errors import UnknownPackageError
from pipecast.agent.store import BlockStore

log = logging.getLogger(__name__)


class PeerServer:
    """The :class:`~pipecast.agent.transport.base.ServedPackages` of an agent, over its block stores.

    A chunk is served as soon as the store holds it verified (cut-through), even while the rest of its
    block is still arriving; a range of a small file as soon as its bytes are here (each receiver checks
    the whole file against the manifest). A request for a package this agent is about to receive (:meth:`expect`)
    waits for it instead of being refused: children may ask before their parent has the manifest. It
    also remembers which nodes asked, so a node knows when the children its plan gave it have come.
    """

    def __init__(self) -> None:
        self.stores: dict[str, BlockStore] = {}
        self.expected: set[str] = set()
        self.requesters: set[str] = set()
        self._added = asyncio.Event()

    def add(self, store: BlockStore) -> None:
        """Serve ``store`` from now on."""
        self.stores[store.package_id] = store
        self._added.set()

    def expect(self, package_id: str) -> None:
        """This agent will hold ``package_id`` soon: hold requests for it until then."""
        self.expected.add(package_id)

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
        if package_id not in self.stores and package_id not in self.expected:
            raise UnknownPackageError(f"package {package_id[:12]} is not held here")
        return await self.wait_store(package_id)

    async def chunk_count(self, package_id: str, block: int) -> int:
        return (await self._store(package_id)).chunk_count(block)

    async def wait_chunk(self, package_id: str, block: int, chunk: int) -> memoryview:
        return await (await self._store(package_id)).wait_chunk(block, chunk)

    async def file_bytes(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        store = await self._store(package_id)
        if path == MANIFEST_FILE:
            data = manifest_to_json(store.manifest).encode()
            return data[offset:offset + length] if length else data
        if length:
            return await store.wait_file_range(path, offset, length)
        return await store.wait_file(path)

    def peer_requested(self, requester: str, package_id: str, block: int | None) -> None:
        if requester not in self.requesters:
            log.info("serving %s (package %s)", requester, package_id[:12])
            self.requesters.add(requester)
