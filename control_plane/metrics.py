"""Prometheus metrics of the control plane, in a registry of its own (several servers can share a
process, as in tests). Gauges are read from the state at scrape time, so they are never stale."""

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from control_plane.state import ControlState

RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _StateCollector(Collector):
    def __init__(self, state: ControlState):
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state
        yield GaugeMetricFamily("pipecast_control_workers_alive", "Workers holding a valid lease.",
                                value=sum(w.alive for w in state.workers.values()))
        yield GaugeMetricFamily("pipecast_control_workers_dead", "Workers whose lease lapsed (kept a while).",
                                value=sum(not w.alive for w in state.workers.values()))
        yield GaugeMetricFamily("pipecast_control_packages", "Published packages.", value=len(state.packages))
        replicas = GaugeMetricFamily("pipecast_control_package_blocks",
                                     "Verified (worker, block) pairs held, per package.", labels=["package"])
        complete = GaugeMetricFamily("pipecast_control_package_complete_holders",
                                     "Alive workers holding every block, per package.", labels=["package"])
        # Bytes, not blocks: blocks differ in size, and a worker's slope is its ingest rate (no agent metrics).
        held = GaugeMetricFamily("pipecast_control_worker_bytes",
                                 "Bytes of verified blocks a worker holds, per package (from its block reports).",
                                 labels=["node", "package"])
        for package_id, availability in state.availability.items():
            replicas.add_metric([package_id], availability.replicas())
            complete.add_metric([package_id], len(availability.complete_holders()))
            sizes = state.packages[package_id].block_bytes
            for node, blocks in availability.by_worker.items():
                held.add_metric([node, package_id], sum(sizes[b] for b in blocks))
        yield replicas
        yield complete
        yield held
        yield GaugeMetricFamily("pipecast_control_plans_active", "Scale-up plans in progress.", value=len(state.plans))
        yield CounterMetricFamily("pipecast_control_replans", "Plans repaired after a death, release or bad peer.",
                                  value=state.replan_count)


class ControlMetrics:
    """The control plane's metrics: RPC latency and block reports counted as they happen, the rest from
    the state."""

    def __init__(self, state: ControlState):
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram("pipecast_control_rpc_seconds", "Time to serve one RPC, by method.",
                                     ["method"], registry=self.registry, buckets=RPC_BUCKETS)
        self.block_reports = Counter("pipecast_control_block_reports", "Verified blocks reported by agents.",
                                     registry=self.registry)
        self.registry.register(_StateCollector(state))
