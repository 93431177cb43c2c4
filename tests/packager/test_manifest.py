"""Property-based tests of manifest validation: anything malformed is a ManifestError, never a crash."""

import json
import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packager.digest import digest_bytes, package_id
from packager.errors import ManifestError
from packager.manifest import manifest_from_json, manifest_to_json, safe_relative_path
from pipecast.v1.manifest_pb2 import Block, Manifest, PackageFile


def _manifest(blocks: int, layers_per_block: int, chunks: list[int]) -> Manifest:
    bl = []
    for i in range(blocks):
        n = chunks[i % len(chunks)]
        bl.append(Block(index=i, file=f"blocks/block-{i:04d}.safetensors", bytes=n * 100 - 1,
                        layer_start=i * layers_per_block, layer_end=(i + 1) * layers_per_block,
                        tensor_names=[f"model.layers.{i}.w"], digest=digest_bytes(bytes([i])), chunk_bytes=100,
                        chunk_digests=[digest_bytes(bytes([i, c])) for c in range(n)]))
    files = [PackageFile(path="config.json", bytes=2, digest=digest_bytes(b"{}"))]
    return Manifest(format_version=1, package_id=package_id(bl, [("config.json", files[0].digest)]),
                    model_name="m", architecture="LlamaForCausalLM", model_type="llama", dtypes=["F32"],
                    num_layers=blocks * layers_per_block, tied_embeddings=True, digest_algorithm="blake3",
                    total_bytes=sum(b.bytes for b in bl), blocks=bl, files=files)


manifests = st.builds(_manifest, st.integers(1, 6), st.integers(1, 4), st.lists(st.integers(1, 5), min_size=1))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**65, 2**65) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


@given(manifests)
def test_valid_manifests_round_trip(manifest):
    text = manifest_to_json(manifest)
    assert manifest_from_json(text) == manifest
    assert manifest_to_json(manifest_from_json(text)) == text


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


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(manifests, st.data(), json_values)
def test_any_single_mutation_is_valid_or_a_manifest_error(manifest, data, value):
    doc = json.loads(manifest_to_json(manifest))
    container, key = data.draw(st.sampled_from(_paths(doc)))
    container[key] = value
    try:
        parsed = manifest_from_json(json.dumps(doc))
    except ManifestError as exc:
        assert "manifest.json: invalid manifest:" in str(exc)
        return
    # Accepted only if it still describes a self-consistent package.
    assert parsed.package_id == package_id(parsed.blocks,
                                           [(f.path, f.digest) for f in parsed.files])


@given(manifests, st.text(alphabet=string.ascii_letters + "./\\\x00", max_size=12), st.integers(0, 5))
def test_paths_that_escape_are_always_refused(manifest, name, which):
    doc = json.loads(manifest_to_json(manifest))
    block = doc["blocks"][which % len(doc["blocks"])]
    block["file"] = name
    escapes = not safe_relative_path(name)
    try:
        manifest_from_json(json.dumps(doc))
    except ManifestError:
        return
    assert not escapes, f"accepted escaping path {name!r}"
    assert ".." not in name.split("/") and not name.startswith("/")


@given(st.binary(max_size=64))
def test_garbage_is_a_manifest_error(raw):
    try:
        manifest_from_json(raw)
    except ManifestError:
        return
    raise AssertionError("garbage accepted as a manifest")
