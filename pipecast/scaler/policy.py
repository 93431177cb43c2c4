"""The scaling policy (pure): a window of signals and the pool's state in, a decision out.

:func:`decide` is a function of its arguments only (no clock, no I/O), so every load shape is a unit test.
How it decides, in this order:

1. **No data, no change.** Without a recent answer from any router the pool is held as it is (raised to
   ``min_replicas`` only, which needs no signal): missing signals never scale to zero. With some routers
   silent it may add replicas but releases none.
2. **Demand** (leading signals first): replicas needed for the requests present now (router queue + in flight, at
   ``replica_concurrency`` each) and for the arrival rate over the last ``SHORT_WINDOW_S`` (or ``SURGE_WINDOW_S``
   where higher, while no replica holds the model), at the per-replica throughput (measured over the last
   ``SHORT_WINDOW_S`` in which requests queued in a router at replicas all holding the model, even before a quiet
   spell, over ``MEASURE_MIN_S`` at least, else the policy's ``replica_rps``; never less than the replicas answer
   now); with a cold start (how long a new replica takes to serve: the policy's
   ``cold_start_s``, or with ``cold_start_measured`` the daemon's measure once it has one,
   :mod:`pipecast.scaler.coldstart`), the replicas that also drain, within the SLO or the cold start (the longer) once
   they serve, what arrives meanwhile beyond the ready replicas' throughput (:func:`cold_start_demand`: with
   multicast, several replicas load in about the time of one), and the requests present add no replica while no
   request waits behind them at the ready replicas for longer than that drain (:func:`drained_by_the_ready`: a
   replica added for them would serve only after the cold start); then the lagging one: a p99 TTFT over the SLO
   with requests still queued and no replica on its way adds one more. Neither the requests present nor the SLO
   add a replica while the requests present fall fast enough to be gone within that drain at the pace measured
   at ready replicas (:func:`backlog_draining`): the replicas in place are catching up, and a p99 over the SLO
   is then the requests that waited for a cold start. ``desired`` = demand + the warm pool, within
   ``min..max``: the policy's ``warm``, or with ``warm_auto_factor`` the replicas that absorb that many times the
   *baseline* demand (:func:`baseline_demand`, the median over the history) beyond what the demand needs now.
3. **Scale up** by the whole gap at once (not one at a time), at most the free workers. Within
   ``scale_up_cooldown_s`` of the last scale-up only for a rate the pool in place does not cover (the arrival
   rate's demand, or the cold start's, above the replicas there), and as many as that rate needs (with the warm
   pool), or a missed SLO: not for the queue, which the replicas still loading will take.
4. **Scale down** with hysteresis: only replicas idle for ``keep_alive_s`` (every router agreeing), only
   above ``DOWN_HEADROOM`` times the *peak* demand of the last ``keep_alive_s`` (at least
   ``SHORT_WINDOW_S``), and never within ``scale_down_cooldown_s`` of a scale-up, so a replica is not
   acquired and released again within the cooldown. The peak needs signals for that whole window: while
   the history holds less since its start or since polls some router did not answer for more than
   :data:`STALE_S` (the daemon restarted, a router or the control plane was out of reach; a missed poll or two
   is no gap), nothing is released.
"""

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from control_plane.deployments import MAX_COUNT, ScalingPolicy

#: Arrival rates are measured over this window (s) ...
SHORT_WINDOW_S = 5.0
#: ... and over this one, the higher counting, while no replica holds the model: a surge from nothing shows in
#: its first seconds, not diluted by five. Once replicas serve, a burst this short is over before a replica
#: added for it could serve (a cold start is longer); the queue and the serving replicas take it.
SURGE_WINDOW_S = 2.0
#: A replica's throughput is measured over no less than this (s) of polls with a queue: answers finish in bursts,
#: so one second of a queue read 0.25 req/s where 1.0 was real, and sized 12 replicas too many for the 10 minutes
#: of history. Not the whole SHORT_WINDOW_S: polls a 1 s tick apart (a little more each) span 4 s of it.
MEASURE_MIN_S = 3.0
#: Scale-down keeps this much above the window's peak demand: a level the load reaches again in noise is
#: not released (the hysteresis band between scaling up and down).
DOWN_HEADROOM = 1.25
#: Signals older than this (s) are no signals.
STALE_S = 5.0
#: The longest history the policy looks back on (s): the daemon keeps this much (and the poll just before),
#: so a longer keep-alive's peak is this window's.
HISTORY_S = 600.0
#: Demand fractions this close below a whole replica round down (float noise does not add a replica).
EPSILON = 1e-9


@dataclass(frozen=True)
class Signals:
    """One poll of a deployment's routers, added up (cumulative counters, gauges now)."""

    at: float  # the daemon's monotonic clock (s): a step of the wall clock is no time passing
    routers_total: int
    routers_answered: int
    queue_depth: int = 0
    in_flight: int = 0
    #: Of ``in_flight``, those waiting in serving workers' own queues (not yet running): workers take up to
    #: their ``max_queue``, so in a surge the backlog waits there while the routers' queues stay empty.
    queued_at_workers: int = 0
    arrived: int = 0  # cumulative, all routers
    answered: int = 0  # cumulative
    serving: int = 0  # workers the routers route to now (ready or partial), each counted once
    ready: int = 0  # of those, the ones holding the whole model (a partial one is still in its cold start)
    ttft_p99_s: float | None = None  # the worst router's p99 over its window
    idle_s: Mapping[str, float | None] = field(default_factory=dict)  # node id -> idle seconds (None: busy)
    #: The instance ids of the routers that answered, sorted (a router's id changes when it restarts): the
    #: cumulative counters of two polls are comparable only when they add up the same router processes.
    instances: tuple[str, ...] = ()


@dataclass(frozen=True)
class Replica:
    """A worker holding the package or receiving it (a replica on its way)."""

    node_id: str
    loading: bool
    pinned: bool = False  # the package's store: it serves, and the control plane never releases it


@dataclass(frozen=True)
class Pool:
    """The deployment's workers now, and when it last scaled up (on the clock of :attr:`Signals.at`, None: never)."""

    now: float
    replicas: tuple[Replica, ...]
    free: int  # alive workers that could take the package
    last_scale_up: float | None = None
    #: Seconds the deployment's last new replicas took to hold the package (the daemon's measure), None: none yet.
    cold_start_s: float | None = None
    #: Alive serving workers bound to another package that hold or receive this one: never replicas, the daemon
    #: releases their copies (``pool_of``); the policy ignores them.
    strays: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    """What to do now: ``add`` replicas, ``release`` these nodes, or neither (hold); and why."""

    add: int
    release: tuple[str, ...]
    reason: str
    kind: str  # for metrics: no_signals, min_replicas, demand, slo, idle, steady, cooldown, no_free_workers
    desired: int
    inputs: dict

    @property
    def action(self) -> str:
        return "scale_up" if self.add else "release" if self.release else "hold"


def _window_start(history: Sequence[Signals], window_s: float) -> Signals:
    """The oldest poll of ``history`` within the last ``window_s`` seconds (the last one at least)."""
    last = history[-1]
    return next((s for s in history if s.at >= last.at - window_s), last)


def comparable(a: Signals, b: Signals) -> bool:
    """Whether two polls add up the same routers: as many answered, the same router processes where they say
    which (``instances``). The routers' cumulative counters are added up over those that answered, so between
    polls of different routers a difference is a router's whole count, not growth: one missed poll of two
    routers, or a router Service whose polls land on another router, read as hundreds of requests/s."""
    return a.routers_answered == b.routers_answered and a.instances == b.instances


def _run(history: Sequence[Signals], window_s: float, end: int | None = None) -> list[Signals]:
    """The polls of ``history`` within ``window_s`` seconds up to the one at index ``end`` (default: the last)
    whose cumulative counters it continues, oldest first, that one at least: those :func:`comparable` with it,
    back to the last time a counter went back (a router restarted: its counts begin again)."""
    end = len(history) - 1 if end is None else end
    last = history[end]
    run = [last]
    for i in range(end - 1, -1, -1):
        s = history[i]
        if s.at < last.at - window_s:
            break
        if not comparable(s, last):
            continue
        if s.arrived > run[-1].arrived or s.answered > run[-1].answered:
            break
        run.append(s)
    run.reverse()
    return run


def _rate(history: Sequence[Signals], attr: str, window_s: float, end: int | None = None) -> float:
    """Per-second growth of cumulative counter ``attr`` over the ``window_s`` of ``history`` up to the poll at
    index ``end`` (default: the last), between polls whose counters continue each other (:func:`_run`)."""
    run = _run(history, window_s, end)
    first, last = run[0], run[-1]
    span = last.at - first.at
    if span <= 0:
        return 0.0
    return max(getattr(last, attr) - getattr(first, attr), 0) / span


def arrival_rate(history: Sequence[Signals], end: int | None = None) -> float:
    """Requests/s arriving at the poll of ``history`` at index ``end`` (default: the last): the short window's
    rate, or the surge window's where higher while no replica holds the whole model (:data:`SURGE_WINDOW_S`)."""
    end = len(history) - 1 if end is None else end
    short = _rate(history, "arrived", SHORT_WINDOW_S, end)
    return short if history[end].ready else max(_rate(history, "arrived", SURGE_WINDOW_S, end), short)


def replica_throughput(history: Sequence[Signals], policy: ScalingPolicy) -> float:
    """Requests/s one replica holding the model serves: measured while requests queued in a router (replicas
    were busy) and every replica served whole (a partial one answers at the pace its blocks arrive, not its
    own), over the ``SHORT_WINDOW_S`` up to the last time they did in ``history`` (so a surge after a quiet
    spell is sized at what the replicas did in the one before) where those polls, one after another with no poll
    between them that saw no queue, span :data:`MEASURE_MIN_S`,
    else the policy's ``replica_rps``; and never less than the replicas answer now (:func:`answered_per_replica`).
    Requests waiting in the workers' own queues do not start a measure: tried, it sized surges at the quarter-core
    replicas' 0.83 req/s, 7-8 replicas at once, for twice the worker-seconds and no lower p99
    (docs/benchmarks.md, "The backlog in the workers' own queues")."""
    def saturated(s: Signals) -> bool:
        return s.queue_depth > 0 and s.serving > 0 and s.ready == s.serving

    # The last spell of consecutive such polls: blips of a queue with none between them are no busy replicas.
    end = next((i for i in range(len(history) - 1, -1, -1) if saturated(history[i])), None)
    start = end
    while start and saturated(history[start - 1]):
        start -= 1
    busy = _run(history[start:end + 1], SHORT_WINDOW_S) if end is not None else []
    measured = policy.replica_rps
    if busy and busy[-1].at - busy[0].at >= MEASURE_MIN_S and busy[-1].answered > busy[0].answered:
        answered = (busy[-1].answered - busy[0].answered) / (busy[-1].at - busy[0].at)
        measured = answered / (sum(s.serving for s in busy) / len(busy))
    return max(measured, answered_per_replica(history))


def answered_per_replica(history: Sequence[Signals]) -> float:
    """Requests/s each replica serving answers over the last ``SHORT_WINDOW_S``, a throughput they have shown
    whatever the load: per the most that served in the window (one released meanwhile answered too) and counting
    the partial ones (slower than one holding the model), so never more than a replica holding the model serves."""
    run = _run(history, SHORT_WINDOW_S)
    span, serving = run[-1].at - run[0].at, max(s.serving for s in run)
    return (run[-1].answered - run[0].answered) / span / serving if span > 0 and serving else 0.0


def baseline_demand(history: Sequence[Signals], throughput: float, policy: ScalingPolicy) -> float:
    """Replicas (fractional) the usual load of ``history`` needs: the median over its samples of the higher
    of the requests present per ``replica_concurrency`` and the arrival rate over ``SHORT_WINDOW_S`` per
    ``throughput``. The median: a spike shorter than half the history barely moves it."""
    answered = [s for s in history if s.routers_answered > 0]
    demands = []
    for i, s in enumerate(answered):
        rate = _rate(answered, "arrived", SHORT_WINDOW_S, i)
        demands.append(max((s.queue_depth + s.in_flight) / policy.replica_concurrency, rate / throughput))
    return statistics.median(demands) if demands else 0.0


def whole_replicas(demand: float) -> int:
    """Replicas (whole) for a fractional ``demand``: rounded up, but down from within :data:`EPSILON` above a
    whole one (float noise adds no replica); at most :data:`MAX_COUNT` (a policy's most), which also stands for a
    demand that is not finite (a ``replica_rps`` next to 0 or a cold start of 1e308 s, in a policy stored before
    their bounds), so that no figure makes :func:`decide` raise."""
    if not demand <= MAX_COUNT:  # inf and nan included
        return MAX_COUNT
    return math.ceil(demand - EPSILON)


def cold_start_of(policy: ScalingPolicy, pool: Pool) -> tuple[float, str]:
    """The cold start a scale-up is sized for (seconds; 0: not counted) and where it comes from: the daemon's
    measure with ``cold_start_measured`` once there is one, else the policy's ``cold_start_s``."""
    if policy.cold_start_measured and pool.cold_start_s is not None:
        return pool.cold_start_s, "measured"
    return policy.cold_start_s, "policy"


def cold_start_demand(rate: float, ready: int, throughput: float, policy: ScalingPolicy,
                      cold_start_s: float) -> int:
    """Replicas for ``rate`` when new ones take ``cold_start_s`` to serve: the requests arriving meanwhile
    beyond what the ``ready`` replicas take wait for them, and are drained within ``slo_ttft_p99_s`` or
    ``cold_start_s``, whichever is longer, once they serve, on top of the rate itself. The longer: those
    requests have waited about a cold start already, and a request arriving once the replicas serve waits
    at most the drain, so a drain within the cold start keeps every later request's wait below theirs
    (the p99 a cold start sets), while a faster one buys replicas that idle for the rest of the surge
    (measured in docs/benchmarks.md's long surge run). 0 when the ready replicas keep up, or without a cold
    start. A partial replica (serving layer by layer while its blocks arrive) is still in its cold start: it
    counts among the replicas this sizes, not among those that keep up."""
    excess = rate - ready * throughput
    if cold_start_s <= 0 or rate <= 0 or excess <= 0:
        return 0
    backlog = excess * cold_start_s
    return whole_replicas((rate + backlog / drain_horizon(policy, cold_start_s)) / throughput)


def drain_horizon(policy: ScalingPolicy, cold_start_s: float) -> float:
    """Seconds within which a backlog must drain: the SLO or the cold start, the longer
    (:func:`cold_start_demand` says why)."""
    return max(policy.slo_ttft_p99_s, cold_start_s)


def drained_by_the_ready(requests: int, ready: int, rate: float, throughput: float, horizon_s: float) -> bool:
    """Whether no request waits longer than ``horizon_s`` behind the ``requests`` present at the ``ready``
    replicas: one arriving now waits for those ahead of it, ``requests / (ready * throughput)``, and while
    ``rate`` stays under that throughput the backlog shrinks, so each later one waits less. A replica added
    for them would serve only after the cold start, and shorten no wait that is shorter. (Not the time until
    the backlog is gone, ``requests / (ready * throughput - rate)``: that sized a replica for 21 requests at
    two replicas, 6.4 s until the last of the backlog but 3.4 s of wait, docs/benchmarks.md.)"""
    capacity = ready * throughput
    return ready > 0 and rate < capacity and requests / capacity <= horizon_s


def backlog_draining(history: Sequence[Signals], horizon_s: float) -> bool:
    """Whether the requests present (router queues + in flight) fell over the last ``SHORT_WINDOW_S`` fast
    enough that, at that measured pace, they are gone within ``horizon_s``: the pool in place is catching up,
    whatever the throughput estimate says. A p99 over the SLO then is the past's (requests that waited for a
    cold start), and a replica added for it would serve once the backlog is gone. Only between two polls of the
    same routers (:func:`comparable`): a router falling silent is not a backlog falling; and only while a replica
    is ready: at none, the requests that leave are given up (clients, queue timeouts), not served."""
    last, first = history[-1], _window_start(history, SHORT_WINDOW_S)
    span = last.at - first.at
    before, now = first.queue_depth + first.in_flight, last.queue_depth + last.in_flight
    if span <= 0 or now >= before or not last.ready or not comparable(first, last):
        return False
    return now / ((before - now) / span) <= horizon_s


def _demand(signals: Signals, rate: float, throughput: float, policy: ScalingPolicy) -> tuple[int, int]:
    by_requests = whole_replicas((signals.queue_depth + signals.in_flight) / policy.replica_concurrency)
    by_rate = whole_replicas(rate / throughput) if rate > 0 else 0
    return by_requests, by_rate


def decide(history: Sequence[Signals], pool: Pool, policy: ScalingPolicy) -> Decision:
    """The decision for now (module docstring); ``history`` is oldest first."""
    have = len(pool.replicas)
    if not history or history[-1].routers_answered == 0 or pool.now - history[-1].at > STALE_S:
        return _no_signals(pool, policy)
    now = history[-1]
    rate = arrival_rate(history)
    throughput = replica_throughput(history, policy)
    by_requests, by_rate = _demand(now, rate, throughput, policy)
    cold_start, cold_from = cold_start_of(policy, pool)
    by_cold = cold_start_demand(rate, now.ready, throughput, policy, cold_start)
    horizon = drain_horizon(policy, cold_start)
    draining = backlog_draining(history, horizon)
    drained = by_requests > have and (draining or (cold_start > 0 and drained_by_the_ready(
        now.queue_depth + now.in_flight, now.ready, rate, throughput, horizon)))
    if drained:
        by_requests = have
    loading = sum(r.loading for r in pool.replicas)
    over_slo = now.ttft_p99_s is not None and now.ttft_p99_s > policy.slo_ttft_p99_s
    slo_missed = over_slo and now.queue_depth > 0 and loading == 0 and not draining
    needed = max(by_requests, by_rate, by_cold, have + 1 if slo_missed else 0)
    inputs = {"queue_depth": now.queue_depth, "in_flight": now.in_flight, "queued_at_workers": now.queued_at_workers,
              "arrival_rps": round(rate, 3),
              "replica_rps": round(throughput, 3), "ttft_p99_s": now.ttft_p99_s, "serving": now.serving,
              "ready": now.ready,
              "replicas": have, "loading": loading, "free": pool.free,
              "routers": f"{now.routers_answered}/{now.routers_total}",
              "cold_start_s": round(cold_start, 3), "cold_start_from": cold_from}
    if policy.warm_auto_factor:
        baseline = baseline_demand(history, throughput, policy)
        warm = max(whole_replicas(policy.warm_auto_factor * baseline) - needed, 0)
        warm_why = f"+warm auto {warm} ({policy.warm_auto_factor}x baseline {round(baseline, 2):g} replicas)"
        inputs["baseline_replicas"] = round(baseline, 3)
    else:
        warm, warm_why = policy.warm, f"+warm {policy.warm}"
    desired = min(max(needed + warm, policy.min_replicas), policy.max_replicas)
    cold_why = f"; {by_cold} to drain what arrives in a {round(cold_start, 1):g}s cold start" + (
        " (measured)" if cold_from == "measured" else "")
    pace_why = f"falling, gone within {round(horizon, 1):g}s at the pace measured"
    drained_why = "" if not drained else f" ({pace_why})" if draining else (
        f" (one arriving now waits {round((now.queue_depth + now.in_flight) / (now.ready * throughput), 1):g}s"
        f" for them at the {now.ready} ready, within the {round(horizon, 1):g}s a new one takes)")
    past_why = f"; p99 TTFT {now.ttft_p99_s:.2f} s over the SLO, but the backlog is {pace_why}" if (
        over_slo and draining) else ""
    at_workers = f" ({now.queued_at_workers} waiting in workers' queues)" if now.queued_at_workers else ""
    why = (f"queue {now.queue_depth} + in flight {now.in_flight}{at_workers} need {by_requests} at "
           f"{policy.replica_concurrency} "
           f"each{drained_why}; {rate:.2f} req/s needs {by_rate} at {throughput:.2f} req/s each"
           f"{cold_why if by_cold else ''}"
           f"{'; p99 TTFT %.2f s over the SLO %.2f s' % (now.ttft_p99_s, policy.slo_ttft_p99_s) if slo_missed else ''}"
           f"{past_why}"
           f"; {warm_why} -> desired {desired}, have {have}")
    if desired > have:
        cooling = pool.last_scale_up is not None and pool.now - pool.last_scale_up < policy.scale_up_cooldown_s
        # Replicas still loading will take the queue: within the cooldown only a higher rate or a missed SLO adds,
        # and a rate adds what it needs, not the queue's demand besides.
        if cooling and max(by_rate, by_cold) <= have and not slo_missed:
            return Decision(0, (), f"{why}: in the scale-up cooldown", "cooldown", desired, inputs)
        if cooling and not slo_missed:
            desired = min(max(max(by_rate, by_cold) + warm, policy.min_replicas), desired)
            why += f"; in the scale-up cooldown: for the rate, {desired}"
        add = min(desired - have, pool.free)
        if add == 0:
            return Decision(0, (), f"{why}: no free worker to add", "no_free_workers", desired, inputs)
        return Decision(add, (), f"{why}: add {add}", "slo" if slo_missed else "demand", desired, inputs)
    return _scale_down(history, pool, policy, warm, desired, why, inputs)


def _no_signals(pool: Pool, policy: ScalingPolicy) -> Decision:
    """Without signals: hold the pool, but raise it to ``min_replicas``, which needs none (a deployment without
    routers, or with all of them down, would else stay below its minimum for good)."""
    have = len(pool.replicas)
    why = f"no signals from any router: holding {have} replicas"
    if have >= policy.min_replicas:
        return Decision(0, (), why, "no_signals", min(have, policy.max_replicas), {})  # max lowered: not more
    inputs = {"replicas": have, "free": pool.free, "min_replicas": policy.min_replicas}
    if pool.last_scale_up is not None and pool.now - pool.last_scale_up < policy.scale_up_cooldown_s:
        return Decision(0, (), f"{why}, below the minimum {policy.min_replicas}: in the scale-up cooldown", "cooldown",
                        policy.min_replicas, inputs)
    add = min(policy.min_replicas - have, pool.free)
    if add == 0:
        return Decision(0, (), f"{why}, below the minimum {policy.min_replicas}: no free worker to add",
                        "no_free_workers", policy.min_replicas, inputs)
    return Decision(add, (), f"no signals from any router: raising {have} replicas to the minimum "
                             f"{policy.min_replicas}: add {add}", "min_replicas", policy.min_replicas, inputs)


def signals_span(history: Sequence[Signals]) -> float:
    """Seconds of signals without a gap up to the last complete poll (every router answered): since the history's
    first complete poll, or the first after a gap, polls some router did not answer (the daemon appends one no
    router answered for a tick that failed) over more than :data:`STALE_S` since the last complete one. A router's
    load while it is silent is unknown, not 0: its peak may be in the gap. A missed poll or two is no gap: the
    counters are cumulative, so a rate taken across them counts every arrival (a gap at every missed poll held idle
    replicas for good where polls failed now and then)."""
    start = last = None
    silent = False
    for signals in history:
        if signals.routers_answered < signals.routers_total or not signals.routers_answered:
            silent = True
            continue
        if last is None or (silent and signals.at - last > STALE_S):
            start = signals.at
        last, silent = signals.at, False
    return 0.0 if last is None else last - start


def _scale_down(history: Sequence[Signals], pool: Pool, policy: ScalingPolicy, warm: int, desired: int, why: str,
                inputs: dict) -> Decision:
    now = history[-1]
    have = len(pool.replicas)
    if desired >= have:
        return Decision(0, (), f"{why}: steady", "steady", desired, inputs)
    if now.routers_answered < now.routers_total:
        return Decision(0, (), f"{why}: not releasing while {now.routers_total - now.routers_answered} router(s) "
                               "are silent", "steady", desired, inputs)
    # Releasing right after an acquire is thrash; releasing more after a release is not (a pool drains in one go).
    if pool.last_scale_up is not None and pool.now - pool.last_scale_up < policy.scale_down_cooldown_s:
        return Decision(0, (), f"{why}: in the scale-down cooldown", "cooldown", desired, inputs)
    # Hysteresis: keep what the keep-alive's peak needed (at the throughput measured now); the cooldown
    # above, not this window, keeps a release away from a scale-up.
    window_s = max(policy.keep_alive_s, SHORT_WINDOW_S)
    span = signals_span(history)
    if span < min(window_s, HISTORY_S):  # the peak of a part of the window is no peak: the rest is unknown
        return Decision(0, (), f"{why}: not releasing on {round(span, 1):g} s of signals, less than the {window_s:g} s "
                               "whose peak it keeps (the daemon restarted or signals were missing)", "steady",
                        desired, inputs)
    throughput = replica_throughput(history, policy)
    peak = max(max(_demand(signals, arrival_rate(history, i), throughput, policy))
               for i, signals in enumerate(history) if signals.at >= now.at - window_s)
    keep = min(max(math.ceil(peak * DOWN_HEADROOM) + warm, policy.min_replicas, desired), policy.max_replicas)
    ready = [r for r in pool.replicas if not r.loading]
    idle = sorted(((now.idle_s.get(r.node_id), r.node_id) for r in ready if not r.pinned),
                  key=lambda pair: (-(pair[0] or 0.0), pair[1]))
    candidates = [node for idle_s, node in idle if idle_s is not None and idle_s >= policy.keep_alive_s]
    # Replicas still loading count towards what is kept, but they serve nothing yet: never fewer ready than kept.
    release = tuple(candidates[:max(min(have, len(ready)) - keep, 0)])
    if not release:
        return Decision(0, (), f"{why}: keeping {keep} (peak of the last {window_s:g} s), "
                               f"{len(candidates)} idle for {policy.keep_alive_s:g} s", "steady", desired, inputs)
    return Decision(0, release, f"{why}: release {len(release)} idle for >= {policy.keep_alive_s:g} s "
                                f"(keeping {keep})", "idle", desired, inputs)
