"""The local API server: how an engine on the same node reads verified blocks without a copy.

The agent's block buffers are shared mappings from the start (memfd for received blocks, the files
themselves for a seed or the disk cache), so a verified block is handed over as a path the engine maps
read-only: the bytes the network wrote are the bytes the engine reads. Requests and events travel over a
unix socket as JSON lines, one request and one answer at a time::

    {"op": "manifest"}                          -> {"ok": true, "manifest": {...}}
    {"op": "wait_block", "block": 3, "timeout": 30}
                                                -> {"ok": true, "block": 3, "path": "/proc/..", "bytes": N}
    {"op": "wait_prefix", "block": 3, "bytes": 4096, "timeout": 30}
                                                -> the same, once the block's first 4096 bytes are verified,
                                                   plus "verified": bytes verified from its start (>= 4096)
    {"op": "buffer", "block": 3}                -> {"ok": true, "block": 3, "path": "/proc/..", "bytes": N}
    {"op": "file", "path": "config.json"}       -> {"ok": true, "data": "<base64>"}
    {"op": "progress"}                          -> {"ok": true, "progress": {StoreProgress as JSON}}
    {"op": "status"}                            -> {"ok": true, "status": {node, bytes moved, packages}}
    {"op": "serving_key", "timeout": 30}        -> {"ok": true, "serving_key": "<hex>"} ("": auth off), once
                                                   the agent knows its cluster credentials (its registration)
    {"op": "subscribe"}                         -> {"ok": true}, then event lines, what happened before first:
        {"event": "block_verified", "package": ID, "block": 3, "bytes": N, "at": T}   (N: the block's size)
        {"event": "prefix_verified", "package": ID, "block": 3, "bytes": N, "at": T}   (N: verified from
                                                   the block's start; one a chunk, while it is in flight)
        {"event": "package_dropped", "package": ID}   (the agent freed it: waits for it fail; held again,
                                                   its blocks are new memory, verified afresh)

``wait_prefix`` lets an engine use a block's first layers while the rest of it is in flight: every chunk
is verified against its own digest as it lands, so a verified prefix is as safe to read as a verified
block. ``buffer`` answers verified or not, once the block's memory is populated (by the agent, from its
memory reserve where it has one, not by the engine's mapping on the engine's CPU): a block's buffer never
moves, so the engine can map it while the block is still arriving and read it once ``wait_block`` says it
is verified (mapping costs ~0.15 ms per MB of page-table set-up, which then stays off the path from the
last block to the first token). An engine that subscribes learns what is verified without asking: its waits
and its view of the blocks held cost no request (:class:`pipecast.agent.local_client.LocalAgentClient`).
Every request may name ``"package"`` (a package id); without it the agent's only package is meant.
Failures answer ``{"ok": false, "error": "...", "timeout": bool}`` (and ``"dropped": true`` where the package was
dropped while the request was answered): a line that is not a JSON object, an
unknown op, a field of the wrong type or range (``timeout`` must be a finite number from 0 to
``MAX_TIMEOUT_S``; ``block`` and ``bytes`` non-negative integers) included. A block's path is
``/proc/<agent pid>/fd/<n>`` (its memfd; for a seed's or cached block, the descriptor of the very file verified,
whatever takes its name later): the engine must run as the agent's user and see its pid
namespace (same container or pod with a shared process namespace). The engine's side is
:class:`pipecast.agent.local_client.LocalAgentClient`.
"""

import asyncio
import base64
import dataclasses
import json
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipecast.agent.errors import AgentError, DroppedHereError, LocalApiError, LocalApiTimeoutError
from pipecast.agent.local_client import MAX_TIMEOUT_S, is_timeout
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.store import BlockStore, StoreEvent
from pipecast.agent.transport.base import PeerAuth
from pipecast.core.credentials import serving_key
from pipecast.core.strictjson import JSONInputError, describe, loads_object

log = logging.getLogger(__name__)

#: Events a subscriber may leave unread before its stream is ended (an engine that stopped reading must not
#: grow the agent's memory one line a chunk; a live one is never this far behind).
MAX_PENDING_EVENTS = 1 << 16
OPS = ("manifest", "wait_block", "wait_prefix", "buffer", "file", "progress", "status", "serving_key", "subscribe")
DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class LocalRequest:
    """One checked request of the local API (the module docstring lists the ops and their fields)."""

    op: str
    package: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    block: int | None = None
    nbytes: int | None = None
    path: str | None = None


def parse_request(line: bytes | str) -> LocalRequest:
    """Check one request line; :class:`LocalApiError` says what is wrong with it (never anything else)."""
    try:
        request = loads_object(line)
    except JSONInputError as exc:
        raise LocalApiError(f"the request is not a JSON object: {exc}") from None
    op = request.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise LocalApiError(f"unknown op {describe(op)} (ops: {', '.join(OPS)})")
    package = request.get("package")
    if package is not None and not isinstance(package, str):
        raise LocalApiError(f"package must be a package id (a string), got {describe(package)}")
    timeout = request.get("timeout", DEFAULT_TIMEOUT_S)
    if not is_timeout(timeout):
        raise LocalApiError(f"timeout must be a number of seconds from 0 to {MAX_TIMEOUT_S:g}, "
                            f"got {describe(timeout)}")
    block = nbytes = path = None
    if op in ("wait_block", "wait_prefix", "buffer"):
        block = _count(request, "block")
    if op == "wait_prefix":
        nbytes = _count(request, "bytes")
    if op == "file":
        path = request.get("path")
        if not isinstance(path, str):
            raise LocalApiError(f"path must be a file name of the package, got {describe(path)}")
    return LocalRequest(op, package, float(timeout), block, nbytes, path)


def _count(request: dict[str, Any], name: str) -> int:
    value = request.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LocalApiError(f"{name} must be a non-negative integer, got {describe(value)}")
    return value


class LocalApiServer:
    """Serves the local API of one agent on a unix socket (mode 0600: same user only)."""

    def __init__(self, peer_server: PeerServer, status: Callable[[], dict], auth: PeerAuth) -> None:
        self._peer_server = peer_server
        self._status = status
        self._auth = auth
        self._server: asyncio.AbstractServer | None = None
        self._subscribers: set[asyncio.Queue] = set()
        self._connections: set[asyncio.Task] = set()
        # Per package: the connections given a path to its blocks' memory (an engine maps it; its client closes
        # with its model, after which the memory is no longer mapped there).
        self._mappers: dict[str, set[asyncio.Task]] = {}
        self.path: Path | None = None

    async def start(self, path: Path) -> None:
        """Listen on ``path``; a stale socket file left by a dead agent is replaced, anything else there is
        :class:`LocalApiError`.

        The socket is bound under a temporary name, made 0600, and only then listens and is renamed to
        ``path``: no other user can connect at any moment, and a client that sees ``path`` can connect.
        """
        path = Path(path)
        if path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))
                raise LocalApiError(f"{path}: another agent is listening on this socket")
            except FileNotFoundError:  # gone since: nothing to replace
                pass
            except ConnectionRefusedError:
                # A regular file or a folder refuses too: a mistyped socket path must not delete the user's file.
                if not stat.S_ISSOCK(path.lstat().st_mode):
                    raise LocalApiError(f"{path} exists and is not a socket: the agent replaces only a stale "
                                        "socket of its own there") from None
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise LocalApiError(f"{path}: cannot tell whether an agent listens on this socket: {exc}") from None
            finally:
                probe.close()
        self._server = await asyncio.start_unix_server(self._serve, sock=_private_socket(path))
        self.path = path

    def publish(self, event: StoreEvent, store: BlockStore) -> None:
        """Send a block's verification, or its longer verified prefix, to every subscriber."""
        if event.kind == "block_started":
            return
        self._send(_event(store, event.block, event.at))

    def publish_dropped(self, package_id: str) -> None:
        """Tell every subscriber that the agent dropped ``package_id``: an engine waiting for its blocks fails at
        once (not at its deadline) and maps the package afresh should the agent hold it again."""
        self._send({"event": "package_dropped", "package": package_id})

    def publish_held(self, store: BlockStore) -> None:
        """Send what ``store`` holds verified already (a package the agent holds again, from its disk cache) to
        every subscriber: one that heard the package dropped learns its blocks afresh."""
        for message in _held(store):
            self._send(message)

    def _send(self, message: dict) -> None:
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(message)
            except asyncio.QueueFull:  # it stopped reading: end its stream after what it has
                self._subscribers.discard(queue)
                _end_stream(queue)

    async def close(self) -> None:
        """Stop serving, end every event stream and request (an engine waiting on one learns the agent is gone
        at once, not at its deadline) and remove the socket file."""
        for queue in self._subscribers:
            _end_stream(queue)
        if self._server is not None:
            self._server.close()
        # Before waiting for the server: from Python 3.12.1 that waits for every open connection, and a worker's
        # pooled idle connection would hold the agent's shutdown until that worker exits.
        for connection in self._connections:
            connection.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = asyncio.current_task()
        self._connections.add(connection)
        next_line = asyncio.ensure_future(_next_line(reader))
        try:
            while line := await next_line:
                # Read on while answering: an engine that goes away ends a wait it no longer needs at once, not at
                # the wait's timeout (up to a day), and a line it sent meanwhile is its next request.
                next_line = asyncio.ensure_future(_next_line(reader))
                try:
                    request = parse_request(line)
                    if request.op == "subscribe":
                        await self._stream_events(next_line, reader, writer)
                        return
                    answer = await self._answer_while_connected(request, next_line)
                    if answer is None:
                        return
                    if isinstance(answer, dict) and "path" in answer:  # an engine maps that package's memory
                        self._mappers.setdefault(answer["package"], set()).add(connection)
                except LocalApiTimeoutError as exc:
                    answer = {"ok": False, "error": str(exc), "timeout": True}
                except (AgentError, ValueError, KeyError, TypeError, IndexError) as exc:
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "timeout": False}
                    if isinstance(exc, DroppedHereError):  # the engine's load waits for it again, not fails
                        answer["dropped"] = True
                writer.write((answer if isinstance(answer, bytes) else json.dumps(answer).encode()) + b"\n")
                await writer.drain()
        except ConnectionError:
            pass  # the engine went away
        except asyncio.CancelledError:
            pass  # the agent stops: asyncio logs a connection's task that ends cancelled as an ERROR
        finally:
            next_line.cancel()
            self._connections.discard(connection)
            for mappers in self._mappers.values():  # an ended connection maps nothing more
                mappers.discard(connection)
            writer.close()

    async def _answer_while_connected(self, request: LocalRequest, next_line: asyncio.Future) -> dict | bytes | None:
        """The answer to ``request``, or None once the engine's connection ends first (``next_line``, its next
        line, comes empty): the answer is then cancelled."""
        answering = asyncio.ensure_future(self._answer(request))
        try:
            await asyncio.wait((answering, next_line), return_when=asyncio.FIRST_COMPLETED)
            if not answering.done() and not next_line.result():
                return None
            return await answering
        finally:
            answering.cancel()  # the engine went away, or the agent stops

    async def _answer(self, request: LocalRequest) -> dict | bytes:
        """The answer to ``request``: a JSON object, or one already encoded (a large one, made in a thread)."""
        op, timeout = request.op, request.timeout
        if op == "status":
            return {"ok": True, "status": self._status()}
        if op == "serving_key":
            key = await self._auth.wait_key(timeout)
            if key is None:
                raise LocalApiTimeoutError(f"no cluster credentials here within {timeout:g} s (the agent has not "
                                           f"registered with its control plane yet)")
            return {"ok": True, "serving_key": serving_key(key).hex()}
        package = f"package {request.package}" if request.package else "package"
        store = await _within(timeout, self._peer_server.wait_store(request.package), f"no {package} here")
        if op == "manifest":  # 10 MB of JSON for a large model: encoded off the event loop, which forwards chunks
            return await asyncio.to_thread(_manifest_answer, store)
        if op == "progress":
            return {"ok": True, "progress": dataclasses.asdict(store.progress())}
        if op == "file":
            data = await _within(timeout, store.wait_file(request.path), f"file {request.path!r} not here")
            return {"ok": True, "data": base64.b64encode(data).decode()}
        block = request.block
        verified = {}
        if op == "wait_block":
            await _within(timeout, store.wait_block(block), f"block {block} not verified")
        elif op == "wait_prefix":
            nbytes = request.nbytes
            await _within(timeout, store.wait_prefix(block, nbytes),
                          f"the first {nbytes} bytes of block {block} not verified")
            # All that is verified: the engine's next parts may need no request.
            verified = {"verified": store.verified_prefix(block)}
        if not store.populated(block):
            # The engine maps the whole block at once (MAP_POPULATE): pages missing then would be allocated and
            # zeroed in the engine's process, on its CPU, and not from the agent's memory reserve.
            await asyncio.to_thread(store.prefault, block)
        return {"ok": True, "package": store.package_id, "block": block, "path": store.block_path(block),
                "bytes": store.manifest.blocks[block].bytes, **verified}

    def mapped_by(self, package_id: str) -> set[asyncio.Task]:
        """The connections still open that were given a path to ``package_id``'s memory (forgotten here: a
        package held again has mappers of its own)."""
        return {task for task in self._mappers.pop(package_id, ()) if not task.done()}

    async def _stream_events(self, next_line: Awaitable[bytes], reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue(MAX_PENDING_EVENTS)
        self._subscribers.add(queue)
        # What a subscriber sends is ignored, and its connection's end ends the stream at once: waiting for the next
        # event (maybe never) would keep the connection, its task and its queue of an engine long gone.
        watching = asyncio.ensure_future(_end_when_gone(next_line, reader, queue))
        try:
            writer.write(b'{"ok": true}\n')
            for store in self._peer_server.stores.values():  # what happened before the subscription
                for message in _held(store):
                    queue.put_nowait(message)
            while (event := await queue.get()) is not None:
                writer.write(json.dumps(event).encode() + b"\n")
                await writer.drain()
        finally:
            watching.cancel()
            self._subscribers.discard(queue)


async def _next_line(reader: asyncio.StreamReader) -> bytes:
    """The engine's next line; b"" once it went away, or sent a line over the stream limit (it is dropped)."""
    try:
        return await reader.readline()
    except (ConnectionError, ValueError):
        return b""


async def _end_when_gone(next_line: Awaitable[bytes], reader: asyncio.StreamReader, queue: asyncio.Queue) -> None:
    """End the event stream to ``queue`` once the subscriber's connection ends (its lines are ignored)."""
    while await next_line:
        next_line = _next_line(reader)
    _end_stream(queue)


def _end_stream(queue: asyncio.Queue) -> None:
    """End a subscriber's event stream after what ``queue`` holds (less its oldest event, if full)."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(None)


async def _within(timeout: float, waiting: Awaitable, what: str) -> Any:
    """What ``waiting`` returns, or :class:`LocalApiTimeoutError` saying ``what`` "within ``timeout`` s".

    Not asyncio.wait_for: on Python 3.11 it cancels before the first step with a timeout of 0, so an answer ready
    at once timed out."""
    try:
        async with asyncio.timeout(timeout):
            return await waiting
    except TimeoutError:
        raise LocalApiTimeoutError(f"{what} within {timeout:g} s") from None


def _held(store: BlockStore) -> Iterator[dict]:
    """A subscriber's lines for what ``store`` holds verified by now."""
    for block in store.progress().blocks:
        if block.verified_at is not None or store.verified_prefix(block.index):
            yield _event(store, block.index, block.verified_at or block.started_at)


def _event(store: BlockStore, block: int, at: float | None) -> dict:
    """A subscriber's line for ``block``: verified, or how many bytes from its start are."""
    kind = "block_verified" if store.is_block_verified(block) else "prefix_verified"
    return {"event": kind, "package": store.package_id, "block": block, "bytes": store.verified_prefix(block),
            "at": at}


def _private_socket(path: Path) -> socket.socket:
    """A unix socket listening at ``path`` that only this user can connect to, at every moment."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        tmp.unlink(missing_ok=True)
        sock.bind(str(tmp))
        try:
            os.chmod(tmp, 0o600)   # before listen: until then every connect is refused
            sock.listen(socket.SOMAXCONN)
            os.replace(tmp, path)  # the path appears ready, and private
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        sock.close()
        raise LocalApiError(f"{path}: cannot listen: {exc.strerror or exc}") from None
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def _manifest_answer(store: BlockStore) -> bytes:
    """The ``manifest`` op's answer line (without its newline): the store's cached manifest JSON, compacted."""
    return json.dumps({"ok": True, "manifest": json.loads(store.manifest_json)}, separators=(",", ":")).encode()
