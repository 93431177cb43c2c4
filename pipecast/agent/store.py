"""The block store: one package's blocks in memory, chunk by chunk, verified before anything sees them.

Each block has one buffer sized from the manifest. Transports receive straight into a chunk's slice of
that buffer (:meth:`BlockStore.chunk_buffer`) and then report it (:meth:`BlockStore.chunk_landed`): the
chunk is hashed against its manifest digest and only then counts as present, so a local engine can never
read an unverified byte. A peer served from this store gets a chunk still arriving as its bytes land
(:meth:`BlockStore.relay_chunk`, so that each hop of a chain adds a piece's time, not a chunk's) but its
last byte only once the chunk is verified: a receiver never holds a whole chunk that its parent did not
verify, and a relay whose receive ends unverified abandons what it relayed of it (its answer starts the
chunk again, :func:`~pipecast.agent.transport.wire.answer_request`). A block is verified when all
its chunks are, whichever fetches landed them (the whole block from one peer, or chunk ranges from
several): the manifest is validated on open, and its package id is the digest of the whole manifest
(every chunk digest, size and file name in it), so the chunk digests are as trustworthy as the package id
and one hash pass over the bytes suffices.

The store is used from one asyncio event loop: marking is synchronous, waiting is awaitable.
"""

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from packager.digest import digest_bytes
from packager.errors import PackageFileError
from packager.manifest import manifest_to_json, validate_manifest
from pipecast.agent.budget import MemoryBudget, Reservation
from pipecast.agent.buffers import BlockBuffer, BufferAllocator
from pipecast.agent.errors import (
    CorruptChunkError,
    CorruptFileError,
    DroppedHereError,
    LocalPackageError,
    OpenCancelledError,
    RelayBrokenError,
    UnknownPackageError,
)
from pipecast.agent.local_package import LocalPackage
from pipecast.v1.manifest_pb2 import Block, Manifest, PackageFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreEvent:
    """Something that happened to a block: its first verified chunk, a longer verified prefix (every chunk
    from its start verified, without a gap), or its verification."""

    kind: Literal["block_started", "prefix_verified", "block_verified"]
    block: int
    peer: str
    at: float  # time.time(): comparable across the processes of one host


@dataclass(frozen=True)
class BlockProgress:
    """State of one block."""

    index: int
    chunks_present: int
    chunks_total: int
    started_at: float | None
    verified_at: float | None


@dataclass(frozen=True)
class StoreProgress:
    """State of the whole package."""

    package_id: str
    blocks_verified: int
    blocks_total: int
    bytes_present: int
    bytes_total: int
    blocks: tuple[BlockProgress, ...]

    @property
    def complete(self) -> bool:
        return self.blocks_verified == self.blocks_total

    @property
    def elapsed_s(self) -> float | None:
        """From the first verified chunk to the last verified block, once complete (else None)."""
        if not self.complete or not self.blocks:
            return None
        return max(b.verified_at for b in self.blocks) - min(b.started_at for b in self.blocks)


class _BlockState:
    """Buffer, chunk bitmap and waiters of one block."""

    def __init__(self, meta: Block, buffer: BlockBuffer) -> None:
        self.meta = meta
        self.buffer = buffer
        self.readonly = buffer.view.toreadonly()
        self.count = len(meta.chunk_digests)
        self.present = bytearray(self.count)
        self.n_present = 0
        self.bytes_present = 0
        self.prefix_chunks = 0  # chunks verified from the block's start without a gap
        self.chunk_waiters: dict[int, list[asyncio.Future]] = {}  # woken as a chunk lands, and as its bytes do
        self.block_waiters: list[asyncio.Future] = []
        self.arriving: dict[int, int] = {}  # chunk -> bytes of it landed so far (a receive in progress, unverified)
        self.receives: dict[int, int] = {}  # chunk -> receives of it begun: a relay checks it still follows its own
        self.started_at: float | None = None
        self.verified_at: float | None = None
        self.dropped: str | None = None  # why every wait on the block fails, once its package is dropped

    def bounds(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.meta.chunk_bytes
        return start, min(start + self.meta.chunk_bytes, self.meta.bytes)

    def wait_on(self, waiters: list[asyncio.Future]) -> asyncio.Future:
        """A new future in ``waiters``, woken when what it waits for changes; :class:`UnknownPackageError`
        once the package is dropped (a wait that begins after the drop too)."""
        if self.dropped is not None:
            raise DroppedHereError(self.dropped)
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        return fut

    def drop(self, reason: str) -> None:
        """Fail every wait on the block with :class:`UnknownPackageError` (``reason``)."""
        # Failed, not cancelled: a task serving a peer answers an ERROR (or ends the connection) and the peer
        # learns at once; cancelled, it ended silently and left the peer to its I/O timeout.
        self.dropped = reason
        _fail([*self.block_waiters, *(f for fs in self.chunk_waiters.values() for f in fs)], reason)
        self.block_waiters.clear()
        self.chunk_waiters.clear()

    def free(self) -> None:
        """Release the memory; unmapping runs without the GIL, so a worker thread may do it."""
        # Each step on its own: a view still held (an engine's tensors, a write to the disk cache in a thread)
        # keeps the mapping, which goes with its last view, but the buffer's descriptor closes all the same
        # (with one try, a held view left the memfd, and so its memory, open for good).
        try:
            self.readonly.release()
        except BufferError:
            log.debug("block %d is still read: its view goes when the reader is done", self.meta.index)
        try:
            self.buffer.close()
        except BufferError:
            log.debug("block %d is still in use; its memory goes when the last view does", self.meta.index)


class LandingChunk:
    """One chunk's bytes for a peer as they land here (from :meth:`BlockStore.relay_chunk`; a
    :class:`~pipecast.agent.transport.base.ChunkRelay`).

    :meth:`next` gives the bytes after those it gave before: of a chunk present, the rest of it; of one being
    received, what has landed of it, all but its last byte, which waits for the chunk's verification. If the
    receive it passed bytes of ends unverified (corrupt, or its sender failed mid-chunk), or another receive of
    the chunk began meanwhile, those bytes are abandoned: :class:`RelayBrokenError`, and the peer's answer must
    drop them (a ``RESTART``, or the answer's end; the peer verifies the chunk itself, so it never keeps them).
    """

    def __init__(self, state: _BlockState, chunk: int) -> None:
        self._state = state
        self.chunk = chunk
        self._start, self._end = state.bounds(chunk)
        self.length = self._end - self._start
        self.sent = 0
        self._receive: int | None = None  # the receive whose bytes it passed on, while the chunk is unverified

    @property
    def done(self) -> bool:
        """Whether every byte of the chunk was given."""
        return self.sent == self.length

    async def next(self) -> memoryview:
        """The next bytes of the chunk (at least one), once here; no deadline: the caller's serving one."""
        state, chunk = self._state, self.chunk
        while True:
            if self.sent and state.receives.get(chunk) != self._receive:
                raise RelayBrokenError(state.meta.index, chunk, "another receive of it began")
            if state.present[chunk]:
                return self._give(self.length)
            landed = state.arriving.get(chunk)
            if landed is None and self.sent:
                raise RelayBrokenError(state.meta.index, chunk, "its receive ended unverified")
            if landed is not None and min(landed, self.length - 1) > self.sent:
                self._receive = state.receives[chunk]
                return self._give(min(landed, self.length - 1))  # the last byte waits for the verification
            await state.wait_on(state.chunk_waiters.setdefault(chunk, []))

    def _give(self, upto: int) -> memoryview:
        if self._state.dropped is not None:  # its buffer may be freed already (a worker thread frees it)
            raise DroppedHereError(self._state.dropped)
        view = self._state.readonly[self._start + self.sent:self._start + upto]
        self.sent = upto
        return view


def _wake(waiters: list[asyncio.Future]) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_result(None)


def _reason(error: Exception) -> str:
    """The system's words for ``error`` (an ``OSError``'s strerror), else its text."""
    return (error.strerror if isinstance(error, OSError) else None) or str(error)


def _fail(waiters: list[asyncio.Future], reason: str) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_exception(DroppedHereError(reason))


class BlockStore:
    """The blocks of one package held by this node. Build it with :meth:`open`."""

    def __init__(self, manifest: Manifest, manifest_origin: str) -> None:
        self.manifest = manifest
        self.package_id = manifest.package_id
        self.manifest_origin = manifest_origin
        self.files: dict[str, bytes] = {}
        self._partial_files: dict[str, bytearray] = {}  # files being received, not verified yet
        self._file_entries = {f.path: f for f in manifest.files}
        self._blocks: list[_BlockState] = []
        self._reservation: Reservation | None = None
        self._listeners: list[Callable[[StoreEvent], None]] = []
        self._file_waiters: dict[str, list[asyncio.Future]] = {}
        self._dropped: str | None = None  # why the store is closed, once it is

    @functools.cached_property
    def manifest_json(self) -> bytes:
        """The manifest as peers fetch it (its JSON), made once: ~0.1 s for a manifest of 10 MB."""
        return manifest_to_json(self.manifest).encode()

    @classmethod
    def open(cls, manifest: Manifest, *, allocator: BufferAllocator, budget: MemoryBudget,
             local: LocalPackage | None = None, require_complete: bool = False,
             manifest_origin: str = "", cancel: threading.Event | None = None) -> "BlockStore":
        """A store for ``manifest``: blocks found in ``local`` are mapped and verified, the rest allocated.

        Local blocks are re-hashed on open (no trusted marker: a torn or rotten file is caught here and
        fetched again). Blocks mapped from files cost no budget (they are page cache); allocated blocks
        are reserved against ``budget`` up front, or :class:`MemoryBudgetError` is raised. With
        ``require_complete`` (a seed) a missing or corrupt local block raises :class:`LocalPackageError`.
        An inconsistent manifest (e.g. one whose digest is not its package id) raises
        :class:`packager.errors.ManifestError` naming ``manifest_origin``. Once ``cancel`` is set (from another
        thread) the verifying stops at the next chunk with :class:`OpenCancelledError`, what was opened closed.
        """
        validate_manifest(manifest, manifest_origin or "manifest")
        store = cls(manifest, manifest_origin or (local.description if local else ""))
        try:
            if local is not None:
                store._load_local(local, require_complete, cancel)
            held = {s.meta.index for s in store._blocks}
            missing = [b for b in manifest.blocks if b.index not in held]
            need = sum(b.bytes for b in missing)
            if need:
                store._reservation = budget.reserve(
                    need, f"package {manifest.package_id[:12]} ({len(missing)} blocks to receive)")
            for meta in missing:
                buffer = allocator.allocate(f"pipecast-{manifest.package_id[:12]}-block-{meta.index}",
                                            meta.bytes)
                store._blocks.append(_BlockState(meta, buffer))
            store._blocks.sort(key=lambda s: s.meta.index)
        except BaseException:
            store.close()
            raise
        return store

    def _load_local(self, local: LocalPackage, require_complete: bool, cancel: threading.Event | None = None) -> None:
        """Map and verify every block and file ``local`` has; keep the good ones. One that is there but cannot be
        read (no permission, an I/O error, a folder under its name) counts as missing: fetched again, or, with
        ``require_complete``, a :class:`LocalPackageError`."""
        for meta in self.manifest.blocks:
            if not local.has_block(meta.index):
                if require_complete:
                    raise LocalPackageError(f"{local.description}: block {meta.index} ({meta.file}) is "
                                             "missing or has the wrong size")
                continue
            try:
                buffer = local.open_block(meta.index)
            except (OSError, ValueError) as exc:  # ValueError: mmap of a file that shrank since it was sized
                problem = f"{local.description}: block {meta.index} ({meta.file}) cannot be read: {_reason(exc)}"
                if require_complete:
                    raise LocalPackageError(problem) from exc
                log.warning("%s; fetching it again", problem)
                continue
            state = _BlockState(meta, buffer)
            try:
                for chunk in range(state.count):
                    if cancel is not None and cancel.is_set():  # a chunk at a time: a large seed takes minutes
                        raise OpenCancelledError(f"{local.description}: opening package "
                                                 f"{self.manifest.package_id[:12]} called off")
                    self._land(state, chunk, local.description)
            except OpenCancelledError:
                state.free()  # not in the store yet: its close would not free it
                raise
            except CorruptChunkError as exc:
                state.free()  # no waiters yet: it was never in the store
                if require_complete:
                    raise LocalPackageError(f"{local.description}: block {meta.index} ({meta.file}) does "
                                             f"not match the manifest: {exc}") from exc
                log.warning("%s: block %d does not match the manifest (%s); fetching it again",
                            local.description, meta.index, exc)
                continue
            self._blocks.append(state)
        for entry in self.manifest.files:
            try:
                data = local.read_file(entry.path)
            except (OSError, PackageFileError) as exc:  # the latter: not a regular file, or of another size
                problem = f"{local.description}: file {entry.path} cannot be read: {_reason(exc)}"
                if require_complete:
                    raise LocalPackageError(problem) from exc
                log.warning("%s; fetching it again", problem)
                continue
            try:
                if data is None:
                    raise LocalPackageError(f"{local.description}: file {entry.path} is missing")
                self.add_file(entry.path, data, local.description)
            except (LocalPackageError, CorruptFileError) as exc:
                if require_complete:
                    raise LocalPackageError(str(exc)) from exc
                log.warning("%s; fetching it again", exc)

    # -- receiving ---------------------------------------------------------------------------------------

    def chunk_count(self, block: int) -> int:
        """Number of chunks of ``block``."""
        return self._state(block).count

    def chunk_buffer(self, block: int, chunk: int) -> memoryview:
        """The writable slice of ``block``'s buffer where ``chunk`` must be received (not yet present)."""
        state = self._state(block)
        if state.present[chunk]:
            raise ValueError(f"chunk {chunk} of block {block} is already present")
        start, end = state.bounds(chunk)
        earlier = state.receives.get(chunk, 0)
        state.receives[chunk] = earlier + 1
        state.arriving[chunk] = 0
        if earlier:  # a relay of an earlier receive of it must give up (the first receive wakes no one: per chunk)
            _wake(state.chunk_waiters.pop(chunk, []))
        return state.buffer.view[start:end]

    def chunk_progress(self, block: int, chunk: int, nbytes: int) -> None:
        """The first ``nbytes`` of ``chunk`` (being received into :meth:`chunk_buffer`) have landed, not yet
        verified: relays of the chunk may pass them on (all but its last byte)."""
        state = self._blocks[block] if 0 <= block < len(self._blocks) else None  # none once closed
        if state is not None and chunk in state.arriving:
            state.arriving[chunk] = nbytes
            _wake(state.chunk_waiters.pop(chunk, []))

    def chunk_dropped(self, block: int, chunk: int) -> None:
        """The receive of ``chunk`` in progress ended before the chunk was whole (the sender failed): what
        relays passed on of it is abandoned, and they give up."""
        state = self._blocks[block] if 0 <= block < len(self._blocks) else None  # none once closed
        if state is not None and state.arriving.pop(chunk, None) is not None:
            _wake(state.chunk_waiters.pop(chunk, []))

    def prefault(self, block: int) -> None:
        """Map ``block``'s memory ahead of receiving it (blocking, GIL-free: run it in a worker thread)."""
        state = self._state(block)
        if state.verified_at is None:
            state.buffer.prefault()

    def populated(self, block: int) -> bool:
        """Whether ``block``'s memory is all there (verified, or populated by :meth:`prefault`)."""
        state = self._state(block)
        return state.verified_at is not None or state.buffer.populated

    def chunk_landed(self, block: int, chunk: int, peer: str) -> None:
        """``chunk`` of ``block`` has been written into its buffer by ``peer``: verify it, then publish it.

        Raises :class:`CorruptChunkError` naming ``peer`` (the chunk stays missing).
        """
        state = self._state(block)
        if state.present[chunk]:
            raise ValueError(f"chunk {chunk} of block {block} is already present")
        self._land(state, chunk, peer)

    def _land(self, state: _BlockState, chunk: int, peer: str) -> None:
        start, end = state.bounds(chunk)
        view = state.buffer.view
        state.arriving.pop(chunk, None)
        if digest_bytes(view[start:end]) != state.meta.chunk_digests[chunk]:
            _wake(state.chunk_waiters.pop(chunk, []))  # relays of the corrupt bytes give up
            raise CorruptChunkError(peer, state.meta.index, chunk)
        state.present[chunk] = 1
        state.n_present += 1
        prefix_chunks = state.prefix_chunks
        while state.prefix_chunks < state.count and state.present[state.prefix_chunks]:
            state.prefix_chunks += 1
        state.bytes_present += end - start
        now = time.time()
        started, verified = state.started_at is None, state.n_present == state.count
        if started:
            state.started_at = now
        # Waiters before listeners: the chunk is present, and its waiters woken, whatever a listener does.
        _wake(state.chunk_waiters.pop(chunk, []))
        if verified:
            state.verified_at = now
            _wake(state.block_waiters)
            state.block_waiters.clear()
        if started:
            self._emit(StoreEvent("block_started", state.meta.index, peer, now))
        if verified:
            self._emit(StoreEvent("block_verified", state.meta.index, peer, now))
        elif state.prefix_chunks > prefix_chunks:
            self._emit(StoreEvent("prefix_verified", state.meta.index, peer, now))

    def add_file(self, path: str, data: bytes, peer: str) -> None:
        """Keep a small package file after checking it against the manifest; ``peer`` is who sent it."""
        entry = self._file_entries.get(path)
        if entry is None:
            raise CorruptFileError(peer, f"sent file {path!r}, which the manifest does not list")
        self._partial_files.pop(path, None)
        if len(data) != entry.bytes or digest_bytes(data) != entry.digest:
            _wake(self._file_waiters.pop(path, []))  # range waiters see the partial copy gone
            raise CorruptFileError(peer, f"sent file {path!r} whose size or digest differs from the manifest")
        self.files[path] = data
        _wake(self._file_waiters.pop(path, []))

    def file_range_landed(self, path: str, offset: int, data: bytes, peer: str) -> None:
        """Append ``data``, sent by ``peer``, to the file being received (``offset`` is where it ends so
        far). Its bytes can be served at once (:meth:`wait_file_range`); once whole it is checked against the
        manifest (:meth:`add_file`: a mismatch raises :class:`CorruptFileError` and drops the copy)."""
        entry = self._file_entries.get(path)
        if entry is None:
            raise CorruptFileError(peer, f"sent file {path!r}, which the manifest does not list")
        partial = self._partial_files.setdefault(path, bytearray())
        if offset != len(partial) or offset + len(data) > entry.bytes:
            raise ValueError(f"file {path!r}: {len(data)} bytes at {offset}, but {len(partial)} of "
                             f"{entry.bytes} are here")
        partial += data
        if len(partial) == entry.bytes:
            self.add_file(path, bytes(partial), peer)
        else:
            _wake(self._file_waiters.pop(path, []))

    def file_received(self, path: str) -> int:
        """Bytes of ``path`` here so far (verified or not)."""
        return len(self.files[path]) if path in self.files else len(self._partial_files.get(path, b""))

    def discard_partial_file(self, path: str) -> None:
        """Forget the unverified bytes of ``path`` (its sender failed): the next sender starts over."""
        if self._partial_files.pop(path, None) is not None:
            _wake(self._file_waiters.pop(path, []))

    async def wait_file(self, path: str) -> bytes:
        """A small package file, once held and verified (no deadline: the caller's); unknown paths are
        refused."""
        self._check_file(path)
        while path not in self.files:
            await self._file_progress(path)
        return self.files[path]

    async def wait_file_range(self, path: str, offset: int, length: int) -> bytes:
        """Bytes ``offset .. offset + length`` of a small package file as soon as they are here, verified
        with the whole file or not yet (a relay forwards a file as it arrives; every receiver checks the
        whole file against the manifest). No deadline: the caller's."""
        size = self._check_file(path).bytes
        if offset < 0 or length < 0 or offset + length > size:
            raise UnknownPackageError(f"file {path!r} of package {self.package_id[:12]} has {size} bytes: "
                                      f"no range of {length} at {offset}")
        if length == 0:
            return b""
        while self.file_received(path) < offset + length:
            await self._file_progress(path)
        data = self.files[path] if path in self.files else self._partial_files[path]
        return bytes(memoryview(data)[offset:offset + length])  # one copy, not two

    def _check_file(self, path: str) -> PackageFile:
        entry = self._file_entries.get(path)
        if entry is None:
            raise UnknownPackageError(f"package {self.package_id[:12]} has no file {path!r}")
        return entry

    async def _file_progress(self, path: str) -> None:
        if self._dropped is not None:
            raise DroppedHereError(self._dropped)
        fut = asyncio.get_running_loop().create_future()
        self._file_waiters.setdefault(path, []).append(fut)
        await fut

    def missing_files(self) -> list[str]:
        """Small package files not held yet."""
        return [f.path for f in self.manifest.files if f.path not in self.files]

    # -- reading -----------------------------------------------------------------------------------------

    def chunk_range(self, block: int, chunks: tuple[int, int] | None = None) -> tuple[int, int]:
        """``chunks`` (first, end: chunks first .. end - 1) of ``block``, checked, or its whole range for None;
        :class:`UnknownPackageError` unless the block has them (a plan that does not fit the manifest)."""
        count = self._state(block).count
        if chunks is None:
            return 0, count
        first, end = chunks
        if not 0 <= first < end <= count:
            raise UnknownPackageError(f"package {self.package_id[:12]}: block {block} has no chunk range "
                                      f"{first}-{end} (it has {count} chunks)")
        return first, end

    def first_missing_chunk(self, block: int, first: int = 0, end: int | None = None) -> int | None:
        """Where a (re)fetch of chunks ``first`` .. ``end - 1`` of ``block`` (``end`` None: to its last chunk)
        starts; None when all of them are present (for the whole block: it is verified)."""
        run = self.missing_run(block, first, end)
        return None if run is None else run[0]

    def missing_run(self, block: int, first: int = 0, end: int | None = None) -> tuple[int, int] | None:
        """The first run of missing chunks within chunks ``first`` .. ``end - 1`` of ``block`` (``end``
        None: to its last chunk), as (first, end); None when all of them are present. A fetch asks for
        runs, not past them: a chunk that another fetch landed meanwhile is not received twice."""
        present = self._state(block).present
        first, end = self.chunk_range(block, (first, len(present) if end is None else end))
        start = present.find(0, first, end)
        if start < 0:
            return None
        stop = present.find(1, start, end)
        return start, end if stop < 0 else stop

    def is_chunk_present(self, block: int, chunk: int) -> bool:
        return bool(self._state(block).present[chunk])

    def is_block_verified(self, block: int) -> bool:
        return self._state(block).verified_at is not None

    def verified_blocks(self) -> list[int]:
        return [s.meta.index for s in self._blocks if s.verified_at is not None]

    async def wait_chunk(self, block: int, chunk: int) -> memoryview:
        """The verified bytes of ``chunk`` (read-only view, no copy), once present.

        No deadline here: the caller's peer (or the fetch that fills the chunk) carries it.
        """
        state = self._state(block)
        if not 0 <= chunk < state.count:
            raise UnknownPackageError(f"block {block} has no chunk {chunk} (it has {state.count})")
        while not state.present[chunk]:
            await state.wait_on(state.chunk_waiters.setdefault(chunk, []))
        if state.dropped is not None:  # dropped as this waiter woke: its buffer may be freed already
            raise DroppedHereError(state.dropped)
        return state.readonly[slice(*state.bounds(chunk))]

    def relay_chunk(self, block: int, chunk: int) -> "LandingChunk":
        """``chunk``'s bytes for a peer, in order, as they land (see :class:`LandingChunk`)."""
        state = self._state(block)
        if not 0 <= chunk < state.count:
            raise UnknownPackageError(f"block {block} has no chunk {chunk} (it has {state.count})")
        return LandingChunk(state, chunk)

    async def wait_prefix(self, block: int, nbytes: int) -> None:
        """Return once the first ``nbytes`` bytes of ``block`` are verified (every chunk they touch)."""
        state = self._state(block)
        if not 0 < nbytes <= state.meta.bytes:
            raise UnknownPackageError(f"block {block} has {state.meta.bytes} bytes: no prefix of {nbytes}")
        # The engine asks again for every part: start past the verified prefix.
        for chunk in range(state.prefix_chunks, (nbytes - 1) // state.meta.chunk_bytes + 1):
            if not state.present[chunk]:
                await self.wait_chunk(block, chunk)

    def verified_prefix(self, block: int) -> int:
        """How many bytes of ``block`` are verified from its start without a gap."""
        state = self._state(block)
        return min(state.prefix_chunks * state.meta.chunk_bytes, state.meta.bytes)

    async def wait_block(self, block: int) -> None:
        """Return once ``block`` is complete and verified."""
        state = self._state(block)
        while state.verified_at is None:
            await state.wait_on(state.block_waiters)

    def block_view(self, block: int) -> memoryview:
        """Read-only view of a verified block's bytes (no copy)."""
        state = self._state(block)
        if state.verified_at is None:
            raise ValueError(f"block {block} is not verified yet")
        return state.readonly

    def block_path(self, block: int) -> str:
        """A path another process on this node can map to read the block without a copy."""
        return self._state(block).buffer.path

    def progress(self) -> StoreProgress:
        """A snapshot of what is present."""
        blocks = tuple(BlockProgress(s.meta.index, s.n_present, s.count, s.started_at, s.verified_at)
                       for s in self._blocks)
        return StoreProgress(
            package_id=self.package_id,
            blocks_verified=sum(1 for s in self._blocks if s.verified_at is not None),
            blocks_total=len(self._blocks),
            bytes_present=sum(s.bytes_present for s in self._blocks),
            bytes_total=self.manifest.total_bytes,
            blocks=blocks,
        )

    def subscribe(self, listener: Callable[[StoreEvent], None]) -> None:
        """Call ``listener`` on every later block event (from the store's event loop)."""
        self._listeners.append(listener)

    def _emit(self, event: StoreEvent) -> None:
        for listener in self._listeners:
            # A listener's failure (e.g. the event log's disk full) is this node's: it must neither undo the
            # chunk for the other listeners nor reach the transport, which would blame the peer that sent it.
            try:
                listener(event)
            except Exception:
                log.exception("a listener of package %s failed on %s of block %d", self.package_id[:12],
                              event.kind, event.block)

    def _state(self, block: int) -> _BlockState:
        if self._dropped is not None:
            raise DroppedHereError(self._dropped)
        if not 0 <= block < len(self._blocks):
            raise UnknownPackageError(f"package {self.package_id[:12]} has no block {block} "
                                      f"(it has {len(self._blocks)})")
        return self._blocks[block]

    def close(self) -> None:
        """Free every buffer and give the memory budget back; the store must not be used afterwards."""
        self.detach()()

    def detach(self) -> Callable[[], None]:
        """Close the store but free nothing yet: every wait on it, and every later call, fails with
        :class:`UnknownPackageError` saying the package was dropped (the event loop's part). Returns what frees
        the buffers and gives the memory budget back, which a worker thread may call (unmapping gigabytes takes
        a while: ~0.2 s for 2 GiB here)."""
        self._dropped = f"package {self.package_id[:12]} was dropped here"
        blocks, self._blocks = self._blocks, []
        for state in blocks:
            state.drop(self._dropped)
        _fail([f for fs in self._file_waiters.values() for f in fs], self._dropped)
        self._file_waiters.clear()
        reservation, self._reservation = self._reservation, None

        def free() -> None:
            for state in blocks:
                state.free()
            if reservation:
                reservation.release()
        return free
