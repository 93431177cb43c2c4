"""Served-model routes: the transitions (pure), the audit trail they leave, proto and JSON round trips, the
SQLite store across a restart, and the `pipecast cp` route commands over real gRPC."""

import asyncio
import json
import re

import pytest
from click.testing import CliRunner

from control_plane.client import ControlPlaneClient
from control_plane.command import cp_group
from control_plane.convert import route_change_from_proto, route_change_to_proto, route_from_proto, route_to_proto
from control_plane.deployments import DeploymentBook
from control_plane.errors import Conflict, InvalidRequest, PermissionDenied, UnknownPackage, UnknownRoute
from control_plane.routes import CanaryGate, ModelRoute, RouteChange, change_route
from control_plane.server import ControlPlaneServer
from control_plane.store_sqlite import SqliteStore
from pipecast.core.credentials import issue_node_token
from tests.control_plane.test_service import PKG, STORE, TOKEN, WAIT_S, config, manifest

A, B, C = "a" * 64, "b" * 64, "c" * 64
PUBLISHED = {A, B, C}


def routed(*changes: RouteChange) -> ModelRoute | None:
    route = None
    for change in changes:
        route = change_route(route, change, PUBLISHED, 1.0)
    return route


def test_a_route_takes_canaries_by_weight_then_promotes_or_rolls_them_back():
    route = routed(RouteChange("chat", "route", A))
    assert (route.stable, route.versions, route.canaries) == (A, ((A, 100),), ())
    route = change_route(route, RouteChange("chat", "canary", B, 10), PUBLISHED, 2.0)
    assert route.versions == ((A, 90), (B, 10)) and route.canaries == (B,) and route.updated_at == 2.0
    route = change_route(route, RouteChange("chat", "canary", C, 5), PUBLISHED, 3.0)
    assert route.versions == ((A, 85), (B, 10), (C, 5))
    assert change_route(route, RouteChange("chat", "canary", B, 30), PUBLISHED, 3.0).versions == (
        (A, 65), (B, 30), (C, 5))  # a new weight for the same canary
    assert change_route(route, RouteChange("chat", "rollback", C), PUBLISHED, 4.0).versions == ((A, 90), (B, 10))
    assert change_route(route, RouteChange("chat", "rollback"), PUBLISHED, 4.0).versions == ((A, 100),)
    promoted = change_route(route, RouteChange("chat", "promote", B), PUBLISHED, 4.0)
    assert (promoted.stable, promoted.versions) == (B, ((B, 100),))
    assert routed(RouteChange("chat", "route", A), RouteChange("chat", "unroute")) is None


@pytest.mark.parametrize("change, error, message", [
    (RouteChange("bad name", "route", A), InvalidRequest,
     "served model name 'bad name' must be 1-128 letters, digits or ._:/@+- (starting with a letter or digit)"),
    (RouteChange("chat", "swap", A), InvalidRequest,
     "route action 'swap' is not one of route, canary, promote, rollback, unroute"),
    (RouteChange("chat", "route", "d" * 64), UnknownPackage, f"package {'d' * 64!r} is not published"),
    (RouteChange("other", "promote"), UnknownRoute,
     "served model 'other' has no route (pipecast cp route other PACKAGE creates it)"),
    (RouteChange("chat", "canary", A, 10), InvalidRequest, f"route 'chat': {A!r} is already the stable version"),
    (RouteChange("chat", "canary", B, 100), InvalidRequest,
     "route 'chat': a canary's weight must be 1..99 percent, got 100"),
    (RouteChange("chat", "promote"), InvalidRequest, "route 'chat' has no canary to promote"),
    (RouteChange("chat", "rollback", B), InvalidRequest, "route 'chat' has no canary to rollback"),
    (RouteChange("chat", "canary", B, 10, CanaryGate(min_requests=0)), InvalidRequest,
     "route 'chat': gate min_requests must be an integer >= 1, got 0"),
    (RouteChange("chat", "canary", B, 10, CanaryGate(), no_gate=True), InvalidRequest,
     "route 'chat': a change sets a gate or removes it, not both"),
    # Found in review: a gate (or its removal) sent with promote or rollback was dropped without a word.
    (RouteChange("chat", "promote", gate=CanaryGate()), InvalidRequest,
     "route 'chat': promote keeps the route's gate; set or remove it with route or canary"),
    (RouteChange("chat", "rollback", no_gate=True), InvalidRequest,
     "route 'chat': rollback keeps the route's gate; set or remove it with route or canary"),
])
def test_every_bad_change_is_refused_with_what_is_wrong(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        change_route(routed(RouteChange("chat", "route", A)) if change.name == "chat" else None, change, PUBLISHED, 2.0)


def test_canaries_keep_the_stable_version_one_percent_and_a_new_stable_waits_for_them():
    route = routed(RouteChange("chat", "route", A), RouteChange("chat", "canary", B, 60))
    with pytest.raises(InvalidRequest, match=re.escape(
            "route 'chat': canaries would take 100% of the requests; they may take at most 99%")):
        change_route(route, RouteChange("chat", "canary", C, 40), PUBLISHED, 2.0)
    with pytest.raises(Conflict, match=re.escape(
            f"route 'chat' has canary {B!r}: promote it or roll it back before setting a new stable version")):
        change_route(route, RouteChange("chat", "route", C), PUBLISHED, 2.0)
    two = change_route(route, RouteChange("chat", "canary", C, 10), PUBLISHED, 2.0)
    with pytest.raises(InvalidRequest, match="route 'chat' has 2 canaries: name the one to promote"):
        change_route(two, RouteChange("chat", "promote"), PUBLISHED, 2.0)
    with pytest.raises(InvalidRequest, match=re.escape(f"route 'chat': {A!r} is not one of its canaries")):
        change_route(two, RouteChange("chat", "rollback", A), PUBLISHED, 2.0)


def test_a_gate_is_kept_until_changed_or_removed():
    gate = CanaryGate(0.2, 0.01, 50)
    route = routed(RouteChange("chat", "route", A), RouteChange("chat", "canary", B, 10, gate))
    assert route.gate == gate
    assert change_route(route, RouteChange("chat", "promote"), PUBLISHED, 2.0).gate == gate
    assert change_route(route, RouteChange("chat", "canary", B, 20, no_gate=True), PUBLISHED, 2.0).gate is None


def test_routes_and_changes_survive_proto_and_json():
    route = routed(RouteChange("chat", "route", A), RouteChange("chat", "canary", B, 10, CanaryGate(0.3, 0.02, 7)))
    assert route_from_proto(route_to_proto(route)) == route
    assert ModelRoute.from_json(json.loads(json.dumps(route.to_json()))) == route
    plain = routed(RouteChange("chat", "route", A))
    assert route_from_proto(route_to_proto(plain)) == plain and plain.gate is None
    for change in (RouteChange("chat", "canary", B, 10, CanaryGate(), "why"),
                   RouteChange("chat", "route", A, no_gate=True)):
        assert route_change_from_proto(route_change_to_proto(change)) == change


def test_every_change_is_in_the_audit_trail_with_the_route_before_and_after(tmp_path):
    book = DeploymentBook()
    book.change_route(RouteChange("chat", "route", A), PUBLISHED, 1.0)
    book.change_route(RouteChange("chat", "canary", B, 10), PUBLISHED, 2.0)
    book.change_route(RouteChange("chat", "rollback", reason="gate: slow"), PUBLISHED, 3.0)
    assert book.routes_of(A) == ["chat"] and book.routes_of(B) == []
    events = book.list_events()
    assert [(e.action, e.package_id, e.reason) for e in events] == [
        ("route", A, f"by hand; chat: {A[:12]} 100%"),
        ("canary", B, f"by hand; chat: {A[:12]} 90%, {B[:12]} 10%"),
        ("rollback", B, f"gate: slow; chat: {A[:12]} 100%")]
    inputs = json.loads(events[1].inputs_json)
    assert inputs["route"] == "chat" and inputs["before"]["versions"] == [[A, 100]]
    assert inputs["after"]["versions"] == [[A, 90], [B, 10]]
    with pytest.raises(UnknownRoute):
        book.change_route(RouteChange("none", "rollback"), PUBLISHED, 4.0)
    assert len(book.list_events()) == 3  # a refused change leaves nothing
    store = SqliteStore(str(tmp_path / "cp.sqlite3"))
    store.flush_book(book)
    again = DeploymentBook()
    SqliteStore(str(tmp_path / "cp.sqlite3")).load_book(again)
    assert again.routes == book.routes and [e.action for e in again.list_events()] == ["route", "canary", "rollback"]
    book.change_route(RouteChange("chat", "unroute"), PUBLISHED, 5.0)
    store.flush_book(book)
    fresh = DeploymentBook()
    SqliteStore(str(tmp_path / "cp.sqlite3")).load_book(fresh)
    assert fresh.routes == {}


def test_the_route_commands_over_grpc_need_the_operator_and_guard_the_packages(tmp_path):
    async def main() -> None:
        server = ControlPlaneServer(config(tmp_path / "cp.sqlite3"))
        await server.start()
        try:
            address = f"127.0.0.1:{server.port}"
            async with ControlPlaneClient(address, token=TOKEN, timeout_s=WAIT_S) as client:
                await client.publish_package(manifest(), STORE)
            runner = CliRunner(env={"PIPECAST_AUTH_TOKEN": TOKEN})

            async def cp(*args: str):  # the CLI runs its own event loop: in a thread
                return await asyncio.to_thread(runner.invoke, cp_group, ["--control-plane", address, *args])

            result = await cp("route", "chat", PKG, "--gate")
            assert result.exit_code == 0, result.output
            assert result.output == f"chat: {PKG[:12]} 100%\n"
            listed = await cp("routes", "--json")
            assert json.loads(listed.output)[0]["gate"] == {"ttft_p95_margin": 0.5, "error_rate_margin": 0.05,
                                                            "min_requests": 20}
            refused = await cp("promote", "chat")
            assert isinstance(refused.exception, InvalidRequest)
            assert str(refused.exception) == "route 'chat' has no canary to promote"
            removal = await cp("remove", PKG)
            assert isinstance(removal.exception, Conflict) and str(removal.exception) == (
                f"package {PKG!r} answers served model 'chat': roll it back, route the name elsewhere or remove the "
                "route (pipecast cp unroute chat) first")  # walkthrough finding 6a: the stable version has no rollback
            node = issue_node_token(TOKEN, "w1")
            async with ControlPlaneClient(address, token=node, timeout_s=WAIT_S) as client:
                assert [r.name for r in await client.list_routes()] == ["chat"]  # a node reads routes
                with pytest.raises(PermissionDenied):
                    await client.change_route(RouteChange("chat", "unroute"))
            assert (await cp("unroute", "chat")).output == "chat: no route\n"
            assert (await cp("remove", PKG)).output == f"removed {PKG}\n"  # as the refusal said
        finally:
            await server.stop()

    asyncio.run(main())
