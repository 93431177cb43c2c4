"""The control plane's gRPC health service (``grpc.health.v1.Health``): SERVING on the replica that serves,
NOT_SERVING on a standby and once stopping, for the whole server (``""``) and for the ControlPlane service.

It answers without a token (probes cannot send one), so it keeps nothing a caller names: grpcio's stock
servicer kept, for each open Watch, the service name it asked for (any length, up to the server's 64 MiB
message limit), and a caller without a token could fill the control plane's memory with open Watch streams.
Here a name that is not one of the two is NOT_FOUND (Check) or SERVICE_UNKNOWN (Watch, held open as the
protocol says, holding no name); a request over :data:`MAX_REQUEST_BYTES` is not even parsed. The handlers
take the request as a stream (on the wire a unary request is a stream of one message) so that it is read only
in its turn: until then gRPC holds at most its flow-control window of it, not 64 MiB.

Turns are given so that no caller without a token can starve the probes that restart the control plane or route
around it (12 calls that never sent their request made every probe of the Helm chart time out, and kubelet restart
it). A caller reads one request at a time per address, and callers on other hosts at most :data:`READING_MAX` at
once among them: the silent calls of one address hold one turn, however many. Callers on this host (loopback, or
one of its own addresses: the chart's probe runs in the container and calls the pod's address) take a turn of their
own, one at a time, which no other host can hold; only something running here can delay them (and callers that a
proxy on this host forwards count as here, still one at a time). A turn is waited for :data:`READ_S` at most (then
RESOURCE_EXHAUSTED), and its request must come within :data:`READ_S` (then DEADLINE_EXCEEDED): a real client sends
it with the call's headers. So at most ``READING_MAX + 1`` requests (64 MiB each at most) are read at once.
"""

import asyncio
import contextlib
import ipaddress
import socket
import urllib.parse
from collections.abc import AsyncIterator, Iterable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1.health_pb2 import DESCRIPTOR, HealthCheckRequest, HealthCheckResponse

HEALTH_SERVICE = DESCRIPTOR.services_by_name["Health"].full_name
MAX_REQUEST_BYTES = 256  # a known name is a few dozen bytes; larger requests are not parsed
READING_MAX = 4  # health requests read at once from other hosts (each up to 64 MiB, from callers without a token)
READ_S = 1.0  # how long a health call may wait for its turn, and then take to send its request
THIS_HOST = ""  # the turns of the callers on this host
SERVING, NOT_SERVING, SERVICE_UNKNOWN = (HealthCheckResponse.SERVING, HealthCheckResponse.NOT_SERVING,
                                         HealthCheckResponse.SERVICE_UNKNOWN)


def _parse(data: bytes) -> HealthCheckRequest | None:
    """The request in ``data``; None when it is too long to name a known service, or does not parse."""
    if len(data) > MAX_REQUEST_BYTES:
        return None
    try:
        return HealthCheckRequest.FromString(data)
    except DecodeError:
        return None


def on_this_host(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``address`` is this host's: loopback, or the one the kernel would send from to reach it (a UDP
    socket connected to it, nothing sent; Linux drops packets from elsewhere that claim one of its addresses as
    their source). Not whether it can be bound: with ``ip_nonlocal_bind`` on (hosts running keepalived or HAProxy)
    any address can, and every caller passed as this host's."""
    if address.is_loopback:
        return True
    with socket.socket(socket.AF_INET6 if address.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((str(address), 9))
            return ipaddress.ip_address(probe.getsockname()[0].partition("%")[0]) == address
        except (OSError, ValueError):
            return False


def caller(peer: str) -> str:
    """Whose turns a call takes, from gRPC's peer string (``ipv4:10.0.0.1:5000``, ``ipv6:%5B::1%5D:5000``,
    ``unix:path``): :data:`THIS_HOST`, or the address of a caller on another host (its /64 for IPv6, which
    hands a host a /64 to take addresses from)."""
    kind, _, rest = peer.partition(":")
    if kind in ("unix", "unix-abstract"):
        return THIS_HOST
    try:
        address = ipaddress.ip_address(urllib.parse.unquote(rest).rpartition(":")[0].strip("[]"))
    except ValueError:
        return peer
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack listener's IPv4 caller
    if on_this_host(address):
        return THIS_HOST
    return str(address) if address.version == 4 else str(ipaddress.IPv6Network((address, 64), strict=False))


class HealthService:
    """Check and Watch for the ``services`` named at construction, all NOT_SERVING until :meth:`set`."""

    def __init__(self, services: Iterable[str]) -> None:
        self._status = dict.fromkeys(services, NOT_SERVING)
        self._changed = asyncio.Condition()
        self._reading = asyncio.Semaphore(READING_MAX)
        self._turns: dict[str, tuple[asyncio.Lock, int]] = {}  # a caller's turn, and how many of its calls wait
        self._stopping = False

    def status(self, service: str | None) -> int:
        """What Check and Watch say of ``service`` now (None: a service not known here)."""
        return self._status.get(service, SERVICE_UNKNOWN) if service is not None else SERVICE_UNKNOWN

    async def set(self, serving: bool) -> None:
        """Every service SERVING or NOT_SERVING (ignored once :meth:`stop` was called)."""
        async with self._changed:
            if not self._stopping:  # checked under the lock: a set() waiting for it while stop() ran must not undo it
                self._put(SERVING if serving else NOT_SERVING)

    async def stop(self) -> None:
        """NOT_SERVING for good: the server is stopping."""
        async with self._changed:
            self._stopping = True
            self._put(NOT_SERVING)

    def _put(self, status: int) -> None:
        self._status = dict.fromkeys(self._status, status)
        self._changed.notify_all()

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's handlers, to add to a server."""
        kwargs = {"request_deserializer": _parse, "response_serializer": HealthCheckResponse.SerializeToString}
        return grpc.method_handlers_generic_handler(HEALTH_SERVICE, {
            "Check": grpc.stream_unary_rpc_method_handler(self._check, **kwargs),
            "Watch": grpc.stream_stream_rpc_method_handler(self._watch, **kwargs)})

    @contextlib.asynccontextmanager
    async def _turn(self, who: str) -> AsyncIterator[None]:
        """``who``'s turn to read a request (and for a caller on another host, one of their :data:`READING_MAX`)."""
        lock, waiting = self._turns.get(who, (asyncio.Lock(), 0))
        self._turns[who] = (lock, waiting + 1)
        try:
            async with lock, (self._reading if who != THIS_HOST else contextlib.nullcontext()):
                yield
        finally:
            lock, waiting = self._turns.pop(who)
            if waiting > 1:
                self._turns[who] = (lock, waiting - 1)

    async def _service(self, requests: AsyncIterator[HealthCheckRequest | None],
                       context: grpc.aio.ServicerContext) -> str | None:
        """The known service the call's request names; None for any other (its name is not kept)."""
        async with contextlib.AsyncExitStack() as turn:
            try:
                async with asyncio.timeout(READ_S):
                    await turn.enter_async_context(self._turn(caller(context.peer())))
            except TimeoutError:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many health checks at once (from this"
                                    f" address, or from other hosts): this one waited {READ_S:g} s for its turn")
            try:
                async with asyncio.timeout(READ_S):
                    request = await anext(requests, None)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no health check request came within {READ_S:g} s")
        service = request.service if request is not None else None
        return service if service in self._status else None

    async def _check(self, requests: AsyncIterator[HealthCheckRequest | None],
                     context: grpc.aio.ServicerContext) -> HealthCheckResponse:
        service = await self._service(requests, context)
        if service is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown service: this health service knows {sorted(self._status)}")
        return HealthCheckResponse(status=self.status(service))

    async def _watch(self, requests: AsyncIterator[HealthCheckRequest | None],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[HealthCheckResponse]:
        # An unknown service stays SERVICE_UNKNOWN, so its call is held (as the protocol says) saying nothing more.
        service, last = await self._service(requests, context), None
        while True:
            async with self._changed:  # not held while writing: a client that does not read must not block set()
                while (status := self.status(service)) == last:
                    await self._changed.wait()
            last = status
            yield HealthCheckResponse(status=status)
