"""The pipeline former: nodes holding different blocks, chained into pipelines that cover every layer.

While a package is multicast in rotated orders, no single node holds the model for a while, but a group
of nodes together does: node A holding layers 0-14 and node B holding 15-29 can serve as one pipeline
(A embeds and runs its layers, sends the hidden states to B, which runs the rest and applies the head).
:func:`form_pipelines` is a pure function from what each node holds (or will hold next) to such
pipelines; the control plane calls it again whenever blocks land, the benchmarks and tests call it
directly. No sockets, no clock.

Each pipeline is an ordered tuple of :class:`Stage` (node, layer range) covering every layer exactly
once; the first stage also embeds (it holds block 0, where the embeddings are), the last applies the
final norm and head (it holds the last block); an LM head tied to the embeddings is applied by the first
stage, which holds them (the last stage sends back its final norm), so no stage needs block 0 twice.
A node is in at most one pipeline, and nodes that hold the whole package are left out: they serve on
their own. Pipelines are formed fewest stages first (each hop costs a network round per token), and
each pipeline's cut points are then chosen to balance compute: the cost of a stage is its layers' plus
the head's (``head_cost``, in decoder layers) for the stage applying it.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from control_plane.planner.plan import PlanError, check_ids

#: Most stages in one pipeline: each adds a hop per token. FaaScale plans pipelines of 8/4/2/1 nodes.
DEFAULT_MAX_STAGES = 8
#: Steps of search a forming takes at most (:func:`form_pipelines`): about a second of this project's 2-core VM.
DEFAULT_BUDGET = 1_000_000
#: Partial chains kept per stage end while searching (see :func:`_fewest_stages`).
_PATHS_PER_END = 32
#: What a chain ending at a position needs of the nodes left: how many of each kind (:attr:`_Runs.kind`) it used
#: that hold a layer past the position.
_Needs = frozenset[tuple[int, int]]


@dataclass(frozen=True)
class ModelLayout:
    """What the former needs of a package: the layers each block holds (``block_layers[i]``, in order, at
    least one each, together ``0..num_layers-1``), whether the head is tied to the embeddings, and the head's
    compute in units of one decoder layer."""

    block_layers: tuple[range, ...]
    tied_embeddings: bool = False
    head_cost: float = 0.0

    def __post_init__(self) -> None:
        if not self.block_layers:
            raise PlanError("ModelLayout: a package has at least one block")
        expected = 0
        for index, layers in enumerate(self.block_layers):
            if layers.step != 1 or layers.start != expected:
                raise PlanError(f"ModelLayout: block {index} holds layers {layers.start}-{layers.stop - 1}, "
                                f"expected a range starting at layer {expected}")
            # A block of no layer (the manifest has none) is needed by no stage: a node missing only it would
            # hold every layer yet be in no pipeline.
            if not layers:
                raise PlanError(f"ModelLayout: block {index} holds no layer")
            expected = layers.stop
        # inf passed >= 0, and no cut then balanced a stage with the head (KeyError).
        if isinstance(self.head_cost, bool) or not isinstance(self.head_cost, int | float) or not (
                math.isfinite(self.head_cost) and self.head_cost >= 0):
            raise PlanError(f"ModelLayout: head_cost must be a finite number >= 0, got {self.head_cost!r}")

    @classmethod
    def from_manifest(cls, manifest) -> ModelLayout:
        """The layout of a package's manifest (``pipecast.v1.Manifest``), the head's cost estimated from
        its bytes: compute per token is proportional to the weights a part multiplies by, and the manifest
        knows each block's bytes. A layer's bytes are the median of the blocks' bytes per layer; the head's
        are what the last block (or, tied, the first) holds beyond its layers."""
        blocks = manifest.blocks
        per_layer = sorted(b.bytes / (b.layer_end - b.layer_start) for b in blocks if b.layer_end > b.layer_start)
        layer_bytes = per_layer[len(per_layer) // 2] if per_layer else 0
        holder = blocks[0] if manifest.tied_embeddings else blocks[-1]
        extra = holder.bytes - (holder.layer_end - holder.layer_start) * layer_bytes
        head_cost = max(extra, 0) / layer_bytes if layer_bytes else 0.0
        return cls(tuple(range(b.layer_start, b.layer_end) for b in blocks), manifest.tied_embeddings,
                   round(head_cost, 3))

    @property
    def num_layers(self) -> int:
        return self.block_layers[-1].stop

    @property
    def num_blocks(self) -> int:
        return len(self.block_layers)

    @cached_property
    def _block_of_layer(self) -> tuple[int, ...]:
        return tuple(b for b, layers in enumerate(self.block_layers) for _ in layers)

    def blocks_for(self, start: int, stop: int) -> frozenset[int]:
        """The blocks a stage running layers ``start..stop-1`` needs (with the embedding and head blocks
        where the stage is the first or the last). A tied LM head is applied by the first stage, which
        holds the embeddings: the last stage then needs only the final norm, in the last block."""
        needed = {self._block_of_layer[layer] for layer in range(start, stop)}
        if start == 0:
            needed.add(0)
        if stop == self.num_layers:
            needed.add(self.num_blocks - 1)
        return frozenset(needed)


@dataclass(frozen=True)
class Stage:
    """One node's part of a pipeline: decoder layers ``start..stop-1``."""

    node: str
    start: int
    stop: int

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


@dataclass(frozen=True)
class Pipeline:
    """Stages in order; together they run every layer exactly once."""

    stages: tuple[Stage, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node for s in self.stages)

    def stage_costs(self, layout: ModelLayout) -> list[float]:
        """Each stage's compute in decoder layers, the LM head's included (the first stage's when tied)."""
        costs = [float(len(s.layers)) for s in self.stages]
        costs[0 if layout.tied_embeddings else -1] += layout.head_cost
        return costs

    def to_json(self) -> list[dict]:
        return [{"node": s.node, "layers": [s.start, s.stop]} for s in self.stages]


def form_pipelines(layout: ModelLayout, held: Mapping[str, Collection[int]], *,
                   max_stages: int = DEFAULT_MAX_STAGES, budget: int = DEFAULT_BUDGET) -> list[Pipeline]:
    """Disjoint pipelines of at most ``max_stages`` stages among the nodes of ``held`` (node -> blocks it
    holds, or holds and will hold next: the caller decides), fewest stages first, each balanced by
    compute. Nodes holding every block are left out. Deterministic: the same ``held`` forms the same pipelines
    (among nodes alike, the smallest id left is taken).

    ``budget``: the most steps of search (a node looked at from a stage end, or a chain kept at a stage end
    compared with) over all pipelines; once spent, the pipelines found so far. Each pipeline is searched for
    among every node left, so nodes holding many different sets of blocks (receivers mid-transfer in rotated
    orders: hundreds of kinds) took minutes at a few thousand; the first pipelines, the fewest stages, are found
    first and serve as well. The comparisons count too: up to 32 per node looked at, uncounted they made 199
    nodes holding three runs of blocks each take 8-11 s."""
    if not isinstance(max_stages, int) or max_stages < 2:
        raise PlanError(f"form_pipelines: max_stages must be an integer >= 2, got {max_stages!r}")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise PlanError(f"form_pipelines: budget must be an integer >= 1, got {budget!r}")
    check_ids("form_pipelines", list(held), "node")
    for node, blocks in held.items():
        bad = sorted((b for b in blocks if type(b) is not int or not 0 <= b < layout.num_blocks),  # True is no block
                     key=lambda b: (0, b) if type(b) is int else (1, repr(b)))
        if bad:
            raise PlanError(f"form_pipelines: node {node!r} holds blocks {bad[:5]} outside the package's "
                            f"0-{layout.num_blocks - 1}")
    kinds: dict[tuple, int] = {}
    runs = {node: _Runs(layout, frozenset(blocks), kinds) for node, blocks in sorted(held.items())
            if len(set(blocks)) < layout.num_blocks}
    runs = {node: r for node, r in runs.items() if r.spans}
    # Made once (a node taken by a pipeline is skipped from then on): layer -> (node, its span holding it), and
    # layer -> every stage end a chain at that layer could reach.
    # Layer -> the nodes left holding it, by (kind, span): nodes of one kind through one span make the same
    # chains, so a search tries the first of each group (a search per pipeline over every node left was
    # quadratic: minutes at a few thousand receivers mid-transfer).
    covering: dict[int, dict[tuple[int, tuple[int, int]], dict[str, None]]] = {}
    reach: dict[int, set[int]] = {}
    for node, r in runs.items():
        for span in r.spans:
            for layer in range(*span):
                covering.setdefault(layer, {}).setdefault((r.kind, span), {})[node] = None
                reach.setdefault(layer, set()).update(_ends(layout, r, span, layer))
    pipelines = []
    spent = [0, budget]
    while True:
        chain = _fewest_stages(layout, runs, covering, reach, max_stages, spent)
        if chain is None:
            return pipelines
        pipelines.append(_balance(layout, chain))
        for node, _ in chain:
            r = runs.pop(node)
            for span in r.spans:
                for layer in range(*span):
                    group = covering[layer][r.kind, span]
                    del group[node]
                    if not group:
                        del covering[layer][r.kind, span]


class _Runs:
    """A node's maximal runs of consecutive layers it holds, and whether it can embed and apply the head."""

    def __init__(self, layout: ModelLayout, blocks: frozenset[int], kinds: dict[tuple, int]):
        self.can_embed = 0 in blocks
        self.can_head = layout.num_blocks - 1 in blocks
        self.spans: list[tuple[int, int]] = []
        for b in sorted(blocks):
            layers = layout.block_layers[b]
            if not layers:
                continue
            if self.spans and self.spans[-1][1] == layers.start:
                self.spans[-1] = (self.spans[-1][0], layers.stop)
            else:
                self.spans.append((layers.start, layers.stop))
        #: Nodes of one kind can stand in for each other in any chain; numbered in ``kinds`` (an int hashes faster,
        #: and what chains need is hashed a lot).
        self.kind = kinds.setdefault((self.can_embed, self.can_head, tuple(self.spans)), len(kinds))


def _ends(layout: ModelLayout, r: _Runs, span: tuple[int, int], p: int) -> Sequence[int]:
    """Where a stage from layer ``p`` through ``span`` may end: where the span does, unless that is the last
    layer and the node cannot apply the head (then anywhere short of it)."""
    last = layout.num_layers
    return [span[1]] if span[1] < last or r.can_head else range(p + 1, last)


def _fewest_stages(layout: ModelLayout, runs: Mapping[str, _Runs],
                   covering: Mapping[int, Mapping[tuple[int, tuple[int, int]], Collection[str]]],
                   reach: Mapping[int, Collection[int]],
                   max_stages: int, spent: list[int]) -> list[tuple[str, tuple[int, int]]] | None:
    """A shortest chain of (node, its span) from layer 0 to the last, breadth first over stage ends; None if
    there is none, or the search's ``spent`` steps reach its budget (``[steps, budget]``, counted on).

    From a position p a node whose span holds p goes as far as its span does: reaching further never
    hurts, except that the stage reaching the last layer must be able to apply the head, so a node that
    cannot stops anywhere short of it. A node runs one stage per pipeline, so each position keeps up to
    :data:`_PATHS_PER_END` chains with different nodes (a node holding blocks 6, 7, 0 and 1 of a rotated
    order has two spans, and the chain through one may need it for the other). Chains differ only in the
    nodes they used that hold a layer at or after the position, counted by kind (nodes holding the same spans
    stand in for each other): the others can never serve the rest. A chain whose such nodes include all of
    another's at the same position can do no more than that one (:func:`_admit`): it is not kept, and gives up
    its place to one that needs fewer, however full the position. Told apart by every node used, many nodes
    holding the same blocks filled a position's chains, and the one chain that left a node free for its second
    span was dropped (no pipeline, though one existed).
    """
    last = layout.num_layers
    found: dict[int, list[_Needs]] = {0: [frozenset()]}
    frontier: list[tuple[int, list[tuple[str, tuple[int, int]]]]] = [(0, [])]
    for _ in range(max_stages):
        following = []
        for p, path in frontier:
            used = {node for node, _ in path}
            needed: dict[int, dict] = {}  # stage end -> what the chain's nodes so far need there
            # Every end this chain could reach is full of chains that need no more of its nodes (or is the last
            # layer, from one node alone): nothing to try.
            full = all(not path if q == last else _full(found.get(q, ()), runs, used, q, spent)
                       for q in reach.get(p, ()))
            if spent[0] > spent[1]:
                return None
            if full:
                continue
            for (_, span), nodes in covering.get(p, {}).items():
                node = next((n for n in nodes if n not in used), None)  # the others of its group: the same chains
                if node is None:
                    continue
                r = runs[node]
                if p == 0 and not r.can_embed:
                    continue
                spent[0] += 1
                if spent[0] > spent[1]:
                    return None
                for q in _ends(layout, r, span, p):
                    if q == last and not path:
                        continue  # one node alone would hold everything: not a pipeline
                    if q == last:
                        return path + [(node, span)]
                    if q not in needed:
                        needed[q] = _count(runs, used, q)
                    needs = needed[q]
                    if r.spans[-1][1] > q:
                        needs = {**needs, r.kind: needs.get(r.kind, 0) + 1}
                    if _admit(found.setdefault(q, []), frozenset(needs.items()), spent):
                        following.append((q, path + [(node, span)]))
        frontier = following
    return None


def _count(runs: Mapping[str, _Runs], used: Collection[str], q: int) -> dict:
    """How many of each kind the ``used`` nodes holding a layer past ``q`` are."""
    counts: dict = {}
    for n in used:
        r = runs[n]
        if r.spans[-1][1] > q:
            counts[r.kind] = counts.get(r.kind, 0) + 1
    return counts


def _within(a: _Needs, counts: Mapping[int, int]) -> bool:
    """Whether ``a`` needs no more of any kind than ``counts`` (kind -> how many) has: most comparisons end at the
    cheap length test."""
    return len(a) <= len(counts) and all(n <= counts.get(kind, 0) for kind, n in a)


def _admit(kept: list[_Needs], needs: _Needs, spent: list[int]) -> bool:
    """Whether a chain that ``needs`` so much is kept among those ending at its position (``kept``, updated): not
    where one of them needs no more (it can do all this one can), else in place of those needing more than it
    does, or in a free place. Each comparison made with a chain kept there is a step of ``spent``'s."""
    counts = dict(needs)  # once, not per chain compared with
    for other in kept:
        spent[0] += 1
        if _within(other, counts):
            return False
    spent[0] += len(kept)
    fewer = [other for other in kept if len(needs) > len(other) or not _within(needs, dict(other))]
    if len(fewer) == len(kept) and len(kept) >= _PATHS_PER_END:
        return False
    kept[:] = fewer + [needs]
    return True


def _full(kept: Sequence[_Needs], runs: Mapping[str, _Runs], used: Collection[str], q: int,
          spent: list[int]) -> bool:
    """Whether no chain extending one that used ``used`` would be kept at stage end ``q``: the places are taken
    and one of them needs no more than such a chain would (at least its ``used`` nodes holding a layer past q).
    Each comparison made with a chain kept there is a step of ``spent``'s."""
    if len(kept) < _PATHS_PER_END:
        return False
    least = _count(runs, used, q)
    for other in kept:
        spent[0] += 1
        if _within(other, least):
            return True
    return False


def _balance(layout: ModelLayout, chain: Sequence[tuple[str, tuple[int, int]]]) -> Pipeline:
    """Cut points for ``chain`` (each node within its span) that minimise the largest stage cost."""
    last, k = layout.num_layers, len(chain)
    inf = float("inf")
    # best[i][c]: (largest stage cost, cuts) for stages 0..i-1 covering layers 0..c-1
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{0: (0.0, ())}]
    head_stage = 0 if layout.tied_embeddings else k - 1
    for i, (_, (lo, hi)) in enumerate(chain):
        row: dict[int, tuple[float, tuple[int, ...]]] = {}
        head = layout.head_cost if i == head_stage else 0.0
        for start, (worst, cuts) in best[i].items():
            if not lo <= start < hi:
                continue
            for stop in ([last] if i == k - 1 else range(start + 1, min(hi, last - 1) + 1)):
                if stop > hi:
                    continue
                cost = max(worst, stop - start + head)
                if cost < row.get(stop, (inf,))[0]:
                    row[stop] = (cost, cuts + (stop,))
        best.append(row)
    _, cuts = best[k][last]
    starts = (0,) + cuts[:-1]
    return Pipeline(tuple(Stage(node, a, b) for (node, _), a, b in zip(chain, starts, cuts)))
