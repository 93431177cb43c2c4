"""``pipecast agent``'s options, checked before the agent starts."""

import time

import pytest
from click.testing import CliRunner

from pipecast.agent.command import agent_command


@pytest.mark.parametrize("value", ["nan", "inf", f"{time.time() * 1000:.0f}"])  # the last: milliseconds
def test_a_start_time_that_is_no_time_soon_is_refused_before_the_agent_starts(value):
    """Found in review: the agent slept until then (for good) without a word, listening but never fetching."""
    result = CliRunner().invoke(agent_command, ["--start-at", value, "--listen", "127.0.0.1:0"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--start-at'" in result.output
    assert "is no time within a day from now in seconds since the epoch" in result.output


def test_the_control_plane_setting_is_registered_with_where_no_flag_names_one(monkeypatch):
    """Found in review: with PIPECAST_CONTROL_PLANE set (the README's setting of the control plane's address) and no
    --control-plane, the agent ran standalone, silently, never registering."""
    import pipecast.agent.command as command

    started = []

    class Daemon:
        def __init__(self, options, settings):
            started.append(options)

        async def run(self):
            return None

    monkeypatch.setattr(command, "AgentDaemon", Daemon)
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    monkeypatch.setenv("PIPECAST_CONTROL_PLANE", "10.0.0.9:7000")
    assert CliRunner().invoke(agent_command, ["--listen", "127.0.0.1:0"]).exit_code == 0
    assert CliRunner().invoke(agent_command, ["--listen", "127.0.0.1:0", "--control-plane", "10.0.0.8:7000"]
                              ).exit_code == 0
    monkeypatch.delenv("PIPECAST_CONTROL_PLANE")
    assert CliRunner().invoke(agent_command, ["--listen", "127.0.0.1:0"]).exit_code == 0  # the default: none
    assert [options.control_plane for options in started] == ["10.0.0.9:7000", "10.0.0.8:7000", None]
