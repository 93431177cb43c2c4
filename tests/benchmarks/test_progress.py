"""Benchmarks: a bar over their runs on a terminal only; their progress lines and report unchanged."""

from click.testing import CliRunner

from benchmarks.command import bench_group
from tests.support.terminal import run_on_a_terminal

# The chaos scenario that runs the packager alone: a benchmark in well under a second.
ARGS = ["chaos", "--short", "--only", "symlinked-checkpoint"]
LINES = ["chaos: symlinked-checkpoint ...", "chaos: symlinked-checkpoint: PASS in "]


def test_without_a_terminal_a_benchmark_writes_its_lines_and_no_bar(tmp_path):
    result = CliRunner().invoke(bench_group, [*ARGS, "--workdir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    written = result.stderr.splitlines()
    assert len(written) == 2 and all(line.startswith(start) for line, start in zip(written, LINES)), written
    assert "\r" not in result.stderr and "all scenarios passed" in result.stdout


def test_on_a_terminal_the_bar_counts_the_runs_below_the_same_lines(tmp_path):
    code, stdout, drawn = run_on_a_terminal(["bench", *ARGS, "--workdir", str(tmp_path)])
    assert code == 0 and "all scenarios passed" in stdout, drawn
    assert "chaos: 100%" in drawn and "1/1" in drawn, drawn
    assert all(line in drawn for line in LINES), drawn
