"""``pipecast convert-gguf GGUF OUT --force`` never replaces the GGUF file it converts."""

import re

import pytest

from packager.errors import PackageError
from packager.gguf_convert import convert_gguf
from pipecast.cli import main


@pytest.mark.parametrize("out", [".", "..", "model.gguf", "link"])
def test_force_refuses_an_output_that_is_holds_or_leads_to_the_gguf(fake_transformers, tmp_path, capsys, out):
    """Finding 2: ``convert-gguf ck/model.gguf ck --force`` moved ck aside and deleted it, the GGUF with it."""
    folder = tmp_path / "ck"
    folder.mkdir()
    gguf = folder / "model.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "link").symlink_to(folder)
    out = tmp_path / "link" if out == "link" else folder / out
    with pytest.raises(PackageError, match=re.escape(f"{out}: refused as the output: replacing it would delete "
                                                     f"the GGUF file being converted ({gguf}")):
        convert_gguf(gguf, out, overwrite=True)
    assert main(["convert-gguf", str(gguf), str(out), "--force"]) == 2
    assert "would delete the GGUF file being converted" in capsys.readouterr().err
    assert gguf.read_bytes() == b"GGUF" and sorted(p.name for p in folder.iterdir()) == ["model.gguf"]


def test_force_replaces_another_output(fake_transformers, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    convert_gguf(gguf, tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["Model.json", "Tokenizer.json"]
    assert gguf.read_bytes() == b"GGUF"


def test_transformers_draws_no_bar_of_its_own_in_a_pipe(fake_transformers, tmp_path, monkeypatch, capfd):
    """Finding 5: `convert-gguf GGUF OUT > log 2>&1` wrote transformers' "Writing model shards" tqdm bar."""
    import transformers
    from transformers.utils import logging as transformers_logging

    from benchmarks.tiny_checkpoints import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))  # its save draws the bar
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()  # as in a fresh process (a test before may have turned it off)
    try:
        assert main(["convert-gguf", str(gguf), str(tmp_path / "out")]) == 0
        out, err = capfd.readouterr()
        assert "converted" in out and "Writing model shards" not in out + err
        assert (tmp_path / "out" / "model.safetensors").is_file()
        assert transformers_logging.is_progress_bar_enabled()  # library code leaves the switch as it found it
    finally:
        if not was_enabled:
            transformers_logging.disable_progress_bar()
