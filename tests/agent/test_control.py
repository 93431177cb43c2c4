"""The agent's control link: the pure helpers (merging a node's parts into one fetch list, which failures
prove a peer itself sent corrupt data), and a package follower that never dies of what a peer sends."""

import asyncio
import socket
import time

import pytest

from control_plane.errors import ControlPlaneUnavailable
from control_plane.messages import AssignmentUpdate, PeerInfo, UpdateKind, WorkerSpec
from control_plane.planner.plan import Fetch
from packager.manifest import MANIFEST_FILE
from pipecast.agent.budget import MemoryBudget
from pipecast.agent.control import ControlLink, PackageFollower, merged_fetches, sender_at_fault
from pipecast.agent.daemon import AgentDaemon, AgentOptions
from pipecast.agent.errors import (
    CorruptChunkError,
    CorruptFileError,
    FetchFailedError,
    LocalResourceError,
    PeerClosedError,
    PeerRefusedError,
    UnknownPackageError,
)
from pipecast.agent.events import read_events
from pipecast.agent.fetcher import FetchPolicy
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.transport.tcp import TcpTransport
from pipecast.core.settings import Settings
from tests.agent.test_fetcher import NESTED, SETTINGS, ManifestForger
from tests.support.agent_fixtures import block_file_bytes, seed_store


def test_merged_fetches_take_each_missing_block_once_in_the_parts_order():
    store, a1 = PeerInfo("store", "10.0.0.1:7070"), PeerInfo("a1", "10.0.0.2:7070")
    first = AssignmentUpdate(UpdateKind.ASSIGN, plan_id="p1", fetch=(Fetch(2, a1), Fetch(0, store)))
    second = AssignmentUpdate(UpdateKind.ASSIGN, plan_id="p2", fetch=(Fetch(0, a1), Fetch(1, store)))
    assert merged_fetches([first, second], done=lambda f: f.block == 1) == [Fetch(2, a1), Fetch(0, store)]


def test_merged_fetches_take_a_blocks_units_from_the_first_part_that_names_it():
    store, a1 = PeerInfo("store", "10.0.0.1:7070"), PeerInfo("a1", "10.0.0.2:7070")
    first = AssignmentUpdate(UpdateKind.ASSIGN, plan_id="p1",
                             fetch=(Fetch(0, store, (0, 3)), Fetch(0, a1, (3, 8)), Fetch(1, a1, (0, 4))))
    # Another plan's units of block 0 overlap the first's: they are left; its block 2 is taken.
    second = AssignmentUpdate(UpdateKind.ASSIGN, plan_id="p2", fetch=(Fetch(0, a1, (0, 5)), Fetch(2, store)))
    assert merged_fetches([first, second], done=lambda f: f.chunks == (3, 8)) == [
        Fetch(0, store, (0, 3)), Fetch(1, a1, (0, 4)), Fetch(2, store)]


def test_only_a_peers_own_corrupt_data_gets_it_distrusted():
    assert sender_at_fault("block 3", CorruptChunkError("p", 3, 1))  # verified by the peer before it served it
    assert sender_at_fault(MANIFEST_FILE, CorruptFileError("p", "sent an invalid manifest"))
    # A file is forwarded before its relay has checked it whole: its parent may have corrupted it.
    assert not sender_at_fault("tokenizer.json", CorruptFileError("p", "sent file 'tokenizer.json' ..."))
    assert not sender_at_fault("block 3", PeerClosedError("p", "closed the connection"))


# -- a follower never dies of a peer ------------------------------------------------------------------------

TOKENIZER_BYTES = 1_000  # the package fixture (conftest) gives it a tokenizer file this big


class FakeSession:
    """What a follower needs of a :class:`WorkerSession`: it records the reports."""

    def __init__(self) -> None:
        self.verified: list[int] = []
        self.bad: list[tuple[str, int, str, bool]] = []
        self.progress: list[int] = []

    def report_verified(self, package_id: str, blocks) -> None:
        self.verified += list(blocks)

    def report_progress(self, package_id: str, bytes_present: int) -> None:
        self.progress.append(bytes_present)

    async def report_bad_peer(self, peer_id: str, package_id: str, block: int, reason: str, *,
                              gone: bool = False) -> bool:
        self.bad.append((peer_id, block, reason, gone))
        return False  # no re-plan: the follower fetches around the peer after replan_wait_s


class FlakyDaemon(AgentDaemon):
    """An agent daemon whose first ``open_store`` fails with an exception no peer was blamed for."""

    failures = 0

    async def open_store(self, package_id, peers, pool, *more):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("a bug, or a full disk")
        return await super().open_store(package_id, peers, pool, *more)


@pytest.fixture
async def two_peers(package):
    """A peer answering the manifest with ``[`` nested 100,000 deep (and refusing the rest), and an honest
    seed; both over TCP on loopback."""
    transport = TcpTransport("peers", Settings(**SETTINGS))
    honest_server = PeerServer()
    honest_server.add(seed_store(package[0]))
    listeners = [await transport.listen("127.0.0.1", 0, served) for served in (ManifestForger(NESTED), honest_server)]
    yield [PeerInfo(name, listener.address) for name, listener in zip(("forger", "honest"), listeners)]
    for listener in listeners:
        await listener.close()
    await transport.close()
    for store in honest_server.stores.values():
        store.close()


async def _follow_until_complete(daemon: AgentDaemon, fetch: tuple[Fetch[PeerInfo], ...], sources: tuple[PeerInfo, ...],
                                 package_id: str, report_progress: bool = False,
                                 transport: TcpTransport | None = None) -> tuple[PackageFollower, FakeSession]:
    daemon.transport = transport or TcpTransport("rx", Settings(**SETTINGS))
    session = FakeSession()
    follower = PackageFollower(package_id, daemon, session, FetchPolicy(retries=0, backoff_s=0.01), replan_wait_s=0.2,
                               progress_interval_s=0.001)
    follower.assign(AssignmentUpdate(UpdateKind.ASSIGN, plan_id="p1", package_id=package_id, fetch=fetch,
                                     sources=sources, report_progress=report_progress))
    for _ in range(2000):
        store = daemon.peer_server.stores.get(package_id)
        if store is not None and store.progress().complete and follower._completed:
            return follower, session
        assert not follower._task.done(), follower._task
        await asyncio.sleep(0.01)
    raise AssertionError(f"the package was not fetched; events: {read_events(daemon.options.events)}")


async def _stop(follower: PackageFollower, daemon: AgentDaemon, package_id: str) -> None:
    """Close what a test's follower opened: the follower, the daemon's transport, the store it filled."""
    await follower.close()
    await daemon.transport.close()
    daemon.peer_server.stores[package_id].close()


def _daemon(tmp_path, cls=AgentDaemon) -> AgentDaemon:
    return cls(AgentOptions(node_id="rx", listen="127.0.0.1:0", events=tmp_path / "rx.jsonl"),
               Settings(**{**SETTINGS, "agent_cache_dir": tmp_path / "cache"}))


@pytest.mark.timeout(60)
async def test_a_follower_whose_first_peer_sends_a_manifest_nested_100000_deep_gets_the_package_elsewhere(
        package, two_peers, tmp_path):
    """Finding 3: the agent died of RecursionError and never tried its other sources."""
    root, manifest = package
    forger, honest = two_peers
    daemon = _daemon(tmp_path)
    # The forger is the first parent, so the first peer asked for the manifest.
    fetch = (Fetch(0, forger), *(Fetch(b.index, honest) for b in manifest.blocks[1:]))
    follower, session = await _follow_until_complete(daemon, fetch, (honest,), manifest.package_id)
    try:
        store = daemon.peer_server.stores[manifest.package_id]
        assert store.manifest == manifest and store.manifest_origin == f"peer {honest}"
        for b in manifest.blocks:
            assert bytes(store.block_view(b.index)) == block_file_bytes(root, manifest, b.index)
        assert sorted(session.verified) == [b.index for b in manifest.blocks]
        failed = [e for e in read_events(tmp_path / "rx.jsonl") if e["event"] == "peer_failed"]
        assert [failed[0][k] for k in ("what", "peer", "error")] == [MANIFEST_FILE, "forger", "CorruptFileError"]
        assert failed[0]["message"] == (f"peer {forger}: sent an invalid manifest: not acceptable JSON (nested too "
                                        "deeply)")
        assert all(e["peer"] == "forger" for e in failed)
        cached = tmp_path / "cache" / manifest.package_id / MANIFEST_FILE
        assert cached.read_bytes() == (root / MANIFEST_FILE).read_bytes()
    finally:
        await _stop(follower, daemon, manifest.package_id)


@pytest.mark.timeout(60)
async def test_a_parent_where_nothing_listens_is_reported_gone_so_that_it_leaves_the_plan(package, two_peers, tmp_path):
    """A dead relay's child says so: the control plane then takes it out of the plan at once, as a dead node,
    instead of moving one block at a time off a node it believes is still receiving."""
    _, manifest = package
    _, honest = two_peers
    with socket.socket() as closed:  # a port nothing listens on: the host refuses connections to it
        closed.bind(("127.0.0.1", 0))
        gone = PeerInfo("gone", "127.0.0.1:%d" % closed.getsockname()[1])
    daemon = _daemon(tmp_path)
    fetch = (*(Fetch(b.index, honest) for b in manifest.blocks[:-1]), Fetch(manifest.blocks[-1].index, gone))
    follower, session = await _follow_until_complete(daemon, fetch, (honest,), manifest.package_id)
    try:
        [(peer, block, reason, reported_gone)] = session.bad
        assert (peer, block, reported_gone) == ("gone", manifest.blocks[-1].index, True)
        assert reason.startswith("PeerNotListeningError: peer gone@127.0.0.1:")
    finally:
        await _stop(follower, daemon, manifest.package_id)


@pytest.mark.timeout(60)
async def test_a_follower_survives_an_exception_no_peer_is_blamed_for_and_starts_again(package, two_peers, tmp_path):
    root, manifest = package
    _, honest = two_peers
    daemon = _daemon(tmp_path, FlakyDaemon)
    daemon.failures = 1
    fetch = tuple(Fetch(b.index, honest) for b in manifest.blocks)
    follower, _ = await _follow_until_complete(daemon, fetch, (honest,), manifest.package_id)
    try:
        events = read_events(tmp_path / "rx.jsonl")
        [failure] = [e for e in events if e["event"] == "transfer_failed"]
        assert (failure["error"], failure["message"]) == ("RuntimeError", "a bug, or a full disk")
        assert [e["event"] for e in events].count("complete") == 1
    finally:
        await _stop(follower, daemon, manifest.package_id)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("watched", [True, False])
async def test_a_follower_reports_its_progress_only_for_a_watched_plan(package, two_peers, tmp_path, watched):
    _, manifest = package
    _, honest = two_peers
    daemon = _daemon(tmp_path)
    fetch = tuple(Fetch(b.index, honest) for b in manifest.blocks)
    follower, session = await _follow_until_complete(daemon, fetch, (honest,), manifest.package_id,
                                                     report_progress=watched)
    try:
        if watched:
            assert session.progress and session.progress == sorted(session.progress)  # bytes held only grow
            assert session.progress[-1] <= sum(b.bytes for b in manifest.blocks)
        else:
            assert session.progress == []
    finally:
        await _stop(follower, daemon, manifest.package_id)


@pytest.mark.timeout(60)
async def test_a_fetch_of_a_block_held_verified_is_announced_again_not_left_unreported(package, two_peers, tmp_path):
    """A child reported this node bad for a block it holds: the control plane took the block from its
    availability and asked it to fetch it again, which a verified block never was: the plan stayed open."""
    _, manifest = package
    _, honest = two_peers
    daemon = _daemon(tmp_path)
    fetch = tuple(Fetch(b.index, honest) for b in manifest.blocks)
    follower, session = await _follow_until_complete(daemon, fetch, (honest,), manifest.package_id)
    try:
        session.verified.clear()
        follower.assign(AssignmentUpdate(UpdateKind.ASSIGN, plan_id="p1", package_id=manifest.package_id,
                                         fetch=(Fetch(1, honest, (0, 1)),), sources=(honest,)))
        assert session.verified == [1]
    finally:
        await _stop(follower, daemon, manifest.package_id)


class ShortOfFds(TcpTransport):
    """A transport that cannot connect to the peers named ``short_of`` until ``until`` (time.monotonic()): this
    node out of file descriptors for a while."""

    until = 0.0
    short_of: tuple[str, ...] = ()

    async def connect(self, address, peer):
        if time.monotonic() < self.until and peer.split("@")[0] in self.short_of:
            raise LocalResourceError(f"cannot connect to {address}: Too many open files on this node")
        return await super().connect(address, peer)


class FirstFileRefused(PeerServer):
    """An honest peer that refuses the first request for a small file other than the manifest."""

    refused = False

    async def file_bytes(self, package_id, path, offset=0, length=0):
        if path != MANIFEST_FILE and not self.refused:
            self.refused = True
            raise UnknownPackageError(f"no file {path} here just now")
        return await super().file_bytes(package_id, path, offset, length)


@pytest.fixture
async def serving():
    """Starts PeerServers serving a package on loopback: ``await serving(name, server, root)`` gives its peer."""
    transport = TcpTransport("peers", Settings(**SETTINGS))
    listeners, stores = [], []

    async def start(name: str, server: PeerServer, root) -> PeerInfo:
        stores.append(seed_store(root))
        server.add(stores[-1])
        listeners.append(await transport.listen("127.0.0.1", 0, server))
        return PeerInfo(name, listeners[-1].address)

    yield start
    for listener in listeners:
        await listener.close()
    await transport.close()
    for store in stores:
        store.close()


@pytest.mark.timeout(60)
async def test_a_follower_short_of_file_descriptors_for_a_moment_tries_again_after_a_pause(package, serving, tmp_path):
    """Found in review: a LocalResourceError that outlasted a unit's retries ended the fetch and the follower
    then waited for new parts with no deadline: the package stalled, unreported, until a re-plan."""
    _, manifest = package
    a, b = await serving("a", PeerServer(), package[0]), await serving("b", PeerServer(), package[0])
    transport = ShortOfFds("rx", Settings(**SETTINGS))
    transport.until, transport.short_of = time.monotonic() + 0.3, ("b",)
    daemon = _daemon(tmp_path)
    started = time.monotonic()
    fetch = (Fetch(0, a), Fetch(1, b), Fetch(2, a))
    follower, session = await _follow_until_complete(daemon, fetch, (a,), manifest.package_id, transport=transport)
    try:
        # Tried again after max(replan_wait_s, 1 s), not when new parts came (none did)
        assert time.monotonic() - started < 5
        assert session.bad == []  # no peer blamed for this node's shortage
        [failure] = [e for e in read_events(tmp_path / "rx.jsonl") if e["event"] == "transfer_failed"]
        assert failure["error"] == "LocalResourceError" and "Too many open files" in failure["message"]
    finally:
        await _stop(follower, daemon, manifest.package_id)


@pytest.mark.timeout(60)
async def test_small_files_a_follower_fetches_on_a_retry_reach_the_disk_cache(package, serving, tmp_path):
    """Found in review: files that failed in the first open were fetched again by the follower itself, past
    the disk cache: the cache held the manifest and blocks but no config.json, so it could not be a seed. Nor
    did the follower report the blocks of a store it did not open whole."""
    root, manifest = package
    flaky = await serving("flaky", FirstFileRefused(), root)
    daemon = _daemon(tmp_path)
    fetch = tuple(Fetch(b.index, flaky) for b in manifest.blocks)
    follower, session = await _follow_until_complete(daemon, fetch, (flaky,), manifest.package_id)
    try:
        folder = daemon.cache.package_dir(manifest.package_id)
        for entry in manifest.files:
            assert (folder / entry.path).read_bytes() == (root / entry.path).read_bytes()
        cached = seed_store(folder)  # a complete package folder: it can be served with --seed
        cached.close()
        assert sorted(session.verified) == [b.index for b in manifest.blocks]
    finally:
        await _stop(follower, daemon, manifest.package_id)


def _assign(follower: PackageFollower, parent: PeerInfo, source: PeerInfo) -> AssignmentUpdate:
    """Give ``follower`` a part: block 0 from ``parent``, ``source`` the plan's source."""
    part = AssignmentUpdate(UpdateKind.ASSIGN, plan_id="p1", package_id=follower.package_id, fetch=(Fetch(0, parent),),
                            sources=(source,))
    follower.assign(part)
    return part


class _SilentSession:
    """A worker session that takes every report and says nothing."""

    def __getattr__(self, name):
        async def bad_peer(*args, **kwargs):
            return False
        return bad_peer if name == "report_bad_peer" else (lambda *args, **kwargs: None)


class _Events:
    """An agent's event log that keeps the kinds emitted."""

    def __init__(self) -> None:
        self.emitted: list[str] = []

    def emit(self, event: str, **fields) -> None:
        self.emitted.append(event)


class _ShortOfMemory:
    """An agent whose memory budget of ``limit`` bytes holds another package of ``held`` until ``other.release()``:
    opening this one (80 bytes) is refused."""

    def __init__(self, limit: int = 100, held: int = 60) -> None:
        self.peer_server, self.events, self.transport = PeerServer(), _Events(), None
        self.budget = MemoryBudget(limit)
        self.other = self.budget.reserve(held, "package A (held)")
        self.opens = 0

    async def open_store(self, package_id, peers, pool, on_failure=None):
        self.opens += 1
        self.budget.reserve(80, f"package {package_id[:12]}")  # MemoryBudgetError while A is held
        await asyncio.Event().wait()  # admitted: the test has seen what it looks for (the follower's close ends it)

    def peer_failed(self, *args):
        pass


async def _opened_again(host, what: str) -> None:
    """Wait up to 5 s for ``host``'s second open of the package (``what`` fails the test otherwise)."""
    deadline = time.monotonic() + 5
    while host.opens < 2:
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_package_refused_for_memory_a_moment_is_tried_again_and_not_expected_meanwhile():
    """Found in review: a package that did not fit the budget (another's memory not yet freed after its drop) waited
    for new parts only, however soon the memory freed, and its children waited for it until their own timeouts."""
    host, source = _ShortOfMemory(), PeerInfo("src", "127.0.0.1:1")
    follower = PackageFollower("b" * 64, host, _SilentSession(), FetchPolicy(), replan_wait_s=0.1)
    host.peer_server.expect("b" * 64)  # as the part's arrival does
    _assign(follower, source, source)
    try:
        await asyncio.sleep(0.3)
        assert host.opens == 1 and "b" * 64 not in host.peer_server.expected  # children are told at once
        host.other.release()  # package A's memory freed
        await _opened_again(host, "not tried again once the memory was free")
    finally:
        await follower.close()


async def test_a_package_larger_than_the_whole_memory_budget_is_reported_once_and_waits_for_new_parts(caplog):
    """Found in review: an agent whose budget (--memory 1MiB) was smaller than the package (1.9 MiB) tried it again
    every 5 s for good, a warning and a transfer_failed event each time, as if the memory would free."""
    host, source = _ShortOfMemory(limit=50, held=0), PeerInfo("src", "127.0.0.1:1")
    follower = PackageFollower("b" * 64, host, _SilentSession(), FetchPolicy(), replan_wait_s=0.1)
    part = _assign(follower, source, source)
    try:
        await asyncio.sleep(1.5)  # past the pause (1 s) after which a shortage that passes is tried again
        assert host.opens == 1 and host.events.emitted == ["transfer_failed"]
        assert [r.levelname for r in caplog.records if "needs 80 B" in r.getMessage()] == ["ERROR"]
        follower.assign(part)  # new parts: tried again
        await _opened_again(host, "not tried again on new parts")
    finally:
        await follower.close()


class _Refusing:
    """An agent whose peers all refuse the package: each fetch round's open fails on every one of them."""

    def __init__(self) -> None:
        self.peer_server, self.events, self.transport = PeerServer(), _Events(), None
        self.budget = MemoryBudget(100)
        self.opens = 0

    async def open_store(self, package_id, peers, pool, on_failure=None):
        self.opens += 1
        await asyncio.sleep(0)  # as a peer's answer: other tasks run meanwhile
        attempts = []
        for peer in peers:
            attempts.append((str(peer), PeerRefusedError(str(peer), f"package {package_id[:12]} is not here")))
            on_failure(MANIFEST_FILE, peer, attempts[-1][1])
        raise FetchFailedError(f"the manifest of package {package_id[:12]}", attempts)

    def peer_failed(self, *args):
        pass


class _ControlPlaneAway(_SilentSession):
    """A worker session whose control plane does not answer: a bad-peer report cannot be sent."""

    def __getattr__(self, name):
        if name != "report_bad_peer":
            return super().__getattr__(name)

        async def unavailable(*args, **kwargs):
            raise ControlPlaneUnavailable("the control plane did not answer")
        return unavailable


@pytest.mark.parametrize("parent", ["the source", "a relay"])
async def test_failed_parents_the_control_plane_cannot_be_told_of_are_tried_again_after_a_pause(caplog, parent):
    """Found in review: with the control plane away and the failed parent a source (nothing to fetch around), the
    next round started at once: ~9 log lines and ~5 events a second, reconnecting to the dead peer each time."""
    host, source = _Refusing(), PeerInfo("src", "127.0.0.1:1")
    follower = PackageFollower("b" * 64, host, _ControlPlaneAway(), FetchPolicy(), replan_wait_s=0.1)
    _assign(follower, source if parent == "the source" else PeerInfo("relay", "127.0.0.1:2"), source)
    try:
        await asyncio.sleep(0.9)  # within the pause (1 s) after a round with nothing new to fetch around
        # A relay is fetched around from the sources once, at once; then, as with the source, the pause.
        assert host.opens == (1 if parent == "the source" else 2)
        assert len([r for r in caplog.records if "cannot report failed parents" in r.getMessage()]) == 1
    finally:
        await follower.close()


@pytest.mark.timeout(30)
async def test_a_plan_s_relay_piece_holds_for_its_package_until_the_package_is_dropped(tmp_path):
    """Issue #16: a long chain's ASSIGN asks for smaller relay pieces (``relay_bytes``); the agent relays that
    package's chunks in them, other packages in its own, and forgets the ask when the plan or the package goes."""
    daemon = _daemon(tmp_path)
    daemon.transport = TcpTransport("rx", Settings(**SETTINGS, agent_relay_bytes=256 << 10))
    link = ControlLink(daemon, client=None, spec=WorkerSpec(PeerInfo("rx", "127.0.0.1:1"), 1 << 30),
                       policy=FetchPolicy(retries=0), replan_wait_s=0.2)
    def assign(plan: str, relay_bytes: int) -> AssignmentUpdate:
        return AssignmentUpdate(UpdateKind.ASSIGN, plan_id=plan, package_id="long", relay_bytes=relay_bytes)

    def piece() -> int:
        return daemon.transport.relay_bytes_for("long")

    try:
        await link._apply(assign("p1", 64 << 10))
        assert [piece(), daemon.transport.relay_bytes_for("other")] == [64 << 10, 256 << 10]
        # A node in two plans of the package (a chain's tail, a source of the chain hung behind it) takes the
        # smaller piece asked, whichever plan told it last, until that plan leaves it.
        await link._apply(assign("p2", 0))
        assert piece() == 64 << 10
        await link._apply(assign("p2", 128 << 10))
        assert piece() == 64 << 10
        await link._apply(AssignmentUpdate(UpdateKind.CANCEL, plan_id="p1", package_id="long"))
        assert piece() == 128 << 10
        await link._apply(assign("p1", 64 << 10))
        await link._apply(AssignmentUpdate(UpdateKind.SYNC, plan_ids=("p2",)))  # p1 ended while the stream was down
        assert piece() == 128 << 10
        await link._apply(AssignmentUpdate(UpdateKind.DROP, package_id="long"))
        assert piece() == 256 << 10
    finally:
        await daemon.transport.close()
