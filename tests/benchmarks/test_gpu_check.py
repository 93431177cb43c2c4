"""The GPU check (benchmarks/gpu_check.py) runs end to end; here on the CPU, with a small cold-start model."""

import json

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
