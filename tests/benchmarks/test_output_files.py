"""Every bench's output files (--json, --plot, --csv) are checked when the options are parsed, not after the run."""

import json

import click
import pytest
from click.testing import CliRunner

from benchmarks.command import bench_group

SIMULATE = ["simulate", "--nodes", "2", "--strategy", "chain", "--model-bytes", "1MiB"]


def _file_options(command):
    return [p for p in command.params if p.name in ("json_path", "plot_path", "csv_path")]


def test_a_folder_is_refused_by_every_output_file_option_before_the_run(tmp_path):
    """Finding: `bench pack --json DIR` packed, then died with IsADirectoryError, its figures lost."""
    for name, command in bench_group.commands.items():
        for option in _file_options(command):
            with pytest.raises(click.BadParameter, match="is a directory"):  # parsed, not run
                command.make_context(name, [option.opts[0], str(tmp_path)])


def test_a_missing_folder_is_made_when_the_figures_land_in_it(tmp_path):
    """Finding: `--json /nonexist/x.json` ran the whole bench, then died with FileNotFoundError."""
    out = tmp_path / "new" / "deeper" / "sim.json"
    result = CliRunner().invoke(bench_group, [*SIMULATE, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["results"]


def test_a_run_refused_after_parsing_leaves_no_folder_behind(tmp_path):
    """Finding: the --json option's folder was made while parsing, left empty when a later check refused the run."""
    out = tmp_path / "new" / "sim.json"
    result = CliRunner().invoke(bench_group, [*SIMULATE, "--json", str(out), "--package", str(tmp_path / "none")])
    assert result.exit_code != 0
    assert not (tmp_path / "new").exists()


def test_a_folder_that_cannot_be_made_is_refused_before_the_run(tmp_path):
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(bench_group, [*SIMULATE, "--json", str(tmp_path / "file" / "sim.json")])
    assert result.exit_code == 2
    assert (f"Invalid value for '--json': cannot make its folder {tmp_path / 'file'}: {tmp_path / 'file'} is not a "
            "folder") in result.output
    assert "x S/B" not in result.output  # nothing simulated
