"""`pipecast serve`'s options."""

import sys

import pytest
from click.testing import CliRunner

from pipecast.serve import command as command_module
from pipecast.serve.command import serve_command

pytestmark = pytest.mark.usefixtures("no_configured_agent")


def test_a_pipeline_step_timeout_past_what_a_stage_accepts_is_refused_up_front():
    """Every stage refuses a call whose deadline is past an hour: a longer step timeout failed every pipelined
    request (400 from the first stage) instead of being refused when the worker starts."""
    result = CliRunner().invoke(serve_command, ["pkg", "--pipeline-step-timeout", "4000"])
    assert result.exit_code == 2
    assert "Invalid value for '--pipeline-step-timeout': 4000.0 is not in the range 0<x<=3600" in result.output


@pytest.fixture
def started(monkeypatch, tmp_path) -> list:
    """The configs of the workers the command would run (none is): what it took, once its checks passed.
    ``tmp_path`` is a package folder (a manifest.json, as the command checks)."""
    (tmp_path / "manifest.json").write_text("{}")
    configs = []

    async def run_worker(worker, *args):
        configs.append(worker.config)

    monkeypatch.setattr(command_module, "run_worker", run_worker)
    monkeypatch.setattr(sys, "setswitchinterval", lambda interval: None)  # the test process keeps its own
    return configs


@pytest.mark.parametrize("option, value, message", [
    ("--stall-timeout", "inf", "'inf' is not a finite number"),
    ("--stall-timeout", "1e400", "'1e400' is not a finite number"),
    ("--stall-timeout", "nan", "'nan' is not a finite number"),
    ("--agent-timeout", "86401", "86401.0 is not in the range 0<x<=86400.0"),
    ("--agent-timeout", "nan", "'nan' is not a finite number"),
    ("--drain-timeout", "nan", "'nan' is not a finite number"),
    ("--pipeline-step-timeout", "nan", "'nan' is not a finite number"),
])
def test_timeouts_that_pipecast_load_or_the_worker_refuse_are_refused_up_front(tmp_path, started, option, value,
                                                                              message):
    """Found in review: --stall-timeout inf and --agent-timeout past a day (and nan anywhere) were taken, and the
    worker listened, then failed its load for good (503 until killed): pipecast.load refuses them."""
    result = CliRunner().invoke(serve_command, [str(tmp_path), option, value])
    assert result.exit_code == 2 and started == []
    assert f"Invalid value for '{option}': {message}" in result.output


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:01", "cuda:-1", "cpu "])
def test_a_device_the_engine_does_not_run_on_is_refused_before_the_worker_listens(tmp_path, started, device):
    """Found in review: a typo'd --device (gpu) printed "listening" and answered 503 until killed."""
    result = CliRunner().invoke(serve_command, [str(tmp_path), "--device", device])
    assert result.exit_code == 2 and started == []
    assert (f"Invalid value for '--device': {device!r} is not a device the engine runs on (cpu, cuda or cuda:N)"
            in result.output)


def test_a_device_setting_the_engine_does_not_run_on_is_refused_naming_the_setting(tmp_path, started, monkeypatch):
    monkeypatch.setenv("PIPECAST_DEVICE", "gpu")
    result = CliRunner().invoke(serve_command, [str(tmp_path)])
    assert result.exit_code == 2 and started == []
    assert "Invalid value for setting 'device': 'gpu' is not a device the engine runs on" in result.output


def _cuda_devices(monkeypatch, count: int) -> None:
    """Make torch see ``count`` CUDA devices (0: none, CUDA unavailable)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("device, devices, problem", [
    ("cuda", 0, "CUDA is not available on this host"), ("cuda:1", 1, "this host has 1 CUDA device(s)")])
def test_a_cuda_device_this_host_lacks_is_refused_before_the_worker_listens(tmp_path, started, monkeypatch, device,
                                                                           devices, problem):
    """Found in review: a CPU image on a GPU node, or cuda:1 on a node of one GPU, printed "listening" and answered
    503 until killed."""
    _cuda_devices(monkeypatch, devices)
    result = CliRunner().invoke(serve_command, [str(tmp_path), "--device", device])
    assert result.exit_code == 2 and started == []
    assert f"Invalid value for '--device': device={device!r}: {problem}" in result.output


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:12", "cpu:0"])
def test_the_devices_the_engine_runs_on_are_taken(tmp_path, started, monkeypatch, device):
    _cuda_devices(monkeypatch, 13)
    result = CliRunner().invoke(serve_command, [str(tmp_path), "--device", device])
    assert result.exit_code == 0, result.output
    assert [config.device for config in started] == [device]


def test_without_an_agent_a_package_that_is_not_here_is_refused_before_the_worker_listens(tmp_path, started):
    """Found in review: `pipecast serve` of a folder that does not exist, with no agent to wait for, printed
    "listening" and answered 503 until killed; it could never serve."""
    missing = str(tmp_path / "nope")
    result = CliRunner().invoke(serve_command, [missing])
    assert result.exit_code == 2 and started == []
    message = (f"Invalid value for 'PACKAGE': {missing!r} is neither a package folder (a folder with a manifest.json) "
               "nor in the agent's disk cache, and no agent is configured to hold it (--agent-socket; settings: "
               "agent_local_socket)")
    assert message in " ".join(result.output.split())
    # Found in review: a folder without a manifest passed, and the worker listened, failed for good.
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(serve_command, [str(empty)])
    assert result.exit_code == 2 and started == [] and "is neither a package folder" in result.output


def test_a_package_id_is_taken_from_the_disk_cache_or_waited_for_at_the_agent(tmp_path, started, monkeypatch):
    package_id = "ab" * 32
    monkeypatch.setenv("PIPECAST_AGENT_CACHE_DIR", str(tmp_path))
    (tmp_path / package_id).mkdir()
    (tmp_path / package_id / "manifest.json").write_text("{}")
    assert CliRunner().invoke(serve_command, [package_id]).exit_code == 0  # its copy in the disk cache
    monkeypatch.delenv("PIPECAST_AGENT_CACHE_DIR")
    socket = tmp_path / "agent.sock"  # not there yet: a scale-up may bring the package to it later
    assert CliRunner().invoke(serve_command, [package_id, "--agent-socket", str(socket)]).exit_code == 0
    assert [(config.package, config.agent) for config in started] == [(package_id, None), (package_id, socket)]


@pytest.mark.parametrize("package", ["ceadb4a69de8", "smollm2", "AB" * 32])
def test_with_an_agent_a_package_that_is_no_folder_nor_a_whole_id_is_refused(tmp_path, started, package,
                                                                             monkeypatch):
    """Found in review: an id's prefix as the listings print it, or a model's name, was asked of the agent as is
    and waited for in silence for good."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(serve_command, [package, "--agent-socket", str(tmp_path / "agent.sock")])
    assert result.exit_code == 2 and started == []
    assert (f"{package!r} is neither a package folder nor a whole package id (64 hex digits"
            in " ".join(result.output.split()))
