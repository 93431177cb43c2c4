"""The pure helpers of :mod:`pipecast.agent.control`: merging a node's parts into one fetch list, and which
failures prove a peer itself sent corrupt data."""

from control_plane.messages import AssignmentUpdate, PeerInfo, UpdateKind
from control_plane.planner.plan import Fetch
from packager.manifest import MANIFEST_FILE
from pipecast.agent.control import merged_fetches, sender_at_fault
from pipecast.agent.errors import CorruptChunkError, CorruptFileError, PeerClosedError


def test_merged_fetches_take_each_missing_block_once_in_the_parts_order():
    store, a1 = PeerInfo("store", "10.0.0.1:7070"), PeerInfo("a1", "10.0.0.2:7070")
    first = AssignmentUpdate(UpdateKind.ASSIGN, plan_id="p1", fetch=(Fetch(2, a1), Fetch(0, store)))
    second = AssignmentUpdate(UpdateKind.ASSIGN, plan_id="p2", fetch=(Fetch(0, a1), Fetch(1, store)))
    assert merged_fetches([first, second], verified={1}) == [Fetch(2, a1), Fetch(0, store)]


def test_only_a_peers_own_corrupt_data_gets_it_distrusted():
    assert sender_at_fault("block 3", CorruptChunkError("p", 3, 1))  # verified by the peer before it served it
    assert sender_at_fault(MANIFEST_FILE, CorruptFileError("p", "sent an invalid manifest"))
    # A file is forwarded before its relay has checked it whole: its parent may have corrupted it.
    assert not sender_at_fault("tokenizer.json", CorruptFileError("p", "sent file 'tokenizer.json' ..."))
    assert not sender_at_fault("block 3", PeerClosedError("p", "closed the connection"))
