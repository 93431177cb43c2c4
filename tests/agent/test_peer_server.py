"""What an agent serves and to whom (no sockets): under a control plane only the children its parts name,
with a grace for a part that arrives after the child's request; the requesters it remembers stay bounded;
the event log is rate-limited per kind. Over the wire: tests/agent/transport/."""

import asyncio
import json
import time
from pathlib import Path

import pytest

from packager.manifest import MANIFEST_FILE
from pipecast.agent.daemon import _AgentPeerServer
from pipecast.agent.errors import PeerNotAllowedError, UnknownPackageError
from pipecast.agent.events import EventLog, read_events, rotated
from pipecast.agent.peer_server import MAX_REQUESTERS_PER_PACKAGE, PeerServer
from pipecast.agent.transport.wire import CHUNK, REQ_BLOCK, Header, answer_request, parse_request, request_payload
from tests.agent.conftest import CHUNK as CHUNK_BYTES
from tests.support.agent_fixtures import block_file_bytes, land_chunk, receiving_store, seed_store

pytestmark = pytest.mark.timeout(30)

PKG = "ab" * 32


async def test_a_static_plan_serves_any_requester_the_transport_let_in():
    server = PeerServer()
    await server.admit("anyone", PKG)


async def test_under_a_control_plane_only_the_children_of_a_current_part_are_served(package):
    _, manifest = package
    relay = receiving_store(manifest)  # still receiving: not a source
    server = PeerServer(plan_gated=True, grace_s=0.2)
    server.add(relay)
    pid = manifest.package_id
    try:
        server.serve_part("plan-1", pid, ["child"])
        await server.admit("child", pid)
        started = time.monotonic()
        with pytest.raises(PeerNotAllowedError, match=rf"^node stranger is not named to this node in any current "
                                                      rf"plan of package {pid[:12]}"):
            await server.admit("stranger", pid)
        assert time.monotonic() - started >= 0.2  # it was given the grace
        with pytest.raises(PeerNotAllowedError):
            await server.admit("child", "cd" * 32)  # a child of another package's plan is not one of this
        server.end_part("plan-1")
        with pytest.raises(PeerNotAllowedError):
            await server.admit("child", pid)
    finally:
        relay.close()


async def test_a_child_of_a_current_part_is_served_a_chunk_range_as_it_lands(package):
    """Issue #16: parts say whom a node serves, not which chunks; a child's range request is admitted and
    answered chunk by chunk, cut-through, from a relay still receiving the block."""
    root, manifest = package
    relay = receiving_store(manifest)
    server = PeerServer(plan_gated=True, grace_s=0.1)
    server.add(relay)
    server.serve_part("plan-1", manifest.package_id, ["child"])
    data = block_file_bytes(root, manifest, 0)
    sent = []

    async def send(header: Header, payload: memoryview) -> None:
        sent.append((header.kind, header.chunk, bytes(payload)))

    payload = request_payload(manifest.package_id, "child", end_chunk=3)
    request = parse_request(Header(REQ_BLOCK, 0, 1, len(payload)), payload, "child")
    try:
        answering = asyncio.create_task(answer_request(server, request, send, "child"))
        land_chunk(relay, data, 0, 0)
        await asyncio.sleep(0.02)
        assert sent == []  # chunk 0 is not asked for
        land_chunk(relay, data, 0, 1)
        await asyncio.sleep(0.02)
        assert [chunk for _, chunk, _ in sent] == [1] and not answering.done()
        land_chunk(relay, data, 0, 2)
        await asyncio.wait_for(answering, 1)
        assert sent == [(CHUNK, c, data[c * CHUNK_BYTES:(c + 1) * CHUNK_BYTES]) for c in (1, 2)]
        assert server.have_requested(manifest.package_id, ["child"])
    finally:
        relay.close()


async def test_a_part_arriving_within_the_grace_admits_the_child_that_asked_first():
    server = PeerServer(plan_gated=True, grace_s=2.0)
    waiting = asyncio.create_task(server.admit("child", PKG))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    server.serve_part("plan-1", PKG, ["child"])
    await asyncio.wait_for(waiting, 1)


async def test_a_source_serves_the_receivers_of_its_plans_and_no_one_else(package):
    """Issue #12: a source (every receiver's fallback) is told the plan's receivers; holding the whole
    package lets a node serve no one by itself."""
    root, manifest = package
    pid = manifest.package_id
    server = PeerServer(plan_gated=True, grace_s=0.0)
    seed = seed_store(root)
    try:
        server.add(seed)  # holds all of it
        with pytest.raises(PeerNotAllowedError):
            await server.admit("anyone", pid)
        server.serve_part("plan-1", pid, ["w1", "w2", "w3"])  # a source's part: every receiver of plan-1
        for receiver in ("w1", "w2", "w3"):
            await server.admit(receiver, pid)
        with pytest.raises(PeerNotAllowedError):
            await server.admit("anyone", pid)
        server.retain_parts([])
        with pytest.raises(PeerNotAllowedError):
            await server.admit("w1", pid)
    finally:
        seed.close()


async def test_a_manifest_range_past_its_end_is_refused_as_any_files_is(package):
    """Found in review: a range of the manifest past its end was answered short (or empty) where a range of any
    other file is refused, so a requester took a truncated manifest for what it asked for."""
    root, manifest = package
    pid = manifest.package_id
    server = PeerServer()
    seed = seed_store(root)
    try:
        server.add(seed)
        whole = await server.file_bytes(pid, MANIFEST_FILE)
        size = len(whole)
        assert await server.file_bytes(pid, MANIFEST_FILE, size - 10, 10) == whole[-10:]  # up to its end: served
        for offset, length in ((size + 1000, 500), (size - 10, 11)):
            with pytest.raises(UnknownPackageError, match=rf"^file 'manifest.json' of package {pid[:12]} has {size} "
                                                          rf"bytes: no range of {length} at {offset}$"):
                await server.file_bytes(pid, MANIFEST_FILE, offset, length)
    finally:
        seed.close()


def test_the_requesters_remembered_stay_bounded_under_a_flood_of_made_up_names():
    server = PeerServer()
    for i in range(5 * MAX_REQUESTERS_PER_PACKAGE):
        server.peer_requested(f"node-{i}", PKG, 0)
    assert len(server.requesters[PKG]) == MAX_REQUESTERS_PER_PACKAGE
    assert server.have_requested(PKG, [f"node-{5 * MAX_REQUESTERS_PER_PACKAGE - 1}"])
    assert not server.have_requested(PKG, ["node-0"])  # the oldest went first
    server.end_package(PKG)
    assert PKG not in server.requesters


def test_events_are_rate_limited_per_kind_and_the_dropped_ones_counted(tmp_path):
    path = tmp_path / "events.jsonl"
    events = EventLog(path, "n1", rate_per_s=10.0, burst=100.0)
    for i in range(10_000):
        events.emit("peer_request", requester=f"node-{i}")
    events.emit("block_verified", block=0)  # another kind has its own bucket
    events.close()
    log = read_events(path)
    requests = [e for e in log if e["event"] == "peer_request"]
    assert 100 <= len(requests) < 110
    assert [e["block"] for e in log if e["event"] == "block_verified"] == [0]
    dropped = [e for e in log if e["event"] == "events_dropped"]
    assert sum(e["dropped"] for e in dropped) == 10_000 - len(requests)
    assert {e["kind"] for e in dropped} == {"peer_request"}
    assert path.stat().st_size < 100 * len(json.dumps(log[0])) * 2


def test_the_events_file_moves_aside_once_when_full_so_it_takes_at_most_twice_its_cap(tmp_path):
    """Found in review: the file grew without bound (a seeding agent writes a line per block it serves)."""
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "earlier_run"}\n')  # appended to, and counted
    events = EventLog(path, "n1", max_bytes=4096)
    for i in range(1000):
        events.emit("peer_request", block=i)
    events.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "events.jsonl.1"]
    assert path.stat().st_size <= 4096 and 3900 < (tmp_path / "events.jsonl.1").stat().st_size <= 4096
    blocks = [e["block"] for e in read_events(path)]  # the rotated file's first
    assert blocks == list(range(blocks[0], 1000))


def test_two_processes_writing_one_events_file_share_its_rotation_and_keep_their_lines_in_order(tmp_path):
    """Found in review: each counted only its own lines, and once one had moved the file aside the other wrote on
    into FILE.1 and, rotating in its turn, replaced what the first had written (a run kept 40 of 120 lines)."""
    path = tmp_path / "events.jsonl"
    old, new = EventLog(path, "old", max_bytes=2000), EventLog(path, "new", max_bytes=2000)
    for seq in range(240):
        (old, new)[seq % 2].emit("peer_request", seq=seq)
    old.close()
    new.close()
    assert path.stat().st_size <= 2000 and 1900 < rotated(path).stat().st_size <= 2000
    seqs = [e["seq"] for e in read_events(path)]
    assert seqs == list(range(seqs[0], 240))


def test_two_writers_crossing_the_limit_at_once_move_the_full_file_aside_once(tmp_path):
    """Found in review: both saw the file full, the first moved it aside, the second then moved the new, nearly empty
    file over it: the full file's lines were lost."""
    path = tmp_path / "events.jsonl"
    first, second = EventLog(path, "first", max_bytes=2000), EventLog(path, "second", max_bytes=2000)
    seq = 0
    while path.stat().st_size < 1900:
        first.emit("peer_request", seq=seq)
        seq += 1
    measure = second._follow_path

    def full_then_the_first_moves_it(seq=seq):
        size = measure()  # the second sees the file full ...
        first.emit("peer_request", seq=seq)  # ... and the first moves it aside before the second can
        return size

    second._follow_path = full_then_the_first_moves_it
    second.emit("peer_request", seq=seq + 1)
    first.close()
    second.close()
    assert [e["seq"] for e in read_events(path)] == list(range(seq + 2))


async def test_a_full_events_disk_loses_lines_but_no_peer_is_refused_a_block(package, caplog):
    """Found in review: the line of each peer request was written before the block was served, and a full disk's
    OSError went up through the request: once the events disk filled, the agent served no block to any child."""
    root, manifest = package
    events = EventLog(Path("/dev/full"), "seed")  # takes no byte: ENOSPC
    server = _AgentPeerServer(events, grace_s=0.0, plan_gated=False)
    seed = seed_store(root)
    server.add(seed)
    sent = []

    async def send(header: Header, payload: memoryview) -> None:
        sent.append(header.kind)

    payload = request_payload(manifest.package_id, "child")
    try:
        for _ in range(2):
            await answer_request(server, parse_request(Header(REQ_BLOCK, 0, 0, len(payload)), payload, "child"), send,
                                 "child")
    finally:
        seed.close()
    assert sent and set(sent) == {CHUNK}
    events.close()  # flushing the lost lines again fails, silently
    assert events.lost == 2
    assert [record.getMessage() for record in caplog.records if record.name == "pipecast.agent.events"] == [
        "events file /dev/full: a line is lost ([Errno 28] No space left on device); the lines lost are counted, "
        "and said at close", "events file /dev/full: 2 lines were lost"]
