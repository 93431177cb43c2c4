"""The automatic canary gate: which canaries of a served model to roll back (pure: no I/O, no clock).

A route with a :class:`~control_plane.routes.CanaryGate` is judged every tick of the scaling daemon from
the per-version figures of its routers' ``/stats`` (``versions``: cumulative counters and a 60 s TTFT
window per package id; several routers add up: counts are summed, the p95 is the worst router's). A canary
is rolled back when

- with both it and the stable version measured on at least ``min_requests`` requests since the canary was
  added (:class:`Gate` remembers each router's counts then, so a canary added again after a rollback is not
  judged on its last run's), its error rate (failed over answered plus failed) exceeds the stable version's by
  more than ``error_rate_margin``, or
- with both versions' TTFT windows holding at least ``min_requests`` answers, and the canary ready (a worker
  holding it whole: ``ready_s``) for a whole window, its p95 TTFT exceeds the stable version's times
  ``1 + ttft_p95_margin``. Before that its window holds requests that waited for its cold start (its first
  replica loading): a wait a new version pays once, no sign of a slower one.

Too few requests on either version: no verdict yet (the canary keeps its weight).
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from control_plane.routes import ModelRoute

@dataclass(frozen=True)
class VersionFigures:
    """One version's figures, added up over the routers that answered."""

    requests: int = 0  # answered + failed
    failed: int = 0
    ttft_p95_s: float | None = None
    ttft_count: int = 0  # answers in the p95's window
    #: Seconds the version has had a ready worker, the shortest any router says; None: none now (at some
    #: router); inf: the routers do not say (before ``ready_s``), judged as before.
    ready_s: float | None = None
    #: How far back the p95 looks (s; ``/stats`` ``ttft.window_s``, the longest of the routers'): a version
    #: ready this long has no request that waited for its cold start left in it.
    ttft_window_s: float = math.inf

    @property
    def error_rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0

    def describe(self) -> str:
        p95 = "-" if self.ttft_p95_s is None else f"{self.ttft_p95_s:.3f} s"
        return f"{self.requests} requests, {self.failed} failed, p95 TTFT {p95}"


def add_up_versions(answers: Iterable[Mapping[str, Mapping[str, Any]] | None]) -> dict[str, VersionFigures]:
    """Per package id, the figures of every answering router's parsed ``versions`` (None: a silent router)."""
    out: dict[str, VersionFigures] = {}
    for versions in answers:
        for package, figures in (versions or {}).items():
            ready, window = figures.get("ready_s", math.inf), figures.get("ttft_window_s", math.inf)
            seen = out.get(package)
            if seen is None:
                out[package] = VersionFigures(figures["requests"], figures["failed"], figures["ttft_p95_s"],
                                              figures["ttft_count"], ready, window)
                continue
            p95s = [p for p in (seen.ttft_p95_s, figures["ttft_p95_s"]) if p is not None]
            out[package] = VersionFigures(seen.requests + figures["requests"], seen.failed + figures["failed"],
                                          max(p95s, default=None), seen.ttft_count + figures["ttft_count"],
                                          None if seen.ready_s is None or ready is None else min(seen.ready_s, ready),
                                          max(seen.ttft_window_s, window))
    return out


@dataclass(frozen=True)
class Verdict:
    """A canary to roll back and why, with the figures it was judged on (the audit trail's reason)."""

    package_id: str
    reason: str


def judge(route: ModelRoute, figures: Mapping[str, VersionFigures],
          counted: Mapping[str, Mapping[str, VersionFigures]] | None = None) -> list[Verdict]:
    """The canaries of ``route`` its gate rolls back now (none without a gate or without enough requests);
    ``counted``: canary -> the route's versions' figures with their counts since it was added (else the whole
    counts of ``figures``)."""
    gate = route.gate
    if gate is None:
        return []
    verdicts = []
    for canary in route.canaries:
        since = (counted or {}).get(canary, {})
        stable = since.get(route.stable, figures.get(route.stable, VersionFigures()))
        mine = since.get(canary, figures.get(canary, VersionFigures()))
        seen = f" (canary: {mine.describe()}; stable: {stable.describe()})"
        if (min(mine.requests, stable.requests) >= gate.min_requests
                and mine.error_rate > stable.error_rate + gate.error_rate_margin):
            verdicts.append(Verdict(canary, f"gate: canary error rate {mine.error_rate:.1%} > stable's "
                                            f"{stable.error_rate:.1%} + {gate.error_rate_margin:.1%}" + seen))
        elif (min(mine.ttft_count, stable.ttft_count) >= gate.min_requests
              and mine.ready_s is not None and mine.ready_s >= mine.ttft_window_s
              and mine.ttft_p95_s is not None and stable.ttft_p95_s is not None
              and mine.ttft_p95_s > stable.ttft_p95_s * (1 + gate.ttft_p95_margin)):
            verdicts.append(Verdict(canary, f"gate: canary p95 TTFT {mine.ttft_p95_s:.3f} s > stable's "
                                            f"{stable.ttft_p95_s:.3f} s x {1 + gate.ttft_p95_margin:g}" + seen))
    return verdicts


@dataclass
class Gate:
    """The gate over the daemon's ticks: :func:`judge` on the counts since each canary was added, taken per
    router (by its ``/stats`` instance id) from the counts the gate saw there first with the canary in the route:
    when it was added, or, for a canary there before (the daemon just started) or a router not heard then (silent,
    or started since), when the gate first heard it. A router's counts from before are not the canary's run's: a
    restarted daemon judged on them a canary added again after a rollback, and a router silent for one tick had
    its whole history counted as since the canary came (the routers' sums fell, then rose). Counts that fall below
    those remembered (the router forgot the version) are remembered as they are then."""

    #: (route name, canary) -> per router instance, the route's versions' figures there when first seen.
    added: dict[tuple[str, str], dict[str, dict[str, VersionFigures]]] = field(default_factory=dict)

    def saw(self, route: ModelRoute) -> None:
        """Note ``route`` as it is now, every tick, judged or not: a canary no longer in it is forgotten, so that
        one added again is counted from then."""
        for key in [key for key in self.added if key[0] == route.name and key[1] not in route.canaries]:
            del self.added[key]

    def judge(self, route: ModelRoute, figures: Mapping[str, VersionFigures],
              per_router: Mapping[str, Mapping[str, VersionFigures]]) -> list[Verdict]:
        """:meth:`saw` ``route``, then :func:`judge` it: ``figures``, the answering routers' added up;
        ``per_router``, each one's (instance id -> figures), whose counts since each canary was added are judged."""
        self.saw(route)
        names = {package for package, _ in route.versions}
        counted = {}
        for canary in route.canaries:
            bases = self.added.setdefault((route.name, canary), {})
            requests, failed = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
            for instance, theirs in per_router.items():
                now = {p: theirs.get(p, VersionFigures()) for p in names}
                base = bases.get(instance)
                base = bases[instance] = now if base is None else {p: _lowest(base.get(p, VersionFigures()), f)
                                                                   for p, f in now.items()}
                for p, f in now.items():
                    requests[p] += f.requests - base[p].requests
                    failed[p] += f.failed - base[p].failed
            counted[canary] = {p: replace(figures.get(p, VersionFigures()), requests=requests[p], failed=failed[p])
                               for p in names}
        return judge(route, figures, counted)

    def forget(self, names: Iterable[str]) -> None:
        """Keep only the routes named ``names`` (the others were deleted)."""
        keep = set(names)
        self.added = {key: base for key, base in self.added.items() if key[0] in keep}


def _lowest(base: VersionFigures, now: VersionFigures) -> VersionFigures:
    return replace(base, requests=min(base.requests, now.requests), failed=min(base.failed, now.failed))
