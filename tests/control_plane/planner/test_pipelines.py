"""The pipeline former: properties on random holdings, checked against a brute-force search."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.pipeline_forming import PipelineCandidates
from control_plane.planner import pipelines
from control_plane.planner.pipelines import ModelLayout, Pipeline, Stage, form_pipelines
from control_plane.planner.plan import PlanError


def layout_of(layers_per_block, tied=False, head_cost=0.0) -> ModelLayout:
    start, spans = 0, []
    for n in layers_per_block:
        spans.append(range(start, start + n))
        start += n
    return ModelLayout(tuple(spans), tied, head_cost)


def valid(layout: ModelLayout, held, pipeline: Pipeline) -> bool:
    """Every layer once, in order, each stage on blocks its node holds, embeddings first, head last."""
    stages = pipeline.stages
    if len(stages) < 2 or len(set(pipeline.nodes)) != len(stages):
        return False
    position = 0
    for stage in stages:
        if stage.start != position or stage.stop <= stage.start:
            return False
        if not layout.blocks_for(stage.start, stage.stop) <= set(held[stage.node]):
            return False
        position = stage.stop
    return position == layout.num_layers


def can_form_any(layout: ModelLayout, held, nodes, max_stages) -> int | None:
    """Brute force: the fewest stages of any pipeline among ``nodes``, trying every order and cut."""
    L = layout.num_layers
    for k in range(2, min(max_stages, len(nodes)) + 1):
        for order in itertools.permutations(nodes, k):
            for cuts in itertools.combinations(range(1, L), k - 1):
                bounds = (0,) + cuts + (L,)
                stages = tuple(Stage(n, a, b) for n, a, b in zip(order, bounds, bounds[1:]))
                if valid(layout, held, Pipeline(stages)):
                    return k
    return None


@st.composite
def holdings(draw, max_nodes=5):
    blocks = draw(st.lists(st.integers(1, 3), min_size=2, max_size=6))
    layout = layout_of(blocks, tied=draw(st.booleans()), head_cost=draw(st.sampled_from([0.0, 1.5])))
    nodes = draw(st.integers(1, max_nodes))
    held = {f"n{i}": draw(st.sets(st.integers(0, len(blocks) - 1))) for i in range(nodes)}
    return layout, held


@settings(max_examples=300, deadline=None)
@given(holdings(), st.integers(2, 4))
def test_pipelines_cover_every_layer_once_on_held_blocks_and_never_share_a_node(case, max_stages):
    layout, held = case
    pipelines = form_pipelines(layout, held, max_stages=max_stages)
    seen = set()
    for pipeline in pipelines:
        assert valid(layout, held, pipeline)
        assert len(pipeline.stages) <= max_stages
        assert not seen & set(pipeline.nodes)
        seen |= set(pipeline.nodes)
        for node in pipeline.nodes:  # nodes with the whole package serve on their own
            assert len(held[node]) < layout.num_blocks


@settings(max_examples=300, deadline=None)
@given(holdings(max_nodes=4), st.integers(2, 4))
def test_the_former_is_maximal_and_forms_fewest_stages_first(case, max_stages):
    layout, held = case
    pipelines = form_pipelines(layout, held, max_stages=max_stages)
    partial = [n for n in sorted(held) if len(held[n]) < layout.num_blocks]
    if pipelines:
        assert len(pipelines[0].stages) == can_form_any(layout, held, partial, max_stages)
    left = [n for n in partial if all(n not in p.nodes for p in pipelines)]
    assert can_form_any(layout, held, left, max_stages) is None


@st.composite
def crowded_holdings(draw):
    """Many nodes holding the same run of blocks (a multicast's receivers at one point of their order) from
    where a node ``a`` with two spans (a rotated order's wrap: the first blocks and the last) leaves off, and a
    few others, each a run between those points or any blocks. Named so that ``a``'s chains are tried first."""
    blocks = draw(st.lists(st.integers(1, 2), min_size=3, max_size=6))
    n = len(blocks)
    head = draw(st.integers(0, n - 3))
    tail = draw(st.integers(head + 2, n - 1))
    end = draw(st.integers(head + 2, tail))
    held = {"a": set(range(head + 1)) | set(range(tail, n))}
    held |= {f"m{i:02d}": set(range(head + 1, end)) for i in range(draw(st.integers(33, 48)))}
    points = sorted({0, head + 1, end, tail, n})
    run = st.lists(st.sampled_from(points), min_size=2, max_size=2, unique=True).map(lambda ab: set(range(*sorted(ab))))
    for i in range(draw(st.integers(1, 3))):
        held[f"n{i}"] = draw(st.one_of(run, st.sets(st.integers(0, n - 1))))
    return layout_of(blocks), held


def one_copy(nodes) -> list[str]:
    """``nodes`` with one of the copies (``m``): a pipeline needs no two nodes holding the same run of blocks,
    as one stage can run from the first's start to the second's end."""
    return [n for n in nodes if not n.startswith("m") or n == min(m for m in nodes if m.startswith("m"))]


@settings(max_examples=150, deadline=None)
@given(crowded_holdings(), st.integers(2, 4))
def test_many_identical_holders_do_not_crowd_out_the_chain_that_leaves_a_two_span_node_free(case, max_stages):
    """Each stage end kept the first 32 chains told apart by every node they used: 40 holders of the middle
    block made 40 chains through ``a``'s first span, and the chains through another head were dropped, so
    ``a``, needed for the last block, was never free there: no pipeline though one existed."""
    layout, held = case
    pipelines = form_pipelines(layout, held, max_stages=max_stages)
    seen: set[str] = set()
    for pipeline in pipelines:
        assert valid(layout, held, pipeline) and len(pipeline.stages) <= max_stages
        assert not seen & set(pipeline.nodes)
        seen |= set(pipeline.nodes)
    partial = [n for n in sorted(held) if len(held[n]) < layout.num_blocks]
    fewest = can_form_any(layout, held, one_copy(partial), max_stages)
    assert (len(pipelines[0].stages) if pipelines else None) == fewest
    assert can_form_any(layout, held, one_copy([n for n in partial if n not in seen]), max_stages) is None


def test_forty_holders_of_the_middle_block_still_leave_the_two_span_node_for_the_last():
    layout = layout_of([1, 1, 1, 1])
    held = {"a_z": {0, 3}, "w": {0}, "b": {2}, **{f"m{i:02d}": {1} for i in range(40)}}
    [pipeline] = form_pipelines(layout, held)
    assert pipeline.stages == (Stage("w", 0, 1), Stage("m00", 1, 2), Stage("b", 2, 3), Stage("a_z", 3, 4))


@pytest.mark.parametrize("copies", [1, 31, 40])
def test_many_two_span_holders_do_not_crowd_out_the_chain_that_leaves_the_critical_node_free(copies):
    # Chains through ``a``'s first span and a ``z``'s second were told apart by the z each used: from 31 copies
    # they filled the 32 places at layer 4, and z00 -> b, which leaves ``a`` for the last layers, was dropped.
    layout = layout_of([1] * 6)
    held = {"a": {0, 1, 2, 4, 5}, "b": {1, 2, 3}, **{f"z{i:02d}": {0, 2, 3, 5} for i in range(copies)}}
    [pipeline] = form_pipelines(layout, held)
    assert pipeline.nodes == ("z00", "b", "a")


def test_many_distinct_holders_do_not_crowd_out_a_longer_chain():
    # 40 holders of blocks 1 and 3, each with later blocks of its own (so none stands in for another), made the
    # chains through c's first span that filled the places; the one pipeline leaves c for block 4.
    layout = layout_of([1] * 13)
    extra = [set(s) for r in range(1, 7) for s in itertools.combinations(range(6, 12), r)][:40]
    held = {"c": {0, 4}, "z": {0}, "m": {2}, "w": set(range(5, 13)),
            **{f"b{i:02d}": {1, 3} | extra[i] for i in range(40)}}
    [pipeline] = form_pipelines(layout, held)
    assert pipeline.nodes == ("z", "b00", "m", "b01", "c", "w")


def test_each_receiver_is_formed_once_on_what_it_holds_and_gets_next_counting_the_blocks_waited_for():
    """:meth:`PipelineCandidates.run` on random candidates (a bounded number, seeded): pipelines of verified
    blocks first, waiting for none; then pipelines of what the receivers left hold and get next, each stage
    on those blocks, waiting for as many as its stages lack; no node in two pipelines."""
    for trial in range(400):
        rnd = random.Random(trial)
        layout = layout_of([rnd.randint(1, 3) for _ in range(rnd.randint(2, 6))], rnd.random() < 0.5,
                           rnd.choice([0.0, 1.5]))
        n = layout.num_blocks
        verified, receiving = {}, {}
        for node in (f"n{i}" for i in range(rnd.randint(1, 6))):
            have = frozenset(b for b in range(n) if rnd.random() < 0.4)
            if have:
                verified[node] = have
            if rnd.random() < 0.6:
                receiving[node] = (have, frozenset(rnd.sample(range(n), rnd.randint(0, 2))) - have)
        out = PipelineCandidates(layout, {node: f"http://{node}" for node in verified.keys() | receiving.keys()},
                                 verified, receiving).run()
        ready = form_pipelines(layout, verified)
        assert [p for p, _ in out[:len(ready)]] == ready and all(w == 0 for _, w in out[:len(ready)]), trial
        seen: set[str] = set()
        for pipeline, waiting in out:
            assert not seen & set(pipeline.nodes), (trial, "a node in two pipelines")
            seen |= set(pipeline.nodes)
            lacking = 0
            for stage in pipeline.stages:
                have = receiving[stage.node][0] if stage.node in receiving else verified[stage.node]
                following = receiving[stage.node][1] if stage.node in receiving else frozenset()
                needed = layout.blocks_for(stage.start, stage.stop)
                assert needed <= have | following, (trial, stage)
                lacking += len(needed - have)
            assert waiting == lacking, trial
        assert all(w > 0 for _, w in out[len(ready):]), trial  # a pipeline of held blocks alone is ready


def test_rotated_halves_make_one_two_stage_pipeline_balanced_by_compute():
    # 8 blocks of 2 layers; node a got blocks 0-3, node b blocks 4-7 (two sources, rotated by half)
    layout = layout_of([2] * 8, head_cost=0.0)
    [pipeline] = form_pipelines(layout, {"a": range(4), "b": range(4, 8)})
    assert pipeline.stages == (Stage("a", 0, 8), Stage("b", 8, 16))


def test_overlapping_holders_split_the_layers_evenly_and_the_head_counts():
    # both hold most layers: the cut balances the cost, the last stage also pays the head
    layout = layout_of([2] * 8, head_cost=2.0)
    [pipeline] = form_pipelines(layout, {"a": range(7), "b": range(1, 8)})
    assert pipeline.stages == (Stage("a", 0, 9), Stage("b", 9, 16))
    assert pipeline.stage_costs(layout) == [9.0, 9.0]


def test_a_tied_head_is_the_first_stages_so_the_last_needs_no_embeddings_and_the_first_pays_the_head():
    layout = layout_of([2, 2, 2, 2], tied=True, head_cost=2.0)
    [pipeline] = form_pipelines(layout, {"a": {0, 1, 2}, "b": {1, 2, 3}})
    assert pipeline.stages == (Stage("a", 0, 3), Stage("b", 3, 8))  # a: 3 layers + the head, b: 5 layers
    assert pipeline.stage_costs(layout) == [5.0, 5.0]
    assert layout.blocks_for(6, 8) == {3} and layout.blocks_for(0, 2) == {0}


def test_a_node_with_two_spans_of_a_rotated_order_is_used_once():
    # c holds blocks 3 and 0 (rotated order): it can only head, since it cannot be both ends
    layout = layout_of([1, 1, 1, 1])
    [pipeline] = form_pipelines(layout, {"c": {3, 0}, "d": {1, 2, 3}})
    assert pipeline.stages == (Stage("c", 0, 1), Stage("d", 1, 4))


def test_fewest_stages_first_then_the_rest_and_whole_holders_are_left_out():
    layout = layout_of([1] * 4)
    held = {"whole": range(4), "a": {0, 1}, "b": {2, 3}, "c": {0}, "d": {1}, "e": {2}, "f": {3}}
    pipelines = form_pipelines(layout, held, max_stages=4)
    assert [p.nodes for p in pipelines] == [("a", "b"), ("c", "d", "e", "f")]
    assert form_pipelines(layout, held, max_stages=3) == [Pipeline((Stage("a", 0, 2), Stage("b", 2, 4)))]


def test_bad_inputs_are_refused_naming_them():
    layout = layout_of([1, 1])
    with pytest.raises(PlanError, match=r"node 'a' holds blocks \[2\] outside the package's 0-1"):
        form_pipelines(layout, {"a": {2}})
    with pytest.raises(PlanError, match="max_stages must be an integer >= 2, got 1"):
        form_pipelines(layout, {}, max_stages=1)
    with pytest.raises(PlanError, match="block 1 holds layers 3-3, expected a range starting at layer 1"):
        ModelLayout((range(0, 1), range(3, 4)))
    # Found in review: an empty block was taken, and a node missing only it was in no pipeline.
    for blocks, index in (((range(0, 3), range(3, 3), range(3, 6)), 1), ((range(0, 0),), 0)):
        with pytest.raises(PlanError) as err:
            ModelLayout(blocks)
        assert str(err.value) == f"ModelLayout: block {index} holds no layer"
    # Found in review: an infinite head cost passed and then raised KeyError; True was taken for block 1.
    for cost in (float("inf"), float("nan"), -1.0, "1", None):
        with pytest.raises(PlanError, match="head_cost must be a finite number >= 0, got"):
            ModelLayout((range(0, 1),), head_cost=cost)
    with pytest.raises(PlanError, match=r"node 'a' holds blocks \[True\] outside the package's 0-1"):
        form_pipelines(layout, {"a": {True}})


def test_a_forming_past_its_budget_answers_the_pipelines_found_so_far():
    """Found in review: each pipeline was searched for among every node left, so receivers holding hundreds of
    different sets of blocks took minutes to form at a few thousand; a search budget bounds it, and what is
    found first (fewest stages) is what a smaller budget keeps."""
    rng = random.Random(7)
    layout = ModelLayout(tuple(range(i, i + 1) for i in range(16)))
    held = {}
    for i in range(300):
        start = rng.randrange(16)
        held[f"w{i:03d}"] = {(start + k) % 16 for k in range(rng.randint(2, 12))}
    whole = form_pipelines(layout, held, budget=10**9)
    cut = form_pipelines(layout, held, budget=2_000)
    assert 0 < len(cut) < len(whole) and cut == whole[:len(cut)]
    with pytest.raises(PlanError, match="budget must be an integer >= 1, got 0"):
        form_pipelines(layout, held, budget=0)


def test_a_forming_counts_its_comparisons_of_chains_against_its_budget(monkeypatch):
    """Found in review: only the nodes looked at counted, and each compared its chain with up to 32 kept at its stage
    end: 199 candidates holding three runs of blocks each took 8-11 s (a thread holding the GIL) within the
    budget of "about a second"."""
    rng = random.Random(1)
    layout = ModelLayout(tuple(range(i, i + 1) for i in range(66)))
    held = {}
    for i in range(199):
        held[f"n{i:03d}"] = set()
        for _ in range(3):
            start = rng.randrange(66)
            held[f"n{i:03d}"] |= {(start + k) % 66 for k in range(rng.randrange(1, 12))}
    compared = 0
    within = pipelines._within

    def counted(a, counts):
        nonlocal compared
        compared += 1
        return within(a, counts)

    monkeypatch.setattr(pipelines, "_within", counted)
    budget = 50_000
    form_pipelines(layout, held, budget=budget)
    # Past the budget, a step finishes (a node tried at each stage end it reaches: at most 65 x 64 comparisons).
    assert budget / 2 < compared <= budget + 65 * 64


def test_a_forming_charges_only_the_comparisons_it_makes():
    """Found in review: a chain compared with those kept at its stage end was charged one step per chain kept there,
    though the comparisons stop at the first that needs no more: the budget was spent up to 32 times as fast."""
    kept = [frozenset({(0, 1)}), *(frozenset({(kind, 1)}) for kind in range(1, 32))]
    spent = [0, 10**9]
    assert not pipelines._admit(kept, frozenset({(0, 1), (1, 2)}), spent)  # the first kept needs no more
    assert spent[0] == 1
    kept[0] = frozenset()  # needs nothing
    assert pipelines._full(kept, {}, (), 0, spent)
    assert spent[0] == 2
