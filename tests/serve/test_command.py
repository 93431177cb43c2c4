"""`pipecast serve`'s options."""

from click.testing import CliRunner

from pipecast.serve.command import serve_command


def test_a_pipeline_step_timeout_past_what_a_stage_accepts_is_refused_up_front():
    """Every stage refuses a call whose deadline is past an hour: a longer step timeout failed every pipelined
    request (400 from the first stage) instead of being refused when the worker starts."""
    result = CliRunner().invoke(serve_command, ["pkg", "--pipeline-step-timeout", "4000"])
    assert result.exit_code == 2
    assert "Invalid value for '--pipeline-step-timeout': 4000.0 is not in the range 0<x<=3600" in result.output
