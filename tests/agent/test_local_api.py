"""The local API between a node agent and its engine, over a real unix socket, without the network."""

import asyncio

import pytest

from pipecast.agent.errors import LocalApiError
from pipecast.agent.local_api import LocalApiServer
from pipecast.agent.local_client import LocalAgentClient
from pipecast.agent.peer_server import PeerServer
from tests.support.agent_fixtures import receiving_store
from tests.support.packages import tiny_package


async def test_a_block_is_mapped_ahead_read_by_verified_prefix_and_whole_once_verified(tmp_path):
    manifest = tiny_package(tmp_path / "pkg", layers=3, layer_bytes=200_000, chunk_bytes=64 << 10).manifest
    store = receiving_store(manifest)
    peer_server = PeerServer()
    peer_server.add(store)
    server = LocalApiServer(peer_server, status=dict)
    await server.start(tmp_path / "agent.sock")
    client = await asyncio.to_thread(LocalAgentClient, tmp_path / "agent.sock")
    try:
        await asyncio.to_thread(client.map_ahead, 1)  # nothing of block 1 is here yet
        with pytest.raises(TimeoutError, match="block 1 not verified within 0.1 s"):
            await asyncio.to_thread(client.wait_block, 1, 0.1)
        with pytest.raises(LocalApiError, match=r"has no block 9 \(it has 3\)"):
            await asyncio.to_thread(client.map_ahead, 9)

        data = (tmp_path / "pkg" / manifest.blocks[1].file).read_bytes()
        chunk = manifest.blocks[1].chunk_bytes
        store.chunk_buffer(1, 0)[:] = data[:chunk]
        store.chunk_landed(1, 0, "p1")  # the first chunk is verified, the block is not
        prefix = await asyncio.to_thread(client.wait_prefix, 1, 1, 5.0)
        assert bytes(prefix) == data[:chunk]  # all that is verified, not just the byte asked for
        with pytest.raises(TimeoutError, match="the first 65537 bytes of block 1 not verified within 0.1 s"):
            await asyncio.to_thread(client.wait_prefix, 1, chunk + 1, 0.1)
        with pytest.raises(LocalApiError, match=f"block 1 has {len(data)} bytes: no prefix of {len(data) + 1}"):
            await asyncio.to_thread(client.wait_prefix, 1, len(data) + 1, 0.1)
        prefix.release()

        for i in range(1, store.chunk_count(1)):
            start = i * chunk
            store.chunk_buffer(1, i)[:] = data[start:start + chunk]
            store.chunk_landed(1, i, "p1")
        view = await asyncio.to_thread(client.wait_block, 1, 5.0)
        assert bytes(view) == data  # the mapping made ahead shows what arrived after it
        assert len(client._maps) == 1  # and wait_block used it rather than mapping again
        view.release()
    finally:
        client.close()
        await server.close()
        store.close()
