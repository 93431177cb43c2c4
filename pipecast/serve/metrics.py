"""The serving worker's Prometheus metrics, in a registry of its own (tests run several workers in one
process), and the sliding-window token rate behind its tokens/s gauge."""

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Seconds. A cold start's first token waits for the weights to cross the network: minutes, not ms.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0)
RATE_WINDOW_S = 10.0


class RateMeter:
    """Events per second over the last ``window_s`` seconds (thread-safe; ``clock`` for tests)."""

    def __init__(self, window_s: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, count: int = 1) -> None:
        """Record ``count`` events now."""
        now = self._clock()
        with self._lock:
            # Here too, not only when read: a worker nobody scrapes would keep every token it generated.
            self._trim(now)
            self._events.append((now, count))

    def rate(self) -> float:
        """Events per second within the window ending now."""
        now = self._clock()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._events) / self.window_s

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window_s:
            self._events.popleft()


class ServeMetrics:
    """Counters, gauges and histograms of one serving worker; :meth:`render` gives ``/metrics``.

    The gauges of the worker's state (queue, running requests, blocks) read it when scraped, through the
    callables given here.
    """

    def __init__(self, *, queue_depth: Callable[[], int], running: Callable[[], int],
                 blocks_present: Callable[[], int], blocks_total: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("pipecast_serve_ttft_seconds",
                              "Arrival of a completion request at this worker to its first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.generated_tokens = Counter("pipecast_serve_generated_tokens",
                                        "Tokens generated (every completion, streamed or not).", registry=r)
        self.prompt_tokens = Counter("pipecast_serve_prompt_tokens", "Prompt tokens of admitted requests.",
                                     registry=r)
        self.rate = RateMeter()
        tokens_per_s = Gauge("pipecast_serve_tokens_per_second",
                             f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.", registry=r)
        tokens_per_s.set_function(self.rate.rate)
        self.requests = Counter("pipecast_serve_requests",
                                "Completion requests by outcome: ok, cancelled (client gone), rejected (429), "
                                "invalid (4xx), failed (5xx).", ["outcome"], registry=r)
        for name, help_text, read in (
                ("pipecast_serve_queue_depth", "Requests admitted and waiting: for the model, or for a batch slot.",
                 queue_depth),
                ("pipecast_serve_running", "Requests in the engine's batch (prefilling or decoding).", running),
                ("pipecast_serve_blocks_present", "Blocks of the model bound in the engine.", blocks_present),
                ("pipecast_serve_blocks_total", "Blocks of the model's package (0 until its manifest is known).",
                 blocks_total)):
            Gauge(name, help_text, registry=r).set_function(read)
        self.load_seconds = Gauge("pipecast_serve_model_load_seconds",
                                  "Seconds from the worker's start (after a release: from the package's return) "
                                  "to the model fully loaded (0 until then, and while released).",
                                  registry=r)

    def token(self) -> None:
        """Count one generated token."""
        self.generated_tokens.inc()
        self.rate.add()

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
