"""A block package on disk, as the runtime uses it: validated manifest, layer ranges, zero-copy blocks."""

import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from packager.blockfile import buffer_header, map_file, tensors_from_buffer
from packager.digest import digest_bytes, whole_digest
from packager.errors import BlockMismatchError, PackageError, PackageFileError
from packager.manifest import read_manifest
from packager.safetensors_format import Header, open_regular_file
from pipecast.core.strictjson import JSONInputError, loads_object
from pipecast.v1.manifest_pb2 import Block, Manifest

if TYPE_CHECKING:
    import torch


CONFIG_FILE = "config.json"


@dataclass
class Package:
    """An opened package folder. Use :meth:`open`."""

    root: Path
    manifest: Manifest
    _maps: dict[int, mmap.mmap] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, root: Path | str, manifest: Manifest | None = None) -> "Package":
        """Open ``root`` and validate its manifest, unless ``manifest`` (validated already) is given; block
        contents are checked when opened."""
        root = Path(root)
        if not root.is_dir():
            raise PackageError(f"{root}: no such package folder")
        return cls(root=root, manifest=manifest if manifest is not None else read_manifest(root))

    @property
    def package_id(self) -> str:
        return self.manifest.package_id

    @property
    def num_blocks(self) -> int:
        return len(self.manifest.blocks)

    @property
    def config(self) -> dict:
        """The model's config.json, checked against the manifest (see :meth:`read_config`)."""
        return self.read_config()

    def read_config(self, *, verify: bool = True) -> dict:
        """The model's config.json; :class:`PackageFileError` if it cannot be read, is not a JSON object, or
        differs from its manifest entry (:meth:`small_file`: its size, and with ``verify`` its digest): an edited
        config.json (say its rope_theta) would load the right weights into the wrong model, wrong logits and no
        error."""
        path = self.root / CONFIG_FILE
        try:
            data = self.small_file(CONFIG_FILE, verify=verify)
        except OSError as exc:
            raise PackageFileError(path, f"cannot read it ({exc.strerror})") from None
        if data is None:
            raise PackageFileError(path, "the manifest lists no config.json")
        return parse_config(data, path)

    def block(self, index: int) -> Block:
        if not 0 <= index < self.num_blocks:
            raise IndexError(f"block {index} out of range: the package has {self.num_blocks} blocks")
        return self.manifest.blocks[index]

    def block_path(self, index: int) -> Path:
        return self.root / self.block(index).file

    def has_block(self, index: int) -> bool:
        """Whether block ``index``'s file is there with the manifest's size (its contents are not checked)."""
        try:
            return self.block_path(index).stat().st_size == self.block(index).bytes
        except OSError:
            return False

    def small_file(self, path: str, *, verify: bool = False) -> bytes | None:
        """The bytes of ``path``, a small file the manifest lists; None if the manifest lists no such file.

        Either way it must be a regular file of the manifest entry's size (:class:`PackageFileError`), of which
        no more is read: a FIFO would hang the read, /dev/zero behind a symlink would fill the memory. Without
        ``verify`` an OSError goes to the caller (``FileNotFoundError``: it is not there). With ``verify``, its
        digest is checked against the entry's too, and a file that cannot be read is a PackageFileError.
        """
        entry = next((f for f in self.manifest.files if f.path == path), None)
        if entry is None:
            return None
        file = self.root / path
        try:
            with open_regular_file(file, PackageFileError) as (f, size):
                if size != entry.bytes:
                    raise PackageFileError(file, f"disagrees with the manifest: size is {size} bytes, the manifest "
                                                 f"says {entry.bytes}")
                # one byte more than the manifest's size: a file that grew meanwhile is told apart, not read whole
                data = f.read(entry.bytes + 1)
        except OSError as exc:
            if not verify:
                raise
            raise PackageFileError(file, f"cannot read it ({exc.strerror})") from None
        if len(data) != entry.bytes:
            raise PackageFileError(file, "changed while it was read")
        if verify and digest_bytes(data) != entry.digest:
            raise PackageFileError(file, "disagrees with the manifest: digest mismatch")
        return data

    def layer_range(self, index: int) -> range:
        """Layers held by block ``index``."""
        b = self.block(index)
        return range(b.layer_start, b.layer_end)

    def block_of_layer(self, layer: int) -> int:
        """Index of the block holding ``layer``."""
        for b in self.manifest.blocks:
            if b.layer_start <= layer < b.layer_end:
                return b.index
        raise IndexError(f"layer {layer} out of range: the model has {self.manifest.num_layers} layers")

    def block_buffer(self, index: int, *, verify: bool = True) -> mmap.mmap:
        """The block file mapped copy-on-write, checked against the manifest (size, header, digest)."""
        if index in self._maps:
            return self._maps[index]
        b, path = self.block(index), self.block_path(index)
        try:
            size = path.stat().st_size
            if size != b.bytes:
                raise BlockMismatchError(path, f"size is {size} bytes, the manifest says {b.bytes}")
            buf = map_file(path)  # a folder of the right st_size fails here
        except OSError as exc:
            raise BlockMismatchError(path, f"cannot read ({exc.strerror})") from None
        if verify:
            bad = check_block_bytes(b, buf)
            if bad:
                buf.close()
                raise BlockMismatchError(path, bad[0])
        self._maps[index] = buf
        return buf

    def forget_block(self, index: int) -> None:
        """Drop this package's hold on block ``index``'s mapping (:meth:`block_buffer`): it goes with the last
        view of it (tensors made from it keep it)."""
        self._maps.pop(index, None)

    def block_tensors(self, index: int, *, verify: bool = True) -> dict[str, "torch.Tensor"]:
        """The block's tensors as zero-copy views of the mapped file."""
        return block_tensors_of(self.block(index), self.block_buffer(index, verify=verify), self.block_path(index))


def parse_config(data: bytes, where: Path | str) -> dict:
    """config.json's bytes as a dict; :class:`PackageFileError` naming ``where`` unless they are one JSON
    object (strict: no duplicate keys, no NaN)."""
    try:
        return loads_object(data)
    except JSONInputError as exc:
        raise PackageFileError(where, f"not a valid JSON object ({exc})") from None


def block_tensors_of(block: Block, buf: bytes | bytearray | memoryview | mmap.mmap,
                     where: Path | str) -> dict[str, "torch.Tensor"]:
    """The tensors of ``block`` held in ``buf`` (its bytes, verified by the caller) as zero-copy views, once
    its header is checked (:func:`block_header`)."""
    return tensors_from_buffer(buf, where, block_header(block, buf, where))


def block_header(block: Block, buf: bytes | bytearray | memoryview | mmap.mmap, where: Path | str) -> Header:
    """The safetensors header of ``block``'s bytes in ``buf``, once its tensor names are checked against the
    manifest's: :class:`BlockMismatchError` naming ``where`` otherwise (SafetensorsFormatError for a header that
    is not one)."""
    header = buffer_header(buf, where)
    expected = set(block.tensor_names)
    if set(header.tensors) != expected:
        raise BlockMismatchError(where, f"holds tensors {sorted(set(header.tensors) ^ expected)} "
                                        "that differ from the manifest")
    return header


def check_block_bytes(block: Block, data: bytes | bytearray | memoryview | mmap.mmap, *,
                      every_chunk: bool = False) -> list[str]:
    """Problems of a block's bytes against its manifest entry (empty if it matches exactly).

    A load checks the block digest alone, in one pass on every core (a GPU node reads blocks faster than one core
    hashes them), and the chunk digests only to name what is wrong in a bad block. ``every_chunk`` (``pipecast
    verify``) checks every chunk digest too: a manifest may hold a block digest that matches and a chunk digest
    that does not, which agents, verifying chunk by chunk, refuse.
    """
    view = memoryview(data)
    if len(view) != block.bytes:
        return [f"size is {len(view)} bytes, the manifest says {block.bytes}"]
    whole_matches = whole_digest(view) == block.digest
    if whole_matches and not every_chunk:
        return []
    size = block.chunk_bytes
    problems = [f"chunk {i} digest mismatch (bytes {i * size}-{min((i + 1) * size, block.bytes) - 1})"
                for i, want in enumerate(block.chunk_digests) if digest_bytes(view[i * size:(i + 1) * size]) != want]
    if not whole_matches:
        problems.append("block digest mismatch")
    return problems
