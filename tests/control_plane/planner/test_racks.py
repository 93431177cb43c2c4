"""The racks helpers: a node's rack, nodes grouped by rack, and the pool of parents."""

from hypothesis import given
from hypothesis import strategies as st

from control_plane.planner.racks import ParentPool, rack_of, rack_order

LABELS = {"a": {"rack": "r1"}, "b": {"rack": "r2"}, "c": {"rack": "r1"}, "d": {}}


def test_a_nodes_rack_comes_from_its_labels_and_nodes_group_by_rack_stably():
    rack = rack_of(LABELS)
    assert [rack(n) for n in "abcde"] == ["r1", "r2", "r1", None, None]
    assert rack_order(list("abcd"), rack) == ["a", "c", "b", "d"]
    assert rack_order(list("abcd"), rack, first="r2") == ["b", "a", "c", "d"]


def test_the_pool_hands_out_the_earliest_spare_slot_in_the_receivers_rack_first():
    pool = ParentPool(rack_of(LABELS))
    pool.add("a", 1, time=0)
    pool.add("b", 2, time=1)
    pool.add("d", 0, time=2)  # no spare slot: never handed out
    assert pool.take("r2") == "b"
    assert pool.take("r1", before=0) is None  # a's time is not before 0
    assert [pool.take(None), pool.take("r1"), pool.take(None)] == ["a", "b", None]


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 2)), max_size=4, unique_by=lambda n: n[0]),
       st.lists(st.tuples(st.sampled_from("efgh"), st.integers(0, 2), st.integers(0, 3)), max_size=4,
                unique_by=lambda n: n[0]),
       st.lists(st.tuples(st.sampled_from(["r1", "r2", None]), st.none() | st.integers(-1, 4)), max_size=12))
def test_nodes_added_first_later_are_handed_out_as_if_they_had_been_added_first(first, later, asks):
    labels = {**LABELS, "e": {"rack": "r2"}, "f": {"rack": "r1"}}
    eager, lazy = ParentPool(rack_of(labels)), ParentPool(rack_of(labels))
    for node, spare in first:
        eager.add(node, spare, time=-1)
    for node, spare, time in sorted(later, key=lambda n: n[2]):
        eager.add(node, spare, time=time)
        lazy.add(node, spare, time=time)
    lazy.add_first(first, time=-1)
    assert [eager.take(rack, before) for rack, before in asks] == [lazy.take(rack, before) for rack, before in asks]
