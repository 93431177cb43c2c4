"""The agents' wire protocol, shared by the TCP and UCX backends: message layout, the authenticated hello,
limits, requests, answers.

Every message is a fixed-size header followed by its payload. The header carries magic, version, message
type, block, chunk and payload length:

- TCP (:data:`TCP_HEADER`): 20 bytes ``!2sBBIIQ``, magic ``PC``; the payload follows on the stream.
- UCX (:data:`UCX_HEADER`): 24 bytes ``!2sBBIIQI``, magic ``PU``, plus a frame size. UCX tag messages
  carry no length the receiver can read before posting its buffer, so the header goes on its own tag and
  announces the payload, which follows on another tag as ``ceil(length / frame)`` messages (one when
  frame is 0) received into consecutive slices of the target buffer (:func:`frames`). Frames let a
  rate-limited side pace a smooth stream, as the TCP backend's send slices do.

**The hello.** When the cluster has credentials, every connection starts with a mutual HMAC-SHA256
challenge keyed with the data-plane key (:func:`pipecast.core.credentials.data_plane_key`); the key
never travels. ``K`` is the key, ``id(K)`` its 8-byte key id, ``Nc``/``Ns`` 32 random bytes of each side::

    requester -> server   AUTH_HELLO      id(K) | Nc | requester node id
    server -> requester   AUTH_CHALLENGE  id(K) | Ns | MAC(K, "server", Nc, Ns, ids) | server node id
    requester -> server   AUTH_PROOF      MAC(K, "client", Nc, Ns, ids)
    server -> requester   AUTH_OK         (empty)

Each side checks the other's MAC over both fresh nonces, both node ids and the header format's magic (a
recorded hello replays to nothing, a TCP hello proves nothing over UCX). Any
failure is an ``AUTH_FAIL`` (UTF-8 reason) and the connection is closed: a missing hello, a wrong key
(key ids differ), a bad or replayed MAC. A server without a key answers a hello with ``AUTH_FAIL``; a
server with one answers a request sent without a hello with ``AUTH_FAIL``. Without a key on either
side no hello is sent (auth off, as in version 2). The requester's id in later requests must be the
one it authenticated as.

A requester sends ``REQ_BLOCK`` (block, first chunk; payload ``package_id\\nrequester``, or
``package_id\\nrequester\\nend`` with ``end`` the chunk after the last one wanted, in decimal) or ``REQ_FILE``
(block and chunk fields: offset and length of the range wanted, length 0 for the whole file; payload
``package_id\\nrequester\\npath``) and waits for its answer before the next request: ``CHUNK`` messages
for chunks first .. end - 1 in order (without an end line: to the block's last chunk), one ``FILE``
message, or one ``ERROR`` (UTF-8 text). A requester sends the end line only for a range that ends before
the block does, so whole-block requests are the same as before chunk ranges existed (servers that
predate them serve them; requesters that predate them are served). A request is checked whole (format,
requester, admission by the served packages, block and chunk range or file and range) before anything
about its requester is recorded; a chunk range that is empty or runs past the block's end is refused
with an ``ERROR``. An answer's announced length is checked against what was asked for before a byte is
allocated for it. Over UCX a request's frame field is the largest frame the requester wants
(:data:`LIMITED_SEND_SLICE` when its ingress is rate-limited, else 0), and a channel ends with
``CLOSE``, answered by ``CLOSE_ACK``.

**Waiting on its own source (version 4).** A relay asked for what has not reached it yet says so: while it
waits, it sends a ``WAIT`` (header only: the block and chunk waited for, length 0) every
:data:`WAIT_EVERY_IO_TIMEOUTS` of its I/O timeout and at least every :data:`MAX_WAIT_EVERY_S`, so that its
requester does not take its parent's silence for its own and blame a healthy node (a hung node's whole subtree
did). A requester accepts ``WAIT`` messages for at most :data:`WAIT_LIMIT_IO_TIMEOUTS` I/O timeouts with less
than two I/O timeouts' worth of its minimum rate between them (:class:`HeardWaits`), then times the relay out;
the relay gives up before, :data:`SERVE_WAIT_IO_TIMEOUTS` after the last bytes it sent, whatever it waited on
meanwhile (an ``ERROR``, or the connection's end mid-chunk). A chunk a TCP relay passes on as it arrives is a
``CHUNK_PIECES`` answer (header: the chunk and its whole length) followed by ``PIECE`` messages (its next
bytes), with ``WAIT`` messages between them while the relay's own receive stalls and a ``RESTART`` (length 0:
drop what came of the chunk, it starts again from its first byte) when that receive failed and a new one from
another parent began: its requester keeps the connection instead of blaming the relay for its parent. A
requester takes at most :data:`MAX_CHUNK_RESTARTS` of a chunk. Both sides' bounds assume one ``io_timeout_s`` on
every node.
"""

import asyncio
import hashlib
import hmac
import logging
import os
import re
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from packager.manifest import HEX_DIGEST, MANIFEST_FILE, MAX_MANIFEST_BYTES
from pipecast.agent.errors import (
    AgentError,
    AnswerAbandonedError,
    PeerAuthError,
    PeerError,
    PeerNotAllowedError,
    PeerProtocolError,
    PeerTimeoutError,
    RelayBrokenError,
    ServeWaitTimeoutError,
    UnknownPackageError,
)
from pipecast.agent.transport.base import PeerAuth, ServedPackages
from pipecast.core.loglimit import LogLimit

log = logging.getLogger(__name__)

VERSION = 4  # 2: REQ_FILE asks for a byte range; 3: the authenticated hello; 4: WAIT, pieced relayed chunks
REQ_BLOCK, REQ_FILE, CHUNK, FILE, ERROR = 1, 2, 3, 4, 5
CLOSE, CLOSE_ACK = 6, 7  # UCX only
AUTH_HELLO, AUTH_CHALLENGE, AUTH_PROOF, AUTH_OK, AUTH_FAIL = 8, 9, 10, 11, 12
WAIT, CHUNK_PIECES, PIECE, RESTART = 13, 14, 15, 16  # CHUNK_PIECES, PIECE and RESTART: TCP only
REQUESTS = (REQ_BLOCK, REQ_FILE)
MAX_REQUEST_BYTES = 4096
MAX_ERROR_BYTES = 64 << 10
MAX_FILE_BYTES = 256 << 20  # a whole small file (ranges are bounded by what was asked for)
# A frame below this is a peer making us post a receive per few bytes.
MIN_FRAME_BYTES = 4096
# Rate-limited sends go in slices this big so a limited link carries a smooth stream, not chunk bursts.
LIMITED_SEND_SLICE = 64 << 10
# A serving side waits for what it serves (a relay's chunk still on its way) at most this many I/O
# timeouts: the requester gives up after one of silence anyway.
SERVE_WAIT_IO_TIMEOUTS = 2.0
# A serving side waiting on what it serves sends a WAIT this often (in I/O timeouts, and at most every
# MAX_WAIT_EVERY_S): well within its requester's silence deadline, and within one of 1 s whatever its own is.
WAIT_EVERY_IO_TIMEOUTS = 1 / 3
MAX_WAIT_EVERY_S = 1.0
# A requester hearing only WAITs gives up after this many I/O timeouts: the serving side's own bound, plus one
# for its WAITs' spacing and the network.
WAIT_LIMIT_IO_TIMEOUTS = SERVE_WAIT_IO_TIMEOUTS + 1
# A chunk a relay passes on may start again this many times (each a receive of it that failed at the relay); its
# requester takes no more.
MAX_CHUNK_RESTARTS = 3


def wait_every_s(io_timeout_s: float) -> float:
    """How often a serving side with ``io_timeout_s`` sends a WAIT while it waits on what it serves."""
    return min(WAIT_EVERY_IO_TIMEOUTS * io_timeout_s, MAX_WAIT_EVERY_S)

NONCE_BYTES = 32
MAC_BYTES = 32
KEY_ID_BYTES = 8
MAX_NODE_ID_BYTES = 256
MAX_HELLO_BYTES = KEY_ID_BYTES + NONCE_BYTES + MAC_BYTES + MAX_NODE_ID_BYTES
_HELLO_CONTEXT = b"pipecast data-plane hello v3\0"
PACKAGE_ID = HEX_DIGEST
MAX_PATH_CHARS = 1024
# A REQ_BLOCK's end chunk: plain ASCII decimal, no sign, no padding; at most the header's chunk field + 1.
END_CHUNK = re.compile(r"0|[1-9][0-9]{0,9}")
MAX_END_CHUNK = 1 << 32


@dataclass(frozen=True)
class Header:
    """A message header; ``frame`` is the UCX frame size (always 0 over TCP)."""

    kind: int
    block: int = 0
    chunk: int = 0
    length: int = 0
    frame: int = 0


@dataclass(frozen=True)
class HeaderFormat:
    """How one backend lays out a :class:`Header` in bytes."""

    magic: bytes
    layout: struct.Struct
    framed: bool  # the layout ends with the frame size

    @property
    def size(self) -> int:
        return self.layout.size

    def pack(self, header: Header) -> bytes:
        frame = (header.frame,) if self.framed else ()
        return self.layout.pack(self.magic, VERSION, header.kind, header.block, header.chunk, header.length, *frame)

    def parse(self, raw: bytes | bytearray, peer: str) -> Header:
        """The header at the start of ``raw``; :class:`PeerProtocolError` naming ``peer`` if it is not one."""
        if len(raw) < self.size:
            raise PeerProtocolError(peer, f"sent a truncated header of {len(raw)} bytes ({self.size} expected)")
        magic, version, kind, block, chunk, length, *frame = self.layout.unpack_from(raw)
        if magic != self.magic or version != VERSION:
            raise PeerProtocolError(peer, f"sent a header with magic {magic!r} version {version} "
                                          f"(expected {self.magic!r} version {VERSION})")
        header = Header(kind, block, chunk, length, *frame)
        if header.frame and header.frame < MIN_FRAME_BYTES:
            raise PeerProtocolError(peer, f"sent a frame size of {header.frame} bytes (minimum {MIN_FRAME_BYTES})")
        return header


TCP_HEADER = HeaderFormat(b"PC", struct.Struct("!2sBBIIQ"), framed=False)
# Pitfall (ucx.py): a receiver must post a buffer of the message's size, so a fixed-size header announces
# each payload.
UCX_HEADER = HeaderFormat(b"PU", struct.Struct("!2sBBIIQI"), framed=True)


def frames(length: int, frame: int) -> list[tuple[int, int]]:
    """The (start, end) byte ranges a payload of ``length`` travels in; none for an empty payload."""
    step = frame or length
    return [(start, min(start + step, length)) for start in range(0, length, step)] if length else []


def byte_view(buffer: memoryview) -> memoryview:
    """A flat uint8 view of ``buffer`` (no copy): lengths in headers and frame offsets are in bytes, which a
    typed view's ``len`` and slices are not (a torch or numpy buffer)."""
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


#: Refusals and closed connections of the serving side, logged at a bounded rate.
SERVE_LOG = LogLimit(log)


# -- the hello -----------------------------------------------------------------------------------------


def _node_id_bytes(node_id: str) -> bytes:
    raw = node_id.encode()
    if not raw or len(raw) > MAX_NODE_ID_BYTES:
        raise ValueError(f"node id {node_id[:64]!r} must be 1-{MAX_NODE_ID_BYTES} bytes")
    return raw


def _mac(key: bytes, role: bytes, magic: bytes, client_nonce: bytes, server_nonce: bytes, client: bytes,
         server: bytes) -> bytes:
    transcript = b"".join([_HELLO_CONTEXT, role, b"\0", magic, client_nonce, server_nonce,
                           struct.pack("!H", len(client)), client, struct.pack("!H", len(server)), server])
    return hmac.new(key, transcript, hashlib.sha256).digest()


def _differing_keys(requester_key_id: bytes, server_key_id: bytes) -> str:
    return (f"data-plane keys differ (requester's key id {requester_key_id.hex()}, server's key id "
            f"{server_key_id.hex()})")


def _keys_differ(detail: str) -> str:
    return f"the peer holds another data-plane key: {detail}; one of the two was given other cluster credentials"


#: What a serving node that has not registered yet answers a hello with (its requester then knows whose it is).
NO_KEY_YET = "this node has no data-plane key yet"


class HelloRefused(Exception):
    """The serving side refuses a requester's hello; the text goes to it in an ``AUTH_FAIL``. ``fault``: whose it
    is as the serving side sees it (``"peer"``: the requester's; ``"here"``: this node lacks a key yet)."""

    def __init__(self, message: str, fault: str = "peer") -> None:
        super().__init__(message)
        self.fault = fault


class ClientHello:
    """The requester's side of one hello (see the module docstring)."""

    def __init__(self, auth: PeerAuth, fmt: HeaderFormat, peer: str) -> None:
        if not auth.key:
            raise ValueError("a hello needs a data-plane key")
        self.key, self.key_id, self.magic, self.peer = auth.key, auth.key_id, fmt.magic, peer
        self.node = _node_id_bytes(auth.node_id)
        self.nonce = os.urandom(NONCE_BYTES)

    def hello(self) -> bytes:
        """The ``AUTH_HELLO`` payload."""
        return self.key_id + self.nonce + self.node

    def proof(self, challenge: bytes) -> bytes:
        """The ``AUTH_PROOF`` payload answering the server's ``AUTH_CHALLENGE``, once its MAC checks out;
        :class:`PeerAuthError` (whose fault it is) otherwise."""
        fixed = KEY_ID_BYTES + NONCE_BYTES + MAC_BYTES
        if not fixed < len(challenge) <= MAX_HELLO_BYTES:
            raise PeerProtocolError(self.peer, f"sent a hello challenge of {len(challenge)} bytes")
        key_id, nonce = challenge[:KEY_ID_BYTES], challenge[KEY_ID_BYTES:KEY_ID_BYTES + NONCE_BYTES]
        mac, server = challenge[KEY_ID_BYTES + NONCE_BYTES:fixed], challenge[fixed:]
        if key_id != self.key_id:
            raise PeerAuthError(self.peer, _keys_differ(_differing_keys(self.key_id, key_id)), fault="keys differ")
        if not hmac.compare_digest(mac, _mac(self.key, b"server", self.magic, self.nonce, nonce, self.node, server)):
            raise PeerAuthError(self.peer, "the peer's hello names this cluster's key but does not prove it (a forged "
                                           "or replayed hello): it is not a member of this cluster", fault="peer")
        return _mac(self.key, b"client", self.magic, self.nonce, nonce, self.node, server)


class ServerHello:
    """The serving side of one hello (see the module docstring)."""

    def __init__(self, auth: PeerAuth, fmt: HeaderFormat) -> None:
        self.key, self.key_id, self.magic = auth.key or b"", auth.key_id, fmt.magic
        self.node = _node_id_bytes(auth.node_id)
        self.nonce = os.urandom(NONCE_BYTES)
        self.client_nonce = b""
        self.client = b""

    def challenge(self, hello: bytes) -> bytes:
        """The ``AUTH_CHALLENGE`` payload answering the requester's ``AUTH_HELLO``; :class:`HelloRefused`."""
        if not KEY_ID_BYTES + NONCE_BYTES < len(hello) <= KEY_ID_BYTES + NONCE_BYTES + MAX_NODE_ID_BYTES:
            raise HelloRefused(f"malformed hello ({len(hello)} bytes)")
        key_id = hello[:KEY_ID_BYTES]
        self.client_nonce = hello[KEY_ID_BYTES:KEY_ID_BYTES + NONCE_BYTES]
        self.client = hello[KEY_ID_BYTES + NONCE_BYTES:]
        if key_id != self.key_id:
            raise HelloRefused(_differing_keys(key_id, self.key_id))
        mac = _mac(self.key, b"server", self.magic, self.client_nonce, self.nonce, self.client, self.node)
        return self.key_id + self.nonce + mac + self.node

    def check(self, proof: bytes) -> str:
        """The requester's node id, once its ``AUTH_PROOF`` checks out; :class:`HelloRefused` otherwise."""
        expected = _mac(self.key, b"client", self.magic, self.client_nonce, self.nonce, self.client, self.node)
        if len(proof) != MAC_BYTES or not hmac.compare_digest(proof, expected):
            raise HelloRefused("the requester's proof does not match (a forged or replayed hello)")
        try:
            return self.client.decode()
        except UnicodeDecodeError:
            raise HelloRefused("the requester's node id is not UTF-8") from None


def refused_by_peer(peer: str, reason: str, have_key: bool) -> PeerAuthError:
    """The error of a requester whose peer answered ``AUTH_FAIL`` with ``reason``."""
    if not have_key:
        return PeerAuthError(peer, f"the peer requires the data-plane hello and this node has no data-plane key "
                                   f"(authentication is off here): {reason}", fault="here")
    if "authentication is off" in reason:
        return PeerAuthError(peer, f"the peer runs without data-plane authentication: {reason}", fault="peer")
    if NO_KEY_YET in reason:
        return PeerAuthError(peer, f"the peer cannot check this node's hello yet: {reason}", fault="peer")
    if reason.startswith("data-plane keys differ"):
        return PeerAuthError(peer, _keys_differ(reason), fault="keys differ")
    return PeerAuthError(peer, f"the peer refused this node's hello: {reason}", fault="here")


# How the serving side reads the next whole message (header and payload) of a connection; it applies
# the connection's deadlines itself and raises a PeerError when they pass.
ReceiveMessage = Callable[[], Awaitable[tuple[Header, bytes]]]
# How a serving backend sends one message (header and payload) to the requester.
SendMessage = Callable[[Header, memoryview], Awaitable[None]]
# How a backend that streams sends a CHUNK_PIECES answer whose bytes are still arriving: the header, the first
# bytes, and what gives the next ones (awaited until the header's length is sent; None: the chunk starts again
# from its first byte, a RESTART; it raises AnswerAbandonedError).
SendStream = Callable[[Header, memoryview, Callable[[], Awaitable[memoryview | None]]], Awaitable[None]]


async def accept_hello(auth: PeerAuth, fmt: HeaderFormat, receive: ReceiveMessage, send: SendMessage, peer: str,
                       wait_key_s: float) -> tuple[str | None, tuple[Header, bytes] | None]:
    """The serving side's start of a connection: the hello if this node has a key. Returns the node id the
    requester authenticated as (None: auth off) and, with auth off, its first message (a request). A
    refused requester is sent ``AUTH_FAIL`` and :class:`PeerAuthError` is raised: close the connection."""
    key = await auth.wait_key(wait_key_s)
    header, payload = await receive()
    try:
        if key is None:
            raise HelloRefused(f"{NO_KEY_YET} (it has not registered with its control plane); try again", "here")
        if header.kind != AUTH_HELLO:
            if key:
                raise HelloRefused("this node requires the data-plane hello (authentication is on here); the "
                                   "requester sent none")
            return None, (header, payload)
        if not key:
            raise HelloRefused("this node has no data-plane key (authentication is off here)", "here")
        server = ServerHello(auth, fmt)
        challenge = server.challenge(payload)
        await send(Header(AUTH_CHALLENGE, length=len(challenge)), memoryview(challenge))
        header, payload = await receive()
        if header.kind != AUTH_PROOF:
            raise HelloRefused(f"the requester sent message type {header.kind} instead of its hello proof")
        node = server.check(payload)
    except HelloRefused as exc:
        reason = str(exc).encode()
        await send(Header(AUTH_FAIL, length=len(reason)), memoryview(reason))
        raise PeerAuthError(peer, str(exc), fault=exc.fault) from None
    await send(Header(AUTH_OK), memoryview(b""))
    return node, None


# -- requests ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A request as the serving side reads it. For ``REQ_BLOCK``, ``chunk`` is the first chunk wanted and
    ``end_chunk`` the one after the last (None: to the block's end); for ``REQ_FILE``, ``block`` and
    ``chunk`` hold the offset and length of the range wanted (length 0: the whole file)."""

    kind: int
    block: int
    chunk: int
    package_id: str
    requester: str
    path: str = ""
    end_chunk: int | None = None


def request_payload(package_id: str, requester: str, path: str | None = None, end_chunk: int | None = None
                    ) -> bytes:
    """The payload of a ``REQ_BLOCK`` (no ``path``; ``end_chunk`` None: to the block's end) or ``REQ_FILE``
    request."""
    if path is not None and end_chunk is not None:
        raise ValueError("a request names a file or an end chunk, not both")
    last = path if path is not None else (str(end_chunk) if end_chunk is not None else None)
    return "\n".join([package_id, requester, *([last] if last is not None else [])]).encode()


def range_end(block: int, first_chunk: int, end_chunk: int | None, count: int) -> int:
    """Where a requester's range of ``block`` (``count`` chunks) from ``first_chunk`` ends: ``end_chunk``, or
    the block's end for None; ``ValueError`` past the block's end (a caller's range not checked against
    the manifest)."""
    end = count if end_chunk is None else end_chunk
    if end > count:
        raise ValueError(f"block {block} has {count} chunks: no chunk range {first_chunk}-{end}")
    return end


def block_request_payload(package_id: str, requester: str, end: int, count: int) -> bytes:
    """The payload of a ``REQ_BLOCK`` for chunks up to ``end`` of a block of ``count`` chunks: the end line
    only when the range ends before the block does (a whole-block request stays as servers that predate
    chunk ranges read it)."""
    return request_payload(package_id, requester, end_chunk=end if end < count else None)


def check_message(header: Header, peer: str) -> None:
    """Raise :class:`PeerProtocolError` unless ``header`` announces a request or a hello message of an
    allowed size (what a serving side may be sent)."""
    if header.kind not in (*REQUESTS, AUTH_HELLO, AUTH_PROOF) or not 0 < header.length <= MAX_REQUEST_BYTES:
        raise PeerProtocolError(peer, f"sent message type {header.kind} of {header.length} bytes as a request")



def _printable(text: str) -> bool:
    return bool(text) and text.isprintable() and not any(c.isspace() for c in text)


def parse_request(header: Header, payload: bytes | bytearray, peer: str) -> Request:
    """The request ``header`` (checked by :func:`check_message`) and its ``payload`` make, checked whole:
    :class:`PeerProtocolError` if it is malformed (the connection is then closed)."""
    if header.kind not in REQUESTS:
        raise PeerProtocolError(peer, f"sent message type {header.kind} where a request was expected")
    try:
        fields = bytes(payload).decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise PeerProtocolError(peer, "sent a request that is not UTF-8") from None
    if len(fields) not in ((2, 3) if header.kind == REQ_BLOCK else (3,)):
        raise PeerProtocolError(peer, f"sent a request of {len(fields)} fields")
    package_id, requester, *last = fields
    if not PACKAGE_ID.fullmatch(package_id):
        raise PeerProtocolError(peer, f"sent a request for {package_id[:80]!r}, which is not a package id")
    if not _printable(requester) or len(requester.encode()) > MAX_NODE_ID_BYTES:
        raise PeerProtocolError(peer, f"sent a request from {requester[:80]!r}, which is not a node id")
    if header.kind == REQ_BLOCK:
        end = None
        if last:
            if not END_CHUNK.fullmatch(last[0]) or int(last[0]) > MAX_END_CHUNK:
                raise PeerProtocolError(peer, f"sent a request with end chunk {last[0][:80]!r}, which is not a "
                                              f"chunk number (decimal, at most {MAX_END_CHUNK})")
            end = int(last[0])
        return Request(header.kind, header.block, header.chunk, package_id, requester, end_chunk=end)
    path = last[0]
    if not path or len(path) > MAX_PATH_CHARS or not path.isprintable():
        raise PeerProtocolError(peer, f"sent a request for file {path[:80]!r}")
    return Request(header.kind, header.block, header.chunk, package_id, requester, path)


async def _now(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


async def answer_request(served: ServedPackages, request: Request, send: SendMessage, peer: str,
                         waiting: Callable[[Awaitable[Any]], Awaitable[Any]] = _now, *,
                         authenticated: str | None = None, wait_s: float | None = None,
                         wait_every_s: float | None = None, stream: SendStream | None = None) -> None:
    """Answer ``request`` from ``served`` through ``send``: the block's ``CHUNK`` messages of the chunk
    range asked for (to the block's end without an end chunk), each as soon as ``served`` has it, or the
    ``FILE`` message. With ``stream`` each chunk goes as its bytes come (``served.relay_chunk``), from the
    first, as a ``CHUNK_PIECES`` answer: a chain's hop then adds a piece's time instead of a whole chunk's;
    a receive of it here that fails after some of it went is a ``RESTART``, and the chunk goes again as a new
    receive brings it (at most :data:`MAX_CHUNK_RESTARTS` times).

    The request is admitted first: its requester must be the node that ``authenticated`` (when the hello
    ran) and ``served`` must admit it; only then is it recorded (``served.peer_requested``). If anything
    refuses (an :class:`AgentError`: not allowed, not held here, nothing within ``wait_s``) the answer is
    one ``ERROR`` with its text, logged, and the connection serves on; a :class:`PeerError` (the requester
    stopped reading or went away) is raised, and so is :class:`AnswerAbandonedError` (a streamed chunk
    failed here after its header went: the backend closes the connection). ``wait_s`` bounds the time since
    the answer's last bytes (or the request), over every wait and restart between them: the requester's own
    bound (:class:`HeardWaits`) is longer. While it waits on ``served`` it sends a ``WAIT`` every
    ``wait_every_s`` (None: never). ``waiting`` wraps every wait on ``served`` (UCX
    gives up on a requester that leaves meanwhile); ``peer`` names the requester in the log."""
    block = request.block if request.kind == REQ_BLOCK else None
    loop = asyncio.get_running_loop()
    last_sent = loop.time()  # when the answer's last bytes went (the request's arrival, first)

    def sent() -> None:
        nonlocal last_sent
        last_sent = loop.time()

    async def provided(awaitable: Awaitable[Any], what: str, chunk: int = 0) -> Any:
        """What ``awaitable`` gives, within ``wait_s`` of the answer's last bytes sent, with a WAIT every
        ``wait_every_s`` meanwhile."""
        if wait_s is None and wait_every_s is None:
            return await waiting(awaitable)
        task = asyncio.ensure_future(waiting(awaitable))
        try:
            while True:
                steps = [s for s in (wait_every_s, None if wait_s is None else last_sent + wait_s - loop.time())
                         if s is not None]
                await asyncio.wait((task,), timeout=max(0.0, min(steps)))
                if task.done():
                    return task.result()
                if wait_s is not None and loop.time() - last_sent >= wait_s:
                    raise ServeWaitTimeoutError(f"{what} of package {request.package_id[:12]} is not here after "
                                                f"{wait_s:g} s")
                await send(Header(WAIT, request.block if block is not None else 0, chunk), memoryview(b""))
        finally:
            task.cancel()  # nothing once done; else what it waits on served is given up (it is safe to cancel)

    try:
        if authenticated is not None and request.requester != authenticated:
            raise PeerNotAllowedError(f"the request names requester {request.requester!r}, not the node that "
                                      f"authenticated ({authenticated!r})")
        await provided(served.admit(request.requester, request.package_id), "admission", request.chunk)
        if request.kind == REQ_BLOCK:
            count = await provided(served.chunk_count(request.package_id, request.block), f"block {block}",
                                   request.chunk)
            end = count if request.end_chunk is None else request.end_chunk
            if request.end_chunk is not None and not request.chunk < end <= count:
                raise UnknownPackageError(f"block {block} has no chunk range {request.chunk}-{end} (it has "
                                          f"{count} chunks)")
            if request.chunk >= count:
                raise UnknownPackageError(f"block {block} has no chunk {request.chunk} (it has {count})")
            served.peer_requested(request.requester, request.package_id, block)
            for chunk in range(request.chunk, end):
                what = f"chunk {chunk} of block {block}"
                if stream is None:
                    data = byte_view(await provided(served.wait_chunk(request.package_id, block, chunk), what, chunk))
                    await send(Header(CHUNK, request.block, chunk, len(data)), data)
                    sent()
                    continue
                await _relay_chunk(served, request, chunk, stream, partial(provided, what=what, chunk=chunk), sent,
                                   peer)
        else:
            data = await provided(served.file_bytes(request.package_id, request.path, request.block, request.chunk),
                                  f"file {request.path}")
            served.peer_requested(request.requester, request.package_id, None)
            await send(Header(FILE, length=len(data)), memoryview(data))
    except PeerError:
        raise
    except AgentError as exc:  # not allowed, or we do not hold what was asked for: say so and keep serving
        await _refuse(request, send, peer, str(exc))


async def _relay_chunk(served: ServedPackages, request: Request, chunk: int, stream: SendStream,
                       provided: Callable[[Awaitable[Any]], Awaitable[Any]], sent: Callable[[], None],
                       peer: str) -> None:
    """Send ``chunk`` through ``stream`` as its bytes land here (``provided`` waits on ``served``; ``sent`` is told
    each time bytes went)."""
    relay = await provided(served.relay_chunk(request.package_id, request.block, chunk))
    # Nothing goes before the chunk's first bytes are here: until then a failure is an ERROR answer.
    first = byte_view(await provided(relay.next()))
    restarts, restarting = 0, False

    async def more() -> memoryview | None:
        nonlocal relay, restarts, restarting
        if not restarting:  # the stream asks for more once what it had went (a RESTART is no bytes)
            sent()
        restarting = False
        try:
            try:
                return byte_view(await provided(relay.next()))
            except RelayBrokenError:
                restarts += 1
                if restarts > MAX_CHUNK_RESTARTS:
                    raise
                relay = await provided(served.relay_chunk(request.package_id, request.block, chunk))
                restarting = True
                return None  # its requester drops what it has of the chunk; a new receive here brings it again
        except AgentError as exc:  # the header is out: no ERROR answer can follow it
            raise AnswerAbandonedError(f"the answer of chunk {chunk} of block {request.block} to {peer} is "
                                       f"abandoned mid-chunk: {exc}") from exc

    await stream(Header(CHUNK_PIECES, request.block, chunk, relay.length), first, more)
    sent()


async def _refuse(request: Request, send: SendMessage, peer: str, reason: str) -> None:
    SERVE_LOG.log(logging.INFO, "refusing %s: %s", peer, reason)
    message = reason.encode()[:MAX_ERROR_BYTES]
    await send(Header(ERROR, request.block, request.chunk, len(message)), memoryview(message))


# -- answers -------------------------------------------------------------------------------------------


def file_answer_limit(path: str, length: int) -> int:
    """The longest ``FILE`` answer a request for ``length`` bytes of ``path`` may get (0: the whole file)."""
    if length:
        return length
    # The packager's own limit: a manifest it packs and a seed serves must be one every receiver takes.
    return MAX_MANIFEST_BYTES if path == MANIFEST_FILE else MAX_FILE_BYTES


def check_answer(header: Header, expected: int | tuple[int, ...], what: str, peer: str,
                 limit: int = MAX_FILE_BYTES, block: int | None = None) -> None:
    """Raise :class:`PeerProtocolError` unless ``header`` is an ``ERROR``, an ``AUTH_FAIL``, an ``expected``
    answer (``CHUNK`` or ``CHUNK_PIECES``, ``FILE``, a hello message) to the request for ``what`` (e.g. "file
    config.json"), or an empty ``WAIT`` while a chunk (of ``block``, when given) or a file is awaited, within the
    size limits: a ``FILE`` or hello answer at most ``limit`` bytes, checked before anything is allocated for it."""
    expected = expected if isinstance(expected, tuple) else (expected,)
    if header.kind in (ERROR, AUTH_FAIL):
        if header.length > MAX_ERROR_BYTES:
            raise PeerProtocolError(peer, f"sent an error message of {header.length} bytes")
    elif header.kind == WAIT and {CHUNK, FILE} & set(expected):
        if header.length:
            raise PeerProtocolError(peer, f"sent a WAIT message of {header.length} bytes")
        if block is not None and header.block != block:
            raise PeerProtocolError(peer, f"sent a WAIT for block {header.block} while sending {what}")
    elif header.kind not in expected:
        raise PeerProtocolError(peer, f"sent message type {header.kind} in answer to {what}")
    elif header.kind not in (CHUNK, CHUNK_PIECES) and header.length > limit:
        raise PeerProtocolError(peer, f"announced {what} of {header.length} bytes (at most {limit} asked for)")


class HeardWaits:
    """A requester's bound on a peer's ``WAIT`` messages: :meth:`heard` raises :class:`PeerTimeoutError` once
    the first of them came :data:`WAIT_LIMIT_IO_TIMEOUTS` I/O timeouts ago with fewer than ``progress_bytes`` of
    the answer since (a peer trickling a byte between WAITs is not making progress; bytes a RESTART dropped do not
    count)."""

    def __init__(self, io_timeout_s: float, progress_bytes: float = 1) -> None:
        self.limit_s = WAIT_LIMIT_IO_TIMEOUTS * io_timeout_s
        self._progress_bytes = max(1.0, progress_bytes)
        self._since: float | None = None
        self._bytes = 0

    def heard(self, now: float, peer: str, what: str) -> None:
        """A ``WAIT`` came at ``now`` (a monotonic clock's) while ``what`` was awaited."""
        if self._since is None:
            self._since, self._bytes = now, 0
        elif now - self._since >= self.limit_s:
            raise PeerTimeoutError(peer, f"sent only WAIT messages ({self._bytes} bytes besides) for "
                                         f"{now - self._since:.1f} s while sending {what} (its own source is not "
                                         "sending it)")

    def progressed(self, nbytes: int) -> None:
        """``nbytes`` of the answer came: enough of them since the first WAIT end its waits."""
        if self._since is not None:
            self._bytes += nbytes
            if self._bytes >= self._progress_bytes:
                self._since = None

    def dropped(self, nbytes: int) -> None:
        """``nbytes`` that came were dropped (a RESTART): they were no progress."""
        self._bytes = max(0, self._bytes - nbytes)

    def reset(self) -> None:
        """A new request: no waits heard."""
        self._since = None


def check_chunk(header: Header, block: int, chunk: int, size: int, peer: str) -> None:
    """Raise :class:`PeerProtocolError` unless ``header`` is chunk ``chunk`` of ``block``, ``size`` bytes."""
    if header.block != block or header.chunk != chunk:
        raise PeerProtocolError(peer, f"sent chunk {header.chunk} of block {header.block}; expected chunk "
                                      f"{chunk} of block {block}")
    if header.length != size:
        raise PeerProtocolError(peer, f"sent {header.length} bytes for chunk {chunk} of block {block}; "
                                      f"the manifest says {size}")
