"""Running an aiohttp application as a long-lived server: the shared life cycle of ``pipecast serve`` and
``pipecast router``, reading request bodies within a size limit and a deadline, and reading an answer's body
whole within a size limit (:func:`read_capped`)."""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from pipecast.core.errors import PipecastError
from pipecast.core.signals import on_stop_signals
from pipecast.core.strictjson import loads

if TYPE_CHECKING:
    from aiohttp import StreamReader, web

log = logging.getLogger(__name__)

#: Bodies up to this size are decoded on the event loop; larger ones on a thread (``decode_json_body``).
INLINE_DECODE_BYTES = 1 << 20


class BodyTooLargeError(PipecastError):
    """A request body over the server's limit (answered 413): refused from its Content-Length before any
    byte is read, or as soon as a body without one passes the limit."""

    def __init__(self, limit: int, declared: int | None = None) -> None:
        size = f"of {declared} bytes " if declared is not None else ""
        super().__init__(f"the request body {size}is over this server's limit of {limit} bytes")
        self.limit, self.declared = limit, declared


class BodyTimeoutError(PipecastError):
    """A request body that did not arrive whole within the server's deadline (answered 408): a client that
    stalls mid-body would else hold its handler and the bytes read so far for good."""

    def __init__(self, timeout_s: float, received: int, declared: int | None = None) -> None:
        of = f" of {declared}" if declared is not None else ""
        super().__init__(f"the request body did not arrive within this server's deadline of {timeout_s:g} s "
                         f"({received}{of} bytes received)")
        self.timeout_s, self.received, self.declared = timeout_s, received, declared


async def read_body(request: "web.Request", limit: int, timeout_s: float | None = None) -> bytes:
    """The body of ``request``, never holding more than ``limit`` bytes of it: :class:`BodyTooLargeError`
    at once when its Content-Length says more, else once the bytes streamed in pass the limit (a chunked
    body); :class:`BodyTimeoutError` when it is not whole ``timeout_s`` after the read began (None: no
    deadline). Answer a refusal with ``force_close()`` on the response, so the rest is never read."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyTooLargeError(limit, declared)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                body += chunk
                if len(body) > limit:
                    raise BodyTooLargeError(limit)
    except TimeoutError:
        raise BodyTimeoutError(timeout_s, len(body), declared) from None
    return bytes(body)


async def read_capped(content: "StreamReader", cap: int) -> bytes:
    """An answer's body to its end, or its first ``cap`` + 1 bytes (the caller refuses an answer that long).
    One ``read(n)`` returns only what has arrived: an answer of several TCP segments would come cut."""
    parts, size = [], 0
    while size <= cap and (part := await content.read(cap + 1 - size)):
        parts.append(part)
        size += len(part)
    return b"".join(parts)


async def decode_json_body(body: bytes) -> Any:
    """:func:`pipecast.core.strictjson.loads` of a request body, on a thread when it is large (the C
    decoder holds the GIL for long stretches still, which is why servers also cap the body size)."""
    if len(body) <= INLINE_DECODE_BYTES:
        return loads(body)
    return await asyncio.to_thread(loads, body)


class ListenError(PipecastError):
    """A server could not listen where it was told (the address is in use, not this host's, or a port below
    1024 without the right); the message names the address and the system's reason."""

    def __init__(self, host: str, port: int, reason: str) -> None:
        super().__init__(f"cannot listen on {host}:{port}: {reason}")
        self.host, self.port, self.reason = host, port, reason


@asynccontextmanager
async def listening(app: "web.Application", host: str, port: int, **runner_options: Any) -> AsyncIterator[str]:
    """Serve ``app`` on host:port (port 0: any free port) while the block runs; yield its bound base URL.
    On exit it stops listening and cleans the app up; ``runner_options`` go to aiohttp's ``AppRunner``."""
    from aiohttp import web

    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            # asyncio words a busy port "error while attempting to bind on address (...): address already in use".
            raise ListenError(host, port, (exc.strerror or str(exc)).rpartition(": ")[2]) from None
        bound_host, bound_port = runner.addresses[0][:2]
        # An IPv6 address goes in brackets (RFC 3986): http://::1:8000 would read as host "::1:8000"
        yield f"http://[{bound_host}]:{bound_port}" if ":" in bound_host else f"http://{bound_host}:{bound_port}"
    finally:
        await runner.cleanup()


#: aiohttp ``AppRunner`` options of pipecast's HTTP servers: a client that disconnects cancels its handler (a
#: request waiting gives its place up at once, not at its deadline; one at a worker is cancelled there too), and a
#: request answered before its body was read (401, 413, 429) has the rest read and dropped for at most
#: ``lingering_time`` before its connection closes: long enough for a client sending a body of a usual size to
#: finish and read its answer (closed at once, it would get a reset instead), where aiohttp's default (10 s) took
#: ~20 GiB from one client sending on loopback. A connection idle for ``keepalive_timeout``, or whose request's
#: headers are not in by then, is closed (aiohttp's default: an hour, so that clients sending no request, or half
#: of one, held a connection and its file descriptor each).
RUNNER_OPTIONS: dict[str, Any] = {"handler_cancellation": True, "lingering_time": 1.0, "keepalive_timeout": 75.0}


#: The shortest drain a server takes (``drain_timeout_s`` 0: requests in flight are cut at once).
MIN_DRAIN_S = 0.001
#: How long past its time an app's own drain is waited for before it is cancelled (it should end by its time).
DRAIN_OVERRUN_S = 1.0


async def serve_until_signalled(app: "web.Application", host: str, port: int, drain_timeout_s: float,
                                announce: Callable[[str], None],
                                drain: Callable[[float], Awaitable[None]] | None = None,
                                **runner_options: Any) -> None:
    """Serve ``app`` on host:port (port 0: any free port) until SIGTERM, SIGINT or SIGHUP (not one ignored at start:
    :func:`~pipecast.core.signals.on_stop_signals`).

    ``announce`` gets the bound base URL once it listens. On a signal it stops listening, runs the app's
    shutdown hooks and gives requests in flight ``drain_timeout_s`` to finish before cleaning up. With ``drain``,
    the app drains itself first, still listening (a pipeline stage's calls come as new requests): ``drain`` is
    awaited with the drain's time and should return once nothing runs, by that time at most (it is cut then);
    what is left is cut at once after it. ``runner_options`` go to aiohttp's ``AppRunner``.
    """
    # aiohttp takes a shutdown timeout of 0 for none: --drain-timeout 0 waited on a request in flight for good.
    shutdown_s = MIN_DRAIN_S if drain is not None else max(drain_timeout_s, MIN_DRAIN_S)
    async with listening(app, host, port, shutdown_timeout=shutdown_s, **runner_options) as url:
        announce(url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        on_stop_signals(loop, stop.set)
        await stop.wait()
        log.info("stopping: draining requests in flight for up to %g s", drain_timeout_s)
        if drain is not None:
            try:
                async with asyncio.timeout(drain_timeout_s + DRAIN_OVERRUN_S):
                    await drain(drain_timeout_s)
            except TimeoutError:
                log.warning("the drain ran past its %g s: what still runs is cut", drain_timeout_s)
