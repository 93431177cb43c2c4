"""Multicast plans: every strategy delivers every block exactly once, without cycles or deadlocks, and
the simulator reproduces the textbook completion times."""

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.planner.plan import STRATEGIES, Fetch, Plan, PlanError
from control_plane.planner.schedules import (
    GROUP_CHAIN_MAX, InFlight, complement_starts, cut_units, make_plan, unit_chunks)
from control_plane.planner.simulate import SERVE_POLICIES, lower_bound, simulate
from pipecast.core.errors import PipecastError


def _ancestors_reach_a_root(plan: Plan) -> None:
    """Follow parent links per block from every receiver: each walk must end at a source or holder."""
    parent = {(rx, a.block): a.parent for rx, fetches in plan.assignments.items() for a in fetches}
    for (rx, block) in parent:
        seen, node = {rx}, parent[rx, block]
        while (node, block) in parent:
            assert node not in seen, f"block {block}: {rx} is its own ancestor"
            seen.add(node)
            node = parent[node, block]
        assert node in plan.sources or block in plan.held.get(node, ()), (rx, block, node)


def _uploads(plan: Plan) -> dict[str, int]:
    sent: dict[str, int] = {}
    for fetches in plan.assignments.values():
        for a in fetches:
            sent[a.parent] = sent.get(a.parent, 0) + 1
    return sent


def _max_children(plan: Plan) -> int:
    counts: dict[tuple[str, int], int] = {}
    for fetches in plan.assignments.values():
        for a in fetches:
            counts[a.parent, a.block] = counts.get((a.parent, a.block), 0) + 1
    return max(counts.values(), default=0)


@st.composite
def plan_requests(draw):
    strategy = draw(st.sampled_from(STRATEGIES))
    k = draw(st.integers(1, 4))
    n = draw(st.integers(0, 40))
    sources = [f"s{i}" for i in range(k - 1)] + ["store"]
    receivers = draw(st.permutations([f"w{i}" for i in range(n)]))
    labels = None
    if draw(st.booleans()):
        racks = st.sampled_from(["r0", "r1", "r2"])
        labels = {node: {"rack": draw(racks)} for node in [*sources, *receivers] if draw(st.booleans())}
    return strategy, sources, list(receivers), draw(st.integers(1, 24)), draw(st.integers(1, 4)), labels


@settings(max_examples=150, deadline=None)
@given(plan_requests())
def test_every_receiver_gets_every_block_once_without_cycles_or_deadlock(case):
    strategy, sources, receivers, num_blocks, fanout, labels = case
    plan = make_plan(strategy, sources, receivers, num_blocks, fanout=fanout, labels=labels)
    assert plan.strategy == strategy and plan.sources == tuple(sources) and not plan.held
    assert set(plan.assignments) == set(receivers)
    for fetches in plan.assignments.values():
        assert sorted(a.block for a in fetches) == list(range(num_blocks))
    _ancestors_reach_a_root(plan)
    plan.validate()
    # Fetching strictly in plan order with cut-through finishes: no wait cycle across blocks either.
    done = simulate(plan, block_bytes=2, link_bytes_per_s=1, chunk_bytes=1)
    assert set(done) == set(receivers)
    assert all(t >= 2 * num_blocks for t in done.values())  # nobody beats the floor S/B


@settings(max_examples=100, deadline=None)
@given(plan_requests())
def test_fanout_and_upload_limits(case):
    strategy, sources, receivers, num_blocks, fanout, labels = case
    plan = make_plan(strategy, sources, receivers, num_blocks, fanout=fanout, labels=labels)
    sent = _uploads(plan)
    if strategy == "unicast":
        assert set(sent) <= set(sources)
        if labels is None:  # round robin: every source serves the same number of receivers, within one
            shares = [sent.get(source, 0) for source in sources]
            assert max(shares) - min(shares) <= num_blocks and sum(shares) == len(receivers) * num_blocks
    elif strategy == "chain":
        assert _max_children(plan) <= 1 and sent.get(sources[0], 0) == num_blocks * bool(receivers)
    elif strategy == "tree":
        assert _max_children(plan) <= fanout
    else:
        # Each group is a binomial pipeline: its source sends each block once, a receiver serves at most
        # d children per block and uploads about one model (at most num_blocks + d - 1 blocks).
        used = sources[:1] if strategy == "binomial" else sources[:len(receivers)]
        group = math.ceil(len(receivers) / max(len(used), 1)) if strategy == "rotated" else len(receivers)
        dim = (group + 1).bit_length() - 1
        for source in sources:
            assert sent.get(source, 0) == (num_blocks if source in used and receivers else 0)
        assert _max_children(plan) <= max(dim, 1)
        assert all(sent.get(rx, 0) <= num_blocks + dim - 1 for rx in receivers)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 60), st.integers(1, 40))
def test_rotated_groups_together_cover_the_model_early(k, n, num_blocks):
    sources = [f"s{i}" for i in range(k)]
    plan = make_plan("rotated", sources, [f"w{i}" for i in range(n)], num_blocks)
    first_seen = {}
    for fetches in plan.assignments.values():
        for position, a in enumerate(fetches):
            first_seen[a.block] = min(first_seen.get(a.block, position), position)
    groups = min(k, n)
    # Some receiver fetches each block among its first ceil(B/K) fetches: each group covers its share.
    assert max(first_seen.values()) < math.ceil(num_blocks / groups)
    if groups == 1:  # one group: a chain while it is short, a binomial pipeline beyond
        alone = "chain" if n <= GROUP_CHAIN_MAX else "binomial"
        assert plan.assignments == make_plan(alone, sources[:1], [f"w{i}" for i in range(n)],
                                             num_blocks).assignments


def test_binomial_for_a_thousand_receivers_keeps_its_bounds():
    receivers = [f"w{i}" for i in range(1000)]
    plan = make_plan("binomial", ["store"], receivers, 64)
    assert all(sorted(a.block for a in fetches) == list(range(64)) for fetches in plan.assignments.values())
    sent = _uploads(plan)
    assert sent["store"] == 64
    assert max(sent[rx] for rx in receivers if rx in sent) <= 64 + 8  # d = 9
    assert max(len(plan.children(rx, b)) for rx in receivers for b in range(64)) <= 9


def test_chain_and_tree_shapes():
    chain = make_plan("chain", ["store"], ["a", "b", "c"], 2)
    assert chain.assignments == {"a": [Fetch(0, "store"), Fetch(1, "store")],
                                 "b": [Fetch(0, "a"), Fetch(1, "a")],
                                 "c": [Fetch(0, "b"), Fetch(1, "b")]}
    tree = make_plan("tree", ["store"], [f"w{i}" for i in range(7)], 1, fanout=3)
    assert {rx: fetches[0].parent for rx, fetches in tree.assignments.items()} == {
        "w0": "store", "w1": "store", "w2": "store", "w3": "w0", "w4": "w0", "w5": "w0", "w6": "w1"}
    assert tree.children("w0", 0) == ["w3", "w4", "w5"] and tree.children("w6", 0) == []


def test_unicast_deals_receivers_round_robin_over_sources():
    plan = make_plan("unicast", ["a", "b"], ["x", "y", "z"], 2)
    assert plan.assignments == {"x": [Fetch(0, "a"), Fetch(1, "a")],
                                "y": [Fetch(0, "b"), Fetch(1, "b")],
                                "z": [Fetch(0, "a"), Fetch(1, "a")]}


def test_labels_prefer_a_parent_in_the_same_rack():
    racks = {"east": {"rack": "e"}, "west": {"rack": "w"},
             **{f"e{i}": {"rack": "e"} for i in range(4)}, **{f"w{i}": {"rack": "w"} for i in range(4)}}
    mixed = ["e0", "w0", "e1", "w1", "e2", "w2", "e3", "w3"]
    unicast = make_plan("unicast", ["east", "west"], mixed, 3, labels=racks)
    assert all(a.parent[0] == rx[0] for rx, fetches in unicast.assignments.items() for a in fetches)
    for strategy in ("chain", "tree", "binomial", "rotated"):
        plan = make_plan(strategy, ["east", "west"], mixed, 4, labels=racks)
        cross = sum(a.parent[0] != rx[0] for rx, fetches in plan.assignments.items() for a in fetches)
        blind = make_plan(strategy, ["east", "west"], mixed, 4)
        blind_cross = sum(a.parent[0] != rx[0] for rx, fetches in blind.assignments.items() for a in fetches)
        assert cross < blind_cross, strategy
    # The chain starts in the source's rack and crosses to the other rack once.
    chain = make_plan("chain", ["west"], mixed, 2, labels=racks)
    assert [a.parent for a in chain.assignments["w0"]] == ["west", "west"]
    assert sum(a.parent[0] != rx[0] for rx, fetches in chain.assignments.items() for a in fetches) == 2
    # Rotated puts each rack's receivers in the group of that rack's source: no block crosses racks.
    rotated = make_plan("rotated", ["east", "west"], mixed, 4, labels=racks)
    assert all(a.parent[0] == rx[0] for rx, fetches in rotated.assignments.items() for a in fetches)


@pytest.mark.parametrize("args, message", [
    (("bcast", ["s"], ["a"], 1), "make_plan: unknown strategy 'bcast' (expected one of unicast, chain, tree, "
                                  "binomial, rotated)"),
    (("chain", ["s"], ["a"], 0), "make_plan: num_blocks must be a positive integer, got 0"),
    (("chain", [], ["a"], 1), "make_plan: no sources to plan from"),
    (("chain", ["s"], ["a", "a"], 1), "make_plan: receiver 'a' is listed twice"),
    (("chain", ["s"], ["a", ""], 1), "make_plan: receiver id must be a non-empty string, got ''"),
    (("chain", ["s", "a"], ["a"], 1), "make_plan: 'a' is both a source and a receiver"),
])
def test_make_plan_rejects_bad_requests(args, message):
    with pytest.raises(PlanError) as err:
        make_plan(*args)
    assert str(err.value) == message
    assert isinstance(err.value, PipecastError)


def test_make_plan_rejects_a_zero_fanout():
    with pytest.raises(PlanError, match=r"^make_plan: fanout must be a positive integer, got 0$"):
        make_plan("tree", ["s"], ["a"], 1, fanout=0)


@settings(max_examples=80, deadline=None)
@given(plan_requests())
def test_json_round_trip(case):
    strategy, sources, receivers, num_blocks, fanout, labels = case
    plan = make_plan(strategy, sources, receivers, num_blocks, fanout=fanout, labels=labels)
    data = plan.to_json()
    assert set(data) == {"strategy", "sources", "assignments"}
    again = Plan.from_json(json.loads(json.dumps(data)))
    assert again == plan and again.to_json() == data


def test_json_round_trip_keeps_holders():
    plan = Plan("chain", ("s",), {"a": [Fetch(1, "s")], "b": [Fetch(0, "a"), Fetch(1, "a")]},
                {"a": (0,)})
    data = plan.to_json()
    assert data["held"] == {"a": [0]}
    assert Plan.from_json(json.loads(json.dumps(data))) == plan


def _good() -> dict:
    return {"strategy": "chain", "sources": ["s"], "assignments": {"a": [[0, "s"], [1, "s"]],
                                                                    "b": [[0, "a"], [1, "a"]]}}


@pytest.mark.parametrize("change, message", [
    (lambda d: [d], "malformed plan: expected a JSON object, got list"),
    (lambda d: d.pop("sources") and d, "malformed plan: missing key(s) sources"),
    (lambda d: {**d, "extra": 1}, "malformed plan: unknown key(s) extra"),
    (lambda d: {**d, "strategy": 3}, "malformed plan: 'strategy' must be a string, got int"),
    (lambda d: {**d, "strategy": "gossip"}, "malformed plan: unknown strategy 'gossip' (expected one of "
                                            "unicast, chain, tree, binomial, rotated)"),
    (lambda d: {**d, "sources": "s"}, "malformed plan: 'sources' must be a list of node ids"),
    (lambda d: {**d, "sources": []}, "malformed plan: no sources"),
    (lambda d: {**d, "sources": ["s", "s"]}, "malformed plan: source 's' is listed twice"),
    (lambda d: {**d, "assignments": []}, "malformed plan: 'assignments' must be an object mapping receiver "
                                         "ids to fetch lists, got list"),
    (lambda d: {**d, "held": [1]}, "malformed plan: 'held' must be an object mapping node ids to block "
                                   "lists, got list"),
    (lambda d: {**d, "held": {"a": [-1]}}, "malformed plan: held blocks of 'a' must be a list of block "
                                           "indexes >= 0"),
    (lambda d: {**d, "held": {"s": [0]}}, "malformed plan: source 's' is also listed as a holder"),
    (lambda d: {**d, "held": {"a": [0]}}, "malformed plan: 'a' fetches block 0 that it holds"),
    (lambda d: d["assignments"].update(a={}) or d, "malformed plan: fetches of 'a' must be a list, got dict"),
    (lambda d: d["assignments"]["a"].append([True, "s"]) or d,
     "malformed plan: fetch 2 of 'a' must be [block, parent] or [block, parent, first, end] with a block index >= 0 "
     "and a parent id, got [True, 's']"),
    (lambda d: d["assignments"]["a"].append([2]) or d,
     "malformed plan: fetch 2 of 'a' must be [block, parent] or [block, parent, first, end] with a block index >= 0 "
     "and a parent id, got [2]"),
    (lambda d: d["assignments"]["a"].append([0, "s"]) or d, "malformed plan: 'a' fetches block 0 twice"),
    (lambda d: d["assignments"]["a"].append([2, "a"]) or d, "malformed plan: 'a' fetches block 2 from itself"),
    (lambda d: d["assignments"]["a"].append([2, ""]) or d,
     "malformed plan: 'a' has a fetch Fetch(block=2, parent='', chunks=None) without a block index >= 0 and a "
     "parent id"),
    (lambda d: d["assignments"].update(s=[[0, "a"]]) or d, "malformed plan: source 's' is also a receiver"),
    (lambda d: d["assignments"]["b"].append([2, "x"]) or d,
     "malformed plan: 'b' fetches block 2 from 'x', which is no source, does not hold it and does not fetch it"),
    (lambda d: d["assignments"].update(a=[[0, "b"], [1, "s"]]) or d,
     "malformed plan: block 0: 'a' is its own ancestor ('a' -> 'b' -> 'a', each fetching from the next)"),
    # No per-block cycle, but a gets 0 from b, which gets it after 1, which it gets from a after 0.
    (lambda d: d["assignments"].update(a=[[0, "b"], [1, "s"]], b=[[1, "a"], [0, "s"]]) or d,
     "malformed plan: fetch orders and parent links form a cycle, so receivers 'a', 'b' would wait for each "
     "other forever"),
])
def test_from_json_rejects_malformed_plans(change, message):
    with pytest.raises(PlanError) as err:
        Plan.from_json(change(_good()))
    assert str(err.value) == message


def test_a_receiver_with_no_fetch_hides_no_cycle_and_shifts_no_level():
    # An emptied receiver (a re-plan keeps one whose fetches all went) shared its first index with the next
    # receiver's first fetch, which was then counted ready twice: a cycle passed, a child levelled before its parent.
    cycle = {"r1": [Fetch(1, "s0"), Fetch(0, "r2")], "r2": [Fetch(0, "r1")]}
    for assignments in ({"r0": [], **cycle}, {**cycle, "r0": []}):
        with pytest.raises(PlanError, match="block 0: 'r1' is its own ancestor"):
            Plan("chain", ("s0",), assignments).validate()
    chain = {"r2": [Fetch(0, "s0"), Fetch(1, "s0"), Fetch(2, "s0")], "r0": [], "r1": [Fetch(5, "s0"), Fetch(2, "r2")],
             "r3": [Fetch(2, "r1")]}
    assert Plan("chain", ("s0",), chain).fetch_levels() == {"r2": [0, 1, 2], "r0": [], "r1": [0, 3], "r3": [4]}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(plan_requests(), st.data(), json_values)
def test_from_json_never_crashes_on_a_corrupted_plan(case, data, junk):
    strategy, sources, receivers, num_blocks, fanout, labels = case
    plan_json = make_plan(strategy, sources, receivers, num_blocks, fanout=fanout, labels=labels).to_json()
    places = [(plan_json, key) for key in plan_json]
    for rx, fetches in plan_json["assignments"].items():
        places.append((plan_json["assignments"], rx))
        places.extend((fetches, k) for k in range(len(fetches)))
        places.extend((pair, k) for pair in fetches for k in (0, 1))
    container, key = data.draw(st.sampled_from(places))
    container[key] = junk
    try:
        Plan.from_json(plan_json)
    except PlanError:
        pass


def test_children_inverts_the_assignments():
    plan = make_plan("binomial", ["store"], [f"w{i}" for i in range(12)], 5)
    for node in ["store", *plan.assignments]:
        for block in range(5):
            assert plan.children(node, block) == [rx for rx, fetches in plan.assignments.items()
                                                  if Fetch(block, node) in fetches]


# --- the simulator: times in units of one chunk at link rate (1 byte chunks at 1 byte/s) ---

def _finish(strategy, n, num_blocks, chunks_per_block, sources=("store",), serve="fair", **kw) -> float:
    plan = make_plan(strategy, list(sources), [f"w{i}" for i in range(n)], num_blocks, **kw)
    return max(simulate(plan, chunks_per_block, 1, 1, serve=serve).values())


def test_chain_takes_s_over_b_plus_one_chunk_per_hop():
    plan = make_plan("chain", ["store"], [f"w{i}" for i in range(5)], 8)
    done = simulate(plan, block_bytes=4 << 20, link_bytes_per_s=1 << 20, chunk_bytes=1 << 20)
    assert done == {f"w{i}": pytest.approx(32 + i) for i in range(5)}


def test_unicast_takes_n_s_over_b_per_source():
    assert _finish("unicast", 6, 4, 2) == 6 * 8
    assert _finish("unicast", 6, 4, 2, sources=("a", "b")) == 3 * 8


def test_tree_pipelined_and_not():
    # Pipelined, a node's uplink is shared by its two children: about 2 S/B whatever N.
    assert 2 * 64 <= _finish("tree", 15, 16, 4) <= 2 * 64 * 1.1
    # Unpipelined (one chunk per model) a node sends to its children one after the other: with 7
    # receivers the last one (store -> w1, second; w1 -> w5, second) has the model at 2 S/B + 2 S/B.
    assert _finish("tree", 7, 1, 1) == 4


@pytest.mark.parametrize("n", [3, 7, 31])
def test_binomial_without_cut_through_takes_k_plus_log_n_rounds(n):
    # Store-and-forward of whole blocks reproduces the rounds exactly: k + d rounds for n = 2^d - 1.
    dim = (n + 1).bit_length() - 1
    assert _finish("binomial", n, 16, 1) == 16 + dim


@pytest.mark.parametrize("n", [20, 31, 100])
def test_binomial_is_close_to_the_floor_and_beats_the_alternatives(n):
    dim = (n + 1).bit_length() - 1
    ideal = (64 + dim) * 2  # k + d rounds of one block (2 chunks)
    binomial = _finish("binomial", n, 64, 2)
    assert binomial <= ideal * 1.06
    assert binomial < _finish("chain", n, 64, 2) and binomial < _finish("tree", n, 64, 2) / 1.8
    assert _finish("rotated", n, 64, 2, sources=("peer", "store")) <= ideal * 1.06


def test_binomial_needs_the_round_rhythm_at_many_chunks_per_block():
    # Fair sharing with 4 chunks per block lets early receivers steal their parent's uplink from the
    # current round; serving the child furthest behind keeps close to (k + d) rounds.
    ideal = (32 + 5) * 4
    assert _finish("binomial", 31, 32, 4) > 1.5 * ideal
    assert _finish("binomial", 31, 32, 4, serve="earliest") <= 1.05 * ideal
    assert _finish("binomial", 100, 64, 8, serve="earliest") <= 1.05 * (64 + 6) * 8


def test_simulate_takes_sizes_per_block_and_holders():
    plan = Plan("chain", ("s",), {"a": [Fetch(1, "s")], "b": [Fetch(0, "a"), Fetch(1, "a")]},
                {"a": (0,)})
    # b: block 0 (3 bytes, chunks of 2 and 1) from holder a, then block 1 (2 bytes) that a has at 2.
    assert simulate(plan, [3, 2], 1, 2) == {"a": 2, "b": 3 + 2}


def test_a_hop_latency_delays_each_chunks_arrival_but_not_the_next_chunks_send():
    plan = make_plan("chain", ["s"], ["a", "b"], 1)
    # 4 chunks of 1 s each: a's last arrives at 4 + L; a forwards each as it lands, b's last at 5 + 2L.
    assert simulate(plan, 4, 1, 1, hop_latency_s=0.25) == {"a": 4.25, "b": 5.5}
    with pytest.raises(ValueError, match="hop latency and start delay must be >= 0, got -1 and 0.0"):
        simulate(plan, 4, 1, 1, hop_latency_s=-1)


def test_simulate_reports_a_deadlock():
    # a gets block 0 from b, which gets it only after block 1, which it gets from a after block 0.
    plan = Plan("chain", ("s",), {"a": [Fetch(0, "b"), Fetch(1, "s")],
                                  "b": [Fetch(1, "a"), Fetch(0, "s")]})
    with pytest.raises(PlanError, match=r"^plan deadlocks in simulation: 2 receiver\(s\) never finish, e\.g\. "
                                        r"'a' waiting for block 0 from 'b'$"):
        simulate(plan, 1, 1, 1)


def test_simulate_rejects_bad_numbers():
    plan = make_plan("chain", ["s"], ["a"], 1)
    with pytest.raises(ValueError, match="link rate and chunk size must be positive"):
        simulate(plan, 1, 0, 1)
    with pytest.raises(ValueError, match="serve must be one of fair, earliest"):
        simulate(plan, 1, 1, 1, serve="fastest")
    with pytest.raises(ValueError, match="block_bytes gives 0 sizes; the plan fetches block 0"):
        simulate(plan, [], 1, 1)


# --- rotation by bytes and sources with several links ---

EMBEDDINGS_FIRST = [81, 25, 25, 25, 25, 25, 25, 26]  # a real model's blocks, MiB: the embeddings are 81 of 257


def test_rotated_starts_each_group_at_the_block_boundary_nearest_its_share_of_the_bytes():
    plan = make_plan("rotated", ["a", "b"], ["x", "y"], 8, block_bytes=EMBEDDINGS_FIRST)
    # Half the bytes (128.5) lie between the boundaries at 106 (block 2) and 131 (block 3): 131 is nearer,
    # so the halves are 131 and 126 bytes; by block count it would be block 4.
    assert [a.block for a in plan.assignments["y"]] == [3, 4, 5, 6, 7, 0, 1, 2]
    assert make_plan("rotated", ["a", "b"], ["x", "y"], 8).assignments["y"][0].block == 4
    # K = 4: 64.25 -> 81 (block 1), 128.5 -> 131 (block 3), 192.75 -> 181 (block 5)
    four = make_plan("rotated", ["a", "b", "c", "d"], ["w", "x", "y", "z"], 8, block_bytes=EMBEDDINGS_FIRST)
    assert [four.assignments[rx][0].block for rx in "wxyz"] == [0, 1, 3, 5]


def test_a_group_beside_receivers_in_flight_starts_where_they_lack_most():
    # One receiver in flight, 1 s into block 0: the new one starts at block 3, so that the first holds
    # blocks 0-2 (131) when the new one holds 3-7 (126); from block 0 it would duplicate the first.
    assert complement_starts(1, 8, EMBEDDINGS_FIRST, [InFlight(tuple(range(8)))]) == [3]
    assert complement_starts(1, 8, EMBEDDINGS_FIRST, [InFlight(tuple(range(1, 8)))]) == [5]  # 0 is in: 1-4 | 5-7
    assert complement_starts(1, 8, EMBEDDINGS_FIRST, [InFlight(())]) == [0]  # the one in flight holds all
    # 50 of block 0's 81 already in: the first holds 0-3 106 bytes from now, the new one 4-7 after 101;
    # counted as not begun, the start would be 3, and every layer held only after 126 (the new one's 3-7).
    assert complement_starts(1, 8, EMBEDDINGS_FIRST, [InFlight(tuple(range(8)), 50)]) == [4]
    assert complement_starts(1, 8, EMBEDDINGS_FIRST, [InFlight(tuple(range(8)), 20)]) == [3]
    assert complement_starts(1, 8, None, [InFlight(tuple(range(8)), 50)]) == [4]  # no sizes: blocks counted
    plan = make_plan("rotated", ["store"], ["y"], 8, block_bytes=EMBEDDINGS_FIRST,
                     in_flight=[InFlight(tuple(range(8)))])
    assert [a.block for a in plan.assignments["y"]] == [3, 4, 5, 6, 7, 0, 1, 2]
    plan.validate()
    assert make_plan("rotated", ["store"], ["y"], 8, block_bytes=EMBEDDINGS_FIRST,
                     in_flight=[InFlight(tuple(range(8)), 50)]).assignments["y"][0].block == 4
    for wrong in (-1, 1.5):
        with pytest.raises(PlanError, match=rf"^make_plan: a receiver in flight holds {wrong} bytes of the blocks "
                                            r"it waits for; a byte count must be an integer >= 0$"):
            make_plan("rotated", ["store"], ["y"], 8, in_flight=[InFlight(tuple(range(8)), wrong)])
    with pytest.raises(PlanError, match=r"^make_plan: a receiver in flight waits for block 8; blocks are 0-7$"):
        make_plan("rotated", ["store"], ["y"], 8, in_flight=[InFlight((7, 8))])
    with pytest.raises(PlanError, match=r"^make_plan: a receiver in flight waits for a block twice: \[0, 0, 1\]$"):
        make_plan("rotated", ["store"], ["y"], 8, in_flight=[InFlight((0, 0, 1))])
    # Ignored without in-flight receivers and by the strategies that do not rotate.
    assert make_plan("rotated", ["a", "b"], ["x", "y"], 8, in_flight=[]) == make_plan("rotated", ["a", "b"],
                                                                                       ["x", "y"], 8)
    assert make_plan("chain", ["a"], ["x"], 8, in_flight=[InFlight((0, 1))]) == make_plan("chain", ["a"], ["x"], 8)


def _all_held_at(sizes: list[int], orders: list[list[int]], present: list[int] = ()) -> int:
    """Bytes into the transfer when every block is held by one receiver, each getting its order at one rate,
    ``present[i]`` bytes of the i-th order already in (a block a receiver's order lacks, it holds from the
    start)."""
    worst = 0
    for block in range(len(sizes)):
        lands = [0 if block not in order else max(0, sum(sizes[b] for b in order[:order.index(block) + 1])
                                                  - (present[i] if i < len(present) else 0))
                 for i, order in enumerate(orders)]
        worst = max(worst, min(lands))
    return worst


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=12), st.data())
def test_a_complementing_start_gets_every_block_held_soonest(sizes, data):
    n = len(sizes)
    in_flight = [data.draw(st.permutations(range(n)).map(lambda p: p[:data.draw(st.integers(0, n))]))
                 for _ in range(data.draw(st.integers(1, 3)))]
    weights = sizes if any(sizes) else [1] * n
    present = [data.draw(st.integers(0, sum(weights[b] for b in order))) for order in in_flight] if any(sizes) \
        else []
    receivers = [InFlight(tuple(order), present[i] if present else 0) for i, order in enumerate(in_flight)]
    start = complement_starts(1, n, sizes, receivers)[0]
    rotation = lambda s: [(s + i) % n for i in range(n)]  # noqa: E731
    best = min(_all_held_at(weights, [*in_flight, rotation(s)], present) for s in range(n))
    assert _all_held_at(weights, [*in_flight, rotation(start)], present) == best
    plan = make_plan("rotated", ["s"], ["x", "y"], n, block_bytes=sizes, source_links={"s": 2}, in_flight=receivers)
    for fetches in plan.assignments.values():
        assert sorted(a.block for a in fetches) == list(range(n))
    plan.validate()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 40), st.integers(1, 24), st.integers(1, 3), st.integers(0, 1000))
def test_rotated_with_equal_block_sizes_is_rotated_by_block_count(k, n, num_blocks, links, size):
    sources, receivers = [f"s{i}" for i in range(k)], [f"w{i}" for i in range(n)]
    by_count = make_plan("rotated", sources, receivers, num_blocks, source_links={"s0": links})
    assert make_plan("rotated", sources, receivers, num_blocks, block_bytes=[size] * num_blocks,
                     source_links={"s0": links}) == by_count


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3), st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(0, 30),
       st.lists(st.integers(0, 300), min_size=1, max_size=16))
def test_rotated_by_bytes_from_sources_with_links_delivers_every_block_once(k, links, n, sizes):
    sources, receivers = [f"s{i}" for i in range(k)], [f"w{i}" for i in range(n)]
    source_links = dict(zip(sources, links))
    plan = make_plan("rotated", sources, receivers, len(sizes), block_bytes=sizes, source_links=source_links)
    assert plan.sources == tuple(sources) and set(plan.assignments) == set(receivers)
    for fetches in plan.assignments.values():
        assert sorted(a.block for a in fetches) == list(range(len(sizes)))
    _ancestors_reach_a_root(plan)
    plan.validate()
    simulate(plan, [s + 1 for s in sizes], 1, 50, links=source_links)
    # One receiver per slot: each fetches its group's rotation, which starts at the block boundary nearest
    # byte g*S/K; where groups would share a first block and there are blocks enough, each gets its own.
    slots = sum(source_links.get(s, 1) for s in sources)
    alone = make_plan("rotated", sources, [f"v{g}" for g in range(slots)], len(sizes), block_bytes=sizes,
                      source_links=source_links)
    starts = [alone.assignments[f"v{g}"][0].block for g in range(slots)]
    weights = sizes if any(sizes) else [1] * len(sizes)
    total, bounds = sum(weights), [0, *itertools.accumulate(weights)][:-1]
    nearest = [min(range(len(sizes)), key=lambda b: (abs(bounds[b] * slots - g * total), b)) for g in range(slots)]
    if len(sizes) >= slots:
        assert starts == sorted(set(starts))
    if nearest == sorted(set(nearest)):
        assert starts == nearest


def test_a_store_with_four_links_feeds_four_groups():
    receivers = [f"w{i}" for i in range(8)]
    plan = make_plan("rotated", ["store"], receivers, 8, source_links={"store": 4})
    plan.validate()
    assert plan.sources == ("store",)
    for fetches in plan.assignments.values():
        assert sorted(a.block for a in fetches) == list(range(8))
    fed = [rx for rx, fetches in plan.assignments.items() if fetches[0].parent == "store"]
    assert len(fed) == 4 and {plan.assignments[rx][0].block for rx in fed} == {0, 2, 4, 6}
    assert _uploads(plan)["store"] == 4 * 8  # each group gets every block from the store once
    # Each group of 2 is a pair: one fetches from the store and forwards to the other.
    partners = {rx: {a.parent for a in fetches} for rx, fetches in plan.assignments.items() if rx not in fed}
    assert all(parents == {"store"} for rx, parents in ((rx, {a.parent for a in plan.assignments[rx]}) for rx in fed))
    assert sorted(p for parents in partners.values() for p in parents) == sorted(fed)


def test_a_store_of_more_links_than_receivers_costs_nothing_for_the_links_no_group_gets():
    """Found in review: a slot per link was built, 10**7 links took 10 s and 1.1 GB for 3 receivers."""
    receivers = ["a", "b", "c"]
    plan = make_plan("rotated", ["s"], receivers, 3, source_links={"s": 10**9})
    assert plan == make_plan("rotated", ["s"], receivers, 3, source_links={"s": 3})
    assert make_plan("rotated", ["s"], [], 3, source_links={"s": 10**9}).assignments == {}


def test_a_store_at_four_links_finishes_near_one_transfer_not_four():
    plan = make_plan("rotated", ["store"], [f"w{i}" for i in range(8)], 8, source_links={"store": 4})
    floor = 8 * 4  # S/B: 8 blocks of 4 chunks at one chunk per unit
    fast = max(simulate(plan, 4, 1, 1, links={"store": 4}).values())
    assert floor <= fast <= floor + 2  # one chunk of latency for the pair's forwarding
    assert max(simulate(plan, 4, 1, 1).values()) >= 4 * floor  # one link: the four groups share it


def test_simulate_with_one_link_per_node_is_unchanged_by_links():
    plan = make_plan("binomial", ["store"], [f"w{i}" for i in range(12)], 6)
    assert simulate(plan, 3, 1, 1, links={"store": 1}) == simulate(plan, 3, 1, 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_bytes": [1, 2]}, "make_plan: block_bytes gives 2 sizes for 3 blocks"),
    ({"block_bytes": [1, -2, 3]}, "make_plan: block 1 has size -2; sizes must be integers >= 0"),
    ({"block_bytes": [1, 2.5, 3]}, "make_plan: block 1 has size 2.5; sizes must be integers >= 0"),
    ({"source_links": {"x": 2}}, "make_plan: source_links names 'x', which is no source"),
    ({"source_links": {"s": 0}}, "make_plan: links of source 's' must be a positive integer, got 0"),
])
def test_make_plan_rejects_bad_sizes_and_links(kwargs, message):
    with pytest.raises(PlanError) as err:
        make_plan("rotated", ["s"], ["a"], 3, **kwargs)
    assert str(err.value) == message


def test_simulate_rejects_bad_links():
    plan = make_plan("chain", ["s"], ["a"], 1)
    with pytest.raises(ValueError, match=r"^simulate: links of 's' must be a positive integer, got 0$"):
        simulate(plan, 1, 1, 1, links={"s": 0})


# --- plans over chunk ranges of blocks ---

DEMO_CHUNKS = [82, 28, 28, 28, 28, 28, 28, 14]  # the demo package's blocks in 1 MiB chunks (264 MiB-chunks)


def _coverage(fetches, chunk_counts) -> dict[int, list[int]]:
    """How often a receiver's fetches get each chunk of each block (a whole fetch: every chunk)."""
    got = {b: [0] * max(count, 1) for b, count in enumerate(chunk_counts)}
    for a in fetches:
        first, end = a.chunks or (0, max(chunk_counts[a.block], 1))
        for c in range(first, end):
            got[a.block][c] += 1
    return got


def _containing_fetch_level(plan, levels, parent, a):
    """The level of ``parent``'s fetch of ``a``'s unit or of one containing it, None if it has none."""
    for fetch, level in zip(plan.assignments.get(parent, ()), levels.get(parent, ())):
        if fetch.block == a.block and (fetch.chunks is None or (
                a.chunks is not None and fetch.chunks[0] <= a.chunks[0] and a.chunks[1] <= fetch.chunks[1])):
            return level
    return None


@st.composite
def ranged_requests(draw):
    strategy = draw(st.sampled_from(["binomial", "binomial", "rotated"]))
    n = draw(st.integers(1, 200))
    counts = draw(st.lists(st.integers(0, 9), min_size=1, max_size=6))
    units = draw(st.none() | st.integers(1, 60))
    sources = ["store"] if strategy == "binomial" else [f"s{i}" for i in range(draw(st.integers(1, 3)))]
    return strategy, sources, [f"w{i}" for i in range(n)], counts, units


@settings(max_examples=60, deadline=None)
@given(ranged_requests())
def test_ranged_plans_get_every_chunk_once_from_a_holder_of_it_without_deadlock(case):
    strategy, sources, receivers, counts, units = case
    plan = make_plan(strategy, sources, receivers, len(counts), chunk_counts=counts, units=units)
    plan.validate()
    levels = plan.fetch_levels()
    sizes = {len(fetches) for fetches in plan.assignments.values()}
    for rx, fetches in plan.assignments.items():
        assert all(c == [1] * len(c) for c in _coverage(fetches, counts).values()), rx
        for a, level in zip(fetches, levels[rx]):
            assert a.chunks is None or 0 <= a.chunks[0] < a.chunks[1] <= counts[a.block]
            # A block in one unit is fetched whole, so a range is never the whole block.
            assert a.chunks != (0, counts[a.block])
            if a.parent not in sources:
                parent_level = _containing_fetch_level(plan, levels, a.parent, a)
                assert parent_level is not None and parent_level < level, (rx, a)
    # Compact: a fetch per block a unit covers, the same units for every receiver of a group, never more units
    # than asked (each unit that runs on into the next block adds a fetch there).
    if strategy == "binomial":
        assert len(sizes) == 1
        if units is not None:
            assert sizes.pop() <= units + len(counts) - 1
    block_bytes = [3 * max(count, 1) for count in counts]  # chunks of 3 bytes, every block's last one too
    done = simulate(plan, block_bytes, 1, 3, hop_latency_s=0.5)
    assert set(done) == set(receivers)
    assert max(done.values()) >= lower_bound(plan, block_bytes, 1, 3, hop_latency_s=0.5)


def test_units_are_runs_of_one_size_going_on_into_the_next_block():
    # A block wholly in a run is whole there; a block of no chunks is a unit of its own, the run going on past it.
    assert cut_units([(0, 7), (1, 2), (2, 0), (3, 1), (4, 6)], 3) == [
        ((0, (0, 3)),), ((0, (3, 6)),), ((0, (6, 7)), (1, None)), ((2, None),), ((3, None), (4, (0, 2))),
        ((4, (2, 5)),), ((4, (5, 6)),)]
    plan = make_plan("binomial", ["s"], [f"w{i}" for i in range(7)], 3, chunk_counts=[7, 3, 5], units=5)
    # The smallest size with at most 5 units is 3 (8 units of 2 would be too many): 15 chunks in 5 runs.
    fetches = plan.assignments["w0"]
    assert sorted((a.block, a.chunks) for a in fetches) == [
        (0, (0, 3)), (0, (3, 6)), (0, (6, 7)), (1, (0, 2)), (1, (2, 3)), (2, (0, 2)), (2, (2, 5))]
    # A unit's pieces come from one parent, one after the other.
    at = {(a.block, a.chunks): i for i, a in enumerate(fetches)}
    for first, second in (((0, (6, 7)), (1, (0, 2))), ((1, (2, 3)), (2, (0, 2)))):
        assert at[second] == at[first] + 1 and fetches[at[first]].parent == fetches[at[second]].parent
    # One unit: every block whole, from one parent.
    whole = make_plan("binomial", ["s"], ["a", "b", "c"], 3, chunk_counts=[7, 2, 5], units=1)
    assert all([(a.block, a.chunks) for a in fetches] == [(0, None), (1, None), (2, None)] and
               len({a.parent for a in fetches}) == 1 for fetches in whole.assignments.values())


def test_the_default_unit_keeps_the_rounds_near_s_over_b_with_few_units():
    # (k + d) rounds of s chunks within 10% of T chunks, the largest such s, then at most MAX_FAIR_UNIT_CHUNKS
    # where that makes at most MAX_FAIR_UNITS units: the demo package has few chunks, so small units (4 chunks
    # meet the budget at d = 4, but shared fairly they lose the rhythm); a big model a few units per block.
    assert [(d, unit_chunks(DEMO_CHUNKS, d)) for d in (4, 6, 8, 10, 12)] == [(4, 2), (6, 2), (8, 2), (10, 2), (12, 2)]
    big = [1750] * 80
    size = unit_chunks(big, 10)
    units = len(cut_units(list(enumerate(big)), size))
    # Within the budget, the fewest fetches: two even units a block (1,400-chunk units made as many fetches, 100
    # units and 60 boundaries inside them, and took longer).
    assert (size, units) == (875, 160) and (units + 10) * size <= 1.1 * sum(big) < (80 + 10) * 1750
    # Fewer rounds deep, whole blocks meet the budget: one fetch a block, none of them cut.
    assert unit_chunks(big, 6) == 1750 and unit_chunks([875] * 160, 4) == 875
    # Where no size meets the budget, the quickest of at least MIN_UNIT_CHUNKS: (3 + 10) * 2 chunk times beat
    # (2 + 10) * 3, and one-chunk units are no default where blocks have more chunks, though (6 + 10) * 1 would
    # be quicker still; blocks of one chunk stay units of their own (the blocks a pipeline across nodes forms from).
    assert unit_chunks([3, 3], 10) == 2 and unit_chunks([1, 1], 3) == 1
    plan = make_plan("binomial", ["s"], [f"w{i}" for i in range(1024)], 8, chunk_counts=DEMO_CHUNKS)
    assert {len(fetches) for fetches in plan.assignments.values()} == {132}  # ~13 units a round of d = 10


def test_only_binomial_pipelines_split_blocks():
    receivers = [f"w{i}" for i in range(12)]
    for strategy in ("unicast", "chain", "tree"):
        whole = make_plan(strategy, ["s"], receivers, 3)
        assert make_plan(strategy, ["s"], receivers, 3, chunk_counts=[9, 9, 9]) == whole
    # Rotated groups of up to GROUP_CHAIN_MAX are chains of whole blocks; larger ones binomial over units.
    rotated = make_plan("rotated", ["s", "t"], [f"w{i}" for i in range(30)], 3, chunk_counts=[9, 9, 9])
    assert all(a.chunks is not None for fetches in rotated.assignments.values() for a in fetches)
    small = make_plan("rotated", ["s", "t"], receivers, 3, chunk_counts=[9, 9, 9])
    assert small == make_plan("rotated", ["s", "t"], receivers, 3)


@pytest.mark.parametrize("kwargs, message", [
    ({"chunk_counts": [4, 4]}, "make_plan: chunk_counts gives 2 counts for 3 blocks"),
    ({"chunk_counts": [4, -1, 4]}, "make_plan: block 1 has -1 chunks; chunk counts must be integers >= 0"),
    ({"chunk_counts": [4, True, 4]}, "make_plan: block 1 has True chunks; chunk counts must be integers >= 0"),
    ({"chunk_counts": [4, 4, 4], "units": 0}, "make_plan: units must be a positive integer, got 0"),
    ({"units": 5}, "make_plan: units needs chunk_counts (the chunks of each block)"),
])
def test_make_plan_rejects_bad_chunk_counts_and_units(kwargs, message):
    with pytest.raises(PlanError) as err:
        make_plan("binomial", ["s"], ["a"], 3, **kwargs)
    assert str(err.value) == message


@settings(max_examples=40, deadline=None)
@given(ranged_requests())
def test_ranged_json_round_trip(case):
    strategy, sources, receivers, counts, units = case
    plan = make_plan(strategy, sources, receivers, len(counts), chunk_counts=counts, units=units)
    data = json.loads(json.dumps(plan.to_json()))
    entries = [entry for fetches in data["assignments"].values() for entry in fetches]
    assert all(len(entry) == (2 if a.chunks is None else 4) for entry, a in
               zip(entries, (a for fetches in plan.assignments.values() for a in fetches)))
    again = Plan.from_json(data)
    assert again == plan and again.to_json() == data


def _ranged() -> dict:
    # a fetches block 0 (chunks 0-5) in two ranges, b its first range, and block 1 whole, from a.
    return {"strategy": "binomial", "sources": ["s"],
            "assignments": {"a": [[0, "s", 0, 3], [0, "s", 3, 6], [1, "s"]], "b": [[0, "a", 0, 3], [1, "a"]]}}


def test_a_ranged_plan_parses_and_a_whole_parent_holds_every_range():
    plan = Plan.from_json(_ranged())
    assert plan.assignments["a"][0] == Fetch(0, "s", (0, 3)) and plan.assignments["b"][1] == Fetch(1, "a")
    contained = _ranged()
    contained["assignments"]["b"] = [[1, "a", 2, 4], [0, "a", 1, 2]]
    assert Plan.from_json(contained).fetch_levels() == {"a": [0, 1, 2], "b": [3, 4]}


@pytest.mark.parametrize("change, message", [
    (lambda d: d["assignments"]["b"].append([2, "s", 4]) or d,
     "malformed plan: fetch 2 of 'b' must be [block, parent] or [block, parent, first, end] with a block index >= 0 "
     "and a parent id, got [2, 's', 4]"),
    (lambda d: d["assignments"]["b"].append([2, "s", 4, 4]) or d,
     "malformed plan: fetch 2 of 'b' must give its chunks as first, end with integers 0 <= first < end, "
     "got [2, 's', 4, 4]"),
    (lambda d: d["assignments"]["b"].append([2, "s", -1, 4]) or d,
     "malformed plan: fetch 2 of 'b' must give its chunks as first, end with integers 0 <= first < end, "
     "got [2, 's', -1, 4]"),
    (lambda d: d["assignments"]["b"].append([2, "s", False, 4]) or d,
     "malformed plan: fetch 2 of 'b' must give its chunks as first, end with integers 0 <= first < end, "
     "got [2, 's', False, 4]"),
    (lambda d: d["assignments"]["b"].append([2, "s", 0, 1.5]) or d,
     "malformed plan: fetch 2 of 'b' must give its chunks as first, end with integers 0 <= first < end, "
     "got [2, 's', 0, 1.5]"),
    (lambda d: d["assignments"]["b"].append([0, "s", 0, 3]) or d,
     "malformed plan: 'b' fetches chunks 0-2 of block 0 twice"),
    (lambda d: d["assignments"]["b"].append([0, "s", 2, 5]) or d,
     "malformed plan: 'b' fetches chunks 0-2 of block 0 and chunks 2-4 of block 0, which overlap"),
    (lambda d: d["assignments"]["b"].append([0, "s"]) or d,
     "malformed plan: 'b' fetches chunks 0-2 of block 0 and block 0, which overlap"),
    (lambda d: d["assignments"]["a"].insert(0, [0, "s", 5, 6]) or d,
     "malformed plan: 'a' fetches chunk 5 of block 0 and chunks 3-5 of block 0, which overlap"),
    (lambda d: d["assignments"]["b"].append([1, "s", 7, 8]) or d,
     "malformed plan: 'b' fetches block 1 and chunk 7 of block 1, which overlap"),
    (lambda d: d["assignments"]["b"].append([2, "b", 0, 2]) or d,
     "malformed plan: 'b' fetches chunks 0-1 of block 2 from itself"),
    (lambda d: {**d, "held": {"b": [0]}}, "malformed plan: 'b' fetches block 0 that it holds"),
    # a fetches chunks 0-2 and 3-5, not one unit holding 2-3.
    (lambda d: d["assignments"]["b"].__setitem__(0, [0, "a", 2, 4]) or d,
     "malformed plan: 'b' fetches chunks 2-3 of block 0 from 'a', which is no source, does not hold the block and "
     "fetches no unit containing those chunks"),
    (lambda d: d["assignments"]["a"].__setitem__(0, [0, "b", 0, 3]) or d,
     "malformed plan: chunks 0-2 of block 0: 'a' is its own ancestor ('a' -> 'b' -> 'a', each fetching from the next)"),
])
def test_from_json_rejects_malformed_ranged_fetches(change, message):
    with pytest.raises(PlanError) as err:
        Plan.from_json(change(_ranged()))
    assert str(err.value) == message


@pytest.mark.parametrize("fetch, wrong", [
    (Fetch(0, "s", (3, 3)), "whose chunks are not a range (first, end) of integers with 0 <= first < end"),
    (Fetch(1, "s", (True, 3)), "whose chunks are not a range (first, end) of integers with 0 <= first < end"),
    (Fetch(1, "s", [0, 3]), "whose chunks are not a range (first, end) of integers with 0 <= first < end"),
    (Fetch(True, "s"), "without a block index >= 0 and a parent id"),
])
def test_validate_names_a_fetch_whose_block_or_chunks_are_malformed(fetch, wrong):
    # After well-formed fetches of the same values: a bool is no index even where it equals one.
    plan = Plan("binomial", ("s",), {"a": [Fetch(1, "s", (1, 3))], "b": [Fetch(2, "s"), fetch]})
    with pytest.raises(PlanError) as err:
        plan.validate()
    assert str(err.value) == f"malformed plan: 'b' has a fetch {fetch!r} {wrong}"


@settings(max_examples=100, deadline=None)
@given(ranged_requests(), st.data(), json_values)
def test_from_json_never_crashes_on_a_corrupted_ranged_plan(case, data, junk):
    strategy, sources, receivers, counts, units = case
    plan_json = make_plan(strategy, sources, receivers[:20], len(counts), chunk_counts=counts, units=units).to_json()
    places = [(fetches, k) for fetches in plan_json["assignments"].values() for k in range(len(fetches))]
    places.extend((entry, k) for fetches in plan_json["assignments"].values() for entry in fetches
                  for k in range(len(entry)))
    container, key = data.draw(st.sampled_from(places))
    container[key] = junk
    try:
        Plan.from_json(plan_json)
    except PlanError:
        pass


def test_parts_and_children_list_a_child_once_per_block_whatever_its_ranges():
    plan = Plan.from_json(_ranged())
    plan.assignments["b"] = [Fetch(0, "a", (0, 3)), Fetch(1, "a"), Fetch(0, "a", (3, 6))]
    assert plan.children("a", 0) == ["b"] and plan.children("s", 0) == ["a"]
    parts = plan.parts()
    assert parts["a"].serve == ((0, "b"), (1, "b"))
    assert parts["s"].serve == ((0, "a"), (1, "a"))
    assert parts["b"].fetch == tuple(plan.assignments["b"])
    ranged = make_plan("binomial", ["store"], [f"w{i}" for i in range(20)], 4, chunk_counts=[30, 9, 9, 9])
    for node, part in ranged.parts().items():
        assert len(set(part.serve)) == len(part.serve)
        for block in range(4):
            assert [child for b, child in part.serve if b == block] == ranged.children(node, block)


# --- the simulator over chunk ranges, and the bound no schedule beats ---

def test_simulate_sends_a_units_bytes_and_forwards_ranges_of_a_unit_being_fetched():
    # a fetches block 0 (4 chunks of 1 byte, one per second) whole; b fetches its chunks 2-3 from a as they
    # arrive (chunk 2 at 3, chunk 3 at 4: b has them at 4 and 5), then chunks 0-1, held by then (6, 7).
    plan = Plan("binomial", ("s",), {"a": [Fetch(0, "s")], "b": [Fetch(0, "a", (2, 4)), Fetch(0, "a", (0, 2))]})
    assert simulate(plan, 4, 1, 1) == {"a": 4, "b": 7}
    # A block of 5 bytes in chunks of 2: chunk 2 is 1 byte; a unit's size is that of its chunks.
    short = Plan("binomial", ("s",), {"a": [Fetch(0, "s", (2, 3)), Fetch(0, "s", (0, 2))]})
    assert simulate(short, 5, 1, 2) == {"a": 5}
    with pytest.raises(ValueError, match=r"^simulate: 'a' fetches chunks 2-3 of block 0, which has 3 chunks$"):
        simulate(Plan("binomial", ("s",), {"a": [Fetch(0, "s", (2, 4))]}), 5, 1, 2)


def test_simulate_names_the_unit_a_deadlocked_receiver_waits_for():
    plan = Plan("binomial", ("s",), {"a": [Fetch(0, "b", (0, 2)), Fetch(1, "s")],
                                     "b": [Fetch(1, "a"), Fetch(0, "s", (0, 2))]})
    with pytest.raises(PlanError, match=r"^plan deadlocks in simulation: 2 receiver\(s\) never finish, e\.g\. "
                                        r"'a' waiting for chunks 0-1 of block 0 from 'b'$"):
        simulate(plan, 2, 1, 1)


def test_the_lower_bound_is_one_copy_and_the_first_chunk_plus_a_hop():
    chain = make_plan("chain", ["s"], ["a", "b"], 2)
    # 2 blocks of 3 chunks (1 byte/s); b starts after the store's first chunk left: 6 + 1 + the hop.
    assert lower_bound(chain, 3, 1, 1, hop_latency_s=0.5) == 7.5
    # A chain takes a hop more, and each fetch waits a hop for its first chunk: block 1's, a's from 3.5.
    assert simulate(chain, 3, 1, 1, hop_latency_s=0.5) == {"a": 7, "b": 8.5}
    # One receiver, or a store with more links, or a holder: only the one copy through a downlink.
    assert lower_bound(make_plan("chain", ["s"], ["a"], 2), 3, 1, 1) == 6
    assert lower_bound(chain, 3, 1, 1, links={"s": 2}) == 6
    assert lower_bound(Plan("chain", ("s",), {"a": [Fetch(1, "s")], "b": [Fetch(0, "a"), Fetch(1, "a")]}, {"a": (0,)}),
                       3, 1, 1) == 6
    # The smallest first chunk of a fetch from the store counts: here a 1-byte last chunk of block 1.
    ranged = Plan("binomial", ("s",), {"a": [Fetch(1, "s", (1, 2)), Fetch(0, "s"), Fetch(1, "s", (0, 1))],
                                       "b": [Fetch(0, "a"), Fetch(1, "a", (0, 1)), Fetch(1, "a", (1, 2))]})
    assert lower_bound(ranged, [4, 3], 1, 2) == 7 + 1


def test_a_relay_passes_a_chunk_on_from_its_first_piece_and_its_end_once_the_chunk_is_whole():
    # A block of 4 bytes in chunks of 2 at 1 byte/s, s -> a -> b. Relayed whole, b gets each chunk a chunk after
    # a: done at 6. Relayed from a's first piece of 1 byte, b's chunk 0 starts at 1 and its end waits for a's
    # whole chunk (at 2) plus a piece: 3; chunk 1 from 3 to 5. The bound counts a piece, not a chunk, for b.
    chain = make_plan("chain", ["s"], ["a", "b"], 1)
    assert simulate(chain, 4, 1, 2) == {"a": 4, "b": 6}
    assert simulate(chain, 4, 1, 2, relay_bytes=1) == {"a": 4, "b": 5}
    assert lower_bound(chain, 4, 1, 2) == 6
    assert lower_bound(chain, 4, 1, 2, relay_bytes=1) == 5
    # A piece as big as the chunk relays as a whole chunk does.
    assert simulate(chain, 4, 1, 2, relay_bytes=2) == simulate(chain, 4, 1, 2)
    with pytest.raises(ValueError, match=r"^simulate: relay_bytes must be an integer >= 0, got -1$"):
        simulate(chain, 4, 1, 2, relay_bytes=-1)


@settings(max_examples=80, deadline=None)
@given(plan_requests(), st.lists(st.integers(1, 9), min_size=24, max_size=24), st.integers(1, 4),
       st.sampled_from([0.0, 0.3]), st.sampled_from(SERVE_POLICIES), st.sampled_from([1, 2, 4]),
       st.sampled_from([0, 1, 2]))
def test_no_simulated_plan_beats_the_lower_bound(case, sizes, chunk, hop, serve, concurrency, relay):
    strategy, sources, receivers, num_blocks, fanout, labels = case
    counts = [-(-size // chunk) for size in sizes[:num_blocks]]
    plan = make_plan(strategy, sources, receivers, num_blocks, fanout=fanout, labels=labels, chunk_counts=counts)
    done = simulate(plan, sizes[:num_blocks], 1, chunk, serve=serve, hop_latency_s=hop, concurrency=concurrency,
                    relay_bytes=relay)
    bound = lower_bound(plan, sizes[:num_blocks], 1, chunk, hop_latency_s=hop, relay_bytes=relay)
    assert max(done.values(), default=0) >= bound - 1e-9


def test_the_ranged_binomial_stays_near_s_over_b_where_whole_blocks_do_not():
    # The demo package's blocks in 1 MiB chunks at a chunk a second (S/B = 256.6 s), 0.01 s a hop.
    chunk = 1 << 20
    sizes = [84948016, 28324768, 28324792, 28324808, 28324808, 28324808, 28324808, 14163664]
    floor = sum(sizes) / chunk

    def ratio(n: int, serve: str, **kw) -> float:
        plan = make_plan("binomial", ["store"], [f"w{i}" for i in range(n)], 8, **kw)
        return max(simulate(plan, sizes, chunk, chunk, serve=serve, hop_latency_s=0.01).values()) / floor

    for n in (31, 64):
        assert ratio(n, "earliest", chunk_counts=DEMO_CHUNKS) <= 1.13
        assert ratio(n, "earliest") >= 2
    # Units of 2 chunks (the default here) keep the rhythm with fair sharing too; of 4 they do not.
    for n in (31, 64):
        assert ratio(n, "fair", chunk_counts=DEMO_CHUNKS) <= 1.1
    assert ratio(31, "fair", chunk_counts=DEMO_CHUNKS, units=67) >= 1.5


def test_a_start_delay_holds_each_receiver_by_its_depth_and_the_bound_by_one():
    tree = make_plan("tree", ["s"], ["a", "b", "c", "d"], 1, fanout=1)  # a chain under s: depths 1..4
    plain = simulate(tree, 100, 100.0, 100)  # one chunk a block: store and forward
    delayed = simulate(tree, 100, 100.0, 100, start_delay_s=0.5)
    # a starts at 0.5 and gets its chunk at 1.5; b could start at 1.0 but waits for a's chunk: 2.5, ...
    assert plain == {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    assert delayed == {"a": 1.5, "b": 2.5, "c": 3.5, "d": 4.5}
    wide = make_plan("unicast", ["s"], ["a", "b"], 1)
    assert simulate(wide, 100, 100.0, 100, start_delay_s=3.0) == {"a": 4.0, "b": 5.0}
    assert lower_bound(wide, 100, 100.0, 100, start_delay_s=3.0) == lower_bound(wide, 100, 100.0, 100) + 3.0
    with pytest.raises(ValueError, match="start delay must be >= 0, got 0.0 and -1"):
        simulate(wide, 100, 100.0, 100, start_delay_s=-1)


def test_a_slow_link_slows_what_crosses_it_both_ways():
    chain = make_plan("chain", ["s"], ["a", "b", "c"], 1)  # s -> a -> b -> c, one chunk: store and forward
    assert simulate(chain, 100, 100.0, 100) == {"a": 1.0, "b": 2.0, "c": 3.0}
    # b's link at a quarter: a -> b and b -> c take 4 s each; a is not slowed.
    assert simulate(chain, 100, 100.0, 100, rates={"b": 0.25}) == {"a": 1.0, "b": 5.0, "c": 9.0}
    with pytest.raises(ValueError, match=r"rate share must be within \(0, 1\]"):
        simulate(chain, 100, 100.0, 100, rates={"b": 0})


def test_an_oversubscribed_rack_uplink_serialises_what_crosses_it():
    # s (rack A) feeds a, b, c (rack B) directly: three chunks at once within B's downlink... but one rack uplink.
    wide = make_plan("unicast", ["s"], ["a", "b", "c"], 1)
    racks = {"s": "A", "a": "B", "b": "B", "c": "B"}
    links = {"s": 3}  # the store could send three at once
    assert simulate(wide, 100, 100.0, 100, links=links) == {"a": 1.0, "b": 1.0, "c": 1.0}
    assert simulate(wide, 100, 100.0, 100, links=links, racks=racks, rack_uplinks=1) == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert simulate(wide, 100, 100.0, 100, links=links, racks=racks, rack_uplinks=3) == {"a": 1.0, "b": 1.0, "c": 1.0}
    # Within a rack nothing waits; racks=None or rack_uplinks=0 means no rack limit.
    same = {n: "A" for n in racks}
    assert simulate(wide, 100, 100.0, 100, links=links, racks=same, rack_uplinks=1) == {"a": 1.0, "b": 1.0, "c": 1.0}
    with pytest.raises(ValueError, match="rack uplinks must be a non-negative integer"):
        simulate(wide, 100, 100.0, 100, racks=racks, rack_uplinks=-1)


def test_a_rack_aware_chain_crosses_the_oversubscribed_uplink_once():
    nodes = [f"w{i}" for i in range(8)]
    racks = {"s": "r0", **{n: f"r{i % 2}" for i, n in enumerate(nodes)}}
    labels = {n: {"rack": r} for n, r in racks.items()}
    aware = make_plan("chain", ["s"], nodes, 4, labels=labels)
    blind = make_plan("chain", ["s"], nodes, 4)  # alternates racks: every hop crosses
    args = dict(racks=racks, rack_uplinks=1)
    assert max(simulate(aware, 100, 100.0, 10, **args).values()) < max(simulate(blind, 100, 100.0, 10, **args).values())


def test_a_relay_that_dies_is_replanned_around_after_the_detection_time():
    chain = make_plan("chain", ["s"], ["a", "b", "c"], 2)  # 2 blocks of 4 chunks of 1 s
    assert simulate(chain, 4, 1, 1) == {"a": 8, "b": 9, "c": 10}
    # b dies at 2.5 (a holds 2 chunks, b 1 whole, its second on the way: lost); c has 0 whole chunks... until
    # the repair at 3.5 gives c a's slot: c resumes from a (a sends b's lost chunk no more).
    after = simulate(chain, 4, 1, 1, failures={"b": 2.5}, detect_s=1.0)
    assert set(after) == {"a", "c"} and after["a"] == 8
    assert 8 < after["c"] <= 8 + 3.5  # behind a by the time lost
    # The later it is detected, the later c finishes; nothing finishes before it could.
    assert simulate(chain, 4, 1, 1, failures={"b": 2.5}, detect_s=3.0)["c"] >= after["c"]
    lossless = simulate(chain, 4, 1, 1, failures={"c": 1.0}, detect_s=0.5)  # a leaf dies: nobody waits
    assert lossless == {"a": 8, "b": 9}
    with pytest.raises(ValueError, match="failures must name receivers of the plan"):
        simulate(chain, 4, 1, 1, failures={"s": 1.0})


@settings(max_examples=40, deadline=None)
@given(strategy=st.sampled_from(["chain", "tree", "binomial"]), n=st.integers(3, 12), blocks=st.integers(1, 4),
       data=st.data())
def test_every_live_receiver_finishes_after_deaths_and_never_before_the_bound(strategy, n, blocks, data):
    receivers = [f"w{i}" for i in range(n)]
    plan = make_plan(strategy, ["s"], receivers, blocks, chunk_counts=[3] * blocks if strategy == "binomial" else None)
    victims = data.draw(st.lists(st.sampled_from(receivers), min_size=1, max_size=2, unique=True))
    failures = {v: data.draw(st.floats(0, 3 * blocks)) for v in victims}
    finished = simulate(plan, 3, 1, 1, failures=failures, detect_s=data.draw(st.floats(0, 2)),
                        concurrency=data.draw(st.sampled_from([1, 2, 4])))
    assert set(finished) == set(receivers) - set(victims)
    assert min(finished.values(), default=3 * blocks) >= 3 * blocks  # a receiver's own bytes at the link rate


def test_concurrent_fetches_fill_a_downlink_that_one_slow_parent_leaves_idle():
    # r fetches block 0 from x, whose link runs at a quarter, then block 1 from holder h; 4 chunks each.
    plan = Plan("chain", ("s",), {"x": [Fetch(0, "s")], "r": [Fetch(0, "x"), Fetch(1, "h")]}, {"h": (1,)})
    # x gets a chunk every 4 s and passes each on in 4 s more: block 0 lands at 20, then block 1 at 24.
    assert simulate(plan, 4, 1, 1, rates={"x": 0.25})["r"] == 24
    # Block 1 arrives while block 0 trickles in, in the gaps of r's downlink.
    assert simulate(plan, 4, 1, 1, rates={"x": 0.25}, concurrency=2)["r"] == 20
    # Still one chunk at a time down a link: two parents at full rate take as long as one.
    fast = Plan("chain", ("s",), {"r": [Fetch(0, "s"), Fetch(1, "h")]}, {"h": (1,)})
    assert simulate(fast, 4, 1, 1, concurrency=2) == simulate(fast, 4, 1, 1) == {"r": 8}


@pytest.mark.parametrize("strategy", ["chain", "tree", "unicast"])
def test_one_parent_plans_fetch_one_unit_at_a_time_whatever_the_concurrency(strategy):
    plan = make_plan(strategy, ["s"], [f"w{i}" for i in range(6)], 4)
    assert simulate(plan, 3, 1, 1, hop_latency_s=0.1, concurrency=4) == simulate(plan, 3, 1, 1, hop_latency_s=0.1)


def test_simulate_rejects_a_bad_concurrency():
    with pytest.raises(ValueError, match="concurrency must be a positive integer, got 0"):
        simulate(make_plan("chain", ["s"], ["a"], 1), 1, 1, 1, concurrency=0)


def test_a_plan_s_hops_are_its_longest_run_of_receivers_each_fetching_first_from_the_one_before():
    receivers = [f"w{i}" for i in range(7)]
    assert make_plan("chain", ["s"], receivers, 3).hops() == 7
    assert make_plan("tree", ["s"], receivers, 3, fanout=2).hops() == 3
    assert make_plan("unicast", ["s"], receivers, 3).hops() == 1
    assert Plan("chain", ("s",), {}).hops() == 0
    # Each fetching first from the other (a plan that would deadlock, not validated): counted, not followed forever.
    cycle = Plan("chain", ("s",), {"a": [Fetch(0, "b")], "b": [Fetch(0, "a")]})
    assert cycle.hops() == 2
