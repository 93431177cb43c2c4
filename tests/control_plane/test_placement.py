"""Placement of a scale-up (:mod:`control_plane.placement`), pure: which workers receive a package, which
nodes send it, and the default strategy."""

import pytest

from control_plane.errors import InsufficientWorkers, InvalidRequest, NoSource
from control_plane.placement import (
    CHAIN_MAX_RECEIVERS, CHAIN_MIN_RECEIVERS, MIN_RELAY_PIECE_BYTES, RELAY_PIECE_BYTES, Candidate, Targets,
    chain_suits, counted_targets, default_strategy, named_targets, pick_sources, plan_relay_piece, plan_transport,
    relay_piece)
from control_plane.planner.schedules import GROUP_CHAIN_MAX, binomial_pairs
from pipecast.core.settings import Settings

PACKAGE_BYTES = 100


def candidate(node: str, *, memory: int = 1000, committed: int = 0, held: int = 0, complete: bool = False,
              receiving: bool = False, releasing: bool = False, rack: str | None = None, cached: int = 0,
              serving: bool = True, transports: tuple[str, ...] = ("tcp",), serve_package: str = "") -> Candidate:
    return Candidate(node, memory, committed, held, complete, receiving, releasing, rack, cached, serving,
                     transports=transports, serve_package=serve_package)


def test_a_package_fits_beside_what_a_worker_is_committed_to():
    assert candidate("w", memory=300, committed=200).fits(PACKAGE_BYTES)
    assert not candidate("w", memory=300, committed=201).fits(PACKAGE_BYTES)


def test_named_workers_that_hold_or_receive_the_package_stay_unchanged():
    targets = named_targets("pkg", PACKAGE_BYTES, [candidate("a"), candidate("b", complete=True),
                                                   candidate("c", receiving=True), candidate("d")])
    assert targets == Targets(receivers=("a", "d"), unchanged=("b", "c"))


def test_a_named_worker_without_room_is_refused_with_its_free_budget():
    with pytest.raises(InsufficientWorkers, match="worker 'a' has 50 B of its 1000 B memory budget free; "
                                                  "package 'pkg' needs 100 B"):
        named_targets("pkg", PACKAGE_BYTES, [candidate("a", committed=950)])


def test_counted_workers_come_releasing_holders_first_then_most_held_then_least_committed():
    candidates = [candidate("full", complete=True),  # holds it and is not releasing it: not a target
                  candidate("busy", receiving=True),
                  candidate("tight", committed=950),
                  candidate("c", committed=200), candidate("b", committed=100), candidate("a", committed=100),
                  candidate("half", held=4, committed=500),
                  candidate("kept", complete=True, releasing=True)]
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 4) == Targets(("half", "a", "b"), ("kept",))


def test_the_package_store_is_never_a_counted_target():
    candidates = [candidate("store"), candidate("w0", committed=100)]
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 1, store="store") == Targets(("w0",), ())
    with pytest.raises(InsufficientWorkers, match="asked for 2 more workers; only 1 are alive"):
        counted_targets("pkg", PACKAGE_BYTES, candidates, 2, store="store")


def test_blocks_in_a_disk_cache_count_as_local_and_memory_wins_among_equals():
    candidates = [candidate("near", rack="r0"), candidate("disk", cached=3, committed=500),
                  candidate("memory", held=3, committed=500), candidate("both", held=1, cached=3, committed=900)]
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 4, {"r0"}).receivers == ("both", "memory", "disk",
                                                                                    "near")


def test_counted_workers_in_a_source_rack_come_after_holders_before_the_least_committed():
    candidates = [candidate("far", rack="r1"), candidate("unlabelled"),
                  candidate("near-busy", committed=500, rack="r0"), candidate("near", committed=100, rack="r0"),
                  candidate("half", held=4, committed=500, rack="r1"),
                  candidate("kept", complete=True, releasing=True, rack="r2")]
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 4, {"r0"}) == Targets(("half", "near", "near-busy"),
                                                                                   ("kept",))
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 3, {"r1"}) == Targets(("half", "far"), ("kept",))


def test_without_source_racks_or_labels_the_order_is_unchanged():
    candidates = [candidate("c", committed=200, rack="r0"), candidate("b", committed=100), candidate("a")]
    by_load = Targets(("a", "b"), ())
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 2) == by_load  # the store's rack is unknown
    unlabelled = [candidate(c.node_id, committed=c.committed_bytes) for c in candidates]
    assert counted_targets("pkg", PACKAGE_BYTES, unlabelled, 2, {"r0"}) == by_load


def test_too_few_workers_for_the_count_are_refused():
    with pytest.raises(InsufficientWorkers, match=r"asked for 2 more workers; only 1 are alive"):
        counted_targets("pkg", PACKAGE_BYTES, [candidate("a"), candidate("b", complete=True)], 2)


def test_sources_are_the_complete_holders_else_the_store():
    assert pick_sources(["w1", "w2"], "store", exclude={"w2"}) == ["w1"]
    assert pick_sources(["w1"], "store", exclude={"w1"}) == ["store"]
    assert pick_sources([], "store", exclude={"store"}) == []


def test_sources_are_at_most_the_limit_idle_ones_first_then_those_near_the_receivers():
    holders = ["w1", "w2", "w3", "w4", "w5"]
    assert pick_sources(holders, "store", exclude=(), limit=2) == ["w1", "w2"]
    assert pick_sources(holders, "store", exclude=(), limit=3, busy={"w1", "w2"}, near={"w5"}) == ["w5", "w3", "w4"]
    assert pick_sources(holders, "store", exclude={"w5"}, limit=2, busy={"w3"}, near={"w3", "w4"}) == ["w4", "w1"]
    assert pick_sources(holders, "store", exclude=(), limit=0) == ["w1"]  # a plan always has a source


def test_the_default_strategy_is_a_chain_for_few_receivers_of_one_source():
    assert default_strategy(1, CHAIN_MIN_RECEIVERS) == "chain"
    assert default_strategy(1, CHAIN_MIN_RECEIVERS + 1) == "binomial"  # no package size given
    assert default_strategy(2, 1) == "rotated"
    # Beside receivers in flight, a few more start where those lack most; many are planned as if alone.
    assert default_strategy(1, 1, beside_in_flight=True) == "rotated"
    assert default_strategy(1, GROUP_CHAIN_MAX + 1, beside_in_flight=True) == "chain"


def test_a_chain_goes_as_far_as_its_relay_pieces_stay_within_a_fifth_of_the_package_off_the_hypercubes():
    demo, piece = 269_000_000, relay_piece(1 << 20)  # the demo model, 1 MiB chunks relayed in 256 KiB pieces
    # 205 pieces are a fifth of it: a chain up to 206 receivers, but for the binomial pipeline's full hypercubes.
    assert [n for n in range(1, 300) if chain_suits(n, demo, piece)] == [
        n for n in range(1, 207) if n <= CHAIN_MIN_RECEIVERS or n not in (127, 128)]
    assert default_strategy(1, 100, package_bytes=demo, piece_bytes=piece) == "chain"
    assert default_strategy(1, 127, package_bytes=demo, piece_bytes=piece) == "binomial"
    assert default_strategy(1, 207, package_bytes=demo, piece_bytes=piece) == "binomial"
    # A small package keeps the chain to CHAIN_MIN_RECEIVERS, as measured; a large one stops at the cap.
    assert not chain_suits(CHAIN_MIN_RECEIVERS + 1, 32 << 20, piece)
    assert chain_suits(CHAIN_MAX_RECEIVERS - 2, 14 << 30, piece)  # 255 is a full hypercube
    assert not chain_suits(CHAIN_MAX_RECEIVERS + 1, 14 << 30, piece)
    assert not chain_suits(CHAIN_MIN_RECEIVERS + 1, 14 << 30, 0)  # no chunk size known
    assert relay_piece(128 << 10) == 128 << 10 and relay_piece(1 << 20, relay_bytes=0) == 1 << 20


def test_binomial_pairs_are_the_receivers_beyond_a_full_hypercube():
    assert [binomial_pairs(n) for n in (1, 2, 3, 7, 8, 9, 14, 127, 128, 254)] == [0, 1, 0, 0, 1, 2, 7, 0, 1, 127]


def test_a_long_chain_s_relay_piece_keeps_its_hops_within_the_fill_down_to_the_smallest_piece():
    demo = 269_000_000  # the demo model: 5% of it is 13.45 MB, 51 pieces of 256 KiB or 102 of 128 KiB
    assert [plan_relay_piece(hops, demo) for hops in (0, 1, 16, 52, 53, 103, 104, 206, 5000)] == \
        [0, 0, 0, 0, 128 << 10, 128 << 10, 64 << 10, 64 << 10, 64 << 10]
    assert MIN_RELAY_PIECE_BYTES == 64 << 10
    assert plan_relay_piece(1000, 16 << 30) == 0  # a big model's hops stay within it in whole pieces
    assert plan_relay_piece(1000, demo, piece_bytes=0) == 0  # relaying off: a plan never turns it on
    assert plan_relay_piece(1000, demo, piece_bytes=32 << 10) == 0  # pieces smaller already: left as they are


def test_the_relay_piece_planned_with_is_the_agents_default():
    assert RELAY_PIECE_BYTES == Settings.model_fields["agent_relay_bytes"].default


def test_a_counted_scale_up_takes_serving_workers_before_agents_alone():
    """Found in review: an agent with no serving worker (a store pod) was picked as a replica, least committed
    first; it never served, so the scaling daemon scaled up again and never released the copy."""
    candidates = [candidate("agent-only", held=3, cached=2, serving=False), candidate("gpu1", committed=500),
                  candidate("gpu2")]
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 2).receivers == ("gpu2", "gpu1")
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 3).receivers == ("gpu2", "gpu1", "agent-only")


def test_a_serving_only_scale_up_never_takes_an_agent_alone():
    """Found in review: the scaling daemon counts serving workers only; a scale-up of its placed on an agent alone
    (serving workers short of memory) made a copy it never counted nor released, and it asked again and again."""
    candidates = [candidate("agent-only", serving=False), candidate("gpu1"), candidate("gpu2")]
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 2, serving_only=True).receivers == ("gpu1", "gpu2")
    with pytest.raises(InsufficientWorkers, match=r"asked for 3 more workers; only 2 are alive, serve it \(a serve "
                                                  r"URL, the worker there bound to no other package\), do not hold it "
                                                  r"already and have "):
        counted_targets("pkg", PACKAGE_BYTES, candidates, 3, serving_only=True)


def test_a_serving_only_scale_up_never_takes_a_worker_serving_another_package():
    """Found in review: with a canary deployed beside its stable version, the scaling daemon's scale-up of the
    canary went to a worker serving the stable version (`pipecast serve STABLE`): it held the canary and served
    none of it, and the canary never had a replica. Workers bound to the package, or to none (agents before
    --serve-package), take it; others never (a scale-up of the operator's takes them last, as agents alone)."""
    candidates = [candidate("a-stable", serve_package="stable"), candidate("b-any"),
                  candidate("c-canary", committed=500, serve_package="canary"), candidate("d-agent", serving=False)]
    placed = counted_targets("canary", PACKAGE_BYTES, candidates, 2, serving_only=True)
    assert placed.receivers == ("b-any", "c-canary")
    with pytest.raises(InsufficientWorkers, match=r"asked for 3 more workers; only 2 are alive, serve it"):
        counted_targets("canary", PACKAGE_BYTES, candidates, 3, serving_only=True)
    assert counted_targets("canary", PACKAGE_BYTES, candidates, 4).receivers == ("b-any", "c-canary", "a-stable",
                                                                                  "d-agent")
    assert [c.serves("canary") for c in candidates] == [False, True, True, False]


# ----- transports -----

def test_a_plans_transport_is_the_offered_one_most_receivers_speak_the_first_offered_among_equals():
    assert plan_transport(["tcp", "ucx"], [("ucx",), ("ucx", "tcp"), ("tcp",), ("ucx",)]) == "ucx"
    assert plan_transport(["tcp", "ucx"], [("ucx",), ("tcp",)]) == "tcp"
    assert plan_transport(["ucx", "tcp"], [("tcp",)]) == "tcp"
    assert plan_transport(["tcp"], [("ucx",)]) == "tcp" and plan_transport([], [("tcp",)]) is None


def test_counted_workers_speak_the_plans_transport_and_holders_of_any_stay_unchanged():
    candidates = [candidate("u0", transports=("ucx",)), candidate("u1", transports=("ucx",)), candidate("t0"),
                  candidate("kept", complete=True, releasing=True, transports=("ucx",))]
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 2, offered=("tcp",)) == Targets(("t0",), ("kept",), "tcp")
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 3, offered=("tcp", "ucx")) == \
        Targets(("u0", "u1"), ("kept",), "ucx")
    assert counted_targets("pkg", PACKAGE_BYTES, candidates, 4).transport is None  # nothing offered: no choice


def test_named_workers_all_speak_a_transport_their_senders_speak():
    ucx = candidate("u0", transports=("ucx",))
    assert named_targets("pkg", PACKAGE_BYTES, [ucx, candidate("both", transports=("tcp", "ucx"))],
                         ("tcp", "ucx")) == Targets(("u0", "both"), (), "ucx")
    # Only receivers count: one that holds the package takes no plan.
    assert named_targets("pkg", PACKAGE_BYTES, [candidate("t0"), candidate("u9", complete=True, transports=("ucx",))],
                         ("tcp",)) == Targets(("t0",), ("u9",), "tcp")
    with pytest.raises(NoSource, match="^scale-up of package 'pkg': worker 'u0' speaks ucx and no node holding the "
                                       r"package to send it from does \(they speak tcp\)$"):
        named_targets("pkg", PACKAGE_BYTES, [candidate("t0"), ucx], ("tcp",))
    with pytest.raises(InvalidRequest, match="^scale-up of package 'pkg': worker 't0' speaks tcp and worker 'u0' ucx"):
        named_targets("pkg", PACKAGE_BYTES, [candidate("t0"), ucx, candidate("u1", transports=("ucx",))],
                      ("tcp", "ucx"))
