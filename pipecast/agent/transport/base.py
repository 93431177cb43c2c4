"""The transport interface: how blocks move between agents, whatever carries them (TCP, UCX).

A backend implements :class:`Transport` (listen, connect), :class:`Channel` (one connection to one peer,
one request at a time) and :class:`Listener`; the messages it carries are :mod:`.wire`'s. It knows
nothing of stores or plans: the receive side writes each chunk into the buffer a :class:`ChunkSink` gives
and then reports it, the serve side asks the :class:`ServedPackages` for each chunk and sends it as soon
as it is there (cut-through: a node still receiving a block serves its verified chunks at once).

Contract every backend keeps:
- every wait on the network has a deadline (connect timeout; I/O silence timeout while a request is
  outstanding), and a failure raises a :class:`~pipecast.agent.errors.PeerError` subclass naming the peer;
- an error from the sink (a corrupt chunk) ends the request with that error and the channel is closed;
- the served packages' errors are sent to the requester, who raises ``PeerRefusedError``;
- ``stats`` counts payload bytes both ways, for goodput.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from pipecast.agent.ratelimit import HostRateLimits
from pipecast.core.settings import Settings


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


class ServedPackages(Protocol):
    """What a node serves to its peers: the packages its stores hold (the agent's peer server)."""

    async def chunk_count(self, package_id: str, block: int) -> int:
        """Number of chunks of ``block``; raises ``UnknownPackageError`` if not served here."""
        ...

    async def wait_chunk(self, package_id: str, block: int, chunk: int) -> memoryview:
        """The verified bytes of ``chunk``, once this node has them."""
        ...

    async def file_bytes(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        """A package's manifest (``manifest.json``) or small file, whole once verified (``length`` 0), or
        its bytes ``offset .. offset + length`` as soon as they are here; raises ``UnknownPackageError``."""
        ...

    def peer_requested(self, requester: str, package_id: str, block: int | None) -> None:
        """Note that node ``requester`` asked for ``block`` (None: a file) of ``package_id``."""
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
    async def fetch_block(self, package_id: str, block: int, first_chunk: int, sink: ChunkSink) -> None:
        """Receive chunks ``first_chunk`` .. last of ``block`` into ``sink``, in order; return when done."""

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

    def __init__(self, node_id: str, settings: Settings) -> None:
        self.node_id = node_id
        self.connect_timeout_s = settings.connect_timeout_s
        self.io_timeout_s = settings.io_timeout_s
        self.limits = HostRateLimits.from_mbit(settings.egress_mbit, settings.ingress_mbit)
        self.stats = TransportStats()

    @abstractmethod
    async def listen(self, host: str, port: int, served: ServedPackages) -> Listener:
        """Serve ``served`` to peers on ``host:port`` (port 0: any free port)."""

    @abstractmethod
    async def connect(self, address: str, peer: str) -> Channel:
        """Open a channel to the agent at ``address``; ``peer`` is how errors name it."""

    async def close(self) -> None:
        """Close what is still open and release what the backend holds for the process (idempotent); the
        agent calls it on shutdown. This default, for backends that hold nothing, does nothing."""
