"""The GPU check (benchmarks/gpu_check.py) runs end to end; here on the CPU, with a small cold-start model."""

import json

import pytest
from click.testing import CliRunner

from benchmarks.gpu_check import main
from packager.manifest import read_manifest


def test_the_gpu_check_runs_on_a_cpu_and_finds_pipecast_exact(tmp_path):
    out = tmp_path / "out.json"
    result = CliRunner().invoke(main, ["--device", "cpu", "--cold-layers", "1", "--repeat", "1",
                                       "--prompt-tokens", "8", "--json", str(out), "--keep", str(tmp_path / "kept")])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert [(r["arch"], r["dtype"], r["tokens_equal"]) for r in figures["exactness"]] == [
        (arch, dtype, 3) for arch in ("llama", "qwen2", "mistral") for dtype in ("float32", "bfloat16")]
    assert figures["cold_start"]["first_tokens_equal"] and figures["cold_start"]["layers"] == 1
    # the cold-start model's package stays, with a tokenizer, for `bench coldstart --package`
    files = {f.path for f in read_manifest(tmp_path / "kept" / "cold").files}
    assert "tokenizer.json" in files
    again = CliRunner().invoke(main, ["--device", "cpu", "--keep", str(tmp_path / "kept")])
    assert again.exit_code == 2 and "is not empty" in again.output


@pytest.mark.parametrize("device, problem", [("cuda", "CUDA is not available on this host"),
                                             ("bogus", "not a torch device (use cpu, cuda or cuda:N)")])
def test_a_device_this_host_lacks_is_a_usage_error_with_the_engines_message(monkeypatch, device, problem):
    """Finding 2: `--device cuda` with a CPU-only torch was an AssertionError traceback from torch.cuda."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # whatever this host has
    result = CliRunner().invoke(main, ["--device", device])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for --device: {problem}" in result.output
