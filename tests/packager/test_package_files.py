"""A package's small files as the runtime reads them: config.json and the rest checked against the manifest
(size and digest) when asked, and a typed error naming the file for one that is missing, edited or not JSON."""

import json
import os
import re
import shutil

import pytest

from packager.errors import PackageError, PackageFileError
from packager.package import Package
from tests.support import packages
from tests.support.packages import rewrite_unsealed


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """A random-bytes package (no torch) with a config.json and a tokenizer.json."""
    return packages.tiny_package(tmp_path_factory.mktemp("files") / "pkg", layers=2, layer_bytes=256,
                                 tokenizer_bytes=64).path


@pytest.fixture
def copy(package, tmp_path):
    return shutil.copytree(package, tmp_path / "pkg")


def _same_size_edit(path):
    """Change one byte of ``path`` keeping its size (only the digest can tell)."""
    data = bytearray(path.read_bytes())
    data[-2] = ord("0") if data[-2] != ord("0") else ord("1")  # config.json: num_hidden_layers' digit
    path.write_bytes(bytes(data))


def test_verified_files_are_the_manifests(package):
    pkg = Package.open(package)
    assert pkg.small_file("tokenizer.json", verify=True) == (package / "tokenizer.json").read_bytes()
    assert pkg.small_file("no-such-file.json", verify=True) is None
    assert pkg.config == pkg.read_config(verify=False) == json.loads((package / "config.json").read_text())


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_an_edited_file_of_the_same_size_is_a_digest_mismatch(copy, name):
    """Finding 3: an edited config.json (say its rope_theta) loaded silently, with verify on, and gave wrong
    logits: the manifest's digest of it was never checked."""
    _same_size_edit(copy / name)
    message = f"^{re.escape(str(copy / name))}: disagrees with the manifest: digest mismatch$"
    with pytest.raises(PackageFileError, match=message):
        Package.open(copy).small_file(name, verify=True)
    assert Package.open(copy).small_file(name) == (copy / name).read_bytes()  # unchecked, as before
    if name == "config.json":
        with pytest.raises(PackageFileError, match=message):
            Package.open(copy).config


def test_a_file_of_another_size_or_missing_is_refused_by_name(copy):
    config = copy / "config.json"
    size = config.stat().st_size
    config.write_text(config.read_text() + " ")
    with pytest.raises(PackageFileError, match=f"^{re.escape(str(config))}: disagrees with the manifest: size "
                                               f"is {size + 1} bytes, the manifest says {size}$"):
        Package.open(copy).read_config(verify=True)
    config.unlink()
    for verify in (True, False):
        with pytest.raises(PackageFileError, match=f"^{re.escape(str(config))}: cannot read it "
                                                   r"\(No such file or directory\)$"):
            Package.open(copy).read_config(verify=verify)


@pytest.mark.parametrize("text, problem", [
    ("{not json", r"not a valid JSON object \(Expecting property name enclosed in double quotes: .*\)"),
    ("[1]", r"not a valid JSON object \(expected a JSON object, got an array\)"),
])
def test_an_unverified_config_that_is_not_a_json_object_is_a_typed_error(copy, text, problem):
    """Finding 3: a corrupt config.json was a raw JSONDecodeError (AttributeError for a list, later)."""
    config = copy / "config.json"
    rewrite_unsealed(config, text)
    with pytest.raises(PackageFileError, match=f"^{re.escape(str(config))}: {problem}$"):
        Package.open(copy).read_config(verify=False)
    assert issubclass(PackageFileError, PackageError)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_small_file_that_is_not_a_regular_file_is_refused_unread(copy, verify, kind):
    """Review findings 1 and 2: a FIFO named config.json hung every load, and the agent seeding the folder, for
    good; unverified, a symlink to /dev/zero was read until the memory ran out."""
    config = copy / "config.json"
    config.unlink()
    if kind == "fifo":
        os.mkfifo(config)
    else:
        config.symlink_to("/dev/zero")
    with pytest.raises(PackageFileError) as refused:
        Package.open(copy).small_file("config.json", verify=verify)
    assert str(refused.value) == f"{config}: not a regular file"


def test_an_unverified_small_file_of_another_size_is_refused(copy):
    """Review finding 2: unverified, a small file was read whole, whatever its size."""
    tokenizer = copy / "tokenizer.json"
    size = tokenizer.stat().st_size
    tokenizer.write_bytes(tokenizer.read_bytes() + b" ")
    with pytest.raises(PackageFileError) as refused:
        Package.open(copy).small_file("tokenizer.json")
    assert str(refused.value) == (f"{tokenizer}: disagrees with the manifest: size is {size + 1} bytes, the manifest "
                                  f"says {size}")
