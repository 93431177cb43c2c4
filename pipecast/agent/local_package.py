"""A node's local package bytes, there without the network: a package folder (a seed, or the agent's disk
cache).

A :class:`LocalPackage` only finds and maps bytes; the block store verifies them. An object-store
implementation of the same three methods can come later.
"""

from abc import ABC, abstractmethod
from pathlib import Path

from packager.package import Package
from pipecast.agent.buffers import BlockBuffer, FileBuffer
from pipecast.v1.manifest_pb2 import Manifest


class LocalPackage(ABC):
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


class LocalPackageFolder(LocalPackage):
    """A package folder as the packager writes it (``manifest.json``, small files, ``blocks/``)."""

    def __init__(self, root: Path, manifest: Manifest | None = None) -> None:
        """Open ``root``; its manifest is read and validated unless ``manifest`` (already verified) is given."""
        self.package = Package.open(root, manifest)
        self.root = self.package.root
        self.description = f"package folder {self.root}"
        self.manifest = self.package.manifest

    def has_block(self, index: int) -> bool:
        return self.package.has_block(index)

    def open_block(self, index: int) -> BlockBuffer:
        return FileBuffer(self.package.block_path(index), self.package.block(index).bytes)

    def read_file(self, path: str) -> bytes | None:
        try:
            return self.package.small_file(path)
        except FileNotFoundError:  # a cache folder holds the files fetched so far
            return None
