"""`pipecast status` is `pipecast cp status` at the top level: the same screen, JSON and options."""

import asyncio
import json

from click.testing import CliRunner

from control_plane.client import ControlPlaneClient
from control_plane.command import cp_group
from control_plane.server import ControlPlaneServer
from pipecast.cli import cli
from tests.control_plane.test_service import PKG, STORE, TOKEN, WAIT_S, config, manifest


async def test_pipecast_status_prints_what_cp_status_prints(tmp_path):
    server = ControlPlaneServer(config(tmp_path / "cp.sqlite3"))
    await server.start()
    try:
        async with ControlPlaneClient(server.address, token=TOKEN, timeout_s=WAIT_S) as c:
            await c.publish_package(manifest(), STORE)
        target = ["--control-plane", server.address, "--token", TOKEN]

        async def invoke(command, args: list[str]) -> str:
            # The commands run their own event loop: off this test's.
            result = await asyncio.to_thread(CliRunner().invoke, command, args)
            assert result.exit_code == 0, result.output
            return result.output

        screen = await invoke(cli, ["status", *target])
        assert screen == await invoke(cp_group, [*target, "status"])
        assert "packages: 1" in screen and PKG[:12] in screen and "deployments: 0" in screen, screen
        data = json.loads(await invoke(cli, ["status", "--json", f"--control-plane={server.address}", "--token",
                                             TOKEN]))
        assert data == json.loads(await invoke(cp_group, ["status", *target, "--json"]))
        assert [p["package_id"] for p in data["packages"]] == [PKG] and data["workers"] == []
    finally:
        await server.stop(grace_s=0)


def test_pipecast_status_names_an_unreachable_control_plane():
    result = CliRunner().invoke(cli, ["status", "--control-plane", "127.0.0.1:1", "--json"])
    assert str(result.exception).startswith("control plane at 127.0.0.1:1 did not answer"), result.output
