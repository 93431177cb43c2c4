"""``pipecast convert-gguf GGUF OUT``: ``--force`` never replaces the GGUF file it converts, nor a folder that is
not a checkpoint; a truncated GGUF file is a typed error; transformers draws no bar of its own."""

import re
from pathlib import Path

import numpy as np
import pytest

from packager.errors import CheckpointError, PackageError
from packager.gguf_convert import convert_gguf
from pipecast.cli import main


def tiny_gguf(path: Path) -> Path:
    """A one-layer Llama GGUF file (hidden 16, byte tokens) of random float32 weights."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([b"<unk>", b"<s>", b"</s>", *(f"<0x{i:02X}>".encode() for i in range(256))])
    writer.add_token_scores([0.0] * 259)
    writer.add_token_types([3, 3, 3] + [6] * 256)  # control tokens, then bytes
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    shapes = {"token_embd.weight": (259, 16), "output_norm.weight": (16,), "output.weight": (259, 16),
              "blk.0.attn_norm.weight": (16,), "blk.0.ffn_norm.weight": (16,),
              **{f"blk.0.{name}.weight": (16, 16) for name in ("attn_q", "attn_k", "attn_v", "attn_output")},
              "blk.0.ffn_gate.weight": (32, 16), "blk.0.ffn_up.weight": (32, 16), "blk.0.ffn_down.weight": (16, 32)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("out", [".", "..", "model.gguf", "link"])
def test_force_refuses_an_output_that_is_holds_or_leads_to_the_gguf(fake_transformers, tmp_path, capsys, out):
    """Finding 2: ``convert-gguf ck/model.gguf ck --force`` moved ck aside and deleted it, the GGUF with it."""
    folder = tmp_path / "ck"
    folder.mkdir()
    gguf = folder / "model.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "link").symlink_to(folder)
    for parent in (folder, tmp_path):  # as checkpoint folders look: else refused as none (test below)
        (parent / "config.json").write_text("{}")
    out = tmp_path / "link" if out == "link" else folder / out
    with pytest.raises(PackageError, match=re.escape(f"{out}: refused as the output: replacing it would delete "
                                                     f"the GGUF file being converted ({gguf}")):
        convert_gguf(gguf, out, overwrite=True)
    assert main(["convert-gguf", str(gguf), str(out), "--force"]) == 2
    assert "would delete the GGUF file being converted" in capsys.readouterr().err
    assert gguf.read_bytes() == b"GGUF" and sorted(p.name for p in folder.iterdir()) == ["config.json",
                                                                                         "model.gguf"]


@pytest.mark.parametrize("old", [["config.json", "old.txt"], []])
def test_force_replaces_another_checkpoint_folder_or_an_empty_one(fake_transformers, tmp_path, old):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "out").mkdir()
    for name in old:
        (tmp_path / "out" / name).write_text("old")
    convert_gguf(gguf, tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["Model.json", "Tokenizer.json"]
    assert gguf.read_bytes() == b"GGUF"


def test_force_refuses_a_folder_that_is_not_a_checkpoint_folder(fake_transformers, tmp_path, capsys):
    """Found in review: ``--force`` deleted any existing OUT, a folder of other models too; as ``pack --force``
    refuses a folder that is not a package, ``convert-gguf --force`` refuses one that is not a checkpoint."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "models"
    (out / "other-model").mkdir(parents=True)
    (out / "other-model" / "config.json").write_text("{}")
    message = (f"{out}: refused as the output: a non-empty folder without config.json is not a checkpoint "
               "folder, and --force would delete it with all it holds")
    with pytest.raises(PackageError) as caught:
        convert_gguf(gguf, out, overwrite=True)
    assert str(caught.value) == message
    assert main(["convert-gguf", str(gguf), str(out), "--force"]) == 2
    assert f"error: {message}\n" in capsys.readouterr().err
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["other-model",
                                                                            "other-model/config.json"]


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


@pytest.mark.parametrize("cut", [8, 200, 2000])
def test_a_truncated_gguf_file_is_a_checkpoint_error(tmp_path, capsys, cut):
    """Found in review: a GGUF file cut short raised struct.error from the gguf reader: a traceback, exit 1."""
    data = tiny_gguf(tmp_path / "full.gguf").read_bytes()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(gguf))}: truncated or not a GGUF file \(.+\)$"):
        convert_gguf(gguf, tmp_path / "out")
    assert main(["convert-gguf", str(gguf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {gguf}: truncated or not a GGUF file (") and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.gguf", "model.gguf"]


def test_the_dequantizing_bar_of_transformers_is_not_drawn(tmp_path, capfd):
    """Found in review: `convert-gguf GGUF OUT 2> log` wrote transformers' "Converting and de-quantizing GGUF
    tensors..." tqdm bar: that loop calls tqdm itself, past transformers' progress bar switch."""
    from transformers import modeling_gguf_pytorch_utils

    bar = modeling_gguf_pytorch_utils.tqdm
    assert main(["convert-gguf", str(tiny_gguf(tmp_path / "model.gguf")), str(tmp_path / "out")]) == 0
    out, err = capfd.readouterr()
    assert out == f"converted {tmp_path / 'out'}\n" and "de-quantizing" not in err
    assert modeling_gguf_pytorch_utils.tqdm is bar  # as it was
    assert (tmp_path / "out" / "model.safetensors").is_file()
