"""What ``pipecast pack`` does with its OUT: never replaces the checkpoint it reads, refuses an OUT it could not
write before any work, and turns a failure to write it into a typed error naming it."""

import json
import os
import re
from pathlib import Path

import pytest

from packager.errors import PackageError
from packager.manifest import read_manifest
from packager.pack import MAX_CHUNK_BYTES, pack
from pipecast.cli import main
from tests.packager.test_checkpoint import hf_snapshot, write_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return write_checkpoint(tmp_path / "ckpt")


def _contents(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


SPARE = "replacing it would delete the checkpoint being packed"
NOT_A_PACKAGE = "a non-empty folder without a valid manifest.json is not a package"  # (test_force_..._not_a_package)
CURRENT = ("refused as the output: the current folder, a folder holding it and a path ending in '..' cannot be "
           "replaced; name the output by a path of its own (such as ../NAME)")


@pytest.mark.parametrize("out, why", [(".", NOT_A_PACKAGE), ("package", SPARE),
                                      ("link", SPARE), ("model.safetensors", SPARE), ("config.json", SPARE)])
def test_force_refuses_an_output_that_is_holds_or_leads_to_the_checkpoint(ckpt, tmp_path, capsys, out, why):
    """Finding 1: ``pack SRC OUT --force`` with OUT the checkpoint (or a folder holding it) deleted it."""
    (tmp_path / "link").symlink_to(ckpt)
    if out == "package":  # a folder holding the checkpoint, and a package's manifest.json: it looks like a package
        pack(ckpt, tmp_path / "p")
        (tmp_path / "p" / "manifest.json").rename(tmp_path / "manifest.json")
    out = tmp_path / "link" if out == "link" else tmp_path if out == "package" else ckpt / out
    before = _contents(ckpt)
    detail = f" ({ckpt.resolve()}" if why == SPARE else ""
    with pytest.raises(PackageError, match=re.escape(f"{out}: refused as the output: ") + ".*" +
                       re.escape(why + detail)):
        pack(ckpt, out, overwrite=True)
    assert main(["pack", str(ckpt), str(out), "--force"]) == 2
    assert why in capsys.readouterr().err
    assert _contents(ckpt) == before
    assert (tmp_path / "link").is_symlink()


def test_force_refuses_a_folder_that_is_not_a_package(ckpt, tmp_path, monkeypatch, capsys):
    """Found in review: ``pack SRC OUT --force`` deleted any existing OUT, a folder of other models too."""
    out = tmp_path / "models"
    (out / "other-model").mkdir(parents=True)
    (out / "other-model" / "model.safetensors").write_bytes(b"weights")
    before = _contents(out)
    message = (f"{out}: refused as the output: {NOT_A_PACKAGE}, and --force would delete it with all it holds")
    monkeypatch.setattr("packager.pack.open_checkpoint", lambda src: pytest.fail("the checkpoint was opened"))
    with pytest.raises(PackageError) as caught:
        pack(ckpt, out, overwrite=True)
    assert str(caught.value) == message
    monkeypatch.setattr("packager.command.source_checkpoint",
                        lambda *args, **kwargs: pytest.fail("the source was fetched"))
    assert main(["pack", str(ckpt), str(out), "--force"]) == 2
    assert f"error: {message}\n" in capsys.readouterr().err
    assert _contents(out) == before
    monkeypatch.undo()
    (out / "other-model").rename(tmp_path / "elsewhere")  # an empty folder, a package: replaced
    assert pack(ckpt, out, overwrite=True).package_id == pack(ckpt, out, overwrite=True).package_id


def test_force_refuses_a_folder_whose_manifest_is_not_a_packages_and_a_mount_point(ckpt, tmp_path, monkeypatch):
    """Found in review: ``--force`` deleted any folder holding a file named manifest.json (a web app's, a docker
    save's); and a mount point passed every check, then failed with EBUSY once the whole pack was done."""
    out = tmp_path / "webapp"
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "app"}')
    (out / "index.html").write_text("<html>")
    with pytest.raises(PackageError) as caught:
        pack(ckpt, out, overwrite=True)
    assert str(caught.value) == (f"{out}: refused as the output: {NOT_A_PACKAGE}, and --force would delete it "
                                 "with all it holds")
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "manifest.json"]
    mounted = tmp_path / "volume"
    mounted.mkdir()
    monkeypatch.setattr("packager.pack.os.path.ismount", lambda path: path == mounted)
    monkeypatch.setattr("packager.pack.open_checkpoint", lambda src: pytest.fail("the checkpoint was opened"))
    with pytest.raises(PackageError) as caught:
        pack(ckpt, mounted, overwrite=True)
    assert str(caught.value) == (f"{mounted}: refused as the output: a mount point cannot be replaced; name a folder "
                                 f"inside it (such as {mounted / 'NAME'})")


def test_force_refuses_the_blob_store_of_a_hugging_face_snapshot(tmp_path):
    """Finding 1: the snapshot's files are symlinks into ../../blobs, which --force would have deleted."""
    snapshot = hf_snapshot(tmp_path / "hub", "org--model")
    blobs = snapshot.parent.parent / "blobs"
    with pytest.raises(PackageError, match=re.escape(f"{blobs}: refused as the output: {NOT_A_PACKAGE}")):
        pack(snapshot, blobs, overwrite=True)
    (tmp_path / "link").symlink_to(blobs)  # a symlink is replaced itself, but one leading to the blobs is refused
    blob = re.escape(f"would delete the checkpoint being packed ({blobs.resolve()}/blob")
    with pytest.raises(PackageError, match=blob):
        pack(snapshot, tmp_path / "link", overwrite=True)
    assert len(list(blobs.iterdir())) == 3


def test_a_package_inside_the_checkpoint_folder_packs_and_repacks(ckpt):
    """The checkpoint is its top-level files: a package in a subfolder of it harms nothing, --force too."""
    first = pack(ckpt, ckpt / "pkg")
    assert pack(ckpt, ckpt / "pkg", overwrite=True).package_id == first.package_id


def test_a_dangling_symlink_output_needs_force(ckpt, tmp_path, capsys):
    """Finding 4: a dangling symlink OUT was found only after every block was written (raw FileExistsError)."""
    out = tmp_path / "pkg"
    out.symlink_to(tmp_path / "nowhere")
    with pytest.raises(PackageError, match=re.escape(f"{out}: already exists (pass --force to replace it)")):
        pack(ckpt, out)
    assert main(["pack", str(ckpt), str(out)]) == 2
    assert "already exists (pass --force to replace it)" in capsys.readouterr().err
    pack(ckpt, out, overwrite=True)
    assert not out.is_symlink() and (out / "manifest.json").is_file()
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("under", ["afile", "afile/deeper", "dangling"])
def test_an_output_under_something_that_is_not_a_folder_is_refused_up_front(ckpt, tmp_path, monkeypatch, under):
    """Finding 4: OUT under a regular file raised a raw FileExistsError."""
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr("packager.pack.open_checkpoint", lambda src: pytest.fail("the checkpoint was opened"))
    parent = tmp_path / under.split("/")[0]
    with pytest.raises(PackageError, match=re.escape(f"{tmp_path / under / 'pkg'}: cannot be created: {parent} "
                                                     "is not a folder")):
        pack(ckpt, tmp_path / under / "pkg")


def test_an_os_error_writing_the_output_is_a_package_error_naming_it(ckpt, tmp_path, monkeypatch):
    """Finding 4: OSError from building OUT (here: OUT appearing meanwhile) escaped raw after the copy."""
    import packager.pack as pack_module

    out = tmp_path / "pkg"
    real = pack_module._write_block

    def appear(*args, **kwargs):
        out.mkdir(exist_ok=True)  # another process creates OUT while this pack runs
        return real(*args, **kwargs)

    monkeypatch.setattr(pack_module, "_write_block", appear)
    with pytest.raises(PackageError, match=re.escape(f"{out}: cannot write the package ({out} appeared while it "
                                                     "was being built)")):
        pack(ckpt, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "pkg"]


@pytest.mark.parametrize("chunk", [0, MAX_CHUNK_BYTES + 1, 20000000000000000000])
def test_a_chunk_size_the_manifest_cannot_hold_is_refused_before_any_work(ckpt, tmp_path, monkeypatch, capsys,
                                                                          chunk):
    """Finding 4: --chunk-bytes 20000000000000000000 (over a uint64) failed in protobuf after the copy."""
    monkeypatch.setattr("packager.pack.open_checkpoint", lambda src: pytest.fail("the checkpoint was opened"))
    message = f"chunk size must be between 1 and {MAX_CHUNK_BYTES} bytes (a uint64 in the manifest), got {chunk}"
    with pytest.raises(PackageError) as caught:
        pack(ckpt, tmp_path / "pkg", chunk_bytes=chunk)
    assert str(caught.value) == message
    if chunk:  # the CLI's size parser refuses 0 itself
        assert main(["pack", str(ckpt), str(tmp_path / "pkg"), "--chunk-bytes", str(chunk)]) == 2
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_the_largest_chunk_size_packs(ckpt, tmp_path):
    manifest = pack(ckpt, tmp_path / "pkg", chunk_bytes=MAX_CHUNK_BYTES)
    assert json.loads((tmp_path / "pkg" / "manifest.json").read_text())["blocks"][0]["chunk_bytes"] == str(
        MAX_CHUNK_BYTES)
    assert all(len(b.chunk_digests) == 1 for b in manifest.blocks)


def test_an_existing_output_is_refused_before_an_mlflow_source_is_downloaded(tmp_path, monkeypatch, capsys):
    """Finding 8: ``pack models:/m/1 existing_out`` downloaded the whole model, then refused OUT."""
    monkeypatch.setattr("packager.command.source_checkpoint",
                        lambda *args, **kwargs: pytest.fail("the source was fetched"))
    (tmp_path / "pkg").mkdir()
    assert main(["pack", "models:/m/1", str(tmp_path / "pkg")]) == 2
    assert f"{tmp_path / 'pkg'}: already exists (pass --force to replace it)" in capsys.readouterr().err
    assert main(["pack", "models:/m/1", str(tmp_path / "pkg"), "--chunk-bytes", str(2**64)]) == 2
    assert "chunk size must be between 1" in capsys.readouterr().err
    assert os.listdir(tmp_path / "pkg") == []


@pytest.mark.parametrize("out", [".", "..", "here", "above", "ckpt/pkg/.."])
def test_an_output_that_is_or_holds_the_current_folder_is_refused_before_any_work(ckpt, tmp_path, monkeypatch,
                                                                                  capsys, out):
    """Review finding 6: ``pack SRC . --force`` in a package folder built the whole package, then failed to move
    '.' aside (EBUSY); a path ending in '..' cannot be moved either."""
    here = tmp_path / "old-pkg"
    pack(ckpt, here)
    monkeypatch.chdir(here)
    out = {"here": here, "above": tmp_path, "ckpt/pkg/..": ckpt / "pkg" / ".."}.get(out, Path(out))
    monkeypatch.setattr("packager.pack.open_checkpoint", lambda src: pytest.fail("the checkpoint was opened"))
    with pytest.raises(PackageError) as refused:
        pack(ckpt, out, overwrite=True)
    assert str(refused.value) == f"{out}: {CURRENT}"
    assert main(["pack", str(ckpt), str(out), "--force"]) == 2
    assert f"error: {out}: {CURRENT}\n" in capsys.readouterr().err
    assert (here / "manifest.json").is_file()


def test_a_package_moved_aside_by_a_killed_pack_is_put_back_before_out_is_judged(ckpt, tmp_path, monkeypatch):
    """Found in review: put back only once the new pack was under way, a package moved aside by a pack killed
    between its two renames made a later pack without --force run in full, then fail ("appeared while it was
    being built")."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = pack(ckpt, tmp_path / "first")
    (tmp_path / "first").rename(tmp_path / f".pkg.partial-old-{dead.pid}")
    out = tmp_path / "pkg"
    monkeypatch.setattr("packager.pack.open_checkpoint", lambda src: pytest.fail("the checkpoint was opened"))
    with pytest.raises(PackageError) as caught:
        pack(ckpt, out)
    assert str(caught.value) == f"{out}: already exists (pass --force to replace it)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "pkg"]
    assert read_manifest(out).package_id == old.package_id
