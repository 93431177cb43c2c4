"""Polls each worker's health and records the answers in the pool (one task per worker).

A pipecast serving worker answers ``GET /health`` in the format of :class:`pipecast.serve.health.WorkerHealth`,
the type the worker writes. A vLLM worker (``vllm serve PACKAGE --load-format pipecast``; its agent registers
``--engine vllm``) answers ``GET /health`` with an empty 200 once its engine serves (it does not listen
before), and its queue is read from ``GET /metrics`` (:func:`vllm_health`): it is ``ready`` with
``vllm:num_requests_waiting`` as its queue depth and ``vllm:num_requests_running`` as what it runs; its model
name comes from ``GET /v1/models`` (asked once, and again after a failed poll: a process restarted at the same
URL may serve another model), and its package from discovery (the package its agent holds, as the control
plane lists it; none for a ``--vllm-worker`` URL).
"""

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping

import aiohttp

from pipecast.core import strictjson
from pipecast.core.engines import DEFAULT_ENGINE
from pipecast.core.httpserve import read_capped
from pipecast.router.errors import HealthAnswerError, describe_exception
from pipecast.router.pool import WorkerPool
from pipecast.serve.health import MAX_COUNT, HealthFormatError, WorkerHealth

log = logging.getLogger(__name__)

MAX_HEALTH_BYTES = 64 << 10  # a /health answer is a few hundred bytes; more is a broken or hostile worker
#: A vLLM /metrics page is tens of kB (histogram buckets per model); more is not a vLLM worker.
MAX_METRICS_BYTES = 4 << 20
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
#: The longest model name read of a vLLM worker: without --served-model-name it is the path it serves (PATH_MAX).
MAX_MODEL_CHARS = 4096


def parse_health(worker: str, answer: object) -> WorkerHealth:
    """Check a decoded ``/health`` JSON answer of ``worker`` and return it typed.

    Raises :class:`HealthAnswerError` when the answer is not an object with a known status and
    integer counts within 0..:data:`MAX_COUNT`.
    """
    try:
        return WorkerHealth.from_json(answer)
    except HealthFormatError as exc:
        raise HealthAnswerError(worker, str(exc)) from None


def _gauge(worker: str, metrics: str, name: str) -> int:
    """The sum of gauge ``name`` over its label sets in a Prometheus text page (vLLM labels it by model)."""
    total, found = 0.0, False
    for line in metrics.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                raise HealthAnswerError(worker, f"/metrics line {line[:120]!r} has no number") from None
            found = True
    if not found:
        raise HealthAnswerError(worker, f"/metrics has no {name} (not a vLLM worker?)")
    # NaN and inf parse as floats but are no count (int() raises on them); a huge one would reach the scaler.
    if not math.isfinite(total) or total > MAX_COUNT:
        raise HealthAnswerError(worker, f"/metrics {name} adds up to {total!r}, not a count of at most {MAX_COUNT}")
    return max(0, int(total))


def vllm_health(worker: str, metrics: str, model: str | None, package_id: str | None = None) -> WorkerHealth:
    """The health of a vLLM worker that answered ``/health`` with 200, from its ``/metrics`` page; ``package_id``:
    the package it serves, as discovery knows it (None: unknown)."""
    return WorkerHealth(status="ready", blocks_present=0, blocks_total=0,
                        queue_depth=_gauge(worker, metrics, VLLM_WAITING),
                        running=_gauge(worker, metrics, VLLM_RUNNING), max_queue=0, model=model,
                        package_id=package_id or None)


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
        self._engines: dict[str, str] = {}
        self._packages: dict[str, str] = {}
        self._vllm_models: dict[str, str] = {}

    def sync(self, urls: Iterable[str], engines: Mapping[str, str] | None = None,
             packages: Mapping[str, str] | None = None) -> None:
        """Poll exactly the workers at ``urls``: start polling new ones, stop polling removed ones;
        ``engines``: URL -> what answers there (default: pipecast's serving worker); ``packages``: URL -> the
        package a vLLM worker there serves, as discovery knows it (its health answers name none)."""
        urls = set(urls)
        self._engines = {url: (engines or {}).get(url, DEFAULT_ENGINE) for url in urls}
        self._packages = {url: package for url, package in (packages or {}).items() if url in urls and package}
        for url in set(self._tasks) - urls:
            self._tasks.pop(url).cancel()
            self._vllm_models.pop(url, None)
        # A poller that ended (it should not) is started again: its worker would otherwise keep its last answer.
        for url in urls - {polled for polled, task in self._tasks.items() if not task.done()}:
            self._tasks[url] = asyncio.create_task(self._watch(url), name=f"health {url}")

    async def _get(self, url: str, path: str, limit: int) -> bytes:
        async with self._session.get(f"{url}{path}", timeout=self._timeout) as response:
            if response.status != 200:
                raise HealthAnswerError(url, f"{path} answered HTTP {response.status}")
            body = await read_capped(response.content, limit)
        if len(body) > limit:
            raise HealthAnswerError(url, f"{path} answered more than {limit} bytes")
        return body

    async def _vllm(self, url: str) -> WorkerHealth:
        try:
            return await self._vllm_answer(url)
        except Exception:
            # A failed poll may be a restart: the process answering next at this URL may serve another model.
            self._vllm_models.pop(url, None)
            raise

    async def _vllm_answer(self, url: str) -> WorkerHealth:
        await self._get(url, "/health", MAX_HEALTH_BYTES)
        if url not in self._vllm_models:  # its served name does not change while it runs (asked again after a failure)
            models = strictjson.loads(await self._get(url, "/v1/models", MAX_HEALTH_BYTES))
            try:
                model = models["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                model = None  # refused below, with any other id that names no model
            # The name is a route's key and goes out in the router's own /v1/models: text, one line, bounded.
            if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_CHARS or not model.isprintable():
                raise HealthAnswerError(url, "/v1/models names no model")
            self._vllm_models[url] = model
        metrics = await self._get(url, "/metrics", MAX_METRICS_BYTES)
        return vllm_health(url, metrics.decode("utf-8", "replace"), self._vllm_models[url], self._packages.get(url))

    async def poll(self, url: str) -> None:
        """Ask the worker at ``url`` for its health once and record the answer or the failure."""
        before = self._status(url)
        polled_at = self._clock()
        try:
            if self._engines.get(url) == "vllm":
                health = await self._vllm(url)
            else:
                # A worker's answer is untrusted: strict JSON turns deep nesting or huge numbers into an error.
                health = parse_health(url, strictjson.loads(await self._get(url, "/health", MAX_HEALTH_BYTES)))
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
            try:
                await self.poll(url)
            # An answer no check foresaw (a bug) must not end the polling: the worker would stay as last seen.
            except Exception as exc:
                problem = f"worker {url}: health poll failed: {describe_exception(exc, self._timeout.total)}"
                worker = self._pool.get(url)
                if worker is not None and worker.problem != problem:  # once, not every interval
                    log.error("%s", problem, exc_info=exc)
                self._pool.record_unreachable(url, problem)
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        """Stop every poll and wait for them to end."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
