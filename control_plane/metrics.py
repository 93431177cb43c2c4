"""Prometheus metrics of the control plane, in a registry of its own (several servers can share a
process, as in tests). Gauges are read from the state at scrape time, so they are never stale: copied on the
event loop that changes the state (:meth:`ControlMetrics.bind`), shown from the metrics server's thread."""

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from control_plane.state import ControlState

# To 30 s: a scale-up of thousands of receivers plans in a thread and then waits for a durable write, pipelines wait
# for their forming; such calls took seconds, all of them counted beyond the last bucket.
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
               30.0)


#: A scrape waits this long for the event loop to copy the state's figures (a loop held longer fails the scrape).
SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class _Figures:
    """What the state's gauges show, copied on the state's thread (the event loop changes the state while the
    metrics server's thread answers a scrape: reading it there failed scrapes, "dictionary changed size during
    iteration")."""

    alive: int
    dead: int
    packages: int
    # package id -> (verified (worker, block) pairs, complete holders, block sizes, blocks per worker)
    held: dict[str, tuple[int, int, tuple[int, ...], dict[str, frozenset[int]]]]
    plans: int
    replans: int

    @classmethod
    def of(cls, state: ControlState) -> "_Figures":
        alive = sum(w.alive for w in state.workers.values())
        held = {package_id: (a.replicas(), len(a.complete_holders()), tuple(state.packages[package_id].block_bytes),
                             dict(a.by_worker))
                for package_id, a in state.availability.items()}
        return cls(alive, len(state.workers) - alive, len(state.packages), held, len(state.plans), state.replan_count)


class _StateCollector(Collector):
    def __init__(self, state: ControlState):
        self._state = state
        self.loop: asyncio.AbstractEventLoop | None = None  # the state's, once the server runs

    def _figures(self) -> _Figures:
        loop = self.loop
        if loop is None or loop.is_closed() or _running(loop):
            return _Figures.of(self._state)

        async def copy() -> _Figures:
            return _Figures.of(self._state)
        return asyncio.run_coroutine_threadsafe(copy(), loop).result(SCRAPE_TIMEOUT_S)

    def collect(self) -> Iterator[Metric]:
        figures = self._figures()
        yield GaugeMetricFamily("pipecast_control_workers_alive", "Workers holding a valid lease.",
                                value=figures.alive)
        yield GaugeMetricFamily("pipecast_control_workers_dead", "Workers whose lease lapsed (kept a while).",
                                value=figures.dead)
        yield GaugeMetricFamily("pipecast_control_packages", "Published packages.", value=figures.packages)
        replicas = GaugeMetricFamily("pipecast_control_package_blocks",
                                     "Verified (worker, block) pairs held, per package.", labels=["package"])
        complete = GaugeMetricFamily("pipecast_control_package_complete_holders",
                                     "Alive workers holding every block, per package.", labels=["package"])
        # Bytes, not blocks: blocks differ in size, and a worker's slope is its ingest rate (no agent metrics).
        held = GaugeMetricFamily("pipecast_control_worker_bytes",
                                 "Bytes of verified blocks a worker holds, per package (from its block reports).",
                                 labels=["node", "package"])
        for package_id, (pairs, holders, sizes, by_worker) in figures.held.items():
            replicas.add_metric([package_id], pairs)
            complete.add_metric([package_id], holders)
            for node, blocks in by_worker.items():
                held.add_metric([node, package_id], sum(sizes[b] for b in blocks))
        yield replicas
        yield complete
        yield held
        yield GaugeMetricFamily("pipecast_control_plans_active", "Scale-up plans in progress.", value=figures.plans)
        yield CounterMetricFamily("pipecast_control_replans",
                                  "Plans repaired after a death, release, bad peer or straggler.",
                                  value=figures.replans)


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread runs ``loop`` (then the state may be read here)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class ControlMetrics:
    """The control plane's metrics: RPC latency and block reports counted as they happen, the rest from
    the state."""

    def __init__(self, state: ControlState):
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram("pipecast_control_rpc_seconds", "Time to serve one RPC, by method.",
                                     ["method"], registry=self.registry, buckets=RPC_BUCKETS)
        self.block_reports = Counter("pipecast_control_block_reports", "Verified blocks reported by agents.",
                                     registry=self.registry)
        self.refused_calls = Counter("pipecast_control_refused_calls", "Calls refused for want of a valid token.",
                                     registry=self.registry)
        self.leader = Gauge("pipecast_control_leader", "1 while this replica leads (serves), 0 while a standby: a "
                            "standby's other gauges show an empty state.", registry=self.registry)
        self._collector = _StateCollector(state)
        self.registry.register(self._collector)

    def watch_leadership(self, leading: Callable[[], bool]) -> None:
        """Show ``leading()`` (read at each scrape) as :attr:`leader`."""
        self.leader.set_function(lambda: float(leading()))

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the state on ``loop``, the one that changes it (a scrape is answered in another thread)."""
        self._collector.loop = loop
