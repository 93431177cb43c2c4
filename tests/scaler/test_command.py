"""`pipecast scaler`'s command line: what `run` takes (the daemon itself is not started) and `events` against a
real control plane on loopback (port 0)."""

import asyncio

import pytest
from click.testing import CliRunner

from control_plane.client import ControlPlaneClient
from control_plane.deployments import Deployment, ScaleEvent, ScalingPolicy
from control_plane.errors import Unauthenticated
from control_plane.server import ControlPlaneServer
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


async def test_events_takes_the_token_as_cp_does(tmp_path):
    """Found in review: `scaler events --token X` said no such option, while `cp` and `status` take --token."""
    server = ControlPlaneServer(config(tmp_path / "cp.sqlite3"))
    await server.start()
    try:
        async with ControlPlaneClient(server.address, token=TOKEN, timeout_s=WAIT_S) as client:
            await client.publish_package(manifest(), STORE)
            await client.put_deployment(Deployment(PKG, ScalingPolicy()))
            await client.append_scale_event(ScaleEvent(at=1.0, package_id=PKG, action="hold", reason="quiet"))

        def events(token: str):
            return CliRunner().invoke(command.scaler_group, ["events", "--control-plane", server.address, "--token",
                                                             token, "--json"])
        result = await asyncio.to_thread(events, TOKEN)
        assert result.exit_code == 0, result.output
        assert '"reason": "quiet"' in result.output
        assert isinstance((await asyncio.to_thread(events, "wrong")).exception, Unauthenticated)
    finally:
        await server.stop(grace_s=0)
