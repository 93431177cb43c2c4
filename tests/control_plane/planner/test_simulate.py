"""The simulator with receivers that die (control_plane/planner/simulate.py): the dead are left out, those not
started yet start as planned, and no figure beats the lower bound of the receivers left."""

import pytest

from control_plane.planner.schedules import make_plan
from control_plane.planner.simulate import lower_bound, simulate

RATE = 1e6  # bytes/s
CHUNK = 1000
BLOCKS = [20_000] * 4
S_OVER_B = sum(BLOCKS) / RATE


def _chain(n: int):
    return make_plan("chain", ["store"], [f"w{i}" for i in range(n)], len(BLOCKS))


def test_a_receiver_that_dies_before_its_start_is_left_out():
    # w3 (depth 4) would start at 0.064 s: the repair at 0.01 s drops it from the plan before then.
    finished = simulate(_chain(4), BLOCKS, RATE, CHUNK, start_delay_s=0.016, failures={"w3": 0.0}, detect_s=0.01)
    assert sorted(finished) == ["w0", "w1", "w2"]
    bound = lower_bound(_chain(4), BLOCKS, RATE, CHUNK, start_delay_s=0.016, dead={"w3"})
    assert max(finished.values()) >= bound


def test_a_repair_starts_no_receiver_before_its_start_delay():
    # w0 dies at 0.02 s, after its start; the repair at once hands w1 to the store. w2, at depth 3, still asks
    # for its first unit at 0.048 s, as planned, not at the repair.
    finished = simulate(_chain(3), BLOCKS, RATE, CHUNK, start_delay_s=0.016, failures={"w0": 0.02})
    assert sorted(finished) == ["w1", "w2"]
    assert finished["w2"] >= 3 * 0.016 + S_OVER_B


def test_the_lower_bound_of_a_plan_with_a_dead_receiver_is_the_others():
    # Two receivers: one of them waits for the store's first chunk, unless the other one is dead.
    plan = _chain(2)
    assert lower_bound(plan, BLOCKS, RATE, CHUNK, hop_latency_s=0.001) == pytest.approx(S_OVER_B + CHUNK / RATE + 0.001)
    alone = lower_bound(plan, BLOCKS, RATE, CHUNK, hop_latency_s=0.001, dead={"w1"})
    assert alone == pytest.approx(S_OVER_B + 0.001)
    finished = simulate(plan, BLOCKS, RATE, CHUNK, failures={"w1": 0.0})
    assert finished == {"w0": pytest.approx(lower_bound(plan, BLOCKS, RATE, CHUNK, dead={"w1"}))}  # met exactly


def test_a_start_delay_takes_plans_whose_first_parents_hold_the_unit_or_list_the_tail_first():
    """Found in review: the depth of each receiver (for the start delay) recursed along first fetches' parents:
    two receivers each holding what the other fetches first recursed for good, and a chain of 1,200 listed tail
    first went past the recursion limit."""
    from control_plane.planner.plan import Plan
    from control_plane.planner.replan import drop_held

    plan = drop_held(make_plan("binomial", ["s"], ["a", "b", "c"], 4), {"a": {0, 2}, "b": {1, 3}})
    assert set(simulate(plan, 100, 100.0, 10, start_delay_s=0.016)) == {"a", "b", "c"}
    chain = make_plan("chain", ["s"], [f"w{i}" for i in range(1200)], 2)
    reversed_chain = Plan(chain.strategy, chain.sources, dict(reversed(list(chain.assignments.items()))), chain.held)
    finish = simulate(reversed_chain, 100, 100.0, 10, start_delay_s=0.016)
    assert finish == pytest.approx(simulate(chain, 100, 100.0, 10, start_delay_s=0.016))  # the order is no matter
    assert finish["w1199"] > finish["w0"] + 1199 * 0.016


def _finished_over_floor(strategy: str, n: int, **kwargs) -> dict[str, float]:
    plan = make_plan(strategy, ["store"], [f"w{i}" for i in range(n)], len(BLOCKS), chunk_counts=[20] * len(BLOCKS))
    return {rx: t / S_OVER_B for rx, t in simulate(plan, BLOCKS, RATE, CHUNK, **kwargs).items()}


def test_a_slow_receiver_takes_its_share_of_its_parents_uplink_not_the_whole_of_it():
    # Finding: a chunk toward w1 at a quarter of the link held the store's uplink for 4 chunk times, so w0 got
    # 1/5 of it and finished at 4.87 x S/B; in fluid terms w1 takes a quarter and w0 the other 3/4 (1.33x).
    unicast = _finished_over_floor("unicast", 2, rates={"w1": 0.25})
    assert unicast["w0"] == pytest.approx(4 / 3, rel=0.03)
    assert unicast["w1"] == pytest.approx(4.0, rel=0.03)  # its own link's rate: S / (B/4)
    # A tree: the store feeds w0 and w1 (slow), w0 feeds w2 and w3; w0 gets 3/4 of the store and its two
    # children half of its uplink each, from 2 S/B on, no longer paced by the store's slow child.
    tree = _finished_over_floor("tree", 4, rates={"w1": 0.25})
    assert tree["w0"] == pytest.approx(4 / 3, rel=0.03)
    assert tree["w2"] == pytest.approx(2.0, rel=0.03) and tree["w3"] == pytest.approx(2.0, rel=0.03)
    assert tree["w1"] == pytest.approx(4.0, rel=0.03)


def test_a_slow_link_leaves_plans_without_a_slower_child_as_they_were():
    # Only an uplink feeding a child slower than itself is freed early: a chain's slow relay paces what it
    # passes on (its own uplink is slow), and its parent feeds no one else.
    assert _finished_over_floor("chain", 3, rates={"w1": 0.25})["w2"] == pytest.approx(4.0, rel=0.03)
    assert _finished_over_floor("unicast", 2) == pytest.approx({"w0": 2.0, "w1": 2.0}, rel=0.03)
