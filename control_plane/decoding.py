"""Requests whose bytes do not parse as their message (a string field that is not UTF-8, a truncated field) are
answered INVALID_ARGUMENT naming the call and the parser's complaint, as any other bad input: gRPC itself would
answer UNKNOWN with a Python exception class in the message and log a traceback."""

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from control_plane.auth import HEALTH_PREFIX

log = logging.getLogger(__name__)


class _Undecodable:
    """What the guarded deserializer gives for bytes that do not parse: the handler's wrapper refuses it."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Refuses, INVALID_ARGUMENT, a request (or a stream's message) that does not parse as its message type. The
    control plane's streaming-response handlers are async generators, as it wraps them."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        # The health service parses its requests itself, none refused (control_plane/health.py): left as it is.
        if (handler is None or handler.request_deserializer is None
                or handler_call_details.method.startswith(HEALTH_PREFIX)):
            return handler
        return _guarded(handler, handler_call_details.method.rsplit("/", 1)[-1])


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def deserializer(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return _Undecodable(f"the {method} request does not parse: {exc}")

    async def refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
        log.warning("refused a call: %s", request.problem)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.problem)

    async def requests_checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Undecodable):
                await refuse(request, context)
            yield request

    # Each wrapper is of its shape's kind (an async generator function, or a coroutine function): gRPC runs a plain
    # function as a synchronous one, in a thread.
    kwargs = {"request_deserializer": deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in handler.stream_stream(requests_checked(requests, context), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)
    if handler.request_streaming:
        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await handler.stream_unary(requests_checked(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
    if handler.response_streaming:
        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await refuse(request, context)
            async for response in handler.unary_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await refuse(request, context)
        return await handler.unary_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
