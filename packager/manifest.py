"""The manifest: reading, validating and writing ``manifest.json`` (protobuf schema, JSON on disk).

The schema is ``pipecast.v1.Manifest`` (proto/pipecast/v1/manifest.proto), the single source of truth for
the manifest here and over gRPC. On disk it is the proto3 JSON mapping with the proto's field names (so
64-bit sizes appear as strings, as that mapping specifies).

The package id covers the whole manifest (format version 2): it is the BLAKE3 digest of
``b"pipecast manifest v2\\n"`` followed by the manifest's canonical bytes, which are the UTF-8 text
:func:`manifest_to_json` writes for the manifest with ``package_id`` set to ``""`` (every field, sorted
keys, two-space indent, ASCII only). A manifest whose id does not match is refused, so no field (a block's
file, size, layer range or tensor names, a chunk digest, a small file, the model's name or flags) can be
changed without changing the id. Format version 1 ids covered only the block and file digests; those
manifests are refused. The canonical JSON prints every field of the schema, defaults included, so adding a
scalar or repeated field to ``pipecast.v1.Manifest`` changes every id: bump :data:`MANIFEST_FORMAT_VERSION`
with it. A message field has presence and is printed only when set: ``source`` (where ``pipecast pack``
fetched the checkpoint, e.g. an MLflow model version) is absent from the manifest of a package packed from a
local folder, whose id is the one it had before that field existed.

Manifests also arrive from peers, so parsing is defensive: anything that is not a manifest (too large, too
deeply nested, duplicate keys, numbers out of range, not an object: :mod:`pipecast.core.strictjson`) is a
:class:`ManifestError`, never another exception.
"""

import json
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import NoReturn

from google.protobuf import json_format

from packager.digest import DIGEST_ALGORITHM, package_id_of_canonical
from packager.errors import ManifestError
from packager.safetensors_format import open_regular_file
from pipecast.core.strictjson import JSONInputError, loads_object
from pipecast.v1.manifest_pb2 import Manifest

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT_VERSION = 2  # 2: the package id covers the whole manifest
# Larger manifests are refused unread. 64 MiB holds ~870k chunk digests: ~0.85 TiB of blocks in 1 MiB chunks
# (pack a larger model with larger chunks). Parsing and validating one that large takes ~5 s and ~300 MB.
MAX_MANIFEST_BYTES = 64 << 20
HEX_DIGEST = re.compile(r"[0-9a-f]{64}")  # fullmatch: "$" would let a trailing newline in


def _manifest_dict(manifest: Manifest) -> dict:
    return json_format.MessageToDict(manifest, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _dumps(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def manifest_to_json(manifest: Manifest) -> str:
    """Deterministic JSON text of a manifest (same manifest, same bytes)."""
    return _dumps(_manifest_dict(manifest))


def canonical_manifest_bytes(manifest: Manifest) -> bytes:
    """What the package id is a digest of: :func:`manifest_to_json` of ``manifest`` with ``package_id``
    empty, as UTF-8 (all ASCII). Every other field is in it, so two manifests that differ anywhere but in
    ``package_id`` have different canonical bytes."""
    data = _manifest_dict(manifest)
    data["package_id"] = ""
    return _dumps(data).encode()


def compute_package_id(manifest: Manifest) -> str:
    """The package id ``manifest`` must carry: the digest of its canonical bytes (see the module doc)."""
    return package_id_of_canonical(canonical_manifest_bytes(manifest))


def seal_manifest(manifest: Manifest) -> Manifest:
    """Set ``manifest.package_id`` to :func:`compute_package_id` of it (the last step of building one);
    returns it."""
    manifest.package_id = compute_package_id(manifest)
    return manifest


def _cut(text: str) -> str:
    """A message part cut short if long (a parser's message may quote a megabyte of the input)."""
    return text if len(text) <= 300 else text[:300] + "..."


def _brief(exc: BaseException) -> str:
    return _cut(f"{type(exc).__name__}: {exc}")


def manifest_from_json(text: str | bytes, where: Path | str = MANIFEST_FILE) -> Manifest:
    """Parse and validate manifest JSON text (from disk or from a peer); raise ManifestError naming ``where``
    and the problem, whatever the text holds (never another exception)."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(where, f"is larger than the {MAX_MANIFEST_BYTES >> 20} MiB a manifest may have")
    try:
        data = loads_object(text)
    except JSONInputError as exc:
        raise ManifestError(where, f"not acceptable JSON ({_cut(str(exc))})") from None
    except Exception as exc:  # whatever else untrusted bytes provoke: still "not a manifest"
        raise ManifestError(where, f"not acceptable JSON ({_brief(exc)})") from None
    manifest = Manifest()
    try:
        json_format.ParseDict(data, manifest)
    except Exception as exc:  # ParseError, and TypeError/ValueError/RecursionError on odd trees
        raise ManifestError(where, f"does not match the schema ({_brief(exc)})") from None
    try:
        validate_manifest(manifest, where)
    except ManifestError:
        raise
    except Exception as exc:
        raise ManifestError(where, f"cannot be validated ({_brief(exc)})") from None
    return manifest


def read_manifest(package_dir: Path) -> Manifest:
    """Read and validate ``package_dir/manifest.json``."""
    path = Path(package_dir) / MANIFEST_FILE
    try:
        with open_regular_file(path, ManifestError) as (f, _):
            text = f.read(MAX_MANIFEST_BYTES + 1)  # no more: a larger one is refused unread
    except OSError as exc:
        raise ManifestError(path, f"cannot read ({exc.strerror})") from None
    return manifest_from_json(text, path)


def _show(text: str) -> str:
    """``text`` quoted for a message, cut short if long (a hostile manifest's strings can be megabytes)."""
    return repr(text) if len(text) <= 200 else f"{text[:200]!r}..."


def safe_relative_path(path: str) -> bool:
    """True if ``path`` is a plain relative POSIX path that stays inside the package folder."""
    if not path or "\\" in path or "\x00" in path:
        return False
    pure = PurePosixPath(path)
    return not pure.is_absolute() and all(p not in ("..", ".", "") for p in path.split("/"))


def _check_entry_path(what: str, path: str, seen: dict[str, str], fail: Callable[[str], NoReturn]) -> None:
    """Refuse the path of a block or small file (``what`` says which) that escapes the package folder, is the
    manifest's own (a receiver writing the entry would overwrite its manifest) or is another entry's; add it to
    ``seen``."""
    if not safe_relative_path(path):
        fail(f"{what} escapes the package folder or is not a relative path")
    if path == MANIFEST_FILE:
        fail(f"{what} has the manifest's own path")
    if path in seen:
        fail(f"{what} is listed twice")
    seen[path] = what


#: The key of a path tree's node that marks an entry there ("": no path component is empty).
_ENTRY = ""


def validate_manifest(m: Manifest, where: Path | str = MANIFEST_FILE) -> None:
    """Check a manifest's internal consistency and that its package id is the digest of the whole manifest;
    raise ManifestError on the first problem."""
    def fail(problem: str) -> NoReturn:
        raise ManifestError(where, problem)

    if m.format_version == 1:
        fail("format_version 1 packages have a package id that does not cover the whole manifest; repack with "
             "`pipecast pack`")
    if m.format_version != MANIFEST_FORMAT_VERSION:
        fail(f"format_version {m.format_version} is not supported (expected {MANIFEST_FORMAT_VERSION})")
    if m.digest_algorithm != DIGEST_ALGORITHM:
        fail(f"digest_algorithm {_show(m.digest_algorithm)} is not supported (expected {DIGEST_ALGORITHM!r})")
    if not m.blocks:
        fail("no blocks")
    seen_paths: dict[str, str] = {}  # each entry's path: what it is, for a message
    seen_tensors: set[str] = set()
    next_layer = 0
    for i, b in enumerate(m.blocks):
        name = f"block {i}"
        if b.index != i:
            fail(f"{name} has index {b.index}; blocks must be numbered 0..{len(m.blocks) - 1} in order")
        _check_entry_path(f"{name} file {_show(b.file)}", b.file, seen_paths, fail)
        if b.layer_start != next_layer or b.layer_end <= b.layer_start:
            fail(f"{name} layer range [{b.layer_start}, {b.layer_end}) does not continue from layer "
                 f"{next_layer}")
        next_layer = b.layer_end
        if b.bytes == 0 or b.chunk_bytes == 0:
            fail(f"{name} has zero bytes or a zero chunk size")
        expected_chunks = -(-b.bytes // b.chunk_bytes)  # exact for any uint64 (a float division is not)
        if len(b.chunk_digests) != expected_chunks:
            fail(f"{name} has {len(b.chunk_digests)} chunk digests; {b.bytes} bytes in chunks of "
                 f"{b.chunk_bytes} need {expected_chunks}")
        for d in (b.digest, *b.chunk_digests):
            if not HEX_DIGEST.fullmatch(d):
                fail(f"{name} has a malformed digest {_show(d)}")
        if not b.tensor_names:
            fail(f"{name} holds no tensors")
        dup = seen_tensors.intersection(b.tensor_names)
        if dup or len(set(b.tensor_names)) != len(b.tensor_names):
            repeated = ", ".join(_show(t) for t in sorted(dup)[:10]) or "within the block"
            fail(f"{name} repeats tensor names {repeated}")
        seen_tensors.update(b.tensor_names)
    if next_layer != m.num_layers:
        fail(f"blocks cover layers [0, {next_layer}) but num_layers is {m.num_layers}")
    if m.total_bytes != sum(b.bytes for b in m.blocks):
        fail(f"total_bytes {m.total_bytes} is not the sum of the block sizes")
    for f in m.files:
        _check_entry_path(f"file {_show(f.path)}", f.path, seen_paths, fail)
        if not HEX_DIGEST.fullmatch(f.digest):
            fail(f"file {_show(f.path)} has a malformed digest {_show(f.digest)}")
    # A path under another entry's ('tokenizer.json/x' beside 'tokenizer.json') names a folder that is a file:
    # no folder can hold both, and a receiver writing one would overwrite or fail on the other. Walked as a tree
    # of path components, shallowest first: time linear in the paths' length (rebuilding each prefix took
    # minutes for a peer's 200 kB path of 100,000 components).
    tree: dict[str, dict] = {}
    for path in sorted(seen_paths, key=lambda p: p.count("/")):
        node = tree
        for part in path.split("/"):
            node = node.setdefault(part, {})
            if _ENTRY in node:
                fail(f"{seen_paths[path]} is inside {node[_ENTRY]}")
        node[_ENTRY] = seen_paths[path]
    if m.HasField("source") and not m.source.uri:
        fail("source has no uri")
    if m.package_id != compute_package_id(m):
        fail(f"package_id {_show(m.package_id)} is not the digest of the manifest (a field was changed after "
             "packing, or the manifest is not the one asked for)")
