"""A multicast plan as a value: who fetches which block, or chunk range of a block, from whom, in which
order, and its checks.

The planners (:mod:`control_plane.planner.schedules`, :mod:`control_plane.planner.replan`) build plans,
the control plane splits them into each node's :class:`Part`, and static plan files carry their JSON.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pipecast.core.errors import PipecastError

STRATEGIES = ("unicast", "chain", "tree", "binomial", "rotated")

Node = TypeVar("Node")
Value = TypeVar("Value")
Chunks = tuple[int, int] | None  # a chunk range [first, end) of a block; None: the whole block


class PlanError(PipecastError):
    """A malformed plan or plan request; the message says which input (whose) and what is wrong."""


@dataclass(frozen=True, slots=True)
class Fetch(Generic[Node]):
    """One fetch: the receiver gets ``block`` (0-based index), or its chunks ``chunks = (first, end)``
    (``first`` .. ``end - 1``), from ``parent``.

    The parent is a node id in plans (``Fetch[str]``) and, in the parts the control plane sends to a
    worker, the node with its address (``Fetch[PeerInfo]``, see :mod:`control_plane.messages`). A plan
    unit smaller than a block lets a schedule keep every uplink busy at any N (a binomial pipeline of k
    units takes (k + d)/k x S/B); ``None`` is the whole block.
    """

    block: int
    parent: Node
    chunks: tuple[int, int] | None = None


@dataclass(frozen=True)
class Part:
    """One node's part in a plan: what it fetches (in order, each from its parent) and whom it serves."""

    fetch: tuple[Fetch[str], ...]
    serve: tuple[tuple[int, str], ...]  # (block, child), once per pair; each child fetches in its own order


@dataclass
class Plan:
    """A multicast schedule.

    ``sources`` hold the whole package. ``assignments`` maps each receiver to its fetches (of whole blocks,
    or of chunk ranges of blocks: units), in the order it fetches them. ``held`` names non-source nodes that
    serve blocks they already hold (only replanned plans have any); it is part of the JSON only when not
    empty. Treat a plan as a value: build a new one instead of mutating it, because :meth:`children` caches
    an index.
    """

    strategy: str
    sources: tuple[str, ...]
    assignments: dict[str, list[Fetch[str]]]
    held: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _children: dict[tuple[str, int], list[str]] | None = field(default=None, init=False, repr=False, compare=False)
    _encoded: str | None = field(default=None, init=False, repr=False, compare=False)
    _parts: dict[str, Part] | None = field(default=None, init=False, repr=False, compare=False)
    _depths: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False)

    def children(self, node: str, block: int) -> list[str]:
        """The receivers that fetch ``block``, or chunk ranges of it, from ``node``, each once, in the order
        of :attr:`assignments`."""
        if self._children is None:
            index: dict[tuple[str, int], list[str]] = {}
            for receiver, fetches in self.assignments.items():
                for a in fetches:
                    children = index.setdefault((a.parent, a.block), [])
                    # Receivers are indexed one after another: one listed already for this pair is the last.
                    if not children or children[-1] != receiver:
                        children.append(receiver)
            self._children = index
        return list(self._children.get((node, block), ()))

    def parts(self) -> dict[str, Part]:
        """Every node's part: receivers fetch; parents (sources, receivers, holders) serve; every source has
        a part, children or not (it is every receiver's fallback, so it must hear of the plan). Made once (a
        few hundred ms for thousands of receivers in units: the control plane has them made off its event
        loop); each call returns a new dict of them."""
        if self._parts is None:
            self._parts = self._make_parts()
        return dict(self._parts)

    def _make_parts(self) -> dict[str, Part]:
        serving: dict[str, list[tuple[int, str]]] = {}
        for receiver, fetches in self.assignments.items():
            add_serving(serving, receiver, fetches)
        parts = {receiver: Part(tuple(fetches), ()) for receiver, fetches in self.assignments.items()}
        for node, children in serving.items():
            own = parts.get(node)
            parts[node] = Part(own.fetch if own is not None else (), tuple(children))
        for source in self.sources:
            parts.setdefault(source, Part((), ()))
        return parts

    def hops(self) -> int:
        """The most receivers in a row that each take their first fetch from the one before (a chain's length; 1
        where each fetches first from a source or a holder, 0 without receivers): the relays a chunk's first piece
        passes through. Made once, in linear time."""
        return max(self._depth_index().values(), default=0)

    def depth(self, node: str) -> int:
        """Where ``node`` is in such a row: 1 for a receiver fetching first from a source or a holder, 0 for a
        node that receives nothing in this plan."""
        return self._depth_index().get(node, 0)

    def _depth_index(self) -> dict[str, int]:
        if self._depths is None:
            first = {rx: fetches[0].parent for rx, fetches in self.assignments.items() if fetches}
            depth: dict[str, int] = {}
            for receiver in first:
                path: list[str] = []
                on_path: set[str] = set()
                node = receiver
                while node in first and node not in depth and node not in on_path:
                    path.append(node)
                    on_path.add(node)
                    node = first[node]
                below = depth.get(node, 0)  # a source's or holder's 0; a cycle (an invalid plan) starts at 0 too
                for node in reversed(path):
                    below = depth[node] = below + 1
            self._depths = depth
        return self._depths

    def to_json(self) -> dict:
        """The plan as JSON-able data: ``{"strategy", "sources", "assignments": {rx: [fetch, ..]}}``, a fetch
        ``[block, parent]`` for a whole block, ``[block, parent, first, end]`` for its chunks first..end-1."""
        data: dict = {"strategy": self.strategy, "sources": list(self.sources),
                      "assignments": {rx: [[a.block, a.parent] if a.chunks is None else [a.block, a.parent, *a.chunks]
                                           for a in fetches]
                                      for rx, fetches in self.assignments.items()}}
        if self.held:
            data["held"] = {node: list(blocks) for node, blocks in self.held.items()}
        return data

    def encoded(self) -> str:
        """:meth:`to_json` as compact JSON text, made once (a 5,000-worker plan takes ~0.3 s in whole blocks, ~1 s
        in 132 units a worker: the control plane has it made off its event loop, before the flush that stores
        it). Encoded a receiver at a time: one ``json.dumps`` call holds the GIL throughout, and one of the
        whole plan would stall the event loop's thread as long (~60 ms at 1,000 receivers in units)."""
        if self._encoded is None:
            data = self.to_json()
            assignments = ",".join(f"{_dumps(rx)}:{_dumps(fetches)}" for rx, fetches in data["assignments"].items())
            held = f',"held":{_dumps(data["held"])}' if "held" in data else ""
            self._encoded = (f'{{"strategy":{_dumps(data["strategy"])},"sources":{_dumps(data["sources"])},'
                             f'"assignments":{{{assignments}}}{held}}}')
        return self._encoded

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
        parsed: dict[str, list[Fetch[str]]] = {}
        made: dict[tuple, Fetch[str]] = {}  # a parent's fetch of a unit recurs in each of its children's lists
        for receiver, fetches in assignments.items():
            if not isinstance(fetches, list | tuple):
                raise PlanError(f"malformed plan: fetches of {receiver!r} must be a list, got {type(fetches).__name__}")
            out = []
            for k, entry in enumerate(fetches):
                # Exact types: what JSON gives (a bool is no index), and checked fast at 100,000s of fetches.
                size = len(entry) if type(entry) in (list, tuple) else 0
                if not (size in (2, 4) and type(entry[0]) is int and entry[0] >= 0 and type(entry[1]) is str):
                    raise PlanError(f"malformed plan: fetch {k} of {receiver!r} must be [block, parent] or [block, "
                                    f"parent, first, end] with a block index >= 0 and a parent id, got {entry!r}")
                if size == 4 and not (type(entry[2]) is int and type(entry[3]) is int and 0 <= entry[2] < entry[3]):
                    raise PlanError(f"malformed plan: fetch {k} of {receiver!r} must give its chunks as first, "
                                    f"end with integers 0 <= first < end, got {entry!r}")
                key = tuple(entry)
                fetch = made.get(key)
                if fetch is None:
                    fetch = made[key] = Fetch(entry[0], entry[1], (entry[2], entry[3]) if size == 4 else None)
                out.append(fetch)
            parsed[receiver] = out
        parsed_held: dict[str, tuple[int, ...]] = {}
        for node, blocks in held.items():
            if not isinstance(blocks, list | tuple) or not all(is_index(b) for b in blocks):
                raise PlanError(f"malformed plan: held blocks of {node!r} must be a list of block indexes >= 0")
            parsed_held[node] = tuple(blocks)
        plan = cls(strategy, tuple(sources), parsed, parsed_held)
        plan.validate()
        return plan

    def validate(self) -> None:
        """Raise :class:`PlanError` unless the plan is executable.

        Checked: a known strategy; distinct, non-empty node ids; no receiver that is a source; chunk
        ranges with 0 <= first < end; no two fetches of one receiver that overlap (the same block twice, a
        whole block and a range of it, or two ranges sharing a chunk) and no block both held and fetched;
        no receiver its own parent; every parent a source, a node that holds the block, or a receiver that
        fetches the unit or one containing it (the whole block contains every range); and no cycle through
        parent links and fetch orders (per unit or across units), so fetching in order cannot deadlock.
        Not checked: that a range ends within its block, since a plan does not know the blocks' chunk
        counts (an agent refuses a fetch past a block's end).
        """
        if self.strategy not in STRATEGIES:
            raise PlanError(f"malformed plan: unknown strategy {self.strategy!r} (expected one of "
                            f"{', '.join(STRATEGIES)})")
        check_ids("malformed plan", self.sources, "source")
        if not self.sources:
            raise PlanError("malformed plan: no sources")
        sources = set(self.sources)
        for node, kept in self.held.items():
            check_ids("malformed plan", (node,), "holder")
            if node in sources:
                raise PlanError(f"malformed plan: source {node!r} is also listed as a holder")
            if not all(is_index(b) for b in kept) or len(set(kept)) != len(kept):
                raise PlanError(f"malformed plan: holder {node!r} must list distinct block indexes >= 0")
        for receiver, fetches in self.assignments.items():
            check_ids("malformed plan", (receiver,), "receiver")
            if receiver in sources:
                raise PlanError(f"malformed plan: source {receiver!r} is also a receiver")
            of_block: dict[int, list[Fetch[str]]] = {}
            for a in fetches:
                # Exact types (a bool is no index), checked fast: a plan has up to 100,000s of fetches.
                if type(a.block) is not int or a.block < 0 or type(a.parent) is not str or not a.parent:
                    raise PlanError(f"malformed plan: {receiver!r} has a fetch {a!r} without a block index >= 0 "
                                    "and a parent id")
                chunks = a.chunks
                if chunks is not None and not (type(chunks) is tuple and len(chunks) == 2 and type(chunks[0]) is int
                                               and type(chunks[1]) is int and 0 <= chunks[0] < chunks[1]):
                    raise PlanError(f"malformed plan: {receiver!r} has a fetch {a!r} whose chunks are not a range "
                                    "(first, end) of integers with 0 <= first < end")
                if a.parent == receiver:
                    raise PlanError(f"malformed plan: {receiver!r} fetches {unit_name(a.block, a.chunks)} from "
                                    "itself")
                earlier = of_block.get(a.block)
                if earlier is None:
                    of_block[a.block] = [a]
                    continue
                if a.chunks is None or earlier[0].chunks is None:  # a whole block overlaps everything of it
                    _overlap(receiver, earlier[0], a)
                earlier.append(a)
            for ranged in of_block.values():
                if len(ranged) > 1:
                    _check_disjoint(receiver, ranged)
            both = of_block.keys() & set(self.held.get(receiver, ()))
            if both:
                raise PlanError(f"malformed plan: {receiver!r} fetches block {min(both)} that it holds")
        self._levels(check_parents=True)

    def fetch_levels(self) -> dict[str, list[int]]:
        """The earliest step of each fetch (aligned with :attr:`assignments`) if every fetch took one step.

        A fetch waits for the receiver's previous fetch and, when the parent itself fetches the unit (or
        one containing it), for that fetch of the parent's. Raises :class:`PlanError` when these waits form
        a cycle (the plan would deadlock), naming a receiver that is its own ancestor for a unit where
        there is one. Linear in the fetches, for plans whose receivers split a block as their parents do
        (a parent's other ranges of the block are searched otherwise).
        """
        return self._levels(check_parents=False)

    def _levels(self, check_parents: bool) -> dict[str, list[int]]:
        # Fetches numbered flat, receiver after receiver: fetch f's successor in its list is f + 1. Each
        # waits for at most two others (its predecessor and its parent's fetch), so the fetches that wait
        # for one are linked in arrays (first dependent, next sibling) rather than in a list each.
        first: dict[str, int] = {}
        exact: dict[tuple[str, int, Chunks], int] = {}
        total = 0
        for rx, fetches in self.assignments.items():
            first[rx] = total
            for f, a in enumerate(fetches, start=total):
                exact[rx, a.block, a.chunks] = f
            total += len(fetches)
        index = UnitIndex(exact)  # for a unit a parent does not fetch as such: one containing it
        sources, held = set(self.sources), self.held
        last = bytearray(total)
        waiting = [1] * total
        above = [-1] * total  # the parent's fetch each fetch waits for, -1 for none
        head = [-1] * total  # the first fetch that waits for fetch f as its parent's, -1 for none
        sibling = [-1] * total  # the next fetch that waits for the same parent's fetch
        for rx, fetches in self.assignments.items():
            if fetches:
                waiting[first[rx]] = 0
                last[first[rx] + len(fetches) - 1] = 1
            for f, a in enumerate(fetches, start=first[rx]):
                parent_f = exact.get((a.parent, a.block, a.chunks))
                if parent_f is None:
                    if a.parent in sources or (held and a.block in held.get(a.parent, ())):
                        continue
                    parent_f = index.get(a.parent, a.block, a.chunks)
                if parent_f is not None:
                    above[f] = parent_f
                    sibling[f] = head[parent_f]
                    head[parent_f] = f
                    waiting[f] += 1
                elif check_parents:
                    it = ("it and does not fetch it" if a.chunks is None
                          else "the block and fetches no unit containing those chunks")
                    raise PlanError(f"malformed plan: {rx!r} fetches {unit_name(a.block, a.chunks)} from "
                                    f"{a.parent!r}, which is no source, does not hold {it}")
        level = [0] * total
        # A receiver with no fetch has its first index at the next one's first fetch: counted once, from that one.
        ready = [first[rx] for rx, fetches in self.assignments.items() if fetches and waiting[first[rx]] == 0]

        def wait_less(g: int, step: int) -> None:
            if level[g] < step:
                level[g] = step
            waiting[g] -= 1
            if waiting[g] == 0:
                ready.append(g)

        done = 0
        while ready:
            f = ready.pop()
            done += 1
            g = head[f]
            while g != -1:
                wait_less(g, level[f] + 1)
                g = sibling[g]
            if not last[f]:
                wait_less(f + 1, level[f] + 1)
        if done < total:
            stuck = sorted(rx for rx, f in first.items() if any(waiting[f:f + len(self.assignments[rx])]))
            raise PlanError(self._describe_cycle(stuck, above))
        return {rx: level[f:f + len(self.assignments[rx])] for rx, f in first.items()}

    def _describe_cycle(self, stuck: list[str], above: list[int]) -> str:
        # Walk up the parents' fetches from every fetch of the stuck receivers' blocks, lowest block first.
        # The units along a cycle contain each other in turn, so they are one unit.
        owner: list[tuple[str, Fetch[str]]] = [(rx, a) for rx, fetches in self.assignments.items() for a in fetches]
        blocks = {a.block for rx in stuck for a in self.assignments[rx]}
        cleared: set[int] = set()
        starts = sorted((f for f, (_, a) in enumerate(owner) if a.block in blocks), key=lambda f: owner[f][1].block)
        for start in starts:
            path: dict[int, int] = {}  # fetch -> its place on the walk up from start
            f = start
            while f != -1 and f not in cleared and f not in path:
                path[f] = len(path)
                f = above[f]
            if f in path:
                cycle = [owner[g][0] for g in list(path)[path[f]:]] + [owner[f][0]]
                a = owner[f][1]
                return (f"malformed plan: {unit_name(a.block, a.chunks)}: {owner[f][0]!r} is its own ancestor "
                        f"({' -> '.join(map(repr, cycle))}, each fetching from the next)")
            cleared.update(path)
        shown = ", ".join(map(repr, stuck[:5])) + (f" and {len(stuck) - 5} more" if len(stuck) > 5 else "")
        return (f"malformed plan: fetch orders and parent links form a cycle, so receivers {shown} would wait "
                "for each other forever")


class UnitIndex(Generic[Value]):
    """A value for each unit (a block, or a chunk range of it) of each node, found by containment: the value
    of the node's unit that contains a given unit (a whole block contains every range of it).

    A node's units of one block do not overlap (:meth:`Plan.validate`), so at most one contains a given
    unit. The same unit is found in O(1); another split of the block by a search of the node's ranges of it.
    """

    __slots__ = ("_exact", "_ranges")

    def __init__(self, exact: dict[tuple[str, int, Chunks], Value] | None = None) -> None:
        """An index of ``exact``: a value per (node, block, chunks), taken as it is, not copied."""
        self._exact = {} if exact is None else exact
        self._ranges: dict[tuple[str, int], list[tuple[int, int, Value]]] | None = None  # made on first need

    def add(self, node: str, block: int, chunks: Chunks, value: Value) -> None:
        """Record ``value`` for ``node``'s unit (``block``, ``chunks``)."""
        self._exact[node, block, chunks] = value
        if chunks is not None and self._ranges is not None:
            self._ranges.setdefault((node, block), []).append((chunks[0], chunks[1], value))

    def get(self, node: str, block: int, chunks: Chunks) -> Value | None:
        """The value of ``node``'s unit of ``block`` that contains ``chunks``; None where it has none."""
        found = self._exact.get((node, block, chunks))
        if found is not None or chunks is None:
            return found
        found = self._exact.get((node, block, None))
        if found is not None:
            return found
        if self._ranges is None:
            self._ranges = {}
            for (owner, of, span), value in self._exact.items():
                if span is not None:
                    self._ranges.setdefault((owner, of), []).append((span[0], span[1], value))
        first, end = chunks
        return next((value for f, e, value in self._ranges.get((node, block), ()) if f <= first and end <= e), None)


def add_serving(serving: dict[str, list[tuple[int, str]]], receiver: str, fetches: Sequence[Fetch[str]],
                parents: Collection[str] | None = None) -> None:
    """Append (block, ``receiver``) to ``serving[parent]`` for each of ``receiver``'s ``fetches``, each pair
    once, for every parent or those among ``parents``: what :attr:`Part.serve` lists."""
    # Several ranges of a block from one parent: one child of it (a receiver fetches a block once otherwise).
    wanted = fetches if parents is None else [f for f in fetches if f.parent in parents]
    for parent, block in dict.fromkeys((f.parent, f.block) for f in wanted):
        children = serving.get(parent)
        if children is None:
            children = serving[parent] = []
        children.append((block, receiver))


def _overlap(receiver: str, a: Fetch[str], b: Fetch[str]) -> None:
    if a.chunks == b.chunks:
        raise PlanError(f"malformed plan: {receiver!r} fetches {unit_name(a.block, a.chunks)} twice")
    raise PlanError(f"malformed plan: {receiver!r} fetches {unit_name(a.block, a.chunks)} and "
                    f"{unit_name(b.block, b.chunks)}, which overlap")


def _check_disjoint(receiver: str, ranged: list[Fetch[str]]) -> None:
    """Raise :class:`PlanError` naming two of ``ranged`` (ranges of one block, in fetch order) that overlap."""
    by_first = sorted(range(len(ranged)), key=lambda k: ranged[k].chunks)
    reach = by_first[0]  # of the ranges so far, the one that ends last
    for k in by_first[1:]:
        if ranged[k].chunks[0] < ranged[reach].chunks[1]:
            _overlap(receiver, ranged[min(k, reach)], ranged[max(k, reach)])
        if ranged[k].chunks[1] > ranged[reach].chunks[1]:
            reach = k


def unit_name(block: int, chunks: Chunks) -> str:
    """A unit as messages name it: ``block 3``, ``chunk 4 of block 3`` or ``chunks 4-9 of block 3``."""
    if chunks is None:
        return f"block {block}"
    first, end = chunks
    return f"chunk {first} of block {block}" if end == first + 1 else f"chunks {first}-{end - 1} of block {block}"


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def check_ids(where: str, nodes: Sequence[str], kind: str) -> None:
    """Raise :class:`PlanError` (prefixed ``where``) unless ``nodes`` are distinct non-empty ids."""
    seen: set[str] = set()
    for node in nodes:
        if not isinstance(node, str) or not node:
            raise PlanError(f"{where}: {kind} id must be a non-empty string, got {node!r}")
        if node in seen:
            raise PlanError(f"{where}: {kind} {node!r} is listed twice")
        seen.add(node)


def is_index(value: object) -> bool:
    """Whether ``value`` is a block index (an int >= 0, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

