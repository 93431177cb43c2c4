"""Racks for the planners: a node's rack from its labels, nodes grouped by rack, and the pool of
parents with spare child slots that prefers the asking receiver's rack."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

RACK_LABEL = "rack"

Rack = Callable[[str], "str | None"]


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

    def add(self, node: str, spare: int, time: int = 0, *, first: bool = False) -> None:
        """Offer ``node`` as a parent for up to ``spare`` more children that come after ``time``; ``first``:
        before every node offered so far (``time`` no later than theirs)."""
        if spare <= 0:
            return
        self._spare[node] = spare
        entry = (time, node)
        (self._all.appendleft if first else self._all.append)(entry)
        rack = self._rack(node)
        if rack is not None:
            queue = self._by_rack.setdefault(rack, deque())
            (queue.appendleft if first else queue.append)(entry)

    def add_first(self, nodes: Sequence[tuple[str, int]], time: int = 0) -> None:
        """Offer ``nodes`` (each with its spare slots), in order, before every node offered so far, as if they
        had been added first (``time`` no later than any added so far)."""
        for node, spare in reversed(nodes):
            self.add(node, spare, time, first=True)

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
