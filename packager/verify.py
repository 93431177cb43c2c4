"""``pipecast verify``: re-hash every block, chunk and small file of a package against its manifest."""

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from packager.blockfile import map_file
from packager.digest import digest_bytes
from packager.manifest import read_manifest
from packager.package import check_block_bytes
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.v1.manifest_pb2 import Block, PackageFile


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a package: which file, and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def verify_package(root: Path, progress: Progress = NO_PROGRESS) -> list[Problem]:
    """Every problem of the package at ``root`` (empty: the package is intact).

    A manifest that cannot be read or is inconsistent raises ManifestError instead. ``progress`` gets a
    bar over the bytes checked.
    """
    root = Path(root)
    manifest = read_manifest(root)
    progress.start(manifest.total_bytes + sum(f.bytes for f in manifest.files), f"verify {root.name}",
                   byte_units=True)
    problems = []
    for block in manifest.blocks:
        problems += _block_problems(root, block)
        progress.advance(block.bytes)
    for entry in manifest.files:
        problems += _file_problems(root, entry)
        progress.advance(entry.bytes)
    return problems


def _block_problems(root: Path, block: Block) -> list[Problem]:
    path = root / block.file
    try:
        size = path.stat().st_size
        # Mapped, not read: a block can be many GB, and page-cache pages cost no private memory.
        data = map_file(path) if size == block.bytes else None
    except OSError as exc:
        return [Problem(block.file, f"block {block.index}: cannot read ({exc.strerror})")]
    if size != block.bytes:
        return [Problem(block.file, f"block {block.index}: size is {size} bytes, the manifest says {block.bytes}")]
    with data:
        return [Problem(block.file, f"block {block.index}: {m}") for m in check_block_bytes(block, data)]


def _file_problems(root: Path, entry: PackageFile) -> list[Problem]:
    try:
        # O_NONBLOCK: a FIFO under the name does not hang the open; its kind and size are checked before any read,
        # so a special file (a FIFO, /dev/zero behind a symlink) is never read at all
        fd = os.open(root / entry.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return [Problem(entry.path, f"cannot read ({exc.strerror})")]
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return [Problem(entry.path, "not a regular file")]
        if st.st_size != entry.bytes:
            return [Problem(entry.path, f"size is {st.st_size} bytes, the manifest says {entry.bytes}")]
        try:
            data = f.read(entry.bytes + 1)
        except OSError as exc:
            return [Problem(entry.path, f"cannot read ({exc.strerror})")]
    if len(data) != entry.bytes or digest_bytes(data) != entry.digest:
        return [Problem(entry.path, "size or digest differs from the manifest")]
    return []
