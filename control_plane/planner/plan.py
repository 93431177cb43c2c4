"""A multicast plan as a value: who fetches which block from whom, in which order, and its checks.

The planners (:mod:`control_plane.planner.schedules`, :mod:`control_plane.planner.replan`) build plans,
the control plane splits them into each node's :class:`Part`, and static plan files carry their JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pipecast.core.errors import PipecastError

STRATEGIES = ("unicast", "chain", "tree", "binomial", "rotated")

Node = TypeVar("Node")


class PlanError(PipecastError):
    """A malformed plan or plan request; the message says which input (whose) and what is wrong."""


@dataclass(frozen=True, slots=True)
class Fetch(Generic[Node]):
    """One fetch: the receiver gets ``block`` (0-based index) from ``parent``.

    The parent is a node id in plans (``Fetch[str]``) and, in the parts the control plane sends to a
    worker, the node with its address (``Fetch[PeerInfo]``, see :mod:`control_plane.messages`).
    """

    block: int
    parent: Node


@dataclass(frozen=True)
class Part:
    """One node's part in a plan: what it fetches (in order, each from its parent) and whom it serves."""

    fetch: tuple[Fetch[str], ...]
    serve: tuple[tuple[int, str], ...]  # (block, child); each child fetches in its own order


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
    assignments: dict[str, list[Fetch[str]]]
    held: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _children: dict[tuple[str, int], list[str]] | None = field(default=None, init=False, repr=False, compare=False)
    _encoded: str | None = field(default=None, init=False, repr=False, compare=False)

    def children(self, node: str, block: int) -> list[str]:
        """The receivers that fetch ``block`` from ``node``, in the order of :attr:`assignments`."""
        if self._children is None:
            index: dict[tuple[str, int], list[str]] = {}
            for receiver, fetches in self.assignments.items():
                for a in fetches:
                    index.setdefault((a.parent, a.block), []).append(receiver)
            self._children = index
        return list(self._children.get((node, block), ()))

    def parts(self) -> dict[str, Part]:
        """Every node's part: receivers fetch; parents (sources, receivers, holders) serve; every source has
        a part, children or not (it is every receiver's fallback, so it must hear of the plan)."""
        serving: dict[str, list[tuple[int, str]]] = {}
        for receiver, fetches in self.assignments.items():
            for fetch in fetches:
                children = serving.get(fetch.parent)
                if children is None:
                    children = serving[fetch.parent] = []
                children.append((fetch.block, receiver))
        parts = {receiver: Part(tuple(fetches), ()) for receiver, fetches in self.assignments.items()}
        for node, children in serving.items():
            own = parts.get(node)
            parts[node] = Part(own.fetch if own is not None else (), tuple(children))
        for source in self.sources:
            parts.setdefault(source, Part((), ()))
        return parts

    def to_json(self) -> dict:
        """The plan as JSON-able data: ``{"strategy", "sources", "assignments": {rx: [[block, parent], ..]}}``."""
        data: dict = {"strategy": self.strategy, "sources": list(self.sources),
                      "assignments": {rx: [[a.block, a.parent] for a in fetches]
                                      for rx, fetches in self.assignments.items()}}
        if self.held:
            data["held"] = {node: list(blocks) for node, blocks in self.held.items()}
        return data

    def encoded(self) -> str:
        """:meth:`to_json` as compact JSON text, made once (a 5,000-worker plan takes ~0.3 s: the control plane
        has it made off its event loop, before the flush that stores it)."""
        if self._encoded is None:
            self._encoded = json.dumps(self.to_json(), separators=(",", ":"))
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
        for receiver, fetches in assignments.items():
            if not isinstance(fetches, list | tuple):
                raise PlanError(f"malformed plan: fetches of {receiver!r} must be a list, got {type(fetches).__name__}")
            out = []
            for k, pair in enumerate(fetches):
                if not (isinstance(pair, list | tuple) and len(pair) == 2 and is_index(pair[0])
                        and isinstance(pair[1], str)):
                    raise PlanError(f"malformed plan: fetch {k} of {receiver!r} must be [block, parent] with a "
                                    f"block index >= 0 and a parent id, got {pair!r}")
                out.append(Fetch(pair[0], pair[1]))
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

        Checked: a known strategy; distinct, non-empty node ids; no receiver that is a source; no block
        fetched twice by one receiver or both held and fetched; no receiver its own parent; every parent
        a source, a node that holds the block, or a receiver that fetches it; and no cycle through parent
        links and fetch orders (per block or across blocks), so fetching in order cannot deadlock.
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
        fetched: dict[str, set[int]] = {}
        for receiver, fetches in self.assignments.items():
            check_ids("malformed plan", (receiver,), "receiver")
            if receiver in sources:
                raise PlanError(f"malformed plan: source {receiver!r} is also a receiver")
            blocks: set[int] = set()
            for a in fetches:
                if not is_index(a.block) or not isinstance(a.parent, str) or not a.parent:
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
