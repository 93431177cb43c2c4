"""Placement of a scale-up: which workers receive a package, which nodes send it, and the default strategy.

Pure: from a snapshot of the workers (:class:`Candidate`, built by :class:`control_plane.state.ControlState`)
to a decision; no state, no clock. Raises :class:`~control_plane.errors.InsufficientWorkers` when the
workers cannot take the package.
"""

import heapq
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from control_plane.errors import InsufficientWorkers
from control_plane.planner.schedules import GROUP_CHAIN_MAX
from pipecast.core.units import format_bytes

DEFAULT_FANOUT = 2
# One source and at most this many receivers: a chain, else a binomial pipeline of chunk-range units. With
# chunk cut-through a chain runs every link at full rate and adds one chunk of latency per hop; that latency
# grows with N, the binomial pipeline's with log N. Measured on this project's emulated cluster (netns, agents
# asking four parents at once): N = 16 at 200 Mbit/s chain 1.11x S/B, unit binomial pipeline 1.19x; N = 32
# at 100 Mbit/s chain 1.18x and 1.23x, binomial 1.33-1.37x; N = 64 at 25 Mbit/s (a 64 MiB package in 256 KiB
# chunks, the demo model's chunk count) chain 1.14-1.21x, binomial 1.25-1.30x (three runs or more); 64 is the
# largest N measured there. Simulated one unit at a time the binomial pipeline is the faster there (1.09x at
# N = 64), which the agents, fetching four at once, do not reach (docs/benchmarks.md).
CHAIN_MAX_RECEIVERS = 64
#: The most worker sources a plan names. A plan uses one per receiver at most (a rotated group each), and
#: every source hears of the plan with every receiver listed while every receiver hears of every source (its
#: fallbacks): naming each of 1,000 warm holders in a scale-up of 8 made 1,009 notices of 32 MB, 1.4 s of the
#: control plane's event loop to render (5,000 holders: 804 MB, 47-51 s; bench control-plane). So a plan takes
#: one source per receiver, at most this many: beyond, rotated groups of several receivers (binomial
#: pipelines) at ~1.1x S/B.
MAX_PLAN_SOURCES = 64


@dataclass(frozen=True)
class Candidate:
    """An alive worker as a scale-up of one package sees it."""

    node_id: str
    memory_bytes: int  # its memory budget
    committed_bytes: int  # the bytes of the other packages it holds or is receiving
    blocks_held: int  # verified blocks of this package
    complete: bool  # it holds every block of this package
    receiving: bool  # an active plan still feeds it this package
    releasing: bool  # it is in a keep-alive release of this package
    rack: str | None = None  # its ``rack`` label (None: unknown)
    blocks_cached: int = 0  # blocks of this package in its disk cache and not in memory

    def fits(self, package_bytes: int) -> bool:
        """Whether a package of ``package_bytes`` fits its memory budget beside what it is committed to."""
        return self.committed_bytes + package_bytes <= self.memory_bytes


@dataclass(frozen=True)
class Targets:
    """The workers a scale-up brings a package onto: ``receivers`` need a plan, ``unchanged`` hold it already
    (or are receiving it)."""

    receivers: tuple[str, ...]
    unchanged: tuple[str, ...]


def named_targets(package_id: str, package_bytes: int, candidates: Sequence[Candidate]) -> Targets:
    """The named workers ``candidates`` (in order) sorted into receivers and unchanged ones; raises
    :class:`InsufficientWorkers` if a receiver lacks the memory budget for the package."""
    receivers: list[str] = []
    unchanged: list[str] = []
    for c in candidates:
        if c.complete or c.receiving:
            unchanged.append(c.node_id)
        elif not c.fits(package_bytes):
            raise InsufficientWorkers(
                f"worker {c.node_id!r} has {format_bytes(c.memory_bytes - c.committed_bytes)} of its "
                f"{format_bytes(c.memory_bytes)} memory budget free; package {package_id!r} needs "
                f"{format_bytes(package_bytes)}")
        else:
            receivers.append(c.node_id)
    return Targets(tuple(receivers), tuple(unchanged))


def counted_targets(package_id: str, package_bytes: int, candidates: Iterable[Candidate], count: int,
                    source_racks: Collection[str] = (), *, store: str = "") -> Targets:
    """``count`` workers picked among the alive ``candidates``: those in a keep-alive release of the package
    that hold all of it first (they are ready at once), then those holding most of it in memory or in their
    disk cache (a local load; memory first among equals), then those in one of ``source_racks`` (the racks
    of the plan's sources: no cross-rack traffic), then the least committed; never the package's ``store``
    node; raises :class:`InsufficientWorkers` if fewer than ``count`` can take it."""
    # The store is the package's origin, not a replica: picked as a receiver (its blocks not counted yet, e.g.
    # seeded before the publish) it would leave its plan with no source.
    eligible = [c for c in candidates if c.node_id != store and not c.receiving and (
        (c.releasing and c.complete) or (not c.complete and c.fits(package_bytes)))]
    if len(eligible) < count:
        raise InsufficientWorkers(
            f"scale-up of package {package_id!r} asked for {count} more workers; only {len(eligible)} "
            f"are alive, do not hold it already and have {format_bytes(package_bytes)} of "
            "memory budget free")
    eligible.sort(key=lambda c: (not c.releasing, -(c.blocks_held + c.blocks_cached), -c.blocks_held,
                                 c.rack is None or c.rack not in source_racks, c.committed_bytes, c.node_id))
    chosen = eligible[:count]
    return Targets(tuple(c.node_id for c in chosen if not c.complete), tuple(c.node_id for c in chosen if c.complete))


def pick_sources(complete_holders: Sequence[str], store: str, exclude: Collection[str], *,
                 limit: int = MAX_PLAN_SOURCES, busy: Collection[str] = (), near: Collection[str] = ()) -> list[str]:
    """The nodes a plan sends from: at most ``limit`` of the workers holding the whole package, those not
    ``busy`` serving another plan first (their uplinks are free: successive scale-ups spread over the holders),
    then those ``near`` the receivers (in their racks), then by id; else its ``store``; none of ``exclude``."""
    # The first ``limit`` of thousands of holders in that order, without sorting them all.
    holders = heapq.nsmallest(max(1, limit), (n for n in complete_holders if n not in exclude),
                              key=lambda n: (n in busy, n not in near, n))
    if holders:
        return holders
    return [] if store in exclude else [store]


def default_strategy(sources: int, receivers: int, beside_in_flight: bool = False) -> str:
    """The plan strategy when the operator names none: ``rotated`` for several source slots (``sources``
    counts a source's links: a store with 4 links is 4), or for a few receivers (at most a rotated group's
    chain, :data:`~control_plane.planner.schedules.GROUP_CHAIN_MAX`) added ``beside_in_flight`` receivers of
    the package (the scaling daemon's scale-ups: a chain still, starting where those lack most, so that a
    pipeline across them forms sooner than if all got the blocks in the same order); else ``chain`` up to
    :data:`CHAIN_MAX_RECEIVERS` receivers and ``binomial`` beyond."""
    if sources > 1 or (beside_in_flight and receivers <= GROUP_CHAIN_MAX):
        return "rotated"
    return "chain" if receivers <= CHAIN_MAX_RECEIVERS else "binomial"
