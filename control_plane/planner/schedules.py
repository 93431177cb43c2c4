"""Multicast schedules: which node sends each block to each receiver, and in which order receivers fetch.

Pure functions from cluster state to a :class:`~control_plane.planner.plan.Plan`; no sockets, no I/O. The
control plane hands a plan to the agents, the benchmarks and the large-scale simulator reuse it
(:mod:`control_plane.planner.simulate`), and :func:`control_plane.planner.replan.replan` repairs one after
failures and joins.

Every strategy gives each (receiver, block) fetch a round such that a parent's round for a block comes
before its child's, and orders each receiver's fetches by round. So a receiver that fetches its list
strictly in order, forwarding chunk by chunk, never waits on a fetch that waits on it: no plan built
here can deadlock, and :meth:`~control_plane.planner.plan.Plan.validate` checks exactly that for plans
that come from elsewhere.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from control_plane.planner.plan import STRATEGIES, Fetch, Plan, PlanError, check_ids, is_index
from control_plane.planner.racks import ParentPool, Rack, rack_of, rack_order

#: Rotated groups up to this size are chains: with chunk cut-through a chain runs every link at full rate
#: and each member receives the group's order front to back (measured, N = 8 at 400 Mbit/s: chain 1.07x
#: S/B, binomial 1.71x, whose rounds move whole blocks, a big one gating each round). Larger groups are
#: binomial pipelines, whose latency grows with log N instead of N.
GROUP_CHAIN_MAX = 8


def make_plan(strategy: str, sources: Sequence[str], receivers: Sequence[str], num_blocks: int, *,
              fanout: int = 2, labels: Mapping[str, Mapping[str, str]] | None = None,
              block_bytes: Sequence[int] | None = None, source_links: Mapping[str, int] | None = None) -> Plan:
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
    for source, links in (source_links or {}).items():
        if source not in sources:
            raise PlanError(f"make_plan: source_links names {source!r}, which is no source")
        if not is_index(links) or links < 1:
            raise PlanError(f"make_plan: links of source {source!r} must be a positive integer, got {links!r}")
    rack = rack_of(labels)
    if strategy == "rotated":
        slots = [s for s in sources for _ in range((source_links or {}).get(s, 1))]
        return Plan(strategy, sources, _rotated(slots, receivers, num_blocks, rack, block_bytes))
    build = {"unicast": _unicast, "chain": _chain, "tree": _tree, "binomial": _binomial}[strategy]
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


def _binomial(sources, receivers, num_blocks, fanout, rack) -> dict[str, list[Fetch[str]]]:
    out: dict[str, list[Fetch[str]]] = {}
    _binomial_group(sources[0], rack_order(receivers, rack, rack(sources[0])), range(num_blocks), rack, out)
    return out


def _rotated(slots, receivers, num_blocks, rack, block_bytes) -> dict[str, list[Fetch[str]]]:
    k = max(1, min(len(slots), len(receivers)))  # groups that get receivers: the first k ones
    out: dict[str, list[Fetch[str]]] = {}
    starts = _rotation_starts(k, num_blocks, block_bytes)
    for source, group, start in zip(slots, _split_groups(slots, receivers, rack), starts):
        order = [(start + i) % num_blocks for i in range(num_blocks)]
        group = rack_order(group, rack, rack(source))
        if len(group) <= GROUP_CHAIN_MAX:
            parent = source
            for rx in group:  # every member then receives the group's order front to back, at the link rate
                out[rx] = [Fetch(b, parent) for b in order]
                parent = rx
        else:
            _binomial_group(source, group, order, rack, out)
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


def _binomial_group(source: str, receivers: list[str], order: Sequence[int], rack: Rack,
                    out: dict[str, list[Fetch[str]]]) -> None:
    """Binomial pipeline of ``source`` to ``receivers``, blocks entering in ``order``; writes into ``out``.

    With n = 2^d - 1 receivers they and the source (slot 0) are the slots of a d-cube. The block
    entering at position i starts on dimension j = i mod d: the source sends it to slot 2^j in round i;
    in round i+s (0 < s < d) every slot with bit j set and no bit outside j..j+s-1 sends it across
    dimension j+s; in round i+d the slots with bit j set send it across dimension j. Every edge used in
    round t lies on dimension t mod d and, for distinct blocks, the senders of a round are disjoint, so
    each node sends and receives at most one block per round: k blocks take k + d rounds, the source
    sends each block once, and a receiver sends exactly d blocks per d consecutive ones (one model).
    Other counts take d = floor(log2(n + 1)) and let the n - (2^d - 1) surplus receivers share a slot
    with another receiver (same rack first): one member fetches every block from the cube and forwards
    it, chunk by chunk, to the other, which makes all the slot's sends. Each still uploads about one
    model and gets one block per round; the pair costs one more hop (one chunk) of latency.
    """
    n = len(receivers)
    if n == 0:
        return
    dim = (n + 1).bit_length() - 1
    slots = _pair_slots(receivers, n - ((1 << dim) - 1), rack)
    takers = [source] + [first for first, _ in slots]  # the member that fetches from the cube
    senders = [source] + [second or first for first, second in slots]  # the member that sends to the cube
    # A receiver gets at most one block per round from the cube, or one from its pair partner, so its
    # fetch in round r goes to place r of its timeline: ordering by round without a sort.
    places = len(order) + dim + 1
    timeline: dict[str, list[Fetch[str] | None]] = {rx: [None] * places for rx in receivers}
    rows = [[(takers[x], senders[parent], step, slots[x - 1][1])
             for x, (parent, step) in enumerate(_hypercube_parents(dim, j), start=1)] for j in range(dim)]
    for i, block in enumerate(order):
        made: dict[str, Fetch[str]] = {}
        for taker, parent, step, partner in rows[i % dim]:
            fetch = made.get(parent)
            if fetch is None:
                fetch = made[parent] = Fetch(block, parent)
            timeline[taker][i + step] = fetch
            if partner is not None:
                timeline[partner][i + step] = Fetch(block, taker)
    for rx, places_of in timeline.items():
        out[rx] = [fetch for fetch in places_of if fetch is not None]


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
    """``len(receivers) - pairs`` slots: ``pairs`` of them shared by two receivers, neighbours in a rack first."""
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
