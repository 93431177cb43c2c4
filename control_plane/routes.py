"""Served model names and their versions: which packages answer a name, with what share of its requests.

A route maps one served name (what clients put in ``model``, e.g. ``smollm2-chat``) to versions, each a
published package with a weight in percent: the ``stable`` one and any canaries (e.g. 90/10). Routers read
the routes from the control plane and split each name's requests by the weights; ``pipecast cp promote``
makes a canary the stable version, ``rollback`` removes canaries; the scaling daemon's automatic gate
(:mod:`pipecast.scaler.gate`) rolls a canary back when it does worse than the stable version by more than
the route's :class:`CanaryGate` margins. Pure: no I/O, no clock; :func:`change_route` is the only transition.
"""

import math
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from typing import Any

from control_plane.errors import Conflict, InvalidRequest, UnknownPackage, UnknownRoute
from control_plane.rows import known_fields

#: What :func:`change_route` does, by action (also the audit trail's action names).
ROUTE_ACTIONS = ("route", "canary", "promote", "rollback", "unroute")
#: A served name: what OpenAI clients send as ``model`` (no spaces or control characters).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


@dataclass(frozen=True)
class CanaryGate:
    """When the automatic gate rolls a canary back (``pipecast.scaler.gate``): its p95 TTFT above the
    stable version's times ``1 + ttft_p95_margin``, or its error rate above the stable's plus
    ``error_rate_margin``, once both versions were measured on at least ``min_requests`` requests."""

    ttft_p95_margin: float = 0.5
    error_rate_margin: float = 0.05
    min_requests: int = 20

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when they are usable)."""
        found = []
        for name in ("ttft_p95_margin", "error_rate_margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                found.append(f"gate {name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.min_requests, bool) or not isinstance(self.min_requests, int) or self.min_requests < 1:
            found.append(f"gate min_requests must be an integer >= 1, got {self.min_requests!r}")
        return found


@dataclass(frozen=True)
class ModelRoute:
    """One served name: its versions as (package id, weight in percent), the weights summing to 100, the
    stable version first; ``gate`` None: canaries change only by hand."""

    name: str
    stable: str
    versions: tuple[tuple[str, int], ...]
    gate: CanaryGate | None = None
    updated_at: float = 0.0

    @property
    def canaries(self) -> tuple[str, ...]:
        """The versions other than the stable one."""
        return tuple(package for package, _ in self.versions if package != self.stable)

    def weights(self) -> dict[str, int]:
        return dict(self.versions)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "stable": self.stable, "versions": [list(v) for v in self.versions],
                "gate": asdict(self.gate) if self.gate else None, "updated_at": self.updated_at}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelRoute":
        """The route a stored row holds; ValueError if its gate's values are not usable ones."""
        gate = CanaryGate(**known_fields(CanaryGate, data["gate"])) if data.get("gate") else None
        if gate is not None and (problems := gate.problems()):
            raise ValueError("; ".join(problems))
        return cls(str(data["name"]), str(data["stable"]), tuple((str(p), int(w)) for p, w in data["versions"]),
                   gate, float(data["updated_at"]))


@dataclass(frozen=True)
class RouteChange:
    """A request to change one route: ``action`` one of :data:`ROUTE_ACTIONS`. ``package_id``: the new
    stable version (``route``), the canary (``canary``; for ``promote`` and ``rollback`` optional when
    the route has exactly one canary / to roll back every canary); ``weight``: the canary's percent;
    ``gate``: set with ``route`` or ``canary`` (None keeps the route's, ``no_gate`` removes it)."""

    name: str
    action: str
    package_id: str = ""
    weight: int = 0
    gate: CanaryGate | None = None
    reason: str = ""
    no_gate: bool = False


def change_route(route: ModelRoute | None, change: RouteChange, published: Collection[str],
                 now: float) -> ModelRoute | None:
    """The route after ``change`` (None: removed). Raises :class:`InvalidRequest` naming what is wrong,
    :class:`UnknownRoute`, :class:`UnknownPackage` for a version that is not published, or
    :class:`Conflict` for a change the route's state forbids (a new stable version while canaries run)."""
    name, action, package = change.name, change.action, change.package_id
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidRequest(f"served model name {name!r} must be 1-128 letters, digits or ._:/@+- "
                             "(starting with a letter or digit)")
    if action not in ROUTE_ACTIONS:
        raise InvalidRequest(f"route action {action!r} is not one of {', '.join(ROUTE_ACTIONS)}")
    if change.gate is not None and (problems := change.gate.problems()):
        raise InvalidRequest(f"route {name!r}: {'; '.join(problems)}")
    if change.gate is not None and change.no_gate:
        raise InvalidRequest(f"route {name!r}: a change sets a gate or removes it, not both")
    if (change.gate is not None or change.no_gate) and action not in ("route", "canary"):
        raise InvalidRequest(f"route {name!r}: {action} keeps the route's gate; set or remove it with route or "
                             "canary")
    if action in ("route", "canary") and package not in published:
        raise UnknownPackage.named(package)
    if action == "route":
        if route is not None and route.canaries:
            raise Conflict(f"route {name!r} has canary {route.canaries[0]!r}: promote it or roll it back before "
                           "setting a new stable version")
        return ModelRoute(name, package, ((package, 100),), _gate_after(route, change), now)
    if route is None:
        raise UnknownRoute.named(name)
    if action == "unroute":
        return None
    if action == "canary":
        if package == route.stable:
            raise InvalidRequest(f"route {name!r}: {package!r} is already the stable version")
        if not isinstance(change.weight, int) or isinstance(change.weight, bool) or not 1 <= change.weight <= 99:
            raise InvalidRequest(f"route {name!r}: a canary's weight must be 1..99 percent, got {change.weight!r}")
        canaries = {p: w for p, w in route.versions if p != route.stable and p != package}
        canaries[package] = change.weight
        if sum(canaries.values()) > 99:
            raise InvalidRequest(f"route {name!r}: canaries would take {sum(canaries.values())}% of the requests; "
                                 "they may take at most 99% (the stable version keeps 1%)")
        return _with_canaries(route, canaries, _gate_after(route, change), now)
    chosen = _canary_named(route, package, action)
    if action == "promote":
        return ModelRoute(name, chosen[0], ((chosen[0], 100),), route.gate, now)
    kept = {p: w for p, w in route.versions if p != route.stable and p not in chosen}
    return _with_canaries(route, kept, route.gate, now)


def _gate_after(route: ModelRoute | None, change: RouteChange) -> CanaryGate | None:
    if change.no_gate:
        return None
    return change.gate if change.gate is not None else (route.gate if route else None)


def _canary_named(route: ModelRoute, package: str, action: str) -> tuple[str, ...]:
    """The canaries ``action`` concerns: ``package``, or (none named) the only one / every one."""
    if not route.canaries:
        raise InvalidRequest(f"route {route.name!r} has no canary to {action}")
    if package:
        if package not in route.canaries:
            raise InvalidRequest(f"route {route.name!r}: {package!r} is not one of its canaries "
                                 f"({', '.join(route.canaries)})")
        return (package,)
    if action == "promote" and len(route.canaries) > 1:
        raise InvalidRequest(f"route {route.name!r} has {len(route.canaries)} canaries: name the one to promote")
    return route.canaries


def _with_canaries(route: ModelRoute, canaries: dict[str, int], gate: CanaryGate | None, now: float) -> ModelRoute:
    versions = ((route.stable, 100 - sum(canaries.values())), *sorted(canaries.items()))
    return replace(route, versions=versions, gate=gate, updated_at=now)


def describe(route: ModelRoute | None, name: str) -> str:
    """A route's versions for logs and the audit trail, e.g. ``smollm2-chat: abc123 90%, def456 10%``."""
    if route is None:
        return f"{name}: no route"
    return f"{name}: " + ", ".join(f"{package[:12]} {weight}%" for package, weight in route.versions)
