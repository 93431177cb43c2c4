"""A small discrete-event simulator of a multicast plan, to compare strategies without a network.

The model, kept simple on purpose:

- every node has a full-duplex link of the same rate, or several (``links``: a store whose egress is
  L links' worth); only uplinks are contended, since a receiver fetches one block at a time (strictly
  in plan order) and so its downlink carries one stream;
- each of a node's uplinks sends one chunk at a time to one of the children fetching from it whose next
  chunk it already holds and that no other uplink is sending to: by default taking turns (round robin),
  so concurrent children share the uplinks equally, as TCP flows would; with ``serve="earliest"`` the
  child whose current fetch comes earliest in its own fetch list (the one furthest behind) instead,
  which a sender can do knowing only the plan;
- a receiver forwards a chunk once the whole chunk has arrived (cut-through at chunk granularity);
- sources hold every block and the plan's holders their held blocks from time 0; a chunk arrives
  ``hop_latency_s`` after it left its sender's uplink (0 by default), which is free for the next chunk
  meanwhile; there is no per-message cost and no verification time.

So a chain finishes in S/B + (N-1)c/B, unicast from one source in N*S/B, and a binomial pipeline of k
blocks to 2^d - 1 receivers in about (k+d)/k * S/B. That last figure needs the plan's round
rhythm: with fair sharing and more than two chunks per block, receivers that finish a fetch early start
the next one while their parent still sends an earlier round's block, and the lag grows round after
round (1.8 * S/B for 31 receivers, 32 blocks of 4 chunks); ``serve="earliest"`` keeps the rhythm
(1.19). The cost is one heap event per chunk transferred, plus a scan of the sender's waiting children.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence

from control_plane.planner.plan import Plan, PlanError


SERVE_POLICIES = ("fair", "earliest")
SENT, ARRIVED = 0, 1  # event kinds: a chunk left its sender's uplink; it reached its receiver


def simulate(plan: Plan, block_bytes: int | Sequence[int], link_bytes_per_s: float, chunk_bytes: int, *,
             serve: str = "fair", links: Mapping[str, int] | None = None,
             hop_latency_s: float = 0.0) -> dict[str, float]:
    """Seconds from the start until each receiver of ``plan`` holds all its blocks.

    ``block_bytes`` is one size for every block or a size per block index; ``serve`` is how an uplink
    picks among waiting children (see the module docstring); ``links`` gives a node's uplinks at
    ``link_bytes_per_s`` each (default 1); ``hop_latency_s`` delays each chunk's arrival. Raises
    :class:`PlanError` if some receivers never finish (the plan deadlocks or names a parent that never gets
    the block).
    """
    if hop_latency_s < 0:
        raise ValueError(f"simulate: hop latency must be >= 0, got {hop_latency_s!r}")
    if link_bytes_per_s <= 0 or chunk_bytes <= 0:
        raise ValueError(f"simulate: link rate and chunk size must be positive, got {link_bytes_per_s!r} "
                         f"and {chunk_bytes!r}")
    if serve not in SERVE_POLICIES:
        raise ValueError(f"simulate: serve must be one of {', '.join(SERVE_POLICIES)}, got {serve!r}")
    links = dict(links or {})
    for node, count in links.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"simulate: links of {node!r} must be a positive integer, got {count!r}")
    fetches = {rx: [a.block for a in items] for rx, items in plan.assignments.items()}
    parents = {rx: [a.parent for a in items] for rx, items in plan.assignments.items()}
    blocks = {b for items in fetches.values() for b in items}
    if not isinstance(block_bytes, int) and blocks and max(blocks) >= len(block_bytes):
        raise ValueError(f"simulate: block_bytes gives {len(block_bytes)} sizes; the plan fetches block "
                         f"{max(blocks)}")
    size = {b: block_bytes if isinstance(block_bytes, int) else block_bytes[b] for b in blocks}
    if any(s <= 0 for s in size.values()):
        raise ValueError("simulate: block sizes must be positive")
    chunks = {b: math.ceil(s / chunk_bytes) for b, s in size.items()}
    sources = set(plan.sources)
    held = {node: set(kept) for node, kept in plan.held.items()}

    position = dict.fromkeys(fetches, 0)  # index of the fetch in progress
    got = dict.fromkeys(fetches, 0)  # chunks of that block received so far
    requested = dict.fromkeys(fetches, 0)  # chunks of that block sent toward it (arrived or on the way)
    done: dict[str, set[int]] = {rx: set() for rx in fetches}
    ticket = dict.fromkeys(fetches, 0)  # bumped per fetch: older uplink queue entries are stale
    queues: dict[str, deque[tuple[str, int]]] = {}
    sending: dict[str, int] = {}  # chunks each node has in flight, at most its links
    receiving: set[str] = set()  # children with a chunk in flight: a downlink carries one
    events: list[tuple[float, int, str, str]] = []
    finished: dict[str, float] = {}
    seq = 0

    def has(node: str, block: int) -> float:
        """Chunks of ``block`` that ``node`` can forward now."""
        if node in sources or block in held.get(node, ()):
            return math.inf
        if node not in fetches:
            return 0
        if block in done[node]:
            return math.inf
        k = position[node]
        return got[node] if k < len(fetches[node]) and fetches[node][k] == block else 0

    def pick(parent: str) -> str | None:
        """The child ``parent`` sends its next chunk to, if any can take one now."""
        queue = queues.get(parent)
        if not queue:
            return None
        chosen, behind = None, math.inf
        for _ in range(len(queue)):
            child, fetch = queue.popleft()
            if ticket[child] != fetch:
                continue  # that child has moved on to another fetch
            queue.append((child, fetch))  # to the back: the next pick starts after it (round robin)
            block = fetches[child][position[child]]
            if child not in receiving and requested[child] < min(has(parent, block), chunks[block]):
                if serve == "fair":
                    return child
                if position[child] < behind:
                    chosen, behind = child, position[child]
        return chosen

    def send(parent: str, now: float) -> None:
        nonlocal seq
        while sending.get(parent, 0) < links.get(parent, 1):
            child = pick(parent)
            if child is None:
                return
            block, nth = fetches[child][position[child]], requested[child]
            nbytes = min(chunk_bytes, size[block] - nth * chunk_bytes)
            sending[parent] = sending.get(parent, 0) + 1
            receiving.add(child)
            requested[child] += 1
            seq += 1
            heapq.heappush(events, (now + nbytes / link_bytes_per_s, seq, SENT, parent, child))

    def start(rx: str, now: float) -> None:
        k = position[rx]
        if k == len(fetches[rx]):
            finished[rx] = now
            return
        parent = parents[rx][k]
        queues.setdefault(parent, deque()).append((rx, ticket[rx]))
        send(parent, now)

    for rx in fetches:
        start(rx, 0.0)
    def arrive(parent: str, child: str, now: float) -> None:
        got[child] += 1
        block = fetches[child][position[child]]
        if got[child] == chunks[block]:
            done[child].add(block)
            position[child] += 1
            got[child] = requested[child] = 0
            ticket[child] += 1
            start(child, now)
        send(child, now)  # its own children may be waiting for the chunk that just arrived
        send(parent, now)

    while events:
        now, _, kind, parent, child = heapq.heappop(events)
        if kind == ARRIVED:
            arrive(parent, child, now)
            continue
        sending[parent] -= 1
        receiving.discard(child)
        if hop_latency_s:
            seq += 1
            heapq.heappush(events, (now + hop_latency_s, seq, ARRIVED, parent, child))
            send(parent, now)  # its uplink is free for the next chunk while this one travels
        else:
            arrive(parent, child, now)
    if len(finished) < len(fetches):
        stuck = sorted(set(fetches) - finished.keys())
        rx = stuck[0]
        raise PlanError(f"plan deadlocks in simulation: {len(stuck)} receiver(s) never finish, e.g. {rx!r} "
                        f"waiting for block {fetches[rx][position[rx]]} from {parents[rx][position[rx]]!r}")
    return finished
