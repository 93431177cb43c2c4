"""Who may talk to the control plane: a shared bearer token on every RPC, and optional TLS / mTLS.

The token travels as ``authorization: Bearer <token>`` metadata and is compared in constant time. The
standard health service is exempt, so that probes (kubelet, load balancers) that cannot send a token
still work; it tells nothing but SERVING / NOT_SERVING.
"""

import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from control_plane.errors import TlsConfigError

log = logging.getLogger(__name__)

AUTH_KEY = "authorization"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
DENIED = "missing or wrong token: send metadata 'authorization: Bearer <token>' with the control plane's token"


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (none when the token is empty: auth off)."""
    return ((AUTH_KEY, f"Bearer {token}"),) if token else ()


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call (except health checks) whose token is not the server's: UNAUTHENTICATED, and
    the handler never runs, so a refused call changes nothing."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, metadata: object) -> bool:
        for key, value in metadata or ():  # type: ignore[attr-defined]
            if key == AUTH_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX) \
                or self._authorized(handler_call_details.invocation_metadata):
            return handler
        log.warning("refused unauthenticated call method=%s", method)
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only answers UNAUTHENTICATED."""
    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"cannot read TLS {what} {path}: {exc.strerror or exc}") from exc


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
