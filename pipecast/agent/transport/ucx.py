"""The UCX transport on ucxx: the data path for RDMA fabrics and GPU memory (TCP stays the CPU default).

Same semantics as the TCP backend (``tcp.py``): a listener serves "chunks k .. e - 1 of block b" (to the
block's end without e) as each chunk becomes present (cut-through), a channel receives every chunk
straight into the store's buffer, every wait has a deadline, and a failing peer is a typed
:class:`~pipecast.agent.errors.PeerError` naming it. Unlike TCP it has no TLS (the hello authenticates,
nothing encrypts): the registry never gives it to a node whose settings name the data plane's TLS files.

Messages are :mod:`.wire`'s: a 24-byte header (:data:`~.wire.UCX_HEADER`) on tag ``TAG_HEADER`` announces
each payload, which follows on ``TAG_PAYLOAD`` in frames. With a data-plane key a connection starts with
the hello (:func:`~.wire.accept_hello`). A channel ends with ``CLOSE``, answered by ``CLOSE_ACK``.

The listen address: ucxx 0.52's Python listener takes a port only and binds every interface (libucxx's
C++ ``ListenerBuilder::host`` is not bound in Python). So the listener asks UCX which local address each
new endpoint came in on (``ucp_ep_query``) and closes, before reading anything, every connection that
did not come to the configured host, as well as those over the connection caps.

ucxx pitfalls measured on this project's machines (DESIGN 6), each handled where marked "pitfall":
notifier-thread mode, stopping that thread and the progress thread, integer tags, UCX_TLS with tcp, a
header before each payload, a payload's length, byte views, ack before close, refused connections, close
callbacks held weakly, UCX_NET_DEVICES. ucxx is imported only inside the functions that use it, so the
registry can name this module on nodes without the extra.
"""

import asyncio
import ctypes
import functools
import glob
import ipaddress
import logging
import os
import socket
import struct
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from pipecast.agent.errors import (
    ListenError,
    PeerAuthError,
    PeerClosedError,
    PeerConnectError,
    PeerConnectTimeoutError,
    PeerError,
    PeerProtocolError,
    PeerRefusedError,
    PeerTimeoutError,
    TransportUnavailableError,
)
from pipecast.agent.ratelimit import HostRateLimits, Pacer
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
from pipecast.agent.transport.registry import accelerated_fabric_present
from pipecast.agent.transport.wire import (
    AUTH_CHALLENGE,
    AUTH_FAIL,
    AUTH_HELLO,
    AUTH_OK,
    AUTH_PROOF,
    CHUNK,
    CLOSE,
    CLOSE_ACK,
    ERROR,
    FILE,
    LIMITED_SEND_SLICE,
    MAX_HELLO_BYTES,
    REQ_BLOCK,
    REQ_FILE,
    SERVE_LOG,
    SERVE_WAIT_IO_TIMEOUTS,
    UCX_HEADER,
    WAIT,
    ClientHello,
    Header,
    HeardWaits,
    accept_hello,
    answer_request,
    block_request_payload,
    byte_view,
    check_answer,
    check_chunk,
    check_message,
    file_answer_limit,
    frames,
    parse_request,
    range_end,
    refused_by_peer,
    request_payload,
    wait_every_s,
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
# A payload's receive probes for its message until it has come (see _Link._recv_exact): at every turn of the
# event loop for this long first (a payload is mostly right behind its header; a timer would wait a whole
# millisecond, the event loop's resolution), then at this interval (a paced sender's pauses).
PROBE_SPIN_S, PROBE_INTERVAL_S = 0.0002, 0.001
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
        except (ImportError, OSError) as exc:  # OSError: its native library does not load
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
        if "UCX_TCP_CM_REUSEADDR" not in os.environ:
            # Pitfall: the listener binds without SO_REUSEADDR: an agent restarted on its port while a peer held a
            # connection found it in TIME_WAIT ("address already in use") for a minute.
            options["TCP_CM_REUSEADDR"] = "y"
        # Pitfall: Python-future mode (a notifier thread waits for completions); the other modes poll and
        # burn a core. It needs the progress thread mode.
        try:
            context = ApplicationContext(options, progress_mode="thread", enable_python_future=True)
        except ucxx.exceptions.UCXError as exc:  # e.g. UCX_TLS=rc on a node without RDMA: no device
            raise TransportUnavailableError(f"transport 'ucx' cannot be used on this node: UCX does not start "
                                            f"({type(exc).__name__}: {exc})") from None
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
        # Pitfall: stop the progress thread here, on the loop's thread. Else ucxx stops it only once its
        # progress task, which the event loop keeps, is collected: never while the loop lives, and then on
        # whichever thread collects it (on the progress thread itself the join fails; elsewhere it can hang).
        context.worker.stop_progress_thread()
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


def _call_on_close(endpoint: "Endpoint", method: Callable[..., None], *args: Any) -> None:
    """Have the bound ``method(*args)`` run on this event loop once ``endpoint`` closes (the peer went away,
    it was aborted or collected); RuntimeError if it is closing already.

    Pitfall: ucxx keeps a close callback natively, beside the endpoint's finalizer, which keeps the
    endpoint: a callback that reached the endpoint (through its owner, or ``args``) would keep both alive
    for good, and a served one its listener listening. So the method is held weakly."""
    loop = asyncio.get_running_loop()
    weak = weakref.WeakMethod(method)

    def closed() -> None:  # ucxx calls it from its progress thread, or the thread aborting the endpoint
        bound = weak()
        if bound is None:
            return
        try:
            loop.call_soon_threadsafe(bound, *args)
        except RuntimeError:  # the loop closed before the endpoint was collected: nothing is left to tell
            pass

    endpoint.set_close_callback(closed)


class _Link:
    """One endpoint's message layer: headers and framed payloads on the two integer tags, with deadlines."""

    def __init__(self, endpoint: "Endpoint", peer: str, io_timeout_s: float, limits: HostRateLimits,
                 stats: TransportStats) -> None:
        self.closed_idle = False  # the peer closed the endpoint while no request was outstanding
        self.endpoint = endpoint
        self.peer = peer
        self.io_timeout_s = io_timeout_s
        self.limits = limits
        self.stats = stats

    async def send(self, header: Header, payload: memoryview, on_timeout: Callable[[], PeerError],
                   egress: Pacer | None = None) -> None:
        """Send ``header``, then ``payload`` (bytes) in frames of ``header.frame``, paced through ``egress``
        (answers are, requests and errors are not, as with TCP)."""
        await _with_deadline(self.endpoint.send(UCX_HEADER.pack(header), tag=TAG_HEADER), self.io_timeout_s, on_timeout)
        for start, end in frames(len(payload), header.frame):
            if egress is not None:
                delay = egress.take(end - start)
                if delay > 0:
                    await asyncio.sleep(delay)
            await _with_deadline(self.endpoint.send(payload[start:end], tag=TAG_PAYLOAD), self.io_timeout_s,
                                 on_timeout)

    async def recv_header(self, on_timeout: Callable[[], PeerError], timeout_s: float | None = None) -> Header:
        """The next header, within ``timeout_s`` (default: the I/O timeout)."""
        raw = bytearray(UCX_HEADER.size)
        await _with_deadline(self.endpoint.recv(raw, tag=TAG_HEADER), timeout_s or self.io_timeout_s, on_timeout)
        return UCX_HEADER.parse(raw, self.peer)

    async def recv_message(self, on_timeout: Callable[[], PeerError], timeout_s: float | None = None
                           ) -> tuple[Header, bytes]:
        """The next message a requester may send (a request, a hello message, ``CLOSE``), header within
        ``timeout_s`` and payload within the I/O timeout; :class:`PeerProtocolError` for anything else."""
        header = await self.recv_header(on_timeout, timeout_s)
        if header.kind == CLOSE:
            return header, b""
        check_message(header, self.peer)
        raw = bytearray(header.length)
        await self.recv_payload(memoryview(raw), header.frame, on_timeout)
        return header, bytes(raw)

    async def recv_payload(self, target: memoryview, frame: int, on_timeout: Callable[[], PeerError],
                           ingress: Pacer | None = None) -> None:
        """Receive a payload in frames of ``frame`` into ``target`` (bytes) in place: when that is the
        store's buffer, UCX writes there directly, with no copy; paced through ``ingress``."""
        for start, end in frames(len(target), frame):
            await _with_deadline(self._recv_exact(target[start:end]), self.io_timeout_s, on_timeout)
            if ingress is not None:
                delay = ingress.take(end - start)
                if delay > 0:
                    await asyncio.sleep(delay)  # before the next receive is posted: the sender waits for it

    async def _recv_exact(self, target: memoryview) -> None:
        """Receive the next payload message into ``target``, which it must fill exactly:
        :class:`PeerProtocolError` for a message of another length.

        Pitfall: a tag receive completes on a shorter message too, and ucxx does not say how much came. So
        a probe finds the message first and tells its length; ucxx cannot wait for a message to come, so
        the probe is repeated until it has or the endpoint closed."""
        from ucxx.exceptions import UCXError

        endpoint, loop = self.endpoint, asyncio.get_running_loop()
        spin_until = loop.time() + PROBE_SPIN_S
        while True:
            closed = endpoint.closed  # read before the probe: what the peer sent before closing is queued by then
            probe = endpoint.tag_probe(TAG_PAYLOAD)
            if probe.matched or closed:
                break
            await asyncio.sleep(0 if loop.time() < spin_until else PROBE_INTERVAL_S)
        if probe.matched and probe.length != target.nbytes:
            with suppress(UCXError):  # taken off the queue all the same, not kept by UCX for good (a longer one is cut)
                await endpoint.recv(target, tag=TAG_PAYLOAD)
            raise PeerProtocolError(self.peer, f"sent a message of {probe.length} bytes where {target.nbytes} "
                                               f"were announced")
        # It takes the message probed (the first of its tag) or, with none, raises why the endpoint closed.
        await endpoint.recv(target, tag=TAG_PAYLOAD)

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
    """A UCX endpoint to one peer agent; one request at a time. If the peer closed it while it was idle
    (the peer's idle deadline), the next request opens a new one first."""

    def __init__(self, peer: str, link: _Link, requester: str, address: str, transport: "UcxTransport") -> None:
        self.peer = peer
        self._link = link
        self._requester = requester
        self._address = address
        self._transport = transport
        self._progress: _Progress | None = None
        self._broken: PeerError | None = None
        self._closed = False
        self._watch(link)

    def _watch(self, link: _Link) -> None:
        try:
            _call_on_close(link.endpoint, self._peer_closed, weakref.ref(link))
        except RuntimeError:  # the peer closed it already ("Endpoint is closing or has already closed")
            link.closed_idle = True

    def _peer_closed(self, link: "weakref.ref[_Link]") -> None:
        if link() is self._link and self._progress is None:
            self._link.closed_idle = True

    @asynccontextmanager
    async def _request(self, progress: _Progress) -> AsyncIterator[None]:
        from ucxx.exceptions import UCXError, UCXMessageTruncatedError

        if self._closed or self._broken is not None:
            raise self._broken or PeerClosedError(self.peer, "channel already closed")
        if self._progress is not None:
            raise RuntimeError(f"channel to {self.peer} already has a request in flight")
        if self._link.closed_idle:
            log.debug("peer %s closed an idle channel; connecting again", self.peer)
            self._link.abort()
            self._link = await self._transport.open_link(self._address, self.peer)
            self._watch(self._link)
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
            elif isinstance(exc, AttributeError) and self._closed:
                # Closed here mid-chunk (the channel or the transport): ucxx's endpoint, torn down, raises this.
                error = PeerClosedError(self.peer, f"the connection was closed here while it sent "
                                                   f"{progress.describe()}")
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

    async def _ask(self, kind: int, block: int, chunk: int, payload: bytes, ingress: Pacer | None) -> None:
        # The frame asked for: small when the answer's ingress is limited, so the limit paces a smooth stream.
        frame = LIMITED_SEND_SLICE if ingress is not None else 0
        # The request itself goes whole (its header's frame field is about the answer).
        await self._link.send(Header(kind, block, chunk, len(payload), frame), memoryview(payload), self._silent)

    async def _answer(self, expected: int, progress: _Progress, limit: int = 0) -> Header:
        """The next answer header, its length checked against ``limit`` (a ``FILE``'s); an ERROR answer is
        raised as :class:`PeerRefusedError`, an AUTH_FAIL as :class:`PeerAuthError` (by a peer this node, holding
        a key, has greeted: :class:`PeerProtocolError`)."""
        waits = HeardWaits(self._link.io_timeout_s)
        while True:
            header = await self._link.recv_header(self._silent)
            check_answer(header, expected, progress.describe(), self.peer, limit,
                         block=progress.block if progress.what == "block" else None)
            if header.kind != WAIT:
                break
            waits.heard(asyncio.get_running_loop().time(), self.peer, progress.describe())
        if header.kind in (ERROR, AUTH_FAIL):
            text = bytearray(header.length)
            await self._link.recv_payload(memoryview(text), header.frame, self._silent)
            reason = text.decode("utf-8", "replace")
            if header.kind == AUTH_FAIL:
                if self._transport.auth.key:  # keyed, the hello is behind us
                    raise PeerProtocolError(self.peer, f"answered {progress.describe()} with an authentication "
                                                       "failure after its hello had succeeded")
                raise refused_by_peer(self.peer, reason, False)
            raise PeerRefusedError(self.peer, reason)
        return header

    async def fetch_block(self, package_id: str, block: int, first_chunk: int, sink: ChunkSink,
                          end_chunk: int | None = None) -> None:
        count = sink.chunk_count(block)
        end = range_end(block, first_chunk, end_chunk, count)
        if first_chunk >= end:
            return
        progress = _Progress("block", block, first_chunk, count)
        ingress = self._link.limits.ingress_for(package_id)
        async with self._request(progress):
            await self._ask(REQ_BLOCK, block, first_chunk, block_request_payload(package_id, self._requester, end,
                                                                                  count), ingress)
            for chunk in range(first_chunk, end):
                progress.next_chunk = chunk
                header = await self._answer(CHUNK, progress)
                # Pitfall: byte views only: lengths and frame offsets are in bytes, as is what ucxx receives.
                buffer = byte_view(sink.chunk_buffer(block, chunk))
                try:  # the sink counts a receive from its buffer on: one that fails must end too, dropped
                    check_chunk(header, block, chunk, len(buffer), self.peer)
                    await self._link.recv_payload(buffer, header.frame, self._silent, ingress)
                except BaseException:
                    sink.chunk_dropped(block, chunk)
                    raise
                sink.chunk_landed(block, chunk, self.peer)
                self._link.stats.bytes_received += header.length

    async def fetch_file(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        progress = _Progress(f"file {path}")
        ingress = self._link.limits.ingress_for(package_id)
        async with self._request(progress):
            await self._ask(REQ_FILE, offset, length, request_payload(package_id, self._requester, path), ingress)
            header = await self._answer(FILE, progress, file_answer_limit(path, length))
            data = bytearray(header.length)
            await self._link.recv_payload(memoryview(data), header.frame, self._silent, ingress)
            self._link.stats.bytes_received += header.length
            return bytes(data)

    async def _goodbye(self) -> None:
        await self._link.send(Header(CLOSE), memoryview(b""), self._silent)
        ack = await self._link.recv_header(self._silent)
        if ack.kind != CLOSE_ACK:
            log.debug("peer %s answered close with message type %d", self.peer, ack.kind)

    async def close(self) -> None:
        from ucxx.exceptions import UCXError

        if self._closed:
            return
        self._closed = True
        self._transport.forget(self)
        if self._broken is None and self._progress is None and not self._link.closed_idle:
            # Pitfall: closing right after a send can reset the peer's receive. Say goodbye and wait for
            # the server's ack, so neither side closes under the other's last message.
            try:
                await asyncio.wait_for(self._goodbye(), GOODBYE_S)
            except (UCXError, PeerError, TimeoutError) as exc:
                log.debug("closing the channel to %s: %s", self.peer, exc or "no goodbye ack")
        self._link.abort()


async def _client_hello(link: _Link, auth: PeerAuth, peer: str) -> None:
    """The requester's side of the hello (:mod:`.wire`) on a new endpoint."""
    hello = ClientHello(auth, UCX_HEADER, peer)

    def silent() -> PeerTimeoutError:
        return PeerTimeoutError(peer, f"silent for {link.io_timeout_s:g} s during the hello")

    async def step(kind: int, payload: bytes, expected: int) -> bytes:
        await link.send(Header(kind, length=len(payload)), memoryview(payload), silent)
        header = await link.recv_header(silent)
        check_answer(header, expected, "its hello", peer, MAX_HELLO_BYTES)
        data = bytearray(header.length)
        await link.recv_payload(memoryview(data), header.frame, silent)
        if header.kind == AUTH_FAIL:
            raise refused_by_peer(peer, data.decode("utf-8", "replace"), have_key=True)
        if header.kind == ERROR:
            raise PeerRefusedError(peer, data.decode("utf-8", "replace"))
        return bytes(data)

    challenge = await step(AUTH_HELLO, hello.hello(), AUTH_CHALLENGE)
    await step(AUTH_PROOF, hello.proof(challenge), AUTH_OK)


class _EpAttr(ctypes.Structure):
    """UCX's ``ucp_ep_attr_t`` (ucp.h, UCX >= 1.15): the fields up to the remote address are all we read."""

    _fields_ = [("field_mask", ctypes.c_uint64), ("name", ctypes.c_char * 32),
                ("local_sockaddr", ctypes.c_ubyte * 128), ("remote_sockaddr", ctypes.c_ubyte * 128),
                ("transports", ctypes.c_ubyte * 64), ("user_data", ctypes.c_void_p)]


_EP_ATTR_LOCAL_SOCKADDR, _EP_ATTR_REMOTE_SOCKADDR = 1 << 1, 1 << 2
_ucp_ep_query: Any = None


def _load_ep_query() -> Any:
    """``ucp_ep_query`` of the libucp ucxx uses (loaded already: dlopen by soname finds that one)."""
    global _ucp_ep_query
    if _ucp_ep_query is None:
        candidates = ["libucp.so.0"]
        try:
            import libucx

            candidates += sorted(glob.glob(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so*")))
        except ImportError:
            pass
        for name in candidates:
            try:
                function = ctypes.CDLL(name).ucp_ep_query
            except (OSError, AttributeError):
                continue
            function.argtypes, function.restype = [ctypes.c_void_p, ctypes.POINTER(_EpAttr)], ctypes.c_int
            _ucp_ep_query = function
            break
        else:
            _ucp_ep_query = False
    return _ucp_ep_query


def _sockaddr_host(raw: bytes) -> str | None:
    family = struct.unpack_from("=H", raw)[0]
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if family == socket.AF_INET6:
        address = ipaddress.IPv6Address(raw[8:24])
        return str(address.ipv4_mapped or address)
    return None


def endpoint_hosts(endpoint: "Endpoint") -> tuple[str | None, str | None]:
    """The (local, remote) IP addresses of a connected endpoint, as UCX says (None where it cannot)."""
    query = _load_ep_query()
    if not query:
        return None, None
    attr = _EpAttr()
    attr.field_mask = _EP_ATTR_LOCAL_SOCKADDR | _EP_ATTR_REMOTE_SOCKADDR
    if query(ctypes.c_void_p(endpoint.ucp_endpoint), ctypes.byref(attr)) != 0:
        return None, None
    return _sockaddr_host(bytes(attr.local_sockaddr)), _sockaddr_host(bytes(attr.remote_sockaddr))


class _ServerConnection:
    """Serve side of one endpoint: the hello, then requests one at a time, sending chunks as soon as this
    node has them."""

    def __init__(self, listener: "UcxListener", endpoint: "Endpoint") -> None:
        self._listener = listener
        self.peer = "a requester"
        self._link = _Link(endpoint, self.peer, listener.io_timeout_s, listener.limits, listener.stats)
        self._task = asyncio.current_task()
        self._peer_gone = asyncio.Event()
        self._waiting_on_served = False
        self._closing = False
        self._counted: str | None = None
        _call_on_close(endpoint, self._peer_closed)

    def _peer_closed(self) -> None:
        self._peer_gone.set()
        # A requester that went away while we wait for a chunk (cut-through) is not waited for.
        if self._waiting_on_served and not self._closing and self._task is not None:
            self._task.cancel()

    def abort(self) -> None:
        self._closing = True
        self._link.abort()

    def evicted(self) -> None:
        """Every slot is taken and this connection has waited longest in its hello: it makes room (see
        :class:`~.base.ConnectionLimits`)."""
        self._counted = None
        SERVE_LOG.log(logging.WARNING, "closing %s, still in its hello, to make room for a newer connection",
                      self.peer)
        self.abort()
        if self._task is not None:
            self._task.cancel()

    def _admit(self) -> str | None:
        """Why this connection is refused before anything is read from it (None: it is not)."""
        local, remote = endpoint_hosts(self._link.endpoint)
        self.peer = self._link.peer = f"a requester at {remote}" if remote else "a requester"
        bound = self._listener.bound_hosts
        if bound and local is not None and local not in bound:
            return f"it connected to {local}, not to the address this agent listens on ({self._listener.host})"
        refused = self._listener.connection_limits.admit(remote or "?", self)
        if refused is None:
            self._counted = remote or "?"
        return refused

    async def serve(self) -> None:
        from ucxx.exceptions import UCXError

        listener = self._listener
        try:
            refused = self._admit()
            if refused is not None:
                SERVE_LOG.log(logging.WARNING, "refusing a connection from %s: %s", self.peer, refused)
                return
            node, first = await accept_hello(listener.auth, UCX_HEADER, self._receive_first, self._send_plain,
                                             self.peer, listener.key_wait_s)
            listener.connection_limits.greeted(self)
            message = first or await self._receive_next()
            while await self._serve_one(message, node):
                message = await self._receive_next()
        except PeerError as exc:  # the requester failed the hello, broke the protocol, stopped reading or left
            SERVE_LOG.log(logging.WARNING, "%s; closing", exc)
            if isinstance(exc, PeerAuthError):
                await self._linger()
        except UCXError as exc:
            if not self._closing:
                log.debug("requester %s went away (%s)", self.peer, _ucx_reason(exc))
        except asyncio.CancelledError:
            if not self._peer_gone.is_set() and not self._closing:
                raise
            log.debug("requester %s went away while waiting for a chunk", self.peer)
        except Exception:
            if self._closing:  # the listener closed under the transfer: ucxx's send or receive fails any way
                log.debug("serving %s ended as the listener closed", self.peer, exc_info=True)
            else:
                log.exception("serving %s failed", self.peer)
        finally:
            if self._counted is not None:
                listener.connection_limits.release(self._counted, self)
                self._counted = None
            self.abort()

    async def _linger(self) -> None:
        """Give a refused requester a moment to read why before the endpoint goes (pitfall: closing right
        after a send can reset the peer's receive)."""
        try:
            await asyncio.wait_for(self._peer_gone.wait(), GOODBYE_S)
        except TimeoutError:
            pass

    def _slow_reader(self) -> PeerTimeoutError:
        return PeerTimeoutError(self.peer, f"read nothing for {self._link.io_timeout_s:g} s")

    async def _receive_first(self) -> tuple[Header, bytes]:
        """A message of the hello (or the first request): each within the I/O timeout."""
        return await self._link.recv_message(
            lambda: PeerTimeoutError(self.peer, f"sent no complete message for {self._link.io_timeout_s:g} s"))

    async def _receive_next(self) -> tuple[Header, bytes]:
        """The next request, within the idle deadline."""
        idle = self._listener.idle_timeout_s
        return await self._link.recv_message(lambda: PeerTimeoutError(self.peer, f"sent no request for {idle:g} s"),
                                             idle)

    async def _serve_one(self, message: tuple[Header, bytes], node: str | None) -> bool:
        """Answer one request; False once the requester said goodbye."""
        header, payload = message
        if header.kind == CLOSE:
            await self._link.send(Header(CLOSE_ACK), memoryview(b""), self._slow_reader)
            try:  # the requester closes once it has the ack; closing first could reset its receive
                await asyncio.wait_for(self._peer_gone.wait(), GOODBYE_S)
            except TimeoutError:
                log.debug("requester %s did not close after its goodbye", self.peer)
            return False
        request = parse_request(header, payload, self.peer)
        self.peer = self._link.peer = request.requester
        egress = self._link.limits.egress_for(request.package_id)
        send = functools.partial(self._send, self._frame(header.frame, egress), egress)
        await answer_request(self._listener.served, request, send, self.peer, self._from_served, authenticated=node,
                             wait_s=SERVE_WAIT_IO_TIMEOUTS * self._listener.io_timeout_s,
                             wait_every_s=wait_every_s(self._listener.io_timeout_s))
        return True

    @staticmethod
    def _frame(requested: int, egress: Pacer | None) -> int:
        """Frame size for answers: the smaller of the requester's and our egress limit's (0: whole)."""
        wanted = [f for f in (requested, LIMITED_SEND_SLICE if egress is not None else 0) if f]
        return min(wanted) if wanted else 0

    async def _from_served(self, awaitable: Awaitable[_T]) -> _T:
        self._waiting_on_served = True
        try:
            return await awaitable
        finally:
            self._waiting_on_served = False

    async def _send_plain(self, header: Header, payload: memoryview) -> None:
        """Send a message whole, at once (not an answer: errors, hello messages)."""
        await self._link.send(header, payload, self._slow_reader)

    async def _send(self, frame: int, egress: Pacer | None, header: Header, payload: memoryview) -> None:
        """Send one message: an answer in frames of ``frame``, paced through ``egress`` and counted; an
        ``ERROR`` whole, at once."""
        if header.kind not in (CHUNK, FILE):
            await self._send_plain(header, payload)
            return
        await self._link.send(replace(header, frame=frame), payload, self._slow_reader, egress)
        self._link.stats.bytes_sent += len(payload)


class UcxListener(Listener):
    """A UCX listener serving an agent's packages.

    UCX listens on every interface of the node (ucxx takes a port only); connections that did not come to
    ``host`` are closed at once (see the module docstring). ``address`` names that host, which is where
    its peers connect.
    """

    def __init__(self, context: "ApplicationContext", served: ServedPackages, transport: "UcxTransport") -> None:
        self.served = served
        self.auth = transport.auth
        self.limits = transport.limits
        self.stats = transport.stats
        self.io_timeout_s = transport.io_timeout_s
        self.key_wait_s = transport.key_wait_s
        self.idle_timeout_s = transport.idle_timeout_s
        self.connection_limits = ConnectionLimits(transport.max_connections, transport.max_connections_per_address)
        self._context = context
        self._connect_timeout_s = transport.connect_timeout_s
        self._on_close = transport.forget_listener
        self.connections: set[_ServerConnection] = set()
        self._handlers: set[asyncio.Task] = set()
        self._listener: Any = None
        self.address = ""
        self.host = ""
        self.bound_hosts: frozenset[str] = frozenset()  # empty: every interface

    def start(self, host: str, port: int) -> None:
        from ucxx.exceptions import UCXBusyError

        self.host, self.bound_hosts = host, _addresses_of(host, port)
        try:
            self._listener = self._context.create_listener(self._handle, port=port,
                                                           connect_timeout=self._connect_timeout_s)
        except UCXBusyError:
            raise ListenError(host, port, "address already in use (UCX)") from None
        if self.bound_hosts and not _load_ep_query():
            log.warning("UCX listener on port %d: cannot query endpoint addresses (ucp_ep_query missing); it "
                        "serves every interface, not only %s", self._listener.port, host)
        self.address = f"[{host}]:{self._listener.port}" if ":" in host else f"{host}:{self._listener.port}"
    async def _handle(self, endpoint: "Endpoint") -> None:
        try:
            connection = _ServerConnection(self, endpoint)
        except RuntimeError as exc:  # the requester closed at once ("Endpoint is closing"): ucxx logged a traceback
            log.debug("requester closed before it was served (%s)", exc)
            endpoint.abort()
            return
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


def _addresses_of(host: str, port: int) -> frozenset[str]:
    """The IP addresses ``host`` names (empty for a wildcard: every interface); :class:`ListenError` unless
    ``host`` resolves and each is this host's. UCX binds every interface, so it would listen anyway and then
    refuse every peer: this says so at once, as TCP's bind does."""
    if host in ("", "0.0.0.0", "::", "*"):
        return frozenset()
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ListenError(host, port, exc.strerror or str(exc)) from None
    found = set()
    for family, kind, _, _, sockaddr in infos:
        try:
            with socket.socket(family, kind) as probe:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
        except OSError as exc:  # EADDRNOTAVAIL: not an address of this host
            raise ListenError(host, port, (exc.strerror or str(exc)).lower()) from None
        address = ipaddress.ip_address(sockaddr[0].split("%")[0])
        mapped = getattr(address, "ipv4_mapped", None)
        found.add(str(mapped or address))
    return frozenset(found)


class UcxTransport(Transport):
    """ucxx with application-level rate limits; :mod:`.wire` describes the wire format.

    Call :meth:`close` when done: it closes what is still open and, with the last UCX transport of the
    process, stops ucxx's threads (a process that skips it would hang at exit but for a safety hook).
    """

    name = "ucx"

    def __init__(self, node_id: str, settings: Settings, auth: PeerAuth | None = None) -> None:
        super().__init__(node_id, settings, auth)
        self._context: "ApplicationContext | None" = None
        self._listeners: set[UcxListener] = set()
        self._channels: set[UcxChannel] = set()

    def _runtime(self) -> "ApplicationContext":
        if self._context is None:
            self._context = _RUNTIME.acquire()
        return self._context

    def forget_listener(self, listener: UcxListener) -> None:
        self._listeners.discard(listener)

    def forget(self, channel: UcxChannel) -> None:
        self._channels.discard(channel)

    async def listen(self, host: str, port: int, served: ServedPackages) -> UcxListener:
        self._listening()
        listener = UcxListener(self._runtime(), served, self)
        listener.start(host, port)
        self._listeners.add(listener)
        return listener

    async def open_link(self, address: str, peer: str) -> _Link:
        """A new endpoint to ``address``, through the hello when this node has a data-plane key."""
        from ucxx.exceptions import UCXError

        host, port = split_address(address)
        context = self._runtime()
        link = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                endpoint = await _open_endpoint(context, host, port, self.connect_timeout_s)
                link = _Link(endpoint, peer, self.io_timeout_s, self.limits, self.stats)
                if self.auth.key:
                    await _client_hello(link, self.auth, peer)
        except TimeoutError:
            if link is not None:
                link.abort()
            raise PeerConnectTimeoutError(peer, f"no connection to {address} within {self.connect_timeout_s:g} "
                                                "s") from None
        except UCXError as exc:
            if link is not None:
                link.abort()
                raise PeerClosedError(peer, f"closed the connection during the hello ({_ucx_reason(exc)})") \
                    from None
            raise PeerConnectError(peer, f"cannot connect to {address} ({_ucx_reason(exc)})") from None
        except BaseException:
            if link is not None:
                link.abort()
            raise
        return link

    async def connect(self, address: str, peer: str) -> UcxChannel:
        channel = UcxChannel(peer, await self.open_link(address, peer), self.node_id, address, self)
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
