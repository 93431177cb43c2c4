"""The UCX transport on ucxx: the data path for RDMA fabrics and GPU memory (TCP stays the CPU default).

Same semantics as the TCP backend (``tcp.py``): a listener serves "block b from chunk k" as each chunk
becomes present (cut-through), a channel receives every chunk straight into the store's buffer, every
wait has a deadline, and a failing peer is a typed :class:`~pipecast.agent.errors.PeerError` naming it.

Messages are :mod:`.wire`'s: a 24-byte header (:data:`~.wire.UCX_HEADER`) on tag ``TAG_HEADER`` announces
each payload, which follows on ``TAG_PAYLOAD`` in frames. A channel ends with ``CLOSE``, answered by
``CLOSE_ACK``.

ucxx pitfalls measured on this project's machines (DESIGN 6), each handled where marked "pitfall":
notifier-thread mode, stopping that thread, integer tags, UCX_TLS with tcp, a header before each
payload, byte views, ack before close, refused connections, UCX_NET_DEVICES. ucxx is imported only
inside the functions that use it, so the registry can name this module on nodes without the extra.
"""

import asyncio
import errno
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from pipecast.agent.errors import (
    PeerClosedError,
    PeerConnectError,
    PeerError,
    PeerProtocolError,
    PeerRefusedError,
    PeerTimeoutError,
    TransportUnavailableError,
)
from pipecast.agent.ratelimit import HostRateLimits
from pipecast.agent.transport.base import (
    Channel,
    ChunkSink,
    Listener,
    ServedPackages,
    Transport,
    TransportStats,
    split_address,
)
from pipecast.agent.transport.registry import accelerated_fabric_present
from pipecast.agent.transport.wire import (
    CHUNK,
    CLOSE,
    CLOSE_ACK,
    ERROR,
    FILE,
    LIMITED_SEND_SLICE,
    REQ_BLOCK,
    REQ_FILE,
    UCX_HEADER,
    Header,
    answer_request,
    byte_view,
    check_answer,
    check_chunk,
    check_request,
    frames,
    parse_request,
    request_payload,
)
from pipecast.core.settings import Settings

if TYPE_CHECKING:
    from ucxx._lib_async import ApplicationContext, Endpoint

log = logging.getLogger(__name__)

# Pitfall: a receiver must post a buffer of the message's size, so a fixed-size header (wire.UCX_HEADER) on
# its own tag announces each payload.
# Pitfall: integer tags only. ucxx hashes a user tag with the endpoint's own tag; a str tag goes through
# hash(), which differs per process, so the two ends would never match and the receive hangs silently.
TAG_HEADER, TAG_PAYLOAD = 1, 2
# How often a connect attempt checks whether UCX has already failed its endpoint.
CONNECT_POLL_S = 0.005
# Bound on waiting for ucxx to retire the connection handlers of a closed listener.
LISTENER_DRAIN_S = 1.0
# Bound on a channel's goodbye (CLOSE, CLOSE_ACK, the endpoint closing): shutdown never waits on a silent peer.
GOODBYE_S = 1.0

_T = TypeVar("_T")


def _ucx_reason(exc: BaseException) -> str:
    """A UCX error's text without the endpoint address ucxx puts in front ("Endpoint 0x.. error: ")."""
    text = str(exc)
    return text.rpartition(" error: ")[2] or type(exc).__name__


def _tls_allows_tcp(tls: str) -> bool:
    names = [t.strip() for t in tls.lstrip("^").split(",")]
    return "tcp" not in names if tls.startswith("^") else ("all" in names or "tcp" in names)


class _UcxRuntime:
    """The process's ucxx context, shared by every UCX transport of the process and tied to one event loop.

    The first transport to need it creates it; the last one to close stops it, so a process (an agent,
    a test) can exit and a later event loop can start afresh.
    """

    def __init__(self) -> None:
        self.context: "ApplicationContext | None" = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.users = 0
        self._exit_hook = False

    def acquire(self) -> "ApplicationContext":
        loop = asyncio.get_running_loop()
        if self.context is not None and self.loop is not loop:
            raise TransportUnavailableError("transport 'ucx' is already in use by another event loop of this "
                                            "process (ucxx delivers completions to one loop)")
        if self.context is None:
            self.context = self._start()
            self.loop = loop
        self.users += 1
        return self.context

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.stop()

    def _start(self) -> "ApplicationContext":
        try:
            import ucxx  # noqa: F401  (loads libucx and sets ucxx's environment defaults)
            from ucxx._lib_async import ApplicationContext
        except ImportError as exc:
            raise TransportUnavailableError(f"transport 'ucx' cannot be used on this node: ucxx does not "
                                            f"import ({exc})") from None
        options = {}
        tls = os.environ.get("UCX_TLS")
        if tls is None and not accelerated_fabric_present():
            # Pitfall: listeners need the tcp transport. Without a GPU or RDMA device there is nothing else
            # to use; elsewhere UCX's own default ("all", tcp included) keeps its RDMA and CUDA transports.
            options["TLS"] = "tcp,sm,self"
        elif tls is not None and not _tls_allows_tcp(tls):
            log.warning("UCX_TLS=%s leaves out tcp: this agent's listener cannot accept connections", tls)
        # Pitfall: Python-future mode (a notifier thread waits for completions); the other modes poll and
        # burn a core. It needs the progress thread mode.
        context = ApplicationContext(options, progress_mode="thread", enable_python_future=True)
        # Pitfall: UCX_NET_DEVICES pins the interface when the operator gives it (UCX reads it from the
        # environment; the emulated cluster sets cluster.interface(host)); unset, UCX picks the devices.
        log.info("ucx %s: transports %s, network devices %s", ucxx.__ucx_version__, context.config.get("TLS"),
                 context.config.get("NET_DEVICES"))
        if not self._exit_hook:
            # Pitfall: the notifier thread is not a daemon, so a process that never closed its transport
            # would hang at exit. threading's exit hooks run before non-daemon threads are joined (atexit
            # runs after, too late); concurrent.futures relies on the same hook.
            threading._register_atexit(self._stop_at_exit)
            self._exit_hook = True
        return context

    def stop(self) -> None:
        """Stop the notifier and progress threads and drop the context (idempotent)."""
        context, self.context, self.loop = self.context, None, None
        if context is None:
            return
        # Pitfall: stop the notifier thread, else the process hangs at exit. Waking it first makes the stop
        # immediate (on its own it notices only after its 1 s wait); a thread woken between two waits takes
        # the wake-up as a shutdown but marks itself running again, so mark it stopped once it has ended
        # (else the worker's destructor warns that it is still running).
        context.worker.stop_request_notifier_thread()
        context.stop_notifier_thread()
        context.worker.stop_request_notifier_thread()
        # ucxx keys progress threads by event loop: clearing them lets a later context on the same loop
        # start its own instead of finding this one's.
        context.clear_progress_tasks()

    def _stop_at_exit(self) -> None:
        if self.context is not None:
            log.warning("a UCX transport was not closed; stopping ucxx at exit")
            self.stop()


_RUNTIME = _UcxRuntime()


async def _with_deadline(awaitable: Awaitable[_T], timeout_s: float, on_timeout: Callable[[], PeerError]) -> _T:
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise on_timeout() from None


class _Link:
    """One endpoint's message layer: headers and framed payloads on the two integer tags, with deadlines."""

    def __init__(self, endpoint: "Endpoint", peer: str, io_timeout_s: float, limits: HostRateLimits,
                 stats: TransportStats) -> None:
        self.endpoint = endpoint
        self.peer = peer
        self.io_timeout_s = io_timeout_s
        self.limits = limits
        self.stats = stats

    async def send(self, header: Header, payload: memoryview, on_timeout: Callable[[], PeerError],
                   paced: bool) -> None:
        """Send ``header``, then ``payload`` (bytes) in frames of ``header.frame``; ``paced``: at the egress
        limit (answers are, requests and errors are not, as with TCP)."""
        await _with_deadline(self.endpoint.send(UCX_HEADER.pack(header), tag=TAG_HEADER), self.io_timeout_s, on_timeout)
        egress = self.limits.egress if paced else None
        for start, end in frames(len(payload), header.frame):
            if egress is not None:
                delay = egress.take(end - start)
                if delay > 0:
                    await asyncio.sleep(delay)
            await _with_deadline(self.endpoint.send(payload[start:end], tag=TAG_PAYLOAD), self.io_timeout_s,
                                 on_timeout)

    async def recv_header(self, on_timeout: Callable[[], PeerError] | None) -> Header:
        """The next header; ``on_timeout`` None waits without a deadline (an idle connection)."""
        raw = bytearray(UCX_HEADER.size)
        receive = self.endpoint.recv(raw, tag=TAG_HEADER)
        await (receive if on_timeout is None else _with_deadline(receive, self.io_timeout_s, on_timeout))
        return UCX_HEADER.parse(raw, self.peer)

    async def recv_payload(self, target: memoryview, frame: int, on_timeout: Callable[[], PeerError],
                           paced: bool) -> None:
        """Receive a payload in frames of ``frame`` into ``target`` (bytes) in place: when that is the
        store's buffer, UCX writes there directly, with no copy. ``paced``: at the ingress limit."""
        ingress = self.limits.ingress if paced else None
        for start, end in frames(len(target), frame):
            await _with_deadline(self.endpoint.recv(target[start:end], tag=TAG_PAYLOAD), self.io_timeout_s,
                                 on_timeout)
            if ingress is not None:
                delay = ingress.take(end - start)
                if delay > 0:
                    await asyncio.sleep(delay)  # before the next receive is posted: the sender waits for it

    def abort(self) -> None:
        """Close at once; receives still posted are cancelled, so no late byte lands in a buffer."""
        self.endpoint.abort()


@dataclass
class _Progress:
    """What a channel's current request is at, for error messages."""

    what: str
    block: int = 0
    next_chunk: int = 0
    count: int = 0

    def describe(self) -> str:
        if self.what == "block":
            return f"block {self.block} (chunk {self.next_chunk} of {self.count})"
        return self.what


class UcxChannel(Channel):
    """A UCX endpoint to one peer agent; one request at a time."""

    def __init__(self, peer: str, link: _Link, requester: str, on_close: Callable[["UcxChannel"], None]) -> None:
        self.peer = peer
        self._link = link
        self._requester = requester
        self._on_close = on_close
        self._progress: _Progress | None = None
        self._broken: PeerError | None = None
        self._closed = False

    @asynccontextmanager
    async def _request(self, progress: _Progress) -> AsyncIterator[None]:
        from ucxx.exceptions import UCXError, UCXMessageTruncatedError

        if self._closed or self._broken is not None:
            raise self._broken or PeerClosedError(self.peer, "channel already closed")
        if self._progress is not None:
            raise RuntimeError(f"channel to {self.peer} already has a request in flight")
        self._progress = progress
        try:
            yield
        except BaseException as exc:
            # Abort before anything else runs: a receive still posted must not write into a buffer that
            # a fallback fetch is about to reuse.
            self._link.abort()
            error = exc
            if isinstance(exc, UCXMessageTruncatedError):
                error = PeerProtocolError(self.peer, f"sent a message longer than announced while sending "
                                                     f"{progress.describe()}")
            elif isinstance(exc, UCXError):
                error = PeerClosedError(self.peer, f"closed the connection while sending {progress.describe()} "
                                                   f"({type(exc).__name__}: {_ucx_reason(exc)})")
            if isinstance(exc, asyncio.CancelledError):
                # Half a block may be on the wire; the endpoint cannot carry another request.
                self._broken = PeerClosedError(self.peer, "channel closed by a cancelled request")
            else:
                self._broken = error if isinstance(error, PeerError) else PeerProtocolError(self.peer, str(error))
            if error is exc:
                raise
            raise error from None
        finally:
            self._progress = None

    def _silent(self) -> PeerTimeoutError:
        what = self._progress.describe() if self._progress else "its answer"
        return PeerTimeoutError(self.peer, f"silent for {self._link.io_timeout_s:g} s while sending {what}")

    async def _ask(self, kind: int, block: int, chunk: int, payload: bytes) -> None:
        # The frame asked for: small when this node's ingress is limited, so the limit paces a smooth stream.
        frame = LIMITED_SEND_SLICE if self._link.limits.ingress is not None else 0
        # The request itself goes whole (its header's frame field is about the answer).
        await self._link.send(Header(kind, block, chunk, len(payload), frame), memoryview(payload), self._silent,
                              paced=False)

    async def _answer(self, expected: int, progress: _Progress) -> Header:
        """The next answer header; an ERROR answer is raised as :class:`PeerRefusedError`."""
        header = await self._link.recv_header(self._silent)
        check_answer(header, expected, progress.describe(), self.peer)
        if header.kind == ERROR:
            text = bytearray(header.length)
            await self._link.recv_payload(memoryview(text), header.frame, self._silent, paced=False)
            raise PeerRefusedError(self.peer, text.decode("utf-8", "replace"))
        return header

    async def fetch_block(self, package_id: str, block: int, first_chunk: int, sink: ChunkSink) -> None:
        count = sink.chunk_count(block)
        if first_chunk >= count:
            return
        progress = _Progress("block", block, first_chunk, count)
        async with self._request(progress):
            await self._ask(REQ_BLOCK, block, first_chunk, request_payload(package_id, self._requester))
            for chunk in range(first_chunk, count):
                progress.next_chunk = chunk
                header = await self._answer(CHUNK, progress)
                # Pitfall: byte views only: lengths and frame offsets are in bytes, as is what ucxx receives.
                buffer = byte_view(sink.chunk_buffer(block, chunk))
                check_chunk(header, block, chunk, len(buffer), self.peer)
                await self._link.recv_payload(buffer, header.frame, self._silent, paced=True)
                sink.chunk_landed(block, chunk, self.peer)
                self._link.stats.bytes_received += header.length

    async def fetch_file(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        progress = _Progress(f"file {path}")
        async with self._request(progress):
            await self._ask(REQ_FILE, offset, length, request_payload(package_id, self._requester, path))
            header = await self._answer(FILE, progress)
            data = bytearray(header.length)
            await self._link.recv_payload(memoryview(data), header.frame, self._silent, paced=True)
            self._link.stats.bytes_received += header.length
            return bytes(data)

    async def _goodbye(self) -> None:
        await self._link.send(Header(CLOSE), memoryview(b""), self._silent, paced=False)
        ack = await self._link.recv_header(self._silent)
        if ack.kind != CLOSE_ACK:
            log.debug("peer %s answered close with message type %d", self.peer, ack.kind)

    async def close(self) -> None:
        from ucxx.exceptions import UCXError

        if self._closed:
            return
        self._closed = True
        self._on_close(self)
        if self._broken is None and self._progress is None:
            # Pitfall: closing right after a send can reset the peer's receive. Say goodbye and wait for
            # the server's ack, so neither side closes under the other's last message.
            try:
                await asyncio.wait_for(self._goodbye(), GOODBYE_S)
            except (UCXError, PeerError, TimeoutError) as exc:
                log.debug("closing the channel to %s: %s", self.peer, exc or "no goodbye ack")
        self._link.abort()


class _ServerConnection:
    """Serve side of one endpoint: answers requests one at a time, sending chunks as soon as this node has them."""

    def __init__(self, listener: "UcxListener", endpoint: "Endpoint") -> None:
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self.peer = "a requester"
        self._link = _Link(endpoint, self.peer, listener.io_timeout_s, listener.limits, listener.stats)
        self._task = asyncio.current_task()
        self._peer_gone = asyncio.Event()
        self._waiting_on_served = False
        self._closing = False
        endpoint.set_close_callback(self._endpoint_closed)

    def _endpoint_closed(self) -> None:
        # Called by ucxx from its progress thread when the peer goes away (or when the endpoint is
        # collected, possibly after the loop closed: nothing is left to tell then).
        try:
            self._loop.call_soon_threadsafe(self._peer_closed)
        except RuntimeError:
            pass

    def _peer_closed(self) -> None:
        self._peer_gone.set()
        # A requester that went away while we wait for a chunk (cut-through) is not waited for.
        if self._waiting_on_served and not self._closing and self._task is not None:
            self._task.cancel()

    def abort(self) -> None:
        self._closing = True
        self._link.abort()

    async def serve(self) -> None:
        from ucxx.exceptions import UCXError

        try:
            while await self._serve_one():
                pass
        except PeerError as exc:  # the requester stopped reading, broke the protocol, or went away
            log.warning("%s", exc)
        except UCXError as exc:
            if not self._closing:
                log.debug("requester %s went away (%s)", self.peer, _ucx_reason(exc))
        except asyncio.CancelledError:
            if not self._peer_gone.is_set() and not self._closing:
                raise
            log.debug("requester %s went away while waiting for a chunk", self.peer)
        except Exception:
            log.exception("serving %s failed", self.peer)
        finally:
            self.abort()

    def _slow_reader(self) -> PeerTimeoutError:
        return PeerTimeoutError(self.peer, f"read nothing for {self._link.io_timeout_s:g} s")

    async def _serve_one(self) -> bool:
        """Answer one request; False once the requester said goodbye."""
        header = await self._link.recv_header(None)  # an idle connection has no deadline, as with TCP
        if header.kind == CLOSE:
            await self._link.send(Header(CLOSE_ACK), memoryview(b""), self._slow_reader, paced=False)
            try:  # the requester closes once it has the ack; closing first could reset its receive
                await asyncio.wait_for(self._peer_gone.wait(), GOODBYE_S)
            except TimeoutError:
                log.debug("requester %s did not close after its goodbye", self.peer)
            return False
        check_request(header, self.peer)
        raw = bytearray(header.length)
        await self._link.recv_payload(memoryview(raw), header.frame, self._slow_reader, paced=False)
        request = parse_request(header, raw)
        self.peer = self._link.peer = request.requester
        send = functools.partial(self._send, self._frame(header.frame))
        await answer_request(self._listener.served, request, send, self.peer, self._from_served)
        return True

    def _frame(self, requested: int) -> int:
        """Frame size for answers: the smaller of the requester's and our egress limit's (0: whole)."""
        wanted = [f for f in (requested, LIMITED_SEND_SLICE if self._link.limits.egress is not None else 0) if f]
        return min(wanted) if wanted else 0

    async def _from_served(self, awaitable: Awaitable[_T]) -> _T:
        self._waiting_on_served = True
        try:
            return await awaitable
        finally:
            self._waiting_on_served = False

    async def _send(self, frame: int, header: Header, payload: memoryview) -> None:
        """Send one message: an answer in frames of ``frame``, paced at the egress limit and counted; an
        ``ERROR`` whole, at once."""
        if header.kind == ERROR:
            await self._link.send(header, payload, self._slow_reader, paced=False)
            return
        await self._link.send(replace(header, frame=frame), payload, self._slow_reader, paced=True)
        self._link.stats.bytes_sent += len(payload)


class UcxListener(Listener):
    """A UCX listener serving an agent's packages.

    UCX listens on every interface of the node (ucxx takes a port only); ``address`` names the host the
    agent was told to listen on, which is where its peers connect.
    """

    def __init__(self, context: "ApplicationContext", served: ServedPackages, limits: HostRateLimits,
                 stats: TransportStats, io_timeout_s: float, connect_timeout_s: float,
                 on_close: Callable[["UcxListener"], None]) -> None:
        self.served = served
        self.limits = limits
        self.stats = stats
        self.io_timeout_s = io_timeout_s
        self._context = context
        self._connect_timeout_s = connect_timeout_s
        self._on_close = on_close
        self.connections: set[_ServerConnection] = set()
        self._handlers: set[asyncio.Task] = set()
        self._listener: Any = None
        self.address = ""

    def start(self, host: str, port: int) -> None:
        from ucxx.exceptions import UCXBusyError

        try:
            self._listener = self._context.create_listener(self._handle, port=port,
                                                           connect_timeout=self._connect_timeout_s)
        except UCXBusyError:
            raise OSError(errno.EADDRINUSE, f"cannot listen on port {port} with UCX: address already in use") \
                from None
        self.address = f"[{host}]:{self._listener.port}" if ":" in host else f"{host}:{self._listener.port}"

    async def _handle(self, endpoint: "Endpoint") -> None:
        connection = _ServerConnection(self, endpoint)
        task = asyncio.current_task()
        self.connections.add(connection)
        self._handlers.add(task)
        try:
            await connection.serve()
        finally:
            self.connections.discard(connection)
            self._handlers.discard(task)

    @property
    def open_connections(self) -> int:
        return len(self.connections)

    async def close(self) -> None:
        if self._listener is None:
            return
        listener, self._listener = self._listener, None
        self._on_close(self)
        listener.close()  # stop accepting
        for connection in list(self.connections):
            connection.abort()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        # ucxx retires each handler one loop turn after it ends; wait, so none is reported as leaked.
        deadline = asyncio.get_running_loop().time() + LISTENER_DRAIN_S
        while listener.active_clients and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.001)


async def _open_endpoint(context: "ApplicationContext", host: str, port: int, timeout_s: float) -> "Endpoint":
    """An endpoint to a ucxx listener, failing as soon as UCX knows the peer is not there.

    Pitfall: ucxx's ``create_endpoint`` notices a refused connection only when its peer-info exchange
    times out (5 s). UCX itself fails the endpoint within milliseconds, so this does the same three steps
    (endpoint, tag exchange, wrapper) while watching the endpoint. Tied to ucxx 0.52 (pinned in the extra).
    """
    from ucxx._lib.libucxx import UCXEndpoint
    from ucxx._lib_async import Endpoint
    from ucxx._lib_async.exchange_peer_info import exchange_peer_info
    from ucxx._lib_async.utils import hash64bits
    from ucxx.exceptions import UCXNotConnectedError

    raw = UCXEndpoint.create(context.worker, host, port, True)
    msg_tag = hash64bits("msg_tag", os.urandom(16), raw.handle)
    exchange = asyncio.ensure_future(exchange_peer_info(raw, msg_tag, listener=False, connect_timeout=timeout_s))
    try:
        while not exchange.done():
            if not raw.alive:
                raw.raise_on_error()
                raise UCXNotConnectedError("the endpoint closed before connecting")
            await asyncio.wait({exchange}, timeout=CONNECT_POLL_S)
        info = exchange.result()
    except BaseException:
        exchange.cancel()
        raw.close_blocking(period=10**9, max_attempts=1)
        raise
    return Endpoint(endpoint=raw, ctx=context, tags={"msg_send": info["msg_tag"], "msg_recv": msg_tag})


class UcxTransport(Transport):
    """ucxx with application-level rate limits; :mod:`.wire` describes the wire format.

    Call :meth:`close` when done: it closes what is still open and, with the last UCX transport of the
    process, stops ucxx's threads (a process that skips it would hang at exit but for a safety hook).
    """

    name = "ucx"

    def __init__(self, node_id: str, settings: Settings) -> None:
        super().__init__(node_id, settings)
        self._context: "ApplicationContext | None" = None
        self._listeners: set[UcxListener] = set()
        self._channels: set[UcxChannel] = set()

    def _runtime(self) -> "ApplicationContext":
        if self._context is None:
            self._context = _RUNTIME.acquire()
        return self._context

    async def listen(self, host: str, port: int, served: ServedPackages) -> UcxListener:
        listener = UcxListener(self._runtime(), served, self.limits, self.stats, self.io_timeout_s,
                               self.connect_timeout_s, self._listeners.discard)
        listener.start(host, port)
        self._listeners.add(listener)
        return listener

    async def connect(self, address: str, peer: str) -> UcxChannel:
        from ucxx.exceptions import UCXError

        host, port = split_address(address)
        context = self._runtime()
        try:
            endpoint = await asyncio.wait_for(_open_endpoint(context, host, port, self.connect_timeout_s),
                                              self.connect_timeout_s)
        except TimeoutError:
            raise PeerConnectError(peer, f"no connection to {address} within {self.connect_timeout_s:g} s") \
                from None
        except UCXError as exc:
            raise PeerConnectError(peer, f"cannot connect to {address} ({_ucx_reason(exc)})") from None
        channel = UcxChannel(peer, _Link(endpoint, peer, self.io_timeout_s, self.limits, self.stats), self.node_id,
                             self._channels.discard)
        self._channels.add(channel)
        return channel

    async def close(self) -> None:
        """Close every listener and channel still open, then let go of ucxx (idempotent)."""
        for listener in list(self._listeners):
            await listener.close()
        for channel in list(self._channels):
            await channel.close()
        if self._context is not None:
            self._context = None
            _RUNTIME.release()
