"""Repairing a multicast plan after nodes fail, leave or join: new parents for the blocks still missing.

Pure: from the old plan and what the control plane knows now (dead nodes, verified blocks per node,
sources) to a new :class:`~control_plane.planner.plan.Plan`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from control_plane.planner.plan import Fetch, Plan, PlanError
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
