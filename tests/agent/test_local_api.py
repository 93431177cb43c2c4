"""The local API between a node agent and its engine, over a real unix socket, without the network."""

import asyncio
import json
import math
import os
import re
import socket
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecast.agent.errors import LocalApiError, LocalApiTimeoutError, PackageDroppedError
from pipecast.agent import local_api
from pipecast.agent.local_api import MAX_TIMEOUT_S, OPS, LocalApiServer, parse_request
from pipecast.agent.local_client import LocalAgentClient, RequestScope
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.transport.base import PeerAuth
from pipecast.core.credentials import data_plane_key, serving_key
from tests.support.agent_fixtures import block_file_bytes, land_chunk, local_api_serving, receiving_store
from tests.support.engine_fixtures import wait_until
from tests.support.packages import tiny_package


@asynccontextmanager
async def local_api_server(tmp_path, layers: int = 3, layer_bytes: int = 200_000, status=dict):
    """A package's receiving store served by a local API server (its events published as the agent wires
    them) and a client: (manifest, store, server, client), all closed at the end."""
    manifest = tiny_package(tmp_path / "pkg", layers=layers, layer_bytes=layer_bytes, chunk_bytes=64 << 10).manifest
    store = receiving_store(manifest)
    try:
        async with local_api_serving(store, tmp_path / "agent.sock", status) as server:
            client = await asyncio.to_thread(LocalAgentClient, tmp_path / "agent.sock")
            try:
                yield manifest, store, server, client
            finally:
                client.close()
    finally:
        store.close()


def land(store, data: bytes, block: int, chunks: range) -> None:
    for chunk in chunks:
        land_chunk(store, data, block, chunk)


async def test_a_block_is_mapped_ahead_read_by_verified_prefix_and_whole_once_verified(tmp_path):
    async with local_api_server(tmp_path) as (manifest, store, _, client):
        assert not store.populated(1)
        await asyncio.to_thread(client.map_ahead, 1)  # nothing of block 1 is here yet
        # The agent populated the block's memory before answering: the engine's mapping allocated none of it.
        assert store.populated(1) and not store.populated(2)
        with pytest.raises(TimeoutError, match="block 1 not verified within 0.1 s"):
            await asyncio.to_thread(client.wait_block, 1, 0.1)
        with pytest.raises(LocalApiError, match=r"has no block 9 \(it has 3\)"):
            await asyncio.to_thread(client.map_ahead, 9)

        data = block_file_bytes(tmp_path / "pkg", manifest, 1)
        chunk = manifest.blocks[1].chunk_bytes
        land(store, data, 1, range(1))  # the first chunk is verified, the block is not
        prefix = await asyncio.to_thread(client.wait_prefix, 1, 1, 5.0)
        assert bytes(prefix) == data[:chunk]  # all that is verified, not just the byte asked for
        with pytest.raises(TimeoutError, match="the first 65537 bytes of block 1 not verified within 0.1 s"):
            await asyncio.to_thread(client.wait_prefix, 1, chunk + 1, 0.1)
        with pytest.raises(LocalApiError, match=f"block 1 has {len(data)} bytes: no prefix of {len(data) + 1}"):
            await asyncio.to_thread(client.wait_prefix, 1, len(data) + 1, 0.1)
        prefix.release()

        land(store, data, 1, range(1, store.chunk_count(1)))
        view = await asyncio.to_thread(client.wait_block, 1, 5.0)
        assert bytes(view) == data  # the mapping made ahead shows what arrived after it
        assert len(client._maps) == 1  # and wait_block used it rather than mapping again
        view.release()


async def test_unmap_lets_a_packages_blocks_go_and_a_wait_under_way_maps_its_block_again(tmp_path):
    """What a model closing calls on a client it shares (found in review: a long-lived client kept every package it
    served mapped); another model of the package waiting for a block meanwhile gets it, mapped again."""
    async with local_api_server(tmp_path) as (manifest, store, _, client):
        data = [block_file_bytes(tmp_path / "pkg", manifest, block) for block in (0, 1)]
        land(store, data[0], 0, range(store.chunk_count(0)))
        held = await asyncio.to_thread(client.wait_block, 0, 5.0)  # a tensor still viewing its block
        waiting = asyncio.create_task(asyncio.to_thread(client.wait_block, 1, 5.0))
        await asyncio.to_thread(wait_until, lambda: len(client._maps) == 2)  # block 1 mapped, not verified
        client.unmap(manifest.package_id)
        assert client._maps == {} and bytes(held) == data[0]  # a mapping still viewed goes with its view
        land(store, data[1], 1, range(store.chunk_count(1)))
        view = await waiting
        assert bytes(view) == data[1] and len(client._maps) == 1
        held.release()
        view.release()


async def test_once_subscribed_the_client_waits_on_events_not_requests(tmp_path):
    """Issue #14: under load an agent answered requests 0.3-3 s late and the engine asked it about every
    block in 50 ms slices, so blocks were bound seconds after they were verified. The client now learns
    what is verified from the agent's events: only a block's first mapping is a request."""
    async with local_api_server(tmp_path) as (manifest, store, server, client):
        asked = []
        answer = server._answer

        async def counted(request):
            asked.append(request.op)
            return await answer(request)

        server._answer = counted
        blocks = {i: block_file_bytes(tmp_path / "pkg", manifest, i) for i in (1, 2)}
        chunk, package = manifest.blocks[1].chunk_bytes, manifest.package_id
        land(store, blocks[1], 1, range(1))  # before the client subscribes: its first events say so
        prefix = await asyncio.to_thread(client.wait_prefix, 1, 1, 5.0, package)
        assert bytes(prefix) == blocks[1][:chunk] and asked == ["buffer"]
        assert await asyncio.to_thread(client.verified_bytes, 1, package) == chunk
        prefix.release()
        waiting = asyncio.ensure_future(asyncio.to_thread(client.wait_block, 1, 5.0, package))
        await asyncio.sleep(0.05)
        land(store, blocks[1], 1, range(1, store.chunk_count(1)))
        land(store, blocks[2], 2, range(store.chunk_count(2)))
        view = await asyncio.wait_for(waiting, 5)
        assert bytes(view) == blocks[1]
        view.release()
        for _ in range(250):  # block 2's event may come a moment after block 1's: both stream from the agent
            if await asyncio.to_thread(client.verified_blocks, package) == {1, 2}:
                break
            await asyncio.sleep(0.02)
        assert await asyncio.to_thread(client.verified_blocks, package) == {1, 2}
        assert await asyncio.to_thread(client.verified_bytes, 2, package) == len(blocks[2])
        assert asked == ["buffer"]  # the waits and what is verified asked nothing
        view = await asyncio.to_thread(client.wait_block, 2, 5.0, package)
        assert bytes(view) == blocks[2] and asked == ["buffer", "buffer"]  # block 2's mapping
        view.release()


async def test_a_long_request_holds_up_no_other_thread(tmp_path):
    """Issue #14: the worker's tokenizer read (a file the agent was still receiving) held the client's one
    connection, and the loader's requests queued behind it for seconds. Each thread now has its own."""
    async with local_api_server(tmp_path, layers=2, status=lambda: {"node": "n1"}) as (_, store, _, client):
        config = (tmp_path / "pkg" / "config.json").read_bytes()
        reading = asyncio.ensure_future(asyncio.to_thread(client.package_file, "config.json", None, 30.0))
        await asyncio.sleep(0.2)
        assert not reading.done()  # the agent has no config.json yet
        assert await asyncio.wait_for(asyncio.to_thread(client.status), 2) == {"node": "n1"}
        await asyncio.wait_for(asyncio.to_thread(client.map_ahead, 0), 2)
        store.add_file("config.json", config, "p1")
        assert await asyncio.wait_for(reading, 5) == config


async def test_a_wait_ends_with_a_clear_error_as_soon_as_the_agent_goes_away(tmp_path):
    """No hung await: a wait on the agent's events ends when the agent closes, long before its deadline."""
    async with local_api_server(tmp_path, layers=2) as (_, _, server, client):
        waiting = asyncio.ensure_future(asyncio.to_thread(client.wait_block, 0, 60.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await server.close()
        with pytest.raises(LocalApiError, match="agent at .*agent.sock: closed its event stream"):
            await asyncio.wait_for(waiting, 10)


async def test_a_client_serves_again_once_its_agent_restarted_on_the_same_socket(tmp_path):
    """Found in review: a client handed to pipecast.load was dead for good after its agent restarted: its kept
    connection failed unanswered (broken pipe) and its ended event stream was never followed again."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, server, client):
        data = block_file_bytes(tmp_path / "pkg", manifest, 0)
        land(store, data, 0, range(store.chunk_count(0)))
        view = await asyncio.to_thread(client.wait_block, 0, 5.0)
        assert bytes(view) == data
        view.release()
        async with restarted(tmp_path, manifest, server, client, data):
            view = await asyncio.to_thread(client.wait_block, 0, 5.0)
            assert bytes(view) == data
            view.release()
            assert (await asyncio.to_thread(client.manifest)).package_id == manifest.package_id


@asynccontextmanager
async def restarted(tmp_path, manifest, server, client, data: bytes) -> AsyncIterator[None]:
    """The agent behind ``server`` stopped and another started on its socket, holding block 0 (``data``) whole;
    the client and the new agent's store closed at the end."""
    await server.close()
    await asyncio.sleep(0.1)
    fresh = receiving_store(manifest)
    try:
        async with local_api_serving(fresh, tmp_path / "agent.sock"):
            land(fresh, data, 0, range(fresh.chunk_count(0)))
            yield
    finally:
        client.close()
        fresh.close()


async def test_memory_mapped_from_an_agent_before_its_restart_is_never_handed_out_as_verified(tmp_path):
    """Found in a review of the restart's fix: a block mapped from the agent before it restarted, then verified by
    the new one, was handed out as the old memory, half written (zeros), as if verified. wait_block's own steps,
    the restart forced between its buffer answer and its wait."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, server, client):
        package = manifest.package_id
        data = block_file_bytes(tmp_path / "pkg", manifest, 0)
        await asyncio.to_thread(client.verified_blocks, package)  # the event stream runs
        land(store, data, 0, range(1))  # the agent before had the first chunk of block 0 only
        mapped = await asyncio.to_thread(client._buffer, 0, package, 5.0)
        async with restarted(tmp_path, manifest, server, client, data):
            with pytest.raises(LocalApiError, match="the agent restarted meanwhile"):
                await asyncio.to_thread(client._await, package, 0, mapped.size, 5.0, time.monotonic(), "verified",
                                        mapped.generation)
            with pytest.raises(LocalApiError, match="the agent restarted meanwhile"):
                await asyncio.to_thread(client._view, mapped, 0, 5.0)
            view = await asyncio.to_thread(client.wait_block, 0, 5.0, package)  # asked again: the new memory
            assert bytes(view) == data
            view.release()


async def test_a_block_mapped_ahead_before_any_wait_is_not_the_old_agents_after_a_restart(tmp_path):
    """Found in a second review of the restart's fix: a block mapped ahead before the event stream started, the
    agent then restarted, was handed out as the old agent's half-written memory once the new one verified it."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, server, client):
        package = manifest.package_id
        data = block_file_bytes(tmp_path / "pkg", manifest, 0)
        land(store, data, 0, range(1))
        await asyncio.to_thread(client.map_ahead, 0, package)
        async with restarted(tmp_path, manifest, server, client, data):
            view = await asyncio.to_thread(client.wait_block, 0, 5.0, package)
            assert bytes(view) == data
            view.release()


async def test_memory_of_another_agent_process_than_the_streams_is_never_handed_out(tmp_path):
    """Found in a third review of the restart's fix: a buffer request retried on a new connection reached the agent
    restarted on the socket while the event thread had not read the old stream's end yet; the new agent's block,
    half written, was handed out on the old stream's word that it was verified. The memory's owner (the pid in its
    path, and that process's start) must be the stream's agent."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, _, client):
        package = manifest.package_id
        data = block_file_bytes(tmp_path / "pkg", manifest, 0)
        land(store, data, 0, range(store.chunk_count(0)))
        await asyncio.to_thread(client.verified_blocks, package)  # the event stream runs, from this process
        assert client._stream_agent is not None
        client._stream_agent = (client._stream_agent[0], client._stream_agent[1] - 1)  # as if an earlier process's
        with pytest.raises(LocalApiError, match=r"the agent restarted meanwhile \(another agent process answers"):
            await asyncio.to_thread(client.wait_block, 0, 5.0, package)
        assert not client._maps
        # The stream is taken for the agent's before: the next wait follows the agent now on the socket (it failed
        # until the process of the stream before had exited, found in a fourth review).
        view = await asyncio.to_thread(client.wait_block, 0, 5.0, package)
        assert bytes(view) == data
        view.release()


async def test_a_wait_gives_up_at_its_timeout_however_long_its_buffer_request_took(tmp_path):
    """Found in review: a block's first wait spent up to its timeout on the buffer request (the agent did not hold
    the package yet), then a fresh full timeout on the events: ~2x what it was given, saying "within T s"."""
    manifest = tiny_package(tmp_path / "pkg", layers=2, layer_bytes=200_000, chunk_bytes=64 << 10).manifest
    peers, store = PeerServer(), receiving_store(manifest)
    server = LocalApiServer(peers, status=dict, auth=PeerAuth("n1"))
    await server.start(tmp_path / "agent.sock")
    client = await asyncio.to_thread(LocalAgentClient, tmp_path / "agent.sock")
    try:
        asyncio.get_running_loop().call_later(2.0, peers.add, store)  # block 0 never comes
        started = time.monotonic()
        with pytest.raises(LocalApiTimeoutError, match="block 0 not verified within 3 s$"):
            await asyncio.to_thread(client.wait_block, 0, 3.0, manifest.package_id)
        assert time.monotonic() - started < 4.4  # 5 s before (2 s for the package, then 3 s more)
    finally:
        client.close()
        await server.close()
        store.close()


async def test_close_ends_the_requests_and_waits_of_other_threads_at_once(tmp_path):
    """Found in review: close() closed only idle connections, so a thread's request (a file, a block's first
    buffer) went on until the agent's timeout and then said it timed out; a wait on events said the event stream
    closed. Each now ends at once with "the client is closed"."""
    async with local_api_server(tmp_path, layers=2) as (manifest, _, _, client):
        await asyncio.to_thread(client.map_ahead, 1, manifest.package_id)
        waits = [asyncio.ensure_future(asyncio.to_thread(*call)) for call in (
            (client.package_file, "config.json", None, 30.0),  # the agent has no config.json
            (client.wait_block, 0, 30.0, "f" * 64),  # nor this package: its buffer request waits
            (client.wait_block, 1, 30.0, manifest.package_id))]  # block 1 mapped, waited for on the events
        await asyncio.sleep(0.2)
        assert not any(wait.done() for wait in waits)
        await asyncio.to_thread(client.close)
        for wait in waits:
            with pytest.raises(LocalApiError, match="agent.sock: the client is closed$"):
                await asyncio.wait_for(wait, 2)


async def test_a_closed_client_follows_no_events_and_answers_none_from_those_it_had(tmp_path):
    """Found in review: after close(), verified_blocks() opened a new event stream (a socket, a thread, a subscriber
    in the agent), and answered from stale events where one ran."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, server, client):
        land(store, block_file_bytes(tmp_path / "pkg", manifest, 0), 0, range(store.chunk_count(0)))
        following = await asyncio.to_thread(LocalAgentClient, tmp_path / "agent.sock")
        await asyncio.to_thread(following.verified_blocks, manifest.package_id)  # its event stream runs
        await until(lambda: following.verified_blocks(manifest.package_id) == {0})
        for closed in (client, following):  # its event stream never started, or ran
            closed.close()
            for ask in (closed.verified_blocks, lambda package: closed.verified_bytes(0, package)):
                with pytest.raises(LocalApiError, match="agent.sock: the client is closed$"):
                    await asyncio.to_thread(ask, manifest.package_id)
        await until(lambda: not server._subscribers, 1.0)


async def test_close_racing_a_wait_ends_it_saying_the_client_is_closed(tmp_path):
    """Found in review: close() unmapping a block between a wait's end and its view ended the wait with a bare
    ValueError (mmap closed or invalid)."""
    def wait_as_it_closes(wait: str, *args) -> memoryview:
        engine = LocalAgentClient(tmp_path / "agent.sock")
        waited = engine._await

        def await_then_close(*await_args):
            verified = waited(*await_args)
            engine.close()  # in the engine another thread's, at this moment
            return verified

        engine._await = await_then_close
        return getattr(engine, wait)(*args)

    async with local_api_server(tmp_path, layers=2) as (manifest, store, _, _):
        land(store, block_file_bytes(tmp_path / "pkg", manifest, 0), 0, range(store.chunk_count(0)))
        for wait, args in (("wait_block", (0, 5.0)), ("wait_prefix", (0, 1, 5.0))):
            with pytest.raises(LocalApiError, match="agent.sock: the client is closed$"):
                await asyncio.to_thread(wait_as_it_closes, wait, *args, manifest.package_id)


async def test_an_idle_connection_does_not_hold_up_the_agents_close(tmp_path):
    """Found in review: close() cancelled its connections only after the server's wait_closed(), which from
    Python 3.12.1 waits for every connection: a worker's pooled idle connection held the agent's shutdown."""
    async with local_api_server(tmp_path, layers=2) as (_, _, server, _):
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "agent.sock"))
        writer.write(b'{"op": "status"}\n')
        assert json.loads(await asyncio.wait_for(reader.readline(), 5))["ok"]
        await asyncio.wait_for(server.close(), 5)  # the connection stays open and idle
        assert await asyncio.wait_for(reader.read(), 5) == b""  # ended by the agent
        writer.close()


async def test_engines_that_go_away_leave_no_connection_or_subscriber_in_the_agent(tmp_path):
    """Found in review: the agent noticed a subscriber gone only at its next event, and a request whose engine had
    gone only at the request's timeout (up to a day): every engine that loaded and exited left a connection, its task
    and its queue in the agent. Both end once the engine's connection does, with no event since."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, server, client):
        land(store, block_file_bytes(tmp_path / "pkg", manifest, 0), 0, range(store.chunk_count(0)))
        client.close()  # the fixture's: every engine goes away

        def engine() -> None:
            with LocalAgentClient(tmp_path / "agent.sock") as engine_client:
                engine_client.wait_block(0, 5.0, manifest.package_id).release()  # follows the events

        for _ in range(5):
            await asyncio.to_thread(engine)
            _, writer = await asyncio.open_unix_connection(str(tmp_path / "agent.sock"))
            writer.write(b'{"op": "wait_block", "block": 1, "timeout": 86400}\n')  # block 1 never comes
            await writer.drain()
            writer.close()
        await until(lambda: not server._connections and not server._subscribers, 1.0)


async def test_a_wait_on_a_package_dropped_meanwhile_ends_saying_so(tmp_path):
    """Not a connection closed with no reason (the wait was cancelled); and a PackageDroppedError, the release the
    serving worker waits out (found in review: a generic LocalApiError, which failed the worker for good)."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, _, client):
        reading = asyncio.ensure_future(asyncio.to_thread(client.package_file, "config.json", None, 30.0))
        await asyncio.sleep(0.2)
        assert not reading.done()  # the agent has no config.json yet
        store.close()  # as the agent drops the package
        with pytest.raises(PackageDroppedError, match=rf"agent.sock: DroppedHereError: package "
                                                      rf"{manifest.package_id[:12]} was dropped here$"):
            await asyncio.wait_for(reading, 5)


async def test_an_engine_waiting_on_a_package_the_agent_drops_fails_at_once_and_forgets_its_blocks(tmp_path):
    """The agent's drop event ends a block wait at once (not at its deadline), and what the client knew of the
    package goes: held again, it is new memory whose blocks are verified afresh."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, server, client):
        land(store, block_file_bytes(tmp_path / "pkg", manifest, 0), 0, range(store.chunk_count(0)))
        await asyncio.to_thread(client.wait_block, 0, 5.0, manifest.package_id)
        waiting = asyncio.ensure_future(asyncio.to_thread(client.wait_block, 1, 60.0, manifest.package_id))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        server.publish_dropped(manifest.package_id)
        with pytest.raises(LocalApiError, match=rf"agent.sock: package {manifest.package_id[:12]} was dropped there "
                                                r"\(block 1 not verified\)$"):
            await asyncio.wait_for(waiting, 5)
        assert client.verified_blocks(manifest.package_id) == set()
        # Known dropped, a wait fails at once, with no request the agent would hold until its timeout.
        with pytest.raises(PackageDroppedError, match=r"was dropped there \(block 1 not verified\)$"):
            await asyncio.wait_for(asyncio.to_thread(client.wait_block, 1, 60.0, manifest.package_id), 1.0)
        # The agent holds it again (here: the same store), and says what it holds: once the client has heard it,
        # a wait maps the block afresh.
        server.publish_held(store)
        await until(lambda: client.verified_blocks(manifest.package_id) == {0})
        assert (await asyncio.to_thread(client.wait_block, 0, 5.0, manifest.package_id)).nbytes > 0


async def until(condition, timeout: float = 5.0) -> None:
    """Wait until ``condition()`` holds (what the client's event thread learns, it learns a moment later)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_buffer_request_the_agent_holds_for_a_package_dropped_meanwhile_says_dropped(tmp_path):
    """A block's first wait asks the agent for its buffer; the agent, no longer holding the package, holds the
    request until its timeout: the client, told of the drop meanwhile, says "dropped", not "timed out"."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, server, client):
        await asyncio.to_thread(client.verified_blocks, manifest.package_id)  # follows its events from now on
        server._peer_server.stores.pop(manifest.package_id)  # as AgentDaemon.drop_package does, before its event
        waiting = asyncio.ensure_future(asyncio.to_thread(client.wait_block, 1, 0.5, manifest.package_id))
        await asyncio.sleep(0.1)
        server.publish_dropped(manifest.package_id)
        with pytest.raises(PackageDroppedError, match=r"was dropped there \(block 1 not verified\)$"):
            await asyncio.wait_for(waiting, 5)


async def test_block_memory_the_engine_cannot_open_is_a_local_api_error_saying_why(tmp_path, monkeypatch):
    """An engine that does not see the agent's processes (another pid namespace, another user) cannot open the
    memfd path the agent answers: a typed error naming the block, the path and what the engine needs."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, _, client):
        monkeypatch.setattr(store, "block_path", lambda block: "/proc/999999999/fd/7")
        with pytest.raises(LocalApiError, match=r"cannot open block 0's memory at /proc/999999999/fd/7 \(No such "
                                                r"file or directory\): an engine must run as the agent's user"):
            await asyncio.to_thread(client.wait_block, 0, 1.0, manifest.package_id)


async def test_a_subscriber_that_stops_reading_is_cut_off_not_kept_in_memory(tmp_path, monkeypatch):
    """An engine that subscribes and never reads must not grow the agent one event a chunk: past
    MAX_PENDING_EVENTS unread, its stream ends after what it was sent."""
    monkeypatch.setattr(local_api, "MAX_PENDING_EVENTS", 3)
    async with local_api_server(tmp_path) as (manifest, store, server, _):
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "agent.sock"))
        writer.write(b'{"op": "subscribe"}\n')
        assert json.loads(await reader.readline()) == {"ok": True}
        data = block_file_bytes(tmp_path / "pkg", manifest, 1)
        land(store, data, 1, range(store.chunk_count(1)))  # more events than the bound, none read yet
        assert not server._subscribers
        lines = (await asyncio.wait_for(reader.read(), 5)).decode().splitlines()
        assert 1 <= len(lines) <= 3 and all(json.loads(line)["block"] == 1 for line in lines)  # then EOF
        writer.close()


# --- hostile requests (issue #12, finding 7 and 3) ---------------------------------------------------

async def exchange(path, *lines: bytes) -> list[dict]:
    """Send ``lines`` on one connection; return the agent's answer to each."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        answers = []
        for line in lines:
            writer.write(line + b"\n")
            await writer.drain()
            answers.append(json.loads(await asyncio.wait_for(reader.readline(), 5)))
        return answers
    finally:
        writer.close()


BAD_REQUESTS = [
    (b"[1, 2]", "not a JSON object"),
    (b'"wait_block"', "not a JSON object"),
    (b"7", "not a JSON object"),
    (b"null", "not a JSON object"),
    (b"{not json", "not a JSON object"),
    (b"[" * 50_000, "nested too deeply"),
    (b'{"op": "status", "op": "manifest"}', "duplicate key 'op'"),
    (b'{"op": "wait_block", "block": 0, "timeout": 1e400}', "out of range"),
    (b'{"op": "wait_block", "block": 0, "timeout": NaN}', "NaN is not a JSON number"),
    (b'{"op": "wait_block", "block": 0, "timeout": Infinity}', "Infinity is not a JSON number"),
    (b'{"op": "wait_block", "block": 0, "timeout": -1}', "timeout must be a number of seconds"),
    (b'{"op": "wait_block", "block": 0, "timeout": 1e300}', "timeout must be a number of seconds"),
    # Found in review: math.isfinite overflowed on it, and the connection closed unanswered.
    (b'{"op": "status", "timeout": 1' + b"0" * 400 + b"}", "timeout must be a number of seconds"),
    (b'{"op": "wait_block", "block": 0, "timeout": "30"}', "timeout must be a number of seconds"),
    (b'{"op": "wait_block", "block": 0, "timeout": true}', "timeout must be a number of seconds"),
    (b'{"op": "wait_block", "block": -1}', "block must be a non-negative integer"),
    (b'{"op": "wait_block", "block": "0"}', "block must be a non-negative integer"),
    (b'{"op": "wait_block", "block": 0.5}', "block must be a non-negative integer"),
    (b'{"op": "wait_block"}', "block must be a non-negative integer"),
    (b'{"op": "wait_prefix", "block": 0, "bytes": [1]}', "bytes must be a non-negative integer"),
    (b'{"op": "file", "path": ["config.json"]}', "path must be a file name"),
    (b'{"op": "manifest", "package": {"id": 1}}', "package must be a package id"),
    (b'{"op": ["status"]}', "unknown op"),
    (b'{"block": 0}', "unknown op None"),
    (b'{"op": "reboot"}', "unknown op 'reboot'"),
]


async def test_malformed_requests_answer_ok_false_and_the_connection_goes_on(package, tmp_path):
    """Findings 3 and 7: a request that is not a JSON object killed the connection (AttributeError) and
    ``timeout`` NaN, negative or infinite reached asyncio; each is now an ``ok: false`` answer saying what
    is wrong, and the next request on the same connection is served."""
    _, manifest = package
    store = receiving_store(manifest)
    peer_server = PeerServer()
    peer_server.add(store)
    server = LocalApiServer(peer_server, status=lambda: {"node": "n1"}, auth=PeerAuth("n1"))
    await server.start(tmp_path / "agent.sock")
    try:
        lines = [line for line, _ in BAD_REQUESTS]
        answers = await exchange(tmp_path / "agent.sock", *lines, b'{"op": "status"}')
        for (line, problem), answer in zip(BAD_REQUESTS, answers):
            assert answer["ok"] is False and answer["timeout"] is False, (line[:60], answer)
            assert problem in answer["error"], (line[:60], answer)
        assert answers[-1] == {"ok": True, "status": {"node": "n1"}}
    finally:
        await server.close()
        store.close()


async def test_the_client_refuses_a_timeout_that_is_not_a_finite_number(tmp_path):
    """Finding 7: a NaN or infinite timeout reached the socket (ValueError/OverflowError); now LocalApiError."""
    server = LocalApiServer(PeerServer(), status=dict, auth=PeerAuth("n1"))
    await server.start(tmp_path / "agent.sock")
    client = await asyncio.to_thread(LocalAgentClient, tmp_path / "agent.sock")
    try:
        for timeout in (math.nan, math.inf, -1.0, 1e300):
            with pytest.raises(LocalApiError, match="timeout must be a number of seconds from 0 to 86400"):
                await asyncio.to_thread(client.wait_block, 0, timeout)
        assert await asyncio.to_thread(client.status) == {}
    finally:
        client.close()
        await server.close()


async def test_the_client_refuses_a_bad_timeout_before_it_waits_on_a_mapped_block(tmp_path):
    """Found in review: a block mapped already asks the agent nothing, so its wait's timeout went unchecked: NaN spun
    at 100% CPU for ever, an infinite or huge one raised OverflowError, None or a string TypeError; events() raised
    ValueError for NaN or a negative one."""
    async with local_api_server(tmp_path, layers=2) as (manifest, _, _, client):
        package = manifest.package_id
        await asyncio.to_thread(client.map_ahead, 1, package)  # block 1 is still arriving
        for timeout in (math.inf, 1e300, -1.0, None, "x", True, math.nan):  # NaN last: it hung the old client
            with pytest.raises(LocalApiError, match="timeout must be a number of seconds from 0 to 86400"):
                await asyncio.to_thread(client.wait_block, 1, timeout, package)
            with pytest.raises(LocalApiError, match="timeout must be a number of seconds from 0 to 86400"):
                await asyncio.to_thread(client.wait_prefix, 1, 1, timeout, package)
            with pytest.raises(LocalApiError, match="timeout must be a number of seconds from 0 to 86400"):
                await asyncio.to_thread(client.map_ahead, 1, package, timeout)
            if timeout is not None:  # events(): None waits for ever
                with pytest.raises(LocalApiError, match="timeout must be a number of seconds from 0 to 86400"):
                    await asyncio.to_thread(next, client.events(timeout))


async def test_a_timeout_of_zero_gets_an_answer_ready_at_once(tmp_path):
    """Found in review: on Python 3.11 asyncio.wait_for(..., 0) cancels before the first step, so a timeout of 0
    failed even where the answer was ready, saying "no package  here" (two spaces) where no package was named."""
    async with local_api_server(tmp_path, layers=2) as (manifest, store, _, client):
        land(store, block_file_bytes(tmp_path / "pkg", manifest, 0), 0, range(store.chunk_count(0)))
        await asyncio.to_thread(client.verified_blocks, manifest.package_id)  # what the client knows, from events
        await until(lambda: client.verified_blocks(manifest.package_id) == {0})
        view = await asyncio.to_thread(client.wait_block, 0, 0.0, manifest.package_id)  # its buffer request too
        assert view.nbytes == manifest.blocks[0].bytes
        view.release()
        assert (await asyncio.to_thread(client.progress, None, 0.0)).package_id == manifest.package_id
        answers = await exchange(tmp_path / "agent.sock",
                                 b'{"op": "wait_prefix", "block": 0, "bytes": 1, "timeout": 0}',
                                 b'{"op": "wait_block", "block": 1, "timeout": 0}')
        assert answers[0]["ok"] and answers[0]["verified"] == manifest.blocks[0].bytes
        assert answers[1] == {"ok": False, "error": "block 1 not verified within 0 s", "timeout": True}
    server = LocalApiServer(PeerServer(), status=dict, auth=PeerAuth("n1"))
    await server.start(tmp_path / "empty.sock")
    try:
        assert await exchange(tmp_path / "empty.sock", b'{"op": "progress", "timeout": 0}') == [
            {"ok": False, "error": "no package here within 0 s", "timeout": True}]
    finally:
        await server.close()


async def test_the_serving_key_comes_once_the_agent_knows_its_cluster_credentials(tmp_path):
    """A serving worker learns the key it checks requests against from its agent: derived from the
    data-plane key (never the key itself), waited for while the agent has not registered, b"" with auth off."""
    auth = PeerAuth("n1", None)  # under a control plane, before the registration
    server = LocalApiServer(PeerServer(), status=dict, auth=auth)
    await server.start(tmp_path / "agent.sock")
    client = await asyncio.to_thread(LocalAgentClient, tmp_path / "agent.sock")
    try:
        with pytest.raises(LocalApiTimeoutError, match=r"no cluster credentials here within 0.05 s \(the agent "
                                                       r"has not registered with its control plane yet\)"):
            await asyncio.to_thread(client.serving_key, 0.05)
        waiting = asyncio.ensure_future(asyncio.to_thread(client.serving_key, 5.0))
        await asyncio.sleep(0.05)
        auth.set_key(data_plane_key("master"))
        key = await waiting
        assert key == serving_key(data_plane_key("master")) and len(key) == 32
        assert key != data_plane_key("master")
        auth.set_key(b"")
        assert await asyncio.to_thread(client.serving_key, 0.0) == b""
    finally:
        client.close()
        await server.close()


async def test_the_socket_is_private_before_it_accepts_anyone(tmp_path, monkeypatch):
    """Finding 7: the socket was chmod-ed to 0600 only after it listened, so with a permissive umask any
    local user could connect in between; now it listens only once it is 0600."""
    modes_at_listen = []
    real_listen = socket.socket.listen

    def listen(sock, *args):
        bound = Path(sock.getsockname())
        # A socket file renamed since its bind is stat-ed under its new name.
        modes_at_listen.append(stat.S_IMODE(os.stat(bound if bound.exists() else tmp_path / "agent.sock").st_mode))
        return real_listen(sock, *args)

    monkeypatch.setattr(socket.socket, "listen", listen)
    old_umask = os.umask(0)
    try:
        server = LocalApiServer(PeerServer(), status=dict, auth=PeerAuth("n1"))
        await server.start(tmp_path / "agent.sock")
    finally:
        os.umask(old_umask)
    try:
        assert modes_at_listen and set(modes_at_listen) == {0o600}
        assert stat.S_IMODE(os.stat(tmp_path / "agent.sock").st_mode) == 0o600
        assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.sock"]  # no temporary name left
        client = await asyncio.to_thread(LocalAgentClient, tmp_path / "agent.sock")
        assert await asyncio.to_thread(client.status) == {}
        client.close()
    finally:
        await server.close()
    assert not (tmp_path / "agent.sock").exists()


async def test_only_a_stale_socket_is_replaced_never_a_file_or_a_folder(tmp_path, monkeypatch):
    """Found in review: whatever refused a connection was unlinked, so a mistyped socket path deleted a regular
    file there; a folder raised a bare IsADirectoryError."""
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # a dead agent's socket: refused, replaced
        dead.bind(str(stale))
    server = LocalApiServer(PeerServer(), status=dict, auth=PeerAuth("n1"))
    await server.start(stale)
    try:
        with pytest.raises(LocalApiError, match="another agent is listening on this socket"):
            await LocalApiServer(PeerServer(), status=dict, auth=PeerAuth("n1")).start(stale)
    finally:
        await server.close()
    mistyped, folder = tmp_path / "agent.toml", tmp_path / "folder"
    mistyped.write_text("auth_token = 'precious'\n")
    folder.mkdir()
    for path in (mistyped, folder):
        with pytest.raises(LocalApiError) as refused:
            await LocalApiServer(PeerServer(), status=dict, auth=PeerAuth("n1")).start(path)
        assert str(refused.value) == (f"{path} exists and is not a socket: the agent replaces only a stale socket "
                                      "of its own there")
    assert mistyped.read_text() == "auth_token = 'precious'\n" and folder.is_dir()

    def stuck(sock, address):  # a listener whose backlog is full, say
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket.socket, "connect", stuck)
    with pytest.raises(LocalApiError) as refused:
        await LocalApiServer(PeerServer(), status=dict, auth=PeerAuth("n1")).start(mistyped)
    assert str(refused.value) == f"{mistyped}: cannot tell whether an agent listens on this socket: timed out"


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=25)
REQUESTS = st.fixed_dictionaries({}, optional={
    "op": st.sampled_from(OPS) | JSON_VALUES,
    "package": st.none() | st.text(max_size=8) | JSON_VALUES,
    "timeout": st.floats() | st.integers() | JSON_VALUES,
    "block": st.integers() | JSON_VALUES,
    "bytes": st.integers() | JSON_VALUES,
    "path": st.text(max_size=8) | JSON_VALUES,
})


@settings(max_examples=500, deadline=None)
@given(REQUESTS | JSON_VALUES)
def test_fuzz_the_request_parser_with_json_values(value):
    """Finding 3: any JSON value (NaN and infinities as Python writes them included) is a checked request
    or LocalApiError, nothing else."""
    try:
        request = parse_request(json.dumps(value).encode())
    except LocalApiError:
        return
    assert request.op in OPS and math.isfinite(request.timeout) and 0 <= request.timeout <= MAX_TIMEOUT_S


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_the_request_parser_with_bytes(line):
    try:
        parse_request(line)
    except LocalApiError:
        pass


def test_an_agent_stopping_with_an_engine_waiting_ends_its_request_and_logs_no_error(tmp_path, caplog):
    """Finding 3 (walk B): an agent stopped by SIGTERM with a serving worker attached logged an ERROR
    traceback per connection (asyncio cancelled its handler at the end of the run, and logs a connection's
    task that ends cancelled); now closing the local API ends each request quietly, and the engine sees EOF."""
    async def agent() -> bytes:
        server = LocalApiServer(PeerServer(), status=dict, auth=PeerAuth("n1"))
        await server.start(tmp_path / "agent.sock")
        reader, writer = await asyncio.open_unix_connection(tmp_path / "agent.sock")
        try:
            writer.write(b'{"op": "wait_block", "block": 0, "timeout": 60}\n')  # a package that never comes
            await writer.drain()
            await asyncio.sleep(0.1)
            await server.close()
            return await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()

    assert asyncio.run(agent()) == b""  # asyncio.run then cancels what is left, as when the agent exits
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


async def test_a_block_mapped_as_its_package_is_dropped_is_not_kept_for_the_package_held_again(tmp_path, monkeypatch):
    """Found in review: a drop the client heard of while it mapped a block (MAP_POPULATE takes ~0.15 ms/MB) left
    that mapping of the dropped memory in its cache: held again, the package's block read from it, its unwritten
    pages zeros, as verified weights."""
    import mmap as real_mmap
    import types

    from pipecast.agent import local_client

    manifest = tiny_package(tmp_path / "pkg", layers=2, layer_bytes=200_000, chunk_bytes=64 << 10).manifest
    package_id, peers = manifest.package_id, PeerServer()
    server = LocalApiServer(peers, status=dict, auth=PeerAuth("test"))
    loop = asyncio.get_running_loop()
    store = receiving_store(manifest)
    peers.add(store)
    await server.start(tmp_path / "agent.sock")

    async def drop():
        peers.forget(package_id)
        await asyncio.to_thread(peers.stores.pop(package_id).detach())
        server.publish_dropped(package_id)

    def engine():
        client = LocalAgentClient(tmp_path / "agent.sock")
        client.verified_blocks(package_id)  # its event stream runs

        def racing_mmap(*args, **kwargs):
            mapped = real_mmap.mmap(*args, **kwargs)
            asyncio.run_coroutine_threadsafe(drop(), loop).result(5)  # the drop lands while the block is mapped
            deadline = time.monotonic() + 5
            while package_id not in client._dropped:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            return mapped

        monkeypatch.setattr(local_client, "mmap", types.SimpleNamespace(
            mmap=racing_mmap, MAP_SHARED=real_mmap.MAP_SHARED, PROT_READ=real_mmap.PROT_READ,
            MAP_POPULATE=getattr(real_mmap, "MAP_POPULATE", 0)))
        try:
            with pytest.raises(PackageDroppedError, match=rf"package {package_id[:12]} was dropped there"):
                client.map_ahead(1, package_id)  # block 1 still arriving
            assert (package_id, 1) not in client._maps
        finally:
            client.close()

    try:
        await asyncio.to_thread(engine)
    finally:
        await server.close()
        store.close()


@pytest.mark.parametrize("call, reply, message", [
    (lambda c: c.manifest(timeout=1), {"ok": True}, "answered manifest without a manifest of the right kind (dict)"),
    (lambda c: c.package_file("config.json", timeout=1), {"ok": True, "data": 5},
     "answered file without a data of the right kind (str)"),
    (lambda c: c.package_file("config.json", timeout=1), {"ok": True, "data": "not base64!"},
     "answered file config.json with data that is not base64"),
    (lambda c: c.wait_block(0, timeout=1), {"ok": True, "package": "p", "block": 0, "path": "/x", "bytes": True},
     "answered buffer without a bytes of the right kind (int)"),
    (lambda c: c.status(), {"ok": True, "status": []}, "answered status without a status of the right kind (dict)"),
    (lambda c: c.serving_key(timeout=1), {"ok": True}, "answered serving_key without a serving_key of the right kind"),
    (lambda c: c.progress(timeout=1), {"ok": True, "progress": {}}, "answered progress of another shape: '{}'"),
])
def test_an_answer_without_the_fields_its_op_gives_is_a_local_api_error(tmp_path, call, reply, message):
    """Found in review: an agent answering {"ok": true} (another version's answer, the local API has none) raised a
    raw KeyError out of pipecast.load, which then neither fell back to the folder nor closed its client."""
    subscribed = []  # a wait follows the agent's events first: its subscription is answered, then kept

    def answer(connection):
        line = connection.makefile("rb").readline()
        if line and json.loads(line)["op"] == "subscribe":
            connection.sendall(b'{"ok": true}\n')
            subscribed.append(connection)
            return
        with connection:
            connection.sendall(json.dumps(reply).encode() + b"\n")

    def serve(server):  # each connection on a thread of its own: the client keeps one open idle from its start
        while True:
            try:
                connection, _ = server.accept()
            except OSError:  # the test ended: its listening socket closed
                return
            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    with fake_agent(tmp_path, serve) as path:
        with LocalAgentClient(path) as client, pytest.raises(LocalApiError, match=re.escape(message)):
            call(client)
        for connection in subscribed:
            connection.close()


@contextmanager
def fake_agent(tmp_path, serve: Callable[[socket.socket], None]) -> Iterator[str]:
    """A local socket at ``tmp_path`` whose listening socket ``serve`` takes on a thread of its own: its path. At
    the end the socket stops listening (a waiting accept() fails) and the thread is joined."""
    path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen()
        thread = threading.Thread(target=serve, args=(server,), daemon=True)
        thread.start()
        try:
            yield path
        finally:
            server.shutdown(socket.SHUT_RDWR)
            thread.join(5)


def test_interrupt_ends_its_scopes_request_in_flight_only_and_the_client_stays_open(tmp_path):
    """What a model closing while its loader waits on a silent agent calls (the wait was agent_timeout_s + 5 s).
    Found in review: it ended every request in flight on the client, so closing one model killed the requests of
    the others loading through the same client (given as ``agent=``): they failed, blaming the agent."""
    received = [threading.Event(), threading.Event()]
    answer = threading.Event()

    def serve(server):
        first, _ = server.accept()  # the client's first connection, which the first request takes
        first.makefile("rb").readline()  # never answered
        received[0].set()
        second, _ = server.accept()
        with first, second:
            lines = second.makefile("rb")
            lines.readline()
            received[1].set()
            answer.wait(5)
            second.sendall(b'{"ok": true, "status": {"node": "n"}}\n')
            lines.readline()  # the next request, on the connection kept
            second.sendall(b'{"ok": true, "status": {"node": "n"}}\n')

    with fake_agent(tmp_path, serve) as path, LocalAgentClient(path) as client:
        scopes = [RequestScope(), RequestScope()]
        results = [[], []]

        def ask(i):
            with scopes[i].active():
                results[i].append(_raised(client.status) or "answered")

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for thread, event in zip(threads, received):
            thread.start()
            assert event.wait(5)
        client.interrupt(scopes[0])
        threads[0].join(5)
        assert not threads[0].is_alive() and isinstance(results[0][0], LocalApiError)
        assert threads[1].is_alive()  # another scope's request goes on
        answer.set()
        threads[1].join(5)
        assert results[1] == ["answered"]
        with scopes[0].active():
            assert client.status() == {"node": "n"}  # not closed, and a later request of the scope is asked


def test_close_ends_a_subscription_an_agent_leaves_unanswered_at_once(tmp_path):
    """Found in review: close() waited out the 5 s connect timeout of an event subscription a silent agent never
    answered (it held the lock close() takes, on a socket close() did not know of)."""
    received = threading.Event()

    def serve(server):
        idle, _ = server.accept()  # the client's first connection, kept for its requests
        silent, _ = server.accept()
        with idle, silent:
            silent.makefile("rb").readline()  # the subscription, never answered
            received.set()
            silent.recv(1)  # until the client shuts it down

    with fake_agent(tmp_path, serve) as path:
        client = LocalAgentClient(path)
        failures = []
        watching = threading.Thread(target=lambda: failures.append(_raised(client._watch)))
        watching.start()
        assert received.wait(5)
        started = time.monotonic()
        client.close()
        watching.join(5)
        assert time.monotonic() - started < 1.0 and not watching.is_alive()
        assert re.search("the client is closed", str(failures[0]))


def _raised(call) -> Exception | None:
    """What ``call()`` raised (None: nothing), from a thread of its own."""
    try:
        call()
    except Exception as exc:
        return exc
    return None
