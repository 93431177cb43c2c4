"""The router's Prometheus metrics, in a registry of its own (several routers may share a process)."""

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Seconds; cold starts put time to first token in minutes, so the buckets reach 10 minutes.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0)


class RouterMetrics:
    """Counters and histograms of one router; :meth:`render` gives the ``/metrics`` page."""

    def __init__(self, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.queue_depth = Gauge("pipecast_router_queue_depth", "Requests waiting in the router for a worker.",
                                 registry=self.registry)
        self.queue_depth.set_function(queue_depth)
        self.routed = Counter("pipecast_router_requests_routed", "Requests sent to a worker (every attempt).",
                              ["worker"], registry=self.registry)
        self.rejected = Counter("pipecast_router_requests_rejected",
                                "Requests the router refused (queue_full, queue_timeout, shutting_down, "
                                "rate_limited, authentication_error).",
                                ["reason"], registry=self.registry)
        self.tenant_rejected = Counter("pipecast_router_tenant_rejected",
                                       "Requests refused with 429 because their tenant was over its rate limit.",
                                       ["tenant"], registry=self.registry)
        self.failed = Counter("pipecast_router_requests_failed",
                              "Requests that ended in an error because of a worker, by the stage it failed at "
                              "(before_response: retries exhausted; mid_stream; error_status: a 5xx answer).",
                              ["worker", "stage"], registry=self.registry)
        self.retried = Counter("pipecast_router_retries",
                               "Attempts that failed before reaching the client and went to another worker.",
                               ["worker"], registry=self.registry)
        self.ttft = Histogram("pipecast_router_ttft_seconds",
                              "Streaming requests: arrival at the router to the first byte of the first chunk.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queued = Histogram("pipecast_router_queue_seconds",
                                "Time requests that reached a worker had waited in the router for one.",
                                buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
