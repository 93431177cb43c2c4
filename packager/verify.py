"""``pipecast verify``: re-hash every block, chunk and small file of a package against its manifest."""

from dataclasses import dataclass
from pathlib import Path

from packager.blockfile import map_file
from packager.digest import digest_bytes
from packager.manifest import read_manifest
from packager.package import check_block_bytes


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a package: which file, and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def verify_package(root: Path) -> list[Problem]:
    """Every problem of the package at ``root`` (empty: the package is intact).

    A manifest that cannot be read or is inconsistent raises ManifestError instead.
    """
    root = Path(root)
    manifest = read_manifest(root)
    problems = []
    for block in manifest.blocks:
        path = root / block.file
        try:
            size = path.stat().st_size
            # Mapped, not read: a block can be many GB, and page-cache pages cost no private memory.
            data = map_file(path) if size == block.bytes else None
        except OSError as exc:
            problems.append(Problem(block.file, f"block {block.index}: cannot read ({exc.strerror})"))
            continue
        if size != block.bytes:
            problems.append(Problem(block.file, f"block {block.index}: size is {size} bytes, the manifest "
                                                f"says {block.bytes}"))
            continue
        with data:
            problems += [Problem(block.file, f"block {block.index}: {m}")
                         for m in check_block_bytes(block, data)]
    for entry in manifest.files:
        try:
            data = (root / entry.path).read_bytes()
        except OSError as exc:
            problems.append(Problem(entry.path, f"cannot read ({exc.strerror})"))
            continue
        if len(data) != entry.bytes or digest_bytes(data) != entry.digest:
            problems.append(Problem(entry.path, "size or digest differs from the manifest"))
    return problems
