"""Which version of a served model a request goes to: the route's weights, among versions that have workers.

Pure logic, no clock. A route (:mod:`control_plane.routes`, learned through discovery) maps a served name
to packages with weights in percent. Requests are split by smooth weighted round robin (nginx's): each
pick adds every eligible version's weight to its credit and takes the version with the most, which then
pays the total back, so any window of requests follows the weights as closely as whole requests can (90/10
sends exactly one request in ten to the canary, not a random number) and versions interleave.

Only versions with a worker that serves them (its last health answer names the package) or a pipeline of
them are eligible: a canary whose workers are all gone sends its share to the others instead of letting it
wait; with none eligible (the pool is still starting) the request goes to the stable version.
"""

from collections.abc import Collection, Mapping

from pipecast.router.discovery import RouteTable


class VersionChooser:
    """The smooth weighted round robin state of every served name."""

    def __init__(self) -> None:
        self._credit: dict[str, dict[str, int]] = {}

    def choose(self, versions: tuple[tuple[str, int], ...], name: str, serving: Collection[str]) -> str:
        """The package of ``name``'s next request, given its ``versions`` (stable first) and the packages
        with ``serving`` workers."""
        eligible = [(package, weight) for package, weight in versions if weight > 0 and package in serving]
        if not eligible:
            return versions[0][0]
        credit = self._credit.setdefault(name, {})
        for package in [p for p in credit if p not in dict(versions)]:
            del credit[package]  # a version rolled back or promoted away
        for package, weight in eligible:
            credit[package] = credit.get(package, 0) + weight
        chosen = max(eligible, key=lambda v: credit[v[0]])[0]
        credit[chosen] -= sum(weight for _, weight in eligible)
        return chosen

    def forget(self, routes: Mapping[str, object]) -> None:
        """Drop the state of names no longer in ``routes``."""
        for name in [n for n in self._credit if n not in routes]:
            del self._credit[name]


def route_versions(routes: RouteTable, model: object) -> tuple[tuple[str, int], ...] | None:
    """The versions of the served name ``model`` (a request's ``model`` field), None when it has no route."""
    return routes.get(model) if isinstance(model, str) else None
