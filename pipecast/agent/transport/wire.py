"""The agents' wire protocol, shared by the TCP and UCX backends: message layout, limits, requests, answers.

Every message is a fixed-size header followed by its payload. The header carries magic, version, message
type, block, chunk and payload length:

- TCP (:data:`TCP_HEADER`): 20 bytes ``!2sBBIIQ``, magic ``PC``; the payload follows on the stream.
- UCX (:data:`UCX_HEADER`): 24 bytes ``!2sBBIIQI``, magic ``PU``, plus a frame size. UCX tag messages
  carry no length the receiver can read before posting its buffer, so the header goes on its own tag and
  announces the payload, which follows on another tag as ``ceil(length / frame)`` messages (one when
  frame is 0) received into consecutive slices of the target buffer (:func:`frames`). Frames let a
  rate-limited side pace a smooth stream, as the TCP backend's send slices do.

A requester sends ``REQ_BLOCK`` (block, first chunk; payload ``package_id\\nrequester``) or ``REQ_FILE``
(block and chunk fields: offset and length of the range wanted, length 0 for the whole file; payload
``package_id\\nrequester\\npath``) and waits for its answer before the next request: ``CHUNK`` messages
for chunks first..last in order, one ``FILE`` message, or one ``ERROR`` (UTF-8 text). Over UCX a
request's frame field is the largest frame the requester wants (:data:`LIMITED_SEND_SLICE` when its
ingress is rate-limited, else 0), and a channel ends with ``CLOSE``, answered by ``CLOSE_ACK``.
"""

import logging
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pipecast.agent.errors import AgentError, PeerError, PeerProtocolError
from pipecast.agent.transport.base import ServedPackages

log = logging.getLogger(__name__)

VERSION = 2  # 2: REQ_FILE asks for a byte range
REQ_BLOCK, REQ_FILE, CHUNK, FILE, ERROR = 1, 2, 3, 4, 5
CLOSE, CLOSE_ACK = 6, 7  # UCX only
MAX_REQUEST_BYTES = 4096
MAX_ERROR_BYTES = 64 << 10
MAX_FILE_BYTES = 256 << 20  # manifests of very large models with 1 MiB chunks are a few MB
# A frame below this is a peer making us post a receive per few bytes.
MIN_FRAME_BYTES = 4096
# Rate-limited sends go in slices this big so a limited link carries a smooth stream, not chunk bursts.
LIMITED_SEND_SLICE = 64 << 10



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


# -- requests ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A request as the serving side reads it. For ``REQ_FILE``, ``block`` and ``chunk`` hold the offset
    and length of the range wanted (length 0: the whole file)."""

    kind: int
    block: int
    chunk: int
    package_id: str
    requester: str
    path: str = ""


def request_payload(package_id: str, requester: str, path: str | None = None) -> bytes:
    """The payload of a ``REQ_BLOCK`` (no ``path``) or ``REQ_FILE`` request."""
    return "\n".join([package_id, requester, *([path] if path is not None else [])]).encode()


def check_request(header: Header, peer: str) -> None:
    """Raise :class:`PeerProtocolError` unless ``header`` announces a request of an allowed size."""
    if header.kind not in (REQ_BLOCK, REQ_FILE) or not 0 < header.length <= MAX_REQUEST_BYTES:
        raise PeerProtocolError(peer, f"sent message type {header.kind} of {header.length} bytes as a request")


def parse_request(header: Header, payload: bytes | bytearray) -> Request:
    """The request ``header`` (checked by :func:`check_request`) and its ``payload`` make."""
    fields = payload.decode("utf-8", "replace").split("\n")
    return Request(header.kind, header.block, header.chunk, fields[0], fields[1] if len(fields) > 1 else "?",
                   fields[2] if len(fields) > 2 else "")


# How a serving backend sends one message (header and payload) to the requester.
SendMessage = Callable[[Header, memoryview], Awaitable[None]]


async def _now(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


async def answer_request(served: ServedPackages, request: Request, send: SendMessage, peer: str,
                         waiting: Callable[[Awaitable[Any]], Awaitable[Any]] = _now) -> None:
    """Answer ``request`` from ``served`` through ``send``: the block's ``CHUNK`` messages from the first
    chunk asked for, each as soon as ``served`` has it, or the ``FILE`` message. If ``served`` refuses (an
    :class:`AgentError`: not held here) the answer is one ``ERROR`` with its text, and the connection
    serves on; a :class:`PeerError` (the requester stopped reading or went away) is raised. ``waiting``
    wraps every wait on ``served`` (UCX gives up on a requester that leaves meanwhile); ``peer`` names
    the requester in the log."""
    block = request.block if request.kind == REQ_BLOCK else None
    try:
        served.peer_requested(request.requester, request.package_id, block)
        if request.kind == REQ_BLOCK:
            count = await waiting(served.chunk_count(request.package_id, request.block))
            for chunk in range(request.chunk, count):
                data = byte_view(await waiting(served.wait_chunk(request.package_id, request.block, chunk)))
                await send(Header(CHUNK, request.block, chunk, len(data)), data)
        else:
            data = await waiting(served.file_bytes(request.package_id, request.path, request.block, request.chunk))
            await send(Header(FILE, length=len(data)), memoryview(data))
    except PeerError:
        raise
    except AgentError as exc:  # we do not hold what was asked for: say so and keep serving
        log.info("refusing %s: %s", peer, exc)
        message = str(exc).encode()[:MAX_ERROR_BYTES]
        await send(Header(ERROR, request.block, request.chunk, len(message)), memoryview(message))


# -- answers -------------------------------------------------------------------------------------------


def check_answer(header: Header, expected: int, what: str, peer: str) -> None:
    """Raise :class:`PeerProtocolError` unless ``header`` is an ``ERROR`` or the ``expected`` answer
    (``CHUNK``, ``FILE``) to the request for ``what`` (e.g. "file config.json"), within the size limits."""
    if header.kind == ERROR:
        if header.length > MAX_ERROR_BYTES:
            raise PeerProtocolError(peer, f"sent an error message of {header.length} bytes")
    elif header.kind != expected:
        raise PeerProtocolError(peer, f"sent message type {header.kind} in answer to {what}")
    elif header.kind == FILE and header.length > MAX_FILE_BYTES:
        raise PeerProtocolError(peer, f"sent {what} of {header.length} bytes (limit {MAX_FILE_BYTES})")


def check_chunk(header: Header, block: int, chunk: int, size: int, peer: str) -> None:
    """Raise :class:`PeerProtocolError` unless ``header`` is chunk ``chunk`` of ``block``, ``size`` bytes."""
    if header.block != block or header.chunk != chunk:
        raise PeerProtocolError(peer, f"sent chunk {header.chunk} of block {header.block}; expected chunk "
                                      f"{chunk} of block {block}")
    if header.length != size:
        raise PeerProtocolError(peer, f"sent {header.length} bytes for chunk {chunk} of block {block}; "
                                      f"the manifest says {size}")
