"""Application-level rate limits per host and direction (PIPECAST_EGRESS_MBIT / PIPECAST_INGRESS_MBIT, and
the multicast share of the link: PIPECAST_AGENT_LINK_MBIT x PIPECAST_MULTICAST_SHARE).

The emulated cluster shapes links with tc where it can; on plain loopback it sets these instead, so each
agent process holds one token bucket per direction shared by all its connections. Off when unset.

The share keeps multicast below the link rate so that the link's queue stays empty for the serving
traffic beside it: a bucket in the sender holds back the bytes the link's queue would otherwise hold.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipecast.core.settings import Settings, SettingsError

# Far below one chunk: a large burst lets an idle hop send faster than its rate and beat the floor
# (DESIGN 5: 2 MB bursts faked better-than-floor results; 256 KiB did not).
DEFAULT_BURST_BYTES = 256 << 10


@dataclass
class TokenBucket:
    """A token bucket that lends: taking more than is there returns how long to wait to repay it."""

    rate_bytes_per_s: float
    burst_bytes: float = DEFAULT_BURST_BYTES
    clock: Callable[[], float] = time.monotonic
    _tokens: float = field(init=False)
    _stamp: float = field(init=False)

    def __post_init__(self) -> None:
        if self.rate_bytes_per_s <= 0:
            raise ValueError(f"rate must be positive, got {self.rate_bytes_per_s}")
        self._tokens = self.burst_bytes
        self._stamp = self.clock()

    def take(self, nbytes: int) -> float:
        """Account for ``nbytes`` moved now; return the seconds to pause before moving more (>= 0)."""
        now = self.clock()
        self._tokens = min(self.burst_bytes, self._tokens + (now - self._stamp) * self.rate_bytes_per_s)
        self._stamp = now
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate_bytes_per_s


def format_rate(bytes_per_s: float) -> str:
    """A data rate for logs: GB/s from 1 GB/s up (the unit the design notes use), MB/s below."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def mbit_to_bytes_per_s(mbit: float) -> float:
    """Megabits per second (10^6) to bytes per second."""
    return mbit * 1e6 / 8


class LinkShareError(SettingsError):
    """A multicast share below 1 without the link rate it is a share of."""


@dataclass(frozen=True)
class DataPlaneCaps:
    """The data plane's rate caps per direction, Mbit/s (0: none)."""

    egress_mbit: float
    ingress_mbit: float

    @classmethod
    def of(cls, settings: Settings) -> "DataPlaneCaps":
        """The caps ``settings`` ask for (:func:`data_plane_caps`)."""
        return data_plane_caps(settings.egress_mbit, settings.ingress_mbit, settings.agent_link_mbit,
                               settings.multicast_share)


def data_plane_caps(egress_mbit: float, ingress_mbit: float, link_mbit: float, share: float) -> DataPlaneCaps:
    """Each direction capped at ``share`` x ``link_mbit`` and at its own cap, whichever is lower (0: none).

    A share of 1 leaves the caps as they are (the whole link). A share below 1 with an unknown link
    (``link_mbit`` 0) raises :class:`LinkShareError`: the agent would otherwise run uncapped while its
    operator believes the serving traffic is protected.
    """
    if share >= 1:
        return DataPlaneCaps(egress_mbit, ingress_mbit)
    if link_mbit <= 0:
        raise LinkShareError(f"multicast_share {share:g} needs agent_link_mbit (--link-mbit), this node's link rate "
                             "in Mbit/s: a share of an unknown link cannot be enforced")
    shared = share * link_mbit
    return DataPlaneCaps(*(min(cap, shared) if cap > 0 else shared for cap in (egress_mbit, ingress_mbit)))


@dataclass
class HostRateLimits:
    """This host's buckets; None means that direction is unlimited."""

    egress: TokenBucket | None = None
    ingress: TokenBucket | None = None

    @classmethod
    def from_mbit(cls, egress_mbit: float, ingress_mbit: float) -> "HostRateLimits":
        """Buckets for the given rates (0: unlimited)."""
        return cls(
            egress=TokenBucket(mbit_to_bytes_per_s(egress_mbit)) if egress_mbit > 0 else None,
            ingress=TokenBucket(mbit_to_bytes_per_s(ingress_mbit)) if ingress_mbit > 0 else None,
        )
