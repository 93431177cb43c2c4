"""Application-level rate limits per host and direction (PIPECAST_EGRESS_MBIT / PIPECAST_INGRESS_MBIT, and
the multicast share of the link: PIPECAST_AGENT_LINK_MBIT x PIPECAST_MULTICAST_SHARE, or per package
priority: PIPECAST_PRIORITY_SHARES).

The emulated cluster shapes links with tc where it can; on plain loopback it sets these instead, so each
agent process holds one token bucket per direction shared by all its connections. Off when unset.

The share keeps multicast below the link rate so that the link's queue stays empty for the serving
traffic beside it: a bucket in the sender holds back the bytes the link's queue would otherwise hold.
With shares per priority, the host's buckets take the largest share, and each priority below it has a
bucket of its own that its packages' bytes also go through (a package's priority comes with its plans).
"""

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from pipecast.core.priorities import DEFAULT_PRIORITY, PRIORITIES
from pipecast.core.settings import Settings, SettingsError

# Far below one chunk at the rates of the emulated links: a large burst lets an idle hop send faster than
# its rate and beat the floor (DESIGN 5: 2 MB bursts faked better-than-floor results at 400 Mbit/s; 256 KiB
# did not) ...
MIN_BURST_BYTES = 256 << 10
# ... but at least this long at the rate: a paced sender wakes up to a millisecond late (a timer's slack, a
# busy event loop), and what a burst cannot hold of that lateness is lost. 256 KiB is 0.5 ms at 4 Gbit/s:
# an agent capped at 500 MB/s moved 273 MB/s (README "On a GPU node"); 5 ms at 400 Mbit/s is about 256 KiB.
BURST_SECONDS = 0.005


def burst_bytes_for(rate_bytes_per_s: float) -> float:
    """The burst of a bucket at ``rate_bytes_per_s``: :data:`BURST_SECONDS` of it, at least
    :data:`MIN_BURST_BYTES`."""
    return max(float(MIN_BURST_BYTES), rate_bytes_per_s * BURST_SECONDS)


@dataclass
class TokenBucket:
    """A token bucket that lends: taking more than is there returns how long to wait to repay it. Its burst
    is :func:`burst_bytes_for` its rate unless given."""

    rate_bytes_per_s: float
    burst_bytes: float | None = None
    clock: Callable[[], float] = time.monotonic
    _tokens: float = field(init=False)
    _stamp: float = field(init=False)

    def __post_init__(self) -> None:
        if self.rate_bytes_per_s <= 0:
            raise ValueError(f"rate must be positive, got {self.rate_bytes_per_s}")
        if self.burst_bytes is None:
            self.burst_bytes = burst_bytes_for(self.rate_bytes_per_s)
        self._tokens = self.burst_bytes
        self._stamp = self.clock()

    def take(self, nbytes: int) -> float:
        """Account for ``nbytes`` moved now; return the seconds to pause before moving more (>= 0)."""
        now = self.clock()
        self._tokens = min(self.burst_bytes, self._tokens + (now - self._stamp) * self.rate_bytes_per_s)
        self._stamp = now
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate_bytes_per_s


class Pacer(Protocol):
    """Something bytes are paced through: a :class:`TokenBucket`, or several at once."""

    def take(self, nbytes: int) -> float:
        """Account for ``nbytes`` moved now; return the seconds to pause before moving more (>= 0)."""


@dataclass(frozen=True)
class BucketChain:
    """Bytes that go through every one of ``buckets`` (a priority's and the host's): the longest pause."""

    buckets: tuple[TokenBucket, ...]

    def take(self, nbytes: int) -> float:
        return max(bucket.take(nbytes) for bucket in self.buckets)


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
    """The data plane's rate caps per direction, Mbit/s (0: none), and the caps of the package priorities
    held below them (the same both ways)."""

    egress_mbit: float
    ingress_mbit: float
    priority_mbit: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, settings: Settings) -> "DataPlaneCaps":
        """The caps ``settings`` ask for (:func:`data_plane_caps`)."""
        return data_plane_caps(settings.egress_mbit, settings.ingress_mbit, settings.agent_link_mbit,
                               settings.multicast_share, settings.priority_shares)


def data_plane_caps(egress_mbit: float, ingress_mbit: float, link_mbit: float, share: float,
                    priority_shares: Mapping[str, float] | None = None) -> DataPlaneCaps:
    """Each direction capped at the largest share x ``link_mbit`` and at its own cap, whichever is lower
    (0: none); each priority whose share is below the largest capped at its share x ``link_mbit``.

    A priority's share is ``priority_shares``' or, for a priority not named there, ``share``. A share of 1
    leaves the caps as they are (the whole link). A share below 1 with an unknown link (``link_mbit`` 0)
    raises :class:`LinkShareError`: the agent would otherwise run uncapped while its operator believes
    the serving traffic is protected.
    """
    shares = {priority: (priority_shares or {}).get(priority, share) for priority in PRIORITIES}
    lowest = min(shares.values())
    if lowest < 1 and link_mbit <= 0:
        named = "multicast_share" if lowest == share else "priority_shares"
        raise LinkShareError(f"{named} {lowest:g} needs agent_link_mbit (--link-mbit), this node's link rate "
                             "in Mbit/s: a share of an unknown link cannot be enforced")
    top = max(shares.values())
    below = {priority: s * link_mbit for priority, s in shares.items() if s < top}
    if top >= 1:
        return DataPlaneCaps(egress_mbit, ingress_mbit, below)
    shared = top * link_mbit
    return DataPlaneCaps(*(min(cap, shared) if cap > 0 else shared for cap in (egress_mbit, ingress_mbit)), below)


def _bucket(mbit: float) -> TokenBucket | None:
    return TokenBucket(mbit_to_bytes_per_s(mbit)) if mbit > 0 else None


def _through(host: TokenBucket | None, own: TokenBucket | None) -> Pacer | None:
    if host is None or own is None:
        return host or own
    return BucketChain((own, host))


@dataclass
class HostRateLimits:
    """This host's buckets (None: that direction is unlimited), the buckets of the priorities held below
    them, and each package's priority as its plans said (a package not named is ``normal``)."""

    egress: TokenBucket | None = None
    ingress: TokenBucket | None = None
    #: priority -> (egress, ingress) buckets, for the priorities capped below the host.
    by_priority: dict[str, tuple[TokenBucket, TokenBucket]] = field(default_factory=dict)
    priority_of: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_mbit(cls, egress_mbit: float, ingress_mbit: float,
                  priority_mbit: Mapping[str, float] | None = None) -> "HostRateLimits":
        """Buckets for the given rates (0: unlimited)."""
        return cls(egress=_bucket(egress_mbit), ingress=_bucket(ingress_mbit),
                   by_priority={p: (TokenBucket(mbit_to_bytes_per_s(mbit)), TokenBucket(mbit_to_bytes_per_s(mbit)))
                                for p, mbit in (priority_mbit or {}).items()})

    @classmethod
    def of(cls, caps: DataPlaneCaps) -> "HostRateLimits":
        """Buckets for ``caps``."""
        return cls.from_mbit(caps.egress_mbit, caps.ingress_mbit, caps.priority_mbit)

    def set_priority(self, package_id: str, priority: str) -> None:
        """``package_id``'s priority from now on (its plans say; an unknown name counts as ``normal``)."""
        if priority == DEFAULT_PRIORITY or priority not in PRIORITIES:
            self.priority_of.pop(package_id, None)
        else:
            self.priority_of[package_id] = priority

    def forget(self, package_id: str) -> None:
        """``package_id`` left this node."""
        self.priority_of.pop(package_id, None)

    def egress_for(self, package_id: str) -> Pacer | None:
        """What ``package_id``'s outgoing bytes are paced through; None: nothing."""
        own = self.by_priority.get(self.priority_of.get(package_id, DEFAULT_PRIORITY))
        return _through(self.egress, own[0] if own else None)

    def ingress_for(self, package_id: str) -> Pacer | None:
        """What ``package_id``'s incoming bytes are paced through; None: nothing."""
        own = self.by_priority.get(self.priority_of.get(package_id, DEFAULT_PRIORITY))
        return _through(self.ingress, own[1] if own else None)
