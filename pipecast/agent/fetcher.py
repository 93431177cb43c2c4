"""Fetching a node's assigned blocks (and the package's manifest and small files) from its peers.

Assignments are fetched in the plan's order with a bounded number in flight. A failed fetch resumes
from the block's first missing chunk. A parent that fails is retried a bounded number of times with
backoff, except one that sent a corrupt chunk (never retried); then the fetch falls back to the given
fallback peers (the sources of a static plan), or fails with a typed error naming every peer tried so
that a control plane can re-parent. A peer given up on is not asked for later blocks either.

Small files (tokenizer, config) are fetched in ranges that each hop serves as soon as it has them, so a
chain forwards them like blocks instead of each hop waiting for its parent's whole copy.

Whatever goes wrong with a peer's answer is that peer's failure, logged, reported and followed by the next
peer: a fetch never dies of a peer's bytes. A failure that is not a :class:`PeerError` already (a parser or
transport bug provoked by odd bytes) becomes one naming the peer (:func:`peer_failure`); only this node's
own errors (:class:`AgentError`, e.g. the store was dropped meanwhile) end a fetch.
"""

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from control_plane.messages import PeerInfo
from control_plane.planner.plan import Fetch
from packager.errors import ManifestError
from packager.manifest import MANIFEST_FILE, manifest_from_json
from pipecast.agent.errors import (
    AgentError,
    CorruptChunkError,
    CorruptFileError,
    FetchFailedError,
    PeerError,
    PeerProtocolError,
)
from pipecast.agent.ratelimit import format_rate
from pipecast.agent.store import BlockStore
from pipecast.agent.transport.base import Channel, Transport
from pipecast.core.units import format_bytes
from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 2
DEFAULT_RETRIES = 2
DEFAULT_BACKOFF_S = 0.2
# A small file moves in ranges this big: what a relay must hold before it passes the file on.
FILE_RANGE_BYTES = 256 << 10


@dataclass(frozen=True)
class FetchPolicy:
    """How hard to try: parents fetched from at once, retries per peer, first backoff (doubling),
    fallback peers."""

    concurrency: int = DEFAULT_CONCURRENCY
    retries: int = DEFAULT_RETRIES
    backoff_s: float = DEFAULT_BACKOFF_S
    fallbacks: tuple[PeerInfo, ...] = ()


PeerFailureCallback = Callable[[str, PeerInfo, Exception], None]


def peer_failure(peer: PeerInfo, what: str, error: Exception) -> PeerError:
    """``error``, raised while fetching ``what`` from ``peer``, as the :class:`PeerError` naming ``peer``: itself
    if it is one, else a :class:`PeerProtocolError` (logged with its traceback: it is a bug somewhere that
    this peer's answer provoked, and the fetch goes on with the next peer)."""
    if isinstance(error, PeerError):
        return error
    log.warning("%s from %s: unexpected %s", what, peer, type(error).__name__, exc_info=error)
    text = f"{type(error).__name__}: {error}"
    return PeerProtocolError(str(peer), f"failed unexpectedly on {what} "
                                        f"({text if len(text) <= 300 else text[:300] + '...'})")


def _own_failure(error: Exception) -> bool:
    """Whether ``error`` is this node's own failure (e.g. its store was dropped, its memory budget is spent),
    which no other peer can help with: then a fetch ends instead of blaming the peer."""
    return isinstance(error, AgentError) and not isinstance(error, PeerError)


def verified_manifest(data: bytes, package_id: str, peer: PeerInfo) -> Manifest:
    """The manifest of ``package_id`` in ``data``, as ``peer`` sent it; :class:`CorruptFileError` naming ``peer``
    if it is not exactly that manifest (it does not parse, is inconsistent, or its digest, which covers every
    field, is not ``package_id``). The sender is at fault: a relay verifies a manifest before serving it."""
    try:
        manifest = manifest_from_json(data, where=f"manifest from {peer}")
    except ManifestError as exc:
        raise CorruptFileError(str(peer), f"sent an invalid manifest: {exc.problem}") from None
    except Exception as exc:  # manifest_from_json raises nothing else; if it ever does, the bytes were bad still
        raise CorruptFileError(str(peer), f"sent a manifest that cannot be parsed ({type(exc).__name__})") from exc
    if manifest.package_id != package_id:
        raise CorruptFileError(str(peer), f"sent the manifest of package {manifest.package_id[:12]}, "
                                          f"not {package_id[:12]}")
    return manifest


class ChannelPool:
    """Open channels per peer, reused between requests; one request per channel at a time."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._idle: dict[PeerInfo, list[Channel]] = {}
        self._busy: set[Channel] = set()

    async def acquire(self, peer: PeerInfo) -> Channel:
        """An idle channel to ``peer``, or a new one (raises ``PeerConnectError`` within the deadline)."""
        idle = self._idle.get(peer)
        channel = idle.pop() if idle else await self.transport.connect(peer.address, str(peer))
        self._busy.add(channel)
        return channel

    def release(self, peer: PeerInfo, channel: Channel) -> None:
        """Give back a channel whose request ended well."""
        self._busy.discard(channel)
        self._idle.setdefault(peer, []).append(channel)

    async def discard(self, peer: PeerInfo, channel: Channel) -> None:
        """Close a channel whose request failed, and ``peer``'s idle ones: a peer that failed one request
        (died, closed, stalled) has likely broken the others too, and a fresh connection says so at once."""
        self._busy.discard(channel)
        for suspect in [channel, *self._idle.pop(peer, [])]:
            await suspect.close()

    async def close(self) -> None:
        """Close every channel."""
        channels = [*self._busy, *(c for cs in self._idle.values() for c in cs)]
        self._busy.clear()
        self._idle.clear()
        for channel in channels:
            await channel.close()


async def fetch_manifest(pool: ChannelPool, package_id: str, peers: Sequence[PeerInfo],
                         on_failure: PeerFailureCallback | None = None) -> tuple[Manifest, PeerInfo]:
    """The manifest of ``package_id`` from the first of ``peers`` that gives a valid one.

    Valid means it parses, is consistent, and is the manifest whose digest is ``package_id`` (the id covers
    every field): a peer can neither substitute another package nor change one field of this one. Nothing
    else is kept of a peer's answer: an invalid one (:func:`verified_manifest`), or any other failure, is
    logged and reported (``on_failure``) and the next peer is asked; :class:`FetchFailedError` names every
    peer tried once none is left.
    """
    attempts: list[tuple[str, Exception]] = []
    for peer in dict.fromkeys(peers):
        channel = None
        try:
            channel = await pool.acquire(peer)
            data = await channel.fetch_file(package_id, MANIFEST_FILE)
            pool.release(peer, channel)
            channel = None
            return verified_manifest(data, package_id, peer), peer
        except Exception as exc:  # any failure on a peer's answer moves on to the next peer
            if channel is not None:
                await pool.discard(peer, channel)
            if _own_failure(exc):
                raise
            error = peer_failure(peer, MANIFEST_FILE, exc)
        log.warning("manifest of %s: %s", package_id[:12], error)
        attempts.append((str(peer), error))
        if on_failure:
            on_failure(MANIFEST_FILE, peer, error)
    raise FetchFailedError(f"the manifest of package {package_id[:12]}", attempts)


async def _fetch_file_ranges(channel: Channel, store: BlockStore, path: str, size: int, peer: str) -> None:
    offset = store.file_received(path)  # a fetch cancelled mid-file (a new plan) left these bytes
    while True:
        length = min(FILE_RANGE_BYTES, size - offset)
        data = await channel.fetch_file(store.package_id, path, offset, length) if length else b""
        if len(data) != length:
            raise PeerProtocolError(peer, f"sent {len(data)} bytes for {length} of file {path} at {offset}")
        store.file_range_landed(path, offset, data, peer)  # the last range checks the whole file
        offset += length
        if offset == size:
            return


async def fetch_files(pool: ChannelPool, store: BlockStore, peers: Sequence[PeerInfo],
                      on_failure: PeerFailureCallback | None = None) -> None:
    """Fetch the package's small files the store lacks, range by range, each file verified against the
    manifest once whole. A peer that fails mid-file leaves nothing behind: the next one starts over."""
    sizes = {f.path: f.bytes for f in store.manifest.files}
    for path in store.missing_files():
        attempts: list[tuple[str, Exception]] = []
        for peer in dict.fromkeys(peers):
            channel = None
            try:
                channel = await pool.acquire(peer)
                await _fetch_file_ranges(channel, store, path, sizes[path], str(peer))
                pool.release(peer, channel)
                channel = None
                break
            except Exception as exc:  # any failure on a peer's answer moves on to the next peer
                store.discard_partial_file(path)
                if channel is not None:
                    await pool.discard(peer, channel)
                if _own_failure(exc):
                    raise
                error = peer_failure(peer, f"file {path}", exc)
            log.warning("file %s: %s", path, error)
            attempts.append((str(peer), error))
            if on_failure:
                on_failure(path, peer, error)
        else:
            raise FetchFailedError(f"file {path}", attempts)


class Fetcher:
    """Fetches assigned blocks into a store."""

    def __init__(self, store: BlockStore, pool: ChannelPool, policy: FetchPolicy = FetchPolicy(),
                 on_peer_failure: PeerFailureCallback | None = None) -> None:
        self.store = store
        self.pool = pool
        self.policy = policy
        self.on_peer_failure = on_peer_failure
        self.failed_peers: set[PeerInfo] = set()

    async def fetch(self, fetches: Sequence[Fetch[PeerInfo]]) -> None:
        """Fetch every block from its parent, in order: one block at a time per parent, and up to
        ``policy.concurrency`` parents at once.

        One block at a time from a parent makes blocks complete in order, each at the parent's full rate
        (an engine needs block 0 first); several parents at once use a receiver's spare ingress.
        Raises the first :class:`FetchFailedError` (the other fetches are cancelled).
        """
        gate = asyncio.Semaphore(self.policy.concurrency)
        per_parent: dict[PeerInfo, asyncio.Lock] = {}

        async def one(block: int, parent: PeerInfo) -> None:
            # Locks and the semaphore are FIFO and tasks start in fetch order: order is kept.
            async with per_parent.setdefault(parent, asyncio.Lock()), gate:
                await self._fetch_block(block, parent)

        tasks = [asyncio.create_task(one(f.block, f.parent)) for f in fetches]
        prefaulting = asyncio.create_task(self._prefault([f.block for f in fetches]))
        try:
            for next_done in asyncio.as_completed(tasks):
                await next_done
        finally:
            for task in [*tasks, prefaulting]:
                task.cancel()
            await asyncio.gather(*tasks, prefaulting, return_exceptions=True)

    async def _prefault(self, blocks: list[int]) -> None:
        """Map the blocks' memory in fetch order, off the event loop, ahead of their bytes."""
        for block in blocks:
            await asyncio.to_thread(self.store.prefault, block)

    async def _fetch_block(self, block: int, parent: PeerInfo) -> None:
        attempts: list[tuple[str, Exception]] = []
        peers = [parent, *(p for p in self.policy.fallbacks if p != parent)]
        for n, peer in enumerate(peers):
            if peer in self.failed_peers:
                continue
            if n:
                log.warning("block %d: parent %s failed; falling back to source %s", block, parent, peer)
            for attempt in range(1 + self.policy.retries):
                if attempt:
                    await asyncio.sleep(self.policy.backoff_s * 2 ** (attempt - 1))
                try:
                    await self._fetch_from(block, peer)
                    return
                except Exception as exc:  # any failure on a peer's answer: retry, or the next peer
                    if _own_failure(exc):
                        raise
                    error = peer_failure(peer, f"block {block}", exc)
                attempts.append((str(peer), error))
                log.warning("block %d: %s", block, error)
                if self.on_peer_failure:
                    self.on_peer_failure(f"block {block}", peer, error)
                if isinstance(error, CorruptChunkError):
                    break  # a peer that sent bad bytes is not asked again
            # Given up on this peer: later blocks go straight to the next one instead of waiting again.
            self.failed_peers.add(peer)
        given_up = tuple(str(p) for p in peers if p in self.failed_peers and str(p) not in dict(attempts))
        raise FetchFailedError(f"block {block}", attempts, given_up)

    async def _fetch_from(self, block: int, peer: PeerInfo) -> None:
        first = self.store.first_missing_chunk(block)
        if first is None:
            return
        channel = await self.pool.acquire(peer)
        start = time.perf_counter()
        try:
            await channel.fetch_block(self.store.package_id, block, first, self.store)
        except BaseException:
            await self.pool.discard(peer, channel)
            raise
        self.pool.release(peer, channel)
        seconds = time.perf_counter() - start
        meta = self.store.manifest.blocks[block]
        nbytes = meta.bytes - first * meta.chunk_bytes
        log.info("block %d from %s: %s in %.3f s (%s)%s", block, peer, format_bytes(nbytes), seconds,
                 format_rate(nbytes / seconds) if seconds else "-", f", resumed at chunk {first}" if first else "")
