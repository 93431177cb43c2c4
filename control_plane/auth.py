"""Who may talk to the control plane: a bearer token on every RPC naming a principal, and optional TLS / mTLS.

The token travels as ``authorization: Bearer <token>`` metadata. :class:`TokenAuthInterceptor` resolves
it to a :class:`~pipecast.core.credentials.Principal` (the master token: the operator; a node token: that
node; see :mod:`pipecast.core.credentials`) and runs the handler with it in :func:`current_principal`;
an unknown or forged token is UNAUTHENTICATED and the handler never runs, so a refused call changes
nothing. The standard health service is exempt, so that probes (kubelet, load balancers) that cannot
send a token still work; it tells nothing but SERVING / NOT_SERVING, and bounds what a caller without a token
can make it read or keep (:mod:`control_plane.health`). What each principal may do is decided by the handlers
(:mod:`control_plane.service`).
"""

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import Counter

from control_plane.errors import NO_TOKEN, TlsConfigError
from pipecast.core.credentials import Principal, principal_for
from pipecast.core.loglimit import LogLimit

log = logging.getLogger(__name__)

AUTH_KEY = "authorization"
BEARER = "Bearer "
HEALTH_PREFIX = "/grpc.health.v1.Health/"
DENIED_READ_S = 5.0  # how long a refused streaming call may take to send its first message
DENIED_HELD_MAX = 8  # refused streams waiting for that (of up to 64 MiB each) at once; beyond, refused at once
DENIED = (f"{NO_TOKEN}: send metadata 'authorization: Bearer <token>' with the control plane's token or a node "
          "token it issued")

# The principal of the call being handled (set by the interceptor's wrapper in the call's own task).
_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("pipecast_principal", default=None)


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (none when the token is empty: auth off)."""
    return ((AUTH_KEY, f"{BEARER}{token}"),) if token else ()


def current_principal() -> Principal | None:
    """Who makes the call being handled; None outside a call the interceptor admitted (auth off)."""
    return _principal.get()


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits a call (except health checks) only with the master token or a node token issued from it,
    and runs its handler as that principal; else UNAUTHENTICATED, counted in ``refused`` and logged at a bounded
    rate (a caller without a token could otherwise write thousands of lines a second)."""

    def __init__(self, master: str, refused: Counter):
        if not master:
            raise ValueError("TokenAuthInterceptor needs a non-empty master token")
        self._master = master
        self._refused = refused
        self._log = LogLimit(log)
        self._held = 0  # refused streams being held for their first message

    def _principal(self, metadata: object) -> Principal | None:
        for key, value in metadata or ():  # type: ignore[attr-defined]
            if key == AUTH_KEY:
                given = value.decode(errors="replace") if isinstance(value, bytes) else value
                return principal_for(self._master, given[len(BEARER):]) if given.startswith(BEARER) else None
        return None

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        principal = self._principal(handler_call_details.invocation_metadata)
        if principal is None:
            self._refused.inc()
            self._log.log(logging.WARNING, "refused unauthenticated call method=%s", method)
            if not handler.request_streaming:
                # Refused unread: a unary handler has gRPC receive and parse the whole request (up to the
                # server's message limit, 64 MiB) before it runs, which a caller without a token could repeat
                # at will to fill the control plane's memory. A request-streaming handler reads none of it.
                return _unread(handler, self._refuse)
            return rebuilt(handler, self._denied, self._denied)  # a coroutine may answer a stream
        return rebuilt(handler, *_as_principal(principal, handler))

    async def _refuse(self, requests: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    async def _denied(self, request: object, context: grpc.aio.ServicerContext) -> None:
        if hasattr(request, "__anext__") and self._held < DENIED_HELD_MAX:
            # A streaming client writes before it reads: refused at once, its write can race the refusal and
            # fail with gRPC's local "Internal error from Core" instead of this status (seen in CI). So take
            # its first message (or its end), waiting DENIED_READ_S at most, then refuse.
            self._held += 1
            try:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(DENIED_READ_S):
                        await anext(request, None)  # type: ignore[call-overload]
            finally:
                self._held -= 1
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


def _behavior(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return (handler.unary_unary or handler.unary_stream or handler.stream_unary  # type: ignore[return-value]
            or handler.stream_stream)


def _as_principal(principal: Principal, handler: grpc.RpcMethodHandler) -> tuple[Callable, Callable]:
    """``handler``'s behavior run as ``principal`` (unary-response and streaming-response forms)."""
    behavior = _behavior(handler)

    async def unary(request: object, context: grpc.aio.ServicerContext) -> object:
        _principal.set(principal)
        return await behavior(request, context)

    async def streaming(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        _principal.set(principal)
        async for response in behavior(request, context):
            yield response

    return unary, streaming


def rebuilt(handler: grpc.RpcMethodHandler, unary: Callable, streaming: Callable) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` running ``unary`` or ``streaming`` (by response kind)."""
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


def _unread(handler: grpc.RpcMethodHandler, refuse: Callable) -> grpc.RpcMethodHandler:
    """A request-streaming handler in place of the unary-request ``handler``, answering with ``refuse`` (which
    reads nothing); on the wire a unary request is a stream of one message, so its caller sees the refusal."""
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        async def streaming(requests: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
            await refuse(requests, context)
            yield  # never reached: makes this an async generator, as a streaming response's behavior must be

        return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)
    return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)


_SETTING = {"certificate": "tls_cert", "key": "tls_key", "CA": "tls_ca"}


def _read(path: Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"cannot read TLS {what} {path}: {exc.strerror or exc}") from exc
    # Checked here: gRPC's own failure came as a bind error on the server (its port blamed), an unanswered call on a
    # client, each after lines of C-core logging.
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"TLS {what} {path} ({_SETTING[what]}) holds no PEM block (-----BEGIN ...)")
    return data


def server_credentials(cert: Path | None, key: Path | None, ca: Path | None) -> grpc.ServerCredentials | None:
    """TLS for the server from ``cert`` and ``key`` (None: plaintext); with ``ca``, clients must present a
    certificate signed by it (mTLS)."""
    if cert is None and key is None:
        if ca is not None:
            raise TlsConfigError(f"a client CA ({ca}) is set for mTLS but no server certificate and key")
        return None
    if cert is None or key is None:
        raise TlsConfigError("TLS needs both a certificate and a key; only one is set "
                             f"(cert={cert}, key={key})")
    return grpc.ssl_server_credentials([(_read(key, "key"), _read(cert, "certificate"))],
                                       root_certificates=_read(ca, "CA") if ca is not None else None,
                                       require_client_auth=ca is not None)


def channel_credentials(ca: Path | None, cert: Path | None, key: Path | None) -> grpc.ChannelCredentials | None:
    """TLS for a client: verify the server with ``ca`` and, for mTLS, present ``cert`` and ``key``.
    None (plaintext) when none is set."""
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise TlsConfigError(f"a client certificate needs both cert and key; only one is set (cert={cert}, key={key})")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA") if ca is not None else None,
        private_key=_read(key, "key") if key is not None else None,
        certificate_chain=_read(cert, "certificate") if cert is not None else None)
