"""`pipecast status` is `pipecast cp status` at the top level: the same screen, JSON and options."""

import asyncio
import dataclasses
import json

from click.testing import CliRunner

from control_plane.client import ControlPlaneClient
from control_plane.command import cp_group
from control_plane.deployments import Deployment, ScalingPolicy
from control_plane.messages import WorkerSpec
from control_plane.server import ControlPlaneServer
from packager.manifest import seal_manifest
from pipecast.cli import cli
from tests.control_plane.test_service import PKG, STORE, TOKEN, WAIT_S, config, manifest, spec


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


async def test_status_tells_versions_of_one_model_apart_and_counts_serving_replicas_only(tmp_path):
    """Found in review: two versions of one model (a canary) read alike by name alone, and a deployment's line
    counted agents without a serving worker (a store pod), and workers serving another package, as replicas."""
    server = ControlPlaneServer(config(tmp_path / "cp.sqlite3"))
    await server.start()
    try:
        async with ControlPlaneClient(server.address, token=TOKEN, timeout_s=WAIT_S) as c:
            await c.publish_package(manifest(), STORE)
            other = await c.publish_package(_renamed("v2"), STORE)
            blocks = {PKG: range(4)}
            await c.register(dataclasses.replace(spec("w1"), serve_url="http://127.0.0.1:8001"), blocks)
            await c.register(spec("w2"), blocks)  # an agent without a serving worker
            await c.register(dataclasses.replace(spec("w3"), serve_url="http://127.0.0.1:8003", serve_package=other),
                             blocks)  # a worker serving the other version
            await c.register(dataclasses.replace(WorkerSpec(STORE, 1 << 30), serve_url="http://10.0.0.1:8009"),
                             blocks)
            await c.put_deployment(Deployment(PKG, ScalingPolicy()))
        result = await asyncio.to_thread(CliRunner().invoke, cli, ["status", "--control-plane", server.address,
                                                                   "--token", TOKEN])
        assert result.exit_code == 0, result.output
        assert f"pkg@{PKG[:8]}:4" in result.output and other[:8] in result.output
        assert f"pkg@{PKG[:8]}: 2 serving workers holding blocks" in result.output, result.output  # w1, the store
        # w3: found in review, a copy on a worker serving another package was not told apart
        assert f"pkg@{PKG[:8]}:4 (holds pkg@{PKG[:8]}, its worker serves pkg@{other[:8]})" in result.output, \
            result.output
    finally:
        await server.stop(grace_s=0)


def _renamed(name: str):
    """A manifest of another package of the same model name (a second version)."""
    m = manifest(name)
    m.model_name = "pkg"
    return seal_manifest(m)
