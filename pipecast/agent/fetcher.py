"""Fetching a node's assigned blocks (and the package's manifest and small files) from its peers.

Assignments are fetched in the plan's order with a bounded number in flight. Each is a unit: a whole block, or a
range of its chunks (:attr:`Fetch.chunks`), so that a block can come in parts from several parents; it is verified
once its last chunk is here, whichever unit brought it. A failed fetch resumes from the first chunk of its unit
still missing. A parent that fails is retried a bounded number of times with backoff (the first retry after a
closed connection at once), except one that sent a corrupt chunk, one silent (or below its minimum rate) for a
whole I/O timeout, or one where nothing listens any more (reached, then refusing a connection; one refusing before
it was ever reached may be starting up, as a static plan's agents started together): never retried; then the fetch
falls back to the given fallback peers (the sources of a static plan), or fails with a typed error naming every
peer tried so that a control plane can re-parent. A peer given up on is not asked for later units either.

The manifest and small files (tokenizer, config) come from the first peer that gives them; a failed connection
to a peer is retried as a parent's is (a static plan's seed may not listen yet), a bad answer or a silent peer is
not (a silent one is asked last for the files after). Small files are fetched in ranges that each hop serves as
soon as it has them, so a chain forwards them like blocks instead of each hop waiting for its parent's whole copy.

Whatever goes wrong with a peer's answer is that peer's failure, logged, reported and followed by the next
peer: a fetch never dies of a peer's bytes. A failure that is not a :class:`PeerError` already (a parser or
transport bug provoked by odd bytes) becomes one naming the peer (:func:`peer_failure`); only this node's
own errors (:class:`AgentError`, e.g. the store was dropped meanwhile) end a fetch. A unit's connection this node
lacks the resources for (:class:`LocalResourceError`) is tried again like a failed parent, without blaming
it, and ends the fetch only once the parent's retries are spent.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from control_plane.messages import PeerInfo
from control_plane.planner.plan import Fetch
from packager.errors import ManifestError
from packager.manifest import MANIFEST_FILE, manifest_from_json
from pipecast.agent.errors import (
    AgentError,
    CorruptChunkError,
    CorruptFileError,
    FetchFailedError,
    LocalResourceError,
    PeerClosedError,
    PeerConnectError,
    PeerConnectTimeoutError,
    PeerError,
    PeerNotListeningError,
    PeerProtocolError,
    PeerTimeoutError,
)
from pipecast.agent.ratelimit import format_rate
from pipecast.agent.store import BlockStore
from pipecast.agent.transport.base import Channel, Transport
from pipecast.core.settings import Settings
from pipecast.core.units import format_bytes
from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)
T = TypeVar("T")

# Parents fetched from at once. A unit binomial pipeline asks a different parent for each 2-chunk unit, and a
# request waits for its unit's first chunk to land at that parent: with requests out for the next units
# meanwhile, that wait overlaps the current unit (netns, demo model, binomial: N = 8 at 400 Mbit/s 1.32x S/B
# with 2, 1.16x with 4, 1.15x with 8; N = 16 at 200 Mbit/s 1.44x / 1.21x / 1.20x; 1.67x with 1). A
# single-parent plan (chain, tree, unicast) is unaffected: one unit at a time per parent. The defaults are the
# settings' (agent_fetch_*), so that the library and the agent's command agree.
DEFAULT_CONCURRENCY = Settings.model_fields["agent_fetch_concurrency"].default
DEFAULT_RETRIES = Settings.model_fields["agent_fetch_retries"].default
DEFAULT_BACKOFF_S = Settings.model_fields["agent_fetch_backoff_s"].default
# A small file moves in ranges this big: what a relay must hold before it passes the file on.
FILE_RANGE_BYTES = 256 << 10
#: The longest wait before a retry (s): the doubling backoff stops there (retries of 40 waited thousands of years).
MAX_RETRY_WAIT_S = 30.0


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


@dataclass
class _Tries:
    """One fetch's tries of its peers: how hard (``policy``), which failures are worth another try
    (``retryable``), whom to tell of each (``on_failure``), the peers connected to (``reached``: one of them
    refusing a connection now is gone, not starting up) and every failure so far (``attempts``)."""

    policy: FetchPolicy
    retryable: Callable[[PeerError], bool]
    on_failure: PeerFailureCallback | None
    reached: set[PeerInfo] = field(default_factory=set)
    attempts: list[tuple[str, Exception]] = field(default_factory=list)

    async def ask(self, peer: PeerInfo, what: str, request: Callable[[], Awaitable[T]],
                  reported: str | None = None) -> T:
        """What ``request`` (one try at ``what`` from ``peer``) returns, tried ``1 + policy.retries`` times with
        doubling backoff, at most :data:`MAX_RETRY_WAIT_S` a wait (the first retry after a closed connection at
        once: a live peer answers it, a dead one's host refuses it in a round trip, not after the backoff). Each
        failure is logged, kept in ``attempts`` and reported (as ``reported``, default ``what``); the last one is
        raised once the retries are spent, or the failure is not ``retryable``, or ``peer`` was reached and nothing
        listens there any more.

        A connection this node lacks the resources for (:class:`LocalResourceError`: out of file descriptors) is
        tried again the same way, unblamed, and raised once the retries are spent; this node's own failures are
        raised at once."""
        attempt = 0
        error: PeerError | None = None
        while True:
            if attempt and not (attempt == 1 and isinstance(error, PeerClosedError)):
                await asyncio.sleep(min(self.policy.backoff_s * 2.0 ** min(attempt - 1, 30), MAX_RETRY_WAIT_S))
            try:
                return await request()
            except LocalResourceError as exc:
                # This node's shortage may pass as other transfers end: the same peer again, unblamed, rather
                # than ending the fetch and the units under way with it.
                if attempt == self.policy.retries:
                    raise
                log.warning("%s from %s: %s; trying again", what, peer, exc)
            except Exception as exc:  # any failure on a peer's answer: retry, or the caller's next peer
                if _own_failure(exc):
                    raise
                error = peer_failure(peer, what, exc)
                self.attempts.append((str(peer), error))
                log.warning("%s: %s", what, error)
                if self.on_failure:
                    self.on_failure(reported or what, peer, error)
                if (attempt == self.policy.retries or not self.retryable(error)
                        or (isinstance(error, PeerNotListeningError) and peer in self.reached)):
                    raise error
            attempt += 1


def _failed_connection(error: PeerError) -> bool:
    """Whether ``error`` is worth asking the same peer for a manifest or file again: a connection that failed
    (the peer may be starting up, or was cut off), not a bad or refused answer, which would come again, nor a
    peer silent for a whole I/O timeout (hung: each try cost another timeout while this node's own children,
    asking it for the file, gave up on it and blamed it, as :func:`_worth_another_try` says of a parent)."""
    return isinstance(error, (PeerConnectError, PeerClosedError))


async def _over_channel(pool: ChannelPool, peer: PeerInfo, reached: set[PeerInfo],
                        ask: Callable[[Channel], Awaitable[T]]) -> T:
    """``ask`` on a pooled channel to ``peer`` (noted in ``reached``): released after, discarded if it fails."""
    channel = await pool.acquire(peer)
    reached.add(peer)
    try:
        answer = await ask(channel)
    except BaseException:
        await pool.discard(peer, channel)
        raise
    pool.release(peer, channel)
    return answer


async def _manifest_from(pool: ChannelPool, package_id: str, peer: PeerInfo, reached: set[PeerInfo]) -> Manifest:
    data = await _over_channel(pool, peer, reached, lambda channel: channel.fetch_file(package_id, MANIFEST_FILE))
    # In a thread: a large model's manifest (~10 MB) takes ~0.6 s to parse and check
    return await asyncio.to_thread(verified_manifest, data, package_id, peer)


async def _first_answer(tries: _Tries, peers: Sequence[PeerInfo], silent: set[PeerInfo], what: str,
                        request: Callable[[PeerInfo], Callable[[], Awaitable[T]]], reported: str,
                        failed: str) -> tuple[T, PeerInfo]:
    """What the first of ``peers`` (once each, those ``silent`` for a whole I/O timeout already last: a hung relay
    costs a timeout each time it is asked) gives for ``request(peer)`` (``what``, in the log), and that peer; one
    silent now joins ``silent``. Each failure is logged, reported (as ``reported``) and kept in ``tries.attempts``;
    :class:`FetchFailedError` names ``failed`` and them all once no peer is left."""
    distinct = list(dict.fromkeys(peers))
    for peer in [p for p in distinct if p not in silent] + [p for p in distinct if p in silent]:
        try:
            return await tries.ask(peer, what, request(peer), reported=reported), peer
        except PeerError as exc:  # the next peer
            if isinstance(exc, (PeerTimeoutError, PeerConnectTimeoutError)):  # hung: each ask costs a timeout
                silent.add(peer)
    raise FetchFailedError(failed, tries.attempts)


async def fetch_manifest(pool: ChannelPool, package_id: str, peers: Sequence[PeerInfo],
                         on_failure: PeerFailureCallback | None = None,
                         policy: FetchPolicy = FetchPolicy(),
                         silent: set[PeerInfo] | None = None) -> tuple[Manifest, PeerInfo]:
    """The manifest of ``package_id`` from the first of ``peers`` that gives a valid one.

    Valid means it parses, is consistent, and is the manifest whose digest is ``package_id`` (the id covers
    every field): a peer can neither substitute another package nor change one field of this one. Nothing
    else is kept of a peer's answer: an invalid one (:func:`verified_manifest`), or any other failure, is
    logged and reported (``on_failure``) and the next peer is asked; :class:`FetchFailedError` names every
    peer tried once none is left. A failed connection, or one this node lacks the resources for, is tried
    again as ``policy`` says (:meth:`_Tries.ask`). A peer silent for a whole I/O timeout is added to ``silent``
    (shared with :func:`fetch_files`: asked last there), and one in it already is asked last here.
    """
    tries = _Tries(policy, _failed_connection, on_failure)
    return await _first_answer(tries, peers, set() if silent is None else silent, f"manifest of {package_id[:12]}",
                               lambda peer: partial(_manifest_from, pool, package_id, peer, tries.reached),
                               MANIFEST_FILE, f"the manifest of package {package_id[:12]}")


async def _file_from(pool: ChannelPool, store: BlockStore, path: str, size: int, peer: PeerInfo,
                     reached: set[PeerInfo]) -> None:
    try:
        await _over_channel(pool, peer, reached, partial(_fetch_file_ranges, store=store, path=path, size=size,
                                                         peer=str(peer)))
    except Exception:  # a peer that fails mid-file leaves nothing behind (a cancelled fetch keeps its bytes)
        store.discard_partial_file(path)
        raise


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
                      on_failure: PeerFailureCallback | None = None, policy: FetchPolicy = FetchPolicy(),
                      silent: set[PeerInfo] | None = None) -> None:
    """Fetch the package's small files the store lacks, range by range, each file verified against the
    manifest once whole. A peer that fails mid-file leaves nothing behind: the next try starts over. A failed
    connection, or one this node lacks the resources for, is tried again as ``policy`` says
    (:meth:`_Tries.ask`); any other failure moves on to the next peer. A peer silent for a whole I/O timeout (on a
    file here, or in ``silent`` already: the manifest's fetch) is asked last for the files after."""
    sizes = {f.path: f.bytes for f in store.manifest.files}
    reached: set[PeerInfo] = set()
    silent = set() if silent is None else silent
    for path in store.missing_files():
        tries = _Tries(policy, _failed_connection, on_failure, reached)
        await _first_answer(tries, peers, silent, f"file {path}",
                            lambda peer: partial(_file_from, pool, store, path, sizes[path], peer, reached), path,
                            f"file {path}")


def describe_fetch(fetch: Fetch) -> str:
    """How logs and failure reports name ``fetch``: "block 3", or "block 3 chunks 5-9" for its chunks 5 .. 8
    (first-end as in :attr:`Fetch.chunks` and on the wire)."""
    if fetch.chunks is None:
        return f"block {fetch.block}"
    return f"block {fetch.block} chunks {fetch.chunks[0]}-{fetch.chunks[1]}"


class _Slots:
    """Up to ``limit`` fetches at once, handed to waiting fetches in plan order; the oldest unfinished
    fetch never waits for a slot.

    Why the exception: later fetches (from other parents) may hold every slot while they wait for chunks
    their parents have yet to fetch, and those parents may be waiting on this node's oldest fetch (in a
    ranged plan the receivers serve each other). Letting the oldest one run, one over the limit, keeps
    fetching as free of deadlocks as fetching strictly in plan order, which ``Plan.validate`` checks.
    """

    def __init__(self, limit: int, count: int) -> None:
        self.limit = limit
        self.running = 0
        self._finished = bytearray(count)
        self._oldest = 0  # the first fetch not finished
        self._waiting: dict[int, asyncio.Future] = {}

    async def acquire(self, index: int) -> None:
        """Wait until fetch ``index`` may run."""
        if self.running < self.limit or index == self._oldest:
            self.running += 1
            return
        granted = self._waiting[index] = asyncio.get_running_loop().create_future()
        try:
            await granted
        except asyncio.CancelledError:
            if self._waiting.pop(index, None) is None:  # granted as it was cancelled: hand the slot on
                self.running -= 1
                self._grant()
            raise

    def release(self, index: int) -> None:
        """Fetch ``index``, which held a slot, has ended."""
        self.running -= 1
        self._finished[index] = 1
        while self._oldest < len(self._finished) and self._finished[self._oldest]:
            self._oldest += 1
        self._grant()

    def _grant(self) -> None:
        for index in sorted(self._waiting):
            if self.running >= self.limit and index != self._oldest:
                return
            self.running += 1
            self._waiting.pop(index).set_result(None)


def _worth_another_try(error: PeerError) -> bool:
    """Whether a unit's parent that failed with ``error`` is worth another try: any but one that sent bad bytes or
    stayed silent (or too slow) for a whole I/O timeout. Each try of a hung parent cost another timeout, and its
    child reported it only after them all, while the child's own children, waiting on it, gave up on it at
    twice the timeout (the relay's serving bound) and blamed it: the whole subtree fetched around healthy nodes."""
    return not isinstance(error, (CorruptChunkError, PeerTimeoutError))


class Fetcher:
    """Fetches assigned blocks and chunk ranges into a store."""

    def __init__(self, store: BlockStore, pool: ChannelPool, policy: FetchPolicy = FetchPolicy(),
                 on_peer_failure: PeerFailureCallback | None = None) -> None:
        self.store = store
        self.pool = pool
        self.policy = policy
        self.on_peer_failure = on_peer_failure
        self.failed_peers: set[PeerInfo] = set()
        # Peers this fetch was connected to: one of them refusing a connection now is gone, not starting up.
        self.reached: set[PeerInfo] = set()

    async def fetch(self, fetches: Sequence[Fetch[PeerInfo]]) -> None:
        """Fetch every unit (a block, or a chunk range of one) from its parent, in order: one unit at a time
        per parent, and up to ``policy.concurrency`` parents at once (see :class:`_Slots`).

        One unit at a time from a parent makes blocks complete in order, each at the parent's full rate
        (an engine needs block 0 first); several parents at once use a receiver's spare ingress, and a
        block fetched in ranges from several parents is verified once its last chunk lands, whichever.
        Raises :class:`UnknownPackageError` before anything moves if a range does not fit the manifest,
        ``ValueError`` if two units overlap (a chunk is received once), and the first
        :class:`FetchFailedError` (the other fetches are cancelled).
        """
        self._check_units(fetches)
        slots = _Slots(self.policy.concurrency, len(fetches))
        per_parent: dict[PeerInfo, asyncio.Lock] = {}

        async def one(index: int, fetch: Fetch[PeerInfo]) -> None:
            # Locks are FIFO and tasks start in fetch order: each parent's units go in plan order.
            async with per_parent.setdefault(fetch.parent, asyncio.Lock()):
                await slots.acquire(index)
                try:
                    await self._fetch_unit(fetch)
                finally:
                    slots.release(index)

        tasks = [asyncio.create_task(one(i, f)) for i, f in enumerate(fetches)]
        prefaulting = asyncio.create_task(self._prefault(list(dict.fromkeys(f.block for f in fetches))))
        try:
            for next_done in asyncio.as_completed(tasks):
                await next_done
        finally:
            for task in [*tasks, prefaulting]:
                task.cancel()
            await asyncio.gather(*tasks, prefaulting, return_exceptions=True)

    def _check_units(self, fetches: Sequence[Fetch[PeerInfo]]) -> None:
        """Every unit's range fits its block, and no two units share a chunk: two fetches receiving one
        chunk at once would both write its buffer, the second after the first one's bytes were verified."""
        taken: dict[int, list[tuple[int, int, Fetch[PeerInfo]]]] = {}
        for fetch in fetches:
            first, end = self.store.chunk_range(fetch.block, fetch.chunks)
            for other_first, other_end, other in taken.setdefault(fetch.block, []):
                if first < other_end and other_first < end:
                    raise ValueError(f"{describe_fetch(fetch)} from {fetch.parent} overlaps "
                                     f"{describe_fetch(other)} from {other.parent}")
            taken[fetch.block].append((first, end, fetch))

    async def _prefault(self, blocks: list[int]) -> None:
        """Map the blocks' memory in fetch order, off the event loop, ahead of their bytes (once a block)."""
        for block in blocks:
            await asyncio.to_thread(self.store.prefault, block)

    async def _fetch_unit(self, fetch: Fetch[PeerInfo]) -> None:
        what = describe_fetch(fetch)
        tries = _Tries(self.policy, _worth_another_try, self.on_peer_failure, self.reached)
        parent = fetch.parent
        peers = [parent, *(p for p in self.policy.fallbacks if p != parent)]
        for n, peer in enumerate(peers):
            if peer in self.failed_peers:
                continue
            if n:
                log.warning("%s: parent %s failed; falling back to source %s", what, parent, peer)
            try:
                return await tries.ask(peer, what, partial(self._fetch_from, fetch, peer, what))
            except PeerError:  # logged, reported and kept in tries.attempts
                # Given up on this peer: later units go straight to the next one instead of waiting again.
                self.failed_peers.add(peer)
        attempts = tries.attempts
        given_up = tuple(str(p) for p in peers if p in self.failed_peers and str(p) not in dict(attempts))
        raise FetchFailedError(what, attempts, given_up)

    async def _fetch_from(self, fetch: Fetch[PeerInfo], peer: PeerInfo, what: str) -> None:
        """Receive the chunks of ``fetch`` still missing from ``peer``: from the first missing one, in runs
        that stop short of chunks already here (a resumed or re-planned fetch)."""
        block = fetch.block
        first, end = self.store.chunk_range(block, fetch.chunks)
        run = self.store.missing_run(block, first, end)
        if run is None:
            return
        resumed_at = run[0] if run[0] > first else None
        channel = await self.pool.acquire(peer)
        self.reached.add(peer)
        start = time.perf_counter()
        meta = self.store.manifest.blocks[block]
        nbytes = 0
        try:
            while run is not None:
                await channel.fetch_block(self.store.package_id, block, run[0], self.store, run[1])
                nbytes += min(run[1] * meta.chunk_bytes, meta.bytes) - run[0] * meta.chunk_bytes
                run = self.store.missing_run(block, first, end)
        except BaseException:
            await self.pool.discard(peer, channel)
            raise
        self.pool.release(peer, channel)
        seconds = time.perf_counter() - start
        log.info("%s from %s: %s in %.3f s (%s)%s", what, peer, format_bytes(nbytes), seconds,
                 format_rate(nbytes / seconds) if seconds else "-",
                 f", resumed at chunk {resumed_at}" if resumed_at is not None else "")
