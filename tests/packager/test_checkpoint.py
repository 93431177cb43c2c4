"""Which files of a checkpoint folder the packager reads: regular files inside it or inside its Hugging
Face blob store, nothing a symlink leads to elsewhere (issue #12, finding 6); hostile JSON in its config
and shard index (finding 3); ``convert-gguf`` and an existing output (finding 6)."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from packager.checkpoint import open_checkpoint
from packager.errors import CheckpointError, CheckpointFileError, PackageError
from packager.gguf_convert import convert_gguf
from packager.pack import pack
from packager.package import Package
from pipecast.cli import main


def write_checkpoint(folder: Path) -> Path:
    """A two-layer llama-shaped checkpoint of random bytes (no torch) with a tokenizer.json."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    tensors = {"model.embed_tokens.weight": rng.integers(0, 256, (4, 8), dtype=np.uint8),
               "model.norm.weight": rng.integers(0, 256, (8,), dtype=np.uint8)}
    for layer in range(2):
        tensors[f"model.layers.{layer}.mlp.weight"] = rng.integers(0, 256, (64,), dtype=np.uint8)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (folder / "tokenizer.json").write_text('{"tokenizer": "of this model"}')
    return folder


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "ckpt")


def test_a_regular_checkpoint_packs_its_small_files(ckpt, tmp_path):
    manifest = pack(ckpt, tmp_path / "pkg")
    assert [f.path for f in manifest.files] == ["config.json", "tokenizer.json"]


def test_a_symlink_inside_the_folder_is_followed(ckpt, tmp_path):
    os.rename(ckpt / "tokenizer.json", ckpt / "real-tokenizer.json")
    (ckpt / "tokenizer.json").symlink_to("real-tokenizer.json")
    pack(ckpt, tmp_path / "pkg")
    assert (tmp_path / "pkg" / "tokenizer.json").read_text() == '{"tokenizer": "of this model"}'


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model.safetensors"])
def test_a_symlink_leading_out_of_the_folder_is_refused_naming_it(ckpt, tmp_path, capsys, name):
    """Finding 6: a tokenizer.json symlinked to a secret outside the folder was copied into the package
    (and from there to every node); now a typed error names it, and nothing is written."""
    secret = tmp_path / "secret"
    secret.write_bytes((ckpt / name).read_bytes())  # even a file that would pack fine
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(secret)
    with pytest.raises(CheckpointFileError) as info:
        pack(ckpt, tmp_path / "pkg")
    assert str(ckpt / name) in str(info.value) and "outside the checkpoint folder" in str(info.value)
    assert not (tmp_path / "pkg").exists()
    assert main(["pack", str(ckpt), str(tmp_path / "pkg")]) == 2
    assert f"{ckpt / name}: refused" in capsys.readouterr().err


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_a_small_file_that_is_not_a_regular_file_is_refused(ckpt, tmp_path, kind):
    """Finding 6: only regular files are read (a FIFO would hang the packer, /dev/zero fill its memory)."""
    target = ckpt / "tokenizer.json"
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        target.symlink_to("/dev/zero")
    else:
        target.mkdir()
    with pytest.raises(CheckpointFileError, match="tokenizer.json: refused: (not a regular file|it is a symlink)"):
        open_checkpoint(ckpt)


def hf_snapshot(hub: Path, repo: str) -> Path:
    """A checkpoint laid out as the Hugging Face cache does: snapshot files are symlinks into blobs/."""
    flat = write_checkpoint(hub / f"flat-{repo}")
    root = hub / f"models--{repo}"
    snapshot = root / "snapshots" / "0123abcd"
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, path in enumerate(sorted(flat.iterdir())):
        blob = root / "blobs" / f"blob{index:02d}"
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("../..") / "blobs" / blob.name)
    shutil.rmtree(flat)
    return snapshot


def test_a_hugging_face_cache_snapshot_packs_through_its_blob_symlinks(tmp_path):
    snapshot = hf_snapshot(tmp_path / "hub", "org--model")
    manifest = pack(snapshot, tmp_path / "pkg")
    assert [f.path for f in manifest.files] == ["config.json", "tokenizer.json"]
    assert Package.open(tmp_path / "pkg").manifest.package_id == manifest.package_id


@pytest.mark.parametrize("repo, name_or_path, flag, recorded", [
    ("org--tiny", None, None, "org/tiny"), ("tiny", None, None, "tiny"),
    ("org--tiny", "org/from-config", None, "org/from-config"), ("org--tiny", "org/from-config", "mine", "mine")])
def test_a_hugging_face_cache_snapshot_is_named_by_its_repository(tmp_path, capsys, repo, name_or_path, flag,
                                                                  recorded):
    """Found in review: a snapshot (models--org--tiny/snapshots/<hash>/) recorded its revision hash as the
    model name; --name and config.json's _name_or_path still come first."""
    snapshot = hf_snapshot(tmp_path / "hub", repo)
    if name_or_path:
        config = snapshot / "config.json"
        text = json.dumps({**json.loads(config.read_text()), "_name_or_path": name_or_path})
        config.unlink()  # a symlink into blobs/: the snapshot's own copy changes, as a new revision would
        config.write_text(text)
    assert pack(snapshot, tmp_path / "pkg", model_name=flag).model_name == recorded
    assert main(["pack", str(snapshot), str(tmp_path / "cli"), *(["--name", flag] if flag else [])]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "cli")]) == 0
    assert f"model     {recorded} (" in capsys.readouterr().out


def test_a_snapshot_symlink_into_another_repositorys_blobs_is_refused(tmp_path):
    """Finding 6: the blob store allowed is the snapshot's own repository's, not any models--*/blobs."""
    snapshot = hf_snapshot(tmp_path / "hub", "org--model")
    other = hf_snapshot(tmp_path / "hub", "org--other")
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to((other / "tokenizer.json").resolve())
    with pytest.raises(CheckpointFileError, match="tokenizer.json: refused: it is a symlink to .*models--org--other"):
        open_checkpoint(snapshot)


def test_model_safetensors_wins_over_a_stale_shard_index(ckpt, tmp_path, caplog):
    """Found in review: with model.safetensors and a model.safetensors.index.json both there (a sharded save,
    then an unsharded one), the index and its stale shards were packed; transformers reads model.safetensors."""
    from safetensors.numpy import load_file

    current = load_file(str(ckpt / "model.safetensors"))
    save_file({name: value + 1 for name, value in current.items()}, str(ckpt / "model-00001-of-00001.safetensors"))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "model-00001-of-00001.safetensors" for name in current}}))
    with caplog.at_level("INFO", logger="packager.checkpoint"):
        pack(ckpt, tmp_path / "pkg")
    assert f"{ckpt / 'model.safetensors.index.json'}: ignored, as transformers ignores it: model.safetensors is " \
           "there" in caplog.messages
    package = Package.open(tmp_path / "pkg")
    packed = {name: tensor.numpy() for block in range(package.num_blocks)
              for name, tensor in package.block_tensors(block).items()}
    assert sorted(packed) == sorted(current) and all((packed[n] == current[n]).all() for n in current)


@pytest.mark.parametrize("text, problem", [
    ("[" * 100_000, "nested too deeply"),
    ('{"num_hidden_layers": 2, "num_hidden_layers": 3}', "duplicate key"),
    ('{"rope_theta": 1e400}', "out of range"),
    ("[]", "expected a JSON object"),
])
def test_hostile_json_in_config_or_index_is_a_checkpoint_error(ckpt, text, problem):
    """Finding 3: a config.json nested 100000 deep raised RecursionError; now CheckpointError."""
    (ckpt / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=problem):
        open_checkpoint(ckpt)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").rename(ckpt / "model-00001.safetensors")  # else the index is ignored
    (ckpt / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        open_checkpoint(ckpt)


def test_convert_gguf_refuses_an_existing_output_without_force(tmp_path, capsys):
    """Finding 6: convert-gguf replaced an existing OUT (any folder, even one not made by it) silently."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    with pytest.raises(PackageError, match="already exists"):
        convert_gguf(gguf, out)
    assert main(["convert-gguf", str(gguf), str(out)]) == 2
    assert "already exists (pass --force to replace it)" in capsys.readouterr().err
    assert (out / "precious.txt").read_text() == "mine"
    (out / "precious.txt").unlink()
    out.rmdir()
    out.symlink_to(tmp_path / "elsewhere")  # a dangling symlink is there too
    with pytest.raises(PackageError, match="already exists"):
        convert_gguf(gguf, out)


@pytest.mark.parametrize("archs, got", [({"LlamaForCausalLM": 1}, "dict"), (3, "int"), ("LlamaForCausalLM", "str"),
                                        (["LlamaForCausalLM", 7], "list holding int")])
def test_a_malformed_architectures_is_a_checkpoint_error_naming_its_type(ckpt, tmp_path, archs, got):
    """Finding 3: a dict or an int raised a raw KeyError or TypeError after every block was written, and a
    string recorded its first letter ("L") as the architecture."""
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": archs}))
    with pytest.raises(CheckpointError) as caught:
        pack(ckpt, tmp_path / "pkg")
    assert str(caught.value) == f"{ckpt / 'config.json'}: architectures must be a list of strings, got {got}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("archs, recorded", [(None, ""), ([], ""), (["LlamaForCausalLM"], "LlamaForCausalLM")])
def test_architectures_absent_null_or_a_list_of_strings_packs(ckpt, tmp_path, archs, recorded):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": archs}))
    assert pack(ckpt, tmp_path / "pkg").architecture == recorded
