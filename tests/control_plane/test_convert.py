"""A part's transfers on the assignment stream: columns over one table of peers, and what a reader refuses."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.convert import part_to_proto, peer_to_proto, update_from_proto
from control_plane.errors import MalformedUpdate
from control_plane.messages import PeerInfo, UpdateKind
from control_plane.planner.plan import Fetch
from pipecast.v1 import control_pb2 as pb

NODES = [f"n{i}" for i in range(6)]


def _peer(node: str) -> PeerInfo:
    return PeerInfo(node, f"10.0.0.{NODES.index(node) + 1}:7070", ("ucx", "tcp"))


def _assign(fetch, serve) -> pb.AssignmentUpdate:
    columns, children, table = part_to_proto(fetch, serve, lambda node: peer_to_proto(_peer(node)))
    msg = pb.AssignmentUpdate(kind=pb.AssignmentUpdate.ASSIGN, plan_id="p1", fetch=columns, serve=children,
                              peers=table)
    return pb.AssignmentUpdate.FromString(msg.SerializeToString())


fetches = st.lists(st.builds(Fetch, st.integers(0, 300), st.sampled_from(NODES),
                             st.none() | st.tuples(st.integers(0, 50), st.integers(51, 99))), max_size=40)
serves = st.lists(st.tuples(st.integers(0, 300), st.sampled_from(NODES)), max_size=40)


@settings(max_examples=100, deadline=None)
@given(fetches, serves)
def test_a_part_round_trips_with_each_peer_listed_once(fetch, serve):
    msg = _assign(fetch, serve)
    update = update_from_proto(msg)
    assert update.kind is UpdateKind.ASSIGN
    assert update.fetch == tuple(Fetch(a.block, _peer(a.parent), a.chunks) for a in fetch)
    assert update.serve == tuple(serve)
    named = [p.node_id for p in msg.peers]
    assert sorted(named) == sorted({a.parent for a in fetch} | {child for _, child in serve})


def test_whole_blocks_carry_no_chunk_columns():
    msg = _assign([Fetch(0, "n1"), Fetch(1, "n2")], [(0, "n3")])
    assert list(msg.fetch.block) == [0, 1] and list(msg.fetch.peer) == [0, 1]
    assert not msg.fetch.first_chunk and not msg.fetch.end_chunk
    assert list(msg.serve.peer) == [2] and [p.node_id for p in msg.peers] == ["n1", "n2", "n3"]


@pytest.mark.parametrize("change, message", [
    (lambda m: m.fetch.peer.append(0),
     "assignment update of plan 'p1': fetch has 2 blocks, 3 peers, 2 first and 2 end chunks (each must have one "
     "per block, or no chunks at all)"),
    (lambda m: m.fetch.end_chunk.pop(),
     "assignment update of plan 'p1': fetch has 2 blocks, 2 peers, 2 first and 1 end chunks (each must have one "
     "per block, or no chunks at all)"),
    (lambda m: m.serve.peer.__setitem__(0, 7),
     "assignment update of plan 'p1': serve names peer 7, but the update lists 2 peers"),
    (lambda m: m.fetch.end_chunk.__setitem__(1, 1),
     "assignment update of plan 'p1': fetch gives chunks 2..1, which is no range (first < end)"),
    (lambda m: setattr(m, "kind", 0),
     "assignment update of plan 'p1' has kind 0, which this worker does not know"),
    (lambda m: setattr(m, "kind", 99),
     "assignment update of plan 'p1' has kind 99, which this worker does not know"),
])
def test_columns_that_do_not_line_up_are_refused_by_name(change, message):
    msg = _assign([Fetch(0, "n1", (0, 2)), Fetch(0, "n1", (2, 4))], [(0, "n2")])
    change(msg)
    with pytest.raises(MalformedUpdate) as info:
        update_from_proto(msg)
    assert str(info.value) == message
