"""The ``pipecast`` command: benchmarks come from a source checkout, never from the installed runtime."""

import subprocess
import sys

import click
import pytest

from pipecast import cli


def test_bench_commands_are_found_in_the_checkout_from_any_folder(tmp_path):
    # From another folder the checkout is not on sys.path: the CLI adds the folder beside the package.
    out = subprocess.run([sys.executable, "-m", "pipecast.cli", "bench", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "distribution" in out.stdout and "control-plane" in out.stdout


def test_bench_without_a_checkout_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "CHECKOUT", tmp_path)
    with pytest.raises(click.ClickException, match="`pipecast bench` needs a source checkout: no benchmarks/"):
        cli._import_command_module("benchmarks.command")


# SIGTERM under main's handler while an event loop runs: in a plain callback (the gRPC poller's, in `bench
# control-plane`), then in the step of a task that another awaits (in a gather): left holding the exception, a
# task logs it with its traceback when collected.
_SIGTERM_IN_THE_LOOP = """
import asyncio, gc, os, signal, sys
from pipecast import cli

async def wait():
    if sys.argv[1] == "callback":
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
    else:
        os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.sleep(10)

async def waits():
    await asyncio.gather(wait(), asyncio.sleep(10))

cli.cli.main = lambda **kwargs: asyncio.run(waits())
code = cli.main([])
gc.collect()
raise SystemExit(code)
"""


@pytest.mark.parametrize("where", ["callback", "task"])
def test_sigterm_while_an_event_loop_runs_terminates_quietly(where):
    """Finding: asyncio logs a BaseException raised in a callback and runs on, so SIGTERM went unheeded."""
    done = subprocess.run([sys.executable, "-c", _SIGTERM_IN_THE_LOOP, where], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stderr) == (143, "terminated\n")
