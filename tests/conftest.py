"""Fixtures used by tests in several folders (a folder's own fixtures are in its conftest.py)."""

from collections.abc import Callable

import pytest

from tests.support import packages
from tests.support.agent_processes import Agents
from tests.support.packages import TinyPackage


@pytest.fixture
def agents(tmp_path):
    """Agent processes of one test (see :class:`tests.support.agent_processes.Agents`), all stopped at the end."""
    running = Agents(tmp_path)
    yield running
    running.stop_all()


@pytest.fixture
def tiny_package(tmp_path) -> Callable[..., TinyPackage]:
    """Builds tiny packages in the test's folder: ``tiny_package(arch, name="pkg", **options)`` is
    :func:`tests.support.packages.tiny_package` at ``tmp_path / name``."""
    def build(arch: str = "llama", *, name: str = "pkg", **options) -> TinyPackage:
        return packages.tiny_package(tmp_path / name, arch, **options)
    return build


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` (:class:`tests.support.mlflow_server.MlflowServer`) shared by the session's
    MLflow tests, started on first use (~10 s), stopped at the end; MLflow's telemetry off in this process."""
    from tests.support.mlflow_server import SERVER_ENV, MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_DISABLE_TELEMETRY", SERVER_ENV["MLFLOW_DISABLE_TELEMETRY"])
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):  # the tests name their server
            env.delenv(name, raising=False)
        try:
            yield server.start()
        finally:
            server.stop()


@pytest.fixture
def no_configured_agent(monkeypatch):
    """No node agent from the environment: ``pipecast.load`` and the serving worker read the package folder."""
    for name in ("PIPECAST_AGENT_LOCAL_SOCKET", "PIPECAST_CONFIG", "PIPECAST_AGENT_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server (:class:`tests.support.postgres.PostgresServer`) shared by the session's tests,
    started on first use, stopped at the end; skips (or fails, with PIPECAST_REQUIRE_POSTGRES=1) without one."""
    from tests.support.postgres import start_server

    server = start_server()
    try:
        yield server
    finally:
        server.stop()
