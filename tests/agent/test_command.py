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
