"""What every transport must do, run against each one (TCP always, UCX where ucxx is installed), on loopback in one
process, with data-plane authentication on (one cluster key) unless a test says: blocks and files arrive
byte-identical, a relay forwards chunks before its block is complete, a corrupt chunk is never present and names
its sender, a relay forwards a file's ranges before it has the whole file. Issue #12: a peer without the key or
with another one is served nothing and told whose fault it is; a requester not named in a plan is refused; an
answer longer than asked for is refused before it is received; a wait on what is served has a deadline; connections
over the caps are closed; silent connections are closed; a relay waiting on its own parent keeps its requester
(WAIT). Issue #16: a chunk range mid-block or to the block's end moves exactly its chunks, a range resumes within
itself after a dropped connection, a range the block lacks is refused with the server's reason, a request without
an end chunk is served to the block's end. Found in review: a host not this node's is refused at listen; a chunk
whose sender dies mid-way is dropped, not left begun.
Transport-specific behaviour (faults on the wire, rate limits, process exit) is in test_tcp.py and
test_ucx.py."""

import asyncio
import threading
import time

import pytest

from control_plane.messages import PeerInfo
from packager.manifest import manifest_from_json
from control_plane.planner.plan import Fetch
from pipecast.agent.errors import (
    CorruptChunkError,
    ListenError,
    PeerAuthError,
    PeerClosedError,
    PeerError,
    PeerProtocolError,
    PeerRefusedError,
)
from pipecast.agent.fetcher import ChannelPool, Fetcher, FetchPolicy
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.store import BlockStore
from pipecast.agent.transport import base
from pipecast.agent.transport.base import PeerAuth, Transport
from pipecast.agent.transport.tcp import TcpTransport
from pipecast.agent.transport.ucx import UcxTransport
from pipecast.core.credentials import data_plane_key
from pipecast.core.settings import Settings
from tests.support.agent_fixtures import (
    FlippingServer,
    ReceiveLog,
    WholeChunkServer,
    block_file_bytes,
    connected,
    land_chunk,
    receiving,
    receiving_store,
    seed_store,
    serving_store,
)
from tests.agent.conftest import CHUNK

CLUSTER_KEY = data_plane_key("conformance master token")
TOKENIZER_BYTES = 300_000  # the package fixture (conftest) gives it a tokenizer file this big
UCX_NOTIFIER_THREAD = "UCX-Py Async Notifier Thread"  # ucxx's thread that must be gone once all are closed

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["tcp", pytest.param("ucx", marks=pytest.mark.ucx)])
async def transports(request):
    """Make transports of the kind under test; every one is closed at the end (and, for UCX, ucxx's
    notifier thread must be gone then)."""
    if request.param == "tcp":
        kind = TcpTransport
    else:
        pytest.importorskip("ucxx", reason="the UCX extra (ucxx-cu12) is not installed")
        kind = UcxTransport
    made: list[Transport] = []

    def make(node: str, key: bytes = CLUSTER_KEY, **overrides) -> Transport:
        values = {"io_timeout_s": 0.3, "connect_timeout_s": 2.0, "egress_mbit": 0, "ingress_mbit": 0}
        made.append(kind(node, Settings(**{**values, **overrides}), PeerAuth(node, key)))
        return made[-1]

    yield make
    for transport in made:
        await transport.close()
    assert UCX_NOTIFIER_THREAD not in {t.name for t in threading.enumerate()}


async def test_a_host_not_this_nodes_or_that_does_not_resolve_is_refused_at_listen(transports):
    """Found in review: UCX (which binds every interface) listened on such a host, then refused every peer."""
    serving = transports("seed")
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this host.
    with pytest.raises(ListenError, match=r"^cannot listen on 192\.0\.2\.1:0: cannot assign requested address$"):
        await serving.listen("192.0.2.1", 0, PeerServer())
    with pytest.raises(ListenError, match=r"^cannot listen on no-such-host\.invalid:0: \S"):
        await serving.listen("no-such-host.invalid", 0, PeerServer())


async def test_blocks_and_files_arrive_byte_identical(package, transports):
    root, manifest = package
    serving, client = transports("seed"), transports("rx")
    async with (serving_store(serving, seed_store(root)) as listener, receiving(manifest) as store,
                connected(client, listener.address, "seed") as channel):
        fetched = manifest_from_json(await channel.fetch_file(manifest.package_id, "manifest.json"))
        assert fetched == manifest
        assert await channel.fetch_file(manifest.package_id, "config.json") == (root / "config.json").read_bytes()
        for block in range(len(manifest.blocks)):
            await channel.fetch_block(manifest.package_id, block, 0, store)
            assert bytes(store.block_view(block)) == block_file_bytes(root, manifest, block)
        assert client.stats.bytes_received == serving.stats.bytes_sent >= manifest.total_bytes
        assert listener.open_connections == 1
        await channel.close()
        await asyncio.sleep(0.1)
        assert listener.open_connections == 0  # the goodbye ended the server's side too


async def test_relay_serves_chunks_before_its_block_is_complete(package, transports):
    root, manifest = package
    data = block_file_bytes(root, manifest, 0)
    relay = receiving_store(manifest)
    async with (serving_store(transports("relay"), relay) as listener, receiving(manifest) as child,
                connected(transports("child", io_timeout_s=5), listener.address, "relay") as channel):
        fetch = asyncio.create_task(channel.fetch_block(manifest.package_id, 0, 0, child))
        land_chunk(relay, data, 0, 0)
        assert bytes(await asyncio.wait_for(child.wait_chunk(0, 0), 2)) == data[:CHUNK]
        assert not relay.is_chunk_present(0, 1)  # the relay still lacks the rest of block 0
        for chunk in range(1, relay.chunk_count(0)):
            land_chunk(relay, data, 0, chunk)
        await asyncio.wait_for(fetch, 2)
        assert bytes(child.block_view(0)) == data


async def test_corrupt_chunk_from_a_relay_is_never_present_and_names_it(package, transports):
    root, manifest = package
    faulty = FlippingServer(flip=(1, 1))
    async with (serving_store(transports("faulty"), seed_store(root), faulty) as listener,
                receiving(manifest) as store):
        peer = PeerInfo("faulty", listener.address)
        async with connected(transports("rx"), peer.address, str(peer)) as channel:
            with pytest.raises(CorruptChunkError) as caught:
                await channel.fetch_block(manifest.package_id, 1, 0, store)
            assert str(caught.value) == (f"peer faulty@{listener.address}: sent a corrupt chunk 1 of block 1 "
                                         "(digest mismatch)")
            assert store.is_chunk_present(1, 0) and not store.is_chunk_present(1, 1)
            assert store.first_missing_chunk(1) == 1
            with pytest.raises(CorruptChunkError):  # the channel is done with: it says so again
                await channel.fetch_block(manifest.package_id, 2, 0, store)


async def test_relay_serves_a_file_range_before_it_has_the_whole_file(package, transports):
    root, manifest = package
    data = (root / "tokenizer.json").read_bytes()
    relay = receiving_store(manifest)
    async with (serving_store(transports("relay"), relay) as listener,
                connected(transports("child", io_timeout_s=5), listener.address, "relay") as channel):
        fetch = asyncio.create_task(channel.fetch_file(manifest.package_id, "tokenizer.json", 1000, 5000))
        await asyncio.sleep(0.1)
        assert not fetch.done()  # the relay has none of it yet
        relay.file_range_landed("tokenizer.json", 0, data[:6000], "upstream")
        assert await asyncio.wait_for(fetch, 2) == data[1000:6000]
        assert "tokenizer.json" in relay.missing_files()  # not whole, so not verified, yet
        whole = asyncio.create_task(channel.fetch_file(manifest.package_id, "tokenizer.json"))
        relay.file_range_landed("tokenizer.json", 6000, data[6000:], "upstream")
        assert await asyncio.wait_for(whole, 2) == data  # a whole-file request waits for the verified file


async def test_a_chunk_whose_sender_dies_mid_way_is_dropped(package, transports):
    """Found in review: UCX never told the sink that a chunk's receive failed, so relays of it waited on."""
    root, manifest = package
    # 0.5 Mbit/s past a 256 KiB burst: block 0 goes at once, then block 1's chunk 1 a second after its header.
    async with (serving_store(transports("seed", egress_mbit=0.5), seed_store(root)) as listener,
                receiving(manifest) as store,
                connected(transports("rx", io_timeout_s=5), listener.address, "seed") as channel):
        sink = ReceiveLog(store)
        await channel.fetch_block(manifest.package_id, 0, 0, store)
        fetch = asyncio.create_task(channel.fetch_block(manifest.package_id, 1, 0, sink))
        started = time.monotonic()
        while ("begun", 1, 1) not in sink.events:
            assert time.monotonic() - started < 10 and not fetch.done()
            await asyncio.sleep(0.01)
        await listener.close()  # the sender dies between chunk 1's header and its bytes
        with pytest.raises(PeerClosedError):
            await asyncio.wait_for(fetch, 2)
        assert sink.events == [("begun", 1, 0), ("landed", 1, 0), ("begun", 1, 1), ("dropped", 1, 1)]
        assert not store.is_chunk_present(1, 1)


# -- issue #12: who gets in, and bounds ----------------------------------------------------------------


class RecordingServer(PeerServer):
    """Serves its stores and records every requester it admitted."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.admitted: list[str] = []

    def peer_requested(self, requester: str, package_id: str, block: int | None) -> None:
        super().peer_requested(requester, package_id, block)
        self.admitted.append(requester)


async def test_a_peer_without_the_key_gets_nothing_and_is_told_it_lacks_one(package, transports):
    root, manifest = package
    server = RecordingServer()
    serving, keyless = transports("seed"), transports("rx", key=b"")
    async with (serving_store(serving, seed_store(root), server) as listener,
                connected(keyless, listener.address, "seed") as channel):
        with pytest.raises(PeerAuthError, match=r"^peer seed: authentication failed: the peer requires the "
                                                r"data-plane hello and this node has no data-plane key") as caught:
            await channel.fetch_file(manifest.package_id, "manifest.json")
        assert caught.value.fault == "here"
        await channel.close()
        assert keyless.stats.bytes_received == 0 and server.admitted == []


async def test_a_peer_with_another_key_is_refused_before_anything_is_served(package, transports):
    root, manifest = package
    server = RecordingServer()
    async with serving_store(transports("seed"), seed_store(root), server) as listener:
        stranger = transports("rx", key=data_plane_key("another cluster"))
        with pytest.raises(PeerAuthError, match=r"^peer seed: authentication failed: the peer holds another "
                                                r"data-plane key: data-plane keys differ \(requester's key id "
                                                r"[0-9a-f]{16}, server's key id [0-9a-f]{16}\); one of the two was "
                                                r"given other cluster credentials$") as caught:
            await stranger.connect(listener.address, "seed")
        assert caught.value.fault == "keys differ"
        # A keyed requester to a server that runs without a key: the peer's side is open.
        open_server = await transports("open", key=b"").listen("127.0.0.1", 0, server)
        with pytest.raises(PeerAuthError, match="the peer runs without data-plane authentication") as caught:
            await transports("rx2").connect(open_server.address, "open")
        assert caught.value.fault == "peer"
        assert stranger.stats.bytes_received == 0 and server.admitted == []


async def test_a_peer_not_yet_registered_refuses_a_hello_and_the_requester_knows_it_is_the_peers(package,
                                                                                              transports):
    """Found in review: the requester took a server still without its key (not registered) for its own fault."""
    root, _ = package
    async with serving_store(transports("seed", key=None), seed_store(root)) as listener:
        with pytest.raises(PeerAuthError, match=r"^peer seed: authentication failed: the peer cannot check this "
                                                r"node's hello yet: this node has no data-plane key yet") as caught:
            # Found in review: with the same deadlines on both sides the requester timed out first (the seed waited
            # its whole io_timeout_s for its key), never learning the fault was the peer's.
            await transports("rx").connect(listener.address, "seed")
        assert caught.value.fault == "peer"


async def test_without_keys_on_either_side_the_data_plane_is_open_and_says_so(package, transports, caplog):
    root, manifest = package
    base.warn_open_data_plane.__globals__["_warned_open"] = False
    async with serving_store(transports("seed", key=b""), seed_store(root)) as listener:
        assert "data-plane authentication is off" in caplog.text
        async with connected(transports("rx", key=b""), listener.address, "seed") as channel:
            assert await channel.fetch_file(manifest.package_id, "config.json") == (root / "config.json").read_bytes()


async def test_a_requester_no_plan_names_is_refused_and_not_recorded(package, transports):
    _, manifest = package
    relay = receiving_store(manifest)  # still receiving: it serves only its children
    server = RecordingServer(plan_gated=True, grace_s=0.1)
    server.serve_part("plan-1", manifest.package_id, ["child"])
    async with serving_store(transports("relay"), relay, server) as listener:
        stranger = await transports("stranger").connect(listener.address, "relay")
        with pytest.raises(PeerRefusedError, match=r"^peer relay: node stranger is not named to this node in any "
                                                   r"current plan of package"):
            await stranger.fetch_file(manifest.package_id, "manifest.json")
        child = await transports("child").connect(listener.address, "relay")
        assert manifest_from_json(await child.fetch_file(manifest.package_id, "manifest.json")) == manifest
        assert server.admitted == ["child"]
        await stranger.close()
        await child.close()


class LongAnswers(PeerServer):
    """Answers every range request with more bytes than were asked for."""

    async def file_bytes(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        return bytes(length + 4096) if length else await super().file_bytes(package_id, path)


async def test_an_answer_longer_than_the_range_asked_for_is_a_protocol_error(package, transports):
    root, manifest = package
    serving, client = transports("liar"), transports("rx")
    async with (serving_store(serving, seed_store(root), LongAnswers()) as listener,
                connected(client, listener.address, "liar") as channel):
        with pytest.raises(PeerProtocolError, match=r"^peer liar: announced file tokenizer.json of 5096 bytes "
                                                    r"\(at most 1000 asked for\)"):
            await channel.fetch_file(manifest.package_id, "tokenizer.json", 0, 1000)
        assert client.stats.bytes_received == 0  # refused on its header: nothing of it was received


async def test_a_wait_on_what_is_served_has_a_deadline(package, transports):
    _, manifest = package
    server = PeerServer()
    server.expect(manifest.package_id)  # it will "soon" hold it: a request waits, but not forever
    listener = await transports("slow", io_timeout_s=0.2).listen("127.0.0.1", 0, server)
    async with (receiving(manifest) as store,
                connected(transports("rx", io_timeout_s=5), listener.address, "slow") as channel):
        started = time.monotonic()
        with pytest.raises(PeerRefusedError, match=r"block 0 of package [0-9a-f]{12} is not here after 0.4 s"):
            await channel.fetch_block(manifest.package_id, 0, 0, store)
        assert time.monotonic() - started < 2.0


async def test_a_relay_waiting_on_its_own_parent_keeps_its_requester_past_the_io_timeout(package, transports):
    """Found in review: a relay waiting on its parent sent nothing, so its requester timed it out at its I/O timeout
    as its parent's children timed the parent out: a hung node's whole subtree blamed healthy parents. The relay
    now sends WAITs while it waits (within its own deadline, SERVE_WAIT_IO_TIMEOUTS of its I/O timeout)."""
    root, manifest = package
    data = block_file_bytes(root, manifest, 0)
    relay = receiving_store(manifest)
    async with (serving_store(transports("relay", io_timeout_s=0.5), relay) as listener,
                receiving(manifest) as child,
                connected(transports("child", io_timeout_s=0.3), listener.address, "relay") as channel):
        fetch = asyncio.create_task(channel.fetch_block(manifest.package_id, 0, 0, child))
        await asyncio.sleep(0.7)  # past the child's I/O timeout, within the relay's wait (1 s)
        assert not fetch.done()
        for chunk in range(relay.chunk_count(0)):
            land_chunk(relay, data, 0, chunk)
        await asyncio.wait_for(fetch, 2)
        assert bytes(child.block_view(0)) == data


async def test_a_relays_waits_are_bounded_from_its_last_bytes_and_it_gives_up_before_its_requester(package,
                                                                                                    transports):
    """Found in review: each of a relay's waits (admission, then its chunk) had a bound of its own, so an answer
    could wait longer in all than its requester's bound on WAITs; the requester timed a healthy relay out, and does
    not try a silent parent again. Now the relay refuses first (2 I/O timeouts after its last bytes), which is tried
    again."""
    root, manifest = package
    data = block_file_bytes(root, manifest, 0)
    relay, served = receiving_store(manifest), PeerServer()
    served.expect(manifest.package_id)  # assigned; its manifest not here yet
    io = 0.5
    listener = await transports("relay", io_timeout_s=io).listen("127.0.0.1", 0, served)

    async def upstream() -> None:  # each wait under the relay's bound (2 io), both together over its requester's
        await asyncio.sleep(1.8 * io)
        served.add(relay)
        await asyncio.sleep(1.9 * io)
        land_chunk(relay, data, 0, 0)

    arriving = asyncio.create_task(upstream())
    failures = []
    async with receiving(manifest) as child:
        pool = ChannelPool(transports("child", io_timeout_s=io))
        fetcher = Fetcher(child, pool, FetchPolicy(retries=2, backoff_s=0.01),
                          on_peer_failure=lambda what, peer, error: failures.append(error))
        try:
            await asyncio.wait_for(fetcher.fetch([Fetch(0, PeerInfo("relay", listener.address), chunks=(0, 1))]), 10)
        finally:
            await pool.close()
            await arriving
            await listener.close()
        assert child.is_chunk_present(0, 0)
    assert [type(error) for error in failures] == [PeerRefusedError], failures
    assert "is not here after 1 s" in str(failures[0])


async def test_connections_over_the_per_address_cap_are_closed_at_once(package, transports):
    root, manifest = package
    async with serving_store(transports("seed", agent_max_connections_per_address=2), seed_store(root)) as listener:
        client = transports("rx")
        first, second = await client.connect(listener.address, "seed"), await client.connect(listener.address, "seed")
        with pytest.raises(PeerError):
            third = await client.connect(listener.address, "seed")  # the hello fails: the server closed it
            await third.fetch_file(manifest.package_id, "config.json")
        assert await first.fetch_file(manifest.package_id, "config.json") == (root / "config.json").read_bytes()
        assert listener.open_connections == 2
        await first.close()
        await second.close()


async def test_connections_still_in_their_hello_make_room_for_members_and_members_keep_theirs(package, transports):
    root, manifest = package
    config = (root / "config.json").read_bytes()
    serving = transports("seed", agent_max_connections=2, io_timeout_s=30)
    async with serving_store(serving, seed_store(root)) as listener:
        squatter, member = transports("squatter", key=b"", io_timeout_s=30), transports("rx")  # squatters send nothing
        for _ in range(2):
            await squatter.connect(listener.address, "seed")
        while listener.open_connections < 2:
            await asyncio.sleep(0.01)
        first, second = await member.connect(listener.address, "seed"), await member.connect(listener.address, "seed")
        assert [await c.fetch_file(manifest.package_id, "config.json") for c in (first, second)] == [config] * 2
        assert listener.open_connections == 2  # both squatters made room
        with pytest.raises(PeerError):  # members' slots are theirs: a third is closed at once
            third = await member.connect(listener.address, "seed")
            await third.fetch_file(manifest.package_id, "config.json")
        assert await first.fetch_file(manifest.package_id, "config.json") == config


async def test_a_connection_that_sends_nothing_is_closed_after_the_deadline(package, transports):
    root, _ = package
    serving = transports("seed", io_timeout_s=0.3)
    keyless = transports("rx", key=b"")  # no hello: it connects and says nothing
    async with (serving_store(serving, seed_store(root)) as listener,
                connected(keyless, listener.address, "seed")):
        await asyncio.sleep(0.1)
        assert listener.open_connections == 1
        started = time.monotonic()
        while listener.open_connections:
            assert time.monotonic() - started < 2.0, "a silent connection was kept open"
            await asyncio.sleep(0.02)


async def test_an_idle_channel_closed_by_the_server_is_opened_again_for_the_next_request(package, transports):
    root, manifest = package
    async with (serving_store(transports("seed", agent_idle_timeout_s=0.2), seed_store(root)) as listener,
                connected(transports("rx"), listener.address, "seed") as channel):
        assert await channel.fetch_file(manifest.package_id, "config.json") == (root / "config.json").read_bytes()
        started = time.monotonic()
        while listener.open_connections:  # the idle deadline closes it
            assert time.monotonic() - started < 2.0
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert await channel.fetch_file(manifest.package_id, "config.json") == (root / "config.json").read_bytes()


# -- issue #16: chunk ranges -------------------------------------------------------------------------------


class ChunkLog(WholeChunkServer):
    """Serves its stores and records every chunk it was asked for as (block, chunk); with ``drop_at`` it drops
    the connection the first time that chunk is asked for (as a requester that went away would)."""

    def __init__(self, drop_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.asked: list[tuple[int, int]] = []
        self.drop_at = drop_at

    async def wait_chunk(self, package_id: str, block: int, chunk: int) -> memoryview:
        self.asked.append((block, chunk))
        if (block, chunk) == self.drop_at:
            self.drop_at = None
            raise PeerClosedError("test", "dropped on purpose")
        return await super().wait_chunk(package_id, block, chunk)


def chunk_bytes(store: BlockStore, block: int, first: int, end: int) -> int:
    meta = store.manifest.blocks[block]
    return min(end * meta.chunk_bytes, meta.bytes) - first * meta.chunk_bytes


def present(store: BlockStore, block: int) -> list[int]:
    return [c for c in range(store.chunk_count(block)) if store.is_chunk_present(block, c)]


async def test_a_chunk_range_mid_block_and_one_to_its_end_move_exactly_their_chunks(package, transports):
    root, manifest = package
    server = ChunkLog()
    serving, client = transports("seed"), transports("rx")
    data = block_file_bytes(root, manifest, 0)
    async with (serving_store(serving, seed_store(root), server) as listener, receiving(manifest) as store,
                connected(client, listener.address, "seed") as channel):
        count = store.chunk_count(0)
        await channel.fetch_block(manifest.package_id, 0, 1, store, 3)
        assert present(store, 0) == [1, 2]
        assert bytes(await store.wait_chunk(0, 1)) + bytes(await store.wait_chunk(0, 2)) == data[CHUNK:3 * CHUNK]
        assert client.stats.bytes_received == chunk_bytes(store, 0, 1, 3)
        await channel.fetch_block(manifest.package_id, 0, 3, store, count)  # the range at the block's end
        await channel.fetch_block(manifest.package_id, 0, 0, store, 1)  # and its first chunk: all of it now
        assert store.is_block_verified(0) and bytes(store.block_view(0)) == data
        assert server.asked == [(0, 1), (0, 2), *((0, c) for c in range(3, count)), (0, 0)]
        assert client.stats.bytes_received == len(data)


async def test_a_request_without_an_end_chunk_is_served_to_the_blocks_end(package, transports):
    """What requesters sent before chunk ranges (and what a whole-block or to-the-end range sends now)."""
    root, manifest = package
    server = ChunkLog()
    async with (serving_store(transports("seed"), seed_store(root), server) as listener, receiving(manifest) as store,
                connected(transports("rx"), listener.address, "seed") as channel):
        count = store.chunk_count(2)
        await channel.fetch_block(manifest.package_id, 2, 2, store)
        assert present(store, 2) == list(range(2, count))
        assert server.asked == [(2, c) for c in range(2, count)]
        await channel.fetch_block(manifest.package_id, 2, 1, store, 1)  # an empty range: nothing is asked
        assert server.asked == [(2, c) for c in range(2, count)]


async def test_a_range_resumes_within_itself_after_a_dropped_connection(package, transports):
    root, manifest = package
    server = ChunkLog(drop_at=(1, 2))
    async with (serving_store(transports("seed"), seed_store(root), server) as listener,
                receiving(manifest) as store):
        peer = PeerInfo("seed", listener.address)
        count = store.chunk_count(1)
        pool = ChannelPool(transports("rx"))
        failures = []
        try:
            fetcher = Fetcher(store, pool, FetchPolicy(retries=1, backoff_s=0.01),
                              lambda what, p, e: failures.append((what, p, type(e))))
            await fetcher.fetch([Fetch(1, peer, (1, 3))])
            assert present(store, 1) == [1, 2] and not store.is_block_verified(1)
            assert failures == [("block 1 chunks 1-3", peer, PeerClosedError)]
            # The first request stopped at the dropped chunk; the second began there and ended with the range.
            assert server.asked == [(1, 1), (1, 2), (1, 2)]
            await fetcher.fetch([Fetch(1, peer, (0, 1)), Fetch(1, peer, (3, count))])
            assert bytes(store.block_view(1)) == block_file_bytes(root, manifest, 1)
        finally:
            await pool.close()


class MoreChunks:
    """A sink that says its blocks have ``extra`` more chunks than they do: its requests name ranges past
    a block's end, as a requester with another idea of the block would."""

    def __init__(self, store: BlockStore, extra: int) -> None:
        self.store, self.extra = store, extra

    def chunk_count(self, block: int) -> int:
        return self.store.chunk_count(block) + self.extra

    def chunk_buffer(self, block: int, chunk: int) -> memoryview:
        return self.store.chunk_buffer(block, chunk)

    def chunk_landed(self, block: int, chunk: int, peer: str) -> None:
        self.store.chunk_landed(block, chunk, peer)


async def test_a_range_the_block_lacks_is_refused_with_the_servers_reason(package, transports):
    root, manifest = package
    server = RecordingServer()
    async with (serving_store(transports("seed"), seed_store(root), server) as listener, receiving(manifest) as store,
                connected(transports("rx"), listener.address, "seed") as channel):
        count = store.chunk_count(0)
        with pytest.raises(ValueError, match=f"^block 0 has {count} chunks: no chunk range 1-{count + 1}$"):
            await channel.fetch_block(manifest.package_id, 0, 1, store, count + 1)  # caught before it is sent
        with pytest.raises(PeerRefusedError) as caught:
            await channel.fetch_block(manifest.package_id, 0, 1, MoreChunks(store, 5), count + 3)
        assert str(caught.value) == f"peer seed: block 0 has no chunk range 1-{count + 3} (it has {count} chunks)"
        assert present(store, 0) == [] and server.admitted == []
