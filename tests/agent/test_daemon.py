"""The agent daemon in-process: seeded with a package, it serves its blocks to a TCP peer, reports them in its
status and event log, and on stop closes its port and frees its blocks; without a control plane its
data-plane key derives from the master token."""

import asyncio
import json
import socket
import threading
from types import SimpleNamespace

import pytest

from pipecast.agent.cache import BlockCache
from control_plane.planner.schedules import make_plan
from pipecast.agent.daemon import AgentDaemon, AgentOptions
from pipecast.agent.errors import (
    DataPlaneTlsError,
    ListenError,
    MemoryBudgetError,
    PeerAuthError,
    PeerConnectError,
    PlanFileError,
    UnknownPackageError,
)
from pipecast.agent.events import read_events
from pipecast.agent.fetcher import ChannelPool
from pipecast.agent.plan_file import plan_file_data
from pipecast.agent.ratelimit import format_rate
from pipecast.agent.store import BlockStore
from pipecast.agent.transport.tcp import TcpTransport
from pipecast.core.credentials import CredentialError, issue_node_token
from pipecast.core.settings import Settings
from pipecast.core.units import format_bytes
from tests.support.agent_fixtures import block_file_bytes, land_chunk, receiving_store
from tests.support.agent_processes import free_ports

pytestmark = pytest.mark.timeout(30)

SETTINGS = dict(agent_transport="tcp", agent_cache_dir=None, agent_local_socket=None, connect_timeout_s=1.0,
                egress_mbit=0, ingress_mbit=0)
MASTER = "the-cluster-master-token"


async def test_a_seeded_daemon_serves_a_block_reports_it_and_frees_everything_on_stop(tiny_package, tmp_path):
    package = tiny_package(layers=3, layer_bytes=200_000, chunk_bytes=64 << 10)
    manifest = package.manifest
    events = tmp_path / "seed.jsonl"
    said: list[str] = []
    daemon = AgentDaemon(AgentOptions(node_id="seed", listen="127.0.0.1:0", seed=package.path, events=events,
                                      announce=said.append), Settings(**SETTINGS))
    running = asyncio.create_task(daemon.run())
    while daemon.listener is None:
        assert not running.done(), running.exception()
        await asyncio.sleep(0.01)
    address = daemon.listener.address
    # Found in review: an agent said nothing at the default log level, not even its node id (which issue-token
    # needs), where the other servers print where they listen.
    assert said == [f"pipecast agent: node seed listening on {address} (tcp)"]
    client = TcpTransport("rx", Settings(**SETTINGS))
    received = receiving_store(manifest)
    try:
        channel = await client.connect(address, "seed")
        await channel.fetch_block(manifest.package_id, 1, 0, received)
        await channel.close()
        assert received.verified_blocks() == [1]
        assert bytes(received.block_view(1)) == block_file_bytes(package.path, manifest, 1)

        status = daemon.status()
        assert (status["node"], status["address"]) == ("seed", address)
        assert status["bytes_sent"] >= manifest.blocks[1].bytes
        held = status["packages"][manifest.package_id]
        assert held["complete"] and held["blocks_verified"] == held["blocks_total"] == 3
    finally:
        received.close()
        daemon.stop()
        await asyncio.wait_for(running, 10)

    store = daemon.peer_server.stores[manifest.package_id]
    assert store.verified_blocks() == []  # its block buffers are released
    with pytest.raises(PeerConnectError):
        await client.connect(address, "seed")
    await client.close()
    log = read_events(events)
    assert [(e["requester"], e["block"]) for e in log if e["event"] == "peer_request"] == [("rx", 1)]
    assert log[-1]["event"] == "stopped" and log[-1]["bytes_sent"] == status["bytes_sent"]


async def test_a_static_daemon_keys_its_hello_with_the_master_token_and_refuses_other_keys(tiny_package, tmp_path):
    package = tiny_package(layers=2, layer_bytes=100_000, chunk_bytes=64 << 10)
    manifest = package.manifest
    daemon = AgentDaemon(AgentOptions(node_id="seed", listen="127.0.0.1:0", seed=package.path),
                         Settings(**SETTINGS, auth_token=MASTER))
    running = asyncio.create_task(daemon.run())
    while daemon.listener is None:
        assert not running.done(), running.exception()
        await asyncio.sleep(0.01)
    member, stranger = (TcpTransport("rx", Settings(**SETTINGS, auth_token=t)) for t in (MASTER, "guess"))
    try:
        channel = await member.connect(daemon.listener.address, "seed")
        config = (package.path / "config.json").read_bytes()
        assert await channel.fetch_file(manifest.package_id, "config.json") == config
        await channel.close()
        with pytest.raises(PeerAuthError, match="data-plane keys differ"):
            await stranger.connect(daemon.listener.address, "seed")
    finally:
        daemon.stop()
        await asyncio.wait_for(running, 10)
        await member.close()
        await stranger.close()


async def test_a_static_daemon_relays_in_the_pieces_its_plan_file_asks_for(tiny_package, tmp_path):
    """Issue #16: a static plan carries a long chain's relay piece as a control plane's ASSIGN does."""
    package = tiny_package(layers=2, layer_bytes=100_000, chunk_bytes=64 << 10)
    port, other = free_ports(2)
    plan = make_plan("chain", ["seed"], ["r1"], len(package.manifest.blocks))
    nodes = {"seed": f"127.0.0.1:{port}", "r1": f"127.0.0.1:{other}"}
    (tmp_path / "plan.json").write_text(json.dumps(plan_file_data(plan, package.manifest.package_id, nodes, 65536)))
    daemon = AgentDaemon(AgentOptions(node_id="seed", seed=package.path, plan=tmp_path / "plan.json"),
                         Settings(**SETTINGS, auth_token=MASTER, agent_relay_bytes=256 << 10))
    running = asyncio.create_task(daemon.run())
    try:
        for _ in range(500):
            if daemon.listener is not None and daemon.transport.relay_bytes_for(package.manifest.package_id) == 65536:
                break
            assert not running.done(), running.exception()
            await asyncio.sleep(0.01)
        assert daemon.transport.relay_bytes_for(package.manifest.package_id) == 65536
        assert daemon.transport.relay_bytes_for("another") == 256 << 10
    finally:
        daemon.stop()
        await asyncio.wait_for(running, 10)


async def test_a_static_daemon_refuses_a_guessable_master_token_before_it_listens(tiny_package):
    daemon = AgentDaemon(AgentOptions(node_id="seed", listen="127.0.0.1:0"), Settings(**SETTINGS, auth_token="master"))
    with pytest.raises(CredentialError, match="the master token has 6 characters"):
        await asyncio.wait_for(daemon.run(), 10)
    assert daemon.listener is None


async def test_a_static_daemon_given_a_node_token_says_it_needs_the_master_token(tiny_package):
    token = issue_node_token("master", "seed")
    daemon = AgentDaemon(AgentOptions(node_id="seed", listen="127.0.0.1:0"), Settings(**SETTINGS, auth_token=token))
    with pytest.raises(PlanFileError, match="auth_token holds a node token"):
        await asyncio.wait_for(daemon.run(), 10)


async def test_a_bad_tls_file_is_refused_before_the_seed_is_verified(tiny_package, tmp_path, monkeypatch):
    """Verifying a large seed takes minutes: a TLS file that cannot be used must not wait for it."""
    package = tiny_package(layers=2, layer_bytes=100_000, chunk_bytes=64 << 10)
    def never(*args, **kwargs):
        raise AssertionError("the seed was opened before the TLS files were checked")

    monkeypatch.setattr(BlockStore, "open", never)
    daemon = AgentDaemon(AgentOptions(node_id="seed", listen="127.0.0.1:0", seed=package.path),
                         Settings(**SETTINGS, tls_cert=tmp_path / "node.pem", tls_key=tmp_path / "node.key",
                                  tls_ca=tmp_path / "ca.pem"))
    with pytest.raises(DataPlaneTlsError, match=r"^cannot read the data plane's TLS file .*node\.pem \(tls_cert\)"):
        await asyncio.wait_for(daemon.run(), 10)
    assert daemon.listener is None


async def test_a_stop_while_the_seed_is_verified_ends_the_agent_and_the_verifying_at_once(tiny_package, monkeypatch):
    """Found in review: SIGTERM while a --seed was verified at start (2.8 s/GB) was heeded only once the agent had
    verified the whole seed, listened and said so. A slow verifier stands for a large seed."""
    import time

    import pipecast.agent.store as store_module

    package = tiny_package(layers=3, layer_bytes=200_000, chunk_bytes=64 << 10)
    chunks = sum(len(block.chunk_digests) for block in package.manifest.blocks)
    hashed: list[float] = []
    digest = store_module.digest_bytes

    def slow_digest(data) -> bytes:
        hashed.append(time.monotonic())
        time.sleep(0.2)
        return digest(data)

    monkeypatch.setattr(store_module, "digest_bytes", slow_digest)
    said: list[str] = []
    daemon = AgentDaemon(AgentOptions(node_id="seed", listen="127.0.0.1:0", seed=package.path, announce=said.append),
                         Settings(**SETTINGS))
    running = asyncio.create_task(daemon.run())
    async with asyncio.timeout(5):
        while not hashed:
            await asyncio.sleep(0.01)
    daemon.stop()  # what SIGTERM's handler does
    await asyncio.wait_for(running, 1.0)  # not after the whole seed (chunks x 0.2 s)
    assert daemon.listener is None and said == []
    stopped = time.monotonic()
    await asyncio.sleep(0.5)
    assert len([t for t in hashed if t > stopped]) == 0 and len(hashed) < chunks  # the thread stopped too


@pytest.mark.parametrize("transport, why", [("tcp", ""), ("ucx", r" \(UCX\)")], ids=["tcp", "ucx"])
async def test_a_daemon_whose_port_is_in_use_says_so(transport, why):
    if transport == "ucx":
        pytest.importorskip("ucxx", reason="the ucx extra (ucxx-cu12) is not installed")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        daemon = AgentDaemon(AgentOptions(node_id="seed", listen=f"127.0.0.1:{port}"),
                             Settings(**{**SETTINGS, "agent_transport": transport}))
        with pytest.raises(ListenError, match=rf"^cannot listen on 127\.0\.0\.1:{port}: address already in use{why}$"):
            await asyncio.wait_for(daemon.run(), 10)


def test_an_agent_given_a_token_refuses_the_empty_key_of_a_control_plane_without_auth(caplog):
    """A control plane without auth_token (a misconfigured standby, a spoofed endpoint) answers a registration
    with an empty data-plane key: an agent holding a token keeps authenticating (no key yet: it serves no one)
    rather than open its data plane; one without a token follows the control plane."""
    token = issue_node_token("master", "rx")
    for auth_token, kept in ((token, None), ("", b"")):
        daemon = AgentDaemon(AgentOptions(node_id="rx", listen="127.0.0.1:0", control_plane="127.0.0.1:1"),
                             Settings(**SETTINGS, auth_token=auth_token))
        auth = daemon._peer_auth()
        auth.set_key(b"")
        assert auth.key == kept
    assert "rx holds credentials of its own but was sent an empty data-plane key" in caplog.text


def test_a_memory_reserve_larger_than_the_budget_is_refused_naming_both():
    settings = Settings(**SETTINGS, agent_memory_bytes=1 << 30, agent_reserve_bytes=2 << 30)
    with pytest.raises(MemoryBudgetError, match=r"^the memory reserve \(2\.0 GiB, --reserve / "
                                                r"PIPECAST_AGENT_RESERVE_BYTES\) is larger than the memory budget "
                                                r"\(1\.0 GiB, --memory\)"):
        AgentDaemon(AgentOptions(node_id="rx", listen="127.0.0.1:0"), settings)


def test_a_memory_reserve_larger_than_the_memory_available_is_refused_and_a_budget_above_it_warned_of(
        monkeypatch, caplog):
    """Found in review: in a memory cgroup of 600 MiB, --memory 4GiB --reserve 2GiB said "listening" and was then
    OOM-killed without a word; --reserve 200TiB failed with a raw OSError traceback from mmap."""
    import pipecast.agent.daemon as daemon_module
    from pipecast.agent.host import HostMemory

    cgroup = "/sys/fs/cgroup/pods/memory.max"
    monkeypatch.setattr(daemon_module, "host_memory",
                        lambda: HostMemory(550 << 20, f"{cgroup} less memory.current", 600 << 20, cgroup))
    settings = Settings(**SETTINGS, agent_memory_bytes=4 << 30, agent_reserve_bytes=2 << 30)
    with pytest.raises(MemoryBudgetError, match=r"^the memory reserve \(2\.0 GiB, --reserve / "
                                                r"PIPECAST_AGENT_RESERVE_BYTES\) is larger than the memory this host "
                                                r"has available \(550\.0 MiB, /sys/fs/cgroup/pods/memory\.max less "
                                                r"memory\.current\): populating it would get the agent killed for "
                                                r"want of memory$"):
        AgentDaemon(AgentOptions(node_id="rx", listen="127.0.0.1:0"), settings)
    daemon = AgentDaemon(AgentOptions(node_id="rx", listen="127.0.0.1:0"),
                         Settings(**SETTINGS, agent_memory_bytes=4 << 30, agent_reserve_bytes=500 << 20))
    daemon.reserve.close()
    daemon.events.close()
    assert ("the memory budget (4.0 GiB, --memory / PIPECAST_AGENT_MEMORY_BYTES) is larger than this host's memory "
            "(600.0 MiB, /sys/fs/cgroup/pods/memory.max): packages it admits can get the agent killed for want of "
            "memory") in caplog.text


def held_opens(monkeypatch) -> tuple[threading.Event, threading.Event, threading.Event]:
    """Hold every BlockStore.open (a cached package's blocks re-hashed, at length): set once one begins; lets them go
    on; set once one has ended."""
    opening, go_on, opened = threading.Event(), threading.Event(), threading.Event()
    open_store = BlockStore.open

    def slow_open(*args, **kwargs) -> BlockStore:
        opening.set()
        go_on.wait(10)
        try:
            return open_store(*args, **kwargs)
        finally:
            opened.set()

    monkeypatch.setattr(BlockStore, "open", slow_open)
    return opening, go_on, opened


async def test_a_store_whose_opening_is_cancelled_gives_its_memory_back(tiny_package, tmp_path, monkeypatch):
    """A DROP while a cached package is re-hashed cancels the open, but the worker thread opens the store all the
    same: it must be closed, or its budget would refuse every later assignment."""
    package = tiny_package(layers=2, layer_bytes=100_000, chunk_bytes=64 << 10)
    manifest = package.manifest
    cache = BlockCache(tmp_path / "cache")
    cache.write_manifest(manifest)  # and its files: neither needs a peer, no block is cached
    for entry in manifest.files:
        cache.write_file(manifest.package_id, entry.path, (package.path / entry.path).read_bytes())
    cache.close()  # the folder's lock, for the daemon's cache
    settings = Settings(**{**SETTINGS, "agent_cache_dir": cache.root}, agent_memory_bytes=manifest.total_bytes)
    daemon = AgentDaemon(AgentOptions(node_id="rx", listen="127.0.0.1:0"), settings)
    opening, go_on, opened = held_opens(monkeypatch)
    transport = TcpTransport("rx", settings)
    pool = ChannelPool(transport)
    try:
        assigned = asyncio.create_task(daemon.open_store(manifest.package_id, [], pool))
        assert await asyncio.to_thread(opening.wait, 5)
        assigned.cancel()
        with pytest.raises(asyncio.CancelledError):
            await assigned
        go_on.set()
        assert await asyncio.to_thread(opened.wait, 5)
        async with asyncio.timeout(5):
            while daemon.budget.used_bytes:
                await asyncio.sleep(0.01)
        store = await daemon.open_store(manifest.package_id, [], pool)  # assigned again: it fits
        assert daemon.budget.used_bytes == manifest.total_bytes and store.missing_files() == []
        store.close()
    finally:
        go_on.set()
        await pool.close()
        await transport.close()


async def test_a_package_opening_from_the_disk_cache_is_not_removed_for_room(tiny_package, tmp_path, monkeypatch):
    """Found in review: while a store opened a package from the disk cache (re-hashing every block), a write for
    another package could remove it for room: only packages already held were kept."""
    cached, other = (tiny_package(name=f"pkg{n}", seed=n, layers=2, layer_bytes=100_000, chunk_bytes=64 << 10)
                     for n in range(2))
    manifest = cached.manifest
    cache = BlockCache(tmp_path / "cache")
    cache.write_manifest(manifest)
    for entry in manifest.files:
        cache.write_file(manifest.package_id, entry.path, (cached.path / entry.path).read_bytes())
    for block in range(len(manifest.blocks)):
        cache.write_block(manifest, block, memoryview(block_file_bytes(cached.path, manifest, block)))
    cache.close()  # the folder's lock, for the daemon's cache
    held_bytes = sum(f.stat().st_size for f in cache.package_dir(manifest.package_id).rglob("*") if f.is_file())
    # the other package's manifest fits only once the cached package is removed
    settings = Settings(**{**SETTINGS, "agent_cache_dir": cache.root}, agent_cache_max_bytes=held_bytes + 100)
    daemon = AgentDaemon(AgentOptions(node_id="rx", listen="127.0.0.1:0"), settings)
    opening, go_on, _ = held_opens(monkeypatch)
    transport = TcpTransport("rx", settings)
    pool = ChannelPool(transport)
    try:
        assigned = asyncio.create_task(daemon.open_store(manifest.package_id, [], pool))
        assert await asyncio.to_thread(opening.wait, 5)
        assert not await asyncio.to_thread(daemon.cache.write_manifest, other.manifest)  # skipped: no room
        assert daemon.cache.skipped_writes == 1 and daemon.cache.holds(manifest.package_id)
        go_on.set()
        store = await asyncio.wait_for(assigned, 5)
        assert store.verified_blocks() == list(range(len(manifest.blocks)))  # every block from the cache
        store.close()
    finally:
        go_on.set()
        await pool.close()
        await transport.close()


async def test_a_cancelled_wait_for_cache_writes_leaves_another_packages_wait_and_every_write_alone(
        tiny_package, tmp_path, monkeypatch):
    """A DROP cancels its follower's wait for the package's disk-cache writes: the other package's wait must still
    end in its completion, and no write (the dropped package's included) be cancelled."""
    packages = [tiny_package(name=f"pkg{n}", seed=n, layers=1, layer_bytes=100_000, chunk_bytes=64 << 10)
                for n in range(2)]
    cache = BlockCache(tmp_path / "cache")
    for package in packages:  # the manifests and small files from the cache: no peer needed
        cache.write_manifest(package.manifest)
        for entry in package.manifest.files:
            cache.write_file(package.manifest.package_id, entry.path, (package.path / entry.path).read_bytes())
    cache.close()  # the folder's lock, for the daemon's cache
    settings = Settings(**{**SETTINGS, "agent_cache_dir": cache.root})
    events = tmp_path / "rx.jsonl"
    daemon = AgentDaemon(AgentOptions(node_id="rx", listen="127.0.0.1:0", events=events), settings)
    release = threading.Event()
    write_block = BlockCache.write_block

    def held_write(self, *args) -> bool:
        release.wait(10)
        return write_block(self, *args)

    monkeypatch.setattr(BlockCache, "write_block", held_write)
    transport = TcpTransport("rx", settings)
    pool = ChannelPool(transport)
    stores = []
    try:
        for package in packages:
            store = await daemon.open_store(package.manifest.package_id, [], pool)
            stores.append(store)
            data = block_file_bytes(package.path, package.manifest, 0)
            for chunk in range(store.chunk_count(0)):
                land_chunk(store, data, 0, chunk)  # block 0 verified: its cache write starts, and is held
        dropped, kept = (asyncio.create_task(daemon.package_complete(store)) for store in stores)
        await asyncio.sleep(0.05)  # both wait on the held writes
        dropped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dropped
        release.set()
        await asyncio.wait_for(kept, 5)
        async with asyncio.timeout(5):  # the dropped package's write was not cancelled: it lands too
            while [cache.cached_blocks(p.manifest.package_id) for p in packages] != [[0], [0]]:
                await asyncio.sleep(0.01)
        daemon.events.close()
        assert [e["package"] for e in read_events(events) if e["event"] == "complete"] == \
            [packages[1].manifest.package_id]
    finally:
        release.set()
        for store in stores:
            store.close()
        await pool.close()
        await transport.close()


@pytest.mark.parametrize("under_control", [True, False])
async def test_a_request_waiting_for_an_expected_package_is_refused_once_it_is_dropped(under_control):
    """Found in review: a child's request held for a package this node expected was never refused after a
    DROP: it waited out its I/O timeout, which blamed this node."""
    daemon = AgentDaemon(AgentOptions(node_id="p", listen="127.0.0.1:0",
                                      control_plane="127.0.0.1:1" if under_control else None), Settings(**SETTINGS))
    package_id = "ab" * 32
    daemon.peer_server.expect(package_id)
    waiting = [asyncio.create_task(daemon.peer_server.file_bytes(package_id, "config.json")),
               asyncio.create_task(daemon.peer_server.chunk_count(package_id, 0))]
    await asyncio.sleep(0.05)
    assert not any(task.done() for task in waiting)  # held while it is expected
    await daemon.drop_package(package_id)
    for task in waiting:
        with pytest.raises(UnknownPackageError, match=rf"^package {package_id[:12]} is not held here$"):
            await asyncio.wait_for(task, 1)


async def test_a_dropped_packages_memory_stays_counted_while_an_engine_still_maps_it(tmp_path):
    """Found in review: a drop gave the memory budget back at once while the released serving worker still mapped
    the package's memory (it drains its requests for up to 30 s): a scale-up admitted meanwhile took as much again,
    resident memory well above --memory."""
    from pipecast.agent.local_api import LocalApiServer
    from pipecast.agent.local_client import LocalAgentClient
    from pipecast.agent.transport.base import PeerAuth
    from tests.support.packages import tiny_package

    package = tiny_package(tmp_path / "pkg", layers=2, layer_bytes=100_000, chunk_bytes=64 << 10)
    manifest = package.manifest
    daemon = AgentDaemon(AgentOptions(node_id="p", listen="127.0.0.1:0"), Settings(**SETTINGS))
    daemon._local_api = server = LocalApiServer(daemon.peer_server, status=dict, auth=PeerAuth("p"))
    await server.start(tmp_path / "agent.sock")
    store = receiving_store(manifest)
    budget = store._reservation.budget
    for block in range(len(manifest.blocks)):
        data = block_file_bytes(package.path, manifest, block)
        for chunk in range(store.chunk_count(block)):
            land_chunk(store, data, block, chunk)
    daemon.peer_server.add(store)
    client = await asyncio.to_thread(LocalAgentClient, tmp_path / "agent.sock")
    try:
        view = await asyncio.to_thread(client.wait_block, 0, 5.0, manifest.package_id)  # the engine maps block 0
        await daemon.drop_package(manifest.package_id)
        await asyncio.sleep(0.2)
        assert budget.used_bytes == manifest.total_bytes  # still counted: the engine maps it
        del view
        await asyncio.to_thread(client.close)  # the engine lets go (its model closes, and its client)
        async with asyncio.timeout(5):
            while budget.used_bytes:
                await asyncio.sleep(0.02)
    finally:
        await server.close()
        daemon.events.close()


async def test_auto_falls_back_to_tcp_when_ucx_cannot_start_on_this_node(monkeypatch):
    """Found in review: UCX that imports but cannot start (UCX_TLS=rc on a node without RDMA: no device) failed the
    agent at listen with a traceback, though its transport was auto."""
    pytest.importorskip("ucxx")
    import dataclasses

    from pipecast.agent.transport import registry

    monkeypatch.setitem(registry._REGISTRY, "ucx", dataclasses.replace(registry._REGISTRY["ucx"],
                                                                      preferred=lambda: True))  # as on a GPU node
    monkeypatch.setenv("UCX_TLS", "rc")
    said: list[str] = []
    daemon = AgentDaemon(AgentOptions(node_id="n1", listen="127.0.0.1:0", announce=said.append),
                         Settings(**{**SETTINGS, "agent_transport": "auto"}))
    running = asyncio.create_task(daemon.run())
    try:
        async with asyncio.timeout(30):
            while not said:
                assert not running.done(), running.exception()
                await asyncio.sleep(0.05)
        assert daemon.transport.name == "tcp" and said[0].endswith("(tcp)")
    finally:
        daemon.stop()
        await asyncio.wait_for(running, 10)


async def test_a_completion_logs_the_blocks_verified_here_and_their_time(tiny_package, monkeypatch, caplog):
    """Found in use: a static plan's agent given 2 of 4 blocks logged "2 blocks (0 from the disk cache), 710.4 KiB
    in 0.000 s (-)": the whole package's size, and no time (the package, not complete there, had none)."""
    package = tiny_package(layers=3, layer_bytes=100_000, chunk_bytes=64 << 10)
    manifest = package.manifest
    assert len(manifest.blocks) == 3
    clock = [10.0]
    monkeypatch.setattr("pipecast.agent.store.time", SimpleNamespace(time=lambda: clock[0]))
    store = receiving_store(manifest)
    daemon = AgentDaemon(AgentOptions(node_id="rx", listen="127.0.0.1:0"), Settings(**SETTINGS))
    try:
        for block, at in ((0, 10.0), (1, 12.0)):  # block 2 is another node's part
            clock[0] = at
            data = block_file_bytes(package.path, manifest, block)
            for chunk in range(store.chunk_count(block)):
                land_chunk(store, data, block, chunk)
        with caplog.at_level("INFO", logger="pipecast.agent.daemon"):
            await daemon.package_complete(store)
    finally:
        store.close()
        daemon.events.close()
    size = manifest.blocks[0].bytes + manifest.blocks[1].bytes
    assert f"agent rx: package {manifest.package_id[:12]} complete: 2 blocks (0 from the disk cache), " \
           f"{format_bytes(size)} in 2.000 s ({format_rate(size / 2)})" in caplog.messages
