"""``pipecast pack``: turn a safetensors checkpoint folder into a block package, streaming and atomically.

Tensor bytes are copied from the input shards into the blocks through one small reusable buffer, so peak
memory does not grow with the model. The package is built in a hidden temporary folder beside the output
and renamed into place only when complete: a failed or interrupted pack leaves no package behind.
"""

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from packager.checkpoint import (CHANGED, Checkpoint, SourceTensor, file_identity, hub_repo_id, open_checkpoint,
                                 read_checkpoint_file)
from packager.chunks import ChunkHasher
from packager.digest import DIGEST_ALGORITHM, digest_bytes
from packager.errors import CheckpointError, CheckpointFileError, PackageError
from packager.layout import HEAD_NAMES, BlockLayout, plan_blocks, stream_order
from packager.manifest import (
    MANIFEST_FILE,
    MANIFEST_FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    manifest_to_json,
    read_manifest,
    seal_manifest,
    validate_manifest,
)
from packager.safetensors_format import build_header, torch_view_problem
from pipecast.core.fsutil import atomic_directory, restore_moved_aside
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.core.units import DEFAULT_CHUNK_BYTES
from pipecast.v1.manifest_pb2 import Block, Manifest, ModelSource, PackageFile

logger = logging.getLogger(__name__)

COPY_BUFFER_BYTES = 8 << 20
BLOCKS_DIR = "blocks"
MAX_CHUNK_BYTES = 2**64 - 1  # Block.chunk_bytes is a uint64
_PLACEHOLDER = "0" * 64  # as long as a digest: it measures the manifest before any digest is known


def pack(src: Path, out: Path, *, layers_per_block: int | None = None, block_bytes: int | None = None,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES, model_name: str | None = None, overwrite: bool = False,
         progress: Progress = NO_PROGRESS, source: ModelSource | None = None) -> Manifest:
    """Pack the checkpoint folder ``src`` into the package folder ``out``; return its manifest.

    ``progress`` gets a bar over the tensor bytes copied and a status line per block written. ``source``
    (recorded in the manifest) says where ``src`` was fetched from, when it was (:mod:`packager.mlflow_source`).
    """
    src, out = Path(src), Path(out)
    check_pack_arguments(out, chunk_bytes=chunk_bytes, overwrite=overwrite)
    ckpt = open_checkpoint(src)
    check_output_spares_source(out, ckpt.root, ckpt.files, "the checkpoint being packed")
    _check_loadable(ckpt)
    layouts = plan_blocks({n: t.info.nbytes for n, t in ckpt.tensors.items()},
                          num_layers=_config_layers(ckpt.config), layers_per_block=layers_per_block,
                          block_bytes=block_bytes, where=str(src))
    # before any block is written: an unreadable small file, or a manifest too large, fails at once
    small = {name: read_checkpoint_file(ckpt.root, name) for name in ckpt.small_files}
    files = [PackageFile(path=name, bytes=len(data), digest=digest_bytes(data)) for name, data in small.items()]

    def manifest_of(blocks: list[Block]) -> Manifest:
        return _build_manifest(ckpt, src, model_name, blocks, files, source)

    _check_manifest_size(src, ckpt, layouts, chunk_bytes, manifest_of)
    try:
        manifest = _build_package(src, out, ckpt, layouts, small, chunk_bytes, manifest_of, overwrite, progress)
    except OSError as exc:  # reading the checkpoint raises typed errors: this is the output (full, read-only)
        raise PackageError(f"{out}: cannot write the package ({exc})") from None
    logger.info("packed %s into %s: %d blocks, %d bytes, package %s", src, out, len(manifest.blocks),
                manifest.total_bytes, manifest.package_id)
    return manifest


def check_pack_arguments(out: Path, *, chunk_bytes: int, overwrite: bool) -> None:
    """Refuse, before any work, a chunk size the manifest cannot record and an ``out`` that cannot be written
    (its parent is not a folder) or that may not be replaced (:func:`check_replaceable`). The CLI calls it
    before it downloads an MLflow source too."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise PackageError(f"chunk size must be between 1 and {MAX_CHUNK_BYTES} bytes (a uint64 in the "
                           f"manifest), got {chunk_bytes}")
    check_replaceable(out, overwrite=overwrite, why_not=_why_not_a_package, what="a package")
    check_output_parent(out)


def _why_not_a_package(folder: Path) -> str | None:
    try:
        read_manifest(folder)
    except PackageError:
        return f"without a valid {MANIFEST_FILE}"
    return None


def check_output_parent(out: Path) -> None:
    """Refuse an ``out`` under something that is not a folder: atomic_directory creates the missing parents, so
    the nearest one that is there must be a folder (else a raw FileExistsError or NotADirectoryError)."""
    for parent in (out.parent, *out.parent.parents):
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise PackageError(f"{out}: cannot be created: {parent} is not a folder")
            break


def check_replaceable(out: Path, *, overwrite: bool, why_not: Callable[[Path], str | None], what: str) -> None:
    """Refuse an ``out`` that is the current folder or one holding it (``.``, ``..``, their paths), whose path
    ends in ``..`` or that is a mount point: it cannot be renamed into place (EBUSY, once all the work is done).
    Refuse an existing ``out`` without ``overwrite`` (``--force``), and with it a non-empty folder that is not
    ``what`` the command writes (``why_not`` says why, or None when it is one): ``--force`` deletes the ``out``
    it replaces, which must not be a folder of something else (other models, a project holding a config.json)."""
    if out.name == ".." or _holds_current_folder(out):
        raise PackageError(f"{out}: refused as the output: the current folder, a folder holding it and a path "
                           "ending in '..' cannot be replaced; name the output by a path of its own (such as ../NAME)")
    if os.path.ismount(out):
        raise PackageError(f"{out}: refused as the output: a mount point cannot be replaced; name a folder inside "
                           f"it (such as {out / 'NAME'})")
    restore_moved_aside(out)  # a run killed while replacing it: ``out`` is that folder again, refused below
    # lexists: a dangling symlink is there too, and atomic_directory would find it only at the end
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise PackageError(f"{out}: already exists (pass --force to replace it)")
    if out.is_symlink() or not out.is_dir():  # a file, or a symlink: replaced itself, nothing it leads to
        return
    try:
        with os.scandir(out) as entries:
            empty = next(entries, None) is None
    except OSError as exc:
        raise PackageError(f"{out}: cannot read it ({exc.strerror})") from None
    reason = None if empty else why_not(out)
    if reason is not None:
        raise PackageError(f"{out}: refused as the output: a non-empty folder {reason} is not {what}, "
                           "and --force would delete it with all it holds")


def check_output_spares_source(out: Path, root: Path, files: Iterable[Path], what: str) -> None:
    """Refuse an ``out`` whose replacement (``--force``) would delete the source ``root`` (a checkpoint folder,
    a GGUF file) or one of its ``files`` (``what`` names the source in the message): ``out`` is the source,
    holds it, is one of its files, or holds a file a symlink of it leads to (a Hugging Face snapshot's blobs).
    A new ``out`` inside a source folder is let be: a checkpoint is its top-level files, found before ``out``
    is created, so a package in a subfolder (or a repack of it) harms nothing."""
    if not os.path.lexists(out):
        return
    replaced = _replaced(out)
    try:
        kept = {root.resolve()}
        for path in files:
            kept |= {path.parent.resolve() / path.name, path.resolve()}
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise PackageError(f"{out}: cannot resolve it ({exc})") from None
    for path in sorted(kept):
        if any(path.is_relative_to(r) for r in replaced):
            raise PackageError(f"{out}: refused as the output: replacing it would delete {what} ({path})")


def _replaced(out: Path) -> tuple[Path, Path]:
    """The paths replacing ``out`` takes away: ``out`` itself, which atomic_directory moves aside (a symlink too),
    and where it leads, which is refused as well: whoever passed a symlink meant its target."""
    try:
        return out.parent.resolve() / out.name, out.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise PackageError(f"{out}: cannot resolve it ({exc})") from None


def _holds_current_folder(out: Path) -> bool:
    """Whether replacing ``out`` would take away the current folder (``out`` is it or holds it)."""
    try:
        cwd = Path.cwd()
    except FileNotFoundError:  # the current folder was removed: there is none to take away
        return False
    return any(cwd.is_relative_to(path) for path in _replaced(out))


def _check_loadable(ckpt: Checkpoint) -> None:
    """Refuse, before any block is written, a tensor whose dtype no reader can load (torch cannot view it): the
    package would pack and verify, then fail on every node that loads it."""
    for name, tensor in ckpt.tensors.items():
        problem = torch_view_problem(name, tensor.info.dtype)
        if problem:
            raise CheckpointError(f"{tensor.path}: {problem}, so pipecast cannot load it")


def _check_manifest_size(src: Path, ckpt: Checkpoint, layouts: list[BlockLayout], chunk_bytes: int,
                         manifest_of: Callable[[list[Block]], Manifest]) -> None:
    """Refuse, before any block is written, a package whose manifest would be larger than a manifest may be.

    Its length is known exactly in advance: every digest in it is as long as a placeholder one, and each chunk
    digest adds the same length (measured as one and two digests a block), so the chunk counts give it."""
    sizes = [len(header) + sum(t.info.nbytes for t in ordered)
             for header, ordered in (_block_contents(layout, ckpt) for layout in layouts)]

    def length(digests: int) -> int:
        blocks = [Block(index=layout.index, file=_block_file(layout), bytes=size, layer_start=layout.layer_start,
                        layer_end=layout.layer_end, tensor_names=list(layout.tensor_names), digest=_PLACEHOLDER,
                        chunk_bytes=chunk_bytes, chunk_digests=[_PLACEHOLDER] * digests)
                  for layout, size in zip(layouts, sizes)]
        return len(manifest_to_json(manifest_of(blocks)))

    one = length(1)
    per_digest = (length(2) - one) // len(layouts)
    total = one + per_digest * sum(-(-size // chunk_bytes) - 1 for size in sizes)
    if total > MAX_MANIFEST_BYTES:
        raise PackageError(f"{src}: the manifest would be {total} bytes, more than a manifest may have "
                           f"({MAX_MANIFEST_BYTES} bytes); pack with larger chunks (--chunk-bytes)")


def _build_package(src: Path, out: Path, ckpt: Checkpoint, layouts: list[BlockLayout], small: dict[str, bytes],
                   chunk_bytes: int, manifest_of: Callable[[list[Block]], Manifest], overwrite: bool,
                   progress: Progress) -> Manifest:
    with atomic_directory(out, overwrite=overwrite, durable=True) as tmp:
        (tmp / BLOCKS_DIR).mkdir()
        blocks = []
        progress.start(sum(t.info.nbytes for t in ckpt.tensors.values()), f"pack {src.name}", byte_units=True)
        with _ShardReader() as reader:
            for layout in layouts:
                blocks.append(_write_block(tmp, layout, ckpt, reader, chunk_bytes, progress))
                progress.status(f"block {layout.index + 1}/{len(layouts)}: layers {layout.layer_start}-"
                                f"{layout.layer_end - 1}, {blocks[-1].bytes} bytes")
            reader.check_unchanged()  # a shard rewritten in place meanwhile: what was copied may be half of each
        for name, data in small.items():
            (tmp / name).write_bytes(data)
        manifest = manifest_of(blocks)
        validate_manifest(manifest, tmp / MANIFEST_FILE)
        (tmp / MANIFEST_FILE).write_text(manifest_to_json(manifest))
    return manifest


def _config_layers(config: dict) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(key), int) and not isinstance(config[key], bool):  # true is no count of layers
            return config[key]
    return None


class _ShardReader:
    """Reads byte ranges of input shards into one reusable buffer, keeping each shard open once."""

    def __init__(self):
        self._files: dict[Path, object] = {}
        self._identities: dict[Path, tuple[int, ...]] = {}
        self._buf = bytearray(COPY_BUFFER_BYTES)

    def __enter__(self) -> "_ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        for f in self._files.values():
            f.close()

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointFileError` if a shard read from was rewritten since its header was read."""
        for path, f in self._files.items():
            self._check(path, f)

    def _check(self, path: Path, f) -> None:
        if self._identities[path] and file_identity(os.fstat(f.fileno())) != self._identities[path]:
            raise CheckpointFileError(path, CHANGED)

    def pieces(self, tensor: SourceTensor):
        """Yield memoryviews covering the tensor's bytes, in order (valid until the next piece)."""
        f = self._files.get(tensor.path)
        try:
            if f is None:
                f = self._files[tensor.path] = tensor.path.open("rb")
                self._identities[tensor.path] = tensor.identity
                self._check(tensor.path, f)  # replaced since its header was read: its offsets are another file's
            f.seek(tensor.file_offset)
        except OSError as exc:  # typed here so that pack() can take any other OSError for the output's
            raise CheckpointFileError(tensor.path, f"cannot read it ({exc.strerror})") from None
        left = tensor.info.nbytes
        view = memoryview(self._buf)
        while left:
            try:
                n = f.readinto(view[:min(left, len(view))])
            except OSError as exc:
                raise CheckpointFileError(tensor.path, f"cannot read it ({exc.strerror})") from None
            if not n:
                raise PackageError(f"{tensor.path}: ended while reading tensor {tensor.info.name!r} "
                                   "(was the file changed during packing?)")
            left -= n
            yield view[:n]


def _block_file(layout: BlockLayout) -> str:
    return f"{BLOCKS_DIR}/block-{layout.index:04d}.safetensors"


def _block_contents(layout: BlockLayout, ckpt: Checkpoint) -> tuple[bytes, list[SourceTensor]]:
    """The safetensors header of a block and its tensors, in the order they are written after it."""
    infos = [ckpt.tensors[n].info for n in layout.tensor_names]
    ordered = [ckpt.tensors[n] for n in stream_order([(i.name, i.dtype, i.nbytes) for i in infos])]
    metadata = {"format": "pt", "pipecast.block": str(layout.index),
                "pipecast.layers": f"{layout.layer_start}-{layout.layer_end - 1}"}
    header, _ = build_header([(t.info.name, t.info.dtype, t.info.shape, t.info.nbytes) for t in ordered],
                             metadata)
    return header, ordered


def _write_block(root: Path, layout: BlockLayout, ckpt: Checkpoint, reader: _ShardReader,
                 chunk_bytes: int, progress: Progress) -> Block:
    header, ordered = _block_contents(layout, ckpt)
    rel = _block_file(layout)
    hasher = ChunkHasher(chunk_bytes)
    with (root / rel).open("wb") as f:
        hasher.update(header)
        f.write(header)
        for tensor in ordered:
            for piece in reader.pieces(tensor):
                hasher.update(piece)
                f.write(piece)
                progress.advance(len(piece))
    digest = hasher.finish()
    return Block(index=layout.index, file=rel, bytes=hasher.total, layer_start=layout.layer_start,
                 layer_end=layout.layer_end, tensor_names=list(layout.tensor_names), digest=digest,
                 chunk_bytes=chunk_bytes, chunk_digests=hasher.chunk_digests)


def _as_utf8(name: str) -> str:
    """``name`` as a manifest's UTF-8 can hold it: the bytes of a folder name or argument that were not UTF-8 (held
    as surrogates) become U+FFFD."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate no undecodable byte makes
        return name.encode("utf-8", "backslashreplace").decode()


def _build_manifest(ckpt: Checkpoint, src: Path, model_name: str | None, blocks: list[Block],
                    files: list[PackageFile], source: ModelSource | None) -> Manifest:
    config = ckpt.config
    archs = config.get("architectures") or [""]
    # a cache snapshot's folder is named by its revision hash: the repository names the model
    named = config.get("_name_or_path")
    name = model_name or (named if isinstance(named, str) else "") or hub_repo_id(src) or src.resolve().name
    # The id is sealed last: it is the digest of every other field (packager.manifest).
    return seal_manifest(Manifest(
        format_version=MANIFEST_FORMAT_VERSION,
        model_name=_as_utf8(name), architecture=str(archs[0]), model_type=str(config.get("model_type", "")),
        dtypes=sorted({t.info.dtype for t in ckpt.tensors.values()}),
        num_layers=blocks[-1].layer_end,
        tied_embeddings=not any(HEAD_NAMES.match(n) for n in ckpt.tensors),
        digest_algorithm=DIGEST_ALGORITHM, total_bytes=sum(b.bytes for b in blocks),
        blocks=blocks, files=files, source=source,  # None: unset, so out of the canonical JSON and the id
    ))
