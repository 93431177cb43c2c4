"""The chaos scenarios' network actors, all on loopback: a TCP proxy that flips a byte of every chunk an
agent serves, a fake peer that answers with a hostile manifest, a raw client that asks for a manifest with
no credentials, and the abusive clients of the resource scenario (slow-loris, connection flood, a
requester that never reads, made-up requester names).

They speak the agents' wire protocol (:mod:`pipecast.agent.transport.wire`), run on an asyncio loop in a
thread of their own (:class:`BackgroundLoop`) so the scenario can wait on processes meanwhile, and every
socket read has a deadline. Those given the data-plane key (``key``, b"" for none) are insiders: they
pass the hello under any node id they make up, as a compromised or buggy member of the cluster would;
the others are outsiders, stopped at the hello when the cluster has credentials.
"""

import asyncio
import logging
import threading
import uuid
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pipecast.agent.transport.base import PeerAuth
from pipecast.core.errors import PipecastError
from pipecast.agent.transport.wire import (
    AUTH_CHALLENGE,
    AUTH_FAIL,
    AUTH_HELLO,
    AUTH_OK,
    AUTH_PROOF,
    CHUNK,
    CHUNK_PIECES,
    ERROR,
    FILE,
    PIECE,
    REQ_BLOCK,
    REQ_FILE,
    TCP_HEADER,
    ClientHello,
    Header,
    HelloRefused,
    ServerHello,
    request_payload,
)

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0
GIVE_UP_AFTER_REFUSALS = 5
T = TypeVar("T")


class BackgroundLoop:
    """An asyncio loop on a daemon thread; ``close()`` cancels what still runs there and stops it."""

    def __init__(self) -> None:
        self.servers: list[asyncio.AbstractServer] = []  # closed by close()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="chaos loop")
        self._thread.start()

    def submit(self, work: Coroutine[Any, Any, T]) -> Future:
        """Start ``work`` on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def run(self, work: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """``work`` on the loop, waited for at most ``timeout_s`` (TimeoutError after)."""
        future = self.submit(work)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        """Close the servers started on the loop, cancel its tasks, stop it."""
        async def cancel_all() -> None:
            for server in self.servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(cancel_all(), 10.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)
            self.loop.close()


def split(address: str) -> tuple[str, int]:
    """``"host:port"`` to ``("host", port)``."""
    host, port = address.rsplit(":", 1)
    return host, int(port)


def request(kind: int, package_id: str, requester: str, block: int = 0, chunk: int = 0, path: str | None = None
            ) -> bytes:
    """A request message: ``REQ_BLOCK`` (block, first chunk) or ``REQ_FILE`` (offset, length, path)."""
    payload = request_payload(package_id, requester, path)
    return TCP_HEADER.pack(Header(kind, block, chunk, len(payload))) + payload


async def read_message(reader: asyncio.StreamReader, limit: int = 1 << 20) -> tuple[Header, bytes]:
    """One message (header and payload, payloads over ``limit`` are read and dropped) within READ_TIMEOUT_S;
    ConnectionError if the peer closes first."""
    try:
        raw = await asyncio.wait_for(reader.readexactly(TCP_HEADER.size), READ_TIMEOUT_S)
    except asyncio.IncompleteReadError:
        raise ConnectionError("closed before a whole header") from None
    header = TCP_HEADER.parse(raw, "agent")
    payload = b""
    left = header.length
    while left:
        piece = await asyncio.wait_for(reader.read(min(left, 1 << 20)), READ_TIMEOUT_S)
        if not piece:
            raise ConnectionError("closed mid-message")
        left -= len(piece)
        if len(payload) < limit:
            payload += piece[:limit - len(payload)]
    return header, payload


def message(kind: int, payload: bytes = b"") -> bytes:
    """A message of ``kind`` with ``payload`` and no block or chunk (the hello's)."""
    return TCP_HEADER.pack(Header(kind, length=len(payload))) + payload


async def hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, node_id: str) -> bool:
    """The requester's hello as ``node_id`` with ``key`` (none when ``key`` is empty): whether the peer
    let us in."""
    if not key:
        return True
    client = ClientHello(PeerAuth(node_id, key), TCP_HEADER, "agent")
    writer.write(message(AUTH_HELLO, client.hello()))
    header, payload = await read_message(reader)
    if header.kind != AUTH_CHALLENGE:
        return False
    writer.write(message(AUTH_PROOF, client.proof(payload)))
    header, _ = await read_message(reader)
    return header.kind == AUTH_OK


async def open_connection(address: str, key: bytes = b"", node_id: str = "chaos", source: str | None = None
                          ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``address`` from the loopback address ``source`` (any of 127/8; default the
    kernel's pick), past the hello when given a ``key`` (ConnectionError if refused)."""
    local = (source, 0) if source else None
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*split(address), local_addr=local),
                                            READ_TIMEOUT_S)
    try:
        admitted = await hello(reader, writer, key, node_id)
    except PipecastError:  # a hello answered with something else than the protocol's: not admitted
        admitted = False
    if not admitted:
        await _close(writer)
        raise ConnectionRefusedError(f"{address} refused the hello of {node_id}")
    return reader, writer


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


# -- a relay whose served bytes are flipped ------------------------------------------------------------


class _LoopbackServer:
    """A fake peer listening on loopback; subclasses answer each connection in ``_serve``."""

    server: asyncio.AbstractServer | None
    port: int

    async def start(self, loop: BackgroundLoop) -> int:
        """Listen on a free loopback port of ``loop`` (which closes it); the port."""
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        loop.servers.append(self.server)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


@dataclass
class FlippingProxy(_LoopbackServer):
    """Forwards connections on its port to ``upstream``; in every ``CHUNK`` the agent sends back (every
    ``PIECE`` of a chunk it passes on as it arrives), one byte is flipped (a relay with bad memory, or a man in
    the middle). ``flipped`` counts them."""

    upstream: str
    flipped: int = 0
    unparsed: int = 0  # answers that did not parse as the wire protocol (passed on unchanged)
    server: asyncio.AbstractServer | None = None
    port: int = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*split(self.upstream))
        except OSError:
            await _close(writer)
            return
        tasks = [asyncio.create_task(self._pipe(reader, up_writer)), asyncio.create_task(self._answers(up_reader,
                                                                                                      writer))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _close(up_writer)
            await _close(writer)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()

    async def _answers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                raw = await reader.readexactly(TCP_HEADER.size)
            except asyncio.IncompleteReadError as exc:
                writer.write(exc.partial)
                return
            try:
                header = TCP_HEADER.parse(raw, "relay")
            except Exception:  # noqa: BLE001 - not the protocol we know: pass everything on untouched
                self.unparsed += 1
                writer.write(raw)
                await self._pipe(reader, writer)
                return
            # A CHUNK_PIECES header announces its chunk's length; its bytes come in the PIECE messages after it.
            payload = bytearray(await reader.readexactly(0 if header.kind == CHUNK_PIECES else header.length))
            if header.kind in (CHUNK, PIECE) and payload:
                payload[len(payload) // 2] ^= 0xFF
                self.flipped += 1
            writer.write(raw + payload)
            await writer.drain()


# -- a fake peer and a raw client ----------------------------------------------------------------------


def nested_json(nbytes: int) -> bytes:
    """``nbytes`` of deeply nested JSON arrays: ``[[[[...]]]]`` (a recursive parser runs out of stack)."""
    depth = nbytes // 2
    return b"[" * depth + b"]" * depth


@dataclass
class FakePeer(_LoopbackServer):
    """A peer that answers every file request with ``body`` (a hostile manifest) and refuses blocks; with
    the data-plane ``key`` it passes the hello first (an insider)."""

    body: bytes
    key: bytes = b""
    requests: int = 0
    server: asyncio.AbstractServer | None = None
    port: int = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = TCP_HEADER.parse(await reader.readexactly(TCP_HEADER.size), "agent")
                payload = await reader.readexactly(header.length)
                if header.kind == AUTH_HELLO:
                    await self._hello(reader, writer, payload)
                    continue
                self.requests += 1
                if header.kind == REQ_FILE:
                    writer.write(TCP_HEADER.pack(Header(FILE, length=len(self.body))) + self.body)
                else:
                    text = b"not here"
                    writer.write(TCP_HEADER.pack(Header(ERROR, header.block, header.chunk, len(text))) + text)
                await writer.drain()
        except Exception:  # noqa: BLE001 - the agent gave up on us, whichever way: that is its job
            pass
        finally:
            await _close(writer)

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> None:
        server = ServerHello(PeerAuth("fake", self.key), TCP_HEADER)
        try:
            writer.write(message(AUTH_CHALLENGE, server.challenge(payload)))
            header, proof = await read_message(reader)
            server.check(proof)
            writer.write(message(AUTH_OK))
        except HelloRefused as exc:
            writer.write(message(AUTH_FAIL, str(exc).encode()))


async def fetch_manifest_raw(address: str, package_id: str) -> str:
    """Ask ``address`` for ``package_id``'s manifest with no credentials at all: what came back
    ("manifest", "error", "closed" or "silence")."""
    reader, writer = await asyncio.open_connection(*split(address))
    try:
        writer.write(request(REQ_FILE, package_id, "anonymous", path="manifest.json"))
        await writer.drain()
        try:
            header, _ = await read_message(reader)
        except ConnectionError:
            return "closed"
        except TimeoutError:
            return "silence"
        except Exception:  # noqa: BLE001 - a reply that is not our protocol gives nothing away either
            return "closed"
        return "manifest" if header.kind == FILE else "error"
    finally:
        await _close(writer)


# -- the resource attacks ------------------------------------------------------------------------------


@dataclass
class Abuse:
    """Connections held open against one agent; ``close()`` lets go of them."""

    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    readers: list[asyncio.StreamReader] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)
    refused: int = 0  # connections the agent refused or closed at once (a limit doing its job)

    async def connect(self, address: str, count: int, sources: Sequence[str]) -> None:
        """Open ``count`` connections, spread over the ``sources`` addresses, and leave them idle (the
        flood); once the agent has refused a few in a row, the rest count as refused too (each would only
        wait out its timeout)."""
        in_a_row = 0
        for i in range(count):
            if in_a_row >= GIVE_UP_AFTER_REFUSALS:
                self.refused += 1
                continue
            try:
                reader, writer = await open_connection(address, source=sources[i % len(sources)])
                self.readers.append(reader)
                self.writers.append(writer)
                in_a_row = 0
            except (OSError, TimeoutError):  # ConnectionError is an OSError
                self.refused += 1
                in_a_row += 1

    async def slow_loris(self, address: str, count: int, interval_s: float, source: str) -> None:
        """Open ``count`` connections from ``source`` that each send one byte of a header every
        ``interval_s``, forever."""
        async def drip(writer: asyncio.StreamWriter) -> None:
            header = request(REQ_BLOCK, "0" * 64, "loris")
            for byte in header[:TCP_HEADER.size - 1]:  # never the whole header
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(interval_s)
            await asyncio.sleep(3600)

        before = len(self.writers)
        await self.connect(address, count, [source])
        self.tasks += [asyncio.create_task(drip(w)) for w in self.writers[before:]]

    async def never_read(self, address: str, count: int, package_id: str, blocks: int, key: bytes,
                         source: str) -> None:
        """``count`` insiders from ``source`` that ask for every block and never read what comes back."""
        for i in range(count):
            try:
                _, writer = await open_connection(address, key, f"sloth-{i}", source)
            except (OSError, TimeoutError):
                self.refused += 1
                continue
            writer.transport.pause_reading()  # the kernel's buffers fill; the agent's sends stall
            for block in range(blocks):
                writer.write(request(REQ_BLOCK, package_id, f"sloth-{i}", block))
            self.writers.append(writer)

    async def closed_by_agent(self) -> int:
        """How many of the connections held open the agent has closed (evicted) so far."""
        return sum(reader.at_eof() for reader in self.readers)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.transport.abort()


async def unique_requesters(address: str, package_id: str, path: str, count: int, connections: int,
                            key: bytes, source: str) -> int:
    """``count`` one-byte file requests from ``source``, each from a connection of its own under a made-up
    node id (an insider passes the hello under any id), ``connections`` at a time; how many were
    answered."""
    answered = 0

    async def one_connection(n: int) -> None:
        nonlocal answered
        for _ in range(n):
            ghost = f"ghost-{uuid.uuid4().hex}"
            reader, writer = await open_connection(address, key, ghost, source)
            try:
                writer.write(request(REQ_FILE, package_id, ghost, 0, 1, path=path))
                await writer.drain()
                header, _ = await read_message(reader)
                answered += header.kind in (FILE, ERROR)
            finally:
                await _close(writer)

    share = [count // connections + (i < count % connections) for i in range(connections)]
    results = await asyncio.gather(*(one_connection(n) for n in share if n), return_exceptions=True)
    for result in results:
        if isinstance(result, Exception):
            log.info("unique-requester connection ended: %s: %s", type(result).__name__, result)
    return answered
