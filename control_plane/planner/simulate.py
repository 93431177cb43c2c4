"""A small discrete-event simulator of a multicast plan, to compare strategies without a network.

The model, kept simple on purpose:

- every node has a full-duplex link of the same rate (or a share of it: ``rates``, e.g. a straggler), or
  several (``links``: a store whose egress is L links' worth), each way one chunk at a time (a chunk moves at
  the slower end's rate, but takes its sender's uplink only for the time the uplink's own rate needs: toward a
  slower receiver the uplink serves other children while that one's downlink drains the chunk, as a fluid
  share would); a receiver fetches its units (blocks or chunk ranges of them) in plan order, one at a time by
  default, or up to ``concurrency`` at once from different parents as agents do (one at a time per parent, the
  first unfinished one always), its downlink still taking one chunk at a time from any of them; a rack's
  uplink may carry fewer chunks at once than its nodes send (``racks``);
- each of a node's uplinks sends one chunk at a time to one of the children fetching from it whose next
  chunk it already holds and that no other uplink is sending to: by default taking turns (round robin),
  so concurrent children share the uplinks equally, as TCP flows would; with ``serve="earliest"`` the
  child whose current fetch comes earliest in its own fetch list (the one furthest behind) instead,
  which a sender can do knowing only the plan;
- a receiver forwards a chunk once the whole chunk has arrived (cut-through at chunk granularity): any
  chunk of a unit it holds, and those of the unit it is fetching that have arrived, to a child fetching
  that unit or a range within it; with ``relay_bytes``, as the agents' TCP relays do, once the chunk's first
  piece of that many bytes has arrived, the forward then ending no sooner than a piece after the chunk
  itself has arrived (its last piece goes once the chunk is whole);
- sources hold every block and the plan's holders their held blocks from time 0; a chunk arrives
  ``hop_latency_s`` after it left its sender's uplink (0 by default), which is free for the next chunk
  meanwhile; there is no per-message cost and no verification time.

One at a time, a receiver asks for a unit once it holds the one before, so with a hop latency each unit's
first chunk comes a hop after the last one's; a request itself takes no time. So a chain finishes in S/B +
(N-1)c/B, unicast from one source in N*S/B, and a binomial pipeline of k equal units to 2^d - 1 receivers in
about (k+d)/k * S/B. That last figure needs the plan's round rhythm: with fair sharing and more than three
chunks per unit, receivers that finish a fetch early start the next one while their parent still sends an
earlier round's unit, and the lag grows round after round (1.8 * S/B for 31 receivers, 32 blocks of 4 chunks);
``serve="earliest"`` keeps the rhythm (1.19). Several units at once from different parents (``concurrency``)
break the rhythm too: the demo model's unit binomial pipeline to 8 receivers, calibrated, takes 1.28 x S/B
four at a time, 1.09 one at a time, against 1.16 measured with agents fetching four at a time, whose requests
take time that overlapping them hides and this model does not charge. The cost is one heap event per chunk
transferred, plus a scan of the sender's waiting children. No schedule beats :func:`lower_bound`.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Collection, Mapping, Sequence

from control_plane.planner.plan import Plan, PlanError, UnitIndex, unit_name
from control_plane.planner.replan import repair


SERVE_POLICIES = ("fair", "earliest")
# Fitted to this project's emulated cluster (netns, TCP, 1 MiB chunks), checked against its measured runs at
# N = 4, 8 and 16 (docs/benchmarks.md): each hop's first block starts ~16 ms after its parent's (its requests,
# the manifest and small files, the shaped link's queue), and a transfer takes 2.5% more than S/B
# (TCP/IP headers on the shaped link: the payload gets 97.5% of it).
CALIBRATED_START_DELAY_S = 0.016
CALIBRATED_GOODPUT = 0.975
# Event kinds: a chunk left its sender's uplink; it reached its receiver; a receiver is ready to fetch its
# first unit; a receiver dies; the control plane re-plans around the dead; a chunk's first piece reached its
# receiver, which may begin to relay it; a sender's uplink has sent its part of a chunk toward a slower
# receiver; that receiver has drained the chunk (a SENT whose uplink was freed already).
SENT, ARRIVED, STARTED, DIED, REPLANNED, RELAYABLE, UPLINK_FREE, DRAINED = 0, 1, 2, 3, 4, 5, 6, 7
HOLDS = -1  # where a fetch's parent gets the unit: it holds it from the start (a source, a holder)


def simulate(plan: Plan, block_bytes: int | Sequence[int], link_bytes_per_s: float, chunk_bytes: int, *,
             serve: str = "fair", links: Mapping[str, int] | None = None,
             hop_latency_s: float = 0.0, start_delay_s: float = 0.0,
             rates: Mapping[str, float] | None = None, racks: Mapping[str, str] | None = None,
             rack_uplinks: int = 0, failures: Mapping[str, float] | None = None,
             detect_s: float = 0.0, concurrency: int = 1, relay_bytes: int = 0) -> dict[str, float]:
    """Seconds from the start until each receiver of ``plan`` holds all its units.

    ``block_bytes`` is one size for every block or a size per block index; chunk c of block b is its bytes c *
    ``chunk_bytes`` up to (c + 1) * ``chunk_bytes`` or the block's end. ``serve`` is how an uplink picks among
    waiting children (see the module docstring); ``links`` gives a node's uplinks at ``link_bytes_per_s`` each
    (default 1); ``hop_latency_s`` delays each chunk's arrival; a receiver asks for its first unit ``start_delay_s``
    x its depth after the start (depth: hops from a source or holder along each first fetch's parent, what each hop
    of the agents adds before its first block); ``rates`` gives a node's link, both ways, as a share of
    ``link_bytes_per_s`` (default 1: mixed links, e.g. a straggler at 0.25), and a chunk moves at the slower end's
    rate, its sender's uplink free again once its own rate has sent it (toward a slower receiver, whose downlink
    then carries the rest); with ``racks`` (a node's rack; nodes not named are outside every rack) and
    ``rack_uplinks`` > 0, a rack's uplink carries that many chunks at once each way (its rate over B: a rack of 16
    nodes at 4:1 oversubscription has 4), and a chunk between two racks waits until both have one free; ``failures``
    kills receivers (node -> when: what it has in flight is lost, it sends nothing more) and ``detect_s`` after each
    death the plan is repaired as the control plane repairs it (:func:`~control_plane.planner.replan.repair`, from
    the blocks each receiver holds then); the dead are left out of the result. ``concurrency``: fetches a receiver
    runs at once from different parents, as an agent does (``agent_fetch_concurrency``; one at a time per parent, in
    plan order, the first unfinished one always), its downlink still carrying one chunk at a time. ``relay_bytes``
    > 0: a receiver passes a chunk on from its first piece of that many bytes (``agent_relay_bytes``; 0: once whole);
    a chunk a dying parent was passing on still reaches the children it was passed to (the agents' children drop it
    and fetch it again, which this model does not charge). Raises :class:`PlanError` if some receivers never finish
    (the plan deadlocks or names a parent that never gets the unit), ValueError for bad numbers or a chunk range
    past its block's end.
    """
    if hop_latency_s < 0 or start_delay_s < 0:
        raise ValueError(f"simulate: hop latency and start delay must be >= 0, got {hop_latency_s!r} and "
                         f"{start_delay_s!r}")
    if link_bytes_per_s <= 0 or chunk_bytes <= 0:
        raise ValueError(f"simulate: link rate and chunk size must be positive, got {link_bytes_per_s!r} "
                         f"and {chunk_bytes!r}")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"simulate: concurrency must be a positive integer, got {concurrency!r}")
    if isinstance(relay_bytes, bool) or not isinstance(relay_bytes, int) or relay_bytes < 0:
        raise ValueError(f"simulate: relay_bytes must be an integer >= 0, got {relay_bytes!r}")
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

    # Each receiver's fetches as an agent runs them: up to ``concurrency`` at once, one at a time per parent,
    # in plan order, the first unfinished one always (a running fetch is a slot taken, waiting for bytes or
    # receiving them); each running fetch has an id, dropped when it ends or a re-plan moves it (a chunk on
    # its way to a dropped id is stale).
    done: dict[str, bytearray] = {}
    oldest: dict[str, int] = {}  # the first unfinished fetch
    running: dict[str, dict[int, int]] = {}  # fetch index -> its id
    busy: dict[str, set[str]] = {}  # parents a fetch runs from
    pending: dict[str, dict[str, deque[int]]] = {}  # per parent, the fetches not started, in plan order
    whose: dict[int, tuple[str, int]] = {}  # fetch id -> (receiver, fetch index)
    got: dict[int, int] = {}  # chunks of its unit received so far, in order
    relayable: dict[int, int] = {}  # chunks of its unit whose first piece arrived (>= got): the receiver may pass on
    lands: dict[int, dict[int, float]] = {}  # when each chunk sent toward it arrives whole, by its place in the unit
    requested: dict[int, int] = {}  # chunks sent toward it (arrived or on the way)
    queues: dict[str, deque[int]] = {}  # per sender, the ids of the fetches from it
    sending: dict[str, int] = {}  # chunks each node has in flight, at most its links
    receiving: set[str] = set()  # children with a chunk in flight: a downlink carries one
    # (when, order, kind, parent, child, the fetch id a chunk is for)
    events: list[tuple[float, int, int, str, str, int]] = []
    finished: dict[str, float] = {}
    dead: set[str] = set()
    started: set[str] = set()  # receivers past their start delay: they ask for units
    seq = ids = 0

    def lay_out(rx: str, finished_units: set[tuple[int, int, int]]) -> None:
        """``rx``'s fetch state for its current units, those in ``finished_units`` done."""
        done[rx] = bytearray(unit in finished_units for unit in units[rx])
        oldest[rx] = next((k for k, flag in enumerate(done[rx]) if not flag), len(units[rx]))
        running[rx], busy[rx], pending[rx] = {}, set(), {}
        for k, parent in enumerate(parents[rx]):
            if not done[rx][k]:
                pending[rx].setdefault(parent, deque()).append(k)

    def ready(fetch: int) -> float:
        """Chunks of fetch ``fetch``'s unit that its parent can forward now."""
        child, k = whose[fetch]
        feed = feeds[child][k]
        if feed == HOLDS:
            return math.inf
        if feed is None:
            return 0
        parent = parents[child][k]
        if done[parent][feed]:
            return math.inf
        theirs = running[parent].get(feed)
        if theirs is None:
            return 0
        # The parent is fetching the unit (or one containing it) now: its chunks arrive in order.
        return max(0, units[parent][feed][1] + relayable[theirs] - units[child][k][1])

    def upstream_landing(fetch: int) -> float:
        """When the parent of ``fetch`` holds whole the chunk it is to send next (0: it does already)."""
        child, k = whose[fetch]
        feed = feeds[child][k]
        parent = parents[child][k]
        if feed == HOLDS or feed is None or done[parent][feed] or feed not in running[parent]:
            return 0.0
        theirs = running[parent][feed]
        place = units[child][k][1] + requested[fetch] - units[parent][feed][1]
        return 0.0 if place < got[theirs] else lands[theirs][place]

    def pick(parent: str) -> int | None:
        """The fetch ``parent`` sends its next chunk to, if any can take one now."""
        queue = queues.get(parent)
        if not queue:
            return None
        chosen, behind = None, math.inf
        for _ in range(len(queue)):
            fetch = queue.popleft()
            if fetch not in whose or whose[fetch][0] in dead:
                continue  # that fetch has ended or moved elsewhere, or its receiver died
            queue.append(fetch)  # to the back: the next pick starts after it (round robin)
            child, k = whose[fetch]
            _, first, end = units[child][k]
            if child not in receiving and requested[fetch] < min(ready(fetch), end - first):
                if not crossing_free(parent, child):
                    held_up.add(parent)
                    continue
                if serve == "fair":
                    return fetch
                if k < behind:
                    chosen, behind = fetch, k
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
            fetch = pick(parent)
            if fetch is None:
                return
            child, k = whose[fetch]
            block, first, _ = units[child][k]
            nbytes = min(chunk_bytes, size[block] - (first + requested[fetch]) * chunk_bytes)
            rate = link_bytes_per_s * min(share.get(parent, 1.0), share.get(child, 1.0))
            ends = now + nbytes / rate
            # Toward a slower child the uplink is charged its fluid share, the chunk at its own rate, and may
            # send to other children while the child drains it (one chunk at a time there: ``receiving``).
            drains = share.get(child, 1.0) < share.get(parent, 1.0)
            if relay_bytes:  # a chunk the parent still receives: its last piece goes once it is whole
                piece = min(relay_bytes, nbytes) / rate
                ends = max(ends, upstream_landing(fetch) + piece)
                if relay_bytes < nbytes:
                    seq += 1
                    heapq.heappush(events, (now + piece + hop_latency_s, seq, RELAYABLE, parent, child, fetch))
            lands[fetch][requested[fetch]] = ends + hop_latency_s
            sending[parent] = sending.get(parent, 0) + 1
            receiving.add(child)
            requested[fetch] += 1
            take_crossing(parent, child, 1)
            if drains:
                seq += 1
                heapq.heappush(events, (now + nbytes / (link_bytes_per_s * share.get(parent, 1.0)), seq,
                                        UPLINK_FREE, parent, child, fetch))
            seq += 1
            heapq.heappush(events, (ends, seq, DRAINED if drains else SENT, parent, child, fetch))

    def begin(rx: str, k: int, now: float, progress: int = 0) -> None:
        """Fetch ``k`` of ``rx`` takes a slot, ``progress`` chunks of it already here."""
        nonlocal ids
        ids += 1
        parent = parents[rx][k]
        running[rx][k] = ids
        busy[rx].add(parent)
        whose[ids] = (rx, k)
        got[ids] = requested[ids] = relayable[ids] = progress
        lands[ids] = {}
        queues.setdefault(parent, deque()).append(ids)
        send(parent, now)

    def fill(rx: str, now: float) -> None:
        """Start what may start: the next fetch from each idle parent, first ones first, while slots are free
        (the first unfinished fetch whatever the slots)."""
        if oldest[rx] == len(units[rx]):
            finished.setdefault(rx, now)
            return
        for k in sorted(queue[0] for parent, queue in pending[rx].items() if queue and parent not in busy[rx]):
            if len(running[rx]) >= concurrency and k != oldest[rx]:
                return
            pending[rx][parents[rx][k]].popleft()
            begin(rx, k, now)

    def end_fetch(fetch: int) -> None:
        child, k = whose.pop(fetch)
        del running[child][k], got[fetch], requested[fetch], relayable[fetch], lands[fetch]
        busy[child].discard(parents[child][k])

    def arrive(parent: str, fetch: int, now: float) -> None:
        child, k = whose[fetch]
        got[fetch] += 1
        relayable[fetch] = max(relayable[fetch], got[fetch])
        _, first, end = units[child][k]
        if got[fetch] == end - first:
            done[child][k] = 1
            end_fetch(fetch)
            while oldest[child] < len(units[child]) and done[child][oldest[child]]:
                oldest[child] += 1
            fill(child, now)
        send(child, now)  # its own children may be waiting for the chunk that just arrived
        send(parent, now)

    def downlink_free(child: str, now: float) -> None:
        """``child``'s downlink can take a chunk again: its other parents may send."""
        for k in list(running.get(child, ())):
            send(parents[child][k], now)

    depth: dict[str, int] = {}

    def depth_of(rx: str) -> int:
        """Hops from a source or holder along first fetches' parents (each fetches that unit before it, or
        holds it: then the walk ends there). Walked, not recursed: a chain of thousands, listed tail first."""
        path: list[str] = []
        on_path: set[str] = set()
        node = rx
        while node not in depth and node in units and units[node] and node not in on_path:
            path.append(node)
            on_path.add(node)
            node = parents[node][0]
        base = depth.get(node, 0)  # a source, a holder, or back on the path (a receiver that holds the unit)
        for at in reversed(path):
            base += 1
            depth[at] = base
        return depth[rx]

    def replan_around(now: float) -> None:
        """The control plane's repair, ``detect_s`` after a death: the live receivers take their new fetches,
        keeping the units they hold and the chunks of those they were fetching; a fetch whose parent stays
        goes on, others start afresh from their next missing chunk."""
        nonlocal current
        held, have, was = {}, {}, {}
        for rx, items in units.items():
            if rx not in dead:
                have[rx] = {unit for unit, flag in zip(items, done[rx]) if flag}
                held[rx] = {block for block, _, _ in have[rx]} - {b for (b, _, _), f in zip(items, done[rx]) if not f}
                was[rx] = {items[k]: (parents[rx][k], fetch) for k, fetch in running[rx].items()}
        current = repair(current, dead=dead, held=held, sources=current.sources)[0]
        for rx in [rx for rx in units if rx not in current.assignments]:
            del units[rx], parents[rx], feeds[rx]
        follow(current)
        restart: dict[str, list[tuple[int, int]]] = {}
        for rx in was:  # every receiver's new state first: sending looks at the others'
            if rx in units:
                lay_out(rx, have[rx])
            for k, unit in enumerate(units.get(rx, ())):
                parent, fetch = was[rx].get(unit, ("", 0))  # fetch ids start at 1
                if not fetch or done[rx][k]:
                    continue
                pending[rx][parents[rx][k]].remove(k)
                if parent == parents[rx][k]:  # goes on: the chunks on their way still count
                    del was[rx][unit]
                    running[rx][k] = fetch
                    busy[rx].add(parent)
                    whose[fetch] = (rx, k)
                else:  # afresh from the next missing chunk (dropped below: what the old parent sends is stale)
                    restart.setdefault(rx, []).append((k, got[fetch]))
            for _, fetch in was[rx].values():
                if whose.pop(fetch, None) is not None:
                    receiving.discard(rx)
                    del got[fetch], requested[fetch], relayable[fetch], lands[fetch]
        for rx in was:
            if rx not in units:  # it needs nothing more
                finished.setdefault(rx, now)
                continue
            for k, progress in restart.get(rx, ()):
                begin(rx, k, now, progress)
            if rx in started:  # one not started yet asks for its first unit at its start, as planned
                fill(rx, now)
        for node in list(queues):
            send(node, now)

    current = plan
    for rx in units:
        lay_out(rx, set())
    for rx, at in failures.items():
        seq += 1
        heapq.heappush(events, (at, seq, DIED, "", rx, 0))
    for rx in units:
        if start_delay_s:
            seq += 1
            heapq.heappush(events, (start_delay_s * depth_of(rx), seq, STARTED, "", rx, 0))
        else:
            started.add(rx)
            fill(rx, 0.0)
    while events:
        now, _, kind, parent, child, fetch = heapq.heappop(events)
        if kind == STARTED:
            if child in units and child not in dead:  # a repair before its start may have dropped it (dead)
                started.add(child)
                fill(child, now)
            continue
        if kind == DIED:
            dead.add(child)
            seq += 1
            heapq.heappush(events, (now + detect_s, seq, REPLANNED, "", child, 0))
            continue
        if kind == REPLANNED:
            replan_around(now)
            continue
        if kind == UPLINK_FREE:
            sending[parent] -= 1
            send(parent, now)
            continue
        stale = child in dead or whose.get(fetch, (None,))[0] != child
        if kind == RELAYABLE:
            if not stale:
                relayable[fetch] += 1
                send(child, now)
            continue
        if kind == ARRIVED:
            if not stale:
                arrive(parent, fetch, now)
            continue
        if kind == SENT:  # a DRAINED chunk's uplink was freed at its UPLINK_FREE
            sending[parent] -= 1
        if not stale:
            receiving.discard(child)
        if parent in dead and not stale:  # its uplink died with it: the chunk never arrives
            requested[fetch] -= 1
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
            heapq.heappush(events, (now + hop_latency_s, seq, ARRIVED, parent, child, fetch))
            send(parent, now)  # its uplink is free for the next chunk while this one travels
        else:
            arrive(parent, fetch, now)
        if child not in dead:
            downlink_free(child, now)
    for node in dead:
        finished.pop(node, None)
    stuck = sorted(set(units) - dead - finished.keys())
    if stuck:
        rx = stuck[0]
        a = current.assignments[rx][oldest[rx]]
        raise PlanError(f"plan deadlocks in simulation: {len(stuck)} receiver(s) never finish, e.g. {rx!r} "
                        f"waiting for {unit_name(a.block, a.chunks)} from {a.parent!r}")
    return finished


def lower_bound(plan: Plan, block_bytes: int | Sequence[int], link_bytes_per_s: float, chunk_bytes: int, *,
                links: Mapping[str, int] | None = None, hop_latency_s: float = 0.0,
                start_delay_s: float = 0.0, relay_bytes: int = 0, dead: Collection[str] = ()) -> float:
    """Seconds before which no schedule of ``plan``'s fetches, in :func:`simulate`'s model with the same
    arguments, gets every receiver its units: the fluid bound.

    A receiver's downlink carries one chunk at a time, so the one fetching the most bytes, S, finishes no
    earlier than S/B plus a hop's latency. Where one source with one uplink and no holders feeds two
    receivers or more, every receiver but the one the source serves first starts getting bytes only once
    the source's first chunk has left, no earlier than c/B for c the smallest first chunk of a unit fetched
    from the source (or its first piece of ``relay_bytes``, where smaller: relays pass chunks on from their
    first piece): the one of them fetching the most bytes, S, finishes no earlier than (S + c)/B plus a
    hop. Every receiver starts ``start_delay_s`` or later.

    ``dead``: receivers that die (:func:`simulate`'s ``failures``), which it leaves out of its result: the
    bound is then the others'. Since the source's first chunk may then go to a dead receiver, or be one of a
    repaired plan's units, c is then the smallest chunk of any block.
    """
    size = _block_sizes(plan, block_bytes)

    def unit_bytes(block: int, chunks: tuple[int, int] | None) -> int:
        first, end = chunks or (0, math.ceil(size[block] / chunk_bytes))
        return min(end * chunk_bytes, size[block]) - first * chunk_bytes

    fetched = sorted((sum(unit_bytes(a.block, a.chunks) for a in items)
                      for rx, items in plan.assignments.items() if items and rx not in dead), reverse=True)
    if not fetched:
        return 0.0
    bound = fetched[0] / link_bytes_per_s
    source, *others = plan.sources
    if not others and not plan.held and (links or {}).get(source, 1) == 1 and len(fetched) > 1:
        starts = {(a.block, a.chunks[0] if a.chunks else 0) for items in plan.assignments.values()
                  for a in items if a.parent == source}
        first = min((unit_bytes(block, (c, c + 1)) for block, c in starts), default=0)
        if set(dead) & plan.assignments.keys():
            first = min(unit_bytes(block, (c - 1, c)) for block in size
                        for c in [math.ceil(size[block] / chunk_bytes)])  # each block's last chunk, the smallest
        if relay_bytes:
            first = min(first, relay_bytes)
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
