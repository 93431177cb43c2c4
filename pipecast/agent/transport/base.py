"""The transport interface: how blocks move between agents, whatever carries them (TCP, UCX).

A backend implements :class:`Transport` (listen, connect), :class:`Channel` (one connection to one peer,
one request at a time) and :class:`Listener`; the messages it carries are :mod:`.wire`'s. It knows
nothing of stores or plans: the receive side writes each chunk into the buffer a :class:`ChunkSink` gives
and then reports it, the serve side asks the :class:`ServedPackages` for each chunk and sends it as soon
as it is there (cut-through: a node still receiving a block serves its verified chunks at once; a backend
that streams, TCP, passes a chunk on in pieces as they land, its last byte once the chunk is verified, see
:class:`ChunkRelay`).

Contract every backend keeps:
- with a data-plane key (:class:`PeerAuth`) every connection starts with the authenticated hello of
  :mod:`.wire`, and a peer that fails it is served nothing; without one the data plane is open (a
  warning says so once);
- every wait on the network has a deadline (connect timeout; I/O silence timeout while a request is
  outstanding; on the serving side a header deadline, an idle deadline and deadlines on the served
  packages), and a failure raises a :class:`~pipecast.agent.errors.PeerError` subclass naming the peer;
- a listener holds at most ``max_connections`` connections, ``max_connections_per_address`` from one
  address, and buffers a bounded amount of output per connection;
- an error from the sink (a corrupt chunk) ends the request with that error and the channel is closed;
- the served packages' errors are sent to the requester, who raises ``PeerRefusedError``;
- ``stats`` counts payload bytes both ways, for goodput.
"""

import asyncio
import hashlib
import hmac
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from pipecast.agent.ratelimit import DataPlaneCaps, HostRateLimits
from pipecast.core.credentials import data_plane_key, parse_node_token
from pipecast.core.settings import MIN_RELAY_PIECE_BYTES, Settings

log = logging.getLogger(__name__)

_KEY_ID_CONTEXT = b"pipecast data plane key id v1"
_warned_open = False


class PeerAuth:
    """A node's data-plane credentials: its node id and the cluster's data-plane key.

    The key is b"" when auth is off, and None while it is not known yet (an agent under a control plane
    learns it from its registration). The transports read it for every new connection, so a key set
    later (:meth:`set_key`) applies from then on.
    """

    def __init__(self, node_id: str, key: bytes | None = b"", *, require_key: bool = False) -> None:
        self.node_id = node_id
        self._key = key
        self._known: asyncio.Event | None = None
        # A node given credentials of its own never turns auth off: an empty key sent to it is refused
        self._require_key = require_key

    @classmethod
    def from_token(cls, node_id: str, token: str) -> "PeerAuth":
        """The credentials a cluster's master ``token`` gives (static-plan mode: every agent is given the
        master). A node token cannot derive the key: the key stays unknown until :meth:`set_key`."""
        if token and parse_node_token(token) is not None:
            return cls(node_id, None)
        return cls(node_id, data_plane_key(token))

    @property
    def key(self) -> bytes | None:
        return self._key

    @property
    def key_id(self) -> bytes:
        """8 bytes naming the key (not revealing it), so two nodes can tell that their keys differ."""
        return hmac.new(self._key or b"", _KEY_ID_CONTEXT, hashlib.sha256).digest()[:8]

    def set_key(self, key: bytes) -> None:
        """The data-plane key from now on (b"": auth off, unless the node was made with ``require_key``: then an
        empty key is refused, logged, and the key stays what it was, so that connections keep failing closed)."""
        if not key and self._require_key:
            log.error("node %s holds credentials of its own but was sent an empty data-plane key (a control plane "
                      "without auth_token?): data-plane authentication stays on", self.node_id)
            return
        self._key = bytes(key)
        if self._known is not None:
            self._known.set()
        if not key:
            warn_open_data_plane(self.node_id)

    async def wait_key(self, timeout_s: float) -> bytes | None:
        """The key, once known, waiting at most ``timeout_s`` (None: still unknown)."""
        if self._key is None:
            if self._known is None:
                self._known = asyncio.Event()
            try:
                await asyncio.wait_for(self._known.wait(), timeout_s)
            except TimeoutError:
                pass
        return self._key


def warn_open_data_plane(node_id: str) -> None:
    """Log, once per process, that this node serves its data plane without authentication."""
    global _warned_open
    if not _warned_open:
        _warned_open = True
        log.warning("node %s: data-plane authentication is off (no cluster credentials): any host that reaches "
                    "this node's data-plane port can fetch every package it holds", node_id)


def relay_piece_taken(own: int, cap: int) -> int:
    """The piece a relay passes chunks on in: its own (``agent_relay_bytes``), or its plan's ``cap`` where smaller (0:
    none; an own 0, whole chunks, stays: a plan never turns the relay on)."""
    return min(own, cap) if own and cap else own


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) to (host, port); ValueError naming the text otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


class ChunkSink(Protocol):
    """Where a fetched block's chunks land (the block store)."""

    def chunk_count(self, block: int) -> int:
        """Number of chunks of ``block``."""
        ...

    def chunk_buffer(self, block: int, chunk: int) -> memoryview:
        """Writable memory of exactly ``chunk``'s size to receive it into."""
        ...

    def chunk_landed(self, block: int, chunk: int, peer: str) -> None:
        """``chunk`` is fully written into its buffer; may raise (a corrupt chunk) to abort the fetch."""
        ...

    def chunk_progress(self, block: int, chunk: int, nbytes: int) -> None:
        """The first ``nbytes`` of ``chunk`` are written into its buffer (a backend that streams says so every
        ``agent_relay_bytes``), not yet whole: a relay may pass them on."""
        ...

    def chunk_dropped(self, block: int, chunk: int) -> None:
        """The receive of ``chunk`` ended before it was whole (its sender failed): its bytes are not the chunk."""
        ...


class ChunkRelay(Protocol):
    """One chunk's bytes for a peer, given in order as they come to be here (:meth:`ServedPackages.relay_chunk`).
    ``next`` may raise :class:`~pipecast.agent.errors.RelayBrokenError`: bytes already given are abandoned, and
    the answer carrying them must drop them (the chunk starts again, or the answer ends unfinished)."""

    length: int

    @property
    def done(self) -> bool:
        """Whether every byte was given."""
        ...

    async def next(self) -> memoryview:
        """The next bytes (at least one), once here."""
        ...


class WholeChunk:
    """A :class:`ChunkRelay` of a chunk that is whole and verified: all of it at once."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self.length = data.nbytes
        self.done = False

    async def next(self) -> memoryview:
        self.done = True
        return self._data


class ServedPackages(Protocol):
    """What a node serves to its peers: the packages its stores hold (the agent's peer server)."""

    async def chunk_count(self, package_id: str, block: int) -> int:
        """Number of chunks of ``block``; raises ``UnknownPackageError`` if not served here."""
        ...

    async def wait_chunk(self, package_id: str, block: int, chunk: int) -> memoryview:
        """The verified bytes of ``chunk``, once this node has them."""
        ...

    async def relay_chunk(self, package_id: str, block: int, chunk: int) -> ChunkRelay:
        """``chunk``'s bytes as they come to be here, for a backend that streams (a chunk still arriving: all but
        its last byte before it is verified); a server holding only whole chunks gives a :class:`WholeChunk`."""
        ...

    async def file_bytes(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        """A package's manifest (``manifest.json``) or small file, whole once verified (``length`` 0), or
        its bytes ``offset .. offset + length`` as soon as they are here; raises ``UnknownPackageError``."""
        ...

    async def admit(self, requester: str, package_id: str) -> None:
        """Return if node ``requester`` may be served ``package_id``; raise an ``AgentError`` saying why
        not (e.g. ``PeerNotAllowedError``: no current plan names it to this node)."""
        ...

    def peer_requested(self, requester: str, package_id: str, block: int | None) -> None:
        """Note that node ``requester`` asked for ``block`` (None: a file) of ``package_id`` (called once
        the request is admitted and valid)."""
        ...


@dataclass
class TransportStats:
    """Payload bytes moved by one transport instance (both directions, all peers)."""

    bytes_received: int = 0
    bytes_sent: int = 0


class Channel(ABC):
    """A connection to one peer; one request at a time. ``peer`` names the peer in every error."""

    peer: str

    @abstractmethod
    async def fetch_block(self, package_id: str, block: int, first_chunk: int, sink: ChunkSink,
                          end_chunk: int | None = None) -> None:
        """Receive chunks ``first_chunk`` .. ``end_chunk - 1`` of ``block`` (``end_chunk`` None: to its last
        chunk) into ``sink``, in order; return when done (at once for an empty range). ``ValueError`` if
        ``end_chunk`` is past the block's end: the range is the caller's to check against the manifest."""

    @abstractmethod
    async def fetch_file(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        """The bytes of a package's ``manifest.json`` or small file, as the peer has them (unverified):
        the whole file once the peer has verified it (``length`` 0), or bytes ``offset .. offset + length``
        as soon as the peer has them (it may still be receiving the rest)."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connection (idempotent)."""


class Listener(ABC):
    """A serving endpoint: ``address`` is where peers connect ("host:port" for TCP)."""

    address: str

    @property
    @abstractmethod
    def open_connections(self) -> int:
        """Peers connected right now."""

    @abstractmethod
    async def close(self) -> None:
        """Stop accepting, drop every connection."""


class Transport(ABC):
    """One backend instance per agent, holding its settings, rate limits and stats."""

    name: str

    def __init__(self, node_id: str, settings: Settings, auth: PeerAuth | None = None) -> None:
        self.node_id = node_id
        # Default: the key the settings' token gives (static-plan mode, tests); under a control plane the
        # agent passes credentials whose key comes with its registration.
        self.auth = auth if auth is not None else PeerAuth.from_token(node_id, settings.auth_token)
        self.connect_timeout_s = settings.connect_timeout_s
        self.io_timeout_s = settings.io_timeout_s
        # How long a connection's serving side waits for this node's data-plane key before it refuses the hello
        # with NO_KEY_YET: within a requester's own deadline for the hello (its connect deadline, shorter by
        # default), else the requester, timed out first, never learns that the fault was the peer's.
        self.key_wait_s = min(settings.io_timeout_s, settings.connect_timeout_s) / 2
        self.io_min_rate_mbit = settings.io_min_rate_mbit
        self.idle_timeout_s = settings.agent_idle_timeout_s
        self.max_connections = settings.agent_max_connections
        self.max_connections_per_address = settings.agent_max_connections_per_address
        caps = DataPlaneCaps.of(settings)  # raises LinkShareError: a share without the link rate
        if settings.multicast_share < 1:
            log.info("node %s: data plane capped at %.4g Mbit/s out, %.4g Mbit/s in (multicast_share %g of a "
                     "%g Mbit/s link)", node_id, caps.egress_mbit, caps.ingress_mbit, settings.multicast_share,
                     settings.agent_link_mbit)
        for priority, mbit in caps.priority_mbit.items():
            log.info("node %s: packages of priority %s capped at %.4g Mbit/s each way", node_id, priority, mbit)
        self.limits = HostRateLimits.of(caps)
        self.stats = TransportStats()
        self.relay_bytes = settings.agent_relay_bytes
        self._relay_caps: dict[str, int] = {}  # package -> the smaller relay piece its plans asked for

    def cap_relay(self, package_id: str, piece_bytes: int) -> None:
        """Pass ``package_id``'s chunks on in pieces of at most ``piece_bytes`` from now on, as its plans ask (a long
        chain's hops each wait for a piece; :data:`MIN_RELAY_PIECE_BYTES` at least); 0: in this node's own
        (``agent_relay_bytes``)."""
        if piece_bytes > 0:
            self._relay_caps[package_id] = max(piece_bytes, MIN_RELAY_PIECE_BYTES)
        else:
            self._relay_caps.pop(package_id, None)

    def relay_bytes_for(self, package_id: str) -> int:
        """The piece a relay of ``package_id`` passes chunks on in (:func:`relay_piece_taken`)."""
        return relay_piece_taken(self.relay_bytes, self._relay_caps.get(package_id, 0))

    def set_key(self, key: bytes) -> None:
        """The data-plane key from now on (b"": auth off); e.g. the one a control plane handed out."""
        self.auth.set_key(key)

    def _listening(self) -> None:
        """Called by a backend's :meth:`listen`: warn if the data plane is open."""
        if self.auth.key == b"":
            warn_open_data_plane(self.node_id)

    @abstractmethod
    async def listen(self, host: str, port: int, served: ServedPackages) -> Listener:
        """Serve ``served`` to peers on ``host:port`` (port 0: any free port)."""

    @abstractmethod
    async def connect(self, address: str, peer: str) -> Channel:
        """Open a channel to the agent at ``address``; ``peer`` is how errors name it."""

    async def close(self) -> None:
        """Close what is still open and release what the backend holds for the process (idempotent); the
        agent calls it on shutdown. This default, for backends that hold nothing, does nothing."""


class Evictable(Protocol):
    """A served connection :class:`ConnectionLimits` may close to make room for a newer one."""

    def evicted(self) -> None:
        """Close at once; the limits no longer count this connection (its own release must not count it again)."""


class ConnectionLimits:
    """The connections a listener holds: at most ``total``, at most ``per_address`` from one address.

    A connection still in its hello (:meth:`greeted` not yet called) yields its slot to a newer one when every slot
    is taken, the longest waiting first: connections that never prove membership cannot keep members out by holding
    every slot until their deadline."""

    def __init__(self, total: int, per_address: int) -> None:
        self.total = total
        self.per_address = per_address
        self.by_address: dict[str, int] = {}
        self.count = 0
        self._in_hello: dict[Evictable, str] = {}  # oldest first

    def admit(self, address: str, connection: Evictable) -> str | None:
        """Count a new connection from ``address`` (in its hello until :meth:`greeted`), closing the oldest one
        still in its hello where every slot is taken; or say why it is refused (then nothing is counted)."""
        held = self.by_address.get(address, 0)
        if held >= self.per_address:
            return f"{held} connections from {address} are open (limit {self.per_address} per address)"
        if self.count >= self.total:
            if not self._in_hello:
                return f"{self.count} connections are open (limit {self.total})"
            oldest, its_address = next(iter(self._in_hello.items()))
            self.release(its_address, oldest)
            oldest.evicted()
        self.by_address[address] = self.by_address.get(address, 0) + 1
        self.count += 1
        self._in_hello[connection] = address
        return None

    def greeted(self, connection: Evictable) -> None:
        """``connection`` passed its hello (or, with auth off, sent its first message): no longer evicted."""
        self._in_hello.pop(connection, None)

    def release(self, address: str, connection: Evictable) -> None:
        """A connection :meth:`admit` counted has ended."""
        self._in_hello.pop(connection, None)
        held = self.by_address.get(address, 0)
        if held <= 1:
            self.by_address.pop(address, None)
        else:
            self.by_address[address] = held - 1
        self.count = max(self.count - 1, 0)
