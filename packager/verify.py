"""``pipecast verify``: re-hash every block, chunk and small file of a package against its manifest."""

from dataclasses import dataclass
from pathlib import Path

from packager.blockfile import map_file
from packager.errors import BlockMismatchError, PackageFileError, SafetensorsFormatError
from packager.manifest import read_manifest
from packager.package import Package, block_header, check_block_bytes
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.v1.manifest_pb2 import Block


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
    package = Package(root, manifest)
    progress.start(manifest.total_bytes + sum(f.bytes for f in manifest.files), f"verify {root.name}",
                   byte_units=True)
    problems = []
    for block in manifest.blocks:
        problems += _block_problems(root, block)
        progress.advance(block.bytes)
    for entry in manifest.files:
        try:
            package.small_file(entry.path, verify=True)
        except PackageFileError as exc:
            problems.append(Problem(entry.path, exc.problem))
        progress.advance(entry.bytes)
    return problems


def _block_problems(root: Path, block: Block) -> list[Problem]:
    """What an agent or a load would refuse in ``block``: its size, every chunk digest and the block's, and, once
    its bytes are the manifest's, its header and tensor names."""
    path = root / block.file
    try:
        size = path.stat().st_size
        # Mapped, not read: a block can be many GB, and page-cache pages cost no private memory.
        data = map_file(path) if size == block.bytes else None
    except OSError as exc:
        return [Problem(block.file, f"block {block.index}: cannot read ({exc.strerror})")]
    if size != block.bytes:
        return [Problem(block.file, f"block {block.index}: size is {size} bytes, the manifest says {block.bytes}")]
    where = f"block {block.index}"
    with data:
        problems = [f"{where}: {m}" for m in check_block_bytes(block, data, every_chunk=True)]
        if not problems:  # the bytes are the manifest's; a corrupt block's header would only repeat that
            try:
                block_header(block, data, where)
            except (BlockMismatchError, SafetensorsFormatError) as exc:
                problems.append(str(exc))
    return [Problem(block.file, problem) for problem in problems]
