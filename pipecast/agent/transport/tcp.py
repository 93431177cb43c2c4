"""The TCP transport on asyncio: the default data path on CPU nodes.

Messages are :mod:`.wire`'s: each a 20-byte header (:data:`~.wire.TCP_HEADER`) followed by its payload on
the stream; with a data-plane key a connection starts with the hello (:func:`~.wire.accept_hello`).

The serving side bounds what a peer can make it hold: connections (total and per address, counted from the
connect: with TLS before the handshake), a header deadline (a connection must send each whole message within
``io_timeout_s`` of its first byte, and its first within ``io_timeout_s`` of connecting, or with TLS the handshake
within that and then its first message), an idle deadline between requests, a few queued requests,
and at most :data:`MAX_BUFFERED_OUTPUT` bytes of unsent output (it writes in slices and waits for the
socket to drain after each, error answers included).

The receive side is an ``asyncio.BufferedProtocol`` that hands the socket the chunk's own slice of the block
buffer: bytes go from the kernel into the block store with no extra copy, and a wake-up costs about half of
``sock_recv_into`` (DESIGN 5). It tells the sink every ``agent_relay_bytes`` of a chunk that land, and the serving
side passes a chunk on in such pieces as they arrive (``answer_request``'s ``stream``: a ``CHUNK_PIECES`` answer of
``PIECE`` messages, :mod:`.wire`), its last byte once the chunk is verified: a chain's hop then costs a piece's
time instead of a chunk's (DESIGN 5: relaying every 256 KiB took a chain of 4 MiB chunks from 1.16 to 1.07-1.08x
S/B). Socket buffer sizes are left to the kernel's autotuning (small fixed buffers slowed chains down, DESIGN 5).
"""

import asyncio
import errno
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from pipecast.agent.errors import (
    AnswerAbandonedError,
    DataPlaneTlsError,
    ListenError,
    LocalResourceError,
    PeerAuthError,
    PeerClosedError,
    PeerConnectError,
    PeerConnectTimeoutError,
    PeerError,
    PeerNotListeningError,
    PeerProtocolError,
    PeerRefusedError,
    PeerTimeoutError,
)
from pipecast.agent.ratelimit import Pacer
from pipecast.agent.transport.base import (
    Channel,
    ChunkSink,
    ConnectionLimits,
    Listener,
    PeerAuth,
    ServedPackages,
    Transport,
    TransportStats,
    split_address,
)
from pipecast.core.settings import Settings
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
    LIMITED_SEND_SLICE,
    MAX_CHUNK_RESTARTS,
    MAX_HELLO_BYTES,
    PIECE,
    REQ_BLOCK,
    REQ_FILE,
    RESTART,
    SERVE_LOG,
    SERVE_WAIT_IO_TIMEOUTS,
    TCP_HEADER,
    WAIT,
    WAIT_LIMIT_IO_TIMEOUTS,
    ClientHello,
    Header,
    HeardWaits,
    accept_hello,
    answer_request,
    block_request_payload,
    check_answer,
    check_chunk,
    check_message,
    file_answer_limit,
    parse_request,
    range_end,
    refused_by_peer,
    request_payload,
    wait_every_s,
)

log = logging.getLogger(__name__)

MAX_QUEUED_REQUESTS = 8
# A chunk arriving slowly is told to the sink (its relays pass it on) at least this often, whatever relay_bytes is.
PROGRESS_EVERY_S = 0.5
# Let the transport buffer a few chunks before pausing the sender: fewer wake-ups per chunk.
WRITE_HIGH_WATER = 4 << 20
WRITE_LOW_WATER = 1 << 20
# An answer goes to the socket in slices this big, each written once the buffer is below the high water
# mark: a requester that reads nothing makes the server hold at most MAX_BUFFERED_OUTPUT bytes.
WRITE_SLICE = 1 << 20
MAX_BUFFERED_OUTPUT = WRITE_HIGH_WATER + WRITE_SLICE + TCP_HEADER.size
# Connect failures that are this node's shortage, not the peer's: blaming the peer would report a good parent.
LOCAL_CONNECT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})


@dataclass
class _BlockRequest:
    block: int
    next_chunk: int
    end: int  # the chunk after the last one asked for
    count: int
    sink: ChunkSink
    done: asyncio.Future

    def describe(self) -> str:
        return f"block {self.block} (chunk {self.next_chunk} of {self.count})"


@dataclass
class _FileRequest:
    path: str
    limit: int  # the longest answer that fits what was asked for
    done: asyncio.Future

    def describe(self) -> str:
        return f"file {self.path}"


@dataclass
class _HelloStep:
    expected: int  # AUTH_CHALLENGE or AUTH_OK
    done: asyncio.Future

    def describe(self) -> str:
        return "its hello"


_Request = _BlockRequest | _FileRequest | _HelloStep


class _ClientProtocol(asyncio.BufferedProtocol):
    """Receive side of a channel: parses headers, lands chunks in the sink's buffers, keeps deadlines."""

    def __init__(self, peer: str, io_timeout_s: float, stats: TransportStats, have_key: bool,
                 relay_bytes: int = 0, min_rate: float = 0.0) -> None:
        self.peer = peer
        self._have_key = have_key
        self._relay_bytes = relay_bytes  # the sink hears of a chunk's progress every this many bytes (0: never)
        self._in_chunk = False  # a chunk's receive is under way (begun with its buffer, not yet landed or dropped)
        self._chunk: memoryview | None = None  # that chunk's buffer
        self._pieces = False  # it comes as PIECE messages (a CHUNK_PIECES answer)
        self._landing = False  # the target is a slice of the chunk's buffer, from _chunk_at
        self._chunk_at = 0
        self._restarts = 0  # RESTARTs of that chunk
        self.closed_idle = False  # the peer closed the connection while no request was outstanding
        self.heard = False  # a byte of the current request's answer has come
        self._io_timeout_s = io_timeout_s
        # A request's answer must bring this many bytes in each io_timeout_s window (our own pauses left out):
        # a peer trickling a byte now and then is never silent, yet would hold the fetch for hours.
        self._window_min_bytes = min_rate * io_timeout_s
        # WAITs over their bound with fewer bytes between them than the minimum rate asks for are no progress: of the
        # bound's span, the relay's own windows on its parent cover all but one I/O timeout (a parent sending in
        # bursts, at its minimum rate per window, passes them).
        self._waits = HeardWaits(io_timeout_s, (WAIT_LIMIT_IO_TIMEOUTS - 1) * self._window_min_bytes)
        self._progress_at = 0.0  # when the sink last heard of a chunk's progress
        self._window_start = 0.0
        self._window_bytes = 0
        self._stats = stats
        self._ingress: Pacer | None = None  # the request's (its package's priority and the host's)
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(TCP_HEADER.size)
        self._target = memoryview(self._header)
        self._filled = 0
        self._on_complete: Callable[[], None] = self._header_complete
        self.request: _Request | None = None
        self._last_rx = self._loop.time()
        self._watchdog: asyncio.TimerHandle | None = None
        self.error: PeerError | None = None

    # asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        # Rate-limited, a read takes a slice at most: while reading is paused the kernel's buffer fills, and one
        # read into the whole rest of a target would take it all at once, past the bucket's burst.
        end = len(self._target) if self._ingress is None else self._filled + LIMITED_SEND_SLICE
        return self._target[self._filled:end]

    def buffer_updated(self, nbytes: int) -> None:
        self.heard = True
        self._filled += nbytes
        self._window_bytes += nbytes
        self._last_rx = self._loop.time()
        if self._landing and self._relay_bytes:
            at = self._chunk_at + self._filled
            # Every relay_bytes, and from a slow parent at least every PROGRESS_EVERY_S: a relay then passes on
            # what came, not only whole pieces, which a parent at its minimum rate sends in over its wait bound.
            if at < len(self._chunk) and (at // self._relay_bytes > (at - nbytes) // self._relay_bytes
                                          or self._last_rx - self._progress_at >= PROGRESS_EVERY_S):
                self._progress_at = self._last_rx
                request = self.request
                request.sink.chunk_progress(request.block, request.next_chunk, at)
        if self._ingress is not None:
            delay = self._ingress.take(nbytes)
            if delay > 0:
                self.transport.pause_reading()
                self._last_rx += delay  # our own pause is not the peer's silence, nor its slowness
                self._window_start += delay
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
        if self.request is None and self.error is None:
            self.closed_idle = True  # e.g. the server's idle deadline: a new connection may take over
        during = f" while sending {self.request.describe()}" if self.request else ""
        reason = f"{type(exc).__name__}: {exc}" if exc else "end of stream"
        self._fail(PeerClosedError(self.peer, f"closed the connection{during} ({reason})"))

    # requests

    def start(self, request: _Request, message: bytes, ingress: Pacer | None = None,
              relay_bytes: int | None = None) -> None:
        """Send ``request``'s ``message``; its answer's bytes are paced through ``ingress``, and told to the sink every
        ``relay_bytes`` of a chunk (None: as this channel was opened with)."""
        if self.error is not None:
            raise self.error
        if self.request is not None:
            raise RuntimeError(f"channel to {self.peer} already has a request in flight")
        self.request = request
        self.heard = False
        self._ingress = ingress
        if relay_bytes is not None:
            self._relay_bytes = relay_bytes
        self._waits.reset()
        self._last_rx = self._window_start = self._loop.time()
        self._window_bytes = 0
        self._arm_watchdog()
        self.transport.write(message)

    def abort(self, error: PeerError) -> None:
        self._fail(error)

    def _fail(self, exc: Exception) -> None:
        if self._watchdog:
            self._watchdog.cancel()
        if self._in_chunk:  # what landed of it is not the chunk: relays of it give up
            self._in_chunk = self._pieces = self._landing = False
            self._chunk = None
            self.request.sink.chunk_dropped(self.request.block, self.request.next_chunk)
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
        due = self._last_rx
        if self._window_min_bytes > 0:
            due = min(due, self._window_start)
        self._watchdog = self._loop.call_at(due + self._io_timeout_s, self._check_deadlines)

    def _check_deadlines(self) -> None:
        if self.request is None:
            return
        now, timeout = self._loop.time(), self._io_timeout_s
        if now - self._last_rx >= timeout:
            self._fail(PeerTimeoutError(self.peer, f"silent for {timeout:g} s while sending "
                                                   f"{self.request.describe()}"))
            return
        if self._window_min_bytes > 0 and now - self._window_start >= timeout:
            if self._window_bytes < self._window_min_bytes:
                self._fail(PeerTimeoutError(self.peer, f"sent {self._window_bytes} bytes in {timeout:g} s while "
                                                       f"sending {self.request.describe()}, fewer than the "
                                                       f"{self._window_min_bytes:.0f} its minimum rate asks for"))
                return
            self._window_start, self._window_bytes = now, 0
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
        if self._pieces:
            self._piece_header(header, request)
            return
        if isinstance(request, _HelloStep):
            check_answer(header, request.expected, request.describe(), self.peer, MAX_HELLO_BYTES)
        elif isinstance(request, _FileRequest):
            check_answer(header, FILE, request.describe(), self.peer, request.limit)
        else:
            check_answer(header, (CHUNK, CHUNK_PIECES), request.describe(), self.peer, block=request.block)
        if header.kind == WAIT:
            self._waited(request)
        elif header.kind == ERROR:
            self._expect(memoryview(bytearray(header.length)), self._error_complete)
        elif header.kind == AUTH_FAIL:
            if self._have_key and not isinstance(request, _HelloStep):  # keyed, the hello is behind us
                raise PeerProtocolError(self.peer, f"answered {request.describe()} with an authentication failure "
                                                   "after its hello had succeeded")
            self._expect(memoryview(bytearray(header.length)), self._auth_failed)
        elif header.kind in (CHUNK, CHUNK_PIECES):
            buffer = request.sink.chunk_buffer(request.block, request.next_chunk)
            # The sink counts a receive from here: a refused header must end it too (_fail drops it).
            self._in_chunk = True
            self._chunk, self._chunk_at, self._restarts = buffer, 0, 0
            check_chunk(header, request.block, request.next_chunk, len(buffer), self.peer)
            if header.kind == CHUNK:
                self._land(0, len(buffer))
            else:
                self._pieces = True
                self._expect_header()
        elif isinstance(request, _HelloStep):
            self._expect(memoryview(bytearray(header.length)), self._hello_complete)
        else:
            self._expect(memoryview(bytearray(header.length)), self._file_complete)

    def _piece_header(self, header: Header, request: "_BlockRequest") -> None:
        """A message inside a ``CHUNK_PIECES`` answer: its next bytes, a WAIT, or a RESTART of the chunk."""
        block, chunk = request.block, request.next_chunk
        if header.block != block or header.chunk != chunk:
            raise PeerProtocolError(self.peer, f"sent a message of chunk {header.chunk} of block {header.block} "
                                               f"inside chunk {chunk} of block {block}")
        if header.kind == PIECE and 0 < header.length <= len(self._chunk) - self._chunk_at:
            self._land(self._chunk_at, header.length)
        elif header.kind == WAIT and not header.length:
            self._waited(request)
        elif header.kind == RESTART and not header.length:
            self._restarts += 1
            if self._restarts > MAX_CHUNK_RESTARTS:
                raise PeerProtocolError(self.peer, f"restarted chunk {chunk} of block {block} more than "
                                                   f"{MAX_CHUNK_RESTARTS} times")
            # Its receive failed at the relay, and a new one began: what came of the chunk is dropped, here too.
            self._waits.dropped(self._chunk_at)
            request.sink.chunk_dropped(block, chunk)
            self._chunk = request.sink.chunk_buffer(block, chunk)
            self._chunk_at = 0
            self._expect_header()
        else:
            raise PeerProtocolError(self.peer, f"sent message type {header.kind} of {header.length} bytes inside "
                                               f"chunk {chunk} of block {block} ({self._chunk_at} of its "
                                               f"{len(self._chunk)} bytes in)")

    def _waited(self, request: _Request) -> None:
        """A ``WAIT``: the peer waits on its own source. Its silence deadline was met (the header's bytes), and
        its minimum rate starts again (a wait is not slowness), within :class:`HeardWaits`'s bound."""
        self._waits.heard(self._loop.time(), self.peer, request.describe())
        self._window_start, self._window_bytes = self._loop.time(), 0
        self._expect_header()

    def _land(self, at: int, length: int) -> None:
        """Receive ``length`` bytes of the chunk into its buffer from ``at``."""
        self._chunk_at, self._landing = at, True
        self._expect(self._chunk[at:at + length], self._landed)

    def _landed(self) -> None:
        self._landing = False
        self._chunk_at += len(self._target)
        self._waits.progressed(len(self._target))
        if self._chunk_at == len(self._chunk):
            self._chunk_complete()
        else:
            self._expect_header()  # the next PIECE, WAIT or RESTART

    def _expect_header(self) -> None:
        self._target = memoryview(self._header)
        self._filled = 0
        self._on_complete = self._header_complete

    def _next_header(self) -> memoryview:
        payload = self._target
        self._expect_header()
        return payload

    def _chunk_complete(self) -> None:
        request, size = self.request, len(self._chunk)
        self._in_chunk = self._pieces = False
        self._chunk = None
        self._expect_header()
        request.sink.chunk_landed(request.block, request.next_chunk, self.peer)
        self._stats.bytes_received += size
        request.next_chunk += 1
        if request.next_chunk == request.end:
            self._finish()

    def _file_complete(self) -> None:
        payload = self._next_header()
        self._waits.progressed(len(payload))
        self._stats.bytes_received += len(payload)
        self._finish(payload.tobytes())

    def _hello_complete(self) -> None:
        self._finish(self._next_header().tobytes())

    def _error_complete(self) -> None:
        payload = self._next_header()
        raise PeerRefusedError(self.peer, bytes(payload).decode("utf-8", "replace"))

    def _auth_failed(self) -> None:
        payload = self._next_header()
        raise refused_by_peer(self.peer, bytes(payload).decode("utf-8", "replace"), self._have_key)


class TcpChannel(Channel):
    """A TCP connection to one peer agent. If the peer closed it while it was idle (the peer's idle
    deadline), the next request opens a new one first; if that close crossed the request (a connection that
    answered before, closed with nothing of the answer come), the request goes once more on a new one."""

    def __init__(self, peer: str, protocol: _ClientProtocol, requester: str, address: str,
                 transport: "TcpTransport") -> None:
        self.peer = peer
        self._protocol = protocol
        self._requester = requester
        self._address = address
        self._transport = transport
        self._closed = False
        self._answered = False  # the connection answered a request: its peer may close it for idleness

    async def _run(self, request: _Request, message: bytes, package_id: str) -> None:
        if self._protocol.closed_idle and not self._closed:
            log.debug("peer %s closed an idle channel; connecting again", self.peer)
            await self._reconnect()
        try:
            await self._request(request, message, package_id)
        except PeerClosedError:
            # The peer's idle deadline may have closed the connection as the request went out: no failure of the
            # peer's. A new connection (nothing to be idle about) or an answer begun is closed by the peer's fault.
            if not self._answered or self._protocol.heard or self._closed:
                raise
            log.debug("peer %s closed an idle channel as a request went out; connecting again", self.peer)
            await self._reconnect()
            request.done = asyncio.get_running_loop().create_future()
            await self._request(request, message, package_id)
        self._answered = True

    async def _reconnect(self) -> None:
        self._protocol = await self._transport.open_protocol(self._address, self.peer)
        self._answered = False

    async def _request(self, request: _Request, message: bytes, package_id: str) -> None:
        self._protocol.start(request, message, self._transport.limits.ingress_for(package_id),
                             self._transport.relay_bytes_for(package_id))
        try:
            await request.done
        except asyncio.CancelledError:
            # Half a block may be on the wire; the connection cannot carry another request.
            self._protocol.abort(PeerClosedError(self.peer, "channel closed by a cancelled request"))
            raise

    async def fetch_block(self, package_id: str, block: int, first_chunk: int, sink: ChunkSink,
                          end_chunk: int | None = None) -> None:
        count = sink.chunk_count(block)
        end = range_end(block, first_chunk, end_chunk, count)
        if first_chunk >= end:
            return
        payload = block_request_payload(package_id, self._requester, end, count)
        request = _BlockRequest(block, first_chunk, end, count, sink, asyncio.get_running_loop().create_future())
        await self._run(request, TCP_HEADER.pack(Header(REQ_BLOCK, block, first_chunk, len(payload))) + payload,
                        package_id)

    async def fetch_file(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        payload = request_payload(package_id, self._requester, path)
        request = _FileRequest(path, file_answer_limit(path, length), asyncio.get_running_loop().create_future())
        await self._run(request, TCP_HEADER.pack(Header(REQ_FILE, offset, length, len(payload))) + payload,
                        package_id)
        return request.done.result()

    async def close(self) -> None:
        self._closed = True
        if self._protocol.transport is not None and not self._protocol.transport.is_closing():
            self._protocol.transport.close()


async def _client_hello(protocol: _ClientProtocol, auth: PeerAuth, peer: str) -> None:
    """The requester's side of the hello (:mod:`.wire`) on a new connection."""
    loop = asyncio.get_running_loop()
    hello = ClientHello(auth, TCP_HEADER, peer)

    async def step(kind: int, payload: bytes, expected: int) -> bytes:
        request = _HelloStep(expected, loop.create_future())
        protocol.start(request, TCP_HEADER.pack(Header(kind, length=len(payload))) + payload)
        return await request.done

    challenge = await step(AUTH_HELLO, hello.hello(), AUTH_CHALLENGE)
    await step(AUTH_PROOF, hello.proof(challenge), AUTH_OK)


class _ServerProtocol(asyncio.Protocol):
    """Serve side of one connection: the hello, then queued requests, each answered with chunks as soon
    as this node has them; deadlines on the peer's silence (see the module docstring)."""

    def __init__(self, listener: "TcpListener") -> None:
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._inbox = bytearray()
        self._requests: asyncio.Queue = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._host = ""
        self._counted = False
        self._greeted = False  # the hello (or, with auth off, the first request) is behind us
        self._partial_since = 0.0  # when the inbox began to hold part of a message
        self._waiting_since: float | None = None  # when the server began to wait for the next message
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.peer = "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        host, port = transport.get_extra_info("peername")[:2]
        self._host, self.peer = host, f"{host}:{port}"
        refused = self._listener.limits.admit(host, self)
        if refused is not None:
            SERVE_LOG.log(logging.WARNING, "refusing a connection from %s: %s", self.peer, refused)
            self._transport.abort()
            return
        if self._listener.tls.server is None:
            self._transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        else:  # the bytes are the TLS handshake's: _start_tls hands them to asyncio's TLS layer
            self._transport.pause_reading()
        self._counted = True
        self._listener.connections.add(self)
        self._waiting_since = self._loop.time()
        self._arm()
        self._worker = self._loop.create_task(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        self._can_write.set()
        if self._worker:
            self._worker.cancel()

    def _forget(self) -> None:
        """The connection has ended: it no longer counts toward the limits, nor has a deadline."""
        if self._counted:
            self._counted = False
            self._listener.limits.release(self._host, self)
        self._listener.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()

    def evicted(self) -> None:
        """Every slot is taken and this connection has waited longest in its hello: it makes room (see
        :class:`~.base.ConnectionLimits`)."""
        self._counted = False
        SERVE_LOG.log(logging.WARNING, "closing %s, still in its hello, to make room for a newer connection",
                      self.peer)
        self._transport.abort()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def data_received(self, data: bytes) -> None:
        if not self._inbox:
            self._partial_since = self._loop.time()
        self._inbox += data
        while len(self._inbox) >= TCP_HEADER.size:
            try:
                header = TCP_HEADER.parse(self._inbox, self.peer)
                check_message(header, self.peer)
                if self._requests.qsize() >= MAX_QUEUED_REQUESTS:
                    raise PeerProtocolError(self.peer, f"sent more than {MAX_QUEUED_REQUESTS} requests at once")
            except PeerProtocolError as exc:
                SERVE_LOG.log(logging.WARNING, "%s; closing", exc)
                self._transport.abort()
                return
            end = TCP_HEADER.size + header.length
            if len(self._inbox) < end:
                break
            payload = bytes(self._inbox[TCP_HEADER.size:end])
            del self._inbox[:end]
            self._partial_since = self._loop.time()
            self._waiting_since = None
            self._requests.put_nowait((header, payload))
        self._arm()

    # deadlines

    def _due(self) -> tuple[float, str] | None:
        """When the peer's silence ends this connection, and how to say why; None: no deadline now."""
        io_timeout, dues = self._listener.io_timeout_s, []
        if self._inbox:
            dues.append((self._partial_since + io_timeout,
                         f"sent part of a message, then nothing for {io_timeout:g} s"))
        if self._waiting_since is not None:
            if self._greeted:
                limit = self._listener.idle_timeout_s
                dues.append((self._waiting_since + limit, f"sent no request for {limit:g} s"))
            else:
                dues.append((self._waiting_since + io_timeout, f"sent no complete message for {io_timeout:g} s"))
        return min(dues) if dues else None

    def _arm(self) -> None:
        due = self._due()
        if due is None:
            return
        if self._timer is None or due[0] < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = due[0]
            self._timer = self._loop.call_at(due[0], self._check_deadline)

    def _check_deadline(self) -> None:
        self._timer = None
        due = self._due()
        if due is None or self._transport is None or self._transport.is_closing():
            return
        if self._loop.time() >= due[0]:
            SERVE_LOG.log(logging.INFO, "peer %s %s; closing", self.peer, due[1])
            self._transport.abort()
        else:
            self._arm()

    async def _receive(self) -> tuple[Header, bytes]:
        if self._requests.empty():
            self._waiting_since = self._loop.time()
            self._arm()
        message = await self._requests.get()
        self._waiting_since = None
        return message

    def abort(self) -> None:
        self._transport.abort()

    async def _start_tls(self) -> bool:
        """The TLS handshake, on a connection already counted toward the limits (a server made with ``ssl=`` shows
        its protocol the connection only once the handshake is done: silent connections then held a file
        descriptor each, uncounted, until the agent ran out of them). Within the deadline of a first message
        (``io_timeout_s`` from the connect); False where it failed or the connection was closed."""
        try:
            transport = await self._loop.start_tls(self._transport, self, self._listener.tls.server,
                                                   server_side=True)
        except OSError as exc:  # a certificate the cluster's CA did not sign, a reset, ...
            SERVE_LOG.log(logging.INFO, "TLS handshake with %s failed (%s); closing", self.peer,
                          _ssl_reason(exc) or type(exc).__name__)
            transport = None
        except BaseException:  # asyncio's TLS layer holds the socket and calls no connection_lost: leave the limits
            self._forget()
            raise
        if transport is None:  # or closed by its deadline or an eviction: asyncio calls no connection_lost then
            self._forget()
            return False
        self._transport = transport
        self._transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        self._waiting_since = self._loop.time()  # its first message has io_timeout_s, as without TLS
        self._arm()
        return True

    async def _serve(self) -> None:
        listener = self._listener
        try:
            if listener.tls.server is not None and not await self._start_tls():
                return
            node, first = await accept_hello(listener.auth, TCP_HEADER, self._receive, self._send, self.peer,
                                             listener.key_wait_s)
            self._greeted = True
            listener.limits.greeted(self)
            message = first or await self._receive()
            while True:
                request = parse_request(*message, self.peer)
                self.peer = f"{request.requester}@{self._host}"
                await answer_request(listener.served, request, partial(self._send, package_id=request.package_id),
                                     self.peer, authenticated=node,
                                     wait_s=SERVE_WAIT_IO_TIMEOUTS * listener.io_timeout_s,
                                     wait_every_s=wait_every_s(listener.io_timeout_s),
                                     stream=partial(self._send_stream, package_id=request.package_id)
                                     if listener.relay_bytes else None)
                message = await self._receive()
        except PeerAuthError as exc:  # refused in the hello: it was told why; close once that is sent
            SERVE_LOG.log(logging.WARNING, "%s; closing", exc)
            self._transport.close()
        except PeerError as exc:  # the requester broke the protocol, stopped reading or went away
            SERVE_LOG.log(logging.WARNING, "%s; closing", exc)
            self._transport.abort()
        except AnswerAbandonedError as exc:  # this node's upstream failed mid-chunk; the requester retries
            SERVE_LOG.log(logging.INFO, "%s; closing", exc)
            self._transport.abort()
        except Exception:
            log.exception("serving %s failed", self.peer)
            self._transport.abort()

    async def _send(self, header: Header, payload: memoryview, package_id: str = "") -> None:
        """Send one message, in slices, waiting for the socket to drain after each: an answer (of
        ``package_id``) paced at its egress limit and counted; an ``ERROR`` or hello message at once."""
        self._transport.write(TCP_HEADER.pack(header))
        answer = header.kind in (CHUNK, FILE)
        await self._write(payload, self._listener.limits_rate.egress_for(package_id) if answer else None, answer)
        await self._drain()

    async def _send_stream(self, header: Header, first: memoryview,
                           more: Callable[[], Awaitable[memoryview | None]], package_id: str = "") -> None:
        """Send a ``CHUNK_PIECES`` answer whose bytes are still arriving: ``first``, then what ``more`` gives
        until the header's length is out, each part a ``PIECE`` whose payload goes as :meth:`_send` sends one
        (``more`` giving None: a ``RESTART``, and the chunk's bytes from its first again)."""
        egress = self._listener.limits_rate.egress_for(package_id)
        self._transport.write(TCP_HEADER.pack(header))
        part: memoryview | None = first
        sent = 0
        while True:
            if part is None:
                self._transport.write(TCP_HEADER.pack(Header(RESTART, header.block, header.chunk)))
                sent = 0
            else:
                self._transport.write(TCP_HEADER.pack(Header(PIECE, header.block, header.chunk, len(part))))
                await self._write(part, egress, True)
                sent += len(part)
            if sent >= header.length:
                break
            part = await more()
        await self._drain()

    async def _write(self, payload: memoryview, egress: Pacer | None, answer: bool) -> None:
        step = LIMITED_SEND_SLICE if egress is not None else WRITE_SLICE
        for start in range(0, len(payload), step):
            piece = payload[start:start + step]
            if egress is not None:
                delay = egress.take(len(piece))
                if delay > 0:
                    await asyncio.sleep(delay)
            await self._drain()
            self._transport.write(piece)
            if answer:
                self._listener.stats.bytes_sent += len(piece)

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

    def __init__(self, served: ServedPackages, transport: "TcpTransport") -> None:
        self.served = served
        self.auth = transport.auth
        self.tls = transport.tls
        self.limits_rate = transport.limits
        self.stats = transport.stats
        self.io_timeout_s = transport.io_timeout_s
        self.key_wait_s = transport.key_wait_s
        self.idle_timeout_s = transport.idle_timeout_s
        self.relay_bytes = transport.relay_bytes
        self.limits = ConnectionLimits(transport.max_connections, transport.max_connections_per_address)
        self.connections: set[_ServerProtocol] = set()
        self.address = ""
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port (port 0: any free one); :class:`ListenError` where it cannot."""
        try:
            # Without ssl=: a connection counts toward the limits before its TLS handshake (_ServerProtocol._start_tls).
            self._server = await asyncio.get_running_loop().create_server(lambda: _ServerProtocol(self), host, port)
        except OSError as exc:
            # asyncio words a busy port "error while attempting to bind on address (...): address already in use".
            raise ListenError(host, port, (exc.strerror or str(exc)).rpartition(": ")[2]) from None
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


@dataclass(frozen=True)
class DataPlaneTls:
    """The TLS contexts of the TCP data plane: mutual TLS when the node has a certificate, its key and the
    cluster's CA (``tls_cert``, ``tls_key``, ``tls_ca``), else none (the hello still authenticates peers)."""

    server: ssl.SSLContext | None = None
    client: ssl.SSLContext | None = None

    @classmethod
    def from_files(cls, cert: Path | None, key: Path | None, ca: Path | None) -> "DataPlaneTls":
        """The contexts from the node's files; :class:`DataPlaneTlsError` naming the file that cannot be used."""
        if not (cert and key and ca):
            if cert or key or ca:
                log.warning("data plane without TLS: mutual TLS needs tls_cert, tls_key and tls_ca all set")
            return cls()
        # OpenSSL's errors name no file: each is read first, so a missing or unreadable one is named.
        for path, setting in ((cert, "tls_cert"), (key, "tls_key"), (ca, "tls_ca")):
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise DataPlaneTlsError(f"cannot read the data plane's TLS file {path} ({setting}): "
                                        f"{exc.strerror or exc}") from None
        try:
            server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca))
            client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
        except ssl.SSLError as exc:
            raise DataPlaneTlsError(f"the data plane's TLS CA {ca} (tls_ca) holds no usable PEM certificate "
                                    f"({_ssl_reason(exc)})") from None
        server.verify_mode = ssl.CERT_REQUIRED  # only nodes whose certificate the cluster's CA signed
        # Peers are addressed by whatever address they advertise; membership is the CA's signature, and
        # the node identity the hello's (a certificate per node address would tie certificates to IPs).
        client.check_hostname = False
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            try:
                context.load_cert_chain(str(cert), str(key))
            except ssl.SSLError as exc:
                raise DataPlaneTlsError(f"the data plane's TLS certificate {cert} (tls_cert) and key {key} "
                                        f"(tls_key) cannot be used: not PEM, or the key is not the certificate's "
                                        f"({_ssl_reason(exc)})") from None
        return cls(server, client)


def _ssl_reason(exc: ssl.SSLError) -> str:
    """OpenSSL's words for ``exc``, without the source line of CPython's ``_ssl.c`` that ends them."""
    text = exc.strerror if isinstance(exc.strerror, str) else str(exc)
    return text.split(" (_ssl.c:")[0]


class TcpTransport(Transport):
    """asyncio TCP with application-level rate limits; :mod:`.wire` describes the wire format; mutual TLS
    when the node's settings name a certificate, its key and the cluster's CA."""

    name = "tcp"

    def __init__(self, node_id: str, settings: Settings, auth: PeerAuth | None = None) -> None:
        super().__init__(node_id, settings, auth)
        self.tls = DataPlaneTls.from_files(settings.tls_cert, settings.tls_key, settings.tls_ca)

    async def listen(self, host: str, port: int, served: ServedPackages) -> TcpListener:
        self._listening()
        listener = TcpListener(served, self)
        await listener.start(host, port)
        return listener

    async def open_protocol(self, address: str, peer: str) -> _ClientProtocol:
        """A new connection to ``address``, through the hello when this node has a data-plane key."""
        host, port = split_address(address)
        key = self.auth.key
        protocol = _ClientProtocol(peer, self.io_timeout_s, self.stats, bool(key), self.relay_bytes,
                                   self.io_min_rate_mbit * 1e6 / 8)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: protocol, host, port, ssl=self.tls.client,
                                             server_hostname=host if self.tls.client else None)
                if key:
                    await _client_hello(protocol, self.auth, peer)
        except TimeoutError:
            protocol.abort(PeerConnectError(peer, "gave up connecting"))
            raise PeerConnectTimeoutError(peer, f"no connection to {address} within {self.connect_timeout_s:g} "
                                                "s") from None
        # TLS and resolver errors before other OSErrors: their errnos are OpenSSL's and getaddrinfo's, not the OS's.
        except ssl.SSLCertVerificationError as exc:
            raise PeerConnectError(peer, f"TLS handshake with {address} failed: its certificate is not trusted "
                                         f"here ({exc.verify_message})") from None
        except ssl.SSLError as exc:
            raise PeerConnectError(peer, f"TLS handshake with {address} failed ({exc})") from None
        except socket.gaierror as exc:
            raise PeerConnectError(peer, f"cannot resolve {address} ({exc.strerror})") from None
        except OSError as exc:
            # asyncio's own errors may have no errno, nor text (a connection lost mid-handshake): then their type
            reason = os.strerror(exc.errno) if exc.errno else (str(exc) or type(exc).__name__)
            if exc.errno in LOCAL_CONNECT_ERRNOS:
                raise LocalResourceError(f"cannot connect to {address}: {reason} on this node") from None
            if exc.errno == errno.ECONNREFUSED:
                raise PeerNotListeningError(peer, f"cannot connect to {address} ({reason}: nothing listens "
                                                  "there)") from None
            raise PeerConnectError(peer, f"cannot connect to {address} ({reason})") from None
        except BaseException as exc:
            protocol.abort(exc if isinstance(exc, PeerError) else PeerClosedError(peer, "connection abandoned"))
            raise
        return protocol

    async def connect(self, address: str, peer: str) -> TcpChannel:
        return TcpChannel(peer, await self.open_protocol(address, peer), self.node_id, address, self)
