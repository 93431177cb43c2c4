"""Multicast schedules: which node sends each block to each receiver, and in which order receivers fetch.

Pure functions from cluster state to a :class:`~control_plane.planner.plan.Plan`; no sockets, no I/O. The
control plane hands a plan to the agents, the benchmarks and the large-scale simulator reuse it
(:mod:`control_plane.planner.simulate`), and :func:`control_plane.planner.replan.replan` repairs one after
failures and joins.

Plans fetch whole blocks, or with ``chunk_counts`` the binomial pipelines fetch units: runs of consecutive
chunks (ranges of one block, or of a block's end and the next block's start), so that a round moves a small
unit, all units alike, and the pipeline stays near S/B at any N.

Every strategy gives each (receiver, unit) fetch a round such that a parent's round for a unit comes
before its child's, and orders each receiver's fetches by round. So a receiver that fetches its list
strictly in order, forwarding chunk by chunk, never waits on a fetch that waits on it: no plan built
here can deadlock, and :meth:`~control_plane.planner.plan.Plan.validate` checks exactly that for plans
that come from elsewhere.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from control_plane.planner.plan import STRATEGIES, Chunks, Fetch, Plan, PlanError, check_ids, is_index
from control_plane.planner.racks import ParentPool, Rack, rack_of, rack_order

#: Rotated groups up to this size are chains: with chunk cut-through a chain runs every link at full rate
#: and each member receives the group's order front to back (measured, N = 8 at 400 Mbit/s: chain 1.07x
#: S/B, binomial 1.71x, whose rounds move whole blocks, a big one gating each round). Larger groups are
#: binomial pipelines, whose latency grows with log N instead of N.
GROUP_CHAIN_MAX = 8

#: The default size of a binomial pipeline's units (runs of consecutive chunks). Each node gets one unit per
#: round and a round lasts as long as the largest unit in flight, so k units of at most s chunks to a group
#: 2^d - 1 receivers deep take about (k + d) * s chunk times, against the model's T chunks (the simulator
#: agrees within ~3% where there are no pairs). The default s is, among those for which (k + d) * s stays
#: within ROUND_OVERHEAD of T, the one of the fewest fetches (the shortest fetch lists: whole blocks, or even
#: shares of them, where those meet it); where none does, the one with the least (k + d) * s. A big model gets
#: few, large units (140,000 chunks in 80 blocks at N = 1,024: 160 units of 875 chunks, two a block; whole blocks
#: up to N = 510), a small one many (the demo's 264 chunks: 44 units of 6 chunks at N = 16 by this rule, 132 of
#: 2 at N = 1,024). Units of more than 2 chunks keep the rounds' rhythm only where a parent serves
#: the child furthest behind first (the simulator's ``serve="earliest"``); shared fairly, its uplink lets
#: children that run ahead slow the current round (the demo at N = 16 in units of 4: 1.57x S/B, 1.10 served
#: earliest first; in units of 3: 1.41 fair; of 2: 1.07; whole blocks 2.24 and 1.75): hence
#: MAX_FAIR_UNIT_CHUNKS. A unit runs on into the next block where a block's chunks end inside it: units cut
#: at every block's end were as long as the chunks left there (the demo's 30 blocks of 7 chunks: 30 units of
#: one), each a short round that the pairs' late sends and the fair sharing turned into lost rhythm (0.2 ms a
#: hop: 1.20x S/B at N = 16 and 127, 1.62x at 100, against 1.07 / 1.09 / 1.10x with runs across blocks).
ROUND_OVERHEAD = 0.1
#: The default unit's least chunks, where blocks have that many. Where N is not 2^d - 1, receivers share
#: a slot in pairs, one forwarding each unit to the other, whose sends are then a chunk late; with
#: one-chunk units that chunk is a whole round and the lag builds up through the pipeline (measured, 257
#: one-chunk units, 0.2 ms a hop: 1.13-1.18x S/B at N = 16-1,024; 1.8-2.0x at N = 100 or 500).
MIN_UNIT_CHUNKS = 2
#: Units of at most this many chunks keep the rounds' rhythm with uplinks shared fairly, as agents share
#: them (a child that runs ahead takes at most a chunk of its parent's round from the others): the default
#: unit is cut down to it where that leaves at most MAX_FAIR_UNITS units (the demo model: 132). A bigger
#: model keeps bigger units and needs parents that serve the child furthest behind first (not built).
MAX_FAIR_UNIT_CHUNKS = 2
MAX_FAIR_UNITS = 256

Piece = tuple[int, Chunks]  # (block, chunk range or None for the whole block)
Unit = tuple[Piece, ...]  # what a binomial pipeline sends in one round: consecutive chunks, in fetch order


@dataclass(frozen=True)
class InFlight:
    """A receiver of the package still in progress under other plans: the blocks it still waits for, in its
    fetch order, and the bytes it already holds of them (those in progress, at the front of its order: its
    progress reports less its verified blocks; 0 where not known)."""

    waiting: tuple[int, ...]
    bytes_present: int = 0


def make_plan(strategy: str, sources: Sequence[str], receivers: Sequence[str], num_blocks: int, *,
              fanout: int = 2, labels: Mapping[str, Mapping[str, str]] | None = None,
              block_bytes: Sequence[int] | None = None, source_links: Mapping[str, int] | None = None,
              chunk_counts: Sequence[int] | None = None, units: int | None = None,
              in_flight: Sequence[InFlight] = ()) -> Plan:
    """Plan how ``receivers`` get blocks ``0..num_blocks-1`` from ``sources`` (nodes holding everything).

    Strategies: ``unicast`` (every block from a source, spread over the sources), ``chain``
    (sources[0] -> r0 -> r1 -> ...), ``tree`` (a ``fanout``-ary tree rooted at sources[0]), ``binomial``
    (binomial pipeline on a hypercube rooted at sources[0]: each block has its own spanning tree, so the
    source sends each block once and every receiver uploads about one model) and ``rotated`` (one group
    of receivers per source slot, K slots in all, each group a binomial pipeline fetching the blocks
    rotated so that group g starts at the block holding byte g*S/K of the S bytes, so the groups together
    hold the whole model early). Where ``labels`` give nodes a ``rack``, receivers are laid out rack by
    rack and a parent in the receiver's rack is preferred wherever there is a choice.

    ``block_bytes`` are the blocks' sizes (default: all equal, so the rotation is by g*num_blocks/K).
    ``source_links`` gives a source's egress in links (default 1): ``rotated`` gives a source with L links
    L groups (a store at 8x the link rate is 8 sources); the other strategies ignore it.

    ``in_flight``: the receivers of the package still in progress under other plans (:class:`InFlight`: the
    blocks each still waits for, in its fetch order, and the bytes it holds of them). ``rotated`` then starts
    its groups where they best complement those (:func:`complement_starts`): a receiver added one second after
    another starts halfway into what the other still lacks, so that the two soon hold every layer between
    them (a pipeline), where rotating as if alone would send it the same blocks first. The other strategies
    ignore it.

    ``chunk_counts`` are the blocks' chunk counts (the manifest's ceil(block bytes / chunk bytes)). With
    them a binomial pipeline (``binomial``, and the binomial groups of ``rotated``) runs over units instead
    of whole blocks: the chunks of its blocks, in its block order, cut into runs of s chunks (the last one
    shorter), a run going on into the next block where one ends inside it; a unit is a fetch per block it
    covers, from the same parent, and a block wholly in one unit is fetched whole. s is the smallest for
    which there are at most ``units`` units in all, or by default the largest that keeps the pipeline's
    rounds within
    :data:`ROUND_OVERHEAD` of S/B (see there), so the units are about as many as the rounds need, not one
    per chunk. ``unicast``, ``chain`` and ``tree`` ignore them: a receiver there forwards every chunk as
    it arrives already, whatever the unit.
    """
    sources, receivers = tuple(sources), tuple(receivers)
    if strategy not in STRATEGIES:
        raise PlanError(f"make_plan: unknown strategy {strategy!r} (expected one of {', '.join(STRATEGIES)})")
    if not is_index(num_blocks) or num_blocks < 1:
        raise PlanError(f"make_plan: num_blocks must be a positive integer, got {num_blocks!r}")
    if not is_index(fanout) or fanout < 1:
        raise PlanError(f"make_plan: fanout must be a positive integer, got {fanout!r}")
    if not sources:
        raise PlanError("make_plan: no sources to plan from")
    check_ids("make_plan", sources, "source")
    check_ids("make_plan", receivers, "receiver")
    both = set(sources).intersection(receivers)
    if both:
        raise PlanError(f"make_plan: {min(both)!r} is both a source and a receiver")
    if block_bytes is not None:
        block_bytes = tuple(block_bytes)
        if len(block_bytes) != num_blocks:
            raise PlanError(f"make_plan: block_bytes gives {len(block_bytes)} sizes for {num_blocks} blocks")
        bad = next((b for b, size in enumerate(block_bytes) if not is_index(size)), None)
        if bad is not None:
            raise PlanError(f"make_plan: block {bad} has size {block_bytes[bad]!r}; sizes must be integers >= 0")
    if chunk_counts is not None:
        chunk_counts = tuple(chunk_counts)
        if len(chunk_counts) != num_blocks:
            raise PlanError(f"make_plan: chunk_counts gives {len(chunk_counts)} counts for {num_blocks} blocks")
        bad = next((b for b, count in enumerate(chunk_counts) if not is_index(count)), None)
        if bad is not None:
            raise PlanError(f"make_plan: block {bad} has {chunk_counts[bad]!r} chunks; chunk counts must be "
                            "integers >= 0")
    if units is not None:
        if not is_index(units) or units < 1:
            raise PlanError(f"make_plan: units must be a positive integer, got {units!r}")
        if chunk_counts is None:
            raise PlanError("make_plan: units needs chunk_counts (the chunks of each block)")
    for receiver in in_flight:
        if not is_index(receiver.bytes_present):
            raise PlanError(f"make_plan: a receiver in flight holds {receiver.bytes_present!r} bytes of the blocks it "
                            "waits for; a byte count must be an integer >= 0")
        wrong = next((b for b in receiver.waiting if not is_index(b) or b >= num_blocks), None)
        if wrong is not None:
            raise PlanError(f"make_plan: a receiver in flight waits for block {wrong!r}; blocks are 0-{num_blocks - 1}")
        if len(set(receiver.waiting)) < len(receiver.waiting):  # its order would put a block in two places
            raise PlanError(f"make_plan: a receiver in flight waits for a block twice: {list(receiver.waiting)}")
    for source, links in (source_links or {}).items():
        if source not in sources:
            raise PlanError(f"make_plan: source_links names {source!r}, which is no source")
        if not is_index(links) or links < 1:
            raise PlanError(f"make_plan: links of source {source!r} must be a positive integer, got {links!r}")
    rack = rack_of(labels)
    split = _Splitter(chunk_counts, units)
    if strategy == "rotated":
        # Only the first len(receivers) groups get anyone: a slot per link past them would cost time and memory.
        slots = list(itertools.islice((s for s in sources for _ in range((source_links or {}).get(s, 1))),
                                      max(1, len(receivers))))
        return Plan(strategy, sources, _rotated(slots, receivers, num_blocks, rack, block_bytes, split, in_flight))
    if strategy == "binomial":
        out: dict[str, list[Fetch[str]]] = {}
        ordered = rack_order(receivers, rack, rack(sources[0]))
        _binomial_group(sources[0], ordered, split(range(num_blocks), len(ordered)), rack, out)
        return Plan(strategy, sources, out)
    build = {"unicast": _unicast, "chain": _chain, "tree": _tree}[strategy]
    return Plan(strategy, sources, build(sources, receivers, num_blocks, fanout, rack))


def _unicast(sources, receivers, num_blocks, fanout, rack) -> dict[str, list[Fetch[str]]]:
    # One source per receiver, the least loaded candidate (round robin without racks). Splitting a
    # receiver's blocks over several sources would idle a source whenever its receivers all fetch
    # from another one, since a receiver fetches one block at a time.
    table = {s: [Fetch(b, s) for b in range(num_blocks)] for s in sources}
    load = dict.fromkeys(sources, 0)
    out = {}
    for rx in receivers:
        mine = rack(rx)
        source = min([s for s in sources if mine is not None and rack(s) == mine] or sources, key=load.get)
        load[source] += 1
        out[rx] = list(table[source])
    return out


def _chain(sources, receivers, num_blocks, fanout, rack) -> dict[str, list[Fetch[str]]]:
    parent, out = sources[0], {}
    for rx in rack_order(receivers, rack, rack(sources[0])):
        out[rx] = [Fetch(b, parent) for b in range(num_blocks)]
        parent = rx
    return out


def _tree(sources, receivers, num_blocks, fanout, rack) -> dict[str, list[Fetch[str]]]:
    # Breadth-first: each receiver takes the shallowest node with a spare slot, in its rack if possible.
    pool = ParentPool(rack)
    pool.add(sources[0], fanout)
    out = {}
    for rx in rack_order(receivers, rack, rack(sources[0])):
        parent = pool.take(rack(rx))
        out[rx] = [Fetch(b, parent) for b in range(num_blocks)]
        pool.add(rx, fanout)
    return out


def _rotated(slots, receivers, num_blocks, rack, block_bytes, split, in_flight) -> dict[str, list[Fetch[str]]]:
    k = max(1, min(len(slots), len(receivers)))  # groups that get receivers: the first k ones
    out: dict[str, list[Fetch[str]]] = {}
    starts = (complement_starts(k, num_blocks, block_bytes, in_flight) if in_flight
              else _rotation_starts(k, num_blocks, block_bytes))
    for source, group, start in zip(slots, _split_groups(slots, receivers, rack), starts):
        order = [(start + i) % num_blocks for i in range(num_blocks)]
        group = rack_order(group, rack, rack(source))
        if len(group) <= GROUP_CHAIN_MAX:
            parent = source
            for rx in group:  # every member then receives the group's order front to back, at the link rate
                out[rx] = [Fetch(b, parent) for b in order]
                parent = rx
        else:
            _binomial_group(source, group, split(order, len(group)), rack, out)
    return {rx: out[rx] for rx in receivers}


def _rotation_starts(k: int, num_blocks: int, block_bytes: Sequence[int] | None) -> list[int]:
    """The first block of each of ``k`` groups: group g's starts at the block boundary nearest to byte
    g*S/k of the S bytes (group 0's is block 0), so that the groups' first S/k bytes together are the model
    with the least overlap: what a pipeline across the groups needs first.

    Where a big block (the embeddings) would give two groups the same first block and there are k blocks
    or more, each group starts past the previous one's, leaving a block for each group after it, so that
    every group starts on a different part of the model. Equal sizes (or none given, or all zero) give
    g*num_blocks/k rounded (half down).
    """
    if block_bytes is None or not any(block_bytes):
        block_bytes = [1] * num_blocks  # by block count
    total = sum(block_bytes)
    ends = list(itertools.accumulate(block_bytes))
    starts = [0]  # also where leading blocks are empty
    for g in range(1, k):
        # integer-exact, no float division: the boundary before block b is at ends[b-1] (0 for b = 0)
        start = min(range(num_blocks), key=lambda b: (abs((ends[b - 1] if b else 0) * k - g * total), b))
        if k <= num_blocks:
            start = min(max(start, starts[-1] + 1), num_blocks - k + g)
        starts.append(start)
    return starts


def complement_starts(k: int, num_blocks: int, block_bytes: Sequence[int] | None,
                      in_flight: Sequence[InFlight]) -> list[int]:
    """The first block of each of ``k`` new groups, given the receivers ``in_flight`` (each waits for its
    ``waiting`` blocks in that order and holds the blocks it does not wait for, and ``bytes_present`` bytes
    of those it waits for).

    Every receiver is taken to get its blocks in order at one link's rate, so block b lands when the bytes
    before it in the receiver's order, less those present, have arrived: a receiver halfway into the
    embeddings' block is half a block nearer each of its blocks than one that has not begun. Group by group,
    each start is the one that makes every block land somewhere soonest (then the most bytes soonest, then
    the lowest block): the union of the receivers, in flight and new, then holds every layer, which is what
    a pipeline across them needs. Sizes as :func:`_rotation_starts` takes them (without sizes, bytes present
    are not counted: the blocks are counted, not their bytes).
    """
    counted = block_bytes is not None and any(block_bytes)
    if not counted:
        block_bytes = [1] * num_blocks
    lands = [math.inf] * num_blocks  # when each block is first held by one of the receivers (0: now)
    for receiver in in_flight:
        arrived, at = -(receiver.bytes_present if counted else 0), {}
        for block in receiver.waiting:
            arrived += block_bytes[block]
            at[block] = max(arrived, 0)
        lands = [min(land, at.get(block, 0)) for block, land in enumerate(lands)]
    starts: list[int] = []
    for _ in range(k):
        best = None
        for start in range(num_blocks):
            trial, arrived = list(lands), 0
            for i in range(num_blocks):
                block = (start + i) % num_blocks
                arrived += block_bytes[block]
                trial[block] = min(trial[block], arrived)
            score = (max(trial), sum(t * block_bytes[b] for b, t in enumerate(trial)), start)
            if best is None or score < best[0]:
                best = (score, start, trial)
        starts.append(best[1])
        lands = best[2]
    return starts


def _split_groups(sources, receivers, rack) -> list[list[str]]:
    """Receivers in len(sources) groups of near-equal size, each filled first from its source's rack (a
    source listed several times, one per link, heads several groups)."""
    k, n = len(sources), len(receivers)
    sizes = [n // k + (g < n % k) for g in range(k)]
    groups: list[list[str]] = [[] for _ in sources]
    by_rack: dict[str, list[int]] = {}
    for g, source in enumerate(sources):
        if rack(source) is not None:
            by_rack.setdefault(rack(source), []).append(g)
    rest = []
    for rx in receivers:
        g = next((g for g in by_rack.get(rack(rx), ()) if len(groups[g]) < sizes[g]), None)
        (rest if g is None else groups[g]).append(rx)
    it = iter(rest)
    for g, group in enumerate(groups):
        group.extend(next(it) for _ in range(sizes[g] - len(group)))
    return groups


def binomial_pairs(n: int) -> int:
    """The shared slots (pairs of receivers) of a binomial pipeline from one source to ``n`` receivers: 0 for a
    full hypercube (n = 2^d - 1), 1 for n = 2^d, up to about n / 2 between."""
    return n - ((1 << ((n + 1).bit_length() - 1)) - 1)


def _binomial_group(source: str, receivers: list[str], order: Sequence[Unit], rack: Rack,
                    out: dict[str, list[Fetch[str]]]) -> None:
    """Binomial pipeline of ``source`` to ``receivers``, units (each its pieces (block, chunks), fetched one
    after another from the unit's parent) entering in ``order``; writes into ``out``.

    With n = 2^d - 1 receivers they and the source (slot 0) are the slots of a d-cube. The unit
    entering at position i starts on dimension j = i mod d: the source sends it to slot 2^j in round i;
    in round i+s (0 < s < d) every slot with bit j set and no bit outside j..j+s-1 sends it across
    dimension j+s; in round i+d the slots with bit j set send it across dimension j. Every edge used in
    round t lies on dimension t mod d and, for distinct units, the senders of a round are disjoint, so
    each node sends and receives at most one unit per round: k units take k + d rounds, the source
    sends each unit once, and a receiver sends exactly d units per d consecutive ones (one model).
    Other counts take d = floor(log2(n + 1)) and let the n - (2^d - 1) surplus receivers share a slot
    with another receiver (same rack first): one member fetches every unit from the cube and forwards
    it, chunk by chunk, to the other, which makes all the slot's sends. Each still uploads about one
    model and gets one unit per round; the pair costs one more hop (one chunk) of latency.
    """
    n = len(receivers)
    if n == 0:
        return
    dim = (n + 1).bit_length() - 1
    slots = _pair_slots(receivers, n - ((1 << dim) - 1), rack)
    takers = [source] + [first for first, _ in slots]  # the member that fetches from the cube
    senders = [source] + [second or first for first, second in slots]  # the member that sends to the cube
    # A receiver gets at most one unit per round from the cube, or one from its pair partner, so its
    # fetch in round r goes to place r of its timeline: ordering by round without a sort; a place holds as many
    # fetches as a unit has pieces at most (``width``), the unit's j-th piece at r * width + j.
    width = max(map(len, order), default=1)
    places = (len(order) + dim + 1) * width
    timeline: dict[str, list[Fetch[str] | None]] = {rx: [None] * places for rx in receivers}
    # Per dimension: the senders of its units (one Fetch each per unit, shared by their takers), and for each
    # taker its timeline, its sender's index and its round offset; the pairs' partners apart.
    rows = []
    for j in range(dim):
        parents: dict[str, int] = {}
        takes, pairs = [], []
        for x, (parent, step) in enumerate(_hypercube_parents(dim, j), start=1):
            taker, partner = takers[x], slots[x - 1][1]
            takes.append((timeline[taker], parents.setdefault(senders[parent], len(parents)), step * width))
            if partner is not None:
                pairs.append((timeline[partner], taker, step * width))
        rows.append((list(parents), takes, pairs))
    for i, unit in enumerate(order):
        parents, takes, pairs = rows[i % dim]
        for place, (block, chunks) in enumerate(unit, start=i * width):
            made = [Fetch(block, parent, chunks) for parent in parents]
            for places_of, k, step in takes:
                places_of[place + step] = made[k]
            for places_of, taker, step in pairs:
                places_of[place + step] = Fetch(block, taker, chunks)
    for rx, places_of in timeline.items():
        out[rx] = [fetch for fetch in places_of if fetch is not None]


class _Splitter:
    """The units a binomial pipeline fetches, in a given block order, for a group of a given size: whole
    blocks without chunk counts, else runs of consecutive chunks (see :func:`make_plan`)."""

    def __init__(self, chunk_counts: Sequence[int] | None, units: int | None):
        self._counts, self._units = chunk_counts, units
        self._sizes: dict[int, int] = {}  # the unit size by the group's depth d: groups of one depth share

    def __call__(self, blocks: Sequence[int], receivers: int) -> list[Unit]:
        if self._counts is None:
            return [((b, None),) for b in blocks]
        rounds = (receivers + 1).bit_length() - 1  # d
        size = self._sizes.get(rounds)
        if size is None:
            if self._units is None:
                size = unit_chunks(self._counts, rounds)
            else:  # the smallest size with at most that many units (blocks of no chunks are one each at least)
                total = max(1, sum(self._counts))
                size = next((s for s in range(1, total) if _unit_count(self._counts, s) <= self._units), total)
            self._sizes[rounds] = size
        return cut_units([(b, self._counts[b]) for b in blocks], size)


def unit_chunks(chunk_counts: Sequence[int], rounds: int) -> int:
    """The default unit size, in chunks, of a binomial pipeline ``rounds`` (d) deep over blocks of
    ``chunk_counts`` chunks, its units running across block ends (:func:`cut_units`): among the s of at least
    :data:`MIN_UNIT_CHUNKS` (where a block has that many: blocks of one chunk stay units of their own) for which
    k units of s chunks take (k + d) * s <= (1 + :data:`ROUND_OVERHEAD`) x T chunk times, T the chunks in all,
    the one of the fewest fetches (a fetch per block a unit covers: whole blocks, or even shares of them, where
    those meet it), then the least (k + d) * s, then the largest; where none meets it, the s with the least
    (k + d) * s (the largest among equals). Then at most :data:`MAX_FAIR_UNIT_CHUNKS`, where that makes no more
    than :data:`MAX_FAIR_UNITS` units."""
    total = sum(chunk_counts)
    least = max(1, min(MIN_UNIT_CHUNKS, max(chunk_counts, default=0)))
    # (k + d) * s >= T + d * s, so no s above ROUND_OVERHEAD * T / d meets the budget: start there.
    top = max(least, min(total, math.floor(ROUND_OVERHEAD * total / max(1, rounds))))
    # A unit covering a block boundary fetches on both sides of it: one fetch more per boundary not at a unit's end.
    boundaries = list(itertools.accumulate(count for count in chunk_counts if count))[:-1]
    empty = sum(1 for count in chunk_counts if not count)  # each a fetch of its own (whole, of no bytes)
    best: tuple | None = None  # (fetches, time, -s) of the best s within the budget
    quickest: tuple | None = None  # (time, -s) of the quickest s, for when none is within it
    for size in range(top, least - 1, -1):
        units = -(-total // size)  # of chunks; those of no chunks (``empty``) take no round time
        time = (units + rounds) * size
        if time <= (1 + ROUND_OVERHEAD) * total:
            if best is not None and units + empty > best[0]:
                break  # smaller units are more units, so more fetches, than the best has in all
            fetches = units + empty + sum(1 for boundary in boundaries if boundary % size)
            best = min(best or (fetches, time, -size), (fetches, time, -size))
        elif best is None:
            quickest = min(quickest or (time, -size), (time, -size))
    size = -best[2] if best is not None else -quickest[1] if quickest is not None else least
    fair = max(least, min(size, MAX_FAIR_UNIT_CHUNKS))
    return fair if _unit_count(chunk_counts, fair) <= MAX_FAIR_UNITS else size


def cut_units(blocks: Sequence[tuple[int, int]], unit_chunks: int) -> list[Unit]:
    """The chunks of ``blocks`` ((block, chunk count), in fetch order) in runs of ``unit_chunks`` chunks, the
    last run shorter: each run its pieces (block, [first, end) or None where the run holds the whole block),
    going on into the next block where a block ends inside it; a block of no chunks (a manifest that gives its
    blocks no chunks) is a unit of its own, whole, where it comes: the run under way goes on past it."""
    units: list[Unit] = []
    unit: list[Piece] = []
    room = unit_chunks
    for block, count in blocks:
        if count == 0:
            units.append(((block, None),))
        first = 0
        while first < count:
            end = min(count, first + room)
            unit.append((block, None if (first, end) == (0, count) else (first, end)))
            room -= end - first
            first = end
            if room == 0:
                units.append(tuple(unit))
                unit, room = [], unit_chunks
    if unit:
        units.append(tuple(unit))
    return units


def _unit_count(chunk_counts: Sequence[int], unit_chunks: int) -> int:
    return max(1, -(-sum(chunk_counts) // unit_chunks) + sum(1 for count in chunk_counts if not count))


def _hypercube_parents(dim: int, j: int) -> list[tuple[int, int]]:
    """(parent slot, round offset) of slots 1..2^dim-1 for a block starting on dimension ``j``."""
    mask = (1 << dim) - 1
    rows = []
    for x in range(1, 1 << dim):
        if x >> j & 1:
            relative = ((x >> j) | (x << (dim - j))) & mask  # rotated so that bit j is bit 0
            top = relative.bit_length() - 1
            rows.append((x ^ (1 << ((j + top) % dim)), top) if top else (0, 0))
        else:
            rows.append((x ^ (1 << j), dim))
    return rows


def _pair_slots(receivers: list[str], pairs: int, rack: Rack) -> list[tuple[str, str | None]]:
    """``len(receivers) - pairs`` slots (slot x of the cube is item x - 1): ``pairs`` of them shared by two
    receivers, neighbours in a rack first, the others in receiver order. Without racks the shared slots are
    those whose numbers have the fewest bits set (then the lowest): a shared slot's sends are a chunk late, and in
    slots of many bits they held up the units' later rounds (0.2 ms a hop, the demo model: 1.64-1.78x S/B from 8
    to 53 pairs among 127 slots, placed first; 1.10-1.11x placed so). With racks the slots keep receiver
    (rack) order, so that the cube's low dimensions stay within a rack: scattered so, more chunks crossed
    racks (4 racks at 4:1: 2.39x S/B at N = 150 against 2.20x)."""
    groups = _pair_groups(receivers, pairs, rack)
    if any(rack(rx) is not None for rx in receivers):
        return groups
    shared = iter([group for group in groups if group[1] is not None])
    alone = iter([group for group in groups if group[1] is None])
    count = len(groups)
    first = set(sorted(range(count), key=lambda x: ((x + 1).bit_count(), x))[:pairs])
    return [next(shared) if x in first else next(alone) for x in range(count)]


def _pair_groups(receivers: list[str], pairs: int, rack: Rack) -> list[tuple[str, str | None]]:
    """``receivers`` in order, in ``len(receivers) - pairs`` groups: ``pairs`` of them two receivers,
    neighbours in a rack first."""
    slots: list[tuple[str, str | None]] = []
    made, i = 0, 0
    while i < len(receivers):
        if made < pairs and i + 1 < len(receivers) and rack(receivers[i]) == rack(receivers[i + 1]):
            slots.append((receivers[i], receivers[i + 1]))
            made, i = made + 1, i + 2
        else:
            slots.append((receivers[i], None))
            i += 1
    singles = [k for k, (_, other) in enumerate(slots) if other is None]
    while made < pairs:  # not enough same-rack neighbours: pair the last singles across racks
        b, a = singles.pop(), singles.pop()
        slots[a] = (slots[a][0], slots[b][0])
        del slots[b]
        made += 1
    return slots
