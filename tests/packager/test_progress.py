"""pack, verify and convert-gguf: a progress bar on a terminal only; elsewhere pack's lines as before."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.tiny_checkpoints import make_checkpoint
from packager.errors import CheckpointError
from packager.gguf_convert import convert_gguf
from packager.manifest import read_manifest
from packager.verify import verify_package
from pipecast.cli import cli
from pipecast.core.progress import Progress
from tests.support.terminal import Terminal, run_on_a_terminal


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


def block_lines(package: Path) -> list[str]:
    """The lines pack writes per block when stderr is not a terminal."""
    manifest = read_manifest(package)
    n = len(manifest.blocks)
    return [f"block {b.index + 1}/{n}: layers {b.layer_start}-{b.layer_end - 1}, {b.bytes} bytes"
            for b in manifest.blocks]


def test_pack_and_verify_write_no_bar_when_stderr_is_not_a_terminal(checkpoint, tmp_path):
    result = CliRunner().invoke(cli, ["pack", str(checkpoint), str(tmp_path / "pkg"), "--layers-per-block", "2"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == block_lines(tmp_path / "pkg")  # the lines, unchanged, and nothing else
    assert result.stdout.startswith(f"packed {tmp_path / 'pkg'}: 2 blocks, ")
    verified = CliRunner().invoke(cli, ["verify", str(tmp_path / "pkg")])
    assert verified.exit_code == 0 and verified.stderr == "" and verified.stdout == f"{tmp_path / 'pkg'}: OK\n"
    as_json = CliRunner().invoke(cli, ["pack", str(checkpoint), str(tmp_path / "pkg"), "--force", "--json"])
    assert as_json.exit_code == 0 and as_json.stderr == ""


def test_pack_and_verify_draw_a_bar_on_a_terminal_instead_of_lines(checkpoint, tmp_path):
    out = tmp_path / "pkg"
    code, stdout, drawn = run_on_a_terminal(["pack", str(checkpoint), str(out), "--layers-per-block", "2"])
    assert code == 0 and stdout.startswith(f"packed {out}: 2 blocks, "), (stdout, drawn)
    assert f"pack {checkpoint.name}:" in drawn and "100%" in drawn, drawn
    last = block_lines(out)[-1]
    assert f"{last}]" in drawn, drawn  # the block's status is beside the bar ...
    assert not any(line.startswith("block ") for line in drawn.replace("\r", "\n").splitlines())  # ... not a line
    code, stdout, drawn = run_on_a_terminal(["verify", str(out)])
    assert code == 0 and stdout == f"{out}: OK\n" and "verify pkg:" in drawn and "100%" in drawn, drawn


def test_verify_moves_the_bar_over_every_byte(checkpoint, tmp_path):
    from packager.pack import pack

    manifest = pack(checkpoint, tmp_path / "pkg", layers_per_block=2)
    terminal = Terminal()
    with Progress(terminal=terminal) as progress:
        assert verify_package(tmp_path / "pkg", progress) == []
        total = manifest.total_bytes + sum(f.bytes for f in manifest.files)
        assert progress._bar.n == total == progress._bar.total


def test_convert_gguf_shows_its_steps_on_a_terminal_only(tmp_path, fake_transformers):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    lines: list[str] = []
    convert_gguf(gguf, tmp_path / "plain", progress=Progress(lines.append))
    assert lines == ["tokenizer", "dequantize to bfloat16", "save"]  # no terminal: the steps as lines
    terminal = Terminal()
    lines.clear()
    with Progress(lines.append, terminal=terminal) as progress:
        convert_gguf(gguf, tmp_path / "shown", progress=progress)
    assert lines == [] and "convert model.gguf" in terminal.getvalue() and "3/3" in terminal.getvalue()
    assert sorted(p.name for p in (tmp_path / "shown").iterdir()) == ["Model.json", "Tokenizer.json"]


def test_a_file_that_is_not_gguf_is_a_checkpoint_error_and_leaves_no_output(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(CheckpointError, match=rf"^{text}: truncated or not a GGUF file \(GGUF magic invalid"):
        convert_gguf(text, tmp_path / "out")
    assert not (tmp_path / "out").exists()
