"""One identity per node and an operator role on the control plane (issue #12, finding 2), over real gRPC.

On the old code one shared token let any worker act as any node or as the operator: register again under
another node's id (plans then pointed at the new address), report blocks or take the assignment stream
of another node, publish a manifest without chunk digests or with the id ``../../../../tmp/x``, and
register a serve URL anywhere. Each test below fails there.
"""

import asyncio
from collections.abc import AsyncIterator

import pytest

from control_plane.client import ControlPlaneClient
from control_plane.errors import (
    Conflict, InvalidRequest, NodeIdInUse, PermissionDenied, Unauthenticated, UnknownWorker)
from control_plane.messages import PeerInfo, UpdateKind, WorkerSpec
from control_plane.server import ControlPlaneServer
from control_plane.worker_session import WorkerSession
from pipecast.core.credentials import CredentialError, data_plane_key, issue_node_token, serving_key, verify_node_token
from tests.control_plane.test_service import PKG, STORE, TOKEN, WAIT_S, Watcher, config, manifest, spec


@pytest.fixture
async def server(tmp_path) -> AsyncIterator[ControlPlaneServer]:
    async with ControlPlaneServer(config(tmp_path / "cp.sqlite3")) as srv:
        yield srv


@pytest.fixture
async def operator(server) -> AsyncIterator[ControlPlaneClient]:
    async with ControlPlaneClient(server.address, token=TOKEN, timeout_s=WAIT_S) as c:
        yield c


@pytest.fixture
async def w2(server) -> AsyncIterator[ControlPlaneClient]:
    """The client of node w2, with the node token the operator issued it."""
    async with ControlPlaneClient(server.address, token=issue_node_token(TOKEN, "w2"), timeout_s=WAIT_S) as c:
        yield c


def denied(acting: str, victim: str):
    return pytest.raises(PermissionDenied, match=f"node '{acting}' may not act for node '{victim}'")


async def test_a_node_cannot_register_again_as_another_node(operator, w2):
    """Finding 2: re-registering w1's id with another address is refused; plans keep w1's address."""
    await operator.publish_package(manifest(), STORE)
    await operator.register(spec("w1"))
    await operator.scale_up(PKG, node_ids=["w1"])
    hijack = WorkerSpec(PeerInfo("w1", "127.0.0.1:6666", ("tcp",)), 1 << 30)
    with denied("w2", "w1"):
        await w2.register(hijack)
    [worker] = await operator.list_workers()
    assert worker.worker.peer.address == spec("w1").peer.address


async def test_a_node_cannot_report_beat_or_leave_for_another(operator, w2):
    """Finding 2: claims about another node's blocks, lease or registration are refused."""
    await operator.publish_package(manifest(), STORE)
    await operator.register(spec("w1"))
    with denied("w2", "w1"):
        await w2.report_blocks("w1", {PKG: range(4)})
    stream = w2.open_report_stream()
    with denied("w2", "w1"):
        await stream.report("w1", {PKG: range(4)})
    assert stream.closed
    with denied("w2", "w1"):
        await w2.heartbeat("w1")
    with denied("w2", "w1"):
        await w2.report_bad_peer("w1", "store", PKG, 0, "made up")
    with denied("w2", "w1"):
        await w2.deregister("w1")
    assert (await operator.availability(PKG)).by_worker == {}
    assert [w.worker.peer.node_id for w in await operator.list_workers()] == ["w1"]


async def test_a_node_cannot_watch_another_nodes_assignments(operator, w2):
    """Finding 2: WatchAssignments for another node is refused, and the victim's stream goes on."""
    await operator.register(spec("w1"))
    own = Watcher(operator, "w1")
    try:
        assert (await own.next()).kind is UpdateKind.SYNC
        with denied("w2", "w1"):
            async for _ in w2.watch_assignments("w1"):
                pass
        await operator.publish_package(manifest(), STORE)
        await operator.scale_up(PKG, node_ids=["w1"])
        assert (await own.next()).kind is UpdateKind.ASSIGN
    finally:
        await own.close()


async def test_a_node_acts_as_itself_and_reads_but_is_no_operator(operator, w2):
    """Finding 2: a node token publishes, scales, releases, removes and issues tokens no more."""
    await operator.publish_package(manifest(), STORE)
    registration = await w2.register(spec("w2"))
    assert registration.data_key == data_plane_key(TOKEN)
    await w2.heartbeat("w2")
    await w2.report_blocks("w2", {PKG: [0]})
    watcher = Watcher(w2, "w2")
    try:
        assert (await watcher.next()).kind is UpdateKind.SYNC
    finally:
        await watcher.close()
    # Reads are open to any principal.
    assert [p.package_id for p in await w2.list_packages()] == [PKG]
    assert (await w2.get_package(PKG))[0] == manifest()
    assert (await w2.availability(PKG)).by_worker == {"w2": {0}}
    assert [w.worker.peer.node_id for w in await w2.list_workers()] == ["w2"]
    # The router (a node token) learns what requests to serving workers present; never the data-plane key.
    assert (await w2.list_workers_keyed())[1] == serving_key(data_plane_key(TOKEN)) != data_plane_key(TOKEN)
    assert await w2.list_plans() == []
    operator_calls = {
        "PublishPackage": w2.publish_package(manifest("other"), STORE),
        "ScaleUp": w2.scale_up(PKG, count=1),
        "Release": w2.release(PKG, ["w2"]),
        "RemovePackage": w2.remove_package(PKG, force=True),
        "IssueToken": w2.issue_token("w1"),
    }
    for rpc, call in operator_calls.items():
        with pytest.raises(PermissionDenied, match=f"{rpc} needs the operator's token; node 'w2' may not call it"):
            await call
    assert [p.package_id for p in await operator.list_packages()] == [PKG]
    assert await operator.list_plans() == []
    await w2.deregister("w2")
    with pytest.raises(UnknownWorker):
        await w2.heartbeat("w2")


@pytest.mark.parametrize("token", [
    issue_node_token("another-master", "w2"),  # a real token of another cluster
    issue_node_token(TOKEN, "w2")[:-2] + "AA",  # a forged mac
    "pcn1.w2",  # no mac
    TOKEN + "x",
])
async def test_forged_node_tokens_are_unauthenticated(server, token):
    async with ControlPlaneClient(server.address, token=token, timeout_s=WAIT_S) as intruder:
        with pytest.raises(Unauthenticated, match="missing or wrong token"):
            await intruder.register(spec("w2"))
    assert server.state.workers == {}


async def test_the_operator_issues_node_tokens_for_valid_node_ids(operator, server):
    token = await operator.issue_token("w7")
    assert verify_node_token(TOKEN, token) == "w7"
    async with ControlPlaneClient(server.address, token=token, timeout_s=WAIT_S) as w7:
        await w7.register(spec("w7"))
    for bad in ("", "a b", "x" * 129, "tab\there"):
        with pytest.raises(InvalidRequest, match="cannot issue a token: .*node id"):
            await operator.issue_token(bad)


async def test_a_revoked_nodes_token_is_refused_whatever_it_calls_and_it_leaves_its_plans(operator, w2, server,
                                                                                          tmp_path):
    """A node token was revoked only by changing the master token (re-keying every node). Revoked, a node leaves
    its plans and its stream, every call with its token is refused, across a restart; restored, it registers."""
    await operator.publish_package(manifest(), STORE)
    await operator.register(WorkerSpec(STORE, 1 << 30), {PKG: range(4)})
    await w2.register(spec("w2"))
    watcher = Watcher(w2, "w2")
    await watcher.next()  # its SYNC
    plan = await operator.scale_up(PKG, node_ids=["w2"])
    assert (await watcher.next()).kind == UpdateKind.ASSIGN
    with pytest.raises(PermissionDenied, match="^RevokeNode needs the operator's token; node 'w2' may not call it$"):
        await w2.revoke_node("w2")
    assert await operator.revoke_node("w2") == (["w2"], True)
    with pytest.raises(UnknownWorker):  # its stream ends, as a dead worker's
        await asyncio.wait_for(watcher.task, WAIT_S)
    revoked = (r"refused \w+: the token of node 'w2' is revoked \(`pipecast cp revoke-node w2 --restore` admits it "
               r"again\)$")
    for call in (lambda: w2.register(spec("w2")), lambda: w2.heartbeat("w2"), w2.list_packages,
                 lambda: w2.report_blocks("w2", {PKG: [0]})):
        with pytest.raises(Unauthenticated, match=revoked):
            await call()
    assert [w.worker.peer.node_id for w in await operator.list_workers()] == ["store"]
    assert plan.plan_id not in {p.plan_id for p in await operator.list_plans()}
    assert await operator.revoke_node("w3") == (["w2", "w3"], True)  # a node not registered (yet) may be too
    with pytest.raises(Unauthenticated, match=revoked.replace("w2", "w3")):  # as the operator too
        await operator.register(spec("w3"))
    assert await operator.revoke_node("w3") == (["w2", "w3"], False)
    assert await operator.revoke_node() == (["w2", "w3"], False)  # the list
    with pytest.raises(Conflict, match="^node 'w2' is revoked: its token would be refused"):
        await operator.issue_token("w2")

    await server.stop(grace_s=0)
    async with ControlPlaneServer(config(tmp_path / "cp.sqlite3")) as again:  # kept in its database
        async with (ControlPlaneClient(again.address, token=TOKEN, timeout_s=WAIT_S) as operator2,
                    ControlPlaneClient(again.address, token=issue_node_token(TOKEN, "w2"), timeout_s=WAIT_S) as w2b):
            with pytest.raises(Unauthenticated, match=revoked):
                await w2b.register(spec("w2"))
            assert await operator2.revoke_node("w2", restore=True) == (["w3"], True)
            await w2b.register(spec("w2"))
            assert "w2" in [w.worker.peer.node_id for w in await operator2.list_workers()]
    # Found in review: with auth off, a node revoked before could not register, nor be restored.
    async with ControlPlaneServer(config(tmp_path / "cp.sqlite3", token="")) as open_plane:
        async with ControlPlaneClient(open_plane.address, timeout_s=WAIT_S) as anyone:
            await anyone.register(spec("w3"))
            with pytest.raises(Conflict, match="auth is off .*: there are no node tokens to revoke"):
                await anyone.revoke_node("w4")
            assert await anyone.revoke_node("w3", restore=True) == ([], True)


async def test_without_auth_everything_is_allowed_and_there_is_no_data_key(tmp_path):
    async with ControlPlaneServer(config(tmp_path / "cp.sqlite3", token="")) as srv:
        async with ControlPlaneClient(srv.address, timeout_s=WAIT_S) as anyone:
            await anyone.publish_package(manifest(), STORE)
            assert (await anyone.register(spec("w1"))).data_key == b""
            await anyone.report_blocks("w1", {PKG: [0]})
            await anyone.scale_up(PKG, count=1)
            with pytest.raises(Conflict, match="auth is off"):
                await anyone.issue_token("w1")


def test_a_control_plane_with_a_guessable_master_token_is_refused_before_it_listens(tmp_path):
    with pytest.raises(CredentialError, match="the master token has 6 characters"):
        ControlPlaneServer(config(tmp_path / "cp.sqlite3", token="s3cret"))
    assert not (tmp_path / "cp.sqlite3").exists()


@pytest.mark.parametrize(("problem", "edit"), [
    ("is not 64 lower-case hex digits", lambda m: setattr(m, "package_id", "../../../../tmp/x")),
    ("is not 64 lower-case hex digits", lambda m: setattr(m, "package_id", m.package_id.upper())),
    ("block 0 has 0 chunk digests", lambda m: m.blocks[0].ClearField("chunk_digests")),
    ("is not the digest of the manifest", lambda m: setattr(m, "model_name", "forged")),
])
async def test_publish_refuses_a_bad_id_or_manifest_and_records_nothing(operator, server, problem, edit):
    """Finding 2: PublishPackage validates the id and the whole manifest before recording anything."""
    bad = manifest()
    edit(bad)
    with pytest.raises(InvalidRequest, match=problem):
        await operator.publish_package(bad, STORE)
    assert server.state.packages == {}


@pytest.mark.parametrize("address", ["", "10.0.0.1", "10.0.0.1:99999", "10.0.0.1:0", "user@10.0.0.1:7070",
                                     "10.0.0.1:7070/x"])
async def test_publish_refuses_a_store_address_that_is_not_host_port(operator, server, address):
    with pytest.raises(InvalidRequest, match="is not a host:port address"):
        await operator.publish_package(manifest(), PeerInfo("store", address))
    assert server.state.packages == {}


@pytest.mark.parametrize(("serve_url", "labels"), [
    ("http://10.9.9.9:8000", {}),
    ("http://127.0.0.2:8000", {}),
    ("", {"serve_url": "http://evil.example:8000"}),  # the legacy label the router also reads
])
async def test_a_serve_url_on_another_host_is_refused(w2, server, serve_url, labels):
    """Finding 2: the router sends prompts to a registered serve URL: it must be on the node's own host."""
    elsewhere = WorkerSpec(spec("w2").peer, 1 << 30, labels=labels, serve_url=serve_url)
    with pytest.raises(InvalidRequest, match="serve URL .* is not on its own host '127.0.0.1'"):
        await w2.register(elsewhere)
    assert server.state.workers == {}
    await w2.register(WorkerSpec(spec("w2").peer, 1 << 30, serve_url="http://127.0.0.1:8000"))


async def test_a_workers_engine_is_kept_and_an_unknown_one_refused(w2, server):
    with pytest.raises(InvalidRequest, match="worker 'w2': engine 'tgi' is not one of pipecast, vllm"):
        await w2.register(WorkerSpec(spec("w2").peer, 1 << 30, serve_url="http://127.0.0.1:8000", engine="tgi"))
    await w2.register(WorkerSpec(spec("w2").peer, 1 << 30, serve_url="http://127.0.0.1:8000", engine="vllm"))
    assert server.state.workers["w2"].spec.engine == "vllm"
    assert WorkerSpec.from_json(server.state.workers["w2"].spec.to_json()).engine == "vllm"


async def test_a_workers_serve_package_is_kept_and_one_not_a_package_id_or_without_a_serve_url_refused(w2, server):
    url = "http://127.0.0.1:8000"
    with pytest.raises(InvalidRequest, match="worker 'w2': serve package 'abc' is not a whole package id"):
        await w2.register(WorkerSpec(spec("w2").peer, 1 << 30, serve_url=url, serve_package="abc"))
    with pytest.raises(InvalidRequest, match="worker 'w2': serve package aaaaaaaaaaaa without a serve URL"):
        await w2.register(WorkerSpec(spec("w2").peer, 1 << 30, serve_package="a" * 64))
    assert server.state.workers == {}
    await w2.register(WorkerSpec(spec("w2").peer, 1 << 30, serve_url=url, serve_package="a" * 64))
    assert server.state.workers["w2"].spec.serve_package == "a" * 64
    assert WorkerSpec.from_json(server.state.workers["w2"].spec.to_json()).serve_package == "a" * 64


async def test_worker_session_hands_over_the_data_key_and_stops_on_another_nodes_token(server):
    keys: list[bytes] = []
    async with ControlPlaneClient(server.address, token=issue_node_token(TOKEN, "w2"), timeout_s=WAIT_S) as own:
        session = WorkerSession(own, spec("w2"), holdings=dict, retry_s=0.05, on_data_key=keys.append)
        assert session.data_key is None
        await session.start()
        try:
            await asyncio.wait_for(session.registered.wait(), WAIT_S)
            assert session.data_key == data_plane_key(TOKEN) and keys == [data_plane_key(TOKEN)]
        finally:
            await session.close()
        wrong = WorkerSession(own, spec("w1"), holdings=dict, retry_s=0.05)
        await wrong.start()
        try:
            with pytest.raises(PermissionDenied, match="node 'w2' may not act for node 'w1'"):
                await asyncio.wait_for(anext(wrong.assignments()), WAIT_S)
        finally:
            await wrong.close()


async def test_a_second_agent_with_a_live_workers_node_id_is_refused_and_the_first_keeps_its_place(operator, server):
    """Finding 1 (walk B): an agent started with the node id of a live worker at another address replaced it
    silently (the router lost the real one's serving worker); now refused while the real one's lease runs, and
    a restart at the same address, or a registration after the lease lapsed, is still accepted."""
    await operator.register(spec("w1"))
    impostor = WorkerSpec(PeerInfo("w1", "127.0.0.9:27070", ("tcp",)), 1 << 30)
    with pytest.raises(NodeIdInUse, match=r"node id 'w1' is in use by a live worker at 127.0.0.1:9001: "
                                          r"registration from 127.0.0.9:27070 refused \(that worker's lease ends in "
                                          r"\d+\.\d s unless it renews it; .*an agent restarted at the same address "
                                          r"is accepted\)"):
        await operator.register(impostor)
    [worker] = await operator.list_workers()
    assert worker.worker.peer.address == spec("w1").peer.address and worker.alive
    await operator.heartbeat("w1")
    await operator.register(spec("w1"))  # the agent restarted where it was
    server.state.workers["w1"].lease_expires = server.clock()  # its lease lapsed: the id is free
    await operator.register(impostor)
    [worker] = await operator.list_workers()
    assert worker.worker.peer.address == "127.0.0.9:27070"


@pytest.mark.parametrize("refusal", ["serve_url", "node_id"])
async def test_worker_session_stops_on_a_refused_registration(operator, server, refusal):
    """Findings 1 and 2 (walk B): a registration refused for the agent's configuration (a serve URL on another
    host, a node id a live worker has) was retried every second forever; now it ends the session (the agent
    exits 2 with the message): at once, or for a node id in use once it was refused for node_id_wait_s."""
    await operator.register(spec("w1"))
    if refusal == "serve_url":
        wrong = WorkerSpec(spec("w2").peer, 1 << 30, serve_url="http://127.0.0.8:27800")
        error, message = InvalidRequest, "serve URL .* is not on its own host"
    else:
        wrong = WorkerSpec(PeerInfo("w1", "127.0.0.9:27070", ("tcp",)), 1 << 30)
        error, message = NodeIdInUse, "node id 'w1' is in use by a live worker at 127.0.0.1:9001"
    session = WorkerSession(operator, wrong, holdings=dict, retry_s=0.05, node_id_wait_s=0.3)
    await session.start()
    try:
        with pytest.raises(error, match=message):
            await asyncio.wait_for(anext(session.assignments()), WAIT_S)
    finally:
        await session.close()
    assert server.state.workers["w1"].spec.peer.address == spec("w1").peer.address


async def test_an_agent_back_at_a_new_address_registers_once_its_old_lease_ends(operator, server):
    """Review P: an agent restarted at another address (a reboot, a new pod IP) while its old process's lease
    still ran exited 2; its registration is retried until that lease ends."""
    await operator.register(spec("w1"))
    server.state.workers["w1"].lease_expires = server.clock() + 60  # the old process's lease runs meanwhile
    moved = WorkerSpec(PeerInfo("w1", "127.0.0.9:27070", ("tcp",)), 1 << 30)
    session = WorkerSession(operator, moved, holdings=dict, retry_s=0.05)
    await session.start()
    try:
        await asyncio.sleep(0.2)  # refused a few times meanwhile
        assert not session.registered.is_set() and not session._refused_event.is_set()
        server.state.workers["w1"].lease_expires = server.clock()  # the old process's lease ends
        await asyncio.wait_for(session.registered.wait(), WAIT_S)
        assert server.state.workers["w1"].spec.peer.address == "127.0.0.9:27070"
    finally:
        await session.close()


def test_a_client_token_gRPC_metadata_cannot_carry_is_refused_where_the_client_is_made():
    """Found in review: a token with a trailing newline (a Secret made from a file) made every call fail in gRPC's
    core with an error no caller took for a refusal: an agent waited for its registration for good, `cp` ended
    in a traceback, a router retried forever. The message says where, never what."""
    for token in ("pcn1.w1.abc\n", "tok en", "tök"):
        with pytest.raises(CredentialError, match=r"auth_token: the token has a character other than printable "
                                                  r"ASCII .* at position \d+ of \d+") as caught:
            ControlPlaneClient("127.0.0.1:1", token=token)
        assert token.strip() not in str(caught.value)


async def test_a_registration_stopped_by_an_error_unforeseen_fails_the_assignment_stream_not_hangs():
    class Broken(ControlPlaneClient):
        async def register(self, *args, **kwargs):
            raise RuntimeError("a bug")

    async with Broken("127.0.0.1:1", timeout_s=WAIT_S) as client:
        session = WorkerSession(client, spec("w1"), holdings=dict, retry_s=0.05)
        await session.start()
        try:
            with pytest.raises(RuntimeError, match="a bug"):
                await asyncio.wait_for(anext(session.assignments()), WAIT_S)
        finally:
            await session.close()
