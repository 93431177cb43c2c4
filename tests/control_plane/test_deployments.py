"""Deployments and the scale-event log: validation (pure), and over real gRPC with a restart on the same file."""

import asyncio
import math
import re
from dataclasses import asdict

import pytest
from click.testing import CliRunner

from control_plane.client import ControlPlaneClient
from control_plane.command import cp_group, deploy_command
from control_plane.convert import deployment_from_proto, deployment_to_proto
from control_plane.deployments import Deployment, DeploymentBook, ScaleEvent, ScalingPolicy
from control_plane.errors import Conflict, InvalidRequest, PermissionDenied, UnknownDeployment, UnknownPackage
from control_plane.server import ControlPlaneServer
from pipecast.core.credentials import issue_node_token
from pipecast.core.units import parse_duration
from tests.support import REPO
from tests.control_plane.test_service import PKG, STORE, TOKEN, WAIT_S, config, manifest


def test_a_usable_policy_has_no_problems():
    assert ScalingPolicy().problems() == []
    assert ScalingPolicy(min_replicas=2, max_replicas=2, warm=2).problems() == []


def test_every_bad_value_is_named():
    bad = ScalingPolicy(min_replicas=5, max_replicas=3, warm=4, slo_ttft_p99_s=0, replica_rps=0,
                        replica_concurrency=0)
    assert bad.problems() == ["slo_ttft_p99_s must be a finite number > 0 and <= 86400, got 0",
                              "replica_rps must be a finite number >= 1e-06, got 0",
                              "replica_concurrency must be a finite number >= 1 and <= 100000, got 0"]
    assert ScalingPolicy(min_replicas=5, max_replicas=3, warm=4).problems() == [
        "min_replicas (5) must be <= max_replicas (3)", "warm (4) must be <= max_replicas (3)"]
    assert ScalingPolicy(keep_alive_s=float("nan")).problems() == [
        "keep_alive_s must be a finite number >= 0 and <= 86400, got nan"]


def test_a_fields_bound_is_worded_the_same_whatever_the_bad_value():
    for value in (0, -1, float("nan")):
        assert ScalingPolicy(replica_rps=value).problems() == [
            f"replica_rps must be a finite number >= 1e-06, got {value!r}"]
        assert ScalingPolicy(max_replicas=value).problems() == [
            f"max_replicas must be a finite number >= 1 and <= 100000, got {value!r}"]


def test_the_deploy_command_names_every_bad_value_by_its_flag_before_calling():
    # 127.0.0.1:1 answers nothing: the refusal comes before any call.
    result = CliRunner().invoke(cp_group, ["--control-plane", "127.0.0.1:1", "deploy", "pkg", "--max", "0",
                                           "--replica-rps", "-1", "--replica-concurrency", "0", "--min", "-2",
                                           "--slo-ttft-p99", "0", "--warm", "-1"])
    assert isinstance(result.exception, InvalidRequest), result.output
    assert str(result.exception) == (
        "deployment of package 'pkg' refused: --min: min_replicas must be a finite number >= 0 and <= 100000, got "
        "-2; --max: max_replicas must be a finite number >= 1 and <= 100000, got 0; --slo-ttft-p99: slo_ttft_p99_s "
        "must be a finite number > 0 and <= 86400, got 0.0; --warm: warm must be a finite number >= 0 and <= "
        "100000, got -1; --replica-rps: replica_rps must be a finite number >= 1e-06, got -1.0; "
        "--replica-concurrency: replica_concurrency must be a finite number >= 1 and <= 100000, got 0")
    result = CliRunner().invoke(cp_group, ["--control-plane", "127.0.0.1:1", "deploy", "pkg", "--min", "3", "--max",
                                           "2"])
    assert str(result.exception) == ("deployment of package 'pkg' refused: --min/--max: min_replicas (3) must be "
                                     "<= max_replicas (2)")


def test_counts_durations_and_a_replicas_throughput_are_bounded_above_and_below():
    """Review of the scaler, finding 2: a replica_rps of 1e-320 or a cold start of 1e308 s was accepted and made the
    daemon's math overflow; `cp deploy --max 4294967296` ended in protobuf's ValueError, not a refusal."""
    assert ScalingPolicy(min_replicas=100_000, max_replicas=100_000, warm=100_000, replica_concurrency=100_000,
                         replica_rps=1e-6, slo_ttft_p99_s=86_400, keep_alive_s=86_400, scale_up_cooldown_s=86_400,
                         scale_down_cooldown_s=86_400, cold_start_s=86_400).problems() == []
    assert ScalingPolicy(max_replicas=2 ** 32, replica_concurrency=100_001, replica_rps=1e-320, cold_start_s=1e308,
                         keep_alive_s=86_401).problems() == [
        "max_replicas must be a finite number >= 1 and <= 100000, got 4294967296",
        "keep_alive_s must be a finite number >= 0 and <= 86400, got 86401",
        "replica_rps must be a finite number >= 1e-06, got 1e-320",
        "replica_concurrency must be a finite number >= 1 and <= 100000, got 100001",
        "cold_start_s must be a finite number >= 0 and <= 86400, got 1e+308"]
    # 127.0.0.1:1 answers nothing: the refusal comes before any call (and before protobuf's uint32).
    result = CliRunner().invoke(cp_group, ["--control-plane", "127.0.0.1:1", "deploy", "pkg", "--min", "1", "--max",
                                           "4294967297", "--replica-concurrency", "4294967296"])
    assert isinstance(result.exception, InvalidRequest), result.output
    assert str(result.exception) == (
        "deployment of package 'pkg' refused: --max: max_replicas must be a finite number >= 1 and <= 100000, got "
        "4294967297; --replica-concurrency: replica_concurrency must be a finite number >= 1 and <= 100000, got "
        "4294967296")


def test_an_auto_warm_factor_is_within_1_to_10_and_excludes_a_fixed_warm():
    assert ScalingPolicy(warm_auto_factor=1.0).problems() == []
    assert ScalingPolicy(warm_auto_factor=10.0).problems() == []
    assert ScalingPolicy(warm_auto_factor=0.5).problems() == [
        "warm_auto_factor must be 0 (warm fixed) or within 1..10, got 0.5"]
    assert ScalingPolicy(warm_auto_factor=12.0, warm=1).problems() == [
        "warm_auto_factor must be 0 (warm fixed) or within 1..10, got 12.0",
        "warm (1) must be 0 when warm_auto_factor (12.0) sizes the warm pool"]
    # Found in review: inf (and -1) were told "a finite number >= 0", and then 0.5 another range.
    for factor in (-1.0, math.inf):
        assert ScalingPolicy(warm_auto_factor=factor).problems() == [
            f"warm_auto_factor must be 0 (warm fixed) or within 1..10, got {factor!r}"]
    with pytest.raises(InvalidRequest, match=re.escape(
            "deployment of package 'p' refused: warm_auto_factor must be 0 (warm fixed) or within 1..10, got 11.0")):
        DeploymentBook().put(Deployment("p", ScalingPolicy(warm_auto_factor=11.0)), ["p"], 1.0)


def test_a_deployments_priority_is_checked_kept_over_proto_and_json_and_old_rows_read_as_normal():
    book = DeploymentBook()
    with pytest.raises(InvalidRequest, match=re.escape(
            "deployment of package 'p' refused: priority must be one of high, normal, low, got 'urgent'")):
        book.put(Deployment("p", ScalingPolicy(), priority="urgent"), ["p"], 1.0)
    stored = book.put(Deployment("p", ScalingPolicy(cold_start_s=5.5), priority="low"), ["p"], 1.0)
    assert book.priority_of("p") == "low" and book.priority_of("other") == "normal"
    assert deployment_from_proto(deployment_to_proto(stored)) == stored
    assert Deployment.from_json(stored.to_json()) == stored
    old = stored.to_json()
    del old["priority"]  # a row written before priorities
    assert Deployment.from_json(old).priority == "normal"


def test_rows_a_newer_version_wrote_load_with_their_new_fields_ignored(caplog):
    """Found in review: a field added to a stored dataclass (cold_start_measured) made the version before refuse the
    whole database as corrupt: a rollback, or an older replica taking over in a rolling upgrade, crash-looped."""
    from control_plane.messages import PeerInfo, WorkerSpec
    from control_plane.routes import CanaryGate, ModelRoute

    deployment = Deployment("p", ScalingPolicy(cold_start_s=4.0), (), 1.0, 2.0)
    newer = deployment.to_json()
    newer["policy"]["a_later_field"] = 7
    assert Deployment.from_json(newer) == deployment
    assert "stored ScalingPolicy has a field 'a_later_field' this version does not know" in caplog.text
    event = ScaleEvent(at=1.0, package_id="p", action="hold", reason="quiet")
    assert ScaleEvent.from_json({**event.to_json(), "a_later_field": 1}) == event
    route = ModelRoute.from_json({"name": "m", "stable": "p", "versions": [["p", 100]],
                                  "gate": {**asdict(CanaryGate()), "a_later_field": 1}, "updated_at": 1.0})
    assert route.gate == CanaryGate()
    spec = WorkerSpec(PeerInfo("w1", "10.0.0.1:7070"), 1 << 30)
    stored = spec.to_json()
    stored["accelerator"]["a_later_field"] = 1
    assert WorkerSpec.from_json(stored) == spec


def test_a_measured_cold_start_survives_the_proto_and_json_old_rows_read_as_unmeasured_and_a_non_bool_is_refused():
    deployment = Deployment("p", ScalingPolicy(cold_start_s=4.0, cold_start_measured=True), (), 1.0, 2.0)
    assert deployment_from_proto(deployment_to_proto(deployment)) == deployment
    assert Deployment.from_json(deployment.to_json()) == deployment
    old = deployment.to_json()
    del old["policy"]["cold_start_measured"]  # a row written before the field existed
    assert Deployment.from_json(old).policy.cold_start_measured is False
    with pytest.raises(InvalidRequest, match=re.escape(
            "deployment of package 'p' refused: cold_start_measured must be true or false, got 1")):
        DeploymentBook().put(Deployment("p", ScalingPolicy(cold_start_measured=1)), ["p"], 1.0)


def test_the_auto_warm_factor_survives_the_proto_and_json_and_old_rows_read_as_fixed_warm():
    deployment = Deployment("p", ScalingPolicy(warm_auto_factor=2.5), ("http://r:8080",), 1.0, 2.0)
    assert deployment_from_proto(deployment_to_proto(deployment)) == deployment
    assert Deployment.from_json(deployment.to_json()) == deployment
    old = deployment.to_json()
    del old["policy"]["warm_auto_factor"]  # a row written before the field existed
    assert Deployment.from_json(old).policy.warm_auto_factor == 0.0


@pytest.mark.parametrize("args, error", [
    (["--warm", "1", "--warm-factor", "3"], "Invalid value for '--warm-factor': is used only with --warm auto"),
    (["--warm", "some"], "Invalid value for '--warm': 'some' is neither a number of replicas nor 'auto'"),
])
def test_the_deploy_command_refuses_a_factor_without_auto_and_a_bad_warm(args, error):
    result = CliRunner().invoke(cp_group, ["--control-plane", "127.0.0.1:1", "deploy", "pkg", *args])
    assert result.exit_code == 2 and error in result.output, result.output


def test_the_book_refuses_bad_deployments_and_keeps_created_time():
    book = DeploymentBook()
    with pytest.raises(InvalidRequest, match=r"deployment of package 'p' refused: max_replicas must be a finite "
                                             r"number >= 1 and <= 100000, got 0"):
        book.put(Deployment("p", ScalingPolicy(max_replicas=0)), ["p"], 1.0)
    with pytest.raises(UnknownPackage, match="package 'q' is not published"):
        book.put(Deployment("q", ScalingPolicy()), ["p"], 1.0)
    with pytest.raises(InvalidRequest, match="router 'ftp://x' is not an http"):
        book.put(Deployment("p", ScalingPolicy(), ("ftp://x",)), ["p"], 1.0)
    with pytest.raises(InvalidRequest, match=r"router 'http://\[::1' is not an http"):  # urlsplit raises on it
        book.put(Deployment("p", ScalingPolicy(), ("http://[::1",)), ["p"], 1.0)
    first = book.put(Deployment("p", ScalingPolicy(), ("http://r:8080/", "http://r:8080")), ["p"], 1.0)
    assert first.routers == ("http://r:8080",) and first.created_at == first.updated_at == 1.0
    second = book.put(Deployment("p", ScalingPolicy(max_replicas=4)), ["p"], 2.0)
    assert (second.created_at, second.updated_at, second.policy.max_replicas) == (1.0, 2.0, 4)


def test_events_get_growing_sequence_numbers_and_filters():
    book = DeploymentBook()
    for package in ("a", "b"):
        book.put(Deployment(package, ScalingPolicy()), ["a", "b"], 0.0)
    for i in range(5):
        book.append(ScaleEvent(at=float(i), package_id="ab"[i % 2], action="hold", reason=f"r{i}"))
    assert [e.seq for e in book.list_events()] == [1, 2, 3, 4, 5]
    assert [e.reason for e in book.list_events("a", after_seq=1)] == ["r2", "r4"]
    assert [e.seq for e in book.list_events(limit=2)] == [4, 5]
    with pytest.raises(InvalidRequest,
                       match="scale event action 'grow' is not one of scale_up, release, take_back, hold"):
        book.append(ScaleEvent(at=0.0, package_id="a", action="grow"))
    with pytest.raises(UnknownDeployment, match="package 'zz' has no deployment"):
        book.append(ScaleEvent(at=0.0, package_id="zz", action="hold"))


@pytest.mark.parametrize("at", [float("inf"), float("-inf"), float("nan"), 1e18, -1.0])
def test_an_event_whose_time_is_not_finite_or_printable_is_refused_before_it_is_recorded(at):
    """Stored, one not finite would make the next start-up refuse the database; one past year 9999 (found in
    review) broke every listing of the events (`pipecast scaler events`: OSError)."""
    book = DeploymentBook()
    book.put(Deployment("a", ScalingPolicy()), ["a"], 0.0)
    with pytest.raises(InvalidRequest, match=re.escape(
            f"scale event of package 'a': at must be a time from 0 to 253402300799 (year 9999), got {at}")):
        book.append(ScaleEvent(at=at, package_id="a", action="hold"))
    assert book.last_seq == 0 and not book.new_events and not book.events


async def test_deployments_and_events_over_grpc_survive_a_restart(tmp_path):
    db = tmp_path / "cp.sqlite3"
    server = ControlPlaneServer(config(db))
    await server.start()
    try:
        async with ControlPlaneClient(server.address, token=TOKEN, timeout_s=WAIT_S) as c:
            await c.publish_package(manifest(), STORE)
            with pytest.raises(InvalidRequest, match="min_replicas \\(3\\) must be <= max_replicas \\(2\\)"):
                await c.put_deployment(Deployment(PKG, ScalingPolicy(min_replicas=3, max_replicas=2)))
            with pytest.raises(InvalidRequest, match=re.escape("warm_auto_factor must be 0 (warm fixed) or within "
                                                               "1..10, got 0.5")):
                await c.put_deployment(Deployment(PKG, ScalingPolicy(warm_auto_factor=0.5)))
            stored = await c.put_deployment(Deployment(PKG, ScalingPolicy(max_replicas=4, warm_auto_factor=2.5),
                                                       ("http://10.0.0.9:8080",)))
            assert stored.created_at > 0 and stored.policy.warm_auto_factor == 2.5
            seq = await c.append_scale_event(ScaleEvent(at=1.0, package_id=PKG, action="scale_up", count=2,
                                                        node_ids=("w1", "w2"), reason="queue", desired=2))
            assert seq == 1
            with pytest.raises(Conflict, match="is deployed: remove its deployment first"):
                await c.remove_package(PKG, force=True)
        async with ControlPlaneClient(server.address, token=issue_node_token(TOKEN, "w1"), timeout_s=WAIT_S) as node:
            with pytest.raises(PermissionDenied, match="PutDeployment needs the operator's token"):
                await node.put_deployment(Deployment(PKG, ScalingPolicy()))
            assert [d.package_id for d in await node.list_deployments()] == [PKG]
    finally:
        await server.stop(grace_s=0)
    again = ControlPlaneServer(config(db))
    await again.start()
    try:
        async with ControlPlaneClient(again.address, token=TOKEN, timeout_s=WAIT_S) as c:
            assert await c.list_deployments() == [stored]
            events = await c.list_scale_events(PKG)
            assert [(e.seq, e.action, e.node_ids, e.desired) for e in events] == [(1, "scale_up", ("w1", "w2"), 2)]
            assert await c.append_scale_event(ScaleEvent(at=2.0, package_id=PKG, action="hold")) == 2
            await c.remove_deployment(PKG)
            with pytest.raises(UnknownDeployment):
                await c.remove_deployment(PKG)
            assert await c.list_deployments() == []
    finally:
        await again.stop(grace_s=0)


async def test_deploy_warm_auto_from_the_command_line_is_listed_with_its_factor(tmp_path):
    server = ControlPlaneServer(config(tmp_path / "cp.sqlite3"))
    await server.start()
    try:
        async with ControlPlaneClient(server.address, token=TOKEN, timeout_s=WAIT_S) as c:
            await c.publish_package(manifest(), STORE)
        cp = ["--control-plane", server.address, "--token", TOKEN]
        # The commands run their own event loop: off this test's.
        deployed = await asyncio.to_thread(CliRunner().invoke, cp_group, [*cp, "deploy", PKG, "--warm", "auto",
                                                                          "--warm-factor", "3"])
        assert deployed.exit_code == 0, deployed.output
        listed = await asyncio.to_thread(CliRunner().invoke, cp_group, [*cp, "deployments"])
        assert "warm auto (3.0x baseline)" in listed.output and "priority normal" in listed.output, listed.output
        deployed = await asyncio.to_thread(CliRunner().invoke, cp_group, [*cp, "deploy", PKG, "--priority", "low"])
        assert deployed.exit_code == 0 and "priority low" in deployed.output, deployed.output
        # Found in review: a deployment without a router was taken in silence (the daemon then holds it for good).
        assert "warning: no --router: the scaling daemon reads no signals" in deployed.output
        routed = await asyncio.to_thread(CliRunner().invoke, cp_group, [*cp, "deploy", PKG, "--router",
                                                                        "http://r:8080"])
        assert routed.exit_code == 0 and "warning" not in routed.output, routed.output
    finally:
        await server.stop(grace_s=0)


def test_the_readme_table_of_deploy_options_matches_the_command():
    text = (REPO / "README.md").read_text()
    table = text[text.index("| `pipecast cp deploy` option |"):].split("\n\n", 1)[0].splitlines()[2:]
    rows = {re.match(r"\| `(--[a-z0-9-]+)", row).group(1): row.split("|")[2].strip() for row in table}
    options = {p.opts[0]: p.default for p in deploy_command.params if p.opts[0].startswith("--")}
    assert {name.split(" ")[0] for name in rows} == set(options)
    for name, default in options.items():
        shown = rows[name]
        if name == "--router":
            assert shown == "-"
        elif name == "--priority":
            assert shown == default
        elif isinstance(default, bool):  # a flag
            assert shown == ("on" if default else "off"), name
        else:
            assert parse_duration(shown) == float(default), name


def test_the_groups_options_may_follow_the_subcommand_and_no_subcommand_has_options_of_their_names():
    for args in (["packages", "--control-plane", "127.0.0.1:1", "--json"], ["packages", "--control-plane=127.0.0.1:1"],
                 ["--json", "packages", "--control-plane", "127.0.0.1:1"]):
        result = CliRunner().invoke(cp_group, args)
        assert str(result.exception).startswith("control plane at 127.0.0.1:1 did not answer ListPackages"), args
    # after "--" nothing is moved: the subcommand gets what follows as given
    assert "Got unexpected extra argument" in CliRunner().invoke(cp_group, ["packages", "--", "--json"]).output
    own = {opt for param in cp_group.params for opt in param.opts}
    for name, command in cp_group.commands.items():
        assert not own & {opt for param in command.params for opt in param.opts}, name


@pytest.mark.parametrize("url", ["http://router..svc:8080", "http://" + "a" * 64 + ".svc", "http://u:pw@r:8080",
                                 "http://r:0"])
def test_the_book_refuses_router_urls_no_resolver_takes_or_with_credentials(url):
    """Found in review: a host whose IDNA encoding fails raised UnicodeError in the daemon at every tick (and
    stopped it where a gated route named the package); credentials were listed to every caller and logged; port 0,
    where no router listens, was read as a silent router for good."""
    with pytest.raises(InvalidRequest, match="router"):
        DeploymentBook().put(Deployment("p", ScalingPolicy(), (url,)), ["p"], 1.0)


@pytest.mark.parametrize("url, endpoint, base", [("http://r:8080/stats", "/stats", "http://r:8080"),
                                                ("http://gw/pipecast/v1/completions", "/v1/completions",
                                                 "http://gw/pipecast"),
                                                ("http://r:8080/v1/", "/v1", "http://r:8080"),
                                                ("http://r:8080/v1/stats", "/stats", "http://r:8080"),
                                                ("http://gw/p/v1/v1/models", "/v1/models", "http://gw/p")])
def test_the_book_refuses_a_router_url_that_names_one_of_its_endpoints(url, endpoint, base):
    """Found in review: `cp deploy --router http://r:8080/stats` was taken, and the daemon polled /stats/stats and held
    the deployment with no signals while saying it was healthy. Found in use: so was the OpenAI base URL its clients
    are given (http://r:8080/v1), and the daemon logged "/stats answered HTTP 404" every tick."""
    with pytest.raises(InvalidRequest, match=f"^deployment of package 'p': router '{url}' names the router's "
                                             f"{endpoint} endpoint; give its base URL \\({base}\\)$"):
        DeploymentBook().put(Deployment("p", ScalingPolicy(), (url,)), ["p"], 1.0)


def test_a_router_url_stored_before_it_was_refused_is_warned_of_at_load_with_the_fix(caplog):
    """Found in review: a deployment stored with the /v1 base URL before it was refused kept polling /v1/stats
    (HTTP 404) every tick, and nothing said how to mend it."""
    stored = Deployment("p", ScalingPolicy(), ("http://r:8080/v1", "http://q:8080"))
    book = DeploymentBook()
    with caplog.at_level("WARNING", logger="control_plane.deployments"):
        book.restore([stored], [])
    assert book.deployments == {"p": stored}
    assert [r.getMessage() for r in caplog.records] == [
        "stored deployment of package 'p': router 'http://r:8080/v1' names the router's /v1 endpoint; give its base "
        "URL (http://r:8080): the scaling daemon gets no signals from it until the package is deployed again with "
        "that URL (pipecast cp deploy)"]


def test_the_book_keeps_one_spelling_per_router():
    """Found in review: two spellings of one router were polled as two and their counts summed."""
    book = DeploymentBook()
    urls = ("http://R:8080", "http://r:8080/", "https://Q:443/x", "https://q/x", "http://[::1]:80", "HTTP://r:8080")
    deployment = book.put(Deployment("p", ScalingPolicy(), urls), ["p"], 1.0)
    assert deployment.routers == ("http://r:8080", "https://q/x", "http://[::1]")


def test_a_packages_listing_has_its_events_among_all_too_and_an_undeployed_ones_are_let_go(monkeypatch):
    """Found in review: with its own kept to 2,000, a package that logged most of the 10,000 kept in all listed fewer
    by name than in all; and a removed deployment's own stayed in memory for good."""
    monkeypatch.setattr("control_plane.deployments.EVENTS_PER_PACKAGE_IN_MEMORY", 2)
    book = DeploymentBook()
    book.put(Deployment("p", ScalingPolicy()), ["p"], 1.0)
    for i in range(5):
        book.append(ScaleEvent(at=2.0 + i, package_id="p", action="hold", reason=f"{i}"))
    assert [e.seq for e in book.list_events("p")] == [e.seq for e in book.list_events()] == [1, 2, 3, 4, 5]
    assert [e.seq for e in book.list_events("p", after_seq=1, through_seq=3)] == [2, 3]
    book.remove("p")
    assert "p" not in book.by_package and len(book.list_events("p")) == 5  # among all still
