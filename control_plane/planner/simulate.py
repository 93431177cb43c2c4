"""A small discrete-event simulator of a multicast plan, to compare strategies without a network.

The model, kept simple on purpose:

- every node has a full-duplex link of the same rate (or a share of it: ``rates``, e.g. a straggler), or
  several (``links``: a store whose egress is L links' worth); only uplinks are contended, since a receiver
  fetches one unit (a block or a chunk range of one) at a time, strictly in plan order, and so its downlink
  carries one stream; a rack's uplink may carry fewer chunks at once than its nodes send (``racks``);
- each of a node's uplinks sends one chunk at a time to one of the children fetching from it whose next
  chunk it already holds and that no other uplink is sending to: by default taking turns (round robin),
  so concurrent children share the uplinks equally, as TCP flows would; with ``serve="earliest"`` the
  child whose current fetch comes earliest in its own fetch list (the one furthest behind) instead,
  which a sender can do knowing only the plan;
- a receiver forwards a chunk once the whole chunk has arrived (cut-through at chunk granularity): any
  chunk of a unit it holds, and those of the unit it is fetching that have arrived, to a child fetching
  that unit or a range within it;
- sources hold every block and the plan's holders their held blocks from time 0; a chunk arrives
  ``hop_latency_s`` after it left its sender's uplink (0 by default), which is free for the next chunk
  meanwhile; there is no per-message cost and no verification time.

A receiver asks for a unit once it holds the one before, so with a hop latency each unit's first chunk
comes a hop after the last one's. So a chain finishes in S/B + (N-1)c/B, unicast from one source in
N*S/B, and a binomial pipeline of k equal units to 2^d - 1 receivers in about (k+d)/k * S/B. That last
figure needs the plan's round rhythm: with fair sharing and more than three chunks per unit, receivers
that finish a fetch early start the next one while their parent still sends an earlier round's unit, and
the lag grows round after round (1.8 * S/B for 31 receivers, 32 blocks of 4 chunks); ``serve="earliest"``
keeps the rhythm (1.19). The cost is one heap event per chunk transferred, plus a scan of the sender's
waiting children. No schedule beats :func:`lower_bound`.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence

from control_plane.planner.plan import Plan, PlanError, UnitIndex, unit_name
from control_plane.planner.replan import repair


SERVE_POLICIES = ("fair", "earliest")
# Fitted to this project's emulated cluster (netns, TCP, 1 MiB chunks), checked against its measured runs at
# N = 4, 8 and 16 (README): each hop's first block starts ~16 ms after its parent's (the manifest and small
# files come first, each hop fetching them from its parent), and a transfer takes 2.5% more than S/B
# (TCP/IP headers on the shaped link: the payload gets 97.5% of it).
CALIBRATED_START_DELAY_S = 0.016
CALIBRATED_GOODPUT = 0.975
# Event kinds: a chunk left its sender's uplink; it reached its receiver; a receiver is ready to fetch its
# first unit; a receiver dies; the control plane re-plans around the dead.
SENT, ARRIVED, STARTED, DIED, REPLANNED = 0, 1, 2, 3, 4
HOLDS = -1  # where a fetch's parent gets the unit: it holds it from the start (a source, a holder)


def simulate(plan: Plan, block_bytes: int | Sequence[int], link_bytes_per_s: float, chunk_bytes: int, *,
             serve: str = "fair", links: Mapping[str, int] | None = None,
             hop_latency_s: float = 0.0, start_delay_s: float = 0.0,
             rates: Mapping[str, float] | None = None, racks: Mapping[str, str] | None = None,
             rack_uplinks: int = 0, failures: Mapping[str, float] | None = None,
             detect_s: float = 0.0) -> dict[str, float]:
    """Seconds from the start until each receiver of ``plan`` holds all its units.

    ``block_bytes`` is one size for every block or a size per block index; chunk c of block b is its bytes
    c * ``chunk_bytes`` up to (c + 1) * ``chunk_bytes`` or the block's end. ``serve`` is how an uplink
    picks among waiting children (see the module docstring); ``links`` gives a node's uplinks at
    ``link_bytes_per_s`` each (default 1); ``hop_latency_s`` delays each chunk's arrival; a receiver asks for
    its first unit ``start_delay_s`` x its depth after the start (depth: hops from a source or holder along
    each first fetch's parent, what agents spend on the manifest and small files hop by hop); ``rates`` gives
    a node's link, both ways, as a share of ``link_bytes_per_s`` (default 1: mixed links, e.g. a straggler at
    0.25), and a chunk moves at the slower end's rate; with ``racks`` (a node's rack; nodes not named are
    outside every rack) and ``rack_uplinks`` > 0, a rack's uplink carries that many chunks at once each way
    (its rate over B: a rack of 16 nodes at 4:1 oversubscription has 4), and a chunk between two racks waits
    until both have one free; ``failures`` kills receivers (node -> when: what it has in flight is lost, it
    sends nothing more) and ``detect_s`` after each death the plan is repaired as the control plane repairs it
    (:func:`~control_plane.planner.replan.repair`, from the blocks each receiver holds then); the dead are
    left out of the result. Raises
    :class:`PlanError` if some receivers never finish (the plan deadlocks or names a parent that never gets
    the unit), ValueError for bad numbers or a chunk range past its block's end.
    """
    if hop_latency_s < 0 or start_delay_s < 0:
        raise ValueError(f"simulate: hop latency and start delay must be >= 0, got {hop_latency_s!r} and "
                         f"{start_delay_s!r}")
    if link_bytes_per_s <= 0 or chunk_bytes <= 0:
        raise ValueError(f"simulate: link rate and chunk size must be positive, got {link_bytes_per_s!r} "
                         f"and {chunk_bytes!r}")
    if serve not in SERVE_POLICIES:
        raise ValueError(f"simulate: serve must be one of {', '.join(SERVE_POLICIES)}, got {serve!r}")
    links = dict(links or {})
    share = dict(rates or {})
    rack_of = dict(racks or {}) if rack_uplinks else {}
    if isinstance(rack_uplinks, bool) or not isinstance(rack_uplinks, int) or rack_uplinks < 0:
        raise ValueError(f"simulate: rack uplinks must be a non-negative integer, got {rack_uplinks!r}")
    spare = {(rack, way): rack_uplinks for rack in set(rack_of.values()) for way in ("out", "in")}
    held_up: set[str] = set()  # senders that had a chunk to send but no free rack uplink for it
    if any(not 0 < r <= 1 for r in share.values()):
        raise ValueError(f"simulate: a node's rate share must be within (0, 1], got {sorted(share.items())!r}")
    for node, count in links.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"simulate: links of {node!r} must be a positive integer, got {count!r}")
    failures = dict(failures or {})
    unknown = sorted(set(failures) - plan.assignments.keys())
    if unknown or detect_s < 0 or any(t < 0 for t in failures.values()):
        raise ValueError(f"simulate: failures must name receivers of the plan at times >= 0, and detect_s be "
                         f">= 0; got {sorted(failures.items())!r} and {detect_s!r}")
    size = _block_sizes(plan, block_bytes)
    chunks = {b: math.ceil(s / chunk_bytes) for b, s in size.items()}
    units: dict[str, list[tuple[int, int, int]]] = {}
    parents: dict[str, list[str]] = {}
    feeds: dict[str, list[int | None]] = {}

    def follow(current: Plan) -> None:
        """Take ``current``'s fetches: each as (block, first chunk, end chunk), and where its parent gets that
        unit: the number of the parent's fetch of the unit or of one containing it, HOLDS, or None (never: the
        plan deadlocks)."""
        index: UnitIndex[int] = UnitIndex()
        for rx, items in current.assignments.items():
            units[rx] = []
            for k, a in enumerate(items):
                first, end = a.chunks or (0, chunks[a.block])
                if end > chunks[a.block]:
                    raise ValueError(f"simulate: {rx!r} fetches {unit_name(a.block, a.chunks)}, which has "
                                     f"{chunks[a.block]} chunks")
                units[rx].append((a.block, first, end))
                index.add(rx, a.block, a.chunks, k)
            parents[rx] = [a.parent for a in items]
        sources = set(current.sources)
        for rx, items in current.assignments.items():
            feeds[rx] = [HOLDS if a.parent in sources or a.block in current.held.get(a.parent, ())
                         else index.get(a.parent, a.block, a.chunks) for a in items]

    follow(plan)

    position = dict.fromkeys(units, 0)  # index of the fetch in progress
    got = dict.fromkeys(units, 0)  # chunks of that unit received so far
    requested = dict.fromkeys(units, 0)  # chunks of that unit sent toward it (arrived or on the way)
    ticket = dict.fromkeys(units, 0)  # bumped per fetch: older uplink queue entries are stale
    queues: dict[str, deque[tuple[str, int]]] = {}
    sending: dict[str, int] = {}  # chunks each node has in flight, at most its links
    receiving: set[str] = set()  # children with a chunk in flight: a downlink carries one
    # (when, order, kind, parent, child, the child's ticket when it was scheduled: a chunk of a fetch since
    # moved elsewhere by a re-plan is stale)
    events: list[tuple[float, int, int, str, str, int]] = []
    finished: dict[str, float] = {}
    dead: set[str] = set()
    seq = 0

    def ready(child: str) -> float:
        """Chunks of ``child``'s current unit that its parent can forward now."""
        k = position[child]
        feed = feeds[child][k]
        if feed == HOLDS:
            return math.inf
        if feed is None:
            return 0
        parent = parents[child][k]
        at = position[parent]
        if at != feed:
            return math.inf if at > feed else 0
        # The parent is fetching the unit (or one containing it) now: its chunks arrive in order.
        return max(0, units[parent][at][1] + got[parent] - units[child][k][1])

    def pick(parent: str) -> str | None:
        """The child ``parent`` sends its next chunk to, if any can take one now."""
        queue = queues.get(parent)
        if not queue:
            return None
        chosen, behind = None, math.inf
        for _ in range(len(queue)):
            child, fetch = queue.popleft()
            if ticket[child] != fetch or child in dead:
                continue  # that child has moved on to another fetch, or died
            queue.append((child, fetch))  # to the back: the next pick starts after it (round robin)
            _, first, end = units[child][position[child]]
            if child not in receiving and requested[child] < min(ready(child), end - first):
                if not crossing_free(parent, child):
                    held_up.add(parent)
                    continue
                if serve == "fair":
                    return child
                if position[child] < behind:
                    chosen, behind = child, position[child]
        return chosen

    def crossing(parent: str, child: str) -> tuple[str, str] | None:
        """The racks a chunk from ``parent`` to ``child`` leaves and enters, if it crosses between two."""
        out, into = rack_of.get(parent), rack_of.get(child)
        return (out, into) if out is not None and into is not None and out != into else None

    def crossing_free(parent: str, child: str) -> bool:
        racks_crossed = crossing(parent, child)
        return racks_crossed is None or (spare[racks_crossed[0], "out"] > 0 and spare[racks_crossed[1], "in"] > 0)

    def take_crossing(parent: str, child: str, amount: int) -> None:
        racks_crossed = crossing(parent, child)
        if racks_crossed is not None:
            spare[racks_crossed[0], "out"] -= amount
            spare[racks_crossed[1], "in"] -= amount

    def send(parent: str, now: float) -> None:
        nonlocal seq
        while parent not in dead and sending.get(parent, 0) < links.get(parent, 1):
            child = pick(parent)
            if child is None:
                return
            block, first, _ = units[child][position[child]]
            nbytes = min(chunk_bytes, size[block] - (first + requested[child]) * chunk_bytes)
            sending[parent] = sending.get(parent, 0) + 1
            receiving.add(child)
            requested[child] += 1
            take_crossing(parent, child, 1)
            seq += 1
            rate = link_bytes_per_s * min(share.get(parent, 1.0), share.get(child, 1.0))
            heapq.heappush(events, (now + nbytes / rate, seq, SENT, parent, child, ticket[child]))

    def start(rx: str, now: float) -> None:
        k = position[rx]
        if k == len(units[rx]):
            finished.setdefault(rx, now)
            return
        parent = parents[rx][k]
        queues.setdefault(parent, deque()).append((rx, ticket[rx]))
        send(parent, now)

    def arrive(parent: str, child: str, now: float) -> None:
        got[child] += 1
        _, first, end = units[child][position[child]]
        if got[child] == end - first:
            position[child] += 1
            got[child] = requested[child] = 0
            ticket[child] += 1
            start(child, now)
        send(child, now)  # its own children may be waiting for the chunk that just arrived
        send(parent, now)

    depth: dict[str, int] = {}

    def depth_of(rx: str) -> int:
        if rx not in units or not units[rx]:
            return 0  # a source or a holder
        if rx not in depth:
            depth[rx] = 1 + depth_of(parents[rx][0])  # its first fetch's parent fetches that unit before it
        return depth[rx]

    def replan_around(now: float) -> None:
        """The control plane's repair, ``detect_s`` after a death: the live receivers take their new fetches
        from their first unfinished unit on, keeping the chunks of it they have."""
        nonlocal current
        held = {}
        for rx, items in units.items():
            if rx not in dead:
                done = {block for block, _, _ in items[:position[rx]]}
                held[rx] = done - {block for block, _, _ in items[position[rx]:]}
        current = repair(current, dead=dead, held=held, sources=current.sources)[0]
        now_at = {rx: units[rx][position[rx]] for rx in units if rx not in dead and position[rx] < len(units[rx])}
        old_parent = {rx: parents[rx][position[rx]] for rx in now_at}
        for rx in [rx for rx in units if rx not in current.assignments]:
            del units[rx], parents[rx], feeds[rx]
        follow(current)
        for rx, unit in now_at.items():
            if rx not in units:  # it needs nothing more
                finished.setdefault(rx, now)
                continue
            position[rx] = units[rx].index(unit)
            if parents[rx][position[rx]] != old_parent[rx]:
                ticket[rx] += 1  # a chunk still coming from the old parent is stale
                requested[rx] = got[rx]
                receiving.discard(rx)
                start(rx, now)
        for node in list(queues):
            send(node, now)

    current = plan
    for rx, at in failures.items():
        seq += 1
        heapq.heappush(events, (at, seq, DIED, "", rx, 0))
    for rx in units:
        if start_delay_s:
            seq += 1
            heapq.heappush(events, (start_delay_s * depth_of(rx), seq, STARTED, "", rx, 0))
        else:
            start(rx, 0.0)
    while events:
        now, _, kind, parent, child, held_ticket = heapq.heappop(events)
        if kind == STARTED:
            start(child, now)
            continue
        if kind == DIED:
            dead.add(child)
            seq += 1
            heapq.heappush(events, (now + detect_s, seq, REPLANNED, "", child, 0))
            continue
        if kind == REPLANNED:
            replan_around(now)
            continue
        stale = child in dead or held_ticket != ticket[child]
        if kind == ARRIVED:
            if not stale:
                arrive(parent, child, now)
            continue
        sending[parent] -= 1
        if not stale:
            receiving.discard(child)
        if parent in dead and not stale:  # its uplink died with it: the chunk never arrives
            requested[child] -= 1
            stale = True
        if crossing(parent, child) is not None:
            take_crossing(parent, child, -1)
            for sender in sorted(held_up - {parent}):  # a rack uplink came free: who waited for one tries again
                held_up.discard(sender)
                send(sender, now)
        if stale:
            send(parent, now)
        elif hop_latency_s:
            seq += 1
            heapq.heappush(events, (now + hop_latency_s, seq, ARRIVED, parent, child, held_ticket))
            send(parent, now)  # its uplink is free for the next chunk while this one travels
        else:
            arrive(parent, child, now)
    for node in dead:
        finished.pop(node, None)
    stuck = sorted(set(units) - dead - finished.keys())
    if stuck:
        rx = stuck[0]
        a = current.assignments[rx][position[rx]]
        raise PlanError(f"plan deadlocks in simulation: {len(stuck)} receiver(s) never finish, e.g. {rx!r} "
                        f"waiting for {unit_name(a.block, a.chunks)} from {a.parent!r}")
    return finished


def lower_bound(plan: Plan, block_bytes: int | Sequence[int], link_bytes_per_s: float, chunk_bytes: int, *,
                links: Mapping[str, int] | None = None, hop_latency_s: float = 0.0,
                start_delay_s: float = 0.0) -> float:
    """Seconds before which no schedule of ``plan``'s fetches, in :func:`simulate`'s model with the same
    arguments, gets every receiver its units: the fluid bound.

    A receiver's downlink carries one chunk at a time, so the one fetching the most bytes, S, finishes no
    earlier than S/B plus a hop's latency. Where one source with one uplink and no holders feeds two
    receivers or more, every receiver but the one the source serves first starts getting bytes only once
    the source's first chunk has left, no earlier than c/B for c the smallest first chunk of a unit fetched
    from the source: the one of them fetching the most bytes, S, finishes no earlier than (S + c)/B plus a
    hop. Every receiver starts ``start_delay_s`` or later.
    """
    size = _block_sizes(plan, block_bytes)

    def unit_bytes(block: int, chunks: tuple[int, int] | None) -> int:
        first, end = chunks or (0, math.ceil(size[block] / chunk_bytes))
        return min(end * chunk_bytes, size[block]) - first * chunk_bytes

    fetched = sorted((sum(unit_bytes(a.block, a.chunks) for a in items)
                      for items in plan.assignments.values() if items), reverse=True)
    if not fetched:
        return 0.0
    bound = fetched[0] / link_bytes_per_s
    source, *others = plan.sources
    if not others and not plan.held and (links or {}).get(source, 1) == 1 and len(fetched) > 1:
        starts = {(a.block, a.chunks[0] if a.chunks else 0) for items in plan.assignments.values()
                  for a in items if a.parent == source}
        first = min((unit_bytes(block, (c, c + 1)) for block, c in starts), default=0)
        bound = max(bound, (fetched[1] + first) / link_bytes_per_s)
    return bound + hop_latency_s + start_delay_s


def _block_sizes(plan: Plan, block_bytes: int | Sequence[int]) -> dict[int, int]:
    """The size of each block ``plan`` fetches; ValueError unless each is given and positive."""
    blocks = {a.block for items in plan.assignments.values() for a in items}
    if not isinstance(block_bytes, int) and blocks and max(blocks) >= len(block_bytes):
        raise ValueError(f"simulate: block_bytes gives {len(block_bytes)} sizes; the plan fetches block "
                         f"{max(blocks)}")
    size = {b: block_bytes if isinstance(block_bytes, int) else block_bytes[b] for b in blocks}
    if any(s <= 0 for s in size.values()):
        raise ValueError("simulate: block sizes must be positive")
    return size
