"""Multicast schedules: which node sends each block to each receiver, and in which order receivers fetch.

Pure functions from cluster state to a :class:`Plan`; no sockets, no I/O. The control plane hands a plan
to the agents, the benchmarks and the large-scale simulator reuse it (:mod:`control_plane.planner.simulate`),
and :func:`control_plane.planner.replan.replan` repairs one after failures and joins.

Every strategy gives each (receiver, block) fetch a round such that a parent's round for a block comes
before its child's, and orders each receiver's fetches by round. So a receiver that fetches its list
strictly in order, forwarding chunk by chunk, never waits on a fetch that waits on it: no plan built
here can deadlock, and :meth:`Plan.validate` checks exactly that for plans that come from elsewhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pipecast.core.errors import PipecastError

STRATEGIES = ("unicast", "chain", "tree", "binomial", "rotated")
RACK_LABEL = "rack"

Rack = Callable[[str], "str | None"]


class PlanError(PipecastError):
    """A malformed plan or plan request; the message says which input (whose) and what is wrong."""


@dataclass(frozen=True, slots=True)
class Assignment:
    """One fetch: the receiver gets ``block`` (0-based index) from node ``parent``."""

    block: int
    parent: str


@dataclass
class Plan:
    """A multicast schedule.

    ``sources`` hold the whole package. ``assignments`` maps each receiver to its fetches, in the order it
    fetches them. ``held`` names non-source nodes that serve blocks they already hold (only replanned
    plans have any); it is part of the JSON only when not empty. Treat a plan as a value: build a new one
    instead of mutating it, because :meth:`children` caches an index.
    """

    strategy: str
    sources: tuple[str, ...]
    assignments: dict[str, list[Assignment]]
    held: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _children: dict[tuple[str, int], list[str]] | None = field(default=None, init=False, repr=False, compare=False)

    def children(self, node: str, block: int) -> list[str]:
        """The receivers that fetch ``block`` from ``node``, in the order of :attr:`assignments`."""
        if self._children is None:
            index: dict[tuple[str, int], list[str]] = {}
            for receiver, fetches in self.assignments.items():
                for a in fetches:
                    index.setdefault((a.parent, a.block), []).append(receiver)
            self._children = index
        return list(self._children.get((node, block), ()))

    def to_json(self) -> dict:
        """The plan as JSON-able data: ``{"strategy", "sources", "assignments": {rx: [[block, parent], ..]}}``."""
        data: dict = {"strategy": self.strategy, "sources": list(self.sources),
                      "assignments": {rx: [[a.block, a.parent] for a in fetches]
                                      for rx, fetches in self.assignments.items()}}
        if self.held:
            data["held"] = {node: list(blocks) for node, blocks in self.held.items()}
        return data

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        """Parse and :meth:`validate` what :meth:`to_json` wrote; raise :class:`PlanError` saying what is wrong."""
        if not isinstance(data, dict):
            raise PlanError(f"malformed plan: expected a JSON object, got {type(data).__name__}")
        missing = {"strategy", "sources", "assignments"} - data.keys()
        unknown = data.keys() - {"strategy", "sources", "assignments", "held"}
        if missing:
            raise PlanError(f"malformed plan: missing key(s) {', '.join(sorted(missing))}")
        if unknown:
            raise PlanError(f"malformed plan: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
        strategy, sources, assignments = data["strategy"], data["sources"], data["assignments"]
        held = data.get("held", {})
        if not isinstance(strategy, str):
            raise PlanError(f"malformed plan: 'strategy' must be a string, got {type(strategy).__name__}")
        if not isinstance(sources, list | tuple) or not all(isinstance(s, str) for s in sources):
            raise PlanError("malformed plan: 'sources' must be a list of node ids")
        if not isinstance(assignments, dict):
            raise PlanError(f"malformed plan: 'assignments' must be an object mapping receiver ids to fetch "
                            f"lists, got {type(assignments).__name__}")
        if not isinstance(held, dict):
            raise PlanError(f"malformed plan: 'held' must be an object mapping node ids to block lists, "
                            f"got {type(held).__name__}")
        parsed: dict[str, list[Assignment]] = {}
        for receiver, fetches in assignments.items():
            if not isinstance(fetches, list | tuple):
                raise PlanError(f"malformed plan: fetches of {receiver!r} must be a list, got {type(fetches).__name__}")
            out = []
            for k, pair in enumerate(fetches):
                if not (isinstance(pair, list | tuple) and len(pair) == 2 and _is_index(pair[0])
                        and isinstance(pair[1], str)):
                    raise PlanError(f"malformed plan: fetch {k} of {receiver!r} must be [block, parent] with a "
                                    f"block index >= 0 and a parent id, got {pair!r}")
                out.append(Assignment(pair[0], pair[1]))
            parsed[receiver] = out
        parsed_held: dict[str, tuple[int, ...]] = {}
        for node, blocks in held.items():
            if not isinstance(blocks, list | tuple) or not all(_is_index(b) for b in blocks):
                raise PlanError(f"malformed plan: held blocks of {node!r} must be a list of block indexes >= 0")
            parsed_held[node] = tuple(blocks)
        plan = cls(strategy, tuple(sources), parsed, parsed_held)
        plan.validate()
        return plan

    def validate(self) -> None:
        """Raise :class:`PlanError` unless the plan is executable.

        Checked: a known strategy; distinct, non-empty node ids; no receiver that is a source; no block
        fetched twice by one receiver or both held and fetched; no receiver its own parent; every parent
        a source, a node that holds the block, or a receiver that fetches it; and no cycle through parent
        links and fetch orders (per block or across blocks), so fetching in order cannot deadlock.
        """
        if self.strategy not in STRATEGIES:
            raise PlanError(f"malformed plan: unknown strategy {self.strategy!r} (expected one of "
                            f"{', '.join(STRATEGIES)})")
        _check_ids("malformed plan", self.sources, "source")
        if not self.sources:
            raise PlanError("malformed plan: no sources")
        sources = set(self.sources)
        for node, kept in self.held.items():
            _check_ids("malformed plan", (node,), "holder")
            if node in sources:
                raise PlanError(f"malformed plan: source {node!r} is also listed as a holder")
            if not all(_is_index(b) for b in kept) or len(set(kept)) != len(kept):
                raise PlanError(f"malformed plan: holder {node!r} must list distinct block indexes >= 0")
        fetched: dict[str, set[int]] = {}
        for receiver, fetches in self.assignments.items():
            _check_ids("malformed plan", (receiver,), "receiver")
            if receiver in sources:
                raise PlanError(f"malformed plan: source {receiver!r} is also a receiver")
            blocks: set[int] = set()
            for a in fetches:
                if not _is_index(a.block) or not isinstance(a.parent, str) or not a.parent:
                    raise PlanError(f"malformed plan: {receiver!r} has a fetch {a!r} without a block index >= 0 "
                                    "and a parent id")
                if a.parent == receiver:
                    raise PlanError(f"malformed plan: {receiver!r} fetches block {a.block} from itself")
                if a.block in blocks:
                    raise PlanError(f"malformed plan: {receiver!r} fetches block {a.block} twice")
                blocks.add(a.block)
            both = blocks.intersection(self.held.get(receiver, ()))
            if both:
                raise PlanError(f"malformed plan: {receiver!r} fetches block {min(both)} that it holds")
            fetched[receiver] = blocks
        for receiver, fetches in self.assignments.items():
            for a in fetches:
                if a.parent not in sources and a.block not in fetched.get(a.parent, ()) \
                        and a.block not in self.held.get(a.parent, ()):
                    raise PlanError(f"malformed plan: {receiver!r} fetches block {a.block} from {a.parent!r}, "
                                    "which is no source, does not hold it and does not fetch it")
        self.fetch_levels()

    def fetch_levels(self) -> dict[str, list[int]]:
        """The earliest step of each fetch (aligned with :attr:`assignments`) if every fetch took one step.

        A fetch waits for the receiver's previous fetch and, when the parent itself fetches the block,
        for the parent's fetch. Raises :class:`PlanError` when these waits form a cycle (the plan would
        deadlock), naming a receiver that is its own ancestor for a block where there is one.
        """
        # Fetches numbered flat, receiver after receiver: fetch f's successor in its list is f + 1.
        first: dict[str, int] = {}
        position: dict[str, dict[int, int]] = {}
        total = 0
        for rx, fetches in self.assignments.items():
            first[rx] = total
            position[rx] = {a.block: total + k for k, a in enumerate(fetches)}
            total += len(fetches)
        last = bytearray(total)
        waiting = [1] * total
        dependents: dict[int, list[int]] = {}
        for rx, fetches in self.assignments.items():
            if fetches:
                waiting[first[rx]] = 0
                last[first[rx] + len(fetches) - 1] = 1
            for f, a in enumerate(fetches, start=first[rx]):
                parent_f = position.get(a.parent, {}).get(a.block)
                if parent_f is not None:
                    dependents.setdefault(parent_f, []).append(f)
                    waiting[f] += 1
        level = [0] * total
        ready = [f for f in first.values() if f < total and waiting[f] == 0]
        done = 0
        while ready:
            f = ready.pop()
            done += 1
            step = level[f] + 1
            nexts = dependents.get(f, [])
            for g in (nexts if last[f] else [*nexts, f + 1]):
                if level[g] < step:
                    level[g] = step
                waiting[g] -= 1
                if waiting[g] == 0:
                    ready.append(g)
        if done < total:
            stuck = sorted(rx for rx, f in first.items() if any(waiting[f:f + len(self.assignments[rx])]))
            raise PlanError(self._describe_cycle(stuck))
        return {rx: level[f:f + len(self.assignments[rx])] for rx, f in first.items()}

    def _describe_cycle(self, stuck: list[str]) -> str:
        parents: dict[int, dict[str, str]] = {}
        for rx, fetches in self.assignments.items():
            for a in fetches:
                parents.setdefault(a.block, {})[rx] = a.parent
        for block in sorted({a.block for rx in stuck for a in self.assignments[rx]}):
            of = parents[block]
            cleared: set[str] = set()
            for start in of:
                path: dict[str, int] = {}  # node -> its place on the walk up from start
                node = start
                while node in of and node not in cleared and node not in path:
                    path[node] = len(path)
                    node = of[node]
                if node in path:
                    cycle = list(path)[path[node]:] + [node]
                    return (f"malformed plan: block {block}: {node!r} is its own ancestor "
                            f"({' -> '.join(map(repr, cycle))}, each fetching from the next)")
                cleared.update(path)
        shown = ", ".join(map(repr, stuck[:5])) + (f" and {len(stuck) - 5} more" if len(stuck) > 5 else "")
        return (f"malformed plan: fetch orders and parent links form a cycle, so receivers {shown} would wait "
                "for each other forever")


def make_plan(strategy: str, sources: Sequence[str], receivers: Sequence[str], num_blocks: int, *,
              fanout: int = 2, labels: Mapping[str, Mapping[str, str]] | None = None) -> Plan:
    """Plan how ``receivers`` get blocks ``0..num_blocks-1`` from ``sources`` (nodes holding everything).

    Strategies: ``unicast`` (every block from a source, spread over the sources), ``chain``
    (sources[0] -> r0 -> r1 -> ...), ``tree`` (a ``fanout``-ary tree rooted at sources[0]), ``binomial``
    (binomial pipeline on a hypercube rooted at sources[0]: each block has its own spanning tree, so the
    source sends each block once and every receiver uploads about one model) and ``rotated`` (one group
    of receivers per source, each a binomial pipeline fetching the blocks rotated by g*num_blocks/K, so
    the groups together hold the whole model early). Where ``labels`` give nodes a ``rack``, receivers
    are laid out rack by rack and a parent in the receiver's rack is preferred wherever there is a choice.
    """
    sources, receivers = tuple(sources), tuple(receivers)
    if strategy not in STRATEGIES:
        raise PlanError(f"make_plan: unknown strategy {strategy!r} (expected one of {', '.join(STRATEGIES)})")
    if not _is_index(num_blocks) or num_blocks < 1:
        raise PlanError(f"make_plan: num_blocks must be a positive integer, got {num_blocks!r}")
    if not _is_index(fanout) or fanout < 1:
        raise PlanError(f"make_plan: fanout must be a positive integer, got {fanout!r}")
    if not sources:
        raise PlanError("make_plan: no sources to plan from")
    _check_ids("make_plan", sources, "source")
    _check_ids("make_plan", receivers, "receiver")
    both = set(sources).intersection(receivers)
    if both:
        raise PlanError(f"make_plan: {min(both)!r} is both a source and a receiver")
    rack = rack_of(labels)
    build = {"unicast": _unicast, "chain": _chain, "tree": _tree, "binomial": _binomial,
             "rotated": _rotated}[strategy]
    return Plan(strategy, sources, build(sources, receivers, num_blocks, fanout, rack))


def rack_of(labels: Mapping[str, Mapping[str, str]] | None) -> Rack:
    """A function giving a node's rack label, or None where it has none."""
    labels = labels or {}
    return lambda node: labels.get(node, {}).get(RACK_LABEL)


def rack_order(nodes: Sequence[str], rack: Rack, first: str | None = None) -> list[str]:
    """``nodes`` grouped by rack (rack ``first``, then racks in order of appearance), stable within a rack."""
    groups: dict[str | None, list[str]] = {first: []} if first is not None else {}
    for node in nodes:
        groups.setdefault(rack(node), []).append(node)
    return [node for group in groups.values() for node in group]


class ParentPool:
    """Nodes that can still take children, earliest first, with the receiver's rack preferred.

    Each node enters with a number of spare child slots and a time; :meth:`take` hands out the earliest
    node with a spare slot, from the asking receiver's rack when one there qualifies. Nodes must be added
    in non-decreasing time. Amortised O(1) per call.
    """

    def __init__(self, rack: Rack):
        self._rack = rack
        self._spare: dict[str, int] = {}
        self._all: deque[tuple[int, str]] = deque()
        self._by_rack: dict[str, deque[tuple[int, str]]] = {}

    def add(self, node: str, spare: int, time: int = 0) -> None:
        """Offer ``node`` as a parent for up to ``spare`` more children that come after ``time``."""
        if spare <= 0:
            return
        self._spare[node] = spare
        entry = (time, node)
        self._all.append(entry)
        rack = self._rack(node)
        if rack is not None:
            self._by_rack.setdefault(rack, deque()).append(entry)

    def take(self, rack: str | None, before: int | None = None) -> str | None:
        """Use up one slot of the earliest qualifying node (time < ``before``), preferring ``rack``."""
        for queue in (self._by_rack.get(rack) if rack is not None else None, self._all):
            while queue and self._spare[queue[0][1]] == 0:
                queue.popleft()
            if queue and (before is None or queue[0][0] < before):
                node = queue[0][1]
                self._spare[node] -= 1
                return node
        return None


def _unicast(sources, receivers, num_blocks, fanout, rack) -> dict[str, list[Assignment]]:
    # One source per receiver, the least loaded candidate (round robin without racks). Splitting a
    # receiver's blocks over several sources would idle a source whenever its receivers all fetch
    # from another one, since a receiver fetches one block at a time.
    table = {s: [Assignment(b, s) for b in range(num_blocks)] for s in sources}
    load = dict.fromkeys(sources, 0)
    out = {}
    for rx in receivers:
        mine = rack(rx)
        source = min([s for s in sources if mine is not None and rack(s) == mine] or sources, key=load.get)
        load[source] += 1
        out[rx] = list(table[source])
    return out


def _chain(sources, receivers, num_blocks, fanout, rack) -> dict[str, list[Assignment]]:
    parent, out = sources[0], {}
    for rx in rack_order(receivers, rack, rack(sources[0])):
        out[rx] = [Assignment(b, parent) for b in range(num_blocks)]
        parent = rx
    return out


def _tree(sources, receivers, num_blocks, fanout, rack) -> dict[str, list[Assignment]]:
    # Breadth-first: each receiver takes the shallowest node with a spare slot, in its rack if possible.
    pool = ParentPool(rack)
    pool.add(sources[0], fanout)
    out = {}
    for rx in rack_order(receivers, rack, rack(sources[0])):
        parent = pool.take(rack(rx))
        out[rx] = [Assignment(b, parent) for b in range(num_blocks)]
        pool.add(rx, fanout)
    return out


def _binomial(sources, receivers, num_blocks, fanout, rack) -> dict[str, list[Assignment]]:
    out: dict[str, list[Assignment]] = {}
    _binomial_group(sources[0], rack_order(receivers, rack, rack(sources[0])), range(num_blocks), rack, out)
    return out


def _rotated(sources, receivers, num_blocks, fanout, rack) -> dict[str, list[Assignment]]:
    k = max(1, min(len(sources), len(receivers)))  # groups that get receivers: the first k ones
    out: dict[str, list[Assignment]] = {}
    for g, (source, group) in enumerate(zip(sources, _split_groups(sources, receivers, rack))):
        start = g * num_blocks // k
        order = [(start + i) % num_blocks for i in range(num_blocks)]
        _binomial_group(source, rack_order(group, rack, rack(source)), order, rack, out)
    return {rx: out[rx] for rx in receivers}


def _split_groups(sources, receivers, rack) -> list[list[str]]:
    """Receivers in len(sources) groups of near-equal size, each filled first from its source's rack."""
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
                    out: dict[str, list[Assignment]]) -> None:
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
    timeline: dict[str, list[Assignment | None]] = {rx: [None] * places for rx in receivers}
    rows = [[(takers[x], senders[parent], step, slots[x - 1][1])
             for x, (parent, step) in enumerate(_hypercube_parents(dim, j), start=1)] for j in range(dim)]
    for i, block in enumerate(order):
        made: dict[str, Assignment] = {}
        for taker, parent, step, partner in rows[i % dim]:
            fetch = made.get(parent)
            if fetch is None:
                fetch = made[parent] = Assignment(block, parent)
            timeline[taker][i + step] = fetch
            if partner is not None:
                timeline[partner][i + step] = Assignment(block, taker)
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


def _check_ids(where: str, nodes: Sequence[str], kind: str) -> None:
    seen: set[str] = set()
    for node in nodes:
        if not isinstance(node, str) or not node:
            raise PlanError(f"{where}: {kind} id must be a non-empty string, got {node!r}")
        if node in seen:
            raise PlanError(f"{where}: {kind} {node!r} is listed twice")
        seen.add(node)


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def __getattr__(name: str):
    # replan lives in its own module (it imports this one); re-exported lazily to avoid an import cycle.
    if name == "replan":
        from control_plane.planner.replan import replan
        return replan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
