"""The block packager: round trips, determinism, atomicity, verify/inspect, and every kind of bad input."""

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from packager.errors import (BlockMismatchError, CheckpointError, CheckpointFileError, ManifestError,
                             MissingShardError, PackageError, PickleCheckpointError, SafetensorsFormatError,
                             UnplacedTensorsError)
from packager.chunks import ChunkHasher
from packager.manifest import compute_package_id, manifest_to_json, read_manifest, seal_manifest
from packager.pack import pack
from packager.package import Package
from packager.safetensors_format import MAX_HEADER_BYTES, build_header
from packager.verify import verify_package
from pipecast.cli import main
from benchmarks.tiny_checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": make_checkpoint("llama", root / "llama"),
        "qwen2": make_checkpoint("qwen2", root / "qwen2", dtype="bfloat16"),
        "gpt2": make_checkpoint("gpt2", root / "gpt2"),
        "sharded": make_checkpoint("llama", root / "sharded", seed=1, max_shard_size="100KB"),
        "qwen3": make_checkpoint("qwen3", root / "qwen3"),
        "gemma3_text": make_checkpoint("gemma3_text", root / "gemma3_text", dtype="bfloat16"),
    }


def original_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "sharded", "qwen3", "gemma3_text"])
def test_round_trip_every_tensor_exactly_once(checkpoints, tmp_path, name):
    manifest = pack(checkpoints[name], tmp_path / "pkg", layers_per_block=3)
    pkg = Package.open(tmp_path / "pkg")
    original = original_tensors(checkpoints[name])
    seen: dict[str, int] = {}
    for b in manifest.blocks:
        # Each block is a valid safetensors file any reader can open.
        with safe_open(pkg.block_path(b.index), "pt") as f:
            assert sorted(f.keys()) == list(b.tensor_names)
        for tensor_name, tensor in pkg.block_tensors(b.index).items():
            assert tensor_name not in seen
            seen[tensor_name] = b.index
            assert tensor.dtype == original[tensor_name].dtype
            assert torch.equal(tensor, original[tensor_name]), tensor_name
    assert set(seen) == set(original)
    assert [(b.layer_start, b.layer_end) for b in manifest.blocks] == [(0, 3), (3, 4)]
    embed = next(n for n in original if "embed_tokens" in n or ".wte." in n)
    assert seen[embed] == 0
    final_norm = next(n for n in original if n in ("model.norm.weight", "transformer.ln_f.weight"))
    assert seen[final_norm] == len(manifest.blocks) - 1
    assert manifest.tied_embeddings == ("lm_head.weight" not in original)


def test_a_model_name_that_is_not_utf8_or_not_text_is_recorded_readably(checkpoints, tmp_path):
    """Found in review: a checkpoint folder named in Latin-1 crashed pack (UnicodeEncodeError) and a config's
    non-text _name_or_path was recorded as its Python repr."""
    src = tmp_path / os.fsdecode(b"caf\xe9-model")
    shutil.copytree(checkpoints["llama"], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "_name_or_path": {"a": [1, 2]}}))
    assert pack(src, tmp_path / "pkg").model_name == "caf\ufffd-model"
    assert pack(src, tmp_path / "pkg2", model_name=os.fsdecode(b"x\xff")).model_name == "x\ufffd"


def test_a_layer_count_of_true_is_no_count(checkpoints, tmp_path):
    """Found in review: `num_hidden_layers: true` was read as 1 layer (a bool is an int to isinstance)."""
    src = tmp_path / "src"
    shutil.copytree(checkpoints["llama"], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": True}))
    assert pack(src, tmp_path / "pkg").num_layers == config["num_hidden_layers"]  # counted from the tensors


def test_block_tensors_are_zero_copy_views_of_the_mapped_file(checkpoints, tmp_path):
    pack(checkpoints["llama"], tmp_path / "pkg")
    pkg = Package.open(tmp_path / "pkg")
    buf = pkg.block_buffer(0)
    base = torch.frombuffer(buf, dtype=torch.uint8)
    start, end = base.data_ptr(), base.data_ptr() + len(buf)
    for tensor in pkg.block_tensors(0).values():
        assert start <= tensor.data_ptr() < end
    assert pkg.block_of_layer(3) == 3 and list(pkg.layer_range(1)) == [1]


def test_same_input_gives_identical_bytes_and_id(checkpoints, tmp_path):
    a = pack(checkpoints["sharded"], tmp_path / "a", block_bytes=40_000, chunk_bytes=4096)
    b = pack(checkpoints["sharded"], tmp_path / "b", block_bytes=40_000, chunk_bytes=4096)
    assert a.package_id == b.package_id
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    # Another chunk size gives the same block bytes, but another package id: the id covers the chunk
    # digests, so that receivers can trust them.
    c = pack(checkpoints["sharded"], tmp_path / "c", block_bytes=40_000, chunk_bytes=8192)
    assert [b.digest for b in c.blocks] == [b.digest for b in a.blocks]
    assert c.package_id != a.package_id


def test_block_bytes_groups_whole_layers(checkpoints, tmp_path):
    layer_bytes = 148_224  # one tiny Llama layer, fp32
    manifest = pack(checkpoints["llama"], tmp_path / "pkg", block_bytes=2 * layer_bytes + 2048)
    # The first block also carries the embeddings, so it fits one layer.
    assert [(b.layer_start, b.layer_end) for b in manifest.blocks] == [(0, 1), (1, 3), (3, 4)]
    # Too small for any layer: still whole layers, one per block.
    manifest = pack(checkpoints["llama"], tmp_path / "one", block_bytes=1000)
    assert [(b.layer_start, b.layer_end) for b in manifest.blocks] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_failed_pack_leaves_nothing_behind(checkpoints, tmp_path, monkeypatch):
    import packager.pack as pack_module

    real = pack_module._write_block
    calls = []

    def fail_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-pack
        return real(*args, **kwargs)

    monkeypatch.setattr(pack_module, "_write_block", fail_on_second)
    with pytest.raises(KeyboardInterrupt):
        pack(checkpoints["llama"], tmp_path / "pkg", layers_per_block=1)
    assert list(tmp_path.iterdir()) == []


def test_a_block_path_that_is_a_folder_of_the_blocks_size_is_a_typed_mismatch(checkpoints, tmp_path):
    """Found in review: its size checked out (a folder's st_size can be anything) and mapping it raised
    IsADirectoryError, where a block that cannot be read is a BlockMismatchError."""
    manifest = pack(checkpoints["llama"], tmp_path / "pkg")
    path = tmp_path / "pkg" / manifest.blocks[0].file
    path.unlink()
    path.mkdir()
    real_stat = Path.stat

    def stat(self, **kwargs):  # the folder's st_size, the block's (as some file systems may give)
        found = real_stat(self, **kwargs)
        return os.stat_result((*found[:6], manifest.blocks[0].bytes, *found[7:])) if self == path else found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "stat", stat)
        with pytest.raises(BlockMismatchError, match=r"cannot read \(Is a directory\)$"):
            Package.open(tmp_path / "pkg").block_buffer(0)


def test_verify_names_each_bad_block_and_chunk(checkpoints, tmp_path, capsys):
    pack(checkpoints["llama"], tmp_path / "pkg", layers_per_block=2, chunk_bytes=4096)
    assert verify_package(tmp_path / "pkg") == []
    assert main(["verify", str(tmp_path / "pkg")]) == 0
    path = tmp_path / "pkg" / "blocks" / "block-0001.safetensors"
    data = bytearray(path.read_bytes())
    data[3 * 4096 + 17] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = [str(p) for p in verify_package(tmp_path / "pkg")]
    assert problems == ["blocks/block-0001.safetensors: block 1: chunk 3 digest mismatch (bytes 12288-16383)",
                        "blocks/block-0001.safetensors: block 1: block digest mismatch"]
    assert main(["verify", str(tmp_path / "pkg")]) == 1
    assert "chunk 3 digest mismatch" in capsys.readouterr().err


def _reseal(pkg: Path, edit) -> None:
    """Edit the manifest of ``pkg`` and seal it again: consistent, its id the digest of it, as a packer writes it."""
    manifest = read_manifest(pkg)
    edit(manifest)
    (pkg / "manifest.json").write_text(manifest_to_json(seal_manifest(manifest)))


def test_verify_checks_every_chunk_digest_of_a_block_whose_digest_matches(checkpoints, tmp_path, capsys):
    """Review finding 3: verify compared the chunk digests only when the block digest differed, so it said OK for
    a package with a wrong chunk digest, which every agent (verifying chunk by chunk) refuses."""
    pack(checkpoints["llama"], tmp_path / "pkg", layers_per_block=2, chunk_bytes=4096)
    _reseal(tmp_path / "pkg", lambda m: m.blocks[1].chunk_digests.__setitem__(2, "0" * 64))
    assert [str(p) for p in verify_package(tmp_path / "pkg")] == [
        "blocks/block-0001.safetensors: block 1: chunk 2 digest mismatch (bytes 8192-12287)"]
    assert main(["verify", str(tmp_path / "pkg")]) == 1
    assert "BAD blocks/block-0001.safetensors: block 1: chunk 2 digest mismatch" in capsys.readouterr().err


def _rename_first_tensor(pkg: Path, manifest) -> str:
    names = list(manifest.blocks[1].tensor_names)
    manifest.blocks[1].tensor_names[0] += "X"
    return (f"block disagrees with the manifest: holds tensors {sorted([names[0], names[0] + 'X'])} that differ "
            "from the manifest")


def _replace_block_bytes(pkg: Path, manifest) -> str:
    """Block 1's file all 0xff bytes, its digests the manifest's: not a safetensors file at all."""
    block = manifest.blocks[1]
    data = b"\xff" * block.bytes
    (pkg / block.file).write_bytes(data)
    hasher = ChunkHasher(block.chunk_bytes)
    hasher.update(data)
    block.digest = hasher.finish()
    block.chunk_digests[:] = hasher.chunk_digests
    return f"invalid safetensors file: header length {2**64 - 1} exceeds {MAX_HEADER_BYTES}"


@pytest.mark.parametrize("edit", [_rename_first_tensor, _replace_block_bytes])
def test_verify_checks_each_blocks_header_against_the_manifest(checkpoints, tmp_path, edit):
    """Review finding 3: verify never parsed a block's header, so it said OK for a package whose manifest names
    tensors the block does not hold (or whose block is no safetensors file), which every load refuses."""
    pkg = _good_package(checkpoints, tmp_path)
    problems = []
    _reseal(pkg, lambda m: problems.append(edit(pkg, m)))
    assert [str(p) for p in verify_package(pkg)] == [f"blocks/block-0001.safetensors: block 1: {problems[0]}"]
    with pytest.raises(PackageError) as refused:
        Package.open(pkg).block_tensors(1)
    assert str(refused.value) == f"{pkg / 'blocks' / 'block-0001.safetensors'}: {problems[0]}"  # as a load says
    assert main(["verify", str(pkg)]) == 1


def test_verify_names_a_small_file_that_is_not_what_the_manifest_says_without_reading_a_special_one(checkpoints,
                                                                                                   tmp_path):
    """A FIFO hung verify and a symlink to /dev/zero exhausted its memory: the file's kind and size are checked
    before it is read."""
    pack(checkpoints["llama"], tmp_path / "pkg", layers_per_block=2)
    config = tmp_path / "pkg" / "config.json"
    size = config.stat().st_size
    config.write_bytes(config.read_bytes() + b" ")
    assert [str(p) for p in verify_package(tmp_path / "pkg")] == [
        f"config.json: disagrees with the manifest: size is {size + 1} bytes, the manifest says {size}"]
    config.write_bytes(config.read_bytes()[:-2] + b"}")  # the same size, another digest
    assert [str(p) for p in verify_package(tmp_path / "pkg")] == [
        "config.json: disagrees with the manifest: digest mismatch"]
    config.unlink()
    os.mkfifo(config)
    assert [str(p) for p in verify_package(tmp_path / "pkg")] == ["config.json: not a regular file"]
    config.unlink()
    config.symlink_to("/dev/zero")
    assert [str(p) for p in verify_package(tmp_path / "pkg")] == ["config.json: not a regular file"]


def test_inspect_table_and_json(checkpoints, tmp_path, capsys):
    manifest = pack(checkpoints["qwen2"], tmp_path / "pkg", layers_per_block=2)
    assert main(["inspect", str(tmp_path / "pkg")]) == 0
    out = capsys.readouterr().out
    assert manifest.package_id in out and "Qwen2ForCausalLM" in out and "BF16" in out
    assert main(["inspect", "--json", str(tmp_path / "pkg")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["package_id"] == manifest.package_id and len(data["blocks"]) == 2


def test_pack_cli_json_and_refuses_existing_output(checkpoints, tmp_path, capsys):
    assert main(["pack", str(checkpoints["gpt2"]), str(tmp_path / "pkg"), "--json", "--chunk-bytes", "64KiB"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["blocks"][0]["chunk_bytes"] == str(64 * 1024)
    assert main(["pack", str(checkpoints["gpt2"]), str(tmp_path / "pkg")]) == 2
    assert "already exists" in capsys.readouterr().err


# --- bad input: typed error in the library, exit 2 naming the file on the CLI, nothing left behind ---

def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def _config(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "architectures": ["X"]}))


def _bad_checkpoints(root: Path, checkpoints) -> dict[str, tuple[Path, type, str]]:
    cases = {}
    d = root / "pickle"
    _config(d)
    torch.save({"w": torch.zeros(1)}, d / "pytorch_model.bin")
    cases["pickle"] = (d, PickleCheckpointError, "pickle checkpoints are refused")
    cases["pickle-file"] = (d / "pytorch_model.bin", PickleCheckpointError, "pickle checkpoints are refused")

    d = root / "truncated"
    _config(d)
    full = (checkpoints["llama"] / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(full[:-100])
    cases["truncated"] = (d, SafetensorsFormatError, "truncated")

    d = root / "overlap"
    _config(d)
    _write_safetensors(d / "model.safetensors", {
        "model.layers.0.a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "model.layers.0.b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))
    cases["overlap"] = (d, SafetensorsFormatError, "overlaps")

    d = root / "overflow"
    _config(d)
    _write_safetensors(d / "model.safetensors", {
        "model.layers.0.a": {"dtype": "F32", "shape": [2**62], "data_offsets": [0, 2**64 - 8]}}, bytes(8))
    cases["overflow"] = (d, SafetensorsFormatError, "model.layers.0.a")

    d = root / "huge-header"
    _config(d)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**63) + b"{}")
    cases["huge-header"] = (d, SafetensorsFormatError, "header length")

    d = root / "dtype"
    _config(d)
    _write_safetensors(d / "model.safetensors", {
        "model.layers.0.a": {"dtype": "F12", "shape": [1], "data_offsets": [0, 2]}}, bytes(2))
    cases["dtype"] = (d, SafetensorsFormatError, "unknown dtype 'F12'")

    d = root / "missing-shard"
    _config(d)
    _write_safetensors(d / "model-1.safetensors", {
        "model.layers.0.a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.layers.0.a": "model-1.safetensors", "model.layers.0.b": "model-2.safetensors"}}))
    cases["missing-shard"] = (d, MissingShardError, "model-2.safetensors")

    d = root / "unplaced"
    _config(d)
    _write_safetensors(d / "model.safetensors", {
        "model.layers.0.a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "mystery.weight": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8))
    cases["unplaced"] = (d, UnplacedTensorsError, "mystery.weight")

    d = root / "no-config"
    d.mkdir()
    cases["no-config"] = (d, CheckpointError, "config.json")
    return cases


BAD_CASES = ["pickle", "pickle-file", "truncated", "overlap", "overflow", "huge-header", "dtype",
             "missing-shard", "unplaced", "no-config"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_checkpoint_typed_error_and_no_output(checkpoints, tmp_path, capsys, case):
    src, error, text = _bad_checkpoints(tmp_path / "in", checkpoints)[case]
    out = tmp_path / "out" / "pkg"
    with pytest.raises(error) as info:
        pack(src, out)
    assert text in str(info.value)
    assert main(["pack", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert text in err and str(src.name) in err
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def _good_package(checkpoints, tmp_path) -> Path:
    pack(checkpoints["llama"], tmp_path / "pkg", layers_per_block=2)
    return tmp_path / "pkg"


def _edit_manifest(pkg: Path, edit) -> None:
    data = json.loads((pkg / "manifest.json").read_text())
    edit(data)
    (pkg / "manifest.json").write_text(json.dumps(data))


def test_manifest_path_escaping_the_package_is_refused(checkpoints, tmp_path, capsys):
    pkg = _good_package(checkpoints, tmp_path)
    _edit_manifest(pkg, lambda d: d["blocks"][0].__setitem__("file", "../../etc/passwd"))
    with pytest.raises(ManifestError, match=r"block 0 file '../../etc/passwd' escapes the package folder"):
        Package.open(pkg)
    assert main(["verify", str(pkg)]) == 2
    assert "manifest.json: invalid manifest" in capsys.readouterr().err


def test_block_size_or_digest_disagreeing_with_manifest(checkpoints, tmp_path, capsys):
    pkg = _good_package(checkpoints, tmp_path)
    path = pkg / "blocks" / "block-0000.safetensors"
    original = path.read_bytes()
    path.write_bytes(original + b"x")
    with pytest.raises(BlockMismatchError, match="size is"):
        Package.open(pkg).block_tensors(0)
    assert main(["verify", str(pkg)]) == 1
    assert "block 0: size is" in capsys.readouterr().err
    corrupted = bytearray(original)
    corrupted[-1] ^= 1
    path.write_bytes(bytes(corrupted))
    last = (len(original) - 1) // Package.open(pkg).block(0).chunk_bytes
    with pytest.raises(BlockMismatchError, match=f"chunk {last} digest mismatch"):  # the last, partial chunk
        Package.open(pkg).block_tensors(0)


@pytest.mark.parametrize("field,value", [("digest", "0" * 64), ("chunk_digests", ["0" * 64])])
def test_manifest_changed_digest_breaks_package_id(checkpoints, tmp_path, field, value):
    pkg = _good_package(checkpoints, tmp_path)
    _edit_manifest(pkg, lambda d: d["blocks"][1].__setitem__(field, value))
    with pytest.raises(ManifestError, match="package_id"):
        read_manifest(pkg)


def _swap_tensor_names(d: dict) -> None:
    d["blocks"][0]["tensor_names"], d["blocks"][1]["tensor_names"] = (d["blocks"][1]["tensor_names"],
                                                                      d["blocks"][0]["tensor_names"])


def _shrink_last_block(d: dict) -> None:
    d["blocks"][-1]["bytes"] = str(int(d["blocks"][-1]["bytes"]) - 1)
    d["total_bytes"] = str(int(d["total_bytes"]) - 1)


@pytest.mark.parametrize("edit", [
    lambda d: d.__setitem__("model_name", "another-model"),
    lambda d: d.__setitem__("tied_embeddings", not d["tied_embeddings"]),
    lambda d: d["blocks"][0].__setitem__("file", "blocks/elsewhere.safetensors"),
    lambda d: d["files"][0].__setitem__("path", "config2.json"),
    _swap_tensor_names,
    _shrink_last_block,
], ids=["model_name", "tied_embeddings", "block file", "file path", "tensor names swapped", "block shrunk"])
def test_a_consistent_but_edited_manifest_is_refused_by_its_package_id(checkpoints, tmp_path, capsys, edit):
    """Edits that keep the manifest self-consistent: the whole-manifest id is what refuses them."""
    pkg = _good_package(checkpoints, tmp_path)
    _edit_manifest(pkg, edit)
    with pytest.raises(ManifestError, match="package_id .* is not the digest of the manifest"):
        read_manifest(pkg)
    assert main(["verify", str(pkg)]) == 2
    assert "is not the digest of the manifest" in capsys.readouterr().err


def test_a_format_version_1_package_is_refused_with_how_to_repack(checkpoints, tmp_path, capsys):
    pkg = _good_package(checkpoints, tmp_path)
    _edit_manifest(pkg, lambda d: d.__setitem__("format_version", 1))
    with pytest.raises(ManifestError, match="format_version 1 packages have a package id that does not cover the "
                                            "whole manifest; repack with `pipecast pack`"):
        Package.open(pkg)
    assert main(["verify", str(pkg)]) == 2
    assert "repack with `pipecast pack`" in capsys.readouterr().err


def test_the_package_id_is_the_digest_of_the_whole_manifest(checkpoints, tmp_path):
    a = pack(checkpoints["llama"], tmp_path / "a", layers_per_block=2)
    assert a.format_version == 2 and compute_package_id(read_manifest(tmp_path / "a")) == a.package_id
    # The model name is part of the manifest, so of the id; the blocks are the same bytes.
    b = pack(checkpoints["llama"], tmp_path / "b", layers_per_block=2, model_name="renamed")
    assert b.package_id != a.package_id
    assert [x.digest for x in b.blocks] == [x.digest for x in a.blocks]


def test_manifest_json_round_trip_is_stable(checkpoints, tmp_path):
    pkg = _good_package(checkpoints, tmp_path)
    manifest = read_manifest(pkg)
    assert manifest_to_json(manifest) == (pkg / "manifest.json").read_text()
    assert os.path.isfile(pkg / "config.json")


def test_unknown_package_folder_is_a_typed_error(tmp_path):
    with pytest.raises(PackageError, match="no such package folder"):
        Package.open(tmp_path / "nope")


def test_partial_folder_of_a_killed_pack_is_removed_by_the_next(checkpoints, tmp_path):
    # A pack killed with SIGKILL cannot clean up; its hidden folder names a pid that no longer runs.
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".pkg.partial-{dead.pid}"
    (stale / "blocks").mkdir(parents=True)
    pack(checkpoints["gpt2"], tmp_path / "pkg")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


def test_a_manifest_too_large_is_refused_before_any_block_is_written(checkpoints, tmp_path, monkeypatch, capsys):
    """Found in review: the manifest's size was checked only once every block was written and hashed
    (``pack big out --chunk-bytes 64``: 19 s and 1.6 GB of blocks, then the refusal)."""
    import packager.pack as pack_module

    src = checkpoints["sharded"]
    pack(src, tmp_path / "ref", layers_per_block=3, chunk_bytes=64, model_name="m")
    length = len((tmp_path / "ref" / "manifest.json").read_bytes())
    monkeypatch.setattr(pack_module, "_write_block", lambda *args, **kwargs: pytest.fail("a block was written"))
    monkeypatch.setattr(pack_module, "MAX_MANIFEST_BYTES", length - 1)  # the size known in advance is exact
    message = (f"{src}: the manifest would be {length} bytes, more than a manifest may have ({length - 1} "
               "bytes); pack with larger chunks (--chunk-bytes)")
    with pytest.raises(PackageError) as caught:
        pack(src, tmp_path / "pkg", layers_per_block=3, chunk_bytes=64, model_name="m")
    assert str(caught.value) == message
    assert main(["pack", str(src), str(tmp_path / "pkg"), "--layers-per-block", "3", "--chunk-bytes", "64",
                 "--name", "m"]) == 2
    assert f"error: {message}\n" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref"]
    monkeypatch.undo()
    monkeypatch.setattr(pack_module, "MAX_MANIFEST_BYTES", length)
    pack(src, tmp_path / "pkg", layers_per_block=3, chunk_bytes=64, model_name="m")


def test_a_tensor_torch_cannot_view_is_refused_before_any_block_is_written(tmp_path, monkeypatch, capsys):
    """Review finding 5: a checkpoint with an F4 tensor packed (and verified), then every load of it failed."""
    import packager.pack as pack_module

    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}))
    header, _ = build_header([("model.embed_tokens.weight", "U8", (8,), 8),
                              ("model.layers.0.mlp.weight", "F4", (4, 4), 8)], {})
    (src / "model.safetensors").write_bytes(header + bytes(16))
    monkeypatch.setattr(pack_module, "_write_block", lambda *args, **kwargs: pytest.fail("a block was written"))
    message = (f"{src / 'model.safetensors'}: tensor 'model.layers.0.mlp.weight' has dtype F4, which torch cannot "
               "view, so pipecast cannot load it")
    with pytest.raises(CheckpointError) as refused:
        pack(src, tmp_path / "pkg")
    assert str(refused.value) == message
    assert main(["pack", str(src), str(tmp_path / "pkg")]) == 2
    assert f"error: {message}\n" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_small_file_that_cannot_be_read_fails_before_any_block_is_written(checkpoints, tmp_path, monkeypatch):
    """Found in review: config and tokenizer files were read only after every block was written."""
    import packager.pack as pack_module

    src = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama"], src)
    real = pack_module.open_checkpoint

    def swapped_after_opening(folder):
        ckpt = real(folder)
        (src / "generation_config.json").unlink()
        os.mkfifo(src / "generation_config.json")  # a FIFO now: refused as it is read
        return ckpt

    monkeypatch.setattr(pack_module, "open_checkpoint", swapped_after_opening)
    monkeypatch.setattr(pack_module, "_write_block", lambda *args, **kwargs: pytest.fail("a block was written"))
    with pytest.raises(CheckpointFileError) as caught:
        pack(src, tmp_path / "pkg")
    assert str(caught.value) == f"{src / 'generation_config.json'}: refused: not a regular file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("how", ["replaced", "rewritten", "rewritten after it was read from"])
def test_a_shard_changed_while_it_is_packed_is_refused_and_leaves_nothing(checkpoints, tmp_path, monkeypatch, how):
    """Found in review: a shard replaced (renamed over) while the first block was written was read at the offsets
    of the header read before, and its header bytes were sealed into the package as weights; verify said OK."""
    import packager.pack as pack_module

    src = tmp_path / "ckpt"
    shutil.copytree(checkpoints["sharded"], src)
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) >= 2
    real = pack_module._write_block
    calls = []

    def change_the_last_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == (2 if how.endswith("read from") else 1):
            last = shards[0] if how.endswith("read from") else shards[-1]
            if how == "replaced":
                data = last.read_bytes()
                (n,) = struct.unpack("<Q", data[:8])
                longer = data[:8 + n] + b" " * 8  # the same tensors, 8 bytes further on
                (tmp_path / "new").write_bytes(struct.pack("<Q", n + 8) + longer[8:] + data[8 + n:])
                os.replace(tmp_path / "new", last)
            else:
                with last.open("r+b") as f:
                    f.seek(-4, os.SEEK_END)
                    f.write(b"\xff\xff\xff\xff")
                os.utime(last, ns=(0, 1))  # a rewrite within the same clock tick would keep its time
        return real(*args, **kwargs)

    monkeypatch.setattr(pack_module, "_write_block", change_the_last_shard)
    with pytest.raises(CheckpointFileError) as refused:
        pack(src, tmp_path / "pkg", layers_per_block=1)
    assert refused.value.path == (shards[0] if how.endswith("read from") else shards[-1])
    assert refused.value.problem.startswith("changed since its header was read")
    assert not (tmp_path / "pkg").exists() and not list(tmp_path.glob(".pkg*"))

