"""Stragglers: receivers that hold their subtree back, found from progress reports and moved out of the way.

Pure: from what receivers reported (bytes held, when) and the plan's parts to the nodes to demote, and from
a plan to the plan without them in the middle. A receiver is a straggler when it receives at less than
``factor`` x its *reference*: the best of what its parents can give it, each parent's share among its
receiving children of: for a parent still receiving, its own rate (a child cannot outrun a relay, so the
children of a straggler are not stragglers); for a parent that holds the package (a source, a holder), the
receiver's declared link rate, or with no declared rate the fastest receiver's. It is judged only while that
reference is at least ``factor`` x what it could get (its declared rate, else the fastest receiver's): behind
a stalled or dead relay everyone is slow, and the repair, not a demotion, is the cure. Only a receiver that
serves others is demoted (a slow leaf slows no one): its first child per unit takes the slot it leaves, the
others go to nodes with a free slot, and it fetches what it misses last, from nodes whose uplinks have room (in
a chain the tail), so everyone but the straggler runs at the link rate.

A relay whose uplink, not its downlink, is slow (an egress cap, a send queue in trouble) receives at full rate
and its child does not, and in a chain (a relay feeding one child) nothing tells a slow child from a slow
parent's uplink. So a slow child of a chain relay leaves the middle with that relay (:func:`chain_pairs`), side
by side past the tail (the relay fetching from the child's parent, not from the child); there the child either
keeps up, and the relay's uplink was the limit, or is still slow behind a parent at full rate, and the child was
(:func:`pair_verdict`); the slow one then fetches behind the other (:func:`follow`). Both moves are made at the
first finding: a healthy node behind a slow uplink gets a quarter of its rate until then and never catches up
(one re-plan per suspect, demoting the relay only when its next child was as slow, took ~2 s, 1.3-1.5x S/B
at N = 8). Pairs are made at a plan's first demotion only: past a slow leaf (the tail's one slot taken) a pair
would wait behind it, where no verdict can be made. In a tree, where a relay feeds several children, and for a
later straggler, a child is demoted alone and its relay becomes a suspect: when its next child is as slow, and
so is every child it feeds, both are demoted. Leaves that find no free slot fetch behind the tail one after
another (not from a source, whose link feeds the head; a slow leaf behind a slower one costs no one else),
behind a leaf a verdict found healthy first, blamed relays last.

A straggler at the head of a plan whose nodes declare no link rate is not found: every node behind it is as
slow, so nothing tells its rate from the link's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from control_plane.planner.plan import Fetch, Part, Plan, PlanError
from control_plane.planner.replan import replan, splice, unit_fanout

#: Progress samples kept per receiver: (seconds, bytes held).
Sample = tuple[float, int]


@dataclass(frozen=True)
class StragglerPolicy:
    """When a receiver is a straggler: below ``factor`` x its reference rate (0: never), measured over at
    least ``window_s`` seconds of its progress (since its part last changed: the state forgets the samples
    of a node whose part changes)."""

    factor: float = 0.5
    window_s: float = 0.4

    def __post_init__(self) -> None:
        if not 0 <= self.factor < 1:
            raise ValueError(f"straggler factor must be within [0, 1), got {self.factor!r}")
        if not 0 < self.window_s < math.inf:  # an infinite window (or NaN) would never measure a rate
            raise ValueError(f"straggler window must be positive and finite, got {self.window_s!r}")

    @property
    def enabled(self) -> bool:
        return self.factor > 0


def receive_rate(samples: Sequence[Sample], *, now: float, window_s: float) -> float | None:
    """Bytes per second over the last ``window_s`` or so of ``samples`` (in time order); None while the recent
    ones span less than ``window_s`` (not measured long enough, or the node stopped reporting)."""
    usable = [s for s in samples if s[0] >= now - window_s * 2]
    if len(usable) < 2 or usable[-1][0] - usable[0][0] < window_s:
        return None
    (t0, b0), (t1, b1) = usable[0], usable[-1]
    return max(b1 - b0, 0) / (t1 - t0)


@dataclass(frozen=True)
class Found:
    """What :func:`find_stragglers` found: the receivers to demote (sorted) and, of them, the ``relays`` blamed for
    their children's rate (their uplink was slow, not what they receive: the last leaves)."""

    slow: list[str]
    relays: frozenset[str] = frozenset()


def find_stragglers(parts: Mapping[str, Part], rates: Mapping[str, float], receiving: Collection[str],
                    expected: Mapping[str, float], *, factor: float, skip: Collection[str] = (),
                    limits: Collection[str] = (), suspects: Collection[str] = ()) -> Found:
    """The receivers to demote, by the module's rule.

    ``parts``: each node's part in the plan; ``rates``: measured receive rates (bytes/s) of the receivers
    still receiving that have one; ``receiving``: every receiver still missing blocks; ``expected``: declared
    link rates (bytes/s) per node, where known; ``skip``: nodes never demoted again (demoted already);
    ``limits``: sources and holders that a child of theirs was demoted under already: if the next child is
    as slow, the sender is the limit, not the child, so their children are not judged again. ``suspects``:
    receiving relays a child was demoted under: a relay still receiving whose every receiving child is slow
    (in a chain, its one child) is demoted with the child, where it is the child's only parent (a slow leaf's
    too); one with a child at the rate it gives is not the limit. A receiver whose receiving parent has no
    rate yet is not judged.
    """
    if factor <= 0 or not rates:
        return Found([])
    fastest = max(rates.values())
    counted: dict[str, set[str]] = {}

    def receivers_of(node: str) -> set[str]:  # receiving children, found only for the few nodes judged
        if node not in counted:
            part = parts.get(node)
            counted[node] = {child for _, child in part.serve if child in receiving} if part else set()
        return counted[node]

    def children(node: str) -> int:
        return len(receivers_of(node))

    def uplink_suspect(relay: str | None) -> bool:
        """A relay a child was demoted under, still receiving, whose every receiving child gets less than
        ``factor`` x its share of the relay's own rate."""
        if relay not in suspects or relay not in receiving or relay in skip or relay not in rates:
            return False
        share = rates[relay] / max(children(relay), 1)
        # A child with no rate yet is not judged, nor is its parent on it.
        return all(child in rates and rates[child] < factor * share for child in receivers_of(relay))

    slow, relays = set(), set()
    for node, rate in rates.items():
        # No reference exceeds the fastest receiver or the node's declared rate: most nodes stop here.
        if node in skip or rate >= factor * max(fastest, expected.get(node, 0.0)):
            continue
        parents = {f.parent for f in parts[node].fetch}
        relay = next(iter(parents)) if len(parents) == 1 else None
        limit = uplink_suspect(relay)
        if not children(node) and not limit:  # a slow leaf slows no one
            continue
        declared = expected.get(node) or fastest
        reference = parents_rate(parents, rates, receiving, declared=declared,
                                 share=lambda parent: max(children(parent), 1), limits=limits)
        if reference is not None and reference >= factor * declared and rate < factor * reference:
            slow.add(node)
            if limit:
                slow.add(relay)
                relays.add(relay)
    return Found(sorted(slow), frozenset(relays))


def parents_rate(parents: Collection[str], rates: Mapping[str, float], receiving: Collection[str], *,
                 declared: float, share: Callable[[str], int] = lambda parent: 1,
                 limits: Collection[str] = ()) -> float | None:
    """The best rate the ``parents`` of a receiver give it, each parent's divided among ``share(parent)`` children: a
    parent still receiving gives its own rate (a child cannot outrun a relay), one that holds the package (a
    source, a holder) the receiver's ``declared`` rate. None where a receiving parent has no rate yet, or a parent
    is among the ``limits`` (its uplink is the limit: nothing to judge the child by)."""
    best = 0.0
    for parent in parents:
        if parent in receiving:
            if parent not in rates:
                return None
            best = max(best, rates[parent] / share(parent))
        elif parent in limits:
            return None
        else:
            best = max(best, declared / share(parent))
    return best


def demote(plan: Plan, slow: Collection[str], *, held: Mapping[str, Collection[int]], sources: Sequence[str],
           num_blocks: int, labels: Mapping[str, Mapping[str, str]] | None = None,
           demoted: Collection[str] = (), last: Collection[str] = (), beside: Mapping[str, str] | None = None,
           healthy: Collection[str] = ()) -> Plan:
    """``plan`` with the ``slow`` receivers out of the middle: their first children per unit fetch it from the
    nodes the slow ones fetched it from (:func:`splice`), their other children from other nodes with a free
    slot for the unit (no sender gets more children for a unit than the plan gives any: :func:`unit_fanout`),
    and the slow ones fetch what they miss (in the plan's own units) last, each from a node with a free slot
    for the unit, else from the leaf before it (in a chain: past the tail, one behind the other, ``last`` at the
    end; a leaf is slow already, a source's link feeds the plan's head), else from a source; so that none of
    them, nor any of the plan's receivers ``demoted`` earlier, is the parent of anyone but a leaf; one ``beside``
    another (a pair's relay: ``beside[relay]`` is its child, joined before it) fetches each unit from that one's
    parent, not from it (:func:`chain_pairs`); leaves go behind the ``healthy`` ones first (leaves found to
    receive at the link rate). ``held``: verified blocks per node."""
    slow = set(slow)
    others = {node: blocks for node, blocks in held.items() if node not in slow}
    fanout = unit_fanout(plan, leaves=demoted)  # leaves feeding leaves are no slot to give a healthy relay
    # Stragglers are leaves, this round's and earlier ones': no slot for another straggler's fetch either.
    leaves = slow | set(demoted)
    without = replan(splice(plan, slow), dead=slow, held=others, sources=sources, labels=labels, fanout=fanout,
                     leaves=leaves)
    joined = sorted(slow & plan.assignments.keys(), key=lambda node: (node in last, node))
    return replan(without, dead=(), held=held, sources=sources, labels=labels, fanout=fanout, joined=joined,
                  num_blocks=num_blocks, units=unit_layout(plan), leaves=leaves, beside=beside, healthy=healthy)


def chain_pairs(slow: Collection[str], parts: Mapping[str, Part], receiving: Collection[str]) -> dict[str, str]:
    """For each ``slow`` receiver whose one parent is a relay still receiving that feeds it alone (a chain's), not
    ``slow`` itself: that relay. Nothing tells the child's slow downlink from the relay's slow uplink there, so
    both leave the middle (:func:`demote`), side by side past the tail, until :func:`pair_verdict` says which it
    was."""
    slow = set(slow)
    pairs = {}
    for node in sorted(slow):
        parents = {f.parent for f in parts[node].fetch}
        relay = next(iter(parents)) if len(parents) == 1 else None
        part = parts.get(relay) if relay is not None else None
        if part is None or relay not in receiving or relay in slow or {child for _, child in part.serve} != {node}:
            continue
        pairs[node] = relay
    return pairs


def pair_verdict(child: str, relay: str, parts: Mapping[str, Part], rates: Mapping[str, float],
                 receiving: Collection[str], expected: Mapping[str, float], *, factor: float) -> str | None:
    """Which of a pair (:func:`chain_pairs`) was slow, now that ``child`` and ``relay`` fetch side by side past the
    tail, once the child's parents deliver at least ``factor`` x its declared rate (else the fastest receiver's;
    their rate: the best of, for a parent still receiving, its own rate, else that declared one): ``"child"`` when
    it gets less than ``factor`` x its due, ``"relay"`` when it keeps up (the relay's uplink was the limit); None
    until both have a rate and the parents are that fast (behind a slow parent nothing tells). Its due: the larger
    of what the relay takes and what the parents' rate leaves beside it (they share the parents' uplink once the
    relay, ahead, needs what the tail has: two healthy ones get half each, a slow child a part of what is left)."""
    rate, beside = rates.get(child), rates.get(relay)
    if rate is None or beside is None:
        return None
    declared = expected.get(child) or max(rates.values())
    reference = parents_rate({f.parent for f in parts[child].fetch}, rates, receiving, declared=declared)
    if reference is None or reference < factor * declared:
        return None
    return "child" if rate < factor * max(beside, reference - beside) else "relay"


def follow(plan: Plan, leaf: str, ahead: str, held: Collection[int] = ()) -> Plan:
    """``plan`` with ``leaf`` fetching each unit from ``ahead``, wherever ``ahead`` fetches the unit too or holds its
    block (``held``: its verified blocks), its old parent elsewhere. ``ahead`` must fetch nothing from ``leaf``."""
    if any(a.parent == leaf for a in plan.assignments.get(ahead, ())):
        raise PlanError(f"follow: {ahead!r} fetches from {leaf!r}")
    fetched = {(a.block, a.chunks) for a in plan.assignments.get(ahead, ())}
    # A block it verified since the plan was made is still among its fetches there: served as one, not as held.
    held = set(held) - {block for block, _ in fetched}
    fetches = [Fetch(a.block, ahead, a.chunks) if (a.block, a.chunks) in fetched or a.block in held else a
               for a in plan.assignments[leaf]]
    serving = dict(plan.held)
    served = {a.block for a in fetches if a.parent == ahead and a.block in held}
    if served:
        serving[ahead] = tuple(sorted(set(serving.get(ahead, ())) | served))
    return Plan(plan.strategy, plan.sources, {**plan.assignments, leaf: fetches}, serving)


def unit_layout(plan: Plan) -> dict[int, tuple]:
    """Each block's units in ``plan`` (its chunk ranges, in order; ``(None,)`` for whole blocks), as the first
    receiver that fetches the block has them."""
    layout: dict[int, list] = {}
    owner: dict[int, str] = {}
    for rx, fetches in plan.assignments.items():
        for fetch in fetches:
            if owner.setdefault(fetch.block, rx) == rx:
                layout.setdefault(fetch.block, []).append(fetch.chunks)
    return {block: tuple(sorted(units, key=lambda c: (0, 0) if c is None else c)) for block, units in layout.items()}
