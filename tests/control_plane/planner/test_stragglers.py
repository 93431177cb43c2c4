"""Stragglers: rates from progress samples, who is one (and who is only behind one), and plans that demote
them to leaves without losing a unit or making a cycle."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.planner.plan import Fetch, Plan, PlanError
from control_plane.planner.replan import repair, unit_fanout
from control_plane.planner.schedules import make_plan
from control_plane.planner.simulate import simulate
from control_plane.planner.stragglers import (
    StragglerPolicy, chain_pairs, demote, find_stragglers, follow, pair_verdict, receive_rate, unit_layout)

MB = 1_000_000


def chain(n: int, blocks: int = 4) -> Plan:
    return make_plan("chain", ["store"], [f"w{i}" for i in range(1, n + 1)], blocks)


def test_receive_rate_needs_a_full_window_of_recent_samples():
    assert receive_rate([(0.0, 0)], now=0.0, window_s=0.5) is None
    assert receive_rate([(0.0, 0), (0.3, 3 * MB)], now=0.3, window_s=0.5) is None
    assert receive_rate([(0.0, 0), (0.3, 3 * MB), (0.6, 6 * MB)], now=0.6, window_s=0.5) == pytest.approx(10 * MB)
    # Samples older than 2 windows do not count: a node that stopped reporting has no rate.
    old = [(0.0, 0), (0.6, 6 * MB)]
    assert receive_rate(old, now=5.0, window_s=0.5) is None
    assert receive_rate([(0.0, 0), (1.0, 2 * MB), (1.6, 2 * MB)], now=1.6, window_s=0.5) == 0.0


def test_policy_rejects_bad_values():
    with pytest.raises(ValueError, match="straggler factor must be within"):
        StragglerPolicy(factor=1.0)
    with pytest.raises(ValueError, match="straggler window must be positive and finite, got 0"):
        StragglerPolicy(window_s=0)
    # Found in review: these passed and silently turned detection off (no rate is ever measured over them).
    for window in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match=f"straggler window must be positive and finite, got {window}"):
            StragglerPolicy(window_s=window)
    assert not StragglerPolicy(factor=0).enabled


def test_only_the_slow_relay_is_a_straggler_not_the_nodes_behind_it():
    plan = chain(8)
    parts = plan.parts()
    fast, slow = 50 * MB, 12 * MB
    rates = {f"w{i}": fast if i < 3 else slow for i in range(1, 9)}  # w3 is slow; w4..w8 follow it
    receiving = set(rates)
    assert find_stragglers(parts, rates, receiving, {}, factor=0.5).slow == ["w3"]
    assert find_stragglers(parts, rates, receiving, {}, factor=0.5, skip={"w3"}).slow == []
    assert find_stragglers(parts, rates, receiving, {}, factor=0).slow == []


def test_a_slow_leaf_is_left_alone_it_slows_no_one():
    plan = chain(4)
    rates = {"w1": 50 * MB, "w2": 50 * MB, "w3": 50 * MB, "w4": 5 * MB}
    assert find_stragglers(plan.parts(), rates, set(rates), {}, factor=0.5).slow == []


def test_nodes_behind_a_stalled_relay_are_not_judged():
    plan = chain(5)
    # w2 died (no rate): w3 gets nothing; w4 got a chunk from w3 before the stall, w5 none.
    rates = {"w1": 50 * MB, "w3": 0.0, "w4": 0.3 * MB, "w5": 0.0}
    receiving = {"w1", "w2", "w3", "w4", "w5"}
    assert find_stragglers(plan.parts(), rates, receiving, {}, factor=0.5).slow == []
    assert find_stragglers(plan.parts(), rates, receiving, dict.fromkeys(receiving, 50 * MB), factor=0.5).slow == []
    # w2 crawls but sends (demoted already): w3 gets what w2 gives it, far below what it could get, so no
    # one behind w2 is judged, though w3 receives at a quarter of w2's rate.
    rates = {"w1": 50 * MB, "w2": 2 * MB, "w3": 0.5 * MB, "w4": 0.5 * MB, "w5": 0.5 * MB}
    assert find_stragglers(plan.parts(), rates, receiving, {}, factor=0.5, skip={"w2"}).slow == []


def test_a_node_whose_receiving_parent_has_no_rate_yet_is_not_judged():
    plan = chain(4)
    rates = {"w1": 50 * MB, "w3": 5 * MB, "w4": 5 * MB}  # w2 just had its part changed: no rate
    assert find_stragglers(plan.parts(), rates, {"w1", "w2", "w3", "w4"}, {}, factor=0.5).slow == []


def test_a_slow_head_is_found_by_its_declared_link_rate_only():
    plan = chain(4)
    rates = dict.fromkeys(["w1", "w2", "w3", "w4"], 12 * MB)  # everyone as slow as the head
    receiving = set(rates)
    assert find_stragglers(plan.parts(), rates, receiving, {}, factor=0.5).slow == []
    declared = dict.fromkeys(receiving, 50 * MB)
    assert find_stragglers(plan.parts(), rates, receiving, declared, factor=0.5).slow == ["w1"]


def test_after_one_demotion_under_a_source_its_next_child_is_not_judged_again():
    plan = chain(3)
    rates = dict.fromkeys(["w1", "w2", "w3"], 12 * MB)
    declared = dict.fromkeys(rates, 50 * MB)
    assert find_stragglers(plan.parts(), rates, set(rates), declared, factor=0.5, limits={"store"}).slow == []


def test_the_next_slow_child_of_a_relay_that_lost_one_is_demoted_with_the_relay():
    """Found in review: a relay that received at full rate but sent slowly (an egress cap) got its child demoted,
    then the next child that took the slot, one after another, each as slow behind it, and never itself."""
    plan = chain(6)
    fast, slow = 50 * MB, 12 * MB
    rates = {"w1": fast, "w2": fast, "w3": slow, "w4": slow, "w5": slow, "w6": slow}  # w2 sends at a quarter
    receiving = set(rates)
    assert find_stragglers(plan.parts(), rates, receiving, {}, factor=0.5).slow == ["w3"]  # child or uplink: unknown
    after = demote(plan, {"w3"}, held={}, sources=["store"], num_blocks=4)
    assert {a.parent for a in after.assignments["w4"]} == {"w2"}
    parts = after.parts()
    found = find_stragglers(parts, rates, receiving, {}, factor=0.5, skip={"w3"}, suspects={"w2"})
    assert (found.slow, found.relays) == (["w2", "w4"], {"w2"})  # w2 blamed for w4's rate, w4 slow as it is
    # A healthy next child keeps the relay in place; a slow leaf under it points at the relay too.
    rates |= dict.fromkeys(["w4", "w5", "w6"], fast)
    assert find_stragglers(parts, rates, receiving, {}, factor=0.5, skip={"w3"}, suspects={"w2"}).slow == []
    leaf = chain(3)
    rates = {"w1": fast, "w2": fast, "w3": slow}
    assert find_stragglers(leaf.parts(), rates, set(rates), {}, factor=0.5).slow == []
    assert find_stragglers(leaf.parts(), rates, set(rates), {}, factor=0.5, suspects={"w2"}).slow == ["w2", "w3"]


def test_a_suspect_relay_with_a_child_at_full_rate_or_done_receiving_is_not_the_limit():
    """Review findings: in a tree a relay a child was demoted under kept others at full rate, yet its next slow child
    blamed it (a subtree moved for one slow leaf); and a suspect relay that finished shielded its children for
    good (a holder in ``limits`` is never judged past)."""
    plan = make_plan("tree", ["store"], [f"w{i}" for i in range(1, 15)], 2, fanout=2)
    parts = plan.parts()
    assert {c for _, c in parts["w1"].serve} == {"w3", "w4"} and parts["w3"].serve  # w3 relays too
    rates = dict.fromkeys(plan.assignments, 50 * MB) | {"w3": 5 * MB}
    # w4 gets its share of w1's rate: w1's uplink is no limit, w3 alone is slow
    found = find_stragglers(parts, rates, set(rates), {}, factor=0.5, suspects={"w1"})
    assert (found.slow, found.relays) == (["w3"], set())
    rates["w4"] = 5 * MB
    assert find_stragglers(parts, rates, set(rates), {}, factor=0.5, suspects={"w1"}).slow == ["w1", "w3", "w4"]
    del rates["w4"]  # not measured yet: not taken for slow, so w1 is not blamed on it
    assert find_stragglers(parts, rates, set(parts) - {"store"}, {}, factor=0.5, suspects={"w1"}).slow == ["w3"]
    chain3 = chain(3)
    rates = {"w1": 50 * MB, "w3": 5 * MB}  # w2 (the suspect) holds the package now
    receiving = {"w1", "w3"}
    assert find_stragglers(chain3.parts(), rates, receiving, {}, factor=0.5, suspects={"w2"}).slow == []  # a leaf
    longer = chain(4)
    rates = {"w1": 50 * MB, "w3": 5 * MB, "w4": 5 * MB}
    assert find_stragglers(longer.parts(), rates, {"w1", "w3", "w4"}, {}, factor=0.5, suspects={"w2"}).slow == ["w3"]


def test_a_leaf_falls_back_only_on_leaves_and_leaves_feeding_leaves_are_no_slots():
    """Review findings: a leaf with no free slot took a full healthy relay (a third child where the plan gives two);
    and an earlier leaf feeding two later ones raised the chain's fanout, so the next demotion gave healthy relays
    two children. (A mildly slow leaf behind a very slow one finishes with it: only stragglers pay; moved to the
    store instead, it shared the head's link and every healthy receiver took 3x longer in a simulation.)"""
    plan = make_plan("binomial", ["store"], [f"w{i}" for i in range(1, 9)], 1)
    once = demote(plan, {"w6"}, held={}, sources=["store"], num_blocks=1)
    twice = demote(once, {"w1"}, held={}, sources=["store"], num_blocks=1, demoted={"w6"})
    assert unit_fanout(twice, leaves={"w1", "w6"}) <= unit_fanout(plan)
    eight = make_plan("chain", ["store"], [f"w{i}" for i in range(1, 9)], 2)
    plans = [eight]
    for slow, before in (({"w2"}, set()), ({"w3", "w4"}, {"w2"}), ({"w5"}, {"w2", "w3", "w4"})):
        plans.append(demote(plans[-1], slow, held={}, sources=["store"], num_blocks=2, demoted=before))
    assert unit_fanout(plans[-1], leaves={"w2", "w3", "w4", "w5"}) == 1


def test_a_dead_relay_in_a_plan_with_leaves_feeding_leaves_gives_no_healthy_relay_a_second_child():
    """Found reviewing the change: a repair counted leaves feeding leaves in the plan's fanout (as demote did
    before it stopped), so a dead relay's children went two to a healthy relay in a chain."""
    plan = make_plan("chain", ["store"], [f"w{i}" for i in range(1, 10)], 2)
    held = {"w1": {0, 1}, "w2": {1}, "w3": {0}, "w6": {0}, "w7": {0, 1}, "w8": {0, 1}}
    demoted: set[str] = set()
    rounds = (({"w4", "w5", "w8"}, {"w4", "w8"}, {"w1": {0}, "w2": {1}}),
              ({"w2", "w9"}, set(), {"w1": {0, 1}, "w2": {1}, "w6": {0}, "w7": {1}, "w8": {0}}),
              ({"w6", "w7"}, set(), held))
    for slow, last, had in rounds:
        plan = demote(plan, slow, held=had, sources=["store"], num_blocks=2, demoted=demoted, last=last)
        demoted |= slow
    assert unit_fanout(plan) > 1  # a leaf feeds two leaves
    repaired, _ = repair(plan, dead={"w3"}, held=held, sources=["store"], fanout=1, leaves=demoted)
    repaired.validate()
    assert unit_fanout(repaired, leaves=demoted) == 1


def test_a_holder_feeding_several_children_shares_the_declared_rate():
    plan = make_plan("tree", ["store"], ["w1", "w2", "w3", "w4", "w5", "w6"], 2, fanout=2)
    parts = plan.parts()
    # The store feeds two children at once: each at half the link is no straggler.
    rates = {rx: 25 * MB for rx in plan.assignments}
    assert find_stragglers(parts, rates, set(rates), dict.fromkeys(rates, 50 * MB), factor=0.5).slow == []


def test_a_receiving_relay_feeding_several_children_shares_its_own_rate():
    plan = make_plan("tree", ["store"], [f"w{i}" for i in range(1, 15)], 2, fanout=2)
    assert {a.parent for a in plan.assignments["w3"]} == {a.parent for a in plan.assignments["w4"]} == {"w1"}
    # w1 and w2 relay at 40 MB/s to two children each, which get a little under half that and pass on half
    # of theirs to their two leaves: each runs at its share of its parent, so no one is a straggler.
    rates = {"w1": 40 * MB, "w2": 40 * MB} | dict.fromkeys(["w3", "w4", "w5", "w6"], 19 * MB)
    rates |= {f"w{i}": 9.5 * MB for i in range(7, 15)}
    assert find_stragglers(plan.parts(), rates, set(rates), {}, factor=0.5).slow == []


def test_demoting_a_chain_relay_puts_its_child_behind_its_parent_and_it_at_the_tail():
    plan = chain(6)
    new = demote(plan, {"w3"}, held={"w1": {0}}, sources=["store"], num_blocks=4)
    new.validate()
    parents = {rx: {a.parent for a in fetches} for rx, fetches in new.assignments.items()}
    assert parents["w4"] == {"w2"}  # the slot w3 leaves
    assert parents["w3"] == {"w6"}  # the tail, whose uplink was idle
    assert not any(a.parent == "w3" for fetches in new.assignments.values() for a in fetches)
    assert [a.block for a in new.assignments["w1"]] == [1, 2, 3]


def test_demoting_a_tree_relay_gives_no_sender_more_children_than_the_plans_fanout():
    """Found in review: every child of the straggler moved to its parent, which then served 3 per unit in a
    tree of fanout 2 (demote promises unit_fanout)."""
    plan = make_plan("tree", ["store"], [f"r{i}" for i in range(14)], 2, fanout=2)
    new = demote(plan, {"r2"}, held={}, sources=["store"], num_blocks=2)
    new.validate()
    assert new.children("r0", 0) == ["r3", "r6"]  # r6 takes r2's slot; r7 goes to a node with a free one
    assert unit_fanout(new) <= unit_fanout(plan) == 2
    assert set(simulate(new, 2, 1, 1)) == set(new.assignments)  # every receiver finishes


def test_stragglers_demoted_together_or_one_after_another_feed_no_one_but_the_leaf_after_them():
    """Found measuring a relay with a slow uplink (docs/benchmarks.md, Stragglers): leaves past the tail's one free
    slot fetched from the store, whose one link feeds the chain's head, and the whole chain ran at a third of it.
    They fetch behind the tail one after another now, ``last`` at the end."""
    plan = chain(6, blocks=3)
    held = {"store": {0, 1, 2}}
    together = demote(plan, {"w2", "w4"}, held=held, sources=["store"], num_blocks=3)
    once = demote(plan, {"w2"}, held=held, sources=["store"], num_blocks=3)
    after = demote(once, {"w4"}, held=held, sources=["store"], num_blocks=3, demoted={"w2"})
    for new in (together, after):
        new.validate()
        assert not {a.parent for rx in ("w1", "w3", "w5", "w6") for a in new.assignments[rx]} & {"w2", "w4"}
        assert {a.parent for a in new.assignments["w2"]} == {"w6"}  # the tail's one free slot
        assert {a.parent for a in new.assignments["w4"]} == {"w2"}  # then the leaf before it, not the store
    relay_last = demote(plan, {"w2", "w4"}, held=held, sources=["store"], num_blocks=3, last={"w2"})
    assert {a.parent for a in relay_last.assignments["w4"]} == {"w6"}
    assert {a.parent for a in relay_last.assignments["w2"]} == {"w4"}


def test_unit_layout_is_the_plans_own_chunk_ranges():
    plan = make_plan("binomial", ["store"], [f"w{i}" for i in range(1, 16)], 2, chunk_counts=[6, 4])
    layout = unit_layout(plan)
    assert sorted(layout) == [0, 1]
    for block, count in ((0, 6), (1, 4)):
        ranges = layout[block]
        assert ranges[0][0] == 0 and ranges[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert unit_layout(chain(3)) == dict.fromkeys(range(4), (None,))


@settings(max_examples=60, deadline=None)
@given(strategy=st.sampled_from(["chain", "tree", "binomial", "binomial-units"]), n=st.integers(2, 20),
       blocks=st.integers(1, 5), data=st.data())
def test_demote_keeps_every_unit_and_no_straggler_serves_anyone_but_a_later_one(strategy, n, blocks, data):
    receivers = [f"w{i}" for i in range(1, n + 1)]
    if strategy == "binomial-units":
        plan = make_plan("binomial", ["store"], receivers, blocks, chunk_counts=[4] * blocks)
    else:
        plan = make_plan(strategy, ["store"], receivers, blocks)
    slow = set(data.draw(st.lists(st.sampled_from(receivers), min_size=1, max_size=3)))
    ordered = sorted(slow)  # a pair's relay (last) beside its child
    beside = {ordered[-1]: ordered[0]} if len(ordered) > 1 and data.draw(st.booleans()) else {}
    healthy = set(data.draw(st.lists(st.sampled_from(ordered), max_size=2)))
    held = {rx: set(data.draw(st.lists(st.integers(0, blocks - 1), max_size=blocks))) for rx in receivers}
    new = demote(plan, slow, held=held, sources=["store"], num_blocks=blocks, last=set(beside), beside=beside,
                 healthy=healthy)
    new.validate()
    simulate(new, [4 if strategy == "binomial-units" else 1] * blocks, 1, 1)  # no deadlock
    layout = unit_layout(plan)
    for rx in receivers:
        needs = {(b, c) for b in range(blocks) if b not in held[rx] for c in layout[b]}
        got = [(a.block, a.chunks) for a in new.assignments.get(rx, ())]
        assert sorted(got, key=str) == sorted(needs, key=str), rx  # every missing unit once, nothing else
    for rx, fetches in new.assignments.items():
        assert rx in slow or not any(a.parent in slow for a in fetches), rx


def test_a_chain_relay_feeding_a_slow_child_alone_is_paired_with_it():
    plan = chain(6)
    parts, receiving = plan.parts(), set(plan.assignments)
    assert chain_pairs(["w3"], parts, receiving) == {"w3": "w2"}
    assert chain_pairs(["w1"], parts, receiving) == {}  # its parent is the store: the slow head is its own
    assert chain_pairs(["w3"], parts, receiving - {"w2"}) == {}  # w2 holds the package: a source now
    assert chain_pairs(["w2", "w3"], parts, receiving) == {"w2": "w1"}  # w2 slow itself: no pair of its own
    tree = make_plan("tree", ["store"], [f"w{i}" for i in range(1, 8)], 2, fanout=2)
    assert chain_pairs(["w3"], tree.parts(), set(tree.assignments)) == {}  # w1 feeds w4 too: its siblings tell


def test_a_pair_side_by_side_past_the_tail_and_the_verdict_that_orders_it():
    plan = chain(6)
    pair = demote(plan, {"w3", "w2"}, held={}, sources=["store"], num_blocks=4, last={"w2"}, beside={"w2": "w3"})
    pair.validate()
    # w4 behind w1; w3 on the tail's free slot, w2 beside it (the tail's too), not behind it
    assert {a.parent for a in pair.assignments["w4"]} == {"w1"}
    assert {a.parent for a in pair.assignments["w3"]} == {a.parent for a in pair.assignments["w2"]} == {"w6"}
    parts = pair.parts()
    fast, slow = 50 * MB, 12 * MB
    receiving = set(pair.assignments)
    rates = dict.fromkeys(receiving, fast) | {"w2": 0.0}  # w2, ahead, needs nothing from the tail yet

    def verdict(rates, receiving=receiving, expected=None):
        return pair_verdict("w3", "w2", parts, rates, receiving, expected or {}, factor=0.5)

    assert verdict(rates) == "relay"  # w3 keeps up: w2's uplink was the limit
    assert verdict(rates | {"w3": slow}) == "child"
    assert verdict(rates | {"w3": slow}, expected=dict.fromkeys(receiving, 200 * MB)) is None  # the tail is slow
    # Found in the netns test of a slow uplink (a 19 MB package, the verdict later in the copy): w2 had caught up
    # with the tail and took half its uplink; w3, healthy, got the other half, and was taken for the slow one.
    assert verdict(rates | {"w3": fast / 2, "w2": fast / 2}) == "relay"
    assert verdict(rates | {"w3": slow, "w2": fast - slow}) == "child"  # a slow child leaves the relay the rest
    assert verdict({node: r for node, r in rates.items() if node != "w6"}) is None  # its parent not measured yet
    assert verdict(rates | {"w3": slow}, receiving=receiving - {"w6"}) == "child"  # behind a holder
    assert verdict({node: r for node, r in rates.items() if node != "w2"}) is None  # the relay not measured yet
    # Found fuzzing: behind a tail as slow as itself, with no declared rate, a slow child "kept up" with the fastest
    # receiver's half (everyone behind stragglers): its healthy relay went behind it. No verdict behind a slow parent.
    assert verdict(dict.fromkeys(receiving, 10 * MB) | {"w1": fast, "w2": 0.0}) is None
    child_slow = follow(pair, "w3", "w2")
    child_slow.validate()
    assert {a.parent for a in child_slow.assignments["w3"]} == {"w2"}
    relay_slow = follow(pair, "w2", "w3")
    relay_slow.validate()
    assert {a.parent for a in relay_slow.assignments["w2"]} == {"w3"}
    with pytest.raises(PlanError, match="follow: 'w3' fetches from 'w2'"):
        follow(child_slow, "w2", "w3")


def test_follow_serves_a_held_block_from_the_one_ahead_and_keeps_the_old_parent_where_it_has_nothing():
    plan = Plan("chain", ("s",), {"a": [Fetch(1, "s")], "b": [Fetch(0, "s"), Fetch(1, "s"), Fetch(2, "s")]})
    new = follow(plan, "b", "a", held={0})
    new.validate()
    assert new.assignments["b"] == [Fetch(0, "a"), Fetch(1, "a"), Fetch(2, "s")] and new.held == {"a": (0,)}


def test_follow_does_not_list_a_block_the_one_ahead_still_fetches_in_the_plan_as_held():
    """Found fuzzing: the control plane passes what the one ahead verified, which includes blocks it verified since
    the plan was made and still fetches there; listed as held too, the plan failed to validate (and to load back)."""
    plan = Plan("chain", ("s",), {"a": [Fetch(0, "s"), Fetch(1, "s")], "b": [Fetch(0, "s"), Fetch(1, "s")]})
    new = follow(plan, "b", "a", held={0})
    new.validate()
    assert new.assignments["b"] == [Fetch(0, "a"), Fetch(1, "a")] and new.held == {}
