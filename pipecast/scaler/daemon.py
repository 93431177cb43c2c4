"""The scaling daemon's loop: every tick, for every deployment, read signals, decide, record, act.

One :class:`Scaler` per cluster. Each tick it lists the deployments from the control plane, polls each
deployment's routers (``GET /stats``, each within ``router_timeout_s``, redirects not followed; a router URL
whose host resolves to several addresses, such as a headless Service in front of several routers, is polled at
each of them, with its Host header, and stands for that many routers, still when a resolution fails), reads the
workers and plans, and asks :func:`pipecast.scaler.policy.decide`. A decision that changes something (and the
start of a hold that leaves the pool behind the load: routers silent, no free worker) is appended to the control
plane's audit trail *before* the daemon acts on it: a scale-up (``ScaleUp`` with a count: the control plane
places it, holders first, and a hold follows it where it placed fewer) or a release (``Release``;
``source_keep_s`` keeps the blocks as a multicast source that long before the drop). Copies of the package on
workers bound to another package (``pool_of``'s strays: no release of the pool's reaches them) are released too,
recorded first. A deployment whose step fails with an error that is not the control plane's holds for that tick;
the others go on.

Each tick also judges every served model route with a gate and canaries (:mod:`pipecast.scaler.gate`)
from the per-version figures of its deployments' routers, and rolls back (``ChangeRoute``, recorded in the
audit trail with the figures) the canaries that do worse than the stable version.

Between ticks the daemon watches the deployments it left at zero replicas with nothing waiting: it polls
their routers every ``watch_s`` and ticks at once when a request waits there, so a scale from zero starts
within a watch interval of the first request, not up to a tick later (the first request's TTFT pays that
reaction in full; Knative's activator pokes its autoscaler for the same reason). A deployment is watched
until a tick sees its demand, so a cold start costs one early tick, however many requests arrive.

Stateless across restarts: the deployments and the audit trail are the control plane's, and the
cooldowns are recovered from the trail's last events. The signal history and the measured cold starts
restart empty, so a restarted daemon decides from fresh data (a worker's idle time comes from the
routers, which keep it), and releases nothing until it has a keep-alive of signals (the peak it keeps).

Time: the history, the cooldowns, the releases held back and the waits after a refusal are timed by the
monotonic clock, so a step of the wall clock (NTP) is no time passing (an hour back froze releases, queue-driven
scale-ups and retries for that hour); the wall clock stamps the audit trail and the last tick's metric only. A
restart reads the trail's rows by their age on the wall clock, a row from its future (stepped back since) as
written now: a cooldown at most its length.
"""

import asyncio
import json
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import aiohttp
from yarl import URL

from control_plane.deployments import Deployment, ScaleEvent
from control_plane.errors import (
    ChangeNotStored, ControlPlaneDeadlineExceeded, ControlPlaneError, InsufficientWorkers, PermissionDenied,
    Unauthenticated, UnknownDeployment)
from control_plane.routes import RouteChange
from pipecast.core import strictjson
from pipecast.core.credentials import serving_headers
from pipecast.core.httpserve import read_capped
from pipecast.scaler.coldstart import ColdStarts
from pipecast.scaler.gate import Gate, add_up_versions
from pipecast.scaler.metrics import ScalerMetrics
from pipecast.scaler.policy import HISTORY_S, Decision, Pool, Replica, Signals, decide
from pipecast.scaler.signals import StatsFormatError, add_up, parse_stats, pool_of, serve_urls
from pipecast.v1 import control_pb2 as pb

log = logging.getLogger(__name__)

MAX_STATS_BYTES = 1 << 20
#: Holds recorded in the audit trail (when they begin): the pool cannot follow the load.
NOTABLE_HOLDS = ("no_signals", "no_free_workers")
#: After the control plane refused an action, the same action is asked again no sooner than this (s), twice as
#: long after each refusal in a row, up to REFUSED_RETRY_MAX_S: each tick's attempt wrote two rows to the audit
#: trail (the decision and its refusal), 170,000 a day per deployment.
REFUSED_RETRY_S = 2.0
REFUSED_RETRY_MAX_S = 16.0
#: A released worker is not counted as a replica (but as free: a scale-up may take it back) for the keep-alive it
#: was released with (``source_keep_s``: the control plane lists its blocks until then) and this long more, while
#: its agent reports the drop (s).
RELEASE_GRACE_S = 30.0
#: A restarted daemon reads this many of a deployment's latest events first (:meth:`Scaler._recover`), four times as
#: many each time while the oldest read is still within its cooldowns and keep-alive, up to RECOVER_EVENTS_MAX (more
#: than the control plane keeps in memory: ``control_plane.deployments.EVENTS_IN_MEMORY``).
RECOVER_EVENTS = 1000
RECOVER_EVENTS_MAX = 16_000
#: A replica holding the whole package that none of its deployment's routers lists this long (s) is warned of: it
#: serves none of their requests, and with no idle time from them it is never released (routers discover workers
#: within a few seconds of their holding it).
UNLISTED_WARN_S = 30.0


async def resolve_addresses(host: str, port: int | None) -> list[str]:
    """Every address ``host`` resolves to for TCP now, in the resolver's order, of the first one's family only:
    a dual-stack name lists each host once per family, and must not count as twice the routers."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(sockaddr[0] for family, *_, sockaddr in infos if family == infos[0][0]))


@dataclass(frozen=True)
class ScalerConfig:
    """The daemon's tunables (``pipecast scaler run``'s options)."""

    tick_s: float = 1.0
    router_timeout_s: float = 1.0
    #: Between ticks, the routers of deployments idle at zero replicas are polled this often (s; 0: never).
    watch_s: float = 0.1
    #: The control plane's plan strategy for scale-ups ("" lets it choose; "unicast": every replica from the store).
    plan_strategy: str = ""
    #: A released replica stays a multicast source this long before it drops the package (s).
    source_keep_s: float = 0.0


@dataclass
class _Tracked:
    """What the daemon remembers of one deployment between ticks (all recoverable: see the module docstring)."""

    history: deque[Signals] = field(default_factory=deque)
    released: dict[str, float] = field(default_factory=dict)  # node -> when
    last_scale_up: float | None = None
    last_kind: str = ""
    refused: tuple[str, float, float] | None = None  # the last action refused, when, and the wait before the next
    strays_refused: tuple[float, float] | None = None  # the last release of strays refused: when, and the wait
    recovered: bool = False
    cold_starts: ColdStarts = field(default_factory=ColdStarts)
    #: At the last tick: no replica and nothing waiting or in flight (watched between ticks), and its routers.
    idle_at_zero: bool = False
    routers: tuple[str, ...] = ()
    #: Replicas holding the whole package that no router listed at any tick since when (see UNLISTED_WARN_S), and
    #: of those the ones warned of.
    unlisted: dict[str, float] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)


def _warn_unlisted(package_id: str, tracked: _Tracked, replicas: Sequence[Replica], signals: Signals,
                   now: float) -> None:
    """Warn once of each replica holding the whole package that every router answered without listing for
    :data:`UNLISTED_WARN_S`: a router in front of it that is not among the deployment's, or its serve URL there
    naming another host than it registered (a name for its address)."""
    if not signals.routers_answered or signals.routers_answered < signals.routers_total:
        return  # a silent router may list it
    whole = {r.node_id for r in replicas if not r.loading and not r.pinned} - set(signals.idle_s)
    tracked.unlisted = {node: tracked.unlisted.get(node, now) for node in whole}
    tracked.warned &= whole
    for node in sorted(whole - tracked.warned):
        if now - tracked.unlisted[node] >= UNLISTED_WARN_S:
            log.warning("scaler %s: replica %s holds the whole package, but none of the deployment's routers has "
                        "listed it for %g s: it serves none of their requests and is never released (is a router in "
                        "front of it missing from the deployment, or its serve URL spelled there with another host "
                        "name?)",
                        package_id[:12], node, UNLISTED_WARN_S)
            tracked.warned.add(node)


def _refused(action: str) -> str:
    """How the reason of the hold recorded when the control plane refused ``action`` begins (a restarted daemon
    reads it: :meth:`Scaler._recover`)."""
    return f"{action} refused: "


def _mark_gap(tracked: _Tracked, now: float) -> None:
    """Add to ``tracked``'s history a poll no router answered: the signals of a tick that failed are unknown, and
    after a gap of more than ``policy.STALE_S`` (a missed poll or two is none) the policy releases nothing until a
    keep-alive of them follows. Nor is the deployment watched until a tick
    sees it idle again: a waiting request would otherwise start the next failing tick at once, again and again."""
    tracked.idle_at_zero = False
    tracked.history.append(Signals(at=now, routers_total=len(tracked.routers), routers_answered=0))
    _trim(tracked.history, now)  # the control plane may stay unreachable for hours


def _trim(history: deque[Signals], now: float) -> None:
    """Keep the policy's HISTORY_S of ``history``, the poll just before included: a keep-alive that long is
    then spanned whole."""
    while len(history) > 1 and history[1].at <= now - HISTORY_S:
        history.popleft()


class Scaler:
    """The daemon over one control plane ``client`` (a :class:`control_plane.client.ControlPlaneClient`)."""

    def __init__(self, client, config: ScalerConfig = ScalerConfig(), *, metrics: ScalerMetrics | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 resolve: Callable[[str, int | None], Awaitable[list[str]]] = resolve_addresses) -> None:
        """``clock``: the wall clock (the audit trail's times), ``monotonic``: what times the rest (module docstring);
        ``resolve``: a router URL's host and port -> the addresses to poll it at (:func:`resolve_addresses`)."""
        self.client = client
        self.config = config
        self.metrics = metrics or ScalerMetrics()
        self.clock = clock
        self.monotonic = monotonic
        self.resolve = resolve
        self.tracked: dict[str, _Tracked] = {}
        self._session: aiohttp.ClientSession | None = None
        self._packages: dict[str, tuple[int, str]] = {}
        self._answers: dict[str, list[dict | None]] = {}  # this tick's /stats, by router URL (one per address)
        self._routers_at: dict[str, int] = {}  # router URL -> the addresses its name had when it last resolved
        self._serving_key = b""  # what the routers' /stats ask of a caller (with credentials), from ListWorkers
        self.gate = Gate()
        self.failed_ticks = 0  # failed in a row, up to now
        self.ticked = False  # whether a tick ever went through

    async def __aenter__(self) -> "Scaler":
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``tick_s`` until ``stop`` is set; a failed tick is logged and the next one tries again, but
        for a token refused before any tick went through (:class:`Unauthenticated`, :class:`PermissionDenied`:
        raised, the daemon's configuration, which no retry mends; found in an operator's walk: it retried for
        good, a warning a tick)."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                await self.tick()
            except ControlPlaneError as exc:
                if isinstance(exc, (Unauthenticated, PermissionDenied)) and not self.ticked:
                    raise
                log.warning("scaler tick failed, holding every pool: %s", exc)
                self.metrics.tick_failures.inc()
                self.failed_ticks += 1
                self._gap()
            else:
                self.metrics.last_tick.set(self.clock())
                self.failed_ticks, self.ticked = 0, True
            try:
                left = max(self.config.tick_s - (time.monotonic() - started), 0.0)
                await asyncio.wait_for(self._watch(stop), left)
            except TimeoutError:
                pass

    def _gap(self) -> None:
        """Mark a failed tick in every deployment's history (:func:`_mark_gap`)."""
        now = self.monotonic()
        for tracked in self.tracked.values():
            _mark_gap(tracked, now)

    async def _watch(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set or a request waits for a deployment left idle at zero replicas (module
        docstring): then the caller ticks at once."""
        watched = {p: t.routers for p, t in self.tracked.items() if t.idle_at_zero and t.routers} \
            if self.config.watch_s > 0 else {}
        urls = sorted({url for routers in watched.values() for url in routers})
        # Resolved once a tick, as the tick's own polls are: the watch polls many times a second.
        addresses = await asyncio.gather(*(self._addresses(url) for url in urls))
        while not stop.is_set():
            if watched:
                polls = (self._poll_each(url, *at, quiet=True) for url, at in zip(urls, addresses))
                answers = dict(zip(urls, await asyncio.gather(*polls)))
                now = self.monotonic()
                for package_id, routers in watched.items():
                    if add_up(now, [a for url in routers for a in answers[url]], {}, package_id).queue_depth > 0:
                        log.info("scaler %s: a request waits with no replica: looking now", package_id[:12])
                        return
            try:
                await asyncio.wait_for(stop.wait(), self.config.watch_s if watched else None)
            except TimeoutError:
                pass

    async def tick(self) -> list[tuple[str, Decision]]:
        """One pass over every deployment; returns what was done for each (:meth:`_act`; none for a deployment
        whose step failed). A step that fails with an error of the control plane's fails the tick (``run`` then
        holds every pool); with any other (a bug, an answer nothing checked), that deployment's tick is a gap in
        its signals, and the others go on."""
        deployments = await self.client.list_deployments()
        for gone in set(self.tracked) - {d.package_id for d in deployments}:
            del self.tracked[gone]
            self.metrics.forget(gone)  # an undeployed package's gauges would show its last figures for good
        if not deployments:
            return []
        workers, self._serving_key = await self.client.list_workers_keyed()
        plans = await self.client.list_plans()
        self._packages = {p.package_id: (p.num_blocks, p.store.node_id) for p in await self.client.list_packages()}
        urls = serve_urls(workers)
        decisions = []
        self._answers = {}
        # Every router at once: one deployment after another, a tick took a router timeout per deployment whose
        # routers were slow to answer, every other deployment's scaling waiting meanwhile.
        # A poll that raised (nothing of it kept) is asked again in its deployment's step, whose failure is that
        # deployment's gap only.
        await asyncio.gather(*(self._stats(url) for url in {url for d in deployments for url in d.routers}),
                             return_exceptions=True)
        for deployment in deployments:
            try:
                decision = await self._step(deployment, workers, plans, urls)
            except UnknownDeployment:  # undeployed since this tick listed it: no outage, the others go on
                log.info("scaler %s: undeployed during its step", deployment.package_id[:12])
                self.tracked.pop(deployment.package_id, None)
                self.metrics.forget(deployment.package_id)
                continue
            except ControlPlaneError:
                raise
            except Exception:
                log.exception("scaler %s: its step failed: holding its pool this tick", deployment.package_id[:12])
                _mark_gap(self.tracked[deployment.package_id], self.monotonic())
                continue
            decisions.append((deployment.package_id, decision))
        try:
            await self._gate(deployments)
        except ControlPlaneError:
            raise
        except Exception:  # as a step's: a bug in judging the canaries must not stop the daemon's scaling
            log.exception("scaler: judging the canaries failed: judged again next tick")
        return decisions

    async def _gate(self, deployments: Sequence[Deployment]) -> None:
        """Roll back the canaries that the gates of their routes fail (module docstring)."""
        routers_of = {d.package_id: d.routers for d in deployments}
        routes = await self.client.list_routes()
        self.gate.forget(route.name for route in routes)
        for route in routes:
            urls = sorted({url for package, _ in route.versions for url in routers_of.get(package, ())})
            if route.gate is None or not route.canaries or not urls:
                self.gate.saw(route)  # a canary added (again) later is then told apart
                continue
            # Per router process (one listed twice, under two names of its host, counts once); a silent one is left
            # out, its counts judged again once it answers (Gate).
            answers = {a["instance"]: a["versions"] for a in await self._stats_of(urls) if a is not None}
            per_router = {instance: add_up_versions([versions]) for instance, versions in answers.items()}
            for verdict in self.gate.judge(route, add_up_versions(answers.values()), per_router):
                log.warning("scaler: rolling back canary %s of %s: %s", verdict.package_id[:12], route.name,
                            verdict.reason)
                try:
                    await self.client.change_route(RouteChange(route.name, "rollback", verdict.package_id,
                                                               reason=verdict.reason))
                except ControlPlaneError as exc:  # changed by hand meanwhile: judged again next tick
                    log.warning("scaler: rollback of %s refused: %s", route.name, exc)
                    continue
                self.metrics.gate_rollbacks.labels(route.name).inc()

    async def _step(self, deployment: Deployment, workers, plans, urls: dict[str, str]) -> Decision:
        package_id = deployment.package_id
        tracked = self.tracked.setdefault(package_id, _Tracked())
        if not tracked.recovered:
            await self._recover(deployment, tracked)
        answers = await self._stats_of(deployment.routers)
        now = self.monotonic()
        held_back = self.config.source_keep_s + RELEASE_GRACE_S
        tracked.released = {n: at for n, at in tracked.released.items() if now - at < held_back}
        num_blocks, store = await self._package(package_id)
        pool = pool_of(package_id, num_blocks, workers, plans, now=now, released=tracked.released,
                       last_scale_up=tracked.last_scale_up, store=store)
        tracked.history.append(add_up(now, answers, urls, package_id, nodes={r.node_id for r in pool.replicas}))
        _trim(tracked.history, now)
        if pool.strays:
            await self._release_strays(package_id, pool, tracked, now)
        tracked.cold_starts.observe(pool.replicas, now, tracked.last_scale_up)
        signals = tracked.history[-1]
        _warn_unlisted(package_id, tracked, pool.replicas, signals, now)
        tracked.idle_at_zero = not pool.replicas and not signals.queue_depth and not signals.in_flight
        tracked.routers = deployment.routers
        pool = replace(pool, cold_start_s=tracked.cold_starts.seconds)
        decision = decide(list(tracked.history), pool, deployment.policy)
        taken = decision
        if tracked.refused is not None and tracked.refused[0] == decision.action and \
                now - tracked.refused[1] < tracked.refused[2]:
            taken = replace(decision, add=0, release=(), kind="refused")  # refused a moment ago: not asked again yet
        elif decision.action != "hold" or (decision.kind != tracked.last_kind and decision.kind in NOTABLE_HOLDS):
            taken = await self._act(package_id, decision, len(pool.replicas), tracked, now)
        self.metrics.observe(package_id, taken, len(pool.replicas), pool.cold_start_s)
        tracked.last_kind = decision.kind
        return taken

    async def _act(self, package_id: str, decision: Decision, actual: int, tracked: _Tracked,
                   now: float) -> Decision:
        """Record ``decision`` in the audit trail and make it (at ``now``, the monotonic clock); return what was
        done: ``decision`` (a scale-up at the count placed: the trail then says so after it), or a hold of kind
        ``refused`` where the control plane refused it."""
        nodes: Sequence[str] = decision.release
        event = ScaleEvent(at=self.clock(), package_id=package_id, action=decision.action,
                           count=decision.add or len(decision.release), node_ids=tuple(nodes), reason=decision.reason,
                           inputs_json=json.dumps(decision.inputs, sort_keys=True), desired=decision.desired,
                           actual=actual)
        if decision.action == "hold":
            await self.client.append_scale_event(event)
            log.info("scaler %s: %s", package_id[:12], decision.reason)
            return decision
        # The decision is durable before it is acted on: a crash in between leaves it in the trail.
        await self.client.append_scale_event(event)
        log.info("scaler %s: %s (%s)", package_id[:12], decision.action, decision.reason)
        taken: tuple[str, ...] = ()
        try:
            if decision.add:
                reply, placed, short = await self._scale_up(package_id, decision.add)
                log.info("scaler %s: plan %s to %s (already holding: %s)", package_id[:12], reply.plan_id or "-",
                         ",".join(reply.receivers) or "-", ",".join(reply.unchanged) or "-")
                tracked.last_scale_up = now
                tracked.cold_starts.started(reply.receivers, now)
                # A released one taken back serves again; the trail says so (below), for a daemon restarted later.
                taken = tuple(node for node in (*reply.receivers, *reply.unchanged)
                              if tracked.released.pop(node, None) is not None)
            else:
                await self.client.release(package_id, list(decision.release), keep_alive_s=self.config.source_keep_s)
                tracked.released.update({node: now for node in decision.release})
        except (ChangeNotStored, ControlPlaneDeadlineExceeded) as exc:
            # Made all the same (agents told), or perhaps made: a call unanswered within its deadline may have been
            # (its handler runs on after the caller's deadline; UNAVAILABLE, a refused connection or a deposed
            # replica, made nothing: a refusal, below). Taken as made, never made again nor logged as refused (a
            # restarted daemon reads a refusal as none made): the next listing shows what was.
            log.warning("scaler %s: %s %s: %s", package_id[:12], decision.action,
                        "made but not stored" if isinstance(exc, ChangeNotStored) else "unanswered: taken as made", exc)
            if decision.add:
                tracked.last_scale_up = now
                # Its reply is lost: the released workers it took back (placement takes them first) would count
                # as free, not as replicas, and be added again.
                tracked.released.clear()
            else:
                tracked.released.update({node: now for node in decision.release})
            return decision
        except ControlPlaneError as exc:
            # The placement may differ from the pool the policy saw (a worker died, memory is short): hold.
            log.warning("scaler %s: %s refused: %s", package_id[:12], decision.action, exc)
            again = tracked.refused is not None and tracked.refused[0] == decision.action
            wait = min(2 * tracked.refused[2], REFUSED_RETRY_MAX_S) if again else REFUSED_RETRY_S
            tracked.refused = (decision.action, now, wait)
            await self.client.append_scale_event(ScaleEvent(
                at=self.clock(), package_id=package_id, action="hold", reason=f"{_refused(decision.action)}{exc}",
                desired=decision.desired, actual=actual))
            return replace(decision, add=0, release=(), kind="refused")
        tracked.refused = None
        if decision.add and placed < decision.add:  # the trail has the count decided: the count made follows
            await self.client.append_scale_event(ScaleEvent(
                at=self.clock(), package_id=package_id, action="hold", count=placed,
                reason=f"scale_up placed {placed} of {decision.add}: {short}", desired=decision.desired,
                actual=actual))
            decision = replace(decision, add=placed)
        if taken:
            await self.client.append_scale_event(ScaleEvent(
                at=self.clock(), package_id=package_id, action="take_back", count=len(taken), node_ids=taken,
                reason=f"the scale-up took back {len(taken)} released", desired=decision.desired, actual=actual))
        return decision

    async def _release_strays(self, package_id: str, pool: Pool, tracked: _Tracked, now: float) -> None:
        """Release the package's copies on workers bound to another package (:attr:`Pool.strays`), recorded in the
        audit trail first, as a release of the pool's is: they never serve it, and no release of the pool's would
        ever reach them. A refusal is recorded as a pool release's is (a restarted daemon takes them as not
        released) and asked again after the same growing wait."""
        if tracked.strays_refused is not None and now - tracked.strays_refused[0] < tracked.strays_refused[1]:
            return  # refused a moment ago: not asked again yet
        strays = pool.strays
        reason = f"released {len(strays)} copies on workers serving another package"
        await self.client.append_scale_event(ScaleEvent(
            at=self.clock(), package_id=package_id, action="release", count=len(strays), node_ids=strays,
            reason=reason, actual=len(pool.replicas)))
        log.warning("scaler %s: %s: %s", package_id[:12], reason, ",".join(strays))
        try:
            await self.client.release(package_id, list(strays), keep_alive_s=self.config.source_keep_s)
        except (ChangeNotStored, ControlPlaneDeadlineExceeded) as exc:  # made (perhaps): as _act takes them
            log.warning("scaler %s: release of copies on workers serving another package taken as made: %s",
                        package_id[:12], exc)
        except ControlPlaneError as exc:
            log.warning("scaler %s: release of copies on workers serving another package refused: %s",
                        package_id[:12], exc)
            last = tracked.strays_refused
            tracked.strays_refused = (now, min(2 * last[1], REFUSED_RETRY_MAX_S) if last else REFUSED_RETRY_S)
            await self.client.append_scale_event(ScaleEvent(
                at=self.clock(), package_id=package_id, action="hold", reason=f"{_refused('release')}{exc}",
                actual=len(pool.replicas)))
            return
        tracked.strays_refused = None
        tracked.released.update({node: now for node in strays})

    async def _scale_up(self, package_id: str, count: int) -> tuple[pb.ScaleUpResponse, int, str]:
        """Scale up by ``count`` workers, or fewer where the control plane cannot place them: the pool counts
        every serving worker that may serve the package and holds none of it as free, but placement also needs its
        memory budget, and refuses a scale-up it cannot place whole (which, retried at the same count each tick,
        added none). Half as many are asked each time, down to one: one fewer at a time took up to ``count`` calls
        (100 with 100 workers short of memory, each within its deadline). Returns the control plane's reply, the
        count placed and why no more were ("" when all were)."""
        asked, short = count, ""
        while True:
            try:
                reply = await self.client.scale_up(package_id, count=count, strategy=self.config.plan_strategy,
                                                   serving_only=True)  # a replica must serve: an agent alone never
                                                                       # is one, counted nor released
                break
            except InsufficientWorkers as exc:
                if count == 1:
                    raise
                count, short = count // 2, str(exc)
        if short:
            log.info("scaler %s: placed %d of the %d workers asked: %s", package_id[:12], count, asked, short)
        return reply, count, short

    async def _recover(self, deployment: Deployment, tracked: _Tracked) -> None:
        """Cooldowns and recent releases from the audit trail's latest events, back to the longest of the cooldowns
        and the released workers' hold (a restarted daemon goes on where it was), each at its age on the wall clock
        (module docstring)."""
        wall, now = self.clock(), self.monotonic()
        policy = deployment.policy
        horizon = max(policy.scale_up_cooldown_s, policy.scale_down_cooldown_s,
                      self.config.source_keep_s + RELEASE_GRACE_S)
        limit = RECOVER_EVENTS
        # A fixed count read too few where holds filled the trail (a router silent every other poll writes two a
        # tick): the last scale-up or release fell out of it, and its cooldown with it.
        while True:
            events = await self.client.list_scale_events(deployment.package_id, limit=limit)
            if len(events) < limit or wall - events[0].at > horizon or limit >= RECOVER_EVENTS_MAX:
                break
            limit *= 4
        last_release: tuple[str, ...] = ()
        before_scale_up = None
        for event in events:
            at = now - max(wall - event.at, 0.0)
            if event.action == "scale_up":
                before_scale_up, tracked.last_scale_up = tracked.last_scale_up, at
            elif event.action == "release":
                tracked.released.update({node: at for node in event.node_ids})
                last_release = event.node_ids
            elif event.action == "take_back":
                for node in event.node_ids:
                    tracked.released.pop(node, None)
            elif event.action == "hold" and event.reason.startswith(_refused("scale_up")):
                # Recorded right after the scale-up it refused (_act): none was made, no cooldown began.
                tracked.last_scale_up = before_scale_up
            elif event.action == "hold" and event.reason.startswith(_refused("release")):
                # Recorded right after the release it refused (_act): its workers still serve.
                for node in last_release:
                    tracked.released.pop(node, None)
        tracked.recovered = True

    async def _package(self, package_id: str) -> tuple[int, str]:
        """The package's number of blocks and its store's node id, as this tick's listing of packages has them (a
        package published again may have moved to another store: kept for good, it was counted a replica never
        released, and the new store a releasable one, every release refused)."""
        if package_id not in self._packages:  # published since the listing
            manifest, store = await self.client.get_package(package_id)
            self._packages[package_id] = len(manifest.blocks), store.node_id
        return self._packages[package_id]

    async def _stats_of(self, urls: Sequence[str]) -> list[dict | None]:
        """This tick's /stats of the routers at ``urls``: one answer (None: silent) per router, a URL of several
        addresses giving one per address."""
        return [answer for answers in await asyncio.gather(*(self._stats(url) for url in urls)) for answer in answers]

    async def _stats(self, url: str) -> list[dict | None]:
        """The /stats of this tick of the routers at ``url``: polled once however many deployments and routes
        read it."""
        if url not in self._answers:
            self._answers[url] = await self._poll_each(url, *await self._addresses(url))
        return self._answers[url]

    async def _addresses(self, url: str) -> tuple[list[str | None], int]:
        """Where to poll the router URL ``url``, and how many routers it stands for: each address its host
        resolves to now, where several (routers behind a headless Service: each keeps its own queue and counts,
        and a poll of the name reaches one of them); else ``[None]``, the URL itself (one router, or a failed
        resolution that its poll reports). A failed resolution of a name that had several addresses when it last
        resolved stands for that many routers all the same: the one a poll of the name reaches is not all of them,
        and their view must not read as complete (it released a replica busy at another router)."""
        parsed = URL(url)
        try:
            async with asyncio.timeout(self.config.router_timeout_s):
                addresses = await self.resolve(parsed.host or "", parsed.port)
        except (OSError, TimeoutError, ValueError):  # ValueError: a name no resolver takes, stored before checks
            return [None], self._routers_at.get(url, 1)
        self._routers_at[url] = max(len(addresses), 1)
        return (list(addresses), len(addresses)) if len(addresses) > 1 else ([None], 1)

    async def _poll_each(self, url: str, addresses: Sequence[str | None], routers: int,
                         quiet: bool = False) -> list[dict | None]:
        """The /stats of the ``routers`` at ``url`` (:meth:`_addresses`): one answer per router, those beyond
        ``addresses`` silent."""
        if routers > len(addresses) and not quiet:
            log.warning("router %s: its name did not resolve: %d of the %d routers it stood for count as silent",
                        url, routers - len(addresses), routers)
        answers = await asyncio.gather(*(self._poll(url, address, quiet) for address in addresses))
        return [*answers, *[None] * (routers - len(addresses))]

    async def _poll(self, url: str, address: str | None = None, quiet: bool = False) -> dict | None:
        """One router's checked /stats (at ``address``, with ``url``'s Host, where given), or None (logged unless
        ``quiet``: the ticks log it) when it is silent or its answer unusable."""
        parsed = URL(url)
        target, router, headers = url, url, serving_headers(self._serving_key)
        if address is not None:
            target, router = str(parsed.with_host(address)), f"{url} at {address}"
            headers["Host"] = parsed.host_port_subcomponent
        try:
            # Not redirected: the serving key in the headers is for the router only.
            async with self._session.get(f"{target}/stats", headers=headers, server_hostname=parsed.host,
                                         allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=self.config.router_timeout_s)) as answer:
                if 300 <= answer.status < 400:
                    raise StatsFormatError(f"router {router}: /stats answered HTTP {answer.status}, a redirect to "
                                           f"{strictjson.describe(answer.headers.get('Location'))}, not followed")
                if answer.status != 200:
                    raise StatsFormatError(f"router {router}: /stats answered HTTP {answer.status}")
                body = await read_capped(answer.content, MAX_STATS_BYTES)
                if len(body) > MAX_STATS_BYTES:
                    raise StatsFormatError(f"router {router}: /stats answered more than {MAX_STATS_BYTES} bytes")
                return parse_stats(router, strictjson.loads(body))
        except (aiohttp.ClientError, TimeoutError, ValueError, StatsFormatError, strictjson.JSONInputError) as exc:
            # ValueError: a host name no resolver takes, as aiohttp raises it (UnicodeError)
            if not quiet:
                log.warning("router %s gave no signals: %s", router, str(exc) or type(exc).__name__)
            return None
