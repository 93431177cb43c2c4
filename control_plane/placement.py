"""Placement of a scale-up: which workers receive a package, which nodes send it, and the default strategy.

Pure: from a snapshot of the workers (:class:`Candidate`, built by :class:`control_plane.state.ControlState`)
to a decision; no state, no clock. Raises :class:`~control_plane.errors.InsufficientWorkers` when the
workers cannot take the package.

A plan's nodes all speak one data-plane transport (:func:`plan_transport`): agents of different transports
cannot exchange blocks (a TCP client cannot fetch from a UCX listener).
"""

import collections
import heapq
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from control_plane.errors import InsufficientWorkers, InvalidRequest, NoSource
from control_plane.planner.schedules import GROUP_CHAIN_MAX, binomial_pairs
from pipecast.core.settings import MIN_RELAY_PIECE_BYTES
from pipecast.core.units import format_bytes

DEFAULT_FANOUT = 2
# One source: a chain or a binomial pipeline of chunk-range units. With chunk cut-through a chain runs every link
# at full rate and adds one relay piece (and a hop's fixed costs) of latency per hop, which grows with N; the
# binomial pipeline's grows with log N, but it keeps its rounds only on a full hypercube (N = 2^d - 1 or 2^d):
# between, the surplus receivers share slots in pairs and the rounds lose their rhythm. Measured on this
# project's emulated cluster (netns, agents asking four parents at once): N = 16 at 200 Mbit/s chain 1.11x S/B,
# unit binomial pipeline 1.19x; N = 32 at 100 Mbit/s chain 1.18x and 1.23x, binomial 1.33-1.37x; N = 64 at 25
# Mbit/s (a 64 MiB package in 256 KiB chunks) chain 1.14-1.21x, binomial 1.25-1.30x; N = 100 at 16 Mbit/s (32
# MiB in 128 KiB chunks, CPU-bound) chain 1.33x twice, binomial 1.38x and 1.47x. So a chain up to 64 receivers
# whatever the package; beyond, up to CHAIN_MAX_RECEIVERS and off the full hypercubes, a chain while (N - 1)
# relay pieces stay within CHAIN_EXCESS of the package. The simulator fitted to the agents (`bench simulate
# --calibrated --concurrency 4`, demo model, 400 Mbit/s) agrees at every count it was run: the chain ahead at N =
# 65, 100, 150, 200 and 206 (1.22 / 1.32 / 1.47 / 1.62 / 1.64x against 1.38 / 1.81 / 1.79 / 1.85 / 1.83x), the
# binomial pipeline at 127, 256 and 300 (1.35 / 1.42 / 1.83x against 1.40 / 1.79 / 1.92x), where the chain's
# fixed cost per hop (the manifest and small files, fetched hop by hop) has added up (docs/benchmarks.md).
CHAIN_MIN_RECEIVERS = 64
# Whatever the package: a hop's fixed cost, which the plan does not know (fitted at 16 ms on this machine's
# emulated cluster), over 256 hops is 4 s.
CHAIN_MAX_RECEIVERS = 256
CHAIN_EXCESS = 0.20
#: The agents' relay piece (the default ``agent_relay_bytes``): a chain's hop passes a chunk on from its first.
RELAY_PIECE_BYTES = 256 << 10
# A chain's last receiver ends (hops - 1) relay pieces after its first: 256 KiB pieces over 205 hops of the demo
# model (257 MiB) are 20% of its time (1.21x S/B simulated, 0.2 ms a hop). A plan whose hops would add more than
# RELAY_FILL of the package asks its receivers for smaller pieces, halved down to MIN_RELAY_PIECE_BYTES: 1.06x there
# in 64 KiB pieces (MIN_RELAY_PIECE_BYTES, no smaller: see there).
RELAY_FILL = 0.05
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
    serving: bool = True  # a serving worker beside its agent (a serve URL), of this package or another (:meth:`serves`)
    #: Of ``committed_bytes``, those of other packages it keeps only in a keep-alive release (a future source):
    #: given up when a scale-up needs the memory.
    reclaimable_bytes: int = 0
    transports: tuple[str, ...] = ("tcp",)  # the data-plane transports its agent speaks
    #: The package its serving worker serves (``pipecast serve PACKAGE``; "": not said, any package): a worker
    #: bound to another one never serves this package, whatever blocks of it its agent holds.
    serve_package: str = ""

    def serves(self, package_id: str) -> bool:
        """Whether its serving worker would serve ``package_id`` once it holds it: it has one, bound to that
        package or to none."""
        return self.serving and self.serve_package in ("", package_id)

    def fits(self, package_bytes: int, *, reclaiming: bool = False) -> bool:
        """Whether a package of ``package_bytes`` fits its memory budget beside what it is committed to (with
        ``reclaiming``: once the packages it keeps only in a keep-alive release are dropped)."""
        kept = self.committed_bytes - (self.reclaimable_bytes if reclaiming else 0)
        return kept + package_bytes <= self.memory_bytes


@dataclass(frozen=True)
class Targets:
    """The workers a scale-up brings a package onto: ``receivers`` need a plan, ``unchanged`` hold it already
    (or are receiving it)."""

    receivers: tuple[str, ...]
    unchanged: tuple[str, ...]
    transport: str | None = None  # the one the plan's nodes speak (:func:`plan_transport`); None: not chosen


def plan_transport(offered: Sequence[str], receivers: Iterable[Sequence[str]]) -> str | None:
    """The transport of a new plan, which its receivers and sources all speak: of those ``offered`` (what the
    nodes that may send the package speak, in order of preference), the one the most ``receivers`` (each one's
    transports) speak, the first offered among equals; None if none is offered."""
    speakers = collections.Counter(t for transports in receivers for t in set(transports))
    return max(offered, key=lambda t: speakers[t], default=None)


def named_targets(package_id: str, package_bytes: int, candidates: Sequence[Candidate],
                  offered: Sequence[str] = ()) -> Targets:
    """The named workers ``candidates`` (in order) sorted into receivers and unchanged ones; raises
    :class:`InsufficientWorkers` if a receiver lacks the memory budget for the package. With ``offered`` (the
    transports of the nodes that may send it, in order of preference) the receivers' transport is chosen
    (:func:`plan_transport`); raises :class:`NoSource` if a receiver speaks none of them, :class:`InvalidRequest`
    if two receivers share none of them."""
    receivers: list[Candidate] = []
    unchanged: list[str] = []
    for c in candidates:
        if c.complete or c.receiving:
            unchanged.append(c.node_id)
        elif not c.fits(package_bytes, reclaiming=True):
            raise InsufficientWorkers(
                f"worker {c.node_id!r} has {format_bytes(c.memory_bytes - c.committed_bytes)} of its "
                f"{format_bytes(c.memory_bytes)} memory budget free; package {package_id!r} needs "
                f"{format_bytes(package_bytes)}")
        else:
            receivers.append(c)
    names = tuple(c.node_id for c in receivers)
    if not offered or not receivers:
        return Targets(names, tuple(unchanged))
    transport = plan_transport(offered, (c.transports for c in receivers))
    for c in receivers:
        if transport in c.transports:
            continue
        if set(offered).isdisjoint(c.transports):
            raise NoSource(f"scale-up of package {package_id!r}: worker {c.node_id!r} speaks "
                           f"{_listed(c.transports)} and no node holding the package to send it from does (they "
                           f"speak {_listed(offered)})")
        other = next(o for o in receivers if transport in o.transports)
        raise InvalidRequest(f"scale-up of package {package_id!r}: worker {c.node_id!r} speaks "
                             f"{_listed(c.transports)} and worker {other.node_id!r} {_listed(other.transports)}, "
                             f"with no transport in common that a node holding the package speaks "
                             f"({_listed(offered)}): one plan's nodes speak one; scale them up apart")
    return Targets(names, tuple(unchanged), transport)


def _listed(transports: Sequence[str]) -> str:
    return ", ".join(transports) or "no transport"


def counted_targets(package_id: str, package_bytes: int, candidates: Iterable[Candidate], count: int,
                    source_racks: Collection[str] = (), *, store: str = "", offered: Sequence[str] = (),
                    serving_only: bool = False) -> Targets:
    """``count`` workers picked among the alive ``candidates``: those whose serving worker would serve the package
    first (:meth:`Candidate.serves`; an agent alone, or one whose worker serves another package, serves no request
    of it: the scaling daemon counts neither as free, and a copy on another node made it scale up again), among
    them those in a keep-alive release of the package
    that hold all of it first (they are ready at once), then those it fits without dropping another package kept
    in a keep-alive release, then those holding most of it in memory or in their
    disk cache (a local load; memory first among equals), then those in one of ``source_racks`` (the racks
    of the plan's sources: no cross-rack traffic), then the least committed; never the package's ``store``
    node; with ``offered`` (the transports of the nodes that may send it, in order of preference), only receivers
    speaking the one of those that the most eligible ones speak (:func:`plan_transport`); with ``serving_only``,
    those whose serving worker would serve it alone; raises :class:`InsufficientWorkers` if fewer than ``count``
    can take it."""
    # The store is the package's origin, not a replica: picked as a receiver (its blocks not counted yet, e.g.
    # seeded before the publish) it would leave its plan with no source.
    eligible = [c for c in candidates
                if c.node_id != store and not c.receiving and (not serving_only or c.serves(package_id))
                and ((c.releasing and c.complete) or (not c.complete and c.fits(package_bytes, reclaiming=True)))]
    transport = plan_transport(offered, (c.transports for c in eligible if not c.complete))
    speaking = [c for c in eligible if c.complete or transport is None or transport in c.transports]
    if len(speaking) < count:
        free = f"{format_bytes(package_bytes)} of memory budget free"
        # Workers of another transport are said to be left out: else the count of alive ones looks wrong.
        which = "serve it (a serve URL, the worker there bound to no other package), " if serving_only else ""
        which += f"do not hold it already and have {free}" if len(speaking) == len(eligible) else (
            f"do not hold it already, have {free} and speak {transport} (of the transports of the nodes that "
            f"may send it, {_listed(offered)}, the one most of them speak)")
        raise InsufficientWorkers(f"scale-up of package {package_id!r} asked for {count} more workers; only "
                                  f"{len(speaking)} are alive, {which}")
    speaking.sort(key=lambda c: (not c.serves(package_id), not c.releasing,
                                 not c.complete and not c.fits(package_bytes), -(c.blocks_held + c.blocks_cached),
                                 -c.blocks_held, c.rack is None or c.rack not in source_racks, c.committed_bytes,
                                 c.node_id))
    chosen = speaking[:count]
    return Targets(tuple(c.node_id for c in chosen if not c.complete), tuple(c.node_id for c in chosen if c.complete),
                   transport)


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


def relay_piece(chunk_bytes: int, relay_bytes: int = RELAY_PIECE_BYTES) -> int:
    """What a chain's hop waits for before it passes a chunk of ``chunk_bytes`` on: a piece of ``relay_bytes``
    (0: the whole chunk)."""
    return min(relay_bytes, chunk_bytes) if relay_bytes else chunk_bytes


def plan_relay_piece(hops: int, package_bytes: int, piece_bytes: int = RELAY_PIECE_BYTES) -> int:
    """The relay piece a plan of ``hops`` relays in a row (:meth:`~control_plane.planner.plan.Plan.hops`) asks of
    its receivers, for a package of ``package_bytes`` that agents relay in pieces of ``piece_bytes``: 0 (their own
    pieces) while (hops - 1) pieces stay within :data:`RELAY_FILL` of the package, else the largest halving of
    ``piece_bytes`` within it, :data:`MIN_RELAY_PIECE_BYTES` at least."""
    piece = piece_bytes
    while piece > MIN_RELAY_PIECE_BYTES and (hops - 1) * piece > RELAY_FILL * package_bytes:
        piece //= 2
    return max(piece, MIN_RELAY_PIECE_BYTES) if piece < piece_bytes else 0


def chain_suits(receivers: int, package_bytes: int, piece_bytes: int) -> bool:
    """Whether one source's default plan to ``receivers`` is a chain, for a package of ``package_bytes`` whose
    hops pass chunks on in pieces of ``piece_bytes`` (see :data:`CHAIN_EXCESS`; without a size, 0 or less, only
    up to :data:`CHAIN_MIN_RECEIVERS`)."""
    if receivers <= CHAIN_MIN_RECEIVERS:
        return True
    if receivers > CHAIN_MAX_RECEIVERS or binomial_pairs(receivers) <= 1 or package_bytes <= 0 or piece_bytes <= 0:
        return False
    return (receivers - 1) * piece_bytes <= CHAIN_EXCESS * package_bytes


def default_strategy(sources: int, receivers: int, beside_in_flight: bool = False, *, package_bytes: int = 0,
                     piece_bytes: int = RELAY_PIECE_BYTES) -> str:
    """The plan strategy when the operator names none: ``rotated`` for several source slots (``sources``
    counts a source's links: a store with 4 links is 4), or for a few receivers (at most a rotated group's
    chain, :data:`~control_plane.planner.schedules.GROUP_CHAIN_MAX`) added ``beside_in_flight`` receivers of
    the package (the scaling daemon's scale-ups: a chain still, starting where those lack most, so that a
    pipeline across them forms sooner than if all got the blocks in the same order); else ``chain`` where
    :func:`chain_suits` the package of ``package_bytes`` in relay pieces of ``piece_bytes``, ``binomial``
    elsewhere."""
    if sources > 1 or (beside_in_flight and receivers <= GROUP_CHAIN_MAX):
        return "rotated"
    return "chain" if chain_suits(receivers, package_bytes, piece_bytes) else "binomial"
