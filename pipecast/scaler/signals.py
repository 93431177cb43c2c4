"""From what the routers and the control plane answer to the policy's inputs (pure: no I/O, no clock).

A router's ``GET /stats`` (see :mod:`pipecast.router.app`) is read strictly: an answer without the fields
the policy needs is that router's fault and counts as silent (:class:`StatsFormatError`). Several routers
add up: counters and gauges are summed, the TTFT p99 is the worst router's, a worker's idle time the
shortest any router saw (it is idle only if idle everywhere), and a worker serving (or ready) at any router
counts once, its own queue too: every router lists every worker. Each answer's ``instance`` (the router
process's id; routers before it send none, and stand for themselves by their URL) goes into the sum's
``instances``, so that the policy never takes a rate between the counts of two different router processes
(one restarted, or another behind the same Service answered).
"""

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from pipecast.core.errors import PipecastError
from pipecast.core.strictjson import describe
from pipecast.core.urls import http_base_url, one_spelling
from pipecast.scaler.policy import Pool, Replica, Signals
from pipecast.v1 import control_pb2 as pb

STATS_FORMAT = 1
READY = "ready"
SERVING_STATUSES = (READY, "partial")
#: The largest figure a /stats field may hold: up to it a float holds every integer, and the policy's float math
#: stays finite. Beyond it the answer is the router's fault: an integer of 400 digits (valid JSON) overflowed it.
MAX_FIGURE = 2 ** 53


class StatsFormatError(PipecastError):
    """A router's /stats answer lacks a field or has one of the wrong type (the router's fault)."""


def _number(data: Mapping[str, Any], key: str, router: str, *, nullable: bool = False) -> float | None:
    value = data.get(key)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_FIGURE:
        raise StatsFormatError(f"router {router}: /stats field {key!r} is {describe(value)}, not a number within "
                               "0..2**53")
    return value


def _admitted(counters: Mapping[str, Any], router: str) -> int:
    """The requests that arrived and that their tenant's limit admitted (``admitted``): a request refused for
    its tenant's rate is refused however many replicas serve, so it is no demand. Routers before that counter
    send only ``arrived``."""
    return int(_number(counters, "admitted" if "admitted" in counters else "arrived", router))


def parse_stats(router: str, data: Any) -> dict[str, Any]:
    """The fields of one router's /stats answer the scaler reads, checked. Its ``arrived`` (the totals' and each
    version's) are the admitted arrivals (:func:`_admitted`)."""
    if not isinstance(data, dict) or data.get("format") != STATS_FORMAT:
        raise StatsFormatError(f"router {router}: /stats is not format {STATS_FORMAT}")
    counters, ttft, workers = data.get("counters"), data.get("ttft"), data.get("workers")
    if not isinstance(counters, dict) or not isinstance(ttft, dict) or not isinstance(workers, list):
        raise StatsFormatError(f"router {router}: /stats lacks counters, ttft or workers")
    parsed_workers = []
    for worker in workers:
        if not isinstance(worker, dict) or not isinstance(worker.get("url"), str):
            raise StatsFormatError(f"router {router}: /stats has a worker without a url")
        node_id = worker.get("node_id")  # null, as none: the worker goes by its URL
        parsed_workers.append({"url": worker["url"], "node_id": "" if node_id is None else str(node_id),
                               "status": str(worker.get("status", "")),
                               # routers before it send none
                               "queue_depth": int(_number(worker, "queue_depth", router, nullable=True) or 0),
                               "idle_s": _number(worker, "idle_s", router, nullable=True)})
    versions = data.get("versions", {})  # routers before versions send none
    if not isinstance(versions, dict):
        raise StatsFormatError(f"router {router}: /stats versions is not an object")
    parsed_versions = {}
    for package, figures in versions.items():
        # Not ``counters``/``ttft``: those are the router's totals, returned below.
        of_version, window = (figures.get("counters"), figures.get("ttft")) if isinstance(figures, dict) \
            else (None, None)
        if not isinstance(of_version, dict) or not isinstance(window, dict):
            raise StatsFormatError(f"router {router}: /stats version {describe(package)} lacks counters or ttft")
        answered, failed = int(_number(of_version, "answered", router)), int(_number(of_version, "failed", router))
        # Routers before ``ready_s`` send none: as long ready as can be (their canaries judged as before).
        ready_s = _number(figures, "ready_s", router, nullable=True) if "ready_s" in figures else math.inf
        parsed_versions[package] = {"requests": answered + failed, "failed": failed, "answered": answered,
                                    "arrived": _admitted(of_version, router),
                                    "queue_depth": int(_number(figures, "queue_depth", router)),
                                    "in_flight": int(_number(figures, "in_flight", router)),
                                    "ready_s": ready_s,
                                    "ttft_count": int(_number(window, "count", router)),
                                    # how far back its p95 looks; routers that do not say: judged as before
                                    "ttft_window_s": _number(window, "window_s", router) if "window_s" in window
                                    else math.inf,
                                    "ttft_p95_s": _number(window, "p95", router, nullable=True),
                                    "ttft_p99_s": _number(window, "p99", router, nullable=True)}
    instance = data.get("instance", router)  # routers before it send none: the URL stands for the router
    if not isinstance(instance, str) or not instance:
        raise StatsFormatError(f"router {router}: /stats instance is {describe(instance)}, not a non-empty string")
    return {"instance": instance, "queue_depth": int(_number(data, "queue_depth", router)),
            "in_flight": int(_number(data, "in_flight", router)),
            "arrived": _admitted(counters, router), "answered": int(_number(counters, "answered", router)),
            "ttft_p99_s": _number(ttft, "p99", router, nullable=True), "workers": parsed_workers,
            "versions": parsed_versions}


def add_up(at: float, answers: Sequence[dict[str, Any] | None], node_of_url: Mapping[str, str],
           package_id: str = "", nodes: Collection[str] | None = None) -> Signals:
    """One :class:`Signals` from the parsed answers of every router (None: that router was silent).
    Workers are named by their control-plane node id (``node_of_url`` maps serve URLs to it). A router that
    counts requests by version (its ``versions``) gives ``package_id``'s queue, requests and TTFT, not its
    totals: a canary's deployment scales for its share of the traffic, and a deployment no request went to
    there yet (a canary never chosen, a package beside a busy one) for none of it. Only a router without
    versions (older, or none of its requests went to a package by name yet) gives its totals. Requests that
    wait there for no version (the router could not tell theirs: no deployment has their model's name, no
    worker names it, nor did one since the router started) count in every version's queue: they may be this
    deployment's, and none may wait for a pool that no signal would ever grow. ``nodes``: the deployment's pool
    (the nodes holding or receiving ``package_id``); where given, only their workers count as serving, ready,
    queued at or idle: a router in front of several packages (a canary beside its stable version) lists every
    one's."""
    # One router listed twice (under two names of its host) is counted once: its instance id says it is one.
    got = list({a["instance"]: _own(a, package_id) for a in answers if a is not None}.values())
    silent = sum(a is None for a in answers)
    idle: dict[str, float | None] = {}
    serving: set[str] = set()  # every router lists every worker: each counts once
    ready: set[str] = set()
    queued: dict[str, int] = {}  # serving node -> requests waiting in its own queue (every router sees the same)
    for answer in got:
        for worker in answer["workers"]:
            node = node_of_url.get(url_key(worker["url"]), worker["node_id"] or worker["url"])
            if nodes is not None and node not in nodes:
                continue
            if worker["status"] in SERVING_STATUSES:
                serving.add(node)
                queued[node] = max(queued.get(node, 0), worker["queue_depth"])
            if worker["status"] == READY:
                ready.add(node)
            seen = worker["idle_s"]
            if node in idle and (idle[node] is None or seen is None):
                idle[node] = None
            else:
                idle[node] = seen if node not in idle else min(idle[node], seen)
    p99s = [a["ttft_p99_s"] for a in got if a["ttft_p99_s"] is not None]
    return Signals(at=at, routers_total=len(got) + silent, routers_answered=len(got),
                   queue_depth=sum(a["queue_depth"] for a in got), in_flight=sum(a["in_flight"] for a in got),
                   queued_at_workers=sum(queued.values()), arrived=sum(a["arrived"] for a in got),
                   answered=sum(a["answered"] for a in got),
                   serving=len(serving), ready=len(ready), ttft_p99_s=max(p99s, default=None), idle_s=idle,
                   instances=tuple(sorted(a["instance"] for a in got)))


#: A version that no request went to at a router yet: the figures it would have.
_UNSEEN = {"arrived": 0, "answered": 0, "queue_depth": 0, "in_flight": 0, "ttft_p99_s": None}


def _own(answer: dict[str, Any], package_id: str) -> dict[str, Any]:
    """``answer`` as far as ``package_id`` goes (:func:`add_up`): its version's figures plus the requests waiting
    for no version, or its totals where it counts no version (or no package is asked for)."""
    if not package_id or not answer["versions"]:
        return answer
    mine = answer["versions"].get(package_id, _UNSEEN)
    return {**answer, **mine, "queue_depth": mine["queue_depth"] + _unattributed(answer)}


def _unattributed(answer: Mapping[str, Any]) -> int:
    """Requests waiting in a router for no version: its queue less every version's."""
    return max(answer["queue_depth"] - sum(v["queue_depth"] for v in answer["versions"].values()), 0)


def serve_urls(workers: Iterable[pb.WorkerState]) -> dict[str, str]:
    """Serve URL (:func:`url_key`) -> node id, of every registered worker with one."""
    return {url_key(w.worker.serve_url): w.worker.peer.node_id for w in workers if w.worker.serve_url}


def url_key(url: str) -> str:
    """``url`` as a worker's serve URL and a router's listing of it compare: in one spelling (:func:`one_spelling`,
    no trailing slash; ``HTTP://W1:80/`` is ``http://w1``), else as it is less a trailing slash. A router's listing
    spelled otherwise than the worker registered matched no node, and the replica was never released."""
    base = http_base_url(url)
    return one_spelling(base) if base is not None else url.rstrip("/")


def pool_of(package_id: str, num_blocks: int, workers: Iterable[pb.WorkerState], plans: Iterable[pb.PlanSummary],
            *, now: float, released: Iterable[str] = (), last_scale_up: float | None = None,
            store: str = "") -> Pool:
    """The deployment's pool: replicas are alive serving workers that hold blocks of the package or are
    receiving it (loading until they hold every block); free ones hold and receive nothing of it. A serving
    worker bound to another package (its agent's ``serve_package``) is neither, whatever it holds: it never
    serves this one, and a scale-up places the package only where it would be (``serving_only``); one that holds or
    receives it all the same (placed before its agent said what it serves, or by a scale-up not serving-only) is a
    stray (:attr:`Pool.strays`, unless ``released`` or the ``store``), whose copy the daemon releases: no release of
    the pool's would ever reach it.
    ``released`` nodes (released moments ago, their drop not reported yet) are free, not replicas: a
    scale-up may take them back (placed on holders first), and a surge whose only spare workers they are
    would else wait for their keep-alive to end. The package's ``store`` node, serving, is a replica never
    released (:attr:`Replica.pinned`)."""
    pending = {node for plan in plans if plan.package_id == package_id for node in plan.pending}
    released = set(released)
    replicas, free, strays = [], 0, []
    for state in workers:
        node = state.worker.peer.node_id
        if not state.alive or not state.worker.serve_url:
            continue
        held = sum(len(h.blocks) for h in state.held if h.package_id == package_id)
        if state.worker.serve_package not in ("", package_id):
            if (held or node in pending) and node not in released and node != store:
                strays.append(node)
        elif node in released:
            free += 1
        elif held or node in pending:
            replicas.append(Replica(node, loading=held < num_blocks or node in pending, pinned=node == store))
        else:
            free += 1
    return Pool(now=now, replicas=tuple(sorted(replicas, key=lambda r: r.node_id)), free=free,
                last_scale_up=last_scale_up, strays=tuple(sorted(strays)))
