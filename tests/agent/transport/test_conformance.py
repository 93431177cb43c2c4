"""What every transport must do, run against each one (TCP always, UCX where ucxx is installed), on
loopback in one process: blocks and files arrive byte-identical, a relay forwards chunks before its block
is complete, a corrupt chunk is never present and names its sender, a relay forwards a file's ranges before it has
the whole file. Transport-specific behaviour (faults
on the wire, rate limits, process exit) is in test_tcp.py and test_ucx.py."""

import asyncio
import threading

import pytest

from control_plane.messages import PeerInfo
from packager.manifest import manifest_from_json
from pipecast.agent.errors import CorruptChunkError
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.transport.base import Transport
from pipecast.agent.transport.tcp import TcpTransport
from pipecast.agent.transport.ucx import UcxTransport
from pipecast.core.settings import Settings
from tests.support.agent_fixtures import (
    FlippingServer,
    block_file_bytes,
    land_chunk,
    receiving_store,
    seed_store,
)
from tests.agent.conftest import CHUNK

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

    def make(node: str, **overrides) -> Transport:
        values = {"io_timeout_s": 0.3, "connect_timeout_s": 2.0, "egress_mbit": 0, "ingress_mbit": 0}
        made.append(kind(node, Settings(**{**values, **overrides})))
        return made[-1]

    yield make
    for transport in made:
        await transport.close()
    assert UCX_NOTIFIER_THREAD not in {t.name for t in threading.enumerate()}


async def test_blocks_and_files_arrive_byte_identical(package, transports):
    root, manifest = package
    seed = seed_store(root)
    server = PeerServer()
    server.add(seed)
    serving = transports("seed")
    listener = await serving.listen("127.0.0.1", 0, server)
    client = transports("rx")
    store = receiving_store(manifest)
    try:
        channel = await client.connect(listener.address, "seed")
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
    finally:
        store.close()
        seed.close()


async def test_relay_serves_chunks_before_its_block_is_complete(package, transports):
    root, manifest = package
    data = block_file_bytes(root, manifest, 0)
    relay = receiving_store(manifest)
    server = PeerServer()
    server.add(relay)
    listener = await transports("relay").listen("127.0.0.1", 0, server)
    child = receiving_store(manifest)
    channel = await transports("child", io_timeout_s=5).connect(listener.address, "relay")
    try:
        fetch = asyncio.create_task(channel.fetch_block(manifest.package_id, 0, 0, child))
        land_chunk(relay, data, 0, 0)
        assert bytes(await asyncio.wait_for(child.wait_chunk(0, 0), 2)) == data[:CHUNK]
        assert not relay.is_chunk_present(0, 1)  # the relay still lacks the rest of block 0
        for chunk in range(1, relay.chunk_count(0)):
            land_chunk(relay, data, 0, chunk)
        await asyncio.wait_for(fetch, 2)
        assert bytes(child.block_view(0)) == data
    finally:
        await channel.close()
        child.close()
        relay.close()


async def test_corrupt_chunk_from_a_relay_is_never_present_and_names_it(package, transports):
    root, manifest = package
    seed = seed_store(root)
    faulty = FlippingServer(flip=(1, 1))
    faulty.add(seed)
    listener = await transports("faulty").listen("127.0.0.1", 0, faulty)
    store = receiving_store(manifest)
    peer = PeerInfo("faulty", listener.address)
    channel = await transports("rx").connect(peer.address, str(peer))
    try:
        with pytest.raises(CorruptChunkError) as caught:
            await channel.fetch_block(manifest.package_id, 1, 0, store)
        assert str(caught.value) == (f"peer faulty@{listener.address}: sent a corrupt chunk 1 of block 1 "
                                     "(digest mismatch)")
        assert store.is_chunk_present(1, 0) and not store.is_chunk_present(1, 1)
        assert store.first_missing_chunk(1) == 1
        with pytest.raises(CorruptChunkError):  # the channel is done with: it says so again
            await channel.fetch_block(manifest.package_id, 2, 0, store)
    finally:
        await channel.close()
        store.close()
        seed.close()


async def test_relay_serves_a_file_range_before_it_has_the_whole_file(package, transports):
    root, manifest = package
    data = (root / "tokenizer.json").read_bytes()
    relay = receiving_store(manifest)
    server = PeerServer()
    server.add(relay)
    listener = await transports("relay").listen("127.0.0.1", 0, server)
    channel = await transports("child", io_timeout_s=5).connect(listener.address, "relay")
    try:
        fetch = asyncio.create_task(channel.fetch_file(manifest.package_id, "tokenizer.json", 1000, 5000))
        await asyncio.sleep(0.1)
        assert not fetch.done()  # the relay has none of it yet
        relay.file_range_landed("tokenizer.json", 0, data[:6000], "upstream")
        assert await asyncio.wait_for(fetch, 2) == data[1000:6000]
        assert "tokenizer.json" in relay.missing_files()  # not whole, so not verified, yet
        whole = asyncio.create_task(channel.fetch_file(manifest.package_id, "tokenizer.json"))
        relay.file_range_landed("tokenizer.json", 6000, data[6000:], "upstream")
        assert await asyncio.wait_for(whole, 2) == data  # a whole-file request waits for the verified file
    finally:
        await channel.close()
        relay.close()
