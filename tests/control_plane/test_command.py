"""`pipecast cp`'s commands against a real control plane on loopback (port 0): what they take and print."""

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator

import pytest
from click.testing import CliRunner, Result

from control_plane.client import ControlPlaneClient
from control_plane.command import TRANSPORTS, cp_group, full_package_id
from control_plane.errors import InvalidRequest, UnknownPackage
from control_plane.messages import WorkerSpec
from control_plane.server import ControlPlaneServer
from packager.manifest import manifest_to_json
from pipecast.agent.transport.registry import transport_names
from pipecast.core.settings import SettingsError
from pipecast.v1 import control_pb2 as pb
from tests.control_plane.test_service import BLOCKS, PKG, STORE, TOKEN, WAIT_S, config, manifest, spec


@pytest.fixture
async def cp(tmp_path) -> AsyncIterator[tuple[ControlPlaneServer, ControlPlaneClient]]:
    """A control plane with the package PKG published and worker w1 holding all of it."""
    server = ControlPlaneServer(config(tmp_path / "cp.sqlite3"))
    await server.start()
    try:
        async with ControlPlaneClient(server.address, token=TOKEN, timeout_s=WAIT_S) as client:
            await client.publish_package(manifest(), STORE)
            await client.register(spec("w1"), {PKG: range(BLOCKS)})
            yield server, client
    finally:
        await server.stop(grace_s=0)


async def invoke(server: ControlPlaneServer, *args: str) -> Result:
    """``pipecast cp ARGS`` against ``server``, off this test's event loop (the commands run their own)."""
    return await asyncio.to_thread(CliRunner().invoke, cp_group,
                                   ["--control-plane", server.address, "--token", TOKEN, *args])


async def test_release_takes_its_keep_alive_as_a_duration(cp):
    """Found in review: `cp release PKG w1 --keep-alive 5m` failed ("'5m' is not a valid float range") while
    `cp deploy --keep-alive 5m` and `scaler run --source-keep 5m` take durations."""
    server, _ = cp
    before = time.time()
    result = await invoke(server, "--json", "release", PKG, "w1", "--keep-alive", "5m")
    assert result.exit_code == 0, result.output
    assert before + 300 <= json.loads(result.output)["drop_at_unix"] <= time.time() + 300
    assert server.state.releases.keys() == {(PKG, "w1")}


async def test_packages_counts_block_copies_under_a_column_saying_so(cp):
    """Found in review: the REPLICAS column counted (worker, block) pairs, 4 for the one worker holding the
    package, where a replica is a serving worker."""
    server, _ = cp
    result = await invoke(server, "packages")
    assert result.exit_code == 0, result.output
    header, row = result.output.splitlines()
    assert header == "PACKAGE              MODEL                        BLOCKS       SIZE COMPLETE BLOCK COPIES  STORE"
    assert row.split()[-3:] == ["1", str(BLOCKS), f"{STORE.node_id}@{STORE.address}"]


async def test_the_token_may_come_from_a_file_out_of_sight_of_ps(cp, tmp_path):
    """Found in review: --token puts the master token in the command line, which any local user reads (`ps`,
    /proc/*/cmdline), and its help did not say so. --token-file reads it from a file, refused as a config file
    holding it is where another user could change it; --token's help points to it."""
    server, _ = cp
    token = tmp_path / "token"
    token.write_text(f"{TOKEN}\n")
    token.chmod(0o600)

    async def cp_with(*args: str) -> Result:
        return await asyncio.to_thread(CliRunner().invoke, cp_group, ["--control-plane", server.address, *args])

    result = await cp_with("--token-file", str(token), "workers")
    assert result.exit_code == 0 and "\nw1 " in result.output, result.output
    both = await cp_with("--token", TOKEN, "--token-file", str(token), "workers")
    assert both.exit_code == 2 and "Error: --token and --token-file both give the token: give one" in both.output
    token.chmod(0o602)
    refused = (await cp_with("workers", "--token-file", str(token))).exception  # after the subcommand too
    assert isinstance(refused, SettingsError) and str(refused) == (
        f"token file {token} holds a token and is writable by others (mode 0602): refused, as another user could "
        "change it (chmod go-w)")
    token.write_text("\n")
    token.chmod(0o600)
    assert str((await cp_with("--token-file", str(token), "workers")).exception) == f"token file {token} is empty"
    assert ("Any local user sees it in `ps` while the command runs: prefer --token-file or PIPECAST_AUTH_TOKEN."
            in " ".join(CliRunner().invoke(cp_group, ["--help"]).output.split()))


def test_publish_takes_only_the_known_transports(tmp_path):
    """Found in review: `cp publish --transport foo` was accepted (and the option had no help): receivers were
    then sent to a store over a transport none of them has."""
    (tmp_path / "manifest.json").write_text(manifest_to_json(manifest()))
    result = CliRunner().invoke(cp_group, ["--control-plane", "127.0.0.1:1", "publish", str(tmp_path), "--store-node",
                                           "store", "--store-address", "10.0.0.1:7070", "--transport", "foo"])
    assert result.exit_code == 2
    assert "Error: Invalid value for '--transport': 'foo' is not one of 'tcp', 'ucx'." in result.output
    assert TRANSPORTS == tuple(name for name in transport_names() if name != "auto")  # the agents' backends
    assert "A data-plane transport the store serves" in CliRunner().invoke(cp_group, ["publish", "--help"]).output


@pytest.mark.parametrize("args, option", [
    (["scale-up", PKG, "--count", "4294967296"], "--count"),
    (["scale-up", PKG, "--worker", "w1", "--fanout", "4294967296"], "--fanout"),
    (["route", "chat", PKG, "--gate", "--gate-min-requests", "4294967296"], "--gate-min-requests"),
])
def test_a_count_beyond_what_the_control_plane_takes_is_refused_by_the_option(args, option):
    """Found in review: protobuf's uint32 refused these with a ValueError, a traceback."""
    result = CliRunner().invoke(cp_group, ["--control-plane", "127.0.0.1:1", *args])
    assert result.exit_code == 2 and f"Invalid value for '{option}': 4294967296 is not in the range" in result.output


def test_a_fanout_without_the_tree_strategy_is_refused():
    """Found in review: accepted, and silently of no use (a rotated plan was made)."""
    result = CliRunner().invoke(cp_group, ["--control-plane", "127.0.0.1:1", "scale-up", PKG, "--count", "1",
                                           "--fanout", "3"])
    assert result.exit_code == 2 and "--fanout is for --strategy tree only" in result.output


@pytest.mark.parametrize("command", [["route", "chat", PKG], ["canary", "chat", PKG, "--weight", "10"]])
@pytest.mark.parametrize("gate", [[], ["--no-gate"]], ids=["no-gate-flag", "no-gate"])
@pytest.mark.parametrize("option, value", [("--gate-ttft-margin", "0.2"), ("--gate-error-margin", "0.01"),
                                           ("--gate-min-requests", "50")])
def test_a_gate_setting_without_the_gate_is_refused(command, gate, option, value):
    """Found in review: accepted, and silently of no use (no gate was set, or the route's was removed)."""
    result = CliRunner().invoke(cp_group, ["--control-plane", "127.0.0.1:1", *command, *gate, option, value])
    assert result.exit_code == 2 and f"Invalid value for '{option}': is used only with --gate" in result.output


@pytest.mark.parametrize("variable, value", [("PIPECAST_CONFIG", "/nonexistent/pipecast.toml"),
                                             ("PIPECAST_AGENT_PORT", "many")])
def test_a_subcommands_help_needs_no_valid_settings(monkeypatch, variable, value):
    """Found in review: the cp group loaded the settings before click read the subcommand's --help, so a bad
    PIPECAST_* variable or a missing PIPECAST_CONFIG file refused `pipecast cp deploy --help`; a subcommand that
    runs still reports them."""
    monkeypatch.setenv(variable, value)
    result = CliRunner().invoke(cp_group, ["deploy", "--help"])
    assert result.exit_code == 0 and "Create or replace the deployment" in result.output, result.output
    result = CliRunner().invoke(cp_group, ["--control-plane", "127.0.0.1:1", "workers"])
    assert result.exit_code != 0 and variable[len("PIPECAST_"):].lower() in str(result.exception)


async def test_a_store_node_id_no_token_can_name_is_refused_at_publish(cp):
    """Found in review: a store id with a new line (or 100,000 characters) was published; it could never register."""
    _, client = cp
    problem = "published with store node id 's\\nx' has unprintable characters"
    with pytest.raises(InvalidRequest, match=re.escape(problem)):
        await client.publish_package(manifest("other"), dataclasses.replace(STORE, node_id="s\nx"))


async def test_package_id_arguments_take_the_start_of_an_id_as_the_listings_print_it(cp):
    """Found in review: `cp status` and `cp routes` print 12 characters of a package id, `cp packages` 20, but every
    PACKAGE_ID argument needed all 64."""
    server, client = cp
    result = await invoke(server, "availability", PKG[:12])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"package {PKG}: {BLOCKS} blocks\n"), result.output
    result = await invoke(server, "release", PKG[:8], "w1", "--keep-alive", "1m")
    assert result.exit_code == 0 and result.output.startswith(f"released {PKG} from 1 workers"), result.output
    assert (await invoke(server, "deploy", PKG[:20])).exit_code == 0
    assert [d.package_id for d in await client.list_deployments()] == [PKG]
    result = await invoke(server, "route", "tiny", PKG[:12])
    assert result.exit_code == 0 and [r.stable for r in await client.list_routes()] == [PKG], result.output
    other = ("0" if PKG[0] != "0" else "1") + PKG[1:12]
    result = await invoke(server, "undeploy", other)
    assert isinstance(result.exception, UnknownPackage)
    assert str(result.exception) == f"no published package id starts with {other!r}"
    result = await invoke(server, "undeploy", PKG.upper())  # in either case
    assert result.exit_code == 0 and result.output == f"undeployed {PKG}\n", result.output


class Listing:
    """A client whose ListPackages answers these ids."""

    def __init__(self, *ids: str):
        self.ids = ids

    async def list_packages(self) -> list[pb.PackageSummary]:
        return [pb.PackageSummary(package_id=i) for i in self.ids]


async def test_the_start_of_a_package_id_that_several_ids_share_is_refused_naming_them():
    """Found in review (with the short ids above): a prefix is resolved only where it names one package."""
    a, b = "abcdef01" + "1" * 56, "abcdef01" + "2" * 56
    with pytest.raises(InvalidRequest) as refused:
        await full_package_id(Listing(b, a), "abcdef01")
    assert str(refused.value) == (f"package id 'abcdef01' is ambiguous: 2 published package ids start with it ({a}, "
                                  f"{b}); give more of it")
    assert await full_package_id(Listing(a, b), "abcdef012") == b
    for whole_or_none in (a, ""):  # passed on, not looked up ("": every package, or a route's one canary)
        assert await full_package_id(Listing(), whole_or_none) == whole_or_none


NOT_AN_ID = "is neither a whole package id (64 hex digits) nor the start of one (8 hex digits or more)"


async def test_a_package_id_is_taken_in_either_case_and_anything_but_an_id_or_its_start_is_refused():
    """Walkthrough finding 5: `cp plans --package 77609d` and `scaler events --package 77609D...` were passed on as
    typed, matched nothing and printed an empty list, exit 0."""
    a = "abcdef01" + "1" * 56
    assert await full_package_id(Listing(a), "ABCDEF01") == a
    assert await full_package_id(Listing(), a.upper()) == a
    for refused in ("abcdef", "abcdef0", "tiny-model", "abcdef01g", a + "1", " " + a):
        with pytest.raises(InvalidRequest) as caught:
            await full_package_id(Listing(a), refused)
        assert str(caught.value) == f"package id {refused!r} {NOT_AN_ID}"


async def test_package_id_options_refuse_a_short_start_and_take_capitals(cp):
    server, _ = cp
    result = await invoke(server, "plans", "--package", PKG[:6])
    assert isinstance(result.exception, InvalidRequest) and result.exit_code != 0, result.output
    assert str(result.exception) == f"package id {PKG[:6]!r} {NOT_AN_ID}"
    result = await invoke(server, "availability", PKG[:12].upper())
    assert result.exit_code == 0 and result.output.startswith(f"package {PKG}: {BLOCKS} blocks\n"), result.output


async def test_deploy_refuses_a_warm_factor_of_0_with_warm_auto(cp):
    """Walkthrough finding 4: `cp deploy --warm auto --warm-factor 0` deployed a fixed warm pool of 0 (the policy's
    factor 0 means "warm fixed"), where --warm-factor takes 1..10 and 0.5 is refused."""
    server, client = cp
    result = await invoke(server, "deploy", PKG, "--warm", "auto", "--warm-factor", "0")
    assert isinstance(result.exception, InvalidRequest), result.output
    assert str(result.exception) == (f"deployment of package {PKG!r} refused: --warm-factor: warm_auto_factor must "
                                     "be within 1..10 with --warm auto, got 0.0")
    assert await client.list_deployments() == []
    result = await invoke(server, "deploy", PKG, "--warm", "0")  # a fixed warm pool of 0 is asked for so
    assert result.exit_code == 0, result.output
    [deployment] = await client.list_deployments()
    assert (deployment.policy.warm, deployment.policy.warm_auto_factor) == (0, 0.0)


async def test_release_from_the_packages_store_node_is_refused_by_the_control_plane(cp):
    """Found in review: `cp release PKG store` was accepted, the store dropped its seeded copy and later scale-ups
    hung with no holder; the control plane refuses it, to every client."""
    server, client = cp
    await client.register(WorkerSpec(STORE, 1 << 30), {PKG: range(BLOCKS)})
    result = await invoke(server, "release", PKG, "store")
    assert isinstance(result.exception, InvalidRequest)
    assert str(result.exception) == (f"release of package {PKG!r} from 'store' refused: 'store' is its store node, "
                                     "which keeps it to send to scale-ups (removing the package drops it there)")
    assert server.state.releases == {} and server.state.availability[PKG].is_complete("store")


async def test_plans_of_an_unpublished_package_and_a_release_naming_a_worker_twice_fail(cp):
    """Found in review: `cp plans --package nope` printed an empty listing and `cp release PKG w1 w1` said it
    released the package from 2 workers, both exiting 0."""
    server, _ = cp
    unpublished = "0" * 64  # a name, or a prefix too short, is refused before it is sent
    result = await invoke(server, "plans", "--package", unpublished)
    assert isinstance(result.exception, UnknownPackage) and result.exit_code != 0
    assert str(result.exception) == f"package {unpublished!r} is not published"
    result = await invoke(server, "release", PKG, "w1", "w1", "--keep-alive", "1m")
    assert isinstance(result.exception, InvalidRequest) and result.exit_code != 0
    assert str(result.exception) == f"release of package {PKG!r}: a worker is listed twice"
    assert server.state.releases == {}


def test_a_tls_file_that_is_not_pem_is_named_with_its_setting(tmp_path):
    """Found in review: the control plane reported a bind error (its port blamed) and a client an unanswered call,
    after lines of gRPC's C-core logging."""
    from control_plane.auth import channel_credentials, server_credentials
    from control_plane.errors import TlsConfigError

    toml = tmp_path / "f.toml"
    toml.write_text("agent_port = 1\n")
    with pytest.raises(TlsConfigError, match=re.escape(f"TLS key {toml} (tls_key) holds no PEM block")):
        server_credentials(toml, toml, None)
    with pytest.raises(TlsConfigError, match=re.escape(f"TLS CA {toml} (tls_ca) holds no PEM block")):
        channel_credentials(toml, None, None)
