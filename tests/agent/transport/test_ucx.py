"""The UCX transport (ucxx over TCP and shared memory on loopback): faults, deadlines, shutdown without
hanging, a listener that serves only the address it was given, and a pair of real ``pipecast agent
--transport ucx`` processes. What every transport must do
is in test_transport_conformance.py."""

import asyncio
import gc
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from contextlib import asynccontextmanager
from dataclasses import replace

import psutil
import pytest

pytest.importorskip("ucxx", reason="the ucx extra (ucxx-cu12) is not installed")

from control_plane.planner.schedules import make_plan  # noqa: E402
from pipecast.agent.errors import (  # noqa: E402
    PeerClosedError,
    PeerError,
    PeerConnectError,
    PeerProtocolError,
    PeerRefusedError,
    PeerTimeoutError,
    TransportUnavailableError,
)
from pipecast.agent.peer_server import PeerServer  # noqa: E402
from pipecast.agent.plan_file import plan_file_data  # noqa: E402
from pipecast.agent.transport import registry, ucx  # noqa: E402
from pipecast.agent.transport.registry import resolve_transport_name  # noqa: E402
from pipecast.agent.transport.ucx import (  # noqa: E402
    TAG_HEADER,
    TAG_PAYLOAD,
    UcxTransport,
    _tls_allows_tcp,
)
from pipecast.agent.transport.wire import CHUNK as CHUNK_MESSAGE, FILE, UCX_HEADER, Header  # noqa: E402
from pipecast.core.settings import Settings  # noqa: E402
from tests.support import REPO  # noqa: E402
from tests.support.agent_fixtures import (  # noqa: E402
    block_file_bytes,
    connected,
    land_chunk,
    receiving,
    receiving_store,
    seed_store,
    serving_store,
)
from tests.support.agent_processes import assert_identical_copy, free_ports, write_plan  # noqa: E402
from tests.agent.conftest import CHUNK  # noqa: E402

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

IO_TIMEOUT_S = 0.3
NOTIFIER_THREAD = "UCX-Py Async Notifier Thread"  # ucxx's name for the thread that must stop at exit


def settings(**overrides) -> Settings:
    values = {"io_timeout_s": IO_TIMEOUT_S, "connect_timeout_s": 2.0, "egress_mbit": 0, "ingress_mbit": 0}
    return Settings(**{**values, **overrides})


@pytest.fixture
async def transports():
    """Make UCX transports; every one is closed at the end, and ucxx's threads must be gone then."""
    made: list[UcxTransport] = []

    def make(node: str, **overrides) -> UcxTransport:
        made.append(UcxTransport(node, settings(**overrides)))
        return made[-1]

    yield make
    for transport in made:
        await transport.close()
    assert NOTIFIER_THREAD not in {t.name for t in threading.enumerate()}




def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_parent_going_away_mid_block_is_a_closed_error_naming_it_at_once(package, transports):
    root, manifest = package
    data = block_file_bytes(root, manifest, 0)
    relay = receiving_store(manifest)
    # A long silence deadline: the error must come from the broken connection, not from a timeout.
    async with (serving_store(transports("relay"), relay) as listener, receiving(manifest) as child,
                connected(transports("child", io_timeout_s=10), listener.address, "relay") as channel):
        fetch = asyncio.create_task(channel.fetch_block(manifest.package_id, 0, 0, child))
        land_chunk(relay, data, 0, 0)
        await asyncio.wait_for(child.wait_chunk(0, 0), 2)
        started = time.monotonic()
        await listener.close()  # every connection of the relay is dropped
        with pytest.raises(PeerClosedError) as caught:
            await asyncio.wait_for(fetch, 5)
        assert time.monotonic() - started < 1.0
        assert str(caught.value).startswith(f"peer relay: closed the connection while sending block 0 (chunk 1 "
                                            f"of {child.chunk_count(0)}) (")
        assert child.is_chunk_present(0, 0) and child.first_missing_chunk(0) == 1


async def test_silent_peer_raises_a_timeout_naming_it_within_the_deadline(package, transports, monkeypatch):
    _, manifest = package

    async def stuck(*args, **kwargs):  # a serving side that answers nothing, not even a WAIT
        await asyncio.sleep(30)

    monkeypatch.setattr(ucx, "answer_request", stuck)
    listener = await transports("mute").listen("127.0.0.1", 0, PeerServer())
    async with receiving(manifest) as store, connected(transports("rx"), listener.address, "mute") as channel:
        started = time.monotonic()
        with pytest.raises(PeerTimeoutError) as caught:
            await asyncio.wait_for(channel.fetch_block(manifest.package_id, 0, 0, store), 5)
        assert time.monotonic() - started < IO_TIMEOUT_S + 1.0
        assert str(caught.value) == (f"peer mute: silent for {IO_TIMEOUT_S:g} s while sending block 0 "
                                     f"(chunk 0 of {store.chunk_count(0)})")


async def test_refused_connection_is_a_connect_error_long_before_the_deadline(transports):
    address = f"127.0.0.1:{closed_port()}"
    client = transports("rx", connect_timeout_s=5.0)
    started = time.monotonic()
    with pytest.raises(PeerConnectError, match=rf"^peer gone: cannot connect to {address} \(.+\)$"):
        await client.connect(address, "gone")
    # ucxx's own connect would wait out its 5 s peer-info exchange here.
    assert time.monotonic() - started < 1.0


async def test_unknown_package_and_file_are_refused_naming_the_peer(package, transports):
    root, manifest = package
    async with serving_store(transports("seed"), seed_store(root)) as listener, receiving(manifest) as store:
        client = transports("rx")
        # As with TCP, a refusal ends its channel; the fetcher opens another for the next request.
        channel = await client.connect(listener.address, "seed")
        with pytest.raises(PeerRefusedError, match=r"^peer seed: package 000000000000 is not held here$"):
            await channel.fetch_block("0" * 64, 0, 0, store)
        channel = await client.connect(listener.address, "seed")
        with pytest.raises(PeerRefusedError, match=r"^peer seed: package \w{12} has no file 'weights.bin'$"):
            await channel.fetch_file(manifest.package_id, "weights.bin")
        channel = await client.connect(listener.address, "seed")
        await channel.fetch_block(manifest.package_id, 0, 0, store)
        assert bytes(store.block_view(0)) == block_file_bytes(root, manifest, 0)


# A plain cap each way, and a low-priority package's share (a quarter of a 16 Mbit/s link) each way.
@pytest.mark.parametrize("side", ["egress_mbit", "ingress_mbit", "low-sender", "low-receiver"])
async def test_rate_limit_paces_the_transfer(package, transports, side):
    root, manifest = package
    mbit = 4.0
    limited = {side: mbit} if side.endswith("_mbit") else {"agent_link_mbit": 16.0, "priority_shares": {"low": 0.25}}
    sender, receiver = side in ("egress_mbit", "low-sender"), side in ("ingress_mbit", "low-receiver")
    serving = transports("seed", **(limited if sender else {}))
    client = transports("rx", io_timeout_s=5, **(limited if receiver else {}))
    for transport in (serving, client):
        transport.limits.set_priority(manifest.package_id, "low")
    async with (serving_store(serving, seed_store(root)) as listener, receiving(manifest) as store,
                connected(client, listener.address, "seed") as channel):
        started = time.monotonic()
        for block in range(len(manifest.blocks)):
            await channel.fetch_block(manifest.package_id, block, 0, store)
        elapsed = time.monotonic() - started
        # Lower bound only: the bucket may start full (its 256 KiB burst), the rest must wait for tokens.
        assert elapsed >= (manifest.total_bytes - (256 << 10)) / (mbit * 1e6 / 8) * 0.9
        assert bytes(store.block_view(2)) == block_file_bytes(root, manifest, 2)


@pytest.mark.parametrize(("tls", "listens"), [("tcp,sm,self", True), ("all", True), ("^ib", True),
                                               ("sm,self", False), ("^tcp,ib", False)])
def test_ucx_tls_without_tcp_is_recognised(tls, listens):
    assert _tls_allows_tcp(tls) is listens


def test_transport_selection_keeps_ucx_for_accelerated_nodes(monkeypatch):
    assert resolve_transport_name("ucx") == "ucx"
    entry = registry._REGISTRY["ucx"]
    monkeypatch.setitem(registry._REGISTRY, "ucx", replace(entry, preferred=lambda: False))
    assert resolve_transport_name("auto") == "tcp"
    monkeypatch.setitem(registry._REGISTRY, "ucx", replace(entry, preferred=lambda: True))
    assert resolve_transport_name("auto") == "ucx"


def test_auto_leaves_an_installed_ucx_that_does_not_import_for_tcp(monkeypatch, tmp_path, caplog):
    """Found in review: auto took UCX when ucxx was installed (found) but its libucx did not load, and the agent
    then failed at listen instead of running on TCP."""
    (tmp_path / "broken_ucxx.py").write_text('raise OSError("libucp.so.0: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.setitem(registry._REGISTRY, "ucx", replace(registry._REGISTRY["ucx"], requires=("broken_ucxx",),
                                                           preferred=lambda: True))  # as on a GPU node
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        assert resolve_transport_name("auto") == "tcp"
    assert caplog.messages == ["ucx unusable (broken_ucxx: libucp.so.0: cannot open shared object file); using tcp"]



def test_ucx_named_whose_library_does_not_load_is_refused_by_name(monkeypatch, tmp_path):
    """Found in review: `--transport ucx` with ucxx installed but its libucx failing to load ended the agent in
    an OSError traceback at listen, not the typed error a missing ucxx gets."""
    (tmp_path / "broken_ucxx.py").write_text('raise OSError("libucp.so.0: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.setitem(registry._REGISTRY, "ucx", replace(registry._REGISTRY["ucx"], requires=("broken_ucxx",)))
    with pytest.raises(TransportUnavailableError) as refused:
        resolve_transport_name("ucx")
    assert str(refused.value) == ("transport 'ucx' cannot be used on this node: broken_ucxx: libucp.so.0: cannot "
                                  "open shared object file")

FORGETFUL = """
import asyncio
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.transport.ucx import UcxTransport
from pipecast.core.settings import Settings

async def main():
    transport = UcxTransport("forgetful", Settings(connect_timeout_s=2.0))
    listener = await transport.listen("127.0.0.1", 0, PeerServer())
    await transport.connect(listener.address, "self")

asyncio.run(main())  # never closes the transport: ucxx's notifier thread is still running at exit
"""


def test_a_process_that_never_closes_its_transport_still_exits():
    done = subprocess.run([sys.executable, "-c", FORGETFUL], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "a UCX transport was not closed; stopping ucxx at exit" in done.stderr


def test_agent_processes_copy_a_package_over_ucx_and_exit_cleanly(agents, package, tmp_path):
    root, manifest = package
    nodes = dict(zip(["seed", "r1"], (f"127.0.0.1:{port}" for port in free_ports(2))))
    plan = write_plan(tmp_path / "plan.json", plan_file_data(
        make_plan("chain", ["seed"], ["r1"], len(manifest.blocks)), manifest.package_id, nodes))
    seed = agents.start("seed", "--seed", root, "--plan", plan, "--transport", "ucx")
    assert agents.wait("seed", "listening")["transport"] == "ucx"
    rx = agents.start("r1", "--plan", plan, "--cache-dir", tmp_path / "cache-r1", "--transport", "ucx",
                      "--exit-when-complete")
    agents.wait("r1", "stopped")
    assert rx.wait(10) == 0, agents.log("r1")
    assert agents.wait("r1", "listening")["transport"] == "ucx"
    assert agents.events("r1", "peer_failed") == []
    assert_identical_copy(agents, "r1", root, manifest)
    seed.terminate()
    assert seed.wait(10) == 0, agents.log("seed")
    assert agents.events("seed")[-1]["event"] == "stopped"
    for node in ("seed", "r1"):  # the agent's shutdown closed its transport, not the exit safety hook
        assert "a UCX transport was not closed" not in agents.log(node)


def test_killed_parent_agent_is_a_typed_error_on_its_child_at_once(agents, package, tmp_path):
    root, manifest = package
    nodes = dict(zip(["seed", "r1"], (f"127.0.0.1:{port}" for port in free_ports(2))))
    plan = write_plan(tmp_path / "plan.json", plan_file_data(
        make_plan("chain", ["seed"], ["r1"], len(manifest.blocks)), manifest.package_id, nodes))
    # 4 Mbit/s: the 0.6 MB package takes over a second, so the seed dies mid-transfer.
    seed = agents.start("seed", "--seed", root, "--plan", plan, "--transport", "ucx",
                        env={"PIPECAST_EGRESS_MBIT": "4"})
    agents.wait("seed", "listening")
    rx = agents.start("r1", "--plan", plan, "--transport", "ucx")
    agents.wait("r1", "block_started")
    seed.send_signal(signal.SIGKILL)
    killed_at = time.time()
    failure = agents.wait("r1", "peer_failed")
    assert failure["t"] - killed_at < 2.0  # far below the agents' 10 s silence deadline
    assert failure["error"] == "PeerClosedError"
    assert failure["message"].startswith(f"peer seed@{nodes['seed']}: closed the connection while sending block ")
    # With no other source the child gives up (refused reconnects are told at once) and exits.
    assert rx.wait(15) != 0
    assert agents.events("r1", "failed")[0]["error"] == "FetchFailedError"
    reconnects = {e["error"] for e in agents.events("r1", "peer_failed")[1:]}
    assert reconnects <= {"PeerConnectError", "PeerConnectTimeoutError"}


def other_local_ipv4() -> str | None:
    """An IPv4 address of this host that is not loopback (None if it has none)."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


async def test_a_listener_on_127_0_0_1_serves_nobody_who_comes_in_on_another_address(package, transports):
    other = other_local_ipv4()
    if other is None:
        pytest.skip("this host has no non-loopback IPv4 address to come in on")
    root, manifest = package
    server = PeerServer()
    async with serving_store(transports("seed"), seed_store(root), server) as listener:
        port = listener.address.rpartition(":")[2]
        with pytest.raises(PeerError):  # UCX's listener takes the connection; the agent closes it unread
            channel = await transports("outsider").connect(f"{other}:{port}", "seed")
            await channel.fetch_file(manifest.package_id, "config.json")
        assert server.requesters == {}
        async with connected(transports("rx"), listener.address, "seed") as channel:
            assert await channel.fetch_file(manifest.package_id, "config.json") == (root / "config.json").read_bytes()


async def test_channels_and_connections_served_and_closed_are_freed(package, transports):
    """Found in review: ucxx keeps an endpoint's close callback natively, beside the endpoint itself; a callback
    holding its channel or served connection kept both, and their endpoint, alive for good."""
    root, manifest = package
    async with serving_store(transports("seed"), seed_store(root)) as listener:
        client = transports("rx")
        kept = []
        for _ in range(3):
            channel = await client.connect(listener.address, "seed")
            assert await channel.fetch_file(manifest.package_id, "config.json") == (root / "config.json").read_bytes()
            kept += [weakref.ref(channel), *map(weakref.ref, listener.connections)]
            await channel.close()
            while listener.open_connections:  # the server's side ends after the goodbye
                await asyncio.sleep(0.01)
        del channel
        gc.collect()
        assert len(kept) == 6 and [ref() for ref in kept] == [None] * 6


async def test_a_listener_closed_after_serving_lets_its_port_be_listened_on_again(package, transports):
    """Found in review: the served endpoints leaked (above) kept ucxx's listener listening after it was closed:
    new connections hung, and listening on the port again failed."""
    root, manifest = package
    seed = seed_store(root)
    server = PeerServer()
    server.add(seed)
    serving, client = transports("seed"), transports("rx")
    port = 0
    try:
        for _ in range(2):  # on a free port, then on the same one again
            listener = await serving.listen("127.0.0.1", port, server)
            port = int(listener.address.rpartition(":")[2])
            channel = await client.connect(listener.address, "seed")
            assert await channel.fetch_file(manifest.package_id, "config.json") == (root / "config.json").read_bytes()
            await channel.close()
            await listener.close()
    finally:
        seed.close()


async def test_a_closed_transport_leaves_no_ucx_thread_behind(transports):
    """Found with the leak above fixed: ucxx's progress thread outlived its transport (one more thread per
    transport closed), stopped, if ever, by whichever thread collected its event loop, which could hang."""
    threads = []
    for node in ("first", "second", "third"):  # the first may start UCX's own thread, kept for the process
        transport = transports(node)
        await transport.listen("127.0.0.1", 0, PeerServer())
        await transport.close()
        threads.append(await settled_thread_count())
    assert threads[1] == threads[2]


async def settled_thread_count(within_s: float = 2.0) -> int:
    """This process's threads once the count holds for 0.1 s (a closed transport's threads end on their own time:
    on a busy machine one still ran when counted, and the next count was one lower), or after ``within_s``."""
    count, deadline = psutil.Process().num_threads(), time.monotonic() + within_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        count, before = psutil.Process().num_threads(), count
        if count == before:
            break
    return count


@asynccontextmanager
async def raw_ucx_server(transport: UcxTransport, answer):
    """A bare ucxx listener on ``transport``'s context; yields its address. It reads each requester's request
    (no hello), then calls ``answer(endpoint)`` and keeps the endpoint open until the end."""
    done = asyncio.Event()

    async def handler(endpoint) -> None:
        raw = bytearray(UCX_HEADER.size)
        await endpoint.recv(raw, tag=TAG_HEADER)
        await endpoint.recv(bytearray(UCX_HEADER.parse(raw, "rx").length), tag=TAG_PAYLOAD)
        await answer(endpoint)
        await done.wait()

    listener = transport._runtime().create_listener(handler, port=0)
    try:
        yield f"127.0.0.1:{listener.port}"
    finally:
        done.set()
        listener.close()
        while listener.active_clients:
            await asyncio.sleep(0.01)


@pytest.mark.parametrize(("kind", "announced", "sent"), [(FILE, 1000, 10), (CHUNK_MESSAGE, CHUNK, CHUNK // 2)],
                         ids=["file", "chunk"])
async def test_a_payload_shorter_than_its_header_announced_is_a_protocol_error(package, transports, kind, announced,
                                                                               sent):
    """Found in review: a tag receive completes on a shorter message too, so a short file answer came back padded
    with zeros and a short chunk was verified on stale bytes (its sender blamed for a corrupt chunk, not for
    breaking the protocol)."""
    _, manifest = package

    async def short(endpoint) -> None:
        await endpoint.send(UCX_HEADER.pack(Header(kind, 0, 0, announced)), tag=TAG_HEADER)
        await endpoint.send(bytearray(b"x" * sent), tag=TAG_PAYLOAD)

    client = transports("rx", io_timeout_s=5)
    store = receiving_store(manifest)
    try:
        async with raw_ucx_server(client, short) as address:
            channel = await client.connect(address, "liar")
            fetch = (channel.fetch_file(manifest.package_id, "config.json") if kind == FILE
                     else channel.fetch_block(manifest.package_id, 0, 0, store, 1))
            with pytest.raises(PeerProtocolError, match=rf"^peer liar: sent a message of {sent} bytes where "
                                                        rf"{announced} were announced$"):
                await asyncio.wait_for(fetch, 5)
            await channel.close()
        assert not store.is_chunk_present(0, 0)
    finally:
        store.close()


@pytest.mark.parametrize("closer", ["channel", "transport"])
async def test_a_fetch_closed_here_mid_chunk_is_a_peer_closed_error(package, transports, closer):
    """Found in review: closing the channel or the transport while a chunk's payload was awaited raised ucxx's
    AttributeError (its endpoint torn down) out of the fetch, where TCP raises PeerClosedError."""
    _, manifest = package

    async def header_only(endpoint) -> None:
        await endpoint.send(UCX_HEADER.pack(Header(CHUNK_MESSAGE, 0, 0, CHUNK)), tag=TAG_HEADER)

    client = transports("rx", io_timeout_s=5)
    store = receiving_store(manifest)
    try:
        async with raw_ucx_server(client, header_only) as address:
            channel = await client.connect(address, "slow")
            fetch = asyncio.create_task(channel.fetch_block(manifest.package_id, 0, 0, store, 1))
            await asyncio.sleep(0.3)
            await (channel.close() if closer == "channel" else client.close())
            with pytest.raises(PeerClosedError, match="^peer slow: "):
                await asyncio.wait_for(fetch, 5)
        assert not store.is_chunk_present(0, 0)
    finally:
        store.close()
