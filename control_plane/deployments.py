"""Deployments, served-model routes and the audit trail, as the control plane keeps them (pure: no I/O, no clock).

A deployment is a published package with the :class:`ScalingPolicy` the scaling daemon (``pipecast
scaler``) keeps it by, the routers whose ``/stats`` are its signals, and its priority (the share of each
link its multicast takes: the agents' ``priority_shares``). The daemon holds no state of its
own: it reads the deployments here every tick and appends each decision (:class:`ScaleEvent`) to the
:class:`DeploymentBook`'s log, from which a restarted daemon also recovers its cooldowns. Every change of a
served model's route (:mod:`control_plane.routes`: canaries, promotions, rollbacks) goes to the same log.
"""

import json
import logging
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from control_plane.errors import InvalidRequest, UnknownDeployment, UnknownPackage
from control_plane.routes import ModelRoute, RouteChange, change_route, describe
from control_plane.rows import known_fields
from pipecast.core.priorities import DEFAULT_PRIORITY, PRIORITIES
from pipecast.core.urls import http_base_url, one_spelling

log = logging.getLogger(__name__)

#: Scale events kept in memory (the database keeps them all).
EVENTS_IN_MEMORY = 10_000
#: And the latest of each package, so that a quiet deployment's trail is not pushed out by busy ones (found in review:
#: `pipecast scaler events --package` showed nothing of it once the others had logged 10,000 events).
EVENTS_PER_PACKAGE_IN_MEMORY = 2_000
#: The audit trail's table keeps the latest this many events; older ones are deleted as new ones are written (found
#: in review: it grew without bound, ~10,800 a day from a deployment whose scale-ups kept being refused).
EVENTS_KEPT = 200_000
DEFAULT_EVENTS_LIMIT = 1000
#: The scaling daemon's actions; a route's changes are logged under control_plane.routes.ROUTE_ACTIONS.
#: ``take_back``: the released workers a scale-up took back (known once it is placed; a restarted daemon
#: counts them as replicas again, not as released).
ACTIONS = ("scale_up", "release", "take_back", "hold")
#: ``warm_auto_factor``'s usable range: from just the baseline to ten times it.
WARM_AUTO_FACTORS = (1.0, 10.0)
_WARM_AUTO_RANGE = f"0 (warm fixed) or within {WARM_AUTO_FACTORS[0]:g}..{WARM_AUTO_FACTORS[1]:g}"
#: The factor ``pipecast cp deploy --warm auto`` asks for (the operator's rule: absorb 2-3x the baseline).
DEFAULT_WARM_AUTO_FACTOR = 2.0
#: The longest duration of a policy (s): a longer SLO, keep-alive, cooldown or cold start is a mistake, and one of
#: 1e308 s overflowed the daemon's math.
MAX_DURATION_S = 86_400.0
#: The most of a policy's counts (replicas, a replica's concurrency): beyond any cluster's, and far within the
#: uint32 that control.proto carries them in (a value above it was refused only by protobuf, with a ValueError).
MAX_COUNT = 100_000
#: The bounds of each ScalingPolicy number: (comparison with the lower bound, lower bound, upper bound or None).
#: ``replica_rps`` at least a request in 11.6 days: the daemon divides by it.
POLICY_BOUNDS = {"min_replicas": (">=", 0, MAX_COUNT), "max_replicas": (">=", 1, MAX_COUNT),
                 "slo_ttft_p99_s": (">", 0, MAX_DURATION_S), "warm": (">=", 0, MAX_COUNT),
                 "keep_alive_s": (">=", 0, MAX_DURATION_S), "scale_up_cooldown_s": (">=", 0, MAX_DURATION_S),
                 "scale_down_cooldown_s": (">=", 0, MAX_DURATION_S), "replica_rps": (">=", 1e-6, None),
                 "replica_concurrency": (">=", 1, MAX_COUNT), "warm_auto_factor": (">=", 0, None),
                 "cold_start_s": (">=", 0, MAX_DURATION_S)}


@dataclass(frozen=True)
class ScalingPolicy:
    """How one deployment is scaled (the fields of ``ScalingPolicy`` in control.proto, same meaning)."""

    min_replicas: int = 0
    max_replicas: int = 8
    slo_ttft_p99_s: float = 2.0
    warm: int = 0
    keep_alive_s: float = 60.0
    scale_up_cooldown_s: float = 5.0
    scale_down_cooldown_s: float = 60.0
    replica_rps: float = 1.0
    replica_concurrency: int = 8
    #: 0: the warm pool is ``warm``; else it is sized from the traffic, to absorb this many times the baseline.
    warm_auto_factor: float = 0.0
    #: Seconds a new replica takes to serve (0: not counted): a scale-up is then sized to drain, within the
    #: SLO, the requests that arrive meanwhile beyond what the ready replicas take.
    cold_start_s: float = 0.0
    #: The daemon sizes for the cold starts it measures on this deployment's scale-ups once it has one
    #: (:mod:`pipecast.scaler.coldstart`), ``cold_start_s`` until then.
    cold_start_measured: bool = False

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when they are usable)."""
        return [message for _, message in self.problems_by_field()]

    def problems_by_field(self) -> list[tuple[tuple[str, ...], str]]:
        """What is wrong with these values, each with the fields it is about (a command line names their flags);
        empty when they are usable."""
        found: list[tuple[tuple[str, ...], str]] = []
        if not isinstance(self.cold_start_measured, bool):
            found.append((("cold_start_measured",), f"cold_start_measured must be true or false, got "
                                                    f"{self.cold_start_measured!r}"))
        for name, value in asdict(self).items():
            if name == "cold_start_measured":
                continue
            op, low, high = POLICY_BOUNDS[name]
            number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            # One wording per field whatever the value (0, -1, nan, 1e308): its bounds.
            if not number or value < low or (op == ">" and value == low) or (high is not None and value > high):
                most = "" if high is None else f" and <= {high:g}"
                bounds = _WARM_AUTO_RANGE if name == "warm_auto_factor" else f"a finite number {op} {low:g}{most}"
                found.append(((name,), f"{name} must be {bounds}, got {value!r}"))
        if found:  # the comparisons below hold only between values within their bounds
            return found
        if self.min_replicas > self.max_replicas:
            found.append((("min_replicas", "max_replicas"),
                          f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})"))
        if self.warm > self.max_replicas:
            found.append((("warm", "max_replicas"),
                          f"warm ({self.warm}) must be <= max_replicas ({self.max_replicas})"))
        if self.warm_auto_factor and not WARM_AUTO_FACTORS[0] <= self.warm_auto_factor <= WARM_AUTO_FACTORS[1]:
            found.append((("warm_auto_factor",), f"warm_auto_factor must be {_WARM_AUTO_RANGE}, got "
                                                 f"{self.warm_auto_factor}"))
        if self.warm_auto_factor and self.warm:
            found.append((("warm", "warm_auto_factor"), f"warm ({self.warm}) must be 0 when warm_auto_factor "
                                                        f"({self.warm_auto_factor}) sizes the warm pool"))
        return found


@dataclass(frozen=True)
class Deployment:
    """A package the scaling daemon keeps, its policy, the routers it reads signals from and its priority."""

    package_id: str
    policy: ScalingPolicy
    routers: tuple[str, ...] = ()
    created_at: float = 0.0
    updated_at: float = 0.0
    priority: str = DEFAULT_PRIORITY

    def to_json(self) -> dict[str, Any]:
        return {"package_id": self.package_id, "policy": asdict(self.policy), "routers": list(self.routers),
                "created_at": self.created_at, "updated_at": self.updated_at, "priority": self.priority}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Deployment":
        """The deployment a stored row holds; ValueError if its policy's values are not usable ones."""
        policy = ScalingPolicy(**known_fields(ScalingPolicy, data["policy"]))
        if problems := policy.problems():
            raise ValueError(f"policy: {'; '.join(problems)}")
        return cls(str(data["package_id"]), policy,
                   tuple(str(r) for r in data["routers"]), float(data["created_at"]), float(data["updated_at"]),
                   str(data.get("priority", DEFAULT_PRIORITY)))  # rows written before priorities: normal


@dataclass(frozen=True)
class ScaleEvent:
    """One entry of the audit trail (``ScaleEvent`` in control.proto): a decision of the scaling daemon, or a
    change of a served model's route (``inputs_json`` then holds the route before and after); ``seq`` 0
    until appended."""

    at: float
    package_id: str
    action: str
    count: int = 0
    node_ids: tuple[str, ...] = ()
    reason: str = ""
    inputs_json: str = "{}"
    desired: int = 0
    actual: int = 0
    seq: int = 0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "node_ids": list(self.node_ids)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ScaleEvent":
        """The event a stored row holds; ValueError naming a field of the wrong type."""
        event = cls(**{**known_fields(cls, data), "node_ids": tuple(data["node_ids"])})
        for name, kind in _EVENT_FIELD_TYPES.items():
            value = getattr(event, name)
            if (isinstance(value, bool) or not isinstance(value, kind)
                    or (isinstance(value, float) and not math.isfinite(value))):
                raise ValueError(f"{name} {value!r:.80} is not {_KIND_NAMES[kind]}")
        if not all(isinstance(node, str) for node in event.node_ids):
            raise ValueError(f"node_ids {event.node_ids!r:.80} are not all text")
        return event


#: What each field of a stored ScaleEvent must hold (bool is refused where a number is due).
_EVENT_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "at": (int, float), "package_id": str, "action": str, "count": int, "reason": str, "inputs_json": str,
    "desired": int, "actual": int, "seq": int}
_KIND_NAMES = {(int, float): "a finite number", str: "text", int: "an integer"}


MAX_EVENT_TIME = 253402300799.0  # 9999-12-31T23:59:59Z, the last second datetime takes


#: Endpoints of a router, which a deployment's router URL must not end with: the daemon appends them to it. /v1 is
#: the OpenAI base URL its clients are given (the daemon polled /v1/stats, a 404 every tick); a path before them is
#: a gateway's prefix, which is kept.
ROUTER_ENDPOINTS = ("/stats", "/metrics", "/health", "/v1/workers", "/v1/completions", "/v1/chat/completions",
                    "/v1/models", "/v1")


def _endpoint_of(path: str) -> str | None:
    """The router endpoint (:data:`ROUTER_ENDPOINTS`) that ``path`` ends with, if any."""
    return next((e for e in ROUTER_ENDPOINTS if path.endswith(e)), None)


def check_router_url(url: str, package_id: str) -> str:
    """A router's base URL (http or https, a host, no query, no credentials), without a trailing slash, its host
    in lower case and without a default port."""
    base = http_base_url(url)
    if base is None:
        raise InvalidRequest(f"deployment of package {package_id!r}: router {url!r} is not an http(s) base URL")
    parts = urlsplit(base)
    if "@" in parts.netloc:  # listed to every caller and logged: the routers take the serving key instead
        raise InvalidRequest(f"deployment of package {package_id!r}: router URL with credentials refused")
    endpoint = _endpoint_of(parts.path)
    if endpoint is not None:  # found in review: the daemon polled .../stats/stats, and held with no signals
        # Stripped while one ends it: .../v1/stats suggested .../v1, itself refused.
        stripped = base
        while (last := _endpoint_of(urlsplit(stripped).path)) is not None:
            stripped = stripped[:len(stripped) - len(last)]
        raise InvalidRequest(f"deployment of package {package_id!r}: router {url!r} names the router's {endpoint} "
                             f"endpoint; give its base URL ({stripped or base})")
    if parts.port == 0:  # no router listens there: its deployment would read it as silent for good
        raise InvalidRequest(f"deployment of package {package_id!r}: router {url!r} names port 0")
    return one_spelling(base)  # two spellings of one router were polled and summed as two


@dataclass
class DeploymentBook:
    """Every deployment and route and the latest audit events; ``dirty_deployments``, ``dirty_routes`` and
    ``new_events`` are what the store has not written yet. ``written_routes`` are the routes as last written
    (or restored): what routers are shown, so that none routes by a change a crash could lose; likewise
    ``written_seq``, the last event written, bounds what the audit trail shows."""

    deployments: dict[str, Deployment] = field(default_factory=dict)
    events: deque[ScaleEvent] = field(default_factory=lambda: deque(maxlen=EVENTS_IN_MEMORY))
    by_package: dict[str, deque[ScaleEvent]] = field(default_factory=dict)
    last_seq: int = 0
    dirty_deployments: set[str] = field(default_factory=set)
    new_events: list[ScaleEvent] = field(default_factory=list)
    routes: dict[str, ModelRoute] = field(default_factory=dict)
    dirty_routes: set[str] = field(default_factory=set)
    written_routes: dict[str, ModelRoute] = field(default_factory=dict)
    written_seq: int = 0

    @property
    def dirty(self) -> bool:
        """Whether the book holds changes the store has not written yet."""
        return bool(self.dirty_deployments or self.new_events or self.dirty_routes)

    def put(self, deployment: Deployment, published: Iterable[str], now: float) -> Deployment:
        """Create or replace the deployment of its package; raises :class:`InvalidRequest` naming every bad
        value, :class:`UnknownPackage` for a package that is not published."""
        package_id = deployment.package_id
        problems = deployment.policy.problems()
        if deployment.priority not in PRIORITIES:
            problems.append(f"priority must be one of {', '.join(PRIORITIES)}, got {deployment.priority!r}")
        if problems:
            raise InvalidRequest(f"deployment of package {package_id!r} refused: {'; '.join(problems)}")
        if package_id not in set(published):
            raise UnknownPackage.named(package_id)
        routers = tuple(dict.fromkeys(check_router_url(url, package_id) for url in deployment.routers))
        earlier = self.deployments.get(package_id)
        stored = replace(deployment, routers=routers, created_at=earlier.created_at if earlier else now,
                         updated_at=now)
        self.deployments[package_id] = stored
        self.dirty_deployments.add(package_id)
        return stored

    def remove(self, package_id: str) -> None:
        """Forget a deployment (its events stay); raises :class:`UnknownDeployment` if there is none."""
        if self.deployments.pop(package_id, None) is None:
            raise UnknownDeployment.named(package_id)
        self.by_package.pop(package_id, None)  # its events stay in the database (found in review: kept for good)
        self.dirty_deployments.add(package_id)

    def priority_of(self, package_id: str) -> str:
        """The priority of ``package_id``'s deployment; ``normal`` for a package without one."""
        deployment = self.deployments.get(package_id)
        return deployment.priority if deployment is not None else DEFAULT_PRIORITY

    def listing(self) -> list[Deployment]:
        return [self.deployments[p] for p in sorted(self.deployments)]

    def append(self, event: ScaleEvent) -> ScaleEvent:
        """Record ``event`` under the next sequence number; raises :class:`InvalidRequest` for an unknown
        action or a time that is not finite, :class:`UnknownDeployment` for a deployment that does not exist."""
        if event.action not in ACTIONS:  # route changes are logged by change_route only
            raise InvalidRequest(f"scale event action {event.action!r} is not one of {', '.join(ACTIONS)}")
        # Not finite, it would be stored and refused when the store is loaded again; past year 9999 no listing
        # could print it.
        if not 0 <= event.at <= MAX_EVENT_TIME:
            raise InvalidRequest(f"scale event of package {event.package_id!r}: at must be a time from 0 to "
                                 f"{MAX_EVENT_TIME:.0f} (year 9999), got {event.at}")
        if event.package_id not in self.deployments:
            raise UnknownDeployment.named(event.package_id)
        return self._record(event)

    def _record(self, event: ScaleEvent) -> ScaleEvent:
        self.last_seq += 1
        stored = replace(event, seq=self.last_seq)
        self._keep(stored)
        self.new_events.append(stored)
        return stored

    def _keep(self, event: ScaleEvent) -> None:
        self.events.append(event)
        if event.package_id in self.deployments:  # a package's own only while it is deployed: memory stays bounded
            self.by_package.setdefault(event.package_id, deque(maxlen=EVENTS_PER_PACKAGE_IN_MEMORY)).append(event)

    def change_route(self, change: RouteChange, published: Iterable[str], now: float) -> ModelRoute | None:
        """Apply ``change`` to its route (:func:`control_plane.routes.change_route`, which raises what is
        wrong) and log it in the audit trail with the versions before and after; return the route (None:
        removed)."""
        before = self.routes.get(change.name)
        after = change_route(before, change, set(published), now)
        if after is None:
            del self.routes[change.name]
        else:
            self.routes[change.name] = after
        self.dirty_routes.add(change.name)
        concerned = change.package_id or (before.canaries[0] if before and before.canaries else
                                          (before.stable if before else ""))
        inputs = {"route": change.name, "before": before.to_json() if before else None,
                  "after": after.to_json() if after else None}
        self._record(ScaleEvent(at=now, package_id=concerned, action=change.action,
                                reason=f"{change.reason or 'by hand'}; {describe(after, change.name)}",
                                inputs_json=json.dumps(inputs, sort_keys=True)))
        return after

    def routes_of(self, package_id: str) -> list[str]:
        """The served names that route some requests to ``package_id``."""
        return sorted(name for name, route in self.routes.items() if package_id in route.weights())

    def list_events(self, package_id: str = "", after_seq: int = 0, limit: int = 0,
                    through_seq: int | None = None) -> list[ScaleEvent]:
        """The latest ``limit`` events (0: :data:`DEFAULT_EVENTS_LIMIT`) after ``after_seq``, and up to
        ``through_seq`` if given, oldest first: of those in memory (:data:`EVENTS_IN_MEMORY` in all, and
        :data:`EVENTS_PER_PACKAGE_IN_MEMORY` of each deployed package)."""
        last = self.last_seq if through_seq is None else through_seq
        if package_id:  # its own, and its among all (found in review: more of them there when it logged most)
            kept = {e.seq: e for e in self.events if e.package_id == package_id}
            kept.update((e.seq, e) for e in self.by_package.get(package_id, ()))
            chosen = [kept[seq] for seq in sorted(kept) if after_seq < seq <= last]
        else:
            chosen = [e for e in self.events if after_seq < e.seq <= last]
        return chosen[-(limit or DEFAULT_EVENTS_LIMIT):]

    def restore(self, deployments: Sequence[Deployment], events: Sequence[ScaleEvent],
                routes: Sequence[ModelRoute] = ()) -> None:
        """Fill an empty book from the store (events oldest first). A router URL stored before
        :func:`check_router_url` refused it (the OpenAI base URL .../v1) is warned of, with the fix: the scaling daemon
        polls its /stats in vain every tick."""
        self.deployments = {d.package_id: d for d in deployments}
        for deployment in deployments:
            for url in deployment.routers:
                try:
                    check_router_url(url, deployment.package_id)
                except InvalidRequest as exc:
                    log.warning("stored %s: the scaling daemon gets no signals from it until the package is "
                                "deployed again with that URL (pipecast cp deploy)", exc)
        self.routes = {r.name: r for r in routes}
        self.written_routes = dict(self.routes)
        for event in events:
            self._keep(event)
        self.last_seq = self.written_seq = max((e.seq for e in events), default=0)
