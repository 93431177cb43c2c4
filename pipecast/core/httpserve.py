"""Running an aiohttp application as a long-lived server: the shared life cycle of ``pipecast serve`` and
``pipecast router``, and reading request bodies within a size limit."""

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipecast.core.errors import PipecastError
from pipecast.core.strictjson import loads

if TYPE_CHECKING:
    from aiohttp import web

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


async def read_body(request: "web.Request", limit: int) -> bytes:
    """The body of ``request``, never holding more than ``limit`` bytes of it: :class:`BodyTooLargeError`
    at once when its Content-Length says more, else once the bytes streamed in pass the limit (a chunked
    body). Answer a refusal with ``force_close()`` on the response, so the rest is never read."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyTooLargeError(limit, declared)
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise BodyTooLargeError(limit)
    return bytes(body)


async def decode_json_body(body: bytes) -> Any:
    """:func:`pipecast.core.strictjson.loads` of a request body, on a thread when it is large (the C
    decoder holds the GIL for long stretches still, which is why servers also cap the body size)."""
    if len(body) <= INLINE_DECODE_BYTES:
        return loads(body)
    return await asyncio.to_thread(loads, body)


async def serve_until_signalled(app: "web.Application", host: str, port: int, drain_timeout_s: float,
                                announce: Callable[[str], None], **runner_options: Any) -> None:
    """Serve ``app`` on host:port (port 0: any free port) until SIGTERM or SIGINT.

    ``announce`` gets the bound base URL once it listens. On a signal it stops listening, runs the app's
    shutdown hooks and gives requests in flight ``drain_timeout_s`` to finish before cleaning up.
    ``runner_options`` go to aiohttp's ``AppRunner``.
    """
    from aiohttp import web

    runner = web.AppRunner(app, shutdown_timeout=drain_timeout_s, **runner_options)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound_host, bound_port = runner.addresses[0][:2]
        announce(f"http://{bound_host}:{bound_port}")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        log.info("stopping: draining requests in flight for up to %g s", drain_timeout_s)
    finally:
        await runner.cleanup()
