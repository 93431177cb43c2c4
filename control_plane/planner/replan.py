"""Repairing a multicast plan after nodes fail, leave or join: new parents for the units still missing.

Pure: from the old plan and what the control plane knows now (dead nodes, verified blocks per node,
sources) to a new :class:`~control_plane.planner.plan.Plan`. A unit is a block or a chunk range of one
(:class:`~control_plane.planner.plan.Fetch`); nodes are known to hold whole blocks only, so a receiver
fetches every unit of a block it has not verified, and fetches none of one it has.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping, Sequence
from operator import itemgetter

from control_plane.planner.plan import Chunks, Fetch, Part, Plan, PlanError, UnitIndex, add_serving, check_ids
from control_plane.planner.racks import ParentPool, rack_of


def replan(plan: Plan, *, dead: Collection[str], held: Mapping[str, Collection[int]], sources: Sequence[str],
           labels: Mapping[str, Mapping[str, str]] | None = None, fanout: int = 2,
           joined: Sequence[str] = (), num_blocks: int | None = None,
           units: Mapping[int, Sequence[Chunks]] | None = None, leaves: Collection[str] = (),
           beside: Mapping[str, str] | None = None, healthy: Collection[str] = ()) -> Plan:
    """A plan for exactly the units each live receiver still misses.

    A receiver of ``plan`` still needs its planned units minus those of blocks in ``held`` (verified
    blocks per live node); a ``joined`` receiver needs blocks ``0..num_blocks-1`` minus those it holds,
    each in the ``units`` given for it (its chunk ranges, e.g. the plan's own), whole where none are. Dead
    receivers, receivers now among ``sources`` and receivers that need nothing leave the plan. Each receiver
    keeps its old fetch order, and its old parent wherever that parent is alive and holds the block, is a
    source, or still fetches the unit or one containing it (earlier). Otherwise the new parent
    is the earliest node with fewer than ``fanout`` children for that unit (kept children count) that holds
    the block (and sends fewer than ``fanout`` children other units: it holds the block, so it sends them later
    ones now) or fetches the same unit earlier in the new plan, one in the receiver's rack first, else the
    least loaded source (same rack first). Never a dead parent, never a cycle, never a unit fetched of a
    block that is already held. Non-source nodes serving blocks they hold are listed in the new plan's
    ``held``. ``leaves`` (demoted stragglers) are no one's parent but a later leaf's: never kept as one nor
    given a slot; a leaf that finds no free slot fetches the unit from the latest leaf fetching it before it
    (in a chain the leaves then run one behind the other past the tail, whose one slot the first took), else
    from a source; the latest of the ``healthy`` leaves (found to receive at the link rate) first, where one
    fetches it before; a leaf ``beside`` another (``beside[leaf]``, placed before it) fetches each unit from that
    one's parent for it instead, not behind a leaf that may be slow.
    """
    dead, sources = set(dead), tuple(sources)
    source_set = set(sources)
    if not sources:
        raise PlanError("replan: no sources to plan from")
    check_ids("replan", sources, "source")
    if source_set & dead:
        raise PlanError(f"replan: source {min(source_set & dead)!r} is listed as dead")
    if not isinstance(fanout, int) or fanout < 1:
        raise PlanError(f"replan: fanout must be a positive integer, got {fanout!r}")
    for node in joined:
        if node in plan.assignments or node in source_set or node in dead:
            raise PlanError(f"replan: joined node {node!r} is already a receiver, a source or dead")
    if len(set(joined)) != len(joined):
        raise PlanError("replan: a joined node is listed twice")
    if joined and (not isinstance(num_blocks, int) or num_blocks < 1):
        raise PlanError(f"replan: joined receivers need num_blocks (a positive integer), got {num_blocks!r}")
    holds = {node: set(blocks) for node, blocks in held.items() if node not in dead}
    leaves = set(leaves)
    beside = beside or {}

    # Each remaining fetch keeps its old level (a topological order of the old plan), so kept parents
    # stay earlier than their children; joined receivers come after everything, interleaved so that one
    # joined receiver may fetch a block from another that is earlier in `joined`. A receiver's levels
    # rise along its list, so (level, receiver) orders the fetches completely.
    levels = plan.fetch_levels()
    needs: list[tuple[int, str, int, Chunks, str | None]] = []
    for rx, fetches in plan.assignments.items():
        if rx in dead or rx in source_set:
            continue
        have = holds.get(rx, ())
        needs.extend((level, rx, a.block, a.chunks, a.parent) for a, level in zip(fetches, levels[rx])
                     if a.block not in have)
    after = 1 + max((level for rx_levels in levels.values() for level in rx_levels), default=0)
    layout = [(b, chunks) for b in range(num_blocks or 0) for chunks in (units or {}).get(b, (None,))]
    for q, rx in enumerate(joined):
        have = holds.get(rx, ())
        # By the unit's place in the layout, not in what the receiver misses: each unit's joined fetches in
        # ``joined`` order, however many blocks each holds already.
        needs.extend((after + i * len(joined) + q, rx, b, chunks, None) for i, (b, chunks) in enumerate(layout)
                     if b not in have)
    needs.sort(key=itemgetter(0, 1))
    scheduled: UnitIndex[int] = UnitIndex()
    for level, rx, block, chunks, _ in needs:
        scheduled.add(rx, block, chunks, level)

    def keeps(parent: str | None, block: int, chunks: Chunks, level: int) -> bool:
        # Dead nodes are no source (checked above), hold nothing and fetch nothing here. A parent that
        # fetches the unit must do so earlier: an old source that rejoined fetches after everyone.
        if parent is None or parent in leaves:
            return False
        if parent in source_set or block in holds.get(parent, ()):
            return True
        then = scheduled.get(parent, block, chunks)
        return then is not None and then < level

    keep = [keeps(parent, block, chunks, level) for level, _, block, chunks, parent in needs]
    kept: dict[tuple[str, int, Chunks], int] = {}
    # A holder's uplink serves the children it keeps, whatever their units: it sends them later units now.
    uplink: dict[str, set[str]] = {}
    for kept_parent, (_, rx, block, chunks, parent) in zip(keep, needs):
        if kept_parent and parent not in source_set:
            kept[parent, block, chunks] = kept.get((parent, block, chunks), 0) + 1
            uplink.setdefault(parent, set()).add(rx)

    rack = rack_of(labels)
    holders: dict[int, list[str]] | None = None  # per block, made at the first need of them
    pools: dict[tuple[int, Chunks], ParentPool] = {}
    # A unit's pool gets the block's holders (before its receivers) only when a parent is first taken from it:
    # most fetches keep their parents, and thousands of complete holders may hold every block.
    stocked: set[tuple[int, Chunks]] = set()
    source_load = dict.fromkeys(sources, 0)
    # Per unit, the leaves that fetch it, in order: a leaf finding no free slot fetches it from the latest one before
    # it, not from a source, whose link feeds the plan's head (leaves spilling onto the store's one link ran the
    # whole chain at a third of it); never from a receiver that is no leaf (its slots are its children's).
    fetchers: dict[tuple[int, Chunks], list[tuple[int, str, str]]] = {}  # (level, leaf, its parent)
    serving: dict[str, set[int]] = {}
    assignments: dict[str, list[Fetch[str]]] = {}
    for kept_parent, (level, rx, block, chunks, old) in zip(keep, needs):
        pool = pools.get((block, chunks))
        if pool is None:
            pool = pools[block, chunks] = ParentPool(rack)
        if kept_parent:
            parent = old
        else:
            if (block, chunks) not in stocked:
                stocked.add((block, chunks))
                if holders is None:
                    holders = {}
                    for node, blocks in holds.items():
                        if node not in source_set and node not in leaves:
                            for held_block in blocks:
                                holders.setdefault(held_block, []).append(node)
                pool.add_first([(node, fanout - max(kept.get((node, block, chunks), 0), len(uplink.get(node, ()))))
                                for node in holders.get(block, ())], time=-1)
            parent = pool.take(rack(rx), before=level)
        if parent is None and rx in leaves:
            earlier = fetchers.get((block, chunks), ())
            partner = beside.get(rx)
            parent = next((its_parent for then, node, its_parent in earlier if node == partner and then < level), None)
            if parent is None:
                ahead = [node for then, node, _ in earlier if then < level]
                parent = next((node for node in reversed(ahead) if node in healthy), ahead[-1] if ahead else None)
        if parent is None:
            mine = rack(rx)
            near = [s for s in sources if mine is not None and rack(s) == mine] or sources
            parent = min(near, key=source_load.__getitem__)
        if parent in source_set:
            source_load[parent] += 1
        elif block in holds.get(parent, ()):
            serving.setdefault(parent, set()).add(block)
        assignments.setdefault(rx, []).append(Fetch(block, parent, chunks))
        # A leaf gets no spare slot: a straggler would slow down whoever fetched from it (but a later leaf).
        pool.add(rx, 0 if rx in leaves else fanout - kept.get((rx, block, chunks), 0), time=level)
        if rx in leaves:
            fetchers.setdefault((block, chunks), []).append((level, rx, parent))
    return Plan(plan.strategy, sources, assignments,
                {node: tuple(sorted(blocks)) for node, blocks in serving.items()})


# A dead node's child takes the least loaded of the first this many holders of the block that have a free slot
# (thousands may hold it; each costs a look at its children).
REPAIR_CANDIDATES = 16


def repair_deaths(plan: Plan, *, dead: Collection[str], held: Mapping[str, Collection[int]],
                  labels: Mapping[str, Mapping[str, str]] | None = None, fanout: int = 2,
                  parts: Mapping[str, Part] | None = None,
                  sources: Sequence[str] | None = None) -> tuple[Plan, set[str]] | None:
    """The plan without the ``dead`` nodes, changed only where it must be; with the nodes whose parts
    changed. ``sources``: the plan's from now on (default: its own less the dead); None when none is left.

    What :func:`replan` does in time proportional to the whole plan (every fetch re-levelled and
    re-parented) this does in a few passes over it, so a relay's death in a plan of thousands of workers
    is repaired without stalling the control plane. Each fetch from a dead parent, of a block or a chunk
    range of one, goes to a node that already holds the block (``held``: verified blocks per node; a
    receiver among them stops fetching that block and serves it as a holder), one in the receiver's rack
    first, with fewer than ``fanout`` children for that unit, the fewest among the first
    :data:`REPAIR_CANDIDATES` holders with a free slot; else to the least loaded source
    (same rack first). A holder never waits, so no cycle can form. A receiver's fetch of a block it already holds is
    dropped, and so is every fetch of a receiver now among the sources (it holds the package). Every other
    fetch keeps its parent: the dead nodes' children get new parents for their
    units, their descendants keep theirs; a dead source's children likewise (a source holds every block, so
    its units go to holders and the sources left: no pass over the plan, where :func:`replan` takes seconds
    at thousands of receivers). ``parts`` (the plan's :meth:`Plan.parts`, made already) lets it find the
    dead nodes' children without a pass over the plan; the result is the same.
    """
    if sources is not None:  # the plan's own are checked where it is made
        check_ids("repair_deaths", sources, "source")
    dead = set(dead)
    alive = [s for s in (plan.sources if sources is None else sources) if s not in dead]
    if not alive:
        return None
    source_set = set(alive)
    # The dead nodes, and any source that leaves or joins (its part goes or comes).
    changed = (dead & (plan.assignments.keys() | plan.held.keys())) | (source_set ^ set(plan.sources))
    # A receiver that becomes a source holds the package (it is a source no other way): it stops fetching, and
    # its parents no longer serve it. Else the plan would not validate, nor load back from the store.
    for node in source_set & plan.assignments.keys():
        changed.update(a.parent for a in plan.assignments[node])
    orphans = [(rx, a) for rx, a in _orphans(plan, dead, changed, parts) if rx not in source_set]
    if not orphans:
        return (plan, set()) if not changed else _without(plan, dead, {}, {}, changed, alive)
    moved, serving = _rehome(plan, orphans, dead=dead, held=held, sources=alive, labels=labels, fanout=fanout,
                             parts=parts, changed=changed)
    return _without(plan, dead, moved, serving, changed, alive)


def _rehome(plan: Plan, orphans: Sequence[tuple[str, Fetch[str]]], *, dead: set[str],
            held: Mapping[str, Collection[int]], sources: Sequence[str],
            labels: Mapping[str, Mapping[str, str]] | None, fanout: int, parts: Mapping[str, Part] | None,
            changed: set[str], leaves: Collection[str] = ()) -> tuple[dict[tuple[str, int, Chunks], str | None],
                                                                      dict[str, set[int]]]:
    """New parents for the ``orphans`` (receiver, fetch), as :func:`repair_deaths` places them, never one of
    ``leaves`` (stragglers): the fetches moved ((receiver, block, chunks) -> new parent; None: dropped) and the
    holders' blocks to list as held. Adds the nodes whose parts change to ``changed``."""
    source_set = set(sources)
    wanted = {a.block for rx, a in orphans if a.block not in held.get(rx, ())}  # the others are dropped
    candidates: dict[int, list[str]] = {b: [] for b in wanted}
    for node, blocks in held.items():
        if node not in source_set and node not in dead and node not in leaves:
            for block in wanted.intersection(blocks):
                candidates[block].append(node)
    children = _children_of(plan, dead, candidates, parts)  # per (candidate, unit)
    rack = rack_of(labels)
    source_load = dict.fromkeys(sources, 0)
    moved: dict[tuple[str, int, Chunks], str | None] = {}  # (receiver, unit) -> new parent; None: drop it
    # Per unit, its holders not known to be full yet: a full one is looked at once, not by every later orphan
    # (thousands of orphans past thousands of full holders: seconds of the control plane's event loop).
    open_holders: dict[tuple[int, Chunks], dict[str, None]] = {}
    for rx, a in orphans:
        changed.add(rx)
        if a.block in held.get(rx, ()):
            moved[rx, a.block, a.chunks] = None
            continue
        mine = rack(rx)
        pool = open_holders.get((a.block, a.chunks))
        if pool is None:
            pool = open_holders[a.block, a.chunks] = dict.fromkeys(candidates[a.block])
        parent, best, seen, full = None, (True, fanout), 0, []
        for n in pool:  # the first best (same rack first, then fewest children) of the first holders with a
            if n == rx:  # free slot looked at, stopping at one that nothing beats
                continue
            key = (rack(n) != mine or mine is None, children[n, a.block, a.chunks])
            if key[1] >= fanout:
                full.append(n)
                continue
            if parent is None or key < best:
                parent, best = n, key
            seen += 1
            if key == (mine is None, 0) or seen >= REPAIR_CANDIDATES:
                break
        for n in full:
            del pool[n]
        if parent is not None:
            children[parent, a.block, a.chunks] = best[1] + 1
            if best[1] + 1 >= fanout:
                del pool[parent]
        else:
            near = [s for s in sources if mine is not None and rack(s) == mine] or sources
            parent = min(near, key=source_load.__getitem__)
            source_load[parent] += 1
        moved[rx, a.block, a.chunks] = parent
        changed.add(parent)
    # A receiver that serves a block it holds, or whose fetch of a unit of a block it holds was dropped,
    # stops fetching every unit of that block (its old parents serve it less) and is listed as holding it.
    for (rx, block, _), parent in list(moved.items()):
        holder = rx if parent is None else parent
        if holder not in source_set and holder in plan.assignments:
            for a in plan.assignments[holder]:
                if a.block == block and (holder, block, a.chunks) not in moved:
                    moved[holder, block, a.chunks] = None
                    changed.add(a.parent)
    serving: dict[str, set[int]] = {}
    for (rx, block, _), parent in moved.items():
        holder = rx if parent is None else parent
        if holder not in source_set and (parent is None or parent in held):
            serving.setdefault(holder, set()).add(block)
    return moved, serving


def reroute(plan: Plan, *, child: str | None, peer: str, block: int, held: Mapping[str, Collection[int]],
            labels: Mapping[str, Mapping[str, str]] | None = None, fanout: int = 2,
            parts: Mapping[str, Part] | None = None, leaves: Collection[str] = (),
            others: Collection[int] = ()) -> tuple[Plan, set[str]]:
    """``plan`` after ``child`` reported ``peer``, a receiver of the plan, bad for ``block`` (it served data that
    failed verification, or failed): changed only where it must be; with the nodes whose parts changed.
    ``others``: more blocks whose fetches by ``child`` from ``peer`` move likewise, the peer keeping them (a peer
    that failed the child would fail it for those too); never back to the peer.
    ``child`` None: the peer lost the block otherwise (a child of another plan reported it, or it dropped it);
    then only what follows for the peer and its children of the block here changes, the peer's new fetch of
    the block whole where no child's units tell them.

    The peer no longer counts as holding the block (``held``, verified blocks per node, is taken without it).
    The child's fetches of the block from the peer go to a holder of the block or a source, as
    :func:`repair_deaths` places a dead parent's. A peer that no longer fetches the block (it served it as a
    holder) fetches it again, last, in the child's units, likewise from a holder or a source, and all its
    children for the block move so (they would wait on that last fetch). Every other fetch stays: a peer
    that still fetches the block keeps relaying it to its other children. Holders and sources never wait,
    so no cycle can form. ``parts`` (the plan's) spares a pass over the plan; the result is the same. No fetch
    moves to one of ``leaves`` (demoted stragglers).
    """
    if peer not in plan.assignments:
        raise PlanError(f"reroute: {peer!r} is no receiver of the plan")
    mine = [a for a in plan.assignments.get(child, ()) if a.block == block] if child is not None else []
    if child is not None and not any(a.parent == peer for a in mine):
        raise PlanError(f"reroute: {child!r} fetches no unit of block {block} from {peer!r}")
    held = {**held, peer: set(held.get(peer, ())) - {block} - set(others)}  # no candidate for them either
    refetch = not any(a.block == block for a in plan.assignments[peer])
    if refetch:
        kids: Collection[str] = (dict.fromkeys(c for b, c in parts[peer].serve if b == block)
                                 if parts is not None and peer in parts else plan.assignments.keys())
    else:
        kids = (child,) if child is not None else ()
    orphans = [(rx, a) for rx in kids for a in plan.assignments[rx] if a.block == block and a.parent == peer]
    if child is not None and others:
        more = set(others) - {block}
        orphans += [(child, a) for a in plan.assignments[child] if a.block in more and a.parent == peer]
    units = [a.chunks for a in mine] or [None]
    # The peer's new fetches are placed as orphans are; nothing fetches them, so they go last in its list.
    orphans += [(peer, Fetch(block, peer, chunks)) for chunks in units] if refetch else []
    changed = {peer}
    moved, serving = _rehome(plan, orphans, dead=set(), held=held, sources=plan.sources, labels=labels,
                             fanout=fanout, parts=parts, changed=changed, leaves=leaves)
    new, changed = _without(plan, set(), moved, serving, changed, plan.sources)
    assignments, kept = new.assignments, dict(new.held)
    if refetch:
        assignments[peer] = [*assignments[peer], *(Fetch(block, moved[peer, block, c], c) for c in units)]
        rest = tuple(b for b in kept.pop(peer, ()) if b != block)
        if rest:
            kept[peer] = rest
    return Plan(plan.strategy, plan.sources, assignments, kept), changed


class _Children(dict):
    """Children per (node, block, chunks) in ``plan`` among the live receivers, counted for every unit of a node
    on the first use of one, from the node's part (its children, then their fetches): a repair looks at a few
    candidates, each for many units (counting a unit at a time went over the node's children once per unit:
    ~35 ms of a relay's repair at 5,000 receivers)."""

    def __init__(self, plan: Plan, dead: set[str], parts: Mapping[str, Part]):
        super().__init__()
        self._plan, self._dead, self._parts = plan, dead, parts
        self._counted: set[str] = set()

    def __missing__(self, key: tuple[str, int, Chunks]) -> int:
        node = key[0]
        if node not in self._counted:
            self._counted.add(node)
            part = self._parts.get(node)
            for child in {child for _, child in part.serve if child not in self._dead} if part else ():
                for a in self._plan.assignments[child]:
                    if a.parent == node:
                        unit = (node, a.block, a.chunks)
                        self[unit] = self.get(unit, 0) + 1
        return self.setdefault(key, 0)


def _children_of(plan: Plan, dead: set[str], candidates: Mapping[int, list[str]],
                 parts: Mapping[str, Part] | None) -> dict[tuple[str, int, Chunks], int]:
    """Children per (candidate, block, chunks) among the live receivers: from ``parts`` as they are asked
    for, else counted in one pass over the plan (0 where a candidate has none)."""
    if parts is not None:
        return _Children(plan, dead, parts)
    holding = {(node, block) for block, nodes in candidates.items() for node in nodes}
    children: collections.defaultdict[tuple[str, int, Chunks], int] = collections.defaultdict(int)
    for rx, fetches in plan.assignments.items() if holding else ():
        if rx not in dead:
            for a in fetches:
                if (a.parent, a.block) in holding:
                    children[a.parent, a.block, a.chunks] += 1
    return children


def _orphans(plan: Plan, dead: set[str], changed: set[str],
             parts: Mapping[str, Part] | None) -> list[tuple[str, Fetch[str]]]:
    """Every fetch from a dead parent, with its receiver, in the plan's order; adds the dead receivers'
    parents to ``changed`` (they no longer serve them)."""
    for node in dead:
        changed.update(a.parent for a in plan.assignments.get(node, ()))
    if parts is None:
        kids: Collection[str] = plan.assignments.keys()
    else:
        rank = {rx: i for i, rx in enumerate(plan.assignments)}
        kids = sorted({child for node in dead if node in parts for _, child in parts[node].serve}, key=rank.__getitem__)
    return [(rx, a) for rx in kids if rx not in dead for a in plan.assignments[rx] if a.parent in dead]


def _without(plan: Plan, dead: set[str], moved: Mapping[tuple[str, int, Chunks], str | None],
             serving: Mapping[str, set[int]], changed: set[str], sources: Sequence[str]) -> tuple[Plan, set[str]]:
    """``plan`` from ``sources`` without the ``dead``, with the ``moved`` fetches (receiver, block, chunks)
    re-parented (None: dropped) and the ``serving`` holders' blocks listed as held. A receiver or holder among
    ``sources`` is neither any more (a source holds every block)."""
    assignments = {}
    source_set = set(sources)
    for rx, fetches in plan.assignments.items():
        if rx in dead or rx in source_set:
            continue
        if rx in changed:
            fetches = [Fetch(a.block, moved[key], a.chunks) if (key := (rx, a.block, a.chunks)) in moved else a
                       for a in fetches]
            fetches = [a for a in fetches if a.parent is not None]
        assignments[rx] = fetches
    kept = {node: set(blocks) for node, blocks in plan.held.items() if node not in dead and node not in source_set}
    for node, blocks in serving.items():
        kept.setdefault(node, set()).update(blocks)
    return Plan(plan.strategy, tuple(sources), assignments,
                {node: tuple(sorted(blocks)) for node, blocks in kept.items() if blocks}), changed


def drop_held(plan: Plan, held: Mapping[str, Collection[int]]) -> Plan:
    """``plan``, just made, without its receivers' fetches of the blocks they hold already (``held``: verified
    blocks per node), each listed as holding the blocks it no longer fetches (its children fetch them from
    it at once); a receiver left with nothing to fetch leaves the plan. What :func:`replan` makes of such a
    plan, since it keeps every parent there (each is a source, holds the block, or fetches the unit
    earlier), in one pass over the receivers that hold blocks instead of a re-plan of every fetch."""
    sources = set(plan.sources)
    assignments = dict(plan.assignments)
    kept = {node: set(blocks) for node, blocks in plan.held.items()}
    for rx, have in held.items():
        fetches = assignments.get(rx)
        if not have or fetches is None or rx in sources:
            continue
        rest = [a for a in fetches if a.block not in have]
        if len(rest) == len(fetches):
            continue
        kept.setdefault(rx, set()).update(a.block for a in fetches if a.block in have)
        if rest:
            assignments[rx] = rest
        else:
            del assignments[rx]
    return Plan(plan.strategy, plan.sources, assignments,
                {node: tuple(sorted(blocks)) for node, blocks in kept.items() if blocks})


def splice(plan: Plan, gone: Collection[str]) -> Plan:
    """``plan`` with the slot each ``gone`` receiver leaves, per unit, taken by its first child for the unit: that
    child fetches the unit instead from the node the gone one fetched it from (further up while that one is gone
    too and the gone one was its first child). In a chain its child then follows its parent. The gone node's other
    children, and a fetch of a unit it held or got in other units, keep their gone parent (for :func:`replan` to
    place where a sender has a free slot): no sender gets more children for a unit than it had."""
    gone = set(gone)
    up = {node: {(a.block, a.chunks): a.parent for a in plan.assignments[node]}
          for node in gone if node in plan.assignments}
    heirs: dict[tuple[str, tuple[int, Chunks]], str] = {}  # (gone node, unit) -> its first child for the unit
    for rx, fetches in plan.assignments.items():
        for a in fetches:
            if a.parent in gone:
                heirs.setdefault((a.parent, (a.block, a.chunks)), rx)

    def slot(rx: str, a: Fetch[str]) -> str:
        # Up through gone parents only while each was its own parent's first child: one heir per slot.
        node, parent, unit, seen = rx, a.parent, (a.block, a.chunks), set()
        while parent in up and parent not in seen and unit in up[parent] and heirs[parent, unit] == node:
            seen.add(parent)
            node, parent = parent, up[parent][unit]
        return parent

    assignments = {rx: [a if a.parent not in gone else Fetch(a.block, slot(rx, a), a.chunks) for a in fetches]
                   if rx not in gone else list(fetches)
                   for rx, fetches in plan.assignments.items()}
    return Plan(plan.strategy, plan.sources, assignments, dict(plan.held))


# Plans up to this many receivers are re-planned whole (~10-25 ms at 64 in units) when a receiver dies or
# straggles; a larger one is repaired in place when a receiver dies (its stragglers are left as they are:
# re-planning it would hold the control plane's event loop for 0.1-1 s).
INLINE_REPLAN_MAX_RECEIVERS = 64


def repair(plan: Plan, *, dead: Collection[str], held: Mapping[str, Collection[int]], sources: Sequence[str],
           labels: Mapping[str, Mapping[str, str]] | None = None, fanout: int = 2,
           parts: Mapping[str, Part] | None = None, leaves: Collection[str] = ()) -> tuple[Plan, set[str] | None]:
    """``plan`` without the ``dead``, as the control plane repairs it; with the nodes whose parts changed
    (None: any may have). In a plan of up to :data:`INLINE_REPLAN_MAX_RECEIVERS` receivers each dead node's
    first child per unit takes the slot it leaves (:func:`splice`, its parent's for the unit), its other children
    go to senders with a free slot for the unit (no sender gets more children for a unit than the plan gives
    any: :func:`unit_fanout`; in a chain, no sender gets a second child); a larger one is repaired in place
    (:func:`repair_deaths`: their children go to holders of the block, or to a source; ``parts``, the plan's,
    make that faster); a dead source means a re-plan from the ``sources`` left (:func:`replan`) in a plan of up
    to that size, a repair in place beyond. ``leaves`` (demoted stragglers) get no children in a re-plan
    but later leaves (:func:`replan`)."""
    dead = set(dead)
    if len(plan.assignments) <= INLINE_REPLAN_MAX_RECEIVERS:
        if dead & set(plan.sources):
            return replan(plan, dead=dead, held=held, sources=sources, labels=labels, fanout=fanout,
                          leaves=leaves), None
        return replan(splice(plan, dead), dead=dead, held=held, sources=sources, labels=labels,
                      fanout=unit_fanout(plan, leaves=leaves), leaves=leaves), None
    repaired = repair_deaths(plan, dead=dead, held=held, labels=labels, fanout=fanout, parts=parts, sources=sources)
    if repaired is not None:
        return repaired
    return replan(plan, dead=dead, held=held, sources=sources, labels=labels, fanout=fanout, leaves=leaves), None


def unit_fanout(plan: Plan, leaves: Collection[str] = ()) -> int:
    """The most children a receiver of ``plan`` sends one unit to (1 in a chain, the tree's fanout in a tree,
    d - 1 in a binomial pipeline of a d-cube: a slot forwards a unit across several dimensions; at least 1): the
    slots a re-plan may give a parent that lost a child. ``leaves`` (demoted stragglers, feeding other leaves
    only) are not counted."""
    counts: dict[tuple[str, int, Chunks], int] = {}
    skip = set(plan.sources) | set(leaves)
    for fetches in plan.assignments.values():
        for a in fetches:
            if a.parent not in skip:
                key = (a.parent, a.block, a.chunks)
                counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=1)


def parts_of(plan: Plan, nodes: Collection[str], old: Mapping[str, Part] | None = None) -> dict[str, Part]:
    """The parts of ``nodes`` as :meth:`Plan.parts` gives them (nodes without one left out), in one pass; with
    ``old``, the parts of the plan ``plan`` was repaired from where only ``nodes`` changed, without a pass
    over the plan: a node's children now are its old ones and the changed receivers."""
    nodes = set(nodes)
    serving: dict[str, list[tuple[int, str]]] = {}
    if old is None:
        receivers: Collection[str] = plan.assignments.keys()
    else:
        rank = {rx: i for i, rx in enumerate(plan.assignments)}
        candidates = {child for node in nodes if node in old for _, child in old[node].serve} | nodes
        receivers = sorted(candidates & rank.keys(), key=rank.__getitem__)
    for rx in receivers:
        add_serving(serving, rx, plan.assignments[rx], nodes)
    out = {}
    for node in nodes:
        fetch, serve = plan.assignments.get(node), serving.get(node)
        if fetch is not None or serve or node in plan.sources:
            out[node] = Part(tuple(fetch or ()), tuple(serve or ()))
    return out
