"""Polls each worker's ``GET /health`` and records the answers in the pool (one task per worker).

The answer's format is :class:`pipecast.serve.health.WorkerHealth`, the type the worker writes.
"""

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp

from pipecast.core import strictjson
from pipecast.router.errors import HealthAnswerError, describe_exception
from pipecast.router.pool import WorkerPool
from pipecast.serve.health import HealthFormatError, WorkerHealth

log = logging.getLogger(__name__)

MAX_HEALTH_BYTES = 64 << 10  # a /health answer is a few hundred bytes; more is a broken or hostile worker


def parse_health(worker: str, answer: object) -> WorkerHealth:
    """Check a decoded ``/health`` JSON answer of ``worker`` and return it typed.

    Raises :class:`HealthAnswerError` when the answer is not an object with a known status and
    non-negative integer counts.
    """
    try:
        return WorkerHealth.from_json(answer)
    except HealthFormatError as exc:
        raise HealthAnswerError(worker, str(exc)) from None


class HealthMonitor:
    """Keeps each worker's health in the pool fresh: a poll every ``interval_s``, each within ``timeout_s``.

    A poll that fails (connection error, timeout, HTTP status other than 200, malformed answer) marks
    the worker down until a poll succeeds.
    """

    def __init__(self, pool: WorkerPool, session: aiohttp.ClientSession, interval_s: float,
                 timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._session = session
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock
        self._tasks: dict[str, asyncio.Task] = {}

    def sync(self, urls: Iterable[str]) -> None:
        """Poll exactly the workers at ``urls``: start polling new ones, stop polling removed ones."""
        urls = set(urls)
        for url in set(self._tasks) - urls:
            self._tasks.pop(url).cancel()
        for url in urls - set(self._tasks):
            self._tasks[url] = asyncio.create_task(self._watch(url), name=f"health {url}")

    async def poll(self, url: str) -> None:
        """Ask the worker at ``url`` for its health once and record the answer or the failure."""
        before = self._status(url)
        polled_at = self._clock()
        try:
            async with self._session.get(f"{url}/health", timeout=self._timeout) as response:
                if response.status != 200:
                    raise HealthAnswerError(url, f"/health answered HTTP {response.status}")
                body = await response.content.read(MAX_HEALTH_BYTES + 1)
                if len(body) > MAX_HEALTH_BYTES:
                    raise HealthAnswerError(url, f"/health answered more than {MAX_HEALTH_BYTES} bytes")
                # A worker's answer is untrusted: strict JSON turns deep nesting or huge numbers into an error.
                answer = strictjson.loads(body)
            health = parse_health(url, answer)
        except HealthAnswerError as exc:
            self._pool.record_unreachable(url, str(exc))
        except strictjson.JSONInputError as exc:
            self._pool.record_unreachable(url, f"worker {url}: /health answered no usable JSON: {exc}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._pool.record_unreachable(
                url, f"worker {url}: /health failed: {describe_exception(exc, self._timeout.total)}")
        else:
            self._pool.record_health(url, health, polled_at)
        after = self._status(url)
        if after != before:
            worker = self._pool.get(url)
            log.info("worker %s: %s -> %s%s", url, before, after,
                     f" ({worker.problem})" if worker and worker.problem else "")

    def _status(self, url: str) -> str:
        worker = self._pool.get(url)
        return worker.status if worker else "removed"

    async def _watch(self, url: str) -> None:
        while True:
            await self.poll(url)
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        """Stop every poll and wait for them to end."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
