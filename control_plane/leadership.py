"""A standby replica's answer: every call but health checks fails UNAVAILABLE, naming the leader.

Replicas of the control plane share a PostgreSQL database; the one holding its lease (see
:mod:`control_plane.store`) serves. The others answer each call with status UNAVAILABLE, the leader's
advertised address in the ``pipecast-leader`` trailer (:data:`~control_plane.errors.LEADER_TRAILER`) and a
message naming both, so that a client with several addresses calls the leader next. Health checks pass
through: they say NOT_SERVING on a standby.
"""

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from control_plane.auth import HEALTH_PREFIX, rebuilt
from control_plane.errors import LEADER_TRAILER


class StandbyGate(grpc.aio.ServerInterceptor):
    """Lets calls through while :attr:`leading`; otherwise answers them as a standby, naming :attr:`leader`
    (address and fencing number, as last read from the database; ``("", 0)``: none known)."""

    def __init__(self) -> None:
        self.leading = False
        self.advertise = ""  # this replica's own address, for the message
        self.leader: tuple[str, int] = ("", 0)

    def refusal(self) -> str:
        """What a standby says to a call."""
        address, fencing = self.leader
        if not address or address == self.advertise:  # its own lease lapsed: nobody leads until it is taken
            return f"control plane {self.advertise} is a standby and no replica leads now: retry in a moment"
        return f"control plane {self.advertise} is a standby: the leader is {address} (fencing number {fencing})"

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if self.leading or handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        return rebuilt(handler, self._refuse, self._refuse_stream)

    async def _refuse(self, request: object, context: grpc.aio.ServicerContext) -> None:
        address = self.leader[0]
        trailer = ((LEADER_TRAILER, address),) if address and address != self.advertise else ()
        await context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal(), trailing_metadata=trailer)

    async def _refuse_stream(self, request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        # A generator, not a coroutine: the auth interceptor iterates the streaming handlers it wraps.
        await self._refuse(request, context)
        yield  # never reached: the abort ends the call
