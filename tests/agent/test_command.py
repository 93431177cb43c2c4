"""``pipecast agent``'s options, checked before the agent starts."""

import socket
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from pipecast.agent.command import agent_command
from pipecast.core.settings import load_settings


@pytest.mark.parametrize("value", ["nan", "inf", f"{time.time() * 1000:.0f}"])  # the last: milliseconds
def test_a_start_time_that_is_no_time_soon_is_refused_before_the_agent_starts(value):
    """Found in review: the agent slept until then (for good) without a word, listening but never fetching."""
    result = CliRunner().invoke(agent_command, ["--start-at", value, "--listen", "127.0.0.1:0"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--start-at'" in result.output
    assert "is no time within a day from now in seconds since the epoch" in result.output


@pytest.fixture
def agents(monkeypatch) -> SimpleNamespace:
    """The options and the settings of each agent the command starts (a stand-in that returns at once); no settings
    file, control plane, node id, cache folder or local socket set in the environment."""
    import pipecast.agent.command as command

    started = SimpleNamespace(options=[], settings=[])

    class Daemon:
        def __init__(self, agent_options, settings):
            started.options.append(agent_options)
            started.settings.append(settings)

        async def run(self):
            return None

    monkeypatch.setattr(command, "AgentDaemon", Daemon)
    for variable in ("PIPECAST_CONFIG", "PIPECAST_CONTROL_PLANE", "PIPECAST_AGENT_NODE_ID", "PIPECAST_AGENT_CACHE_DIR",
                     "PIPECAST_AGENT_LOCAL_SOCKET"):
        monkeypatch.delenv(variable, raising=False)
    return started


@pytest.fixture
def started(agents) -> list:
    """The options of each agent the command starts (:func:`agents`)."""
    return agents.options


def test_the_control_plane_setting_is_registered_with_where_no_flag_names_one(monkeypatch, started):
    """Found in review: with PIPECAST_CONTROL_PLANE set (the README's setting of the control plane's address) and no
    --control-plane, the agent ran standalone, silently, never registering."""
    monkeypatch.setenv("PIPECAST_CONTROL_PLANE", "10.0.0.9:7000")
    listen = ["--listen", "127.0.0.1:0", "--node-id", "n1"]
    assert CliRunner().invoke(agent_command, listen).exit_code == 0
    assert CliRunner().invoke(agent_command, [*listen, "--control-plane", "10.0.0.8:7000"]).exit_code == 0
    monkeypatch.delenv("PIPECAST_CONTROL_PLANE")
    assert CliRunner().invoke(agent_command, listen).exit_code == 0  # the default: none
    assert [options.control_plane for options in started] == ["10.0.0.9:7000", "10.0.0.8:7000", None]


def test_any_free_port_under_a_control_plane_needs_a_node_id(monkeypatch, started):
    """Found in review: the default node id, hostname:port, was taken before listening: every agent on a host given
    --listen HOST:0 registered as hostname:0, and the second was refused (NodeIdInUse) after a minute."""
    refused = CliRunner().invoke(agent_command, ["--listen", "127.0.0.1:0", "--control-plane", "127.0.0.1:43700"])
    assert refused.exit_code == 2 and started == []
    assert ("Error: --listen HOST:0 (any free port) under a control plane needs --node-id: the default node id, "
            "hostname:port, would be hostname:0 for every such agent on this host") in refused.output
    assert CliRunner().invoke(agent_command, ["--listen", "127.0.0.1:0", "--control-plane", "127.0.0.1:43700",
                                              "--node-id", "n1"]).exit_code == 0
    monkeypatch.setenv("PIPECAST_AGENT_NODE_ID", "n2")  # the setting names it as well
    assert CliRunner().invoke(agent_command, ["--listen", "127.0.0.1:0", "--control-plane", "127.0.0.1:43700"]
                              ).exit_code == 0
    monkeypatch.delenv("PIPECAST_AGENT_NODE_ID")
    assert CliRunner().invoke(agent_command, ["--listen", "127.0.0.1:0"]).exit_code == 0  # no control plane: no need
    assert [options.node_id for options in started] == ["n1", "n2", f"{socket.gethostname()}:0"]


def test_listen_takes_one_address_not_a_list(started):
    """Found in review: --listen took the control plane's comma-separated replica list, and a:1,b:2 failed late, when
    listening, with a misleading message."""
    result = CliRunner().invoke(agent_command, ["--listen", "127.0.0.1:43701,10.0.0.1:43702"])
    assert result.exit_code == 2 and started == []
    assert ("Invalid value for '--listen': one host:port address to listen on, not a list: "
            "'127.0.0.1:43701,10.0.0.1:43702'") in result.output


def test_an_events_file_in_a_missing_folder_is_refused_before_the_agent_starts(tmp_path, started):
    """Found in review: the agent failed with a traceback as it opened the events file."""
    missing = tmp_path / "missing" / "events.jsonl"
    result = CliRunner().invoke(agent_command, ["--events", str(missing), "--listen", "127.0.0.1:0"])
    assert result.exit_code == 2 and started == []
    assert f"Invalid value for '--events': cannot append to {missing}: No such file or directory" in result.output


def test_a_cache_dir_setting_that_is_a_file_is_refused_as_the_flag_is(monkeypatch, started, tmp_path):
    """Found in review: --cache-dir FILE was refused, PIPECAST_AGENT_CACHE_DIR=FILE ran without a word (every cache
    write then failed)."""
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("PIPECAST_AGENT_CACHE_DIR", str(tmp_path / "afile"))
    result = CliRunner().invoke(agent_command, ["--listen", "127.0.0.1:0"])
    assert result.exit_code == 2 and started == []
    assert f"Invalid value for '--cache-dir' (setting agent_cache_dir): {str(tmp_path / 'afile')!r} is not a folder" \
        in " ".join(result.output.split())


def test_an_empty_cache_dir_or_local_socket_leaves_its_setting_unset(monkeypatch, tmp_path, agents):
    """Found in review: click made ``--cache-dir ""`` the working directory, which the agent then cached in (and made
    room in by removing its folders named as package ids); an empty value is unset, as an empty variable is."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(agent_command, ["--cache-dir", "", "--local-socket", "", "--listen", "127.0.0.1:0"])
    assert result.exit_code == 0, result.output
    [settings] = agents.settings
    assert settings.agent_cache_dir is None and settings.agent_local_socket is None


@pytest.mark.parametrize("missing", [True, False], ids=["missing", "a-file"])
def test_a_local_socket_whose_folder_is_not_there_is_refused_before_the_agent_starts(tmp_path, started, missing,
                                                                                     monkeypatch):
    """Found in review: a --local-socket in a missing folder was reported only after the seed was verified and the
    data port said listening."""
    folder = tmp_path / "run"
    if not missing:
        folder.write_text("")
    path = folder / "agent.sock"
    why = "does not exist" if missing else "is not a folder"
    result = CliRunner().invoke(agent_command, ["--local-socket", str(path), "--listen", "127.0.0.1:0"])
    assert result.exit_code == 2 and started == []
    assert (f"Invalid value for '--local-socket' (setting agent_local_socket): the folder of {str(path)!r}, "
            f"{str(folder)!r}, {why}") in " ".join(result.output.split())
    monkeypatch.setenv("PIPECAST_AGENT_LOCAL_SOCKET", str(path))  # the setting is checked as the flag is
    assert CliRunner().invoke(agent_command, ["--listen", "127.0.0.1:0"]).exit_code == 2 and started == []
    assert CliRunner().invoke(agent_command, ["--local-socket", str(tmp_path / "agent.sock"), "--listen",
                                              "127.0.0.1:0"]).exit_code == 0


def test_a_reserve_of_zero_is_none_and_other_sizes_stay_positive(monkeypatch, started):
    """Found in review: --reserve 0 was refused ("size must be positive") though the README and the setting say 0
    means none."""
    import pipecast.agent.command as command

    reserves = []
    monkeypatch.setattr(command, "load_settings", lambda **kw: (reserves.append(kw["agent_reserve_bytes"]),
                                                               load_settings(**kw))[1])
    monkeypatch.setenv("PIPECAST_AGENT_RESERVE_BYTES", "1GiB")
    for value in ("0", "0GiB"):
        result = CliRunner().invoke(agent_command, ["--reserve", value, "--listen", "127.0.0.1:0"])
        assert result.exit_code == 0, result.output
    assert reserves == [0, 0]  # none, over the environment's
    result = CliRunner().invoke(agent_command, ["--memory", "0", "--listen", "127.0.0.1:0"])
    assert result.exit_code == 2 and "Invalid value for '--memory': size must be positive: '0'" in result.output


def test_the_package_the_serving_worker_serves_is_a_whole_id_beside_a_serve_url(monkeypatch, started):
    """Found in review: nothing told the control plane which package a node's worker serves, so the scaling daemon
    placed another deployment's package there. --serve-package (or its setting) says it: a whole package id, of
    the worker at --serve-url."""
    for variable in ("PIPECAST_AGENT_SERVE_URL", "PIPECAST_AGENT_SERVE_PACKAGE"):
        monkeypatch.delenv(variable, raising=False)
    listen, serve = ["--listen", "127.0.0.1:0"], ["--serve-url", "http://127.0.0.1:8000"]
    result = CliRunner().invoke(agent_command, [*listen, *serve, "--serve-package", "a" * 64])
    assert result.exit_code == 0, result.output
    monkeypatch.setenv("PIPECAST_AGENT_SERVE_PACKAGE", "b" * 64)
    assert CliRunner().invoke(agent_command, [*listen, *serve]).exit_code == 0
    assert CliRunner().invoke(agent_command, listen + ["--serve-url", ""]).exit_code == 2
    monkeypatch.delenv("PIPECAST_AGENT_SERVE_PACKAGE")
    assert CliRunner().invoke(agent_command, listen).exit_code == 0
    assert [o.serve_package for o in started] == ["a" * 64, "b" * 64, ""]
    result = CliRunner().invoke(agent_command, [*listen, *serve, "--serve-package", "A" * 64])
    assert result.exit_code == 2 and f"Invalid value for '--serve-package' (setting agent_serve_package): " \
        f"'{'A' * 64}' is not a whole package id (64 lowercase hex digits" in result.output, result.output
    result = CliRunner().invoke(agent_command, [*listen, "--serve-package", "a" * 64])
    assert result.exit_code == 2 and "--serve-package names what the serving worker at --serve-url serves: it " \
        "needs --serve-url" in result.output, result.output
