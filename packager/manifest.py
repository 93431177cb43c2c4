"""The manifest: reading, validating and writing ``manifest.json`` (protobuf schema, JSON on disk).

The schema is ``pipecast.v1.Manifest`` (proto/pipecast/v1/manifest.proto), the single source of truth for
the manifest here and over gRPC. On disk it is the proto3 JSON mapping with the proto's field names (so
64-bit sizes appear as strings, as that mapping specifies).
"""

import json
import math
import re
from pathlib import Path, PurePosixPath

from google.protobuf import json_format

from packager.digest import DIGEST_ALGORITHM, package_id
from packager.errors import ManifestError
from pipecast.v1.manifest_pb2 import Manifest

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT_VERSION = 1
_HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def manifest_to_json(manifest: Manifest) -> str:
    """Deterministic JSON text of a manifest (same manifest, same bytes)."""
    data = json_format.MessageToDict(manifest, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def manifest_from_json(text: str | bytes, where: Path | str = MANIFEST_FILE) -> Manifest:
    """Parse and validate manifest JSON text; raise ManifestError naming ``where`` and the problem."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(where, f"not JSON ({exc})") from None
    manifest = Manifest()
    try:
        json_format.ParseDict(data, manifest)
    except (json_format.ParseError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(where, f"does not match the schema ({exc})") from None
    validate_manifest(manifest, where)
    return manifest


def read_manifest(package_dir: Path) -> Manifest:
    """Read and validate ``package_dir/manifest.json``."""
    path = package_dir / MANIFEST_FILE
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ManifestError(path, f"cannot read ({exc.strerror})") from None
    return manifest_from_json(text, path)


def safe_relative_path(path: str) -> bool:
    """True if ``path`` is a plain relative POSIX path that stays inside the package folder."""
    if not path or "\\" in path or "\x00" in path:
        return False
    pure = PurePosixPath(path)
    return not pure.is_absolute() and all(p not in ("..", ".", "") for p in path.split("/"))


def validate_manifest(m: Manifest, where: Path | str = MANIFEST_FILE) -> None:
    """Check a manifest's internal consistency; raise ManifestError on the first problem."""
    def fail(problem: str) -> None:
        raise ManifestError(where, problem)

    if m.format_version != MANIFEST_FORMAT_VERSION:
        fail(f"format_version {m.format_version} is not supported (expected {MANIFEST_FORMAT_VERSION})")
    if m.digest_algorithm != DIGEST_ALGORITHM:
        fail(f"digest_algorithm {m.digest_algorithm!r} is not supported (expected {DIGEST_ALGORITHM!r})")
    if not m.blocks:
        fail("no blocks")
    seen_paths: set[str] = set()
    seen_tensors: set[str] = set()
    next_layer = 0
    for i, b in enumerate(m.blocks):
        name = f"block {i}"
        if b.index != i:
            fail(f"{name} has index {b.index}; blocks must be numbered 0..{len(m.blocks) - 1} in order")
        if not safe_relative_path(b.file):
            fail(f"{name} file {b.file!r} escapes the package folder or is not a relative path")
        if b.file in seen_paths:
            fail(f"{name} file {b.file!r} is listed twice")
        seen_paths.add(b.file)
        if b.layer_start != next_layer or b.layer_end <= b.layer_start:
            fail(f"{name} layer range [{b.layer_start}, {b.layer_end}) does not continue from layer "
                 f"{next_layer}")
        next_layer = b.layer_end
        if b.bytes == 0 or b.chunk_bytes == 0:
            fail(f"{name} has zero bytes or a zero chunk size")
        expected_chunks = math.ceil(b.bytes / b.chunk_bytes)
        if len(b.chunk_digests) != expected_chunks:
            fail(f"{name} has {len(b.chunk_digests)} chunk digests; {b.bytes} bytes in chunks of "
                 f"{b.chunk_bytes} need {expected_chunks}")
        for d in (b.digest, *b.chunk_digests):
            if not _HEX_DIGEST.match(d):
                fail(f"{name} has a malformed digest {d!r}")
        if not b.tensor_names:
            fail(f"{name} holds no tensors")
        dup = seen_tensors.intersection(b.tensor_names)
        if dup or len(set(b.tensor_names)) != len(b.tensor_names):
            fail(f"{name} repeats tensor names {sorted(dup) or 'within the block'}")
        seen_tensors.update(b.tensor_names)
    if next_layer != m.num_layers:
        fail(f"blocks cover layers [0, {next_layer}) but num_layers is {m.num_layers}")
    if m.total_bytes != sum(b.bytes for b in m.blocks):
        fail(f"total_bytes {m.total_bytes} is not the sum of the block sizes")
    for f in m.files:
        if not safe_relative_path(f.path) or f.path == MANIFEST_FILE:
            fail(f"file {f.path!r} escapes the package folder or is not a relative path")
        if f.path in seen_paths:
            fail(f"file {f.path!r} is listed twice")
        seen_paths.add(f.path)
        if not _HEX_DIGEST.match(f.digest):
            fail(f"file {f.path!r} has a malformed digest {f.digest!r}")
    expected_id = package_id(m.blocks, ((f.path, f.digest) for f in m.files))
    if m.package_id != expected_id:
        fail(f"package_id {m.package_id!r} does not match its block and file digests")
