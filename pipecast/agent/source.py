"""Where a node's local package bytes come from: a package folder (a seed, or the agent's disk cache).

A :class:`PackageSource` only finds and maps bytes; the block store verifies them. An object-store
source can implement the same three methods later.
"""

from abc import ABC, abstractmethod
from pathlib import Path

from packager.manifest import read_manifest
from pipecast.agent.buffers import BlockBuffer, FileBuffer
from pipecast.v1.manifest_pb2 import Manifest


class PackageSource(ABC):
    """Blocks and small files of one package, available without the network."""

    description: str
    manifest: Manifest

    @abstractmethod
    def has_block(self, index: int) -> bool:
        """Whether block ``index`` is there with the manifest's size (its digest is checked by the store)."""

    @abstractmethod
    def open_block(self, index: int) -> BlockBuffer:
        """Map block ``index`` read-only, without copying it."""

    @abstractmethod
    def read_file(self, path: str) -> bytes | None:
        """A small package file listed in the manifest, or None when it is not there."""


class PackageFolderSource(PackageSource):
    """A package folder as the packager writes it (``manifest.json``, small files, ``blocks/``)."""

    def __init__(self, root: Path, manifest: Manifest | None = None) -> None:
        """Open ``root``; its manifest is read and validated unless ``manifest`` (already verified) is given."""
        self.root = Path(root)
        self.description = f"package folder {self.root}"
        self.manifest = manifest if manifest is not None else read_manifest(self.root)

    def _block_path(self, index: int) -> Path:
        return self.root / self.manifest.blocks[index].file

    def has_block(self, index: int) -> bool:
        try:
            return self._block_path(index).stat().st_size == self.manifest.blocks[index].bytes
        except OSError:
            return False

    def open_block(self, index: int) -> BlockBuffer:
        return FileBuffer(self._block_path(index), self.manifest.blocks[index].bytes)

    def read_file(self, path: str) -> bytes | None:
        try:
            return (self.root / path).read_bytes()
        except FileNotFoundError:
            return None
