"""Typed failures of the node agent; each message says whose fault the failure was."""

from pipecast.core.errors import PipecastError


class AgentError(PipecastError):
    """Base of every node-agent failure."""


class PeerError(AgentError):
    """A peer (parent, source or child) failed us; ``peer`` names it."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(f"peer {peer}: {message}")
        self.peer = peer


class PeerConnectError(PeerError):
    """The peer could not be reached within the connect timeout (refused, unreachable, unresolvable, too slow,
    or the TLS handshake with it failed)."""


class PeerNotListeningError(PeerConnectError):
    """The peer's host refused the connection: nothing listens at its data-plane address (its agent is not
    running there). A fetch gives up at once on such a peer it was connected to before (a parent it had not
    reached yet may be starting up: retried as any), so that its children are re-planned in a round trip
    rather than after the retries' backoff. TCP only: UCX names a refused endpoint
    in several ways (not connected, canceled, truncated), no one of them sure to mean that."""


class PeerConnectTimeoutError(PeerConnectError):
    """No connection (its hello included) within the connect timeout: the peer's host took the connection but its
    agent never answered (stopped, hung), or nothing answered at all. Each try costs the whole timeout."""


class PeerTimeoutError(PeerError):
    """The peer stayed silent longer than the I/O timeout in the middle of a transfer."""


class PeerClosedError(PeerError):
    """The peer closed or reset the connection before the transfer ended."""


class PeerProtocolError(PeerError):
    """The peer sent something the protocol does not allow (bad header, wrong chunk, wrong size)."""


class PeerRefusedError(PeerError):
    """The peer answered with an error (it does not hold the package, block or file asked for)."""


class PeerAuthError(PeerError):
    """The data-plane hello failed: "peer X: authentication failed: ...". ``fault`` says whose it is:
    ``"here"`` (this node lacks the key the peer requires), ``"peer"`` (the peer proved no key, or runs
    without one), ``"keys differ"`` (both hold a key, not the same one: one of the two was given other
    cluster credentials; both key ids are in the message)."""

    def __init__(self, peer: str, message: str, fault: str) -> None:
        super().__init__(peer, f"authentication failed: {message}")
        self.fault = fault


class PeerNotAllowedError(AgentError):
    """A requester this node must not serve (not a child of it in any current plan of the package)."""


class ServeWaitTimeoutError(AgentError):
    """What a requester asked for did not arrive at this node within the serving deadline."""


class RelayBrokenError(AgentError):
    """This node passed on part of a chunk as it arrived, and that receive ended unverified: the peer being
    served must drop the answer (this node's upstream failed, not the peer)."""

    def __init__(self, block: int, chunk: int, why: str) -> None:
        super().__init__(f"chunk {chunk} of block {block} was passed on as it arrived, and {why}: the bytes "
                         "passed on are abandoned")
        self.block = block
        self.chunk = chunk


class AnswerAbandonedError(PipecastError):
    """An answer whose header and first bytes are sent cannot be finished (the chunk it passes on as it arrives
    failed here): the connection is closed mid-answer, which the requester takes as a closed connection and
    retries. Not an :class:`AgentError`: no ``ERROR`` answer can follow a header already sent."""


class CorruptChunkError(PeerError):
    """A chunk whose digest does not match the manifest; it was not marked present."""

    def __init__(self, peer: str, block: int, chunk: int) -> None:
        super().__init__(peer, f"sent a corrupt chunk {chunk} of block {block} (digest mismatch)")
        self.block = block
        self.chunk = chunk


class CorruptFileError(PeerError):
    """A manifest or small package file whose digest does not match what the plan or manifest says."""


class MemoryBudgetError(AgentError):
    """A package does not fit in the agent's memory budget; refused rather than swapped."""


class LocalResourceError(AgentError):
    """This node ran short of a resource of its own (file descriptors, socket buffers, memory, local ports)
    while connecting to a peer: no peer's fault, so no peer is blamed for it."""


class ListenError(AgentError):
    """The data plane cannot listen where it was told (the port in use, an address not this host's, a port
    below 1024 without the right): the message names host:port and the system's reason."""

    def __init__(self, host: str, port: int, reason: str) -> None:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        super().__init__(f"cannot listen on {where}: {reason}")
        self.host, self.port, self.reason = host, port, reason


class DataPlaneTlsError(AgentError):
    """The data plane's TLS files (``tls_cert``, ``tls_key``, ``tls_ca``) cannot be used: missing, unreadable,
    not PEM, or a key that is not the certificate's; the message names the file."""


class LocalPackageError(AgentError):
    """A package folder (seed or cache) that cannot be served: missing, unreadable or corrupt."""


class OpenCancelledError(AgentError):
    """Opening a store was called off while its local blocks were verified (the agent stopping, the package
    dropped): the verifying thread stops at its next chunk instead of re-hashing the rest."""


class CacheInUseError(AgentError):
    """Another agent holds the disk cache folder (its ``.lock``): two agents on one folder would remove each
    other's packages to make room; the message names the folder."""


class UnknownPackageError(AgentError):
    """A request names a package or block this agent does not hold."""


class DroppedHereError(UnknownPackageError):
    """The package a wait or a request is on was dropped here meanwhile (the node was released)."""


class TransportUnavailableError(AgentError):
    """The configured transport cannot be used on this node (not registered or not importable)."""


class PlanFileError(AgentError):
    """A static plan file that cannot be used (unreadable, malformed, or not naming this node)."""


class FetchFailedError(AgentError):
    """A block or file could not be fetched from its parent nor from any fallback source."""

    def __init__(self, what: str, attempts: list[tuple[str, Exception]], given_up: tuple[str, ...] = ()) -> None:
        tried = [f"{type(err).__name__}: {err}" for _, err in attempts]
        if given_up:
            tried.append(f"given up on earlier: {', '.join(given_up)}")
        super().__init__(f"{what} could not be fetched from any peer ({'; '.join(tried)})")
        self.what = what
        self.attempts = attempts


class LocalApiError(AgentError):
    """The local agent API refused a request or could not be reached."""


class PackageDroppedError(LocalApiError):
    """The agent dropped the package an engine waits for (the node was released): not a failed load; should the
    agent hold the package again, it is loaded afresh."""


class LocalApiTimeoutError(LocalApiError, TimeoutError):
    """What a local client waited for did not happen within its timeout (also a ``TimeoutError``)."""
