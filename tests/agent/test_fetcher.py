"""The fetcher against peers that answer badly: a hostile or forged manifest names its sender and the
manifest comes from the next peer (never cached, never served), and any exception a peer's answer
provokes, whatever its type, moves a fetch on to its next peer instead of ending it."""

import asyncio
import json
import socket

import pytest

from control_plane.messages import PeerInfo
from control_plane.planner.plan import Fetch
from packager.manifest import MANIFEST_FILE, manifest_to_json, seal_manifest
from pipecast.agent.daemon import AgentDaemon, AgentOptions
from pipecast.agent.errors import (
    CorruptFileError,
    FetchFailedError,
    PeerConnectError,
    PeerConnectTimeoutError,
    PeerNotListeningError,
    PeerProtocolError,
    PeerRefusedError,
    PeerTimeoutError,
    UnknownPackageError,
)
from pipecast.agent.fetcher import ChannelPool, Fetcher, FetchPolicy, fetch_files, fetch_manifest
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.transport.base import Channel, Transport
from pipecast.agent.transport.tcp import TcpTransport
from pipecast.core.settings import Settings
from pipecast.v1.manifest_pb2 import Manifest
from tests.support.agent_fixtures import WholeChunkServer, block_file_bytes, land_chunk, receiving_store, seed_store

pytestmark = pytest.mark.timeout(60)

TOKENIZER_BYTES = 1_000  # the package fixture (conftest) gives it a tokenizer file this big
SETTINGS = dict(agent_transport="tcp", agent_cache_dir=None, agent_local_socket=None, connect_timeout_s=1.0,
                io_timeout_s=5.0, egress_mbit=0, ingress_mbit=0)
NESTED = b"[" * 100_000  # finding 3: an agent died of RecursionError on this and never tried its other sources


class ManifestForger(PeerServer):
    """A peer that answers ``manifest.json`` with ``answer`` and refuses everything else."""

    def __init__(self, answer: bytes) -> None:
        super().__init__()
        self.answer = answer

    async def file_bytes(self, package_id: str, path: str, offset: int = 0, length: int = 0) -> bytes:
        if path == MANIFEST_FILE:
            return self.answer
        raise UnknownPackageError(f"package {package_id[:12]} is not held here")

    async def chunk_count(self, package_id: str, block: int) -> int:
        raise UnknownPackageError(f"package {package_id[:12]} is not held here")


class Peers:
    """TCP peers on loopback, each serving a :class:`PeerServer`; closed by the fixture."""

    def __init__(self) -> None:
        self.transport = TcpTransport("peers", Settings(**SETTINGS))
        self.listeners = []

    async def start(self, name: str, served: PeerServer, port: int = 0) -> PeerInfo:
        listener = await self.transport.listen("127.0.0.1", port, served)
        self.listeners.append(listener)
        return PeerInfo(name, listener.address)

    async def close(self) -> None:
        for listener in self.listeners:
            await listener.close()
        await self.transport.close()


@pytest.fixture
async def peers():
    running = Peers()
    yield running
    await running.close()


@pytest.fixture
async def honest(package, peers):
    """An honest peer serving the package (a seed)."""
    store = seed_store(package[0])
    served = PeerServer()
    served.add(store)
    yield await peers.start("honest", served)
    store.close()


@pytest.fixture
async def pool():
    transport = TcpTransport("rx", Settings(**SETTINGS))
    channels = ChannelPool(transport)
    yield channels
    await channels.close()
    await transport.close()


def _forged(manifest: Manifest, edit) -> bytes:
    """``manifest`` with ``edit`` applied to its JSON, its package id left as it was."""
    doc = json.loads(manifest_to_json(manifest))
    edit(doc)
    return json.dumps(doc).encode()


def _another_package(manifest: Manifest) -> bytes:
    other = Manifest()
    other.CopyFrom(manifest)
    other.model_name += "-other"
    return manifest_to_json(seal_manifest(other)).encode()


def _version_1(manifest: Manifest) -> bytes:
    old = Manifest()
    old.CopyFrom(manifest)
    old.format_version = 1
    return manifest_to_json(old).encode()


HOSTILE = {
    "nested 100000 deep": (lambda m: NESTED, "nested too deeply"),
    "a number out of range": (lambda m: b'{"format_version": 1e400}', "out of range"),
    "duplicate keys": (lambda m: manifest_to_json(m).encode().replace(b"{", b'{"model_name": "x",', 1),
                       "duplicate key 'model_name'"),
    "an array": (lambda m: b"[]", "expected a JSON object"),
    "garbage": (lambda m: bytes(range(256)) * 64, "not UTF-8"),
    "a block renamed": (lambda m: _forged(m, lambda d: d["blocks"][0].__setitem__("file", "blocks/x.safetensors")),
                        "is not the digest of the manifest"),
    "tensor names swapped": (lambda m: _forged(m, lambda d: d["blocks"].__setitem__(slice(0, 2), [
        {**d["blocks"][0], "tensor_names": d["blocks"][1]["tensor_names"]},
        {**d["blocks"][1], "tensor_names": d["blocks"][0]["tensor_names"]}])), "is not the digest of the manifest"),
    "another package's manifest": (_another_package, "sent the manifest of package"),
    "a format_version 1 manifest": (_version_1, "format_version 1 packages"),
}


@pytest.mark.parametrize("answer", HOSTILE.values(), ids=HOSTILE.keys())
async def test_a_bad_manifest_names_its_sender_and_comes_from_the_next_peer(package, peers, honest, pool, answer):
    _, manifest = package
    make, problem = answer
    forger = await peers.start("forger", ManifestForger(make(manifest)))
    failures = []
    got, peer = await fetch_manifest(pool, manifest.package_id, [forger, honest],
                                     lambda what, p, e: failures.append((what, p, e)))
    assert (got, peer) == (manifest, honest)
    [(what, blamed, error)] = failures
    assert (what, blamed, type(error)) == (MANIFEST_FILE, forger, CorruptFileError)
    assert str(error).startswith(f"peer {forger}: sent ")
    assert problem in str(error)


async def test_with_only_forgers_the_manifest_fetch_fails_naming_every_one(package, peers, pool):
    _, manifest = package
    forgers = [await peers.start(f"forger{i}", ManifestForger(answer))
               for i, answer in enumerate([NESTED, _another_package(manifest)])]
    with pytest.raises(FetchFailedError) as failed:
        await fetch_manifest(pool, manifest.package_id, forgers)
    assert [(peer, type(e)) for peer, e in failed.value.attempts] == [(str(p), CorruptFileError) for p in forgers]


async def test_a_forged_manifest_never_reaches_the_store_the_cache_or_children(package, peers, honest, tmp_path):
    """The daemon's open_store path: the forger is asked first; what lands and is served is the honest
    manifest, byte for byte as the packager wrote it."""
    root, manifest = package
    forger = await peers.start("forger", ManifestForger(NESTED))
    cache = tmp_path / "cache"
    daemon = AgentDaemon(AgentOptions(node_id="rx", listen="127.0.0.1:0"),
                         Settings(**{**SETTINGS, "agent_cache_dir": cache}))
    daemon.transport = TcpTransport("rx", Settings(**SETTINGS))
    pool = ChannelPool(daemon.transport)
    try:
        store = await daemon.open_store(manifest.package_id, [forger, honest], pool)
        assert store.manifest == manifest and store.manifest_origin == f"peer {honest}"
        assert (cache / manifest.package_id / MANIFEST_FILE).read_bytes() == (root / MANIFEST_FILE).read_bytes()
        served = await daemon.peer_server.file_bytes(manifest.package_id, MANIFEST_FILE)
        assert served == (root / MANIFEST_FILE).read_bytes()
        store.close()

        # Only the forger: nothing is held, cached or served.
        other = Manifest()
        other.CopyFrom(manifest)
        other.model_name = "never-packed"
        wanted = seal_manifest(other).package_id
        with pytest.raises(FetchFailedError):
            await daemon.open_store(wanted, [forger], pool)
        assert wanted not in daemon.peer_server.stores
        assert not (cache / wanted).exists()
    finally:
        await pool.close()
        await daemon.transport.close()


# -- any exception from a peer's answer moves on to the next peer -----------------------------------------


class StubChannel(Channel):
    """A channel whose answers are scripted per peer: an exception to raise, or the real peer's answer."""

    def __init__(self, peer: str, fail: BaseException | None, real: Channel | None) -> None:
        self.peer, self._fail, self._real = peer, fail, real

    async def fetch_block(self, package_id, block, first_chunk, sink, end_chunk=None) -> None:
        if self._fail is not None:
            raise self._fail
        await self._real.fetch_block(package_id, block, first_chunk, sink, end_chunk)

    async def fetch_file(self, package_id, path, offset=0, length=0) -> bytes:
        if self._fail is not None:
            raise self._fail
        return await self._real.fetch_file(package_id, path, offset, length)

    async def close(self) -> None:
        if self._real is not None:
            await self._real.close()


class StubTransport(Transport):
    """Connects peers named in ``failures`` to a channel raising that exception, others over TCP."""

    name = "stub"

    def __init__(self, failures: dict[str, BaseException]) -> None:
        super().__init__("rx", Settings(**SETTINGS))
        self.failures = failures
        self.tcp = TcpTransport("rx", Settings(**SETTINGS))

    async def listen(self, host, port, served):
        raise NotImplementedError

    async def connect(self, address: str, peer: str) -> Channel:
        name = peer.partition("@")[0]
        if name in self.failures:
            return StubChannel(peer, self.failures[name], None)
        return StubChannel(peer, None, await self.tcp.connect(address, peer))


UNEXPECTED = [RecursionError("maximum recursion depth exceeded"), MemoryError(), ValueError("bad length"),
              KeyError("x"), RuntimeError("a transport bug")]


@pytest.mark.parametrize("exc", UNEXPECTED, ids=lambda e: type(e).__name__)
async def test_any_exception_from_a_peer_is_that_peers_failure_and_the_next_peer_is_asked(package, honest, exc):
    root, manifest = package
    odd = PeerInfo("odd", "127.0.0.1:9")
    transport = StubTransport({"odd": exc})
    pool = ChannelPool(transport)
    failures = []

    def failed(what, peer, error):
        failures.append((what, peer.node_id, type(error)))

    store = None
    try:
        got, _ = await fetch_manifest(pool, manifest.package_id, [odd, honest], failed)
        assert got == manifest
        store = receiving_store(manifest)
        await fetch_files(pool, store, [odd, honest], failed)
        assert store.missing_files() == []
        fetcher = Fetcher(store, pool, FetchPolicy(retries=1, backoff_s=0.01, fallbacks=(honest,)), failed)
        await fetcher.fetch([Fetch(b.index, odd) for b in manifest.blocks])
        for b in manifest.blocks:
            assert bytes(store.block_view(b.index)) == block_file_bytes(root, manifest, b.index)
    finally:
        if store is not None:
            store.close()
        await pool.close()
        await transport.tcp.close()
    files = [f.path for f in manifest.files]
    # Each is the odd peer's failure, a PeerProtocolError naming it; the odd peer is tried twice for the
    # first block (retries=1), then given up on: later blocks go straight to the fallback.
    assert failures == [(MANIFEST_FILE, "odd", PeerProtocolError), *((f, "odd", PeerProtocolError) for f in files),
                        ("block 0", "odd", PeerProtocolError), ("block 0", "odd", PeerProtocolError)]


HUNG_ERRORS = [PeerTimeoutError("hung@127.0.0.1:9", "silent for 1 s"),
               PeerConnectTimeoutError("hung@127.0.0.1:9", "no connection to 127.0.0.1:9 within 1 s")]


@pytest.mark.parametrize("shared", [False, True], ids=["apart", "shared"])
@pytest.mark.parametrize("error", HUNG_ERRORS, ids=lambda e: type(e).__name__)
async def test_a_silent_peer_is_asked_once_then_last_for_the_files_after(package, honest, shared, error):
    """Found by a flaky cluster test: a relay asking its hung parent for config.json asked it again after each
    I/O timeout, so its own child, waiting on the relay for the file, gave up on the relay and blamed it. Found
    in review of that fix: the hung peer then cost a timeout for each file still; it is asked last after its
    first (the manifest's, where the caller shares what it learnt). Found by the same cluster test later: a
    stopped parent, whose host takes the connection but never answers the hello, cost the connect timeout three
    times (the retries) for the manifest and again for each file, 30 s in all."""
    root, manifest = package
    hung = PeerInfo("hung", "127.0.0.1:9")
    transport = StubTransport({"hung": error})
    pool = ChannelPool(transport)
    failures = []

    def record(what, peer, error):
        failures.append((what, peer.node_id, type(error)))

    store = None
    try:
        policy = FetchPolicy(retries=2, backoff_s=0.01)
        silent = set()
        got, _ = await fetch_manifest(pool, manifest.package_id, [hung, honest], record, policy, silent)
        assert got == manifest and silent == {hung}
        store = receiving_store(manifest)
        await fetch_files(pool, store, [hung, honest], record, policy, silent if shared else None)
        assert store.missing_files() == []
    finally:
        if store is not None:
            store.close()
        await pool.close()
        await transport.tcp.close()
    tries = 3 if isinstance(error, PeerConnectError) else 1  # a failed connection is tried again (retries=2)
    first_file = [] if shared else [(manifest.files[0].path, "hung", type(error))] * tries
    assert len(manifest.files) >= 2 and failures == [(MANIFEST_FILE, "hung", type(error))] * tries + first_file


async def test_this_nodes_own_failure_ends_a_fetch_without_blaming_the_peer(package, honest, pool):
    _, manifest = package
    store = receiving_store(manifest)
    store.close()  # dropped meanwhile: the store knows no block any more
    failures = []
    with pytest.raises(UnknownPackageError):
        await Fetcher(store, pool, on_peer_failure=lambda *a: failures.append(a)).fetch([Fetch(0, honest)])
    assert failures == []


async def test_a_refusing_peer_is_not_blamed_for_corruption(package, peers, honest, pool):
    """The forger refuses the small files: that is a PeerRefusedError, not a corrupt copy."""
    _, manifest = package
    forger = await peers.start("forger", ManifestForger(NESTED))
    store = receiving_store(manifest)
    failures = []
    try:
        await fetch_files(pool, store, [forger, honest], lambda what, p, e: failures.append((what, type(e))))
    finally:
        store.close()
    assert failures == [(f.path, PeerRefusedError) for f in manifest.files]


def _free_port() -> int:
    """A loopback port nothing listens on, in the range these tests may use."""
    for port in range(42900, 43000):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 42900-42999")


@pytest.mark.parametrize("fetched", ["manifest", "files"])
async def test_a_peer_not_listening_yet_is_tried_again_as_a_parent_is(package, peers, pool, fetched):
    """A static plan's agents start together: the seed may listen a moment after a receiver asks it for the
    manifest (or a relay for the small files). Its refused connections are retried with the blocks' policy
    (each reported), instead of failing the agent at once."""
    root, manifest = package
    seed = seed_store(root)
    served = PeerServer()
    served.add(seed)
    port = _free_port()
    late = PeerInfo("seed", f"127.0.0.1:{port}")
    store = receiving_store(manifest)
    failures = []

    async def listen_later() -> None:
        await asyncio.sleep(0.3)
        await peers.start("seed", served, port)

    starting = asyncio.create_task(listen_later())
    try:
        if fetched == "manifest":
            assert await fetch_manifest(pool, manifest.package_id, [late],
                                        lambda what, p, e: failures.append((what, type(e)))) == (manifest, late)
        else:
            await fetch_files(pool, store, [late], lambda what, p, e: failures.append((what, type(e))))
            assert store.missing_files() == []
        await starting
    finally:
        starting.cancel()
        store.close()
        seed.close()
    first = MANIFEST_FILE if fetched == "manifest" else manifest.files[0].path
    assert failures and set(failures) == {(first, PeerNotListeningError)}


# -- chunk ranges (issue #16) ------------------------------------------------------------------------------


class ChunkLog(WholeChunkServer):
    """Serves its stores and records every chunk it was asked for as (block, chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[int, int]] = []

    async def wait_chunk(self, package_id: str, block: int, chunk: int) -> memoryview:
        self.asked.append((block, chunk))
        return await super().wait_chunk(package_id, block, chunk)


async def test_ranges_from_two_parents_make_each_block_verified_once_as_a_whole_block_fetch_does(package, peers,
                                                                                                 pool, caplog):
    root, manifest = package
    seed = seed_store(root)
    servers = {"a": ChunkLog(), "b": ChunkLog()}
    parents = {}
    for name, server in servers.items():
        server.add(seed)
        parents[name] = await peers.start(name, server)
    store = receiving_store(manifest)
    events = []
    store.subscribe(events.append)
    counts = [store.chunk_count(b.index) for b in manifest.blocks]
    # Each block: its first chunk and last half from b, the chunks between from a; b's units come first in
    # its own order, and a unit of one block may land after a unit of the next.
    fetches = []
    for block, count in enumerate(counts):
        half = count // 2
        fetches += [Fetch(block, parents["b"], (half, count)), Fetch(block, parents["a"], (1, half)),
                    Fetch(block, parents["b"], (0, 1))]
    caplog.set_level("INFO", logger="pipecast.agent.fetcher")
    try:
        await Fetcher(store, pool).fetch(fetches)
        for block in manifest.blocks:
            assert bytes(store.block_view(block.index)) == block_file_bytes(root, manifest, block.index)
        assert store.progress().complete
        for name, server in servers.items():  # each parent was asked for its units' chunks only, in plan order
            assert server.asked == [(f.block, c) for f in fetches if f.parent == parents[name]
                                    for c in range(*f.chunks)]
        verified = [e.block for e in events if e.kind == "block_verified"]
        assert sorted(verified) == list(range(len(counts)))  # once a block, whichever unit completed it
        assert [e.block for e in events if e.kind == "block_started"] == sorted(set(verified))
        half = counts[0] // 2
        assert f"block 0 chunks {half}-{counts[0]} from b@" in caplog.text
        assert f"block 0 chunks 1-{half} from a@" in caplog.text
    finally:
        store.close()
        seed.close()


async def test_a_unit_whose_chunks_are_partly_here_fetches_only_the_missing_runs(package, peers, pool):
    root, manifest = package
    seed = seed_store(root)
    server = ChunkLog()
    server.add(seed)
    parent = await peers.start("a", server)
    store = receiving_store(manifest)
    count = store.chunk_count(0)
    data = block_file_bytes(root, manifest, 0)
    try:
        land_chunk(store, data, 0, 1)  # an earlier generation landed this one (e.g. from another parent)
        await Fetcher(store, pool).fetch([Fetch(0, parent)])
        assert server.asked == [(0, 0), *((0, c) for c in range(2, count))]
        assert bytes(store.block_view(0)) == data
    finally:
        store.close()
        seed.close()


async def test_units_that_do_not_fit_the_manifest_or_overlap_fail_before_anything_moves(package, honest, pool):
    _, manifest = package
    store = receiving_store(manifest)
    count = store.chunk_count(1)
    try:
        with pytest.raises(UnknownPackageError, match=rf"^package {manifest.package_id[:12]}: block 1 has no chunk "
                                                      rf"range 2-{count + 1} \(it has {count} chunks\)$"):
            await Fetcher(store, pool).fetch([Fetch(0, honest), Fetch(1, honest, (2, count + 1))])
        with pytest.raises(ValueError, match=r"^block 1 chunks 1-3 from honest@\S+ overlaps block 1 chunks 0-2 from "):
            await Fetcher(store, pool).fetch([Fetch(0, honest), Fetch(1, honest, (0, 2)), Fetch(1, honest, (1, 3))])
        with pytest.raises(ValueError, match=r"^block 1 from .* overlaps block 1 chunks 0-2 from "):
            await Fetcher(store, pool).fetch([Fetch(1, honest, (0, 2)), Fetch(1, honest)])
        assert store.progress().bytes_present == 0
    finally:
        store.close()


class ScriptedTransport(Transport):
    """Channels that land chunks from ``data`` themselves: a unit of block 0 from "slow" takes ``slow_s``,
    and every unit from "p" or "q" of block 1 waits until chunk 0 of block 1 is here (their peers need
    what this node fetches from "slow" first)."""

    name = "scripted"

    def __init__(self, store, data: dict[int, bytes], slow_s: float) -> None:
        super().__init__("rx", Settings(**SETTINGS))
        self.store, self.data, self.slow_s = store, data, slow_s

    async def listen(self, host, port, served):
        raise NotImplementedError

    async def connect(self, address: str, peer: str) -> Channel:
        return ScriptedChannel(peer, self)


class ScriptedChannel(Channel):
    def __init__(self, peer: str, transport: ScriptedTransport) -> None:
        self.peer, self.transport = peer, transport

    async def fetch_block(self, package_id, block, first_chunk, sink, end_chunk=None) -> None:
        name = self.peer.partition("@")[0]
        if name == "slow" and block == 0:
            await asyncio.sleep(self.transport.slow_s)
        if name in ("p", "q") and block == 1:
            await self.transport.store.wait_chunk(1, 0)
        for chunk in range(first_chunk, end_chunk):
            land_chunk(sink, self.transport.data[block], block, chunk)

    async def fetch_file(self, package_id, path, offset=0, length=0) -> bytes:
        raise NotImplementedError

    async def close(self) -> None:
        pass


async def test_units_waiting_on_this_nodes_earlier_unit_never_keep_it_from_running(package):
    """A ranged plan's receivers serve each other: later units (from p and q) can take every slot and wait
    for chunks this node fetches in an earlier unit (from slow); that unit still runs, one over the limit."""
    root, manifest = package
    store = receiving_store(manifest)
    count = store.chunk_count(0)
    transport = ScriptedTransport(store, {b: block_file_bytes(root, manifest, b) for b in (0, 1)}, slow_s=0.2)
    pool = ChannelPool(transport)
    slow, p, q = (PeerInfo(name, f"127.0.0.1:{port}") for name, port in (("slow", 1), ("p", 2), ("q", 3)))
    thirds = [(0, 1), (1, 2), (2, count)]
    # Plan order: block 0 from slow, p, q; then block 1 likewise. p's and q's block 0 units end long before
    # slow's, so their block 1 units queue for the two slots before slow's block 1 unit can.
    fetches = [Fetch(block, parent, chunks) for block in (0, 1) for parent, chunks in zip((slow, p, q), thirds)]
    try:
        await asyncio.wait_for(Fetcher(store, pool, FetchPolicy(concurrency=2)).fetch(fetches), 5)
        assert all(store.is_block_verified(b) for b in (0, 1))
    finally:
        await pool.close()
        store.close()


async def test_the_retry_backoff_stops_doubling_at_its_cap(monkeypatch):
    """Found in review: with 40 retries the last waits were 10^11 s (a parent given up on after millennia)."""
    from pipecast.agent import fetcher
    waits = []

    async def no_sleep(seconds):
        waits.append(seconds)

    async def silent():
        raise PeerTimeoutError("p", "silent")

    monkeypatch.setattr(fetcher.asyncio, "sleep", no_sleep)
    tries = fetcher._Tries(FetchPolicy(retries=100, backoff_s=0.2), lambda error: True, None)
    with pytest.raises(PeerTimeoutError):
        await tries.ask(PeerInfo("p", "127.0.0.1:1"), "block 0", silent)
    assert len(waits) == 100 and waits[:3] == [0.2, 0.4, 0.8] and max(waits) == fetcher.MAX_RETRY_WAIT_S
