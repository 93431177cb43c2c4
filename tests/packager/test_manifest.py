"""Property-based tests of the manifest.

The package id covers the whole manifest: every single-field change of a valid manifest changes the id, so
the manifest with its old id is refused. And parsing is total: random bytes, random JSON, hostile shapes
(deep nesting, huge numbers, duplicate keys) and mutated manifests give a valid manifest or a
ManifestError, never another exception.
"""

import json
import os
import string
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packager.digest import PACKAGE_ID_DOMAIN, digest_bytes
from packager.errors import ManifestError
from packager.manifest import (
    MANIFEST_FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    canonical_manifest_bytes,
    compute_package_id,
    manifest_from_json,
    manifest_to_json,
    safe_relative_path,
    seal_manifest,
    validate_manifest,
)
from pipecast.v1.manifest_pb2 import Block, Manifest, ModelSource, PackageFile

CHUNK = 100
FILES = [("config.json", b"{}"), ("tokenizer.json", b'{"model": {}}')]


def _manifest(blocks: int, layers_per_block: int, chunks: list[int], tensors: int = 2, files: int = 1,
              source: ModelSource | None = None) -> Manifest:
    bl = []
    for i in range(blocks):
        n = chunks[i % len(chunks)]
        bl.append(Block(index=i, file=f"blocks/block-{i:04d}.safetensors", bytes=n * CHUNK - 1,
                        layer_start=i * layers_per_block, layer_end=(i + 1) * layers_per_block,
                        tensor_names=[f"model.layers.{i}.w{t}" for t in range(tensors)],
                        digest=digest_bytes(bytes([i])), chunk_bytes=CHUNK,
                        chunk_digests=[digest_bytes(bytes([i, c])) for c in range(n)]))
    return seal_manifest(Manifest(
        format_version=MANIFEST_FORMAT_VERSION, model_name="m", architecture="LlamaForCausalLM",
        model_type="llama", dtypes=["F32"], num_layers=blocks * layers_per_block, tied_embeddings=True,
        digest_algorithm="blake3", total_bytes=sum(b.bytes for b in bl), blocks=bl,
        files=[PackageFile(path=p, bytes=len(d), digest=digest_bytes(d)) for p, d in FILES[:files]],
        source=source))


SOURCE = ModelSource(uri="models:/tiny/3", version="3", run_id="0123456789abcdef0123456789abcdef", path="model")
manifests = st.builds(_manifest, st.integers(1, 5), st.integers(1, 3), st.lists(st.integers(1, 4), min_size=1),
                      st.integers(1, 3), st.integers(0, 2), source=st.sampled_from([None, SOURCE]))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**65, 2**65) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


def test_the_id_is_the_domain_separated_digest_of_the_manifest_without_its_id():
    import blake3

    manifest = _manifest(2, 2, [3])
    canonical = canonical_manifest_bytes(manifest)
    unsealed = Manifest()
    unsealed.CopyFrom(manifest)
    unsealed.package_id = ""
    assert canonical == manifest_to_json(unsealed).encode()
    assert manifest.package_id == blake3.blake3(PACKAGE_ID_DOMAIN + canonical).hexdigest()
    assert PACKAGE_ID_DOMAIN == b"pipecast manifest v2\n"
    assert canonical.isascii()


def test_an_unset_source_is_not_in_the_canonical_bytes_so_folder_packs_keep_their_ids():
    manifest = _manifest(2, 2, [3])
    assert b'"source"' not in canonical_manifest_bytes(manifest)
    fetched = _manifest(2, 2, [3], source=SOURCE)
    assert b'"uri": "models:/tiny/3"' in canonical_manifest_bytes(fetched)
    assert fetched.package_id != manifest.package_id
    fetched.ClearField("source")
    assert seal_manifest(fetched).package_id == manifest.package_id


def test_a_source_without_uri_is_refused():
    with pytest.raises(ManifestError, match="invalid manifest: source has no uri$"):
        validate_manifest(_manifest(1, 1, [1], source=ModelSource(version="1")))


@given(manifests)
def test_valid_manifests_round_trip(manifest):
    text = manifest_to_json(manifest)
    assert manifest_from_json(text) == manifest
    assert manifest_to_json(manifest_from_json(text)) == text
    assert compute_package_id(manifest_from_json(text)) == manifest.package_id


# -- every single-field change changes the id --------------------------------------------------------------

Mutation = Callable[[Manifest], None]  # changes a manifest in place
_UINT_MAX = {"uint32": 2**32 - 1, "uint64": 2**64 - 1}


def _other_scalar(draw, old, kind: str):
    """A value of proto scalar ``kind`` other than ``old``."""
    if kind == "bool":
        return not old
    if kind == "string":
        return draw(st.one_of(st.just(old + "x"), st.just(old[:-1]), st.text(max_size=12)).filter(lambda v: v != old))
    return draw(st.one_of(st.just(old + 1), st.just(max(old - 1, 0)), st.integers(0, _UINT_MAX[kind]))
                .filter(lambda v: v != old))


def _other_list(draw, old: list[str]) -> list[str]:
    """A list of strings other than ``old``: one appended, dropped, replaced, or two swapped."""
    options = [old + [draw(st.text(max_size=8))]]
    if old:
        i = draw(st.integers(0, len(old) - 1))
        options += [old[:i] + old[i + 1:], old[:i] + [old[i] + "x"] + old[i + 1:]]
    if len(set(old)) > 1:
        i, j = draw(st.permutations(range(len(old))))[:2]
        swapped = list(old)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        if swapped != old:
            options.append(swapped)
    return draw(st.sampled_from(options))


def _field_kind(field) -> str:
    return {field.TYPE_BOOL: "bool", field.TYPE_STRING: "string", field.TYPE_UINT32: "uint32",
            field.TYPE_UINT64: "uint64"}[field.type]


def _set_field(draw, message, field) -> str:
    """Change ``field`` of ``message`` (a scalar or a repeated string) to another value; returns a label."""
    old = getattr(message, field.name)
    if field.is_repeated:
        new = _other_list(draw, list(old))
        del old[:]
        old.extend(new)
    else:
        setattr(message, field.name, _other_scalar(draw, old, _field_kind(field)))
    return field.name


@st.composite
def single_changes(draw, manifest: Manifest) -> tuple[str, Manifest]:
    """A copy of ``manifest`` with one thing changed, and what: a top-level field, a field of one block or
    file, a file added or dropped, or one of the forgeries every structural check passes (:func:`_forgeries`)."""
    changed = Manifest()
    changed.CopyFrom(manifest)
    kinds = ["manifest", "block", "forgery", "add file"] + (["file", "drop file"] if manifest.files else []) \
        + (["source", "drop source"] if manifest.HasField("source") else ["add source"])
    kind = draw(st.sampled_from(kinds))
    if kind == "manifest":
        field = draw(st.sampled_from([f for f in Manifest.DESCRIPTOR.fields
                                      if f.name not in ("package_id", "blocks", "files", "source")]))
        return _set_field(draw, changed, field), changed
    if kind == "source":
        field = draw(st.sampled_from(list(ModelSource.DESCRIPTOR.fields)))
        return f"source {_set_field(draw, changed.source, field)}", changed
    if kind == "add source":
        changed.source.CopyFrom(SOURCE)
        return "a source added", changed
    if kind == "drop source":
        changed.ClearField("source")
        return "the source dropped", changed
    if kind in ("block", "file"):
        items = getattr(changed, "blocks" if kind == "block" else "files")
        i = draw(st.integers(0, len(items) - 1))
        field = draw(st.sampled_from(list(items[i].DESCRIPTOR.fields)))
        return f"{kind} {i} {_set_field(draw, items[i], field)}", changed
    if kind == "add file":
        changed.files.add(path="extra.txt", bytes=1, digest=digest_bytes(b"x"))
        return "a file added", changed
    if kind == "drop file":
        j = draw(st.integers(0, len(changed.files) - 1))
        del changed.files[j]
        return f"file {j} dropped", changed
    label, forge = draw(st.sampled_from(_forgeries(manifest)))
    forge(changed)
    return label, changed


def _forgeries(manifest: Manifest) -> list[tuple[str, Mutation]]:
    """Changes that keep the manifest self-consistent: only the id can catch them."""
    out: list[tuple[str, Mutation]] = [
        ("rename a block file", lambda m: setattr(m.blocks[0], "file", "blocks/other.safetensors")),
        ("rename the model", lambda m: setattr(m, "model_name", m.model_name + "-evil")),
        ("another architecture", lambda m: setattr(m, "architecture", "GPT2LMHeadModel")),
        ("untie the embeddings", lambda m: setattr(m, "tied_embeddings", not m.tied_embeddings)),
        ("rename a tensor", lambda m: m.blocks[-1].tensor_names.__setitem__(0, "lm_head.weight")),
    ]
    last = manifest.blocks[-1]
    if last.bytes % last.chunk_bytes != 1:  # the last chunk has a byte to lose

        def shrink(m: Manifest) -> None:
            m.blocks[-1].bytes -= 1
            m.total_bytes -= 1
        out.append(("shrink the last block within its last chunk", shrink))
    if len(manifest.blocks) > 1:

        def swap(m: Manifest) -> None:
            a, b = list(m.blocks[0].tensor_names), list(m.blocks[1].tensor_names)
            m.blocks[0].tensor_names[:] = b
            m.blocks[1].tensor_names[:] = a
        out.append(("swap tensor names between blocks", swap))
    return out


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(manifests, st.data())
def test_every_single_field_change_changes_the_id_and_is_refused_with_the_old_one(manifest, data):
    label, changed = data.draw(single_changes(manifest))
    assert changed != manifest, label
    assert compute_package_id(changed) != manifest.package_id, f"{label}: the package id did not change"
    with pytest.raises(ManifestError):
        validate_manifest(changed)  # it still carries the old id
    with pytest.raises(ManifestError):
        manifest_from_json(manifest_to_json(changed))


def _changed_value(message, field):
    old = getattr(message, field.name)
    if field.is_repeated:
        return [*old, "x"]
    kind = _field_kind(field)
    return not old if kind == "bool" else f"{old}x" if kind == "string" else old + 1


def test_every_field_of_manifest_block_and_file_is_covered_by_the_id():
    """Not sampled: each field in turn (any field added to the proto later is covered too)."""
    manifest = _manifest(2, 1, [2], files=2, source=SOURCE)
    targets = [(Manifest.DESCRIPTOR, lambda m: m), (Block.DESCRIPTOR, lambda m: m.blocks[1]),
               (PackageFile.DESCRIPTOR, lambda m: m.files[1]), (ModelSource.DESCRIPTOR, lambda m: m.source)]
    changed_fields = []
    for descriptor, pick in targets:
        for field in descriptor.fields:
            if field.name == "package_id" or field.message_type is not None:
                continue
            changed = Manifest()
            changed.CopyFrom(manifest)
            target = pick(changed)
            value = _changed_value(target, field)
            if field.is_repeated:
                getattr(target, field.name)[:] = value
            else:
                setattr(target, field.name, value)
            assert compute_package_id(changed) != manifest.package_id, field.full_name
            with pytest.raises(ManifestError):
                manifest_from_json(manifest_to_json(changed))
            changed_fields.append(field.full_name)
    assert len(changed_fields) == len(Manifest.DESCRIPTOR.fields) - 4 + len(Block.DESCRIPTOR.fields) \
        + len(PackageFile.DESCRIPTOR.fields) + len(ModelSource.DESCRIPTOR.fields)


@given(manifests, st.data())
def test_forgeries_pass_every_check_but_the_id(manifest, data):
    """The changes the v1 id did not cover are consistent manifests: only the whole-manifest id refuses them."""
    label, change = data.draw(st.sampled_from(_forgeries(manifest)))
    forged = Manifest()
    forged.CopyFrom(manifest)
    change(forged)
    with pytest.raises(ManifestError, match="package_id .* is not the digest of the manifest"):
        manifest_from_json(manifest_to_json(forged))
    resealed = seal_manifest(forged)
    assert manifest_from_json(manifest_to_json(resealed)) == resealed, label
    assert resealed.package_id != manifest.package_id


def test_a_digest_with_a_trailing_newline_is_malformed_even_when_sealed():
    # Found by fuzzing: "^...$" let "<64 hex>\n" pass; such a chunk or file could then never verify.
    for which in ("chunk", "file"):
        manifest = _manifest(1, 1, [1])
        if which == "chunk":
            manifest.blocks[0].chunk_digests[0] += "\n"
        else:
            manifest.files[0].digest += "\n"
        with pytest.raises(ManifestError, match="has a malformed digest"):
            validate_manifest(seal_manifest(manifest))


def test_a_changed_package_id_is_refused():
    manifest = _manifest(2, 1, [2])
    manifest.package_id = "0" * 64
    with pytest.raises(ManifestError, match="package_id '0000"):
        validate_manifest(manifest)


def test_format_version_1_is_refused_with_how_to_repack():
    old = _manifest(1, 1, [1])
    old.format_version = 1
    with pytest.raises(ManifestError, match="format_version 1 packages have a package id that does not cover the "
                                            "whole manifest; repack with `pipecast pack`"):
        manifest_from_json(manifest_to_json(seal_manifest(old)))


# -- parsing is total: a manifest or a ManifestError --------------------------------------------------------


def _paths(data: dict) -> list[list]:
    """Every (container, key) in a JSON tree, so a test can replace any one value."""
    out = []
    stack = [data]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            out.append([node, key])
            if isinstance(value, (dict, list)):
                stack.append(value)
    return out


def _accepted_only_unchanged(text: str | bytes, manifest: Manifest) -> None:
    try:
        parsed = manifest_from_json(text)
    except ManifestError as exc:
        assert "manifest.json: invalid manifest:" in str(exc)
        assert len(str(exc)) < 2000  # a hostile manifest cannot make the message huge
        return
    # Accepted only if it is the same manifest (e.g. a size written as a number instead of a string).
    assert parsed == manifest


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(manifests, st.data(), json_values)
def test_any_single_json_value_replaced_is_the_same_manifest_or_a_manifest_error(manifest, data, value):
    doc = json.loads(manifest_to_json(manifest))
    container, key = data.draw(st.sampled_from(_paths(doc)))
    container[key] = value
    _accepted_only_unchanged(json.dumps(doc), manifest)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(manifests, st.data())
def test_mangled_manifest_text_is_the_same_manifest_or_a_manifest_error(manifest, data):
    text = manifest_to_json(manifest).encode()
    how = data.draw(st.sampled_from(["truncate", "insert", "delete", "duplicate a key", "flip a byte"]))
    at = data.draw(st.integers(0, len(text)))
    if how == "truncate":
        text = text[:at]
    elif how == "insert":
        junk = data.draw(st.binary(min_size=1, max_size=8) | st.sampled_from([b"[", b"{", b"\\u", b"1e999"]))
        text = text[:at] + junk + text[at:]
    elif how == "delete":
        text = text[:at] + text[at + data.draw(st.integers(1, 16)):]
    elif how == "duplicate a key":
        line = data.draw(st.sampled_from([ln for ln in text.split(b"\n") if b'": ' in ln and ln.rstrip().endswith(b",")]
                                         or [b'"model_name": "m",']))
        text = text.replace(line, line + b"\n" + line, 1)
    else:
        if not text:
            return
        at = min(at, len(text) - 1)
        text = text[:at] + bytes([text[at] ^ data.draw(st.integers(1, 255))]) + text[at + 1:]
    _accepted_only_unchanged(text, manifest)


@given(st.binary(max_size=256))
def test_random_bytes_are_a_manifest_error(raw):
    with pytest.raises(ManifestError):
        manifest_from_json(raw)


@given(json_values)
def test_random_json_is_a_manifest_error(value):
    with pytest.raises(ManifestError):
        manifest_from_json(json.dumps(value))


@given(st.text(alphabet='[]{}",:0123456789.eE-+ntrufalse\\', max_size=64))
def test_random_json_like_text_is_a_manifest_error(text):
    with pytest.raises(ManifestError):
        manifest_from_json(text)


@pytest.mark.parametrize("text,problem", [
    ("[" * 100_000, "nested too deeply"),
    ('{"a": ' * 100_000, "nested too deeply"),
    ('{"blocks": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"format_version": 1e400}', "number 1e400 is out of range"),
    ('{"total_bytes": -1e400}', "number -1e400 is out of range"),
    ('{"format_version": NaN}', "NaN is not a JSON number"),
    ('{"format_version": Infinity}', "Infinity is not a JSON number"),
    ('{"total_bytes": ' + "9" * 5000 + "}", "not acceptable JSON"),
    ('{"total_bytes": ' + "9" * 30 + "}", "does not match the schema"),
    ('{"total_bytes": "' + "9" * 5000 + '"}', "does not match the schema"),
    ('{"model_name": "a", "model_name": "b"}', "duplicate key 'model_name'"),
    ('{"blocks": [{"file": "a", "file": "b"}]}', "duplicate key 'file'"),
    ("[]", "expected a JSON object, got an array"),
    ('"manifest"', "expected a JSON object, got a string"),
    ("42", "expected a JSON object, got a number"),
    ("null", "expected a JSON object, got null"),
    ("true", "expected a JSON object, got a boolean"),
    (b"\xff\xfe\x00", "not UTF-8"),
    ('{"model_name": "\\ud800"}', "lone surrogate"),
    ('{"blocks": [[[[]]]]}', "does not match the schema"),
    ('{"format_version": 2, "extra": 1}', "does not match the schema"),
])
def test_hostile_shapes_are_a_manifest_error_naming_the_problem(text, problem):
    with pytest.raises(ManifestError) as refused:
        manifest_from_json(text, where="manifest from peer evil@10.0.0.9:7070")
    assert str(refused.value).startswith("manifest from peer evil@10.0.0.9:7070: invalid manifest: ")
    assert problem in str(refused.value)


def test_oversized_input_is_refused_unparsed():
    with pytest.raises(ManifestError, match=f"larger than the {MAX_MANIFEST_BYTES >> 20} MiB"):
        manifest_from_json(b" " * (MAX_MANIFEST_BYTES + 1))


def test_an_oversized_manifest_file_is_refused_unread(tmp_path):
    from packager.manifest import read_manifest

    with (tmp_path / "manifest.json").open("wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 10)  # sparse: no 64 MiB written
    with pytest.raises(ManifestError, match="larger than"):
        read_manifest(tmp_path)


@given(manifests, st.text(alphabet=string.ascii_letters + "./\\\x00", max_size=12), st.integers(0, 5))
def test_paths_that_escape_are_always_refused(manifest, name, which):
    block = manifest.blocks[which % len(manifest.blocks)]
    block.file = name
    seal_manifest(manifest)  # a consistent id: the path check alone must refuse it
    escapes = not safe_relative_path(name)
    try:
        manifest_from_json(manifest_to_json(manifest))
    except ManifestError:
        return
    assert not escapes, f"accepted escaping path {name!r}"
    assert ".." not in name.split("/") and not name.startswith("/")


@pytest.mark.parametrize("edit, problem", [
    (lambda m: setattr(m.blocks[0], "file", "manifest.json"),
     "block 0 file 'manifest.json' has the manifest's own path"),
    (lambda m: setattr(m.files[0], "path", "manifest.json"), "file 'manifest.json' has the manifest's own path"),
    (lambda m: setattr(m.blocks[1], "file", "config.json/x"), "block 1 file 'config.json/x' is inside file "
                                                              "'config.json'"),
    (lambda m: setattr(m.files[1], "path", "blocks/block-0000.safetensors/t.json"),
     "file 'blocks/block-0000.safetensors/t.json' is inside block 0 file 'blocks/block-0000.safetensors'"),
    (lambda m: setattr(m.files[1], "path", "blocks"),
     "block 0 file 'blocks/block-0000.safetensors' is inside file 'blocks'"),
])
def test_a_path_that_is_the_manifests_or_inside_another_entrys_is_refused(edit, problem):
    """Review finding 4: a block file named manifest.json, or under another entry's path (a folder that is a file),
    passed: an agent caching the package overwrote its own cached manifest with the block's bytes."""
    manifest = _manifest(2, 1, [1], files=2)
    edit(manifest)
    with pytest.raises(ManifestError) as refused:
        validate_manifest(seal_manifest(manifest))  # a consistent id: the path check alone must refuse it
    assert refused.value.problem == problem


@pytest.mark.timeout(10)
def test_a_path_of_a_hundred_thousand_components_is_checked_at_once():
    """Found in review: each of a path's prefixes was rebuilt to look it up, so a peer's 200 kB manifest held a core
    for 30 s before it was refused (a 64 MiB one for days)."""
    manifest = _manifest(2, 1, [1], files=2)
    manifest.files[1].path = "/".join(["d"] * 100_000)
    validate_manifest(seal_manifest(manifest))  # no entry is inside another: accepted
    manifest.files[0].path = "d/d"
    with pytest.raises(ManifestError) as refused:
        validate_manifest(seal_manifest(manifest))
    assert refused.value.problem.startswith("file 'd/d/d/d/") and refused.value.problem.endswith(
        "is inside file 'd/d'")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_manifest_that_is_not_a_regular_file_is_refused_unread(tmp_path, capsys, kind):
    """Review finding 1: a FIFO named manifest.json hung `pipecast verify`, `inspect` and every load for good; a
    symlink to /dev/zero was read (64 MiB of it) before it was refused as too large."""
    from packager.manifest import read_manifest
    from pipecast.cli import main

    path = tmp_path / "manifest.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    with pytest.raises(ManifestError) as refused:
        read_manifest(tmp_path)
    assert str(refused.value) == f"{path}: invalid manifest: not a regular file"
    for command in ("verify", "inspect"):
        assert main([command, str(tmp_path)]) == 2
        assert f"{path}: invalid manifest: not a regular file" in capsys.readouterr().err
