"""`pipecast scaler`'s command line: what `run` takes (the daemon itself is not started), how the daemon it runs
ends and answers /health (over a fake control plane), and `events` against a real control plane on loopback
(port 0)."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner

from control_plane.client import ControlPlaneClient
from control_plane.deployments import Deployment, ScaleEvent, ScalingPolicy
from control_plane.errors import InvalidRequest, Unauthenticated, UnknownPackage
from control_plane.server import ControlPlaneServer
from pipecast.core.credentials import issue_node_token
from pipecast.core.httpserve import listening
from pipecast.core.settings import load_settings
from pipecast.scaler import command
from pipecast.scaler.daemon import ScalerConfig
from tests.control_plane.test_service import PKG, STORE, TOKEN, WAIT_S, config, manifest


@pytest.fixture
def started(monkeypatch) -> list[ScalerConfig]:
    """The configurations `scaler run` would start the daemon with (it starts none)."""
    configs: list[ScalerConfig] = []

    async def run(settings, scaler_config: ScalerConfig, host: str, port: int | None) -> None:
        configs.append(scaler_config)

    monkeypatch.setattr(command, "_run", run)
    return configs


def test_run_takes_only_the_planners_strategies_or_none(started):
    """Found in review: `scaler run --plan-strategy bogus` was accepted, then every tick wrote scale_up and hold
    events 'unknown strategy'."""
    result = CliRunner().invoke(command.scaler_group, ["run", "--plan-strategy", "bogus"])
    assert result.exit_code == 2 and started == []
    assert ("Error: Invalid value for '--plan-strategy': 'bogus' is not one of '', 'unicast', 'chain', 'tree', "
            "'binomial', 'rotated'.") in result.output
    for given, strategy in ((["--plan-strategy", "chain"], "chain"), (["--plan-strategy", ""], ""), ([], "")):
        assert CliRunner().invoke(command.scaler_group, ["run", *given]).exit_code == 0
        assert started.pop().plan_strategy == strategy


@pytest.mark.parametrize("flag", ["--tick", "--router-timeout"])
def test_run_refuses_a_tick_or_router_timeout_of_0(started, flag):
    """Found in review: `scaler run --tick 0` was accepted and busy-looped at 70% CPU; `--router-timeout 0` too."""
    result = CliRunner().invoke(command.scaler_group, ["run", flag, "0s"])
    assert result.exit_code == 2 and started == []
    assert f"Error: Invalid value for '{flag}': must be longer than 0, got '0s'" in result.output
    # --watch 0 is documented: only at ticks.
    assert CliRunner().invoke(command.scaler_group, ["run", flag, "500ms", "--watch", "0"]).exit_code == 0
    assert (started[0].tick_s if flag == "--tick" else started[0].router_timeout_s, started[0].watch_s) == (0.5, 0)


@contextlib.asynccontextmanager
async def one_event(tmp_path) -> AsyncIterator[Callable[..., Any]]:
    """A control plane with a deployment and one event in its trail; yields `scaler events` run against it with
    the arguments given (in a thread: the command runs its own event loop)."""
    server = ControlPlaneServer(config(tmp_path / "cp.sqlite3"))
    await server.start()
    try:
        async with ControlPlaneClient(server.address, token=TOKEN, timeout_s=WAIT_S) as client:
            await client.publish_package(manifest(), STORE)
            await client.put_deployment(Deployment(PKG, ScalingPolicy()))
            await client.append_scale_event(ScaleEvent(at=1.0, package_id=PKG, action="hold", reason="quiet"))

        async def events(*args: str):
            return await asyncio.to_thread(CliRunner().invoke, command.scaler_group,
                                           ["events", "--control-plane", server.address, *args])
        yield events
    finally:
        await server.stop(grace_s=0)


def test_run_refuses_a_source_keep_the_control_plane_would_refuse_at_every_release(started):
    """Found in review: --source-keep 25h was taken, and every release was refused from then on (keep-alive past
    a day) while /health said ok: idle replicas were never released."""
    result = CliRunner().invoke(command.scaler_group, ["run", "--source-keep", "25h"])
    assert result.exit_code == 2 and not started
    assert "Invalid value for '--source-keep': must be at most 86400 s, got '25h'" in result.output
    assert CliRunner().invoke(command.scaler_group, ["run", "--source-keep", "24h"]).exit_code == 0


async def test_events_takes_the_token_as_cp_does(tmp_path):
    """Found in review: `scaler events --token X` said no such option, while `cp` and `status` take --token (and
    --token-file)."""
    async with one_event(tmp_path) as events:
        result = await events("--token", TOKEN, "--json")
        assert result.exit_code == 0, result.output
        assert '"reason": "quiet"' in result.output
        assert isinstance((await events("--token", "wrong", "--json")).exception, Unauthenticated)
        token = tmp_path / "token"  # out of sight of `ps`, as `cp --token-file` reads it
        token.write_text(TOKEN)
        token.chmod(0o600)
        result = await events("--token-file", str(token), "--json")
        assert result.exit_code == 0 and '"reason": "quiet"' in result.output, result.output


async def test_events_takes_the_start_of_a_package_id_as_the_listings_print_it(tmp_path):
    """Review of the scaler, finding 7: `scaler events --package` with the 12 characters it prints printed nothing
    and exited 0."""
    async with one_event(tmp_path) as events:
        result = await events("--token", TOKEN, "--package", PKG[:12])
        assert result.exit_code == 0 and result.output.endswith(f" {PKG[:12]} hold      0 desired 0 actual 0: quiet\n")
        unknown = (await events("--token", TOKEN, "--package", "0123456789ab")).exception
        assert isinstance(unknown, UnknownPackage)
        assert str(unknown) == "no published package id starts with '0123456789ab'"


class FailingClient:
    """A control plane's client whose deployment listing fails with a bug once ``failing`` is set."""

    def __init__(self) -> None:
        self.failing = asyncio.Event()

    async def __aenter__(self) -> "FailingClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def list_deployments(self):
        if self.failing.is_set():
            raise RuntimeError("a bug")
        return []


async def test_the_daemon_exits_with_the_error_that_ends_its_loop_not_on_with_health_ok(monkeypatch, capsys):
    """Review of the scaler, finding 1: the loop died and `scaler run --port` went on answering /health ok, scaling
    nothing, until a SIGTERM brought its error up."""
    client = FailingClient()
    monkeypatch.setattr(ControlPlaneClient, "from_settings", lambda settings: client)
    settings = load_settings(None, control_plane="127.0.0.1:1")
    run = asyncio.create_task(command._run(settings, ScalerConfig(tick_s=0.05), "127.0.0.1", 0))
    while "scaler metrics on " not in (err := capsys.readouterr().err):
        await asyncio.sleep(0.01)
    url = err.split("scaler metrics on ")[1].split()[0]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/health") as answer:
            assert (answer.status, await answer.json()) == (200, {"status": "ok", "failed_ticks": 0,
                                                                  "deployments": []})
    client.failing.set()
    await asyncio.wait([run], timeout=5)
    assert run.done(), "the daemon went on after its loop failed"
    with pytest.raises(RuntimeError, match="a bug"):
        run.result()


async def test_health_answers_503_once_the_loop_has_failed():
    async def fail():
        raise RuntimeError("a bug")

    task = asyncio.create_task(fail())
    await asyncio.wait([task])
    async with listening(command._app(None, task), "127.0.0.1", 0) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/health") as answer:
            assert (answer.status, await answer.json()) == (503, {"status": "failed", "error": "RuntimeError: a bug"})


async def test_health_says_degraded_while_ticks_fail_to_reach_the_control_plane():
    """It answered ok while every tick failed (the control plane down, or refusing the daemon's token): nothing was
    scaled and nothing showed it but a log line a second. Still 200: a restart would mend no outage."""
    scaler = SimpleNamespace(failed_ticks=3, tracked={})
    task = asyncio.create_task(asyncio.Event().wait())
    try:
        async with listening(command._app(scaler, task), "127.0.0.1", 0) as url, aiohttp.ClientSession() as http:
            async with http.get(f"{url}/health") as answer:
                assert (answer.status, await answer.json()) == (200, {"status": "degraded", "failed_ticks": 3,
                                                                      "deployments": []})
    finally:
        task.cancel()


async def test_events_takes_a_package_id_in_either_case_and_refuses_a_start_too_short(tmp_path):
    """Walkthrough finding 5: `scaler events --package` with 6 hex digits, or in capitals, printed nothing and
    exited 0."""
    async with one_event(tmp_path) as events:
        result = await events("--token", TOKEN, "--package", PKG[:12].upper())
        assert result.exit_code == 0 and result.output.endswith(f" {PKG[:12]} hold      0 desired 0 actual 0: quiet\n")
        refused = (await events("--token", TOKEN, "--package", PKG[:6])).exception
        assert isinstance(refused, InvalidRequest)
        assert str(refused) == (f"package id {PKG[:6]!r} is neither a whole package id (64 hex digits) nor the start "
                                "of one (8 hex digits or more)")


def test_events_limit_past_the_protocols_range_is_a_usage_error():
    """Found in review: --limit 5000000000 ended in protobuf's ValueError traceback."""
    result = CliRunner().invoke(command.scaler_group,
                                ["events", "--control-plane", "127.0.0.1:1", "--limit", "5000000000"])
    assert result.exit_code == 2 and "is not in the range 1<=x<=4294967295" in result.output, result.output


def test_the_daemon_with_a_node_token_is_refused_at_its_start(monkeypatch):
    """Found in review: it started, /health ok, and failed only at its first action, every tick from then on."""
    monkeypatch.setenv("PIPECAST_AUTH_TOKEN", issue_node_token("m" * 16 + "0123456789abcdef", "w1"))
    result = CliRunner().invoke(command.scaler_group, ["run", "--control-plane", "127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert "auth_token is node 'w1''s token: the scaling daemon acts as the operator" in " ".join(result.output.split())
