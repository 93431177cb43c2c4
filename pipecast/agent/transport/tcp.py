"""The TCP transport on asyncio: the default data path on CPU nodes.

Messages are :mod:`.wire`'s: each a 20-byte header (:data:`~.wire.TCP_HEADER`) followed by its payload on
the stream.

The receive side is an ``asyncio.BufferedProtocol`` that hands the socket the chunk's own slice of the
block buffer: bytes go from the kernel into the block store with no extra copy, and a wake-up costs about
half of ``sock_recv_into`` (DESIGN 5). Socket buffer sizes are left to the kernel's autotuning (small
fixed buffers slowed chains down, DESIGN 5).
"""

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from pipecast.agent.errors import (
    PeerClosedError,
    PeerConnectError,
    PeerError,
    PeerProtocolError,
    PeerRefusedError,
    PeerTimeoutError,
)
from pipecast.agent.ratelimit import HostRateLimits, TokenBucket
from pipecast.agent.transport.base import (
    Channel,
    ChunkSink,
    Listener,
    ServedPackages,
    Transport,
    TransportStats,
    split_address,
)
from pipecast.agent.transport.wire import (
    CHUNK,
    ERROR,
    FILE,
    LIMITED_SEND_SLICE,
    REQ_BLOCK,
    REQ_FILE,
    TCP_HEADER,
    Header,
    answer_request,
    check_answer,
    check_chunk,
    check_request,
    parse_request,
    request_payload,
)

log = logging.getLogger(__name__)

MAX_QUEUED_REQUESTS = 8
# Let the transport buffer a few chunks before pausing the sender: fewer wake-ups per chunk.
WRITE_HIGH_WATER = 4 << 20
WRITE_LOW_WATER = 1 << 20


@dataclass
class _BlockRequest:
    block: int
    next_chunk: int
    count: int
    sink: ChunkSink
    done: asyncio.Future

    def describe(self) -> str:
        return f"block {self.block} (chunk {self.next_chunk} of {self.count})"


@dataclass
class _FileRequest:
    path: str
    done: asyncio.Future

    def describe(self) -> str:
        return f"file {self.path}"


class _ClientProtocol(asyncio.BufferedProtocol):
    """Receive side of a channel: parses headers, lands chunks in the sink's buffers, keeps deadlines."""

    def __init__(self, peer: str, io_timeout_s: float, stats: TransportStats,
                 ingress: TokenBucket | None) -> None:
        self.peer = peer
        self._io_timeout_s = io_timeout_s
        self._stats = stats
        self._ingress = ingress
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(TCP_HEADER.size)
        self._target = memoryview(self._header)
        self._filled = 0
        self._on_complete: Callable[[], None] = self._header_complete
        self.request: _BlockRequest | _FileRequest | None = None
        self._last_rx = self._loop.time()
        self._watchdog: asyncio.TimerHandle | None = None
        self.error: PeerError | None = None

    # asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        self._last_rx = self._loop.time()
        if self._ingress is not None:
            delay = self._ingress.take(nbytes)
            if delay > 0:
                self.transport.pause_reading()
                self._last_rx += delay  # our own pause is not the peer's silence
                self._loop.call_later(delay, self._resume_reading)
        if self._filled == len(self._target):
            try:
                self._on_complete()
            except Exception as exc:  # a corrupt chunk, a protocol violation: the channel is done
                self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close; connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watchdog:
            self._watchdog.cancel()
        during = f" while sending {self.request.describe()}" if self.request else ""
        reason = f"{type(exc).__name__}: {exc}" if exc else "end of stream"
        self._fail(PeerClosedError(self.peer, f"closed the connection{during} ({reason})"))

    # requests

    def start(self, request: _BlockRequest | _FileRequest, message: bytes) -> None:
        if self.error is not None:
            raise self.error
        if self.request is not None:
            raise RuntimeError(f"channel to {self.peer} already has a request in flight")
        self.request = request
        self._last_rx = self._loop.time()
        self._arm_watchdog()
        self.transport.write(message)

    def abort(self, error: PeerError) -> None:
        self._fail(error)

    def _fail(self, exc: Exception) -> None:
        if self._watchdog:
            self._watchdog.cancel()
        if self.error is None:
            self.error = exc if isinstance(exc, PeerError) else PeerProtocolError(self.peer, str(exc))
        request, self.request = self.request, None
        if request is not None and not request.done.done():
            request.done.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def _finish(self, result: bytes | None = None) -> None:
        request, self.request = self.request, None
        if self._watchdog:
            self._watchdog.cancel()
        request.done.set_result(result)

    def _resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _arm_watchdog(self) -> None:
        if self._watchdog:
            self._watchdog.cancel()
        self._watchdog = self._loop.call_at(self._last_rx + self._io_timeout_s, self._check_silence)

    def _check_silence(self) -> None:
        if self.request is None:
            return
        if self._loop.time() - self._last_rx >= self._io_timeout_s:
            self._fail(PeerTimeoutError(self.peer, f"silent for {self._io_timeout_s:g} s while sending "
                                                   f"{self.request.describe()}"))
        else:
            self._arm_watchdog()

    # parsing

    def _expect(self, target: memoryview, on_complete: Callable[[], None]) -> None:
        self._target = target
        self._filled = 0
        self._on_complete = on_complete
        if len(target) == 0:  # nothing to read (an empty file): the socket must never get an empty buffer
            on_complete()

    def _header_complete(self) -> None:
        header = TCP_HEADER.parse(self._header, self.peer)
        request = self.request
        if request is None:
            raise PeerProtocolError(self.peer, f"sent message type {header.kind} with no request outstanding")
        check_answer(header, CHUNK if isinstance(request, _BlockRequest) else FILE, request.describe(), self.peer)
        if header.kind == ERROR:
            self._expect(memoryview(bytearray(header.length)), self._error_complete)
        elif header.kind == CHUNK:
            buffer = request.sink.chunk_buffer(request.block, request.next_chunk)
            check_chunk(header, request.block, request.next_chunk, len(buffer), self.peer)
            self._expect(buffer, self._chunk_complete)
        else:
            self._expect(memoryview(bytearray(header.length)), self._file_complete)

    def _next_header(self) -> memoryview:
        payload = self._target
        self._target = memoryview(self._header)
        self._filled = 0
        self._on_complete = self._header_complete
        return payload

    def _chunk_complete(self) -> None:
        payload = self._next_header()
        request = self.request
        request.sink.chunk_landed(request.block, request.next_chunk, self.peer)
        self._stats.bytes_received += len(payload)
        request.next_chunk += 1
        if request.next_chunk == request.count:
            self._finish()

    def _file_complete(self) -> None:
        payload = self._next_header()
        self._stats.bytes_received += len(payload)
        self._finish(payload.tobytes())

    def _error_complete(self) -> None:
        payload = self._next_header()
        raise PeerRefusedError(self.peer, bytes(payload).decode("utf-8", "replace"))


class TcpChannel(Channel):
    """A TCP connection to one peer agent."""

    def __init__(self, peer: str, protocol: _ClientProtocol, requester: str) -> None:
        self.peer = peer
        self._protocol = protocol
        self._requester = requester

    async def _run(self, request: _BlockRequest | _FileRequest, message: bytes) -> None:
        self._protocol.start(request, message)
        try:
            await request.done
        except asyncio.CancelledError:
            # Half a block may be on the wire; the connection cannot carry another request.
            self._protocol.abort(PeerClosedError(self.peer, "channel closed by a cancelled request"))
            raise

    async def fetch_block(self, package_id: str, block: int, first_chunk: int, sink: ChunkSink) -> None:
        count = sink.chunk_count(block)
        if first_chunk >= count:
            return
        payload = request_payload(package_id, self._requester)
        request = _BlockRequest(block, first_chunk, count, sink, asyncio.get_running_loop().create_future())
        await self._run(request, TCP_HEADER.pack(Header(REQ_BLOCK, block, first_chunk, len(payload))) + payload)

    async def fetch_file(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        payload = request_payload(package_id, self._requester, path)
        request = _FileRequest(path, asyncio.get_running_loop().create_future())
        await self._run(request, TCP_HEADER.pack(Header(REQ_FILE, offset, length, len(payload))) + payload)
        return request.done.result()

    async def close(self) -> None:
        if self._protocol.transport is not None and not self._protocol.transport.is_closing():
            self._protocol.transport.close()


class _ServerProtocol(asyncio.Protocol):
    """Serve side of one connection: queues requests, sends chunks as soon as this node has them."""

    def __init__(self, listener: "TcpListener") -> None:
        self._listener = listener
        self._transport: asyncio.Transport | None = None
        self._inbox = bytearray()
        self._requests: asyncio.Queue = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self.peer = "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        host, port = transport.get_extra_info("peername")[:2]
        self.peer = f"{host}:{port}"
        self._listener.connections.add(self)
        self._worker = asyncio.get_running_loop().create_task(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.connections.discard(self)
        self._can_write.set()
        if self._worker:
            self._worker.cancel()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def data_received(self, data: bytes) -> None:
        self._inbox += data
        while len(self._inbox) >= TCP_HEADER.size:
            try:
                header = TCP_HEADER.parse(self._inbox, self.peer)
                check_request(header, self.peer)
                if self._requests.qsize() >= MAX_QUEUED_REQUESTS:
                    raise PeerProtocolError(self.peer, f"sent more than {MAX_QUEUED_REQUESTS} requests at once")
            except PeerProtocolError as exc:
                log.warning("%s; closing", exc)
                self._transport.abort()
                return
            end = TCP_HEADER.size + header.length
            if len(self._inbox) < end:
                return
            payload = bytes(self._inbox[TCP_HEADER.size:end])
            del self._inbox[:end]
            self._requests.put_nowait(parse_request(header, payload))

    def abort(self) -> None:
        self._transport.abort()

    async def _serve(self) -> None:
        while True:
            request = await self._requests.get()
            self.peer = f"{request.requester}@{self._transport.get_extra_info('peername')[0]}"
            try:
                await answer_request(self._listener.served, request, self._send, self.peer)
            except PeerError as exc:  # the requester stopped reading or went away
                log.warning("%s", exc)
                self._transport.abort()
                return
            except Exception:
                log.exception("serving %s failed", self.peer)
                self._transport.abort()
                return

    async def _send(self, header: Header, payload: memoryview) -> None:
        """Send one message: an answer paced at the egress limit and counted, an ``ERROR`` at once."""
        self._transport.write(TCP_HEADER.pack(header))
        if header.kind == ERROR:
            self._transport.write(payload)
            return
        egress = self._listener.limits.egress
        step = LIMITED_SEND_SLICE if egress is not None else max(len(payload), 1)
        for start in range(0, len(payload), step):
            piece = payload[start:start + step]
            if egress is not None:
                delay = egress.take(len(piece))
                if delay > 0:
                    await asyncio.sleep(delay)
            self._transport.write(piece)
            self._listener.stats.bytes_sent += len(piece)
            await self._drain()

    async def _drain(self) -> None:
        timeout = self._listener.io_timeout_s
        while not self._can_write.is_set():
            # The deadline is on progress: a slow (rate-limited) reader may take longer to drain.
            before = self._transport.get_write_buffer_size()
            try:
                await asyncio.wait_for(self._can_write.wait(), timeout)
            except TimeoutError:
                if self._transport.get_write_buffer_size() >= before:
                    raise PeerTimeoutError(self.peer, f"read nothing for {timeout:g} s") from None
        if self._transport.is_closing():
            raise PeerClosedError(self.peer, "closed the connection")


class TcpListener(Listener):
    """A listening TCP socket serving an agent's packages."""

    def __init__(self, served: ServedPackages, limits: HostRateLimits, stats: TransportStats,
                 io_timeout_s: float) -> None:
        self.served = served
        self.limits = limits
        self.stats = stats
        self.io_timeout_s = io_timeout_s
        self.connections: set[_ServerProtocol] = set()
        self.address = ""
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.get_running_loop().create_server(lambda: _ServerProtocol(self), host,
                                                                      port)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self.address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"

    @property
    def open_connections(self) -> int:
        return len(self.connections)

    async def close(self) -> None:
        self._server.close()
        for connection in list(self.connections):
            connection.abort()
        await self._server.wait_closed()


class TcpTransport(Transport):
    """asyncio TCP with application-level rate limits; :mod:`.wire` describes the wire format."""

    name = "tcp"

    async def listen(self, host: str, port: int, served: ServedPackages) -> TcpListener:
        listener = TcpListener(served, self.limits, self.stats, self.io_timeout_s)
        await listener.start(host, port)
        return listener

    async def connect(self, address: str, peer: str) -> TcpChannel:
        host, port = split_address(address)
        protocol = _ClientProtocol(peer, self.io_timeout_s, self.stats, self.limits.ingress)
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().create_connection(lambda: protocol, host, port),
                self.connect_timeout_s)
        except TimeoutError:
            raise PeerConnectError(peer, f"no connection to {address} within {self.connect_timeout_s:g} s") \
                from None
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise PeerConnectError(peer, f"cannot connect to {address} ({reason})") from None
        return TcpChannel(peer, protocol, self.node_id)
