"""The disk cache tier: verified blocks persisted so that a restarted agent serves them at once.

Each package is a package folder ``<root>/<package_id>/`` in the packager's layout (``manifest.json``,
small files, ``blocks/``), so a cache folder can also be served with ``--seed``. Every file is written
to a temporary name and renamed into place, so a crash never leaves a half file under a real name.
There is no fsync and no trusted "verified" marker: on restart each cached block is re-hashed against
the manifest when the store opens it (BLAKE3 runs at several GB/s per core, far above disk and network
rates), and a torn or rotten file is dropped and fetched again.
"""

import logging
from pathlib import Path

from packager.errors import ManifestError
from packager.manifest import MANIFEST_FILE, manifest_to_json, read_manifest
from pipecast.agent.local_package import LocalPackageFolder
from pipecast.core.fsutil import atomic_write
from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)


class BlockCache:
    """A folder of cached packages, one package folder per package id."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def package_dir(self, package_id: str) -> Path:
        return self.root / package_id

    def local_package(self, package_id: str) -> LocalPackageFolder | None:
        """The cached folder of ``package_id`` if its manifest is there and valid, else None."""
        folder = self.package_dir(package_id)
        if not (folder / MANIFEST_FILE).exists():
            return None
        try:
            manifest = read_manifest(folder)  # validated: its digests hash to its package id
        except ManifestError as exc:
            log.warning("ignoring the cached manifest: %s", exc)
            return None
        if manifest.package_id != package_id:
            log.warning("%s holds the manifest of package %s; ignoring it", folder, manifest.package_id[:12])
            return None
        return LocalPackageFolder(folder, manifest)

    def write_manifest(self, manifest: Manifest) -> None:
        """Persist the manifest (once per package)."""
        path = self.package_dir(manifest.package_id) / MANIFEST_FILE
        if not path.exists():
            atomic_write(path, manifest_to_json(manifest).encode())

    def write_file(self, package_id: str, path: str, data: bytes) -> None:
        """Persist a verified small file."""
        atomic_write(self.package_dir(package_id) / path, data)

    def write_block(self, manifest: Manifest, block: int, data: memoryview) -> None:
        """Persist a verified block (the caller keeps ``data`` unchanged meanwhile)."""
        atomic_write(self.package_dir(manifest.package_id) / manifest.blocks[block].file, data)
        log.debug("cached block %d of %s", block, manifest.package_id[:12])
