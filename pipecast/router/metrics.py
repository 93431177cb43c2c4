"""The router's Prometheus metrics, in a registry of its own (several routers may share a process)."""

from collections.abc import Callable, Collection, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

#: Seconds; cold starts put time to first token in minutes, so the buckets reach 10 minutes.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0)


class RouterMetrics:
    """Counters and histograms of one router; :meth:`render` gives the ``/metrics`` page."""

    def __init__(self, queue_depth: Callable[[], int], versions: Callable[[], dict] = dict) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_VersionCollector(versions))
        self.queue_depth = Gauge("pipecast_router_queue_depth", "Requests waiting in the router for a worker.",
                                 registry=self.registry)
        self.queue_depth.set_function(queue_depth)
        self.routed = Counter("pipecast_router_requests_routed", "Requests sent to a worker (every attempt).",
                              ["worker"], registry=self.registry)
        self.rejected = Counter("pipecast_router_requests_rejected",
                                "Requests the router refused (queue_full, queue_timeout, shutting_down, "
                                "rate_limited, invalid_api_key, invalid_tenant: a tenant header that is no printable "
                                "text).",
                                ["reason"], registry=self.registry)
        self.tenant_rejected = Counter("pipecast_router_tenant_rejected",
                                       "Requests refused with 429 because their tenant was over its rate limit.",
                                       ["tenant"], registry=self.registry)
        self.failed = Counter("pipecast_router_requests_failed",
                              "Requests that ended in an error because of a worker, by the stage it failed at "
                              "(before_response: retries exhausted, the retry found no worker in time, or a 504 of "
                              "a worker still working at the upstream deadline; mid_stream: lost, silent or without "
                              "[DONE]; error_status: a 5xx answer; error_event: a stream the worker ended with an "
                              "error).",
                              ["worker", "stage"], registry=self.registry)
        self.retried = Counter("pipecast_router_retries",
                               "Attempts that failed before reaching the client and went to another worker.",
                               ["worker"], registry=self.registry)
        self.ttft = Histogram("pipecast_router_ttft_seconds",
                              "Arrival at the router to the first whole event relayed (streaming requests; none "
                              "for a stream that begins with the worker's error event) or to a 200 answer whole "
                              "(the others), as /stats counts it.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queued = Histogram("pipecast_router_queue_seconds",
                                "Time requests answered by a worker had waited in the router for one, once per "
                                "request (retries' waits included).",
                                buckets=LATENCY_BUCKETS, registry=self.registry)

    def forget_workers(self, current: Collection[str]) -> None:
        """Drop the series labelled with a worker (or pipeline) not in ``current``, the pool's units now:
        workers come and go under new URLs (pod addresses, pipelines of other nodes), and theirs would stay."""
        for counter in (self.routed, self.retried, self.failed):
            stale = {tuple(sample.labels.values()) for family in counter.collect() for sample in family.samples
                     if sample.labels["worker"] not in current}
            for labels in stale:
                counter.remove(*labels)

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _VersionCollector:
    """Per-version figures of routed names, read from the router's signals at each scrape: ``versions``
    returns the ``/stats`` answer's ``versions`` (package id -> counters and TTFT window)."""

    def __init__(self, versions: Callable[[], dict]) -> None:
        self._versions = versions

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("pipecast_router_version_requests",
                                       "Requests of routed names by version (package id) and outcome "
                                       "(arrived, answered, failed).", labels=["version", "outcome"])
        tokens = CounterMetricFamily("pipecast_router_version_completion_tokens",
                                     "Completion tokens answered, by version.", labels=["version"])
        ttft = GaugeMetricFamily("pipecast_router_version_ttft_seconds",
                                 "TTFT percentiles over the last 60 s, by version (NaN-free: absent while no sample).",
                                 labels=["version", "quantile"])
        for version, figures in self._versions().items():
            counters = figures["counters"]
            for outcome in ("arrived", "answered", "failed"):
                requests.add_metric([version, outcome], counters[outcome])
            tokens.add_metric([version], counters["completion_tokens"])
            for q in ("50", "95", "99"):
                if (value := figures["ttft"][f"p{q}"]) is not None:
                    ttft.add_metric([version, f"0.{q}"], value)
        yield from (requests, tokens, ttft)
