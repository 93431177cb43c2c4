"""Whether something listens at a worker's data-plane address: the control plane's own look before it takes a
worker another reported gone for dead (a child's word alone would let any member drop its parent from the
cluster, and a parent restarted meanwhile would be dropped wrongly)."""

import asyncio
import logging

log = logging.getLogger(__name__)

#: How long the look may take (s): a refused connection answers within a round trip; a host this control plane
#: cannot reach (its network apart from the agents') is no answer, and the report is then taken as it is.
PROBE_TIMEOUT_S = 1.0


async def listens(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """True when a TCP connection to host:port opens (it is closed at once, before any byte is sent), False when
    it is refused (nothing listens there), None when neither is known within ``timeout_s`` (no route, filtered,
    the name not resolved)."""
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return False
    except (OSError, TimeoutError) as exc:
        log.info("could not tell whether %s:%d listens: %s", host, port, exc or type(exc).__name__)
        return None
    writer.transport.abort()  # a reset, not a connection left for the agent to time out
    return True
