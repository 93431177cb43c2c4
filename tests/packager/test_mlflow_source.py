"""``pipecast pack models:/... | runs:/...`` against a real ``mlflow server`` (SQLite backend, local artifacts).

A tiny random Llama checkpoint is logged as a run's artifacts and registered; packing it from the registry or
the run gives the package of the folder itself (same blocks and block digests, same files), with the source
recorded, and so the same package id once the source is taken out. Bad sources are typed errors that name
what was wrong and leave nothing behind.
"""

import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.tiny_checkpoints import make_checkpoint, write_byte_tokenizer
from packager.errors import MlflowSourceError
from packager.command import format_table
from packager.manifest import read_manifest, seal_manifest
from packager.mlflow_source import source_checkpoint
from packager.pack import pack
from packager.verify import verify_package
from pipecast.cli import main
from pipecast.v1.manifest_pb2 import ModelSource

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                reason="needs the mlflow extra: pip install 'pipecast[mlflow]'")

MODEL, FLAVORED, NO_CHECKPOINT = "tiny-llama", "tiny-flavored", "tiny-notes"
UNKNOWN_RUN = "0123456789abcdef0123456789abcdef"


@dataclass(frozen=True)
class Registry:
    uri: str
    run_id: str
    checkpoint: Path


def _flavored(checkpoint: Path, folder: Path) -> Path:
    """The layout of an mlflow.transformers model saved with its weights: MLmodel, the weights and config in
    model/, the tokenizer apart in components/tokenizer/."""
    (folder / "components" / "tokenizer").mkdir(parents=True)
    (folder / "MLmodel").write_text("flavors:\n  transformers:\n    model_binary: model\n")
    shutil.copytree(checkpoint, folder / "model", ignore=shutil.ignore_patterns("tokenizer*"))
    for tokenizer_file in checkpoint.glob("tokenizer*"):
        shutil.copy(tokenizer_file, folder / "components" / "tokenizer")
    return folder


@pytest.fixture(scope="module")
def registry(mlflow_server, tmp_path_factory) -> Registry:
    """One run holding the checkpoint at model/, a flavored copy at hf/ and a folder without a checkpoint at
    notes/; each registered as version 1 of a model, the checkpoint also under the alias champion."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("mlflow-sources")
    checkpoint = make_checkpoint("llama", root / "llama")
    write_byte_tokenizer(checkpoint)
    notes = root / "notes"
    notes.mkdir()
    (notes / "README.txt").write_text("no weights here\n")
    client = MlflowClient(mlflow_server.uri)
    run_id = client.create_run(client.create_experiment("pack-sources")).info.run_id
    for folder, path in ((checkpoint, "model"), (_flavored(checkpoint, root / "hf"), "hf"), (notes, "notes")):
        client.log_artifacts(run_id, str(folder), path)
    client.set_terminated(run_id)
    for name, path in ((MODEL, "model"), (FLAVORED, "hf"), (NO_CHECKPOINT, "notes")):
        client.create_registered_model(name)
        client.create_model_version(name, f"runs:/{run_id}/{path}", run_id)
    client.set_registered_model_alias(MODEL, "champion", "1")
    return Registry(mlflow_server.uri, run_id, checkpoint)


@pytest.mark.parametrize("form", [f"models:/{MODEL}/1", f"models:/{MODEL}@champion", "runs:/{run}/model"])
def test_a_pack_from_mlflow_is_the_pack_of_the_folder_with_its_source(registry, tmp_path, form):
    src = form.format(run=registry.run_id)
    local = pack(registry.checkpoint, tmp_path / "local")
    out = tmp_path / "fetched" / "pkg"
    assert main(["pack", src, str(out), "--mlflow-uri", registry.uri]) == 0
    fetched = read_manifest(out)
    from_run = src.startswith("runs:/")
    assert fetched.source == ModelSource(uri=src, version="" if from_run else "1", run_id=registry.run_id, path="")
    assert fetched.model_name == ("model" if from_run else MODEL)  # the artifact folder's, or the registry's
    assert list(fetched.blocks) == list(local.blocks)  # block digests, chunk digests, layers, tensors
    assert list(fetched.files) == list(local.files)
    assert fetched.package_id != local.package_id  # the id covers the source...
    fetched.ClearField("source")
    fetched.model_name = local.model_name
    assert seal_manifest(fetched).package_id == local.package_id  # ...and nothing else differs
    assert verify_package(out) == []
    assert [p.name for p in out.parent.iterdir()] == ["pkg"]  # the download folder is gone
    shown = format_table(read_manifest(out)).splitlines()[4]  # what `pipecast inspect` prints
    assert shown == f"source    {src} (version {'-' if from_run else '1'}, run {registry.run_id})"


def test_an_mlflow_transformers_layout_packs_its_weights_with_its_tokenizer(registry, tmp_path):
    local = pack(registry.checkpoint, tmp_path / "local")
    out = tmp_path / "pkg"
    assert main(["pack", f"models:/{FLAVORED}/1", str(out), "--mlflow-uri", registry.uri, "--name", "llama"]) == 0
    fetched = read_manifest(out)
    assert fetched.source.path == "model" and fetched.source.version == "1"
    assert {f.path for f in fetched.files} >= {"tokenizer.json", "tokenizer_config.json"}
    assert list(fetched.files) == list(local.files) and list(fetched.blocks) == list(local.blocks)


@pytest.mark.parametrize("form, message", [
    (f"models:/{MODEL}/9", f"registered model '{MODEL}' has no version 9"),
    (f"models:/{MODEL}@nightly", f"registered model '{MODEL}' has no alias 'nightly'"),
    ("models:/no-such-model/1", "no registered model 'no-such-model'"),
    (f"runs:/{UNKNOWN_RUN}/model", f"no run '{UNKNOWN_RUN}'"),
    ("runs:/{run}/weights", "run {run} has no artifacts at 'weights'"),
    (f"models:/{MODEL}", "not an MLflow URI pipecast packs: expected models:/NAME/VERSION, models:/NAME@ALIAS or "
                         "runs:/RUN_ID/PATH"),
    (f"models:/{NO_CHECKPOINT}/1", "no checkpoint in its artifacts: expected a folder holding config.json and "
                                   "*.safetensors files (a Hugging Face checkpoint folder logged with "
                                   "mlflow.log_artifacts, or an mlflow.transformers model saved with its weights); "
                                   "the artifacts hold README.txt"),
    ("runs:/{run}", "its artifacts hold 2 checkpoint folders (hf/model, model); pack one of them with "
                    "runs:/RUN_ID/PATH"),
])
def test_a_bad_source_is_a_typed_error_naming_it_and_leaves_nothing(registry, tmp_path, form, message):
    src = form.format(run=registry.run_id)
    with pytest.raises(MlflowSourceError) as caught:
        with source_checkpoint(src, scratch=tmp_path, mlflow_uri=registry.uri):
            pytest.fail(f"{src} was resolved")
    assert str(caught.value) == f"{src}: {message.format(run=registry.run_id)}"
    assert list(tmp_path.iterdir()) == []


def test_the_cli_exits_2_with_the_message_and_writes_no_package(registry, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.uri)  # MLflow's convention, when --mlflow-uri is not given
    assert main(["pack", f"models:/{MODEL}/9", str(tmp_path / "pkg")]) == 2
    assert capsys.readouterr().err == f"error: models:/{MODEL}/9: registered model '{MODEL}' has no version 9\n"
    assert list(tmp_path.iterdir()) == []


def test_a_download_left_by_a_killed_pack_is_removed_by_the_next_and_one_in_use_is_not(registry, tmp_path):
    """Found in review: the download folder of a pack killed (SIGKILL) mid-download stayed beside OUT for good, a
    model's size of disk, also after later packs to the same OUT. (A later review: swept by pid, a pack in another
    container or on another host of a shared folder lost its download in use: a lock says, a pid does not.)"""
    import fcntl
    import os
    import time

    def download(name: str, *, age_s: float, lock: bool = True) -> Path:
        folder = tmp_path / f".pipecast-mlflow-{name}"
        (folder / "model").mkdir(parents=True)
        if lock:
            (folder / ".lock").touch()
            os.utime(folder / ".lock", (time.time() - age_s,) * 2)
        return folder

    download("killed", age_s=120)
    download("starting", age_s=0)  # its lock file just made, not yet locked
    download("older", age_s=120, lock=False)  # no lock file: not one of ours to judge
    with open(download("in-use", age_s=120) / ".lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another pack's, elsewhere
        assert main(["pack", f"models:/{MODEL}/1", str(tmp_path / "pkg"), "--mlflow-uri", registry.uri]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".pipecast-mlflow-in-use", ".pipecast-mlflow-older",
                                                          ".pipecast-mlflow-starting", "pkg"]


@pytest.mark.parametrize("uri", ["bogus://x", "127.0.0.1:9"])
def test_a_tracking_uri_the_client_refuses_is_a_typed_error(tmp_path, capsys, uri):
    """Found in review: an unknown scheme, or a URI without one, was MLflow's traceback (the client was built
    outside the calls whose errors are turned into messages)."""
    assert main(["pack", f"models:/{MODEL}/1", str(tmp_path / "pkg"), "--mlflow-uri", uri]) == 2
    assert capsys.readouterr().err.startswith(f"error: MLflow tracking server {uri}: ")
    assert list(tmp_path.iterdir()) == []
