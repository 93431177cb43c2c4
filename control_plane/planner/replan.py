"""Repairing a multicast plan after nodes fail, leave or join: new parents for the blocks still missing.

Pure: from the old plan and what the control plane knows now (dead nodes, verified blocks per node,
sources) to a new :class:`~control_plane.planner.plan.Plan`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from control_plane.planner.plan import Fetch, Part, Plan, PlanError
from control_plane.planner.racks import ParentPool, rack_of


def replan(plan: Plan, *, dead: Collection[str], held: Mapping[str, Collection[int]], sources: Sequence[str],
           labels: Mapping[str, Mapping[str, str]] | None = None, fanout: int = 2,
           joined: Sequence[str] = (), num_blocks: int | None = None) -> Plan:
    """A plan for exactly the blocks each live receiver still misses.

    A receiver of ``plan`` still needs its planned blocks minus those in ``held`` (verified blocks per
    live node); a ``joined`` receiver needs blocks ``0..num_blocks-1`` minus those it holds. Dead
    receivers, receivers now among ``sources`` and receivers that need nothing leave the plan. Each
    receiver keeps its old fetch order, and its old parent wherever that parent is alive and holds the
    block, is a source, or still fetches the block (earlier). Otherwise the new parent is the earliest
    node with fewer than ``fanout`` children for that block (kept children count) that holds it or
    fetches it earlier in the new plan, one in the receiver's rack first, else the least loaded source
    (same rack first). Never a dead parent, never a cycle, never a block fetched that is already held.
    Non-source nodes serving blocks they hold are listed in the new plan's ``held``.
    """
    dead, sources = set(dead), tuple(sources)
    source_set = set(sources)
    if not sources:
        raise PlanError("replan: no sources to plan from")
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

    # Each remaining fetch keeps its old level (a topological order of the old plan), so kept parents
    # stay earlier than their children; joined receivers come after everything, interleaved so that one
    # joined receiver may fetch a block from another that is earlier in `joined`.
    levels = plan.fetch_levels()
    needs: list[tuple[int, str, int, str | None]] = []
    for rx, fetches in plan.assignments.items():
        if rx in dead or rx in source_set:
            continue
        have = holds.get(rx, ())
        needs.extend((level, rx, a.block, a.parent) for a, level in zip(fetches, levels[rx]) if a.block not in have)
    after = 1 + max((level for rx_levels in levels.values() for level in rx_levels), default=0)
    for q, rx in enumerate(joined):
        have = holds.get(rx, ())
        missing = [b for b in range(num_blocks or 0) if b not in have]
        needs.extend((after + i * len(joined) + q, rx, b, None) for i, b in enumerate(missing))
    needs.sort()
    scheduled = {(rx, block): level for level, rx, block, _ in needs}

    def keeps(parent: str | None, block: int, level: int) -> bool:
        # Dead nodes are no source (checked above), hold nothing and fetch nothing here. A parent that
        # fetches the block must do so earlier: an old source that rejoined fetches after everyone.
        return parent is not None and (parent in source_set or block in holds.get(parent, ())
                                       or scheduled.get((parent, block), level) < level)

    kept: dict[tuple[str, int], int] = {}
    for level, _, block, parent in needs:
        if keeps(parent, block, level) and parent not in source_set:
            kept[parent, block] = kept.get((parent, block), 0) + 1

    rack = rack_of(labels)
    holders: dict[int, list[str]] = {}
    for node, blocks in holds.items():
        if node not in source_set:
            for block in blocks:
                holders.setdefault(block, []).append(node)
    pools: dict[int, ParentPool] = {}
    source_load = dict.fromkeys(sources, 0)
    serving: dict[str, set[int]] = {}
    assignments: dict[str, list[Fetch[str]]] = {}
    for level, rx, block, old in needs:
        pool = pools.get(block)
        if pool is None:
            pool = pools[block] = ParentPool(rack)
            for node in holders.get(block, ()):
                pool.add(node, fanout - kept.get((node, block), 0), time=-1)
        parent = old if keeps(old, block, level) else pool.take(rack(rx), before=level)
        if parent is None:
            mine = rack(rx)
            near = [s for s in sources if mine is not None and rack(s) == mine] or sources
            parent = min(near, key=source_load.__getitem__)
        if parent in source_set:
            source_load[parent] += 1
        elif (parent, block) not in scheduled:
            serving.setdefault(parent, set()).add(block)
        assignments.setdefault(rx, []).append(Fetch(block, parent))
        pool.add(rx, fanout - kept.get((rx, block), 0), time=level)
    return Plan(plan.strategy, sources, assignments,
                {node: tuple(sorted(blocks)) for node, blocks in serving.items()})


def repair_deaths(plan: Plan, *, dead: Collection[str], held: Mapping[str, Collection[int]],
                  labels: Mapping[str, Mapping[str, str]] | None = None,
                  fanout: int = 2) -> tuple[Plan, set[str]] | None:
    """The plan without the ``dead`` receivers, changed only where it must be; with the nodes whose parts
    changed. None when a source died (then :func:`replan` plans again from the sources left).

    What :func:`replan` does in time proportional to the whole plan (every fetch re-levelled and
    re-parented) this does in a few passes over it, so a relay's death in a plan of thousands of workers
    is repaired without stalling the control plane. Each fetch from a dead parent goes to a node that
    already holds the block (``held``: verified blocks per node; a receiver among them stops fetching that
    block and serves it as a holder), one in the receiver's rack first, with fewer than ``fanout``
    children for it; else to the least loaded source (same rack first). A holder never waits, so no
    cycle can form. A receiver's fetch of a block it already holds is dropped. Every other fetch keeps its
    parent: the dead nodes' children get new parents, their descendants keep theirs.
    """
    dead = set(dead)
    source_set = set(plan.sources)
    if dead & source_set:
        return None
    holds = {node: set(blocks) for node, blocks in held.items() if node not in dead}
    changed = set(dead) & (plan.assignments.keys() | plan.held.keys())
    orphans: list[tuple[str, int]] = []
    for rx, fetches in plan.assignments.items():
        if rx in dead:
            changed.update(a.parent for a in fetches)  # they no longer serve it
            continue
        orphans.extend((rx, k) for k, a in enumerate(fetches) if a.parent in dead)
    if not orphans:
        return (plan, set()) if not changed else _without(plan, dead, {}, {}, changed)
    wanted = {plan.assignments[rx][k].block for rx, k in orphans}
    candidates: dict[int, list[str]] = {b: [] for b in wanted}
    for node, blocks in holds.items():
        if node not in source_set:
            for block in wanted & blocks:
                candidates[block].append(node)
    children = {(node, block): 0 for block, nodes in candidates.items() for node in nodes}
    for rx, fetches in plan.assignments.items():
        if rx not in dead:
            for a in fetches:
                key = (a.parent, a.block)
                if key in children:
                    children[key] += 1
    rack = rack_of(labels)
    source_load = dict.fromkeys(plan.sources, 0)
    moved: dict[tuple[str, int], str | None] = {}  # (receiver, block) -> new parent; None: drop the fetch
    for rx, k in orphans:
        block = plan.assignments[rx][k].block
        changed.add(rx)
        if block in holds.get(rx, ()):
            moved[rx, block] = None
            continue
        mine = rack(rx)
        free = [n for n in candidates[block] if n != rx and children[n, block] < fanout]
        if free:
            parent = min(free, key=lambda n: (rack(n) != mine or mine is None, children[n, block]))
            children[parent, block] += 1
        else:
            near = [s for s in plan.sources if mine is not None and rack(s) == mine] or plan.sources
            parent = min(near, key=source_load.__getitem__)
            source_load[parent] += 1
        moved[rx, block] = parent
        changed.add(parent)
    # A receiver that serves a block it holds stops fetching it (its old parent serves one fewer) and is
    # listed as holding it, as is a receiver whose fetch of a block it holds was dropped.
    for (rx, block), parent in list(moved.items()):
        if parent is not None and parent not in source_set and parent in plan.assignments:
            for a in plan.assignments[parent]:
                if a.block == block and (parent, block) not in moved:
                    moved[parent, block] = None
                    changed.add(a.parent)
    serving: dict[str, set[int]] = {}
    for (rx, block), parent in moved.items():
        holder = rx if parent is None else parent
        if holder not in source_set and (parent is None or parent in holds):
            serving.setdefault(holder, set()).add(block)
    return _without(plan, dead, moved, serving, changed)


def _without(plan: Plan, dead: set[str], moved: Mapping[tuple[str, int], str | None],
             serving: Mapping[str, set[int]], changed: set[str]) -> tuple[Plan, set[str]]:
    """``plan`` without the ``dead``, with the ``moved`` fetches re-parented (None: dropped) and the
    ``serving`` holders' blocks listed as held."""
    assignments = {}
    for rx, fetches in plan.assignments.items():
        if rx in dead:
            continue
        if rx in changed:
            fetches = [Fetch(a.block, moved[rx, a.block]) if (rx, a.block) in moved else a for a in fetches]
            fetches = [a for a in fetches if a.parent is not None]
        assignments[rx] = fetches
    kept = {node: set(blocks) for node, blocks in plan.held.items() if node not in dead}
    for node, blocks in serving.items():
        kept.setdefault(node, set()).update(blocks)
    return Plan(plan.strategy, plan.sources, assignments,
                {node: tuple(sorted(blocks)) for node, blocks in kept.items() if blocks}), changed


def parts_of(plan: Plan, nodes: Collection[str]) -> dict[str, Part]:
    """The parts of ``nodes`` as :meth:`Plan.parts` gives them (nodes without one left out), in one pass."""
    nodes = set(nodes)
    serving: dict[str, list[tuple[int, str]]] = {}
    for rx, fetches in plan.assignments.items():
        for a in fetches:
            if a.parent in nodes:
                serving.setdefault(a.parent, []).append((a.block, rx))
    out = {}
    for node in nodes:
        fetch, serve = plan.assignments.get(node), serving.get(node)
        if fetch is not None or serve or node in plan.sources:
            out[node] = Part(tuple(fetch or ()), tuple(serve or ()))
    return out
