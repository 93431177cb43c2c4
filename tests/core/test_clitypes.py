"""The command-line parameter types every command shares."""

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipecast.cli import cli
from pipecast.core.clitypes import Number, SettingPath


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


def test_an_empty_setting_path_is_none_not_the_working_directory():
    """Found in review: click made ``--cache-dir ""`` Path(""), the working directory, before the settings' own
    empty-is-unset check could see it."""
    assert SettingPath(file_okay=False, path_type=Path).convert("", None, None) is None
    assert SettingPath(exists=True, path_type=Path).convert("", None, None) is None  # not "does not exist"
    assert SettingPath(path_type=Path).convert("a", None, None) == Path("a")


# Every path option that backs a setting, as (command words, option, parameter name, other arguments it needs).
SETTING_PATH_OPTIONS = [(["agent"], "--cache-dir", "cache_dir", []),
                        (["agent"], "--local-socket", "local_socket", []),
                        (["serve"], "--agent-socket", "agent_socket", ["PACKAGE"]),
                        (["control-plane"], "--config", "config", []),
                        (["cp"], "--config", "config", ["workers"]),
                        (["scaler", "run"], "--config", "config", []),
                        (["scaler", "events"], "--config", "config", [])]


@pytest.mark.parametrize(("words", "option", "name", "others"), SETTING_PATH_OPTIONS,
                         ids=[" ".join(words) + " " + option for words, option, _, _ in SETTING_PATH_OPTIONS])
def test_every_path_option_of_a_setting_takes_an_empty_value_for_unset(words, option, name, others):
    """Found in review: ``pipecast agent --cache-dir ""`` cached in the working directory (and made room there by
    removing its folders named as package ids); an empty value leaves the setting unset, as an empty variable does."""
    command, ctx = cli, None
    for word in words:
        ctx = click.Context(command, parent=ctx)
        command = command.get_command(ctx, word)
    assert isinstance(next(p for p in command.params if p.name == name).type, SettingPath)
    assert command.make_context(words[-1], [option, "", *others]).params[name] is None
