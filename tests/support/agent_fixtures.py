"""Shared pieces of the agent's tests: stores as a seed or a receiver opens them, chunk helpers, a faulty relay
(their packages: ``tiny_package(..., layer_bytes=...)`` in tests.support.packages)."""

import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from pipecast.agent.budget import MemoryBudget
from pipecast.agent.buffers import SharedMemoryAllocator
from pipecast.agent.local_api import LocalApiServer
from pipecast.agent.local_package import LocalPackageFolder
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.store import BlockStore
from pipecast.agent.transport.base import Channel, Listener, PeerAuth, Transport, WholeChunk
from pipecast.v1.manifest_pb2 import Manifest


def receiving_store(manifest: Manifest, budget_bytes: int = 1 << 30, **kwargs) -> BlockStore:
    """An empty store for ``manifest``, as a receiving agent opens it (shared memory, nothing verified)."""
    return BlockStore.open(manifest, allocator=SharedMemoryAllocator(), budget=MemoryBudget(budget_bytes),
                           manifest_origin="test", **kwargs)


@asynccontextmanager
async def local_api_serving(store: BlockStore, socket: Path, status: Callable[[], dict] = dict,
                            auth: PeerAuth | None = None,
                            others: Sequence[BlockStore] = ()) -> AsyncIterator[LocalApiServer]:
    """``store`` (and the ``others``: more packages the agent holds) served by a local API server at ``socket``,
    their events published as the agent wires them (``auth``: the agent's cluster credentials; default none, auth
    off); the server closed at the end (the stores are the caller's)."""
    peer_server = PeerServer()
    for held in (store, *others):
        peer_server.add(held)
    server = LocalApiServer(peer_server, status=status, auth=auth or PeerAuth("test"))
    for held in (store, *others):
        held.subscribe(lambda event, held=held: server.publish(event, held))
    await server.start(socket)
    try:
        yield server
    finally:
        await server.close()


def block_file_bytes(root: Path, manifest: Manifest, block: int) -> bytes:
    """The bytes of block ``block``'s file in the package folder ``root``."""
    return (root / manifest.blocks[block].file).read_bytes()


def land_chunk(store: BlockStore, data: bytes, block: int, chunk: int) -> None:
    """Land ``chunk`` of ``block`` (whose bytes are ``data``) in ``store`` as if an upstream parent sent it."""
    buffer = store.chunk_buffer(block, chunk)
    start = chunk * store.manifest.blocks[block].chunk_bytes
    buffer[:] = data[start:start + len(buffer)]
    store.chunk_landed(block, chunk, "upstream")


def corrupt_copy(package: Path, dest: Path) -> Path:
    """A copy of the package folder ``package`` at ``dest`` whose first block file has its last byte flipped."""
    shutil.copytree(package, dest)
    block = min((dest / "blocks").iterdir())
    data = bytearray(block.read_bytes())
    data[-1] ^= 0xFF
    block.write_bytes(bytes(data))
    return dest


def seed_store(root: Path) -> BlockStore:
    """A store serving the package folder ``root``, as a seed agent holds it."""
    seed = LocalPackageFolder(root)
    return BlockStore.open(seed.manifest, allocator=SharedMemoryAllocator(), budget=MemoryBudget(1 << 30),
                           local=seed, require_complete=True)


class WholeChunkServer(PeerServer):
    """Passes chunks on only whole and verified, through :meth:`wait_chunk`, over TCP too (which otherwise relays
    a chunk as it lands): a test server that overrides ``wait_chunk`` sees, or alters, every chunk asked for."""

    async def relay_chunk(self, package_id: str, block: int, chunk: int) -> WholeChunk:
        return WholeChunk(await self.wait_chunk(package_id, block, chunk))


class FlippingServer(WholeChunkServer):
    """A faulty relay: serves its stores but flips a byte of one chunk (block, chunk)."""

    def __init__(self, flip: tuple[int, int]) -> None:
        super().__init__()
        self.flip = flip

    async def wait_chunk(self, package_id: str, block: int, chunk: int) -> memoryview:
        data = await super().wait_chunk(package_id, block, chunk)
        if (block, chunk) == self.flip:
            bad = bytearray(data)
            bad[7] ^= 0xFF
            return memoryview(bad)
        return data


@asynccontextmanager
async def serving_store(transport: Transport, store: BlockStore,
                        server: PeerServer | None = None) -> AsyncIterator[Listener]:
    """``store`` served by ``server`` (or a plain one) on loopback; the store closed at the end, the listener not."""
    server = PeerServer() if server is None else server
    server.add(store)
    try:
        yield await transport.listen("127.0.0.1", 0, server)
    finally:
        store.close()


@asynccontextmanager
async def receiving(manifest: Manifest) -> AsyncIterator[BlockStore]:
    """A :func:`receiving_store` closed at the end (async, to sit in one ``async with`` with listener and channel)."""
    store = receiving_store(manifest)
    try:
        yield store
    finally:
        store.close()


@asynccontextmanager
async def connected(transport: Transport, address: str, peer: str) -> AsyncIterator[Channel]:
    """A channel of ``transport`` to ``peer`` at ``address``, closed at the end (closing again is harmless)."""
    channel = await transport.connect(address, peer)
    try:
        yield channel
    finally:
        await channel.close()


class ReceiveLog:
    """The store as a chunk sink, logging each chunk's receive: ("begun", block, chunk) as its buffer is taken,
    then ("landed", ...) or ("dropped", ...)."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.events: list[tuple[str, int, int]] = []

    def chunk_count(self, block: int) -> int:
        return self.store.chunk_count(block)

    def chunk_buffer(self, block: int, chunk: int) -> memoryview:
        self.events.append(("begun", block, chunk))
        return self.store.chunk_buffer(block, chunk)

    def chunk_progress(self, block: int, chunk: int, nbytes: int) -> None:
        self.store.chunk_progress(block, chunk, nbytes)

    def chunk_landed(self, block: int, chunk: int, peer: str) -> None:
        self.events.append(("landed", block, chunk))
        self.store.chunk_landed(block, chunk, peer)

    def chunk_dropped(self, block: int, chunk: int) -> None:
        self.events.append(("dropped", block, chunk))
        self.store.chunk_dropped(block, chunk)
