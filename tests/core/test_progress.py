"""Progress: a bar only on a terminal, the task's lines unchanged everywhere else."""

import io

from pipecast.core.progress import NO_PROGRESS, Progress
from tests.support.terminal import Terminal


def run_task(progress: Progress) -> None:
    progress("starting")
    progress.start(4, "task", unit="step")
    for step in range(4):
        progress.advance()
        progress.status(f"step {step + 1}/4")
    progress("done")
    progress.close()


def test_without_a_terminal_there_is_no_bar_and_every_line_is_written_as_it_was():
    lines: list[str] = []
    stream = io.StringIO()  # a pipe, a log file, captured output: not a terminal
    progress = Progress(lines.append, terminal=stream)
    assert not progress.draws_bar
    run_task(progress)
    assert lines == ["starting", "step 1/4", "step 2/4", "step 3/4", "step 4/4", "done"]
    assert stream.getvalue() == ""


def test_on_a_terminal_the_bar_is_drawn_and_statuses_go_beside_it_not_as_lines():
    lines: list[str] = []
    terminal = Terminal()
    progress = Progress(lines.append, terminal=terminal)
    assert progress.draws_bar
    run_task(progress)
    assert lines == ["starting", "done"]  # the task's own lines still come out, whole
    drawn = terminal.getvalue()
    assert "task" in drawn and "4/4" in drawn and "100%" in drawn and "step 4/4" in drawn, drawn


def test_lines_written_while_a_bar_is_up_reach_their_sink():
    terminal = Terminal()
    written: list[str] = []
    with Progress(written.append, terminal=terminal) as progress:
        progress.start(2, "runs")
        progress.advance()
        progress("run 1: 1.23 s")
    assert written == ["run 1: 1.23 s"]
    assert "runs" in terminal.getvalue()


def test_byte_units_are_scaled():
    terminal = Terminal()
    with Progress(terminal=terminal) as progress:
        progress.start(3 << 20, "pack", byte_units=True)
        progress.advance(3 << 20)
    assert "3.00M/3.00M" in terminal.getvalue(), terminal.getvalue()


def test_no_progress_reports_nothing_and_keeps_no_bar():
    run_task(NO_PROGRESS)
    assert not NO_PROGRESS.draws_bar
