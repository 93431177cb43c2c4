"""The automatic canary gate: which canaries of a served model to roll back (pure: no I/O, no clock).

A route with a :class:`~control_plane.routes.CanaryGate` is judged every tick of the scaling daemon from
the per-version figures of its routers' ``/stats`` (``versions``: cumulative counters and a 60 s TTFT
window per package id; several routers add up: counts are summed, the p95 is the worst router's). A canary
is rolled back when, with both it and the stable version measured on at least ``min_requests`` requests,

- its error rate (failed over answered plus failed) exceeds the stable version's by more than
  ``error_rate_margin``, or
- its p95 TTFT exceeds the stable version's times ``1 + ttft_p95_margin``.

Too few requests on either version: no verdict yet (the canary keeps its weight).
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from control_plane.routes import ModelRoute


@dataclass(frozen=True)
class VersionFigures:
    """One version's figures, added up over the routers that answered."""

    requests: int = 0  # answered + failed
    failed: int = 0
    ttft_p95_s: float | None = None

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
            seen = out.get(package, VersionFigures())
            p95s = [p for p in (seen.ttft_p95_s, figures["ttft_p95_s"]) if p is not None]
            out[package] = VersionFigures(seen.requests + figures["requests"], seen.failed + figures["failed"],
                                          max(p95s, default=None))
    return out


@dataclass(frozen=True)
class Verdict:
    """A canary to roll back and why, with the figures it was judged on (the audit trail's reason)."""

    package_id: str
    reason: str


def judge(route: ModelRoute, figures: Mapping[str, VersionFigures]) -> list[Verdict]:
    """The canaries of ``route`` its gate rolls back now (none without a gate or without enough requests)."""
    gate = route.gate
    if gate is None:
        return []
    stable = figures.get(route.stable, VersionFigures())
    verdicts = []
    for canary in route.canaries:
        mine = figures.get(canary, VersionFigures())
        if min(mine.requests, stable.requests) < gate.min_requests:
            continue
        seen = f" (canary: {mine.describe()}; stable: {stable.describe()})"
        if mine.error_rate > stable.error_rate + gate.error_rate_margin:
            verdicts.append(Verdict(canary, f"gate: canary error rate {mine.error_rate:.1%} > stable's "
                                            f"{stable.error_rate:.1%} + {gate.error_rate_margin:.1%}" + seen))
        elif (mine.ttft_p95_s is not None and stable.ttft_p95_s is not None
              and mine.ttft_p95_s > stable.ttft_p95_s * (1 + gate.ttft_p95_margin)):
            verdicts.append(Verdict(canary, f"gate: canary p95 TTFT {mine.ttft_p95_s:.3f} s > stable's "
                                            f"{stable.ttft_p95_s:.3f} s x {1 + gate.ttft_p95_margin:g}" + seen))
    return verdicts
