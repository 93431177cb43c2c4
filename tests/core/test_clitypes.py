"""The command-line parameter types every command shares."""

import pytest
from click.testing import CliRunner

from pipecast.cli import cli
from pipecast.core.clitypes import Number


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_a_number_that_is_not_finite_is_refused(value):
    """Found in review: click's FloatRange takes nan (every bound comparison with it is false) and inf: a router given
    --queue-timeout nan never answered a queued request, one given --upstream-timeout inf never gave up on a worker."""
    with pytest.raises(Exception, match="is not a finite number"):
        Number().convert(value, None, None)


def test_a_finite_number_keeps_its_bounds():
    assert Number(min=0, max=1).convert("0.5", None, None) == 0.5
    with pytest.raises(Exception, match="not in the range"):
        Number(min=0, min_open=True).convert("0", None, None)


@pytest.mark.parametrize("args", [["router", "--queue-timeout", "nan"], ["router", "--upstream-timeout", "inf"],
                                  ["control-plane", "--lease-s", "nan"], ["agent", "--link-mbit", "inf"],
                                  ["bench", "simulate", "--link-mbit", "nan"]])
def test_every_command_refuses_a_number_that_is_not_finite_before_it_starts(args):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "is not a finite number" in result.output, result.output
