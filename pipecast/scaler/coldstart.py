"""How long a deployment's new replicas take to serve, as the scaling daemon sees them (pure: times are given).

A replica the daemon's scale-up added is timed from that scale-up to the first tick that sees it hold the
whole package (one whole by the next tick too); the measure is the median of the last :data:`KEPT` such
times. A replica that first shows loading without a scale-up of the daemon's since the previous tick (placed
by hand, or seen by a restarted daemon) is timed from when it was seen. One released or gone while it loads
gives no time.
"""

import statistics
from collections import deque
from collections.abc import Iterable

from pipecast.scaler.policy import Replica

#: Cold starts remembered: recent enough to follow a change (a bigger model, a slower link, unicast instead of
#: multicast), enough for the median to ride over one slow start.
KEPT = 5


class ColdStarts:
    """The last :data:`KEPT` cold starts of one deployment's replicas (seconds)."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}  # node -> when its loading began
        self._seconds: deque[float] = deque(maxlen=KEPT)
        self._seen_at: float | None = None

    def started(self, nodes: Iterable[str], at: float) -> None:
        """The daemon's scale-up at ``at`` placed the package on ``nodes``: timed from then, also those that hold
        it whole by the next tick (a local load), which no tick sees loading."""
        for node in nodes:
            self._since.setdefault(node, at)

    def observe(self, replicas: Iterable[Replica], now: float, last_scale_up: float | None) -> None:
        """Take one tick's replicas at ``now`` (the daemon's monotonic clock); ``last_scale_up``: its last one."""
        ours = last_scale_up is not None and self._seen_at is not None and self._seen_at <= last_scale_up <= now
        present = set()
        for replica in replicas:
            present.add(replica.node_id)
            if replica.loading:
                self._since.setdefault(replica.node_id, last_scale_up if ours else now)
            elif replica.node_id in self._since:
                self._seconds.append(now - self._since.pop(replica.node_id))
        for node in set(self._since) - present:
            del self._since[node]
        self._seen_at = now

    @property
    def seconds(self) -> float | None:
        """The median of the cold starts kept, None before the first."""
        return statistics.median(self._seconds) if self._seconds else None
