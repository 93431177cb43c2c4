"""``pipecast convert-gguf GGUF OUT``: ``--force`` never replaces the GGUF file it converts, nor a folder that is
not a checkpoint; a truncated GGUF file, or one the model cannot be whole from, is a typed error; the tokenizer is
the GGUF's own; transformers draws no bar of its own. And the demo's conversion: its cache, and a folder in it that
the demo did not make."""

import re
from pathlib import Path

import numpy as np
import pytest

from packager.errors import CheckpointError, PackageError
from packager.gguf_convert import convert_gguf
from pipecast.cli import main


def tiny_gguf(path: Path, *, without: str = "", metadata_ffn: int = 32, q8_1: str = "", blocks: int = 1,
              block_count: int | None = None, metadata_hidden: int = 16) -> Path:
    """A Llama GGUF file of ``blocks`` layers (hidden 16, byte tokens) of random float32 weights; ``without`` that
    tensor, ``metadata_ffn`` the feed-forward size its metadata gives (its tensors' is 32), ``q8_1`` that tensor in
    Q8_1 (which gguf cannot dequantize), ``block_count`` and ``metadata_hidden`` the block count (default
    ``blocks``) and hidden size its metadata gives."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(blocks if block_count is None else block_count)
    writer.add_context_length(32)
    writer.add_embedding_length(metadata_hidden)
    writer.add_feed_forward_length(metadata_ffn)
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
              **{f"blk.{i}.{name}": shape for i in range(blocks) for name, shape in {
                  "attn_norm.weight": (16,), "ffn_norm.weight": (16,),
                  **{f"{name}.weight": (16, 16) for name in ("attn_q", "attn_k", "attn_v", "attn_output")},
                  "ffn_gate.weight": (32, 16), "ffn_up.weight": (32, 16), "ffn_down.weight": (16, 32)}.items()}}
    shapes.pop(without, None)
    for name, shape in shapes.items():
        if name == q8_1:  # each row as Q8_1 blocks of zeros: gguf reads them, but cannot dequantize them
            values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            writer.add_tensor(name, np.zeros((shape[0], shape[1] // values * block_bytes), dtype=np.uint8),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("out", [".", "model.gguf", "link"])
def test_force_refuses_an_output_that_is_holds_or_leads_to_the_gguf(fake_transformers, tmp_path, capsys, out):
    """Finding 2: ``convert-gguf ck/model.gguf ck --force`` moved ck aside and deleted it, the GGUF with it."""
    folder = tmp_path / "ck"
    folder.mkdir()
    gguf = folder / "model.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "link").symlink_to(folder)
    for parent in (folder, tmp_path):  # as checkpoint folders look: else refused as none (test below)
        (parent / "config.json").write_text("{}")
        (parent / "model.safetensors").write_text("")
    out = tmp_path / "link" if out == "link" else folder / out
    with pytest.raises(PackageError, match=re.escape(f"{out}: refused as the output: replacing it would delete "
                                                     f"the GGUF file being converted ({gguf}")):
        convert_gguf(gguf, out, overwrite=True)
    assert main(["convert-gguf", str(gguf), str(out), "--force"]) == 2
    assert "would delete the GGUF file being converted" in capsys.readouterr().err
    assert gguf.read_bytes() == b"GGUF" and sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.gguf", "model.safetensors"]


@pytest.mark.parametrize("out", [".", "..", "here"])
def test_an_output_that_is_or_holds_the_current_folder_is_refused(fake_transformers, tmp_path, monkeypatch, capsys,
                                                                  out):
    """Review finding 6: ``convert-gguf GGUF . --force`` in a checkpoint folder converted the whole model, then
    failed to move '.' aside (EBUSY)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    here = tmp_path / "ck"
    here.mkdir()
    (here / "config.json").write_text("{}")
    monkeypatch.chdir(here)
    out = here if out == "here" else Path(out)
    message = (f"{out}: refused as the output: the current folder, a folder holding it and a path ending in '..' "
               "cannot be replaced; name the output by a path of its own (such as ../NAME)")
    with pytest.raises(PackageError) as refused:
        convert_gguf(gguf, out, overwrite=True)
    assert str(refused.value) == message
    assert main(["convert-gguf", str(gguf), str(out), "--force"]) == 2
    assert f"error: {message}\n" in capsys.readouterr().err
    assert sorted(p.name for p in here.iterdir()) == ["config.json"]


@pytest.mark.parametrize("old", [["config.json", "model.safetensors", "old.txt"], []])
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


@pytest.mark.parametrize("files, why", [
    (["config.json", "notes.txt", "src/main.py"], "without model.safetensors"),
    (["config.json", "model.safetensors", "src/main.py"], "holding a folder (src)")])
def test_force_refuses_a_project_folder_holding_a_config_json(fake_transformers, tmp_path, files, why):
    """Found in review: ``--force`` deleted any folder holding a file named config.json (a project's)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "proj"
    for name in files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    with pytest.raises(PackageError) as caught:
        convert_gguf(gguf, out, overwrite=True)
    assert str(caught.value) == (f"{out}: refused as the output: a non-empty folder {why} is not a checkpoint "
                                 "folder, and --force would delete it with all it holds")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == sorted(files)


def test_transformers_draws_no_bar_of_its_own_in_a_pipe(fake_transformers, tmp_path, monkeypatch, capfd):
    """Finding 5: `convert-gguf GGUF OUT > log 2>&1` wrote transformers' "Writing model shards" tqdm bar."""
    import transformers
    from transformers.utils import logging as transformers_logging

    from benchmarks.tiny_checkpoints import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))  # its save draws the bar
    _, loaded = transformers.AutoModelForCausalLM.from_pretrained()  # the fake's loading info: nothing missing
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: (model, loaded))
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


def test_a_gguf_whose_metadata_the_config_refuses_is_a_checkpoint_error(tmp_path):
    """Found in review: a damaged key (head_count renamed: transformers then takes 32 heads for a hidden size of 16)
    raised huggingface_hub's StrictDataclassClassValidationError, a traceback."""
    data = tiny_gguf(tmp_path / "full.gguf").read_bytes()
    assert data.count(b"attention.head_count") == 2  # the heads, then head_count_kv
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(data.replace(b"attention.head_count", b"attention.head_Kount", 1))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(gguf))}: cannot convert it \(\w+: "):
        convert_gguf(gguf, tmp_path / "out")
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


@pytest.mark.parametrize("written, message", [
    ({"without": "blk.0.ffn_down.weight"}, "lacks tensors the model needs: model.layers.0.mlp.down_proj.weight"),
    ({"metadata_ffn": 64}, "tensor shapes do not match its metadata: model.layers.0.mlp.down_proj.weight is "
                           "(16, 32), its metadata makes it (16, 64), model.layers.0.mlp.gate_proj.weight is (32, 16), "
                           "its metadata makes it (64, 16), model.layers.0.mlp.up_proj.weight is (32, 16), its "
                           "metadata makes it (64, 16)"),
    ({"q8_1": "blk.0.ffn_down.weight"}, "uses a quantization type gguf cannot dequantize (Dequantization for Q8_1 "
                                        "is not yet implemented)"),
])
def test_a_gguf_the_model_cannot_be_whole_from_is_a_checkpoint_error(tmp_path, capsys, written, message):
    """Review findings 1 and 5: a tensor missing converted with random weights (transformers fills them in and
    warns) and exit 0; a shape the metadata contradicts (RuntimeError) or a quantization type gguf cannot
    dequantize (NotImplementedError) ended in a traceback, exit 1."""
    gguf = tiny_gguf(tmp_path / "model.gguf", **written)
    with pytest.raises(CheckpointError) as refused:
        convert_gguf(gguf, tmp_path / "out")
    assert str(refused.value) == f"{gguf}: {message}"
    assert main(["convert-gguf", str(gguf), str(tmp_path / "out")]) == 2
    assert f"error: {gguf}: {message}\n" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


@pytest.mark.parametrize("written, message", [
    ({"block_count": 200_000}, "its metadata gives 200000 blocks (llama.block_count), its tensors are of 1"),
    ({"blocks": 2, "block_count": 1}, "its metadata gives 1 blocks (llama.block_count), its tensors are of 2"),
    ({"metadata_hidden": 100_000}, "its metadata makes a model of 40,061,700,000 weights, its tensors hold 10,896"),
])
def test_a_gguf_whose_metadata_outsizes_its_tensors_is_refused_before_the_model_is_built(tmp_path, capsys, written,
                                                                                           message):
    """Noticed in a session: a block count of 200,000 in a 50 KB file built the model first: 5 GiB and two minutes,
    then a MemoryError; a count short of the file's blocks converted a model without the layers past it."""
    gguf = tiny_gguf(tmp_path / "model.gguf", **written)
    assert main(["convert-gguf", str(gguf), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {gguf}: {message}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_a_tied_output_weight_is_not_missing(tmp_path):
    """The missing-tensor check leaves out tied weights: a GGUF without output.weight ties lm_head to the
    embedding."""
    from transformers import AutoConfig

    assert main(["convert-gguf", str(tiny_gguf(tmp_path / "model.gguf", without="output.weight")),
                 str(tmp_path / "out")]) == 0
    assert AutoConfig.from_pretrained(tmp_path / "out").tie_word_embeddings


def test_the_tokenizer_is_the_ggufs_own_not_a_tokenizer_json_beside_it(tmp_path):
    """Review finding 2: a tokenizer.json lying beside the GGUF (another model's) was converted instead of the
    GGUF's own vocabulary."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer

    Tokenizer(models.WordLevel({"[UNK]": 0, "other": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    assert main(["convert-gguf", str(tiny_gguf(tmp_path / "model.gguf")), str(tmp_path / "out")]) == 0
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out")) == 259


def test_an_output_under_a_file_is_refused_up_front(fake_transformers, tmp_path, capsys):
    """Review finding 6: OUT under a regular file raised a raw FileExistsError (pack refused it clearly)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "afile").write_text("not a folder")
    out = tmp_path / "afile" / "out"
    message = f"{out}: cannot be created: {tmp_path / 'afile'} is not a folder"
    with pytest.raises(PackageError) as refused:
        convert_gguf(gguf, out)
    assert str(refused.value) == message
    assert main(["convert-gguf", str(gguf), str(out)]) == 2
    assert f"error: {message}\n" in capsys.readouterr().err


@pytest.mark.parametrize("cache", ["afile", "afile/deeper"])
def test_the_demo_refuses_a_cache_under_a_file_up_front(tmp_path, capsys, cache):
    """Review finding 6: ``make demo`` with --cache a file failed midway, a NotADirectoryError traceback."""
    from benchmarks import demo

    (tmp_path / "afile").write_text("not a folder")
    cache = tmp_path / cache
    with pytest.raises(SystemExit) as exited:
        demo.main(["--cache", str(cache), "--skip-cold-start"])
    assert exited.value.code == 2
    assert (f"argument --cache: {cache / 'demo'}: cannot be created: {tmp_path / 'afile'} is not a folder"
            in capsys.readouterr().err)


@pytest.mark.parametrize("step, folder, marker", [("demo_checkpoint", "checkpoints", "config.json"),
                                                  ("demo_package", "packages", "manifest.json"),
                                                  ("prepare_package", "packages", "manifest.json")])
def test_the_demo_names_a_folder_it_did_not_make_as_the_one_to_delete(tmp_path, step, folder, marker):
    """Review finding 7: such a folder was refused pointing at --force, which the demo does not have."""
    from benchmarks import demo, demo_model

    out = tmp_path / folder / demo_model.MODEL_NAME
    (out / "notes").mkdir(parents=True)
    with pytest.raises(PackageError) as refused:
        getattr(demo if step == "prepare_package" else demo_model, step)(tmp_path)
    assert str(refused.value) == (f"{out}: holds files but no {marker}, so the demo did not make it and will not "
                                  "replace it: delete that folder, or use another cache folder")
    assert sorted(p.name for p in out.iterdir()) == ["notes"]


def test_an_output_that_cannot_be_written_is_a_typed_error_and_leaves_nothing(fake_transformers, tmp_path,
                                                                             monkeypatch, capsys):
    """Found in review: a full disk, a read-only mount or a name too long for the output was a raw OSError
    traceback (exit 1), where pack says which output it cannot write (exit 2)."""
    import transformers

    def full(self, folder):
        raise OSError(28, "No space left on device")

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    model = transformers.AutoModelForCausalLM.from_pretrained("x")[0]
    monkeypatch.setattr(type(model), "save_pretrained", full)
    out = tmp_path / "out"
    assert main(["convert-gguf", str(gguf), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {out}: cannot write the checkpoint ([Errno 28] No space left on device)\n" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
