"""Running an aiohttp application as a long-lived server: the shared life cycle of ``pipecast serve`` and
``pipecast router``."""

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)


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
