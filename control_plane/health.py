"""The control plane's gRPC health service (``grpc.health.v1.Health``): SERVING on the replica that serves,
NOT_SERVING on a standby and once stopping, for the whole server (``""``) and for the ControlPlane service.

It answers without a token (probes cannot send one), so it keeps nothing a caller names: grpcio's stock
servicer kept, for each open Watch, the service name it asked for (any length, up to the server's 64 MiB
message limit), and a caller without a token could fill the control plane's memory with open Watch streams.
Here a name that is not one of the two is NOT_FOUND (Check) or SERVICE_UNKNOWN (Watch, held open as the
protocol says, holding no name); a request over :data:`MAX_REQUEST_BYTES` is not even parsed. The handlers
take the request as a stream (on the wire a unary request is a stream of one message) so that it is read only
under :data:`READING_MAX`: until then gRPC holds at most its flow-control window of it, not 64 MiB.
"""

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1.health_pb2 import DESCRIPTOR, HealthCheckRequest, HealthCheckResponse

HEALTH_SERVICE = DESCRIPTOR.services_by_name["Health"].full_name
MAX_REQUEST_BYTES = 256  # a known name is a few dozen bytes; larger requests are not parsed
READING_MAX = 4  # health requests read at once (each up to 64 MiB, from callers without a token)
READ_S = 5.0  # how long a health call may take to send its request
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


class HealthService:
    """Check and Watch for the ``services`` named at construction, all NOT_SERVING until :meth:`set`."""

    def __init__(self, services: Iterable[str]) -> None:
        self._status = dict.fromkeys(services, NOT_SERVING)
        self._changed = asyncio.Condition()
        self._reading = asyncio.Semaphore(READING_MAX)
        self._stopping = False

    def status(self, service: str | None) -> int:
        """What Check and Watch say of ``service`` now (None: a service not known here)."""
        return self._status.get(service, SERVICE_UNKNOWN) if service is not None else SERVICE_UNKNOWN

    async def set(self, serving: bool) -> None:
        """Every service SERVING or NOT_SERVING (ignored once :meth:`stop` was called)."""
        if self._stopping:
            return
        await self._set(SERVING if serving else NOT_SERVING)

    async def stop(self) -> None:
        """NOT_SERVING for good: the server is stopping."""
        await self._set(NOT_SERVING)
        self._stopping = True

    async def _set(self, status: int) -> None:
        async with self._changed:
            self._status = dict.fromkeys(self._status, status)
            self._changed.notify_all()

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's handlers, to add to a server."""
        kwargs = {"request_deserializer": _parse, "response_serializer": HealthCheckResponse.SerializeToString}
        return grpc.method_handlers_generic_handler(HEALTH_SERVICE, {
            "Check": grpc.stream_unary_rpc_method_handler(self._check, **kwargs),
            "Watch": grpc.stream_stream_rpc_method_handler(self._watch, **kwargs)})

    async def _service(self, requests: AsyncIterator[HealthCheckRequest | None],
                       context: grpc.aio.ServicerContext) -> str | None:
        """The known service the call's request names; None for any other (its name is not kept)."""
        async with self._reading:
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
