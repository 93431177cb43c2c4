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
