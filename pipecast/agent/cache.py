"""The disk cache tier: verified blocks persisted so that a restarted agent serves them at once.

Each package is a package folder ``<root>/<package_id>/`` in the packager's layout (``manifest.json``,
small files, ``blocks/``), so a cache folder can also be served with ``--seed``. Every file is written
to a temporary name and renamed into place, so a crash never leaves a half file under a real name.
Blocks and small files are not fsynced and have no trusted "verified" marker: on restart each is
re-hashed against the manifest when the store opens it (BLAKE3 runs at several GB/s per core, far above
disk and network rates), and a torn or rotten one is dropped and fetched again. The manifest, which every
other file is checked against, is fsynced before its rename; one that is torn all the same, invalid or
another package's is ignored on restart and written again.

The cache is an optimisation, never a reason to stop: a write that fails (disk full, I/O error, a
read-only mount) is logged and counted in :attr:`BlockCache.write_errors`, the block stays served from
memory, and the agent goes on. Temporary files left by a crash mid-write are removed when the cache opens.

Bounded by ``max_bytes`` (``agent_cache_max_bytes``; 0: no bound): to make room for a write, the packages used
least recently (a package folder's time is its last write or open) that the agent does not hold in memory now
(nor is opening a store of) are removed whole (and the agent told, which tells its control plane); a write that
still does not fit is skipped (counted in :attr:`BlockCache.skipped_writes`). A block is written only into a
folder that holds its package's manifest (one that is not there is skipped and counted too, and logged once per
package).

One agent per cache folder: the cache holds an exclusive ``flock`` on ``<root>/.lock`` while open, and a second
one on the folder is refused (:class:`CacheInUseError`): each would remove the other's packages for room, and the
other's writes would then be skipped.
"""

import fcntl
import logging
import os
import shutil
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import IO

from packager.errors import PackageError
from packager.manifest import HEX_DIGEST, MANIFEST_FILE, manifest_to_json, read_manifest
from pipecast.agent.errors import CacheInUseError
from pipecast.agent.local_package import LocalPackageFolder
from pipecast.core.fsutil import (commit_temporary, fsync_path, is_temporary, sweep_stale_temporaries,
                                  write_temporary)
from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class BlockCache:
    """A folder of cached packages, one package folder per package id. Every method is safe to call
    whatever the disk does: reads that fail find nothing, writes that fail return False. Opening it takes the
    folder's lock (:class:`CacheInUseError` if another cache holds it), :meth:`close` gives it back."""

    def __init__(self, root: Path, max_bytes: int = 0,
                 in_use: Callable[[], Collection[str]] = frozenset,
                 on_removed: Callable[[str], None] = lambda package_id: None) -> None:
        """``max_bytes``: the most the cache holds (0: no bound); ``in_use``: the package ids the agent holds in
        memory now or is opening stores of, never removed to make room; ``on_removed``: told each package id
        removed to make room (on the thread that writes)."""
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._in_use = in_use
        self._on_removed = on_removed
        #: Writes that failed since the cache opened (each is logged; the data stayed in memory).
        self.write_errors = 0
        #: Writes skipped for want of room under ``max_bytes``, or of their package's manifest (the data stayed in
        #: memory).
        self.skipped_writes = 0
        self._lock = threading.Lock()  # writes run on worker threads
        self._without_manifest: set[str] = set()  # packages whose skipped block writes were logged
        self._lock_file = self._take_lock()
        # Bytes of writes let in under max_bytes but not yet on disk: writes running at once all count.
        self._pending_bytes = 0
        removed = sum(sweep_stale_temporaries(self.package_dir(p)) for p in self.packages())
        if removed:
            log.info("disk cache %s: removed %d temporary file(s) left by an interrupted write", self.root,
                     removed)

    def _take_lock(self) -> IO | None:
        """The open ``.lock`` of the folder, locked; None where it cannot be locked (a cache that cannot be written
        still serves what it holds: the cache is never a reason to stop)."""
        path = self.root / LOCK_FILE
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            held = open(path, "a")  # empty: it counts toward no bound
        except OSError as exc:
            try:
                held = open(path)  # a read-only folder: its lock is taken all the same where the file is there
            except OSError:
                log.warning("disk cache %s: cannot lock it (%s): a second agent on it would not be refused",
                            self.root, exc.strerror or exc)
                return None
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.close()
            raise CacheInUseError(
                f"the disk cache {self.root} is held by another agent (its lock {path} is taken): two agents on one "
                "cache folder remove each other's packages; give each agent a --cache-dir of its own") from None
        except OSError as exc:  # a file system without locks
            held.close()
            log.warning("disk cache %s: cannot lock it (%s): a second agent on it would not be refused", self.root,
                        exc.strerror or exc)
            return None
        return held

    def close(self) -> None:
        """Give the folder's lock back (idempotent): another agent may open the cache then."""
        if self._lock_file is not None:
            self._lock_file.close()  # closing the last descriptor of the open file releases its flock
            self._lock_file = None

    def package_dir(self, package_id: str) -> Path:
        return self.root / package_id

    def holds(self, package_id: str) -> bool:
        """Whether ``package_id``'s folder is here with its manifest (a look: nothing is read or checked)."""
        return (self.package_dir(package_id) / MANIFEST_FILE).exists()

    def local_package(self, package_id: str, *, use: bool = False) -> LocalPackageFolder | None:
        """The cached folder of ``package_id`` if its manifest is there and valid, else None; ``use``: a store
        opens from it, which makes it the last to be removed for room (a look, as at a registration, does not)."""
        folder = self.package_dir(package_id)
        try:
            if not (folder / MANIFEST_FILE).exists():
                return None
            manifest = read_manifest(folder)  # validated: its digest is its package id
            if manifest.package_id != package_id:
                log.warning("%s holds the manifest of package %s; ignoring it", folder,
                            manifest.package_id[:12])
                return None
            if use:
                _touch(folder)
            return LocalPackageFolder(folder, manifest)
        except (PackageError, OSError) as exc:
            log.warning("disk cache: ignoring %s: %s", folder, exc)
            return None

    def cached_blocks(self, package_id: str) -> list[int]:
        """The blocks of ``package_id`` whose files are in the cache (not re-hashed: a hint for placement;
        a store that opens them verifies each)."""
        cached = self.local_package(package_id)
        if cached is None:
            return []
        return [i for i in range(len(cached.manifest.blocks)) if cached.has_block(i)]

    def packages(self) -> list[str]:
        """The package ids with a folder in the cache (unreadable cache: none). Only folders named as package
        ids: the cache root may be a volume's (``lost+found``) or shared, and what else is there is not ours to
        remove for room."""
        try:
            return sorted(p.name for p in self.root.iterdir() if HEX_DIGEST.fullmatch(p.name) and p.is_dir())
        except OSError:
            return []

    def write_manifest(self, manifest: Manifest) -> bool:
        """Persist the manifest, durably, unless the cache holds it already (a valid manifest of this package:
        its digest is the package id); False if it could not be written."""
        self._without_manifest.discard(manifest.package_id)  # gone again later: said again
        # Not merely "manifest.json exists": a torn, invalid or foreign one would keep the folder useless for good.
        if self.local_package(manifest.package_id) is not None:
            return True
        return self._write(self.package_dir(manifest.package_id) / MANIFEST_FILE, manifest_to_json(manifest).encode(),
                           f"the manifest of {manifest.package_id[:12]}", durable=True)

    def write_file(self, package_id: str, path: str, data: bytes) -> bool:
        """Persist a verified small file; False if it could not be written."""
        return self._write(self.package_dir(package_id) / path, data, f"file {path} of {package_id[:12]}")

    def write_block(self, manifest: Manifest, block: int, data: memoryview) -> bool:
        """Persist a verified block (the caller keeps ``data`` unchanged meanwhile); False if it could not
        be written, or its package's manifest is not in the cache (the block would be of no use there)."""
        what = f"block {block} of {manifest.package_id[:12]}"
        if not (self.package_dir(manifest.package_id) / MANIFEST_FILE).is_file():
            return self._skip_without_manifest(manifest.package_id, what)
        if self._write(self.package_dir(manifest.package_id) / manifest.blocks[block].file, data, what):
            log.debug("cached %s", what)
            return True
        return False

    def _skip_without_manifest(self, package_id: str, what: str) -> bool:
        """Count a block write skipped for want of its package's manifest, and say so once per package."""
        with self._lock:
            self.skipped_writes += 1
            count = self.skipped_writes
            first = package_id not in self._without_manifest
            self._without_manifest.add(package_id)
        if first:
            log.warning("disk cache %s: no manifest of package %s here (its write failed, or its folder was removed): "
                        "%s and its later blocks stay in memory only (%d write(s) skipped so far)", self.root,
                        package_id[:12], what, count)
        return False

    def _write(self, path: Path, data: bytes | memoryview, what: str, durable: bool = False) -> bool:
        """Write ``data`` to ``path`` within the cache's bound (every file counts, the manifest too)."""
        package_id = path.relative_to(self.root).parts[0]
        if not self._make_room(package_id, path, len(data), what):
            return False
        pending = len(data) if self.max_bytes else 0
        try:
            tmp = write_temporary(path, data, durable=durable)  # outside the lock: writes run at once
            with self._lock:
                # The rename and the end of the pending count in one step: between them a _make_room counted the
                # bytes twice (on disk and pending) and removed a package, or skipped a write, for room it had.
                self._pending_bytes -= pending
                pending = 0
                commit_temporary(tmp, path)
            if durable:
                fsync_path(path.parent)  # the rename itself, outside the lock
            os.utime(self.package_dir(package_id))  # used now: the last to be removed for room
        except OSError as exc:
            return self._failed(what, exc)
        finally:
            if pending:  # the temporary file was never written
                with self._lock:
                    self._pending_bytes -= pending
        return True

    def _make_room(self, package_id: str, path: Path, nbytes: int, what: str) -> bool:
        """Whether ``nbytes`` written to ``path`` (replacing what is there) fit under ``max_bytes`` beside the
        writes pending, once the least recently used packages not held in memory (nor ``package_id``) are
        removed as needed (module docstring). If they fit they count as pending until the caller's write ends."""
        if not self.max_bytes:
            return True
        removed: list[str] = []
        with self._lock:
            fits = self._remove_for(package_id, path, nbytes, what, removed)
            if fits:
                self._pending_bytes += nbytes
            else:
                self.skipped_writes += 1
            count = self.skipped_writes
        for pid in removed:  # outside the lock: the callback may take its time
            self._on_removed(pid)
        if not fits:
            log.warning("disk cache %s: no room for %s under its %d bytes (agent_cache_max_bytes) beside the "
                        "packages held in memory; it stays in memory only (%d write(s) skipped so far)", self.root,
                        what, self.max_bytes, count)
        return fits

    def _remove_for(self, package_id: str, path: Path, nbytes: int, what: str, removed: list[str]) -> bool:
        """Remove packages (into ``removed``) until ``nbytes`` fit, if removing them can make them fit (under the
        lock)."""
        sizes = {pid: _folder_bytes(self.package_dir(pid)) for pid in self.packages()}
        over = sum(sizes.values()) + self._pending_bytes + nbytes - _file_bytes(path) - self.max_bytes
        kept = {package_id, *self._in_use()}
        removable = sorted((p for p in sizes if p not in kept), key=lambda p: _mtime(self.package_dir(p)))
        if over > sum(sizes[p] for p in removable):
            return over <= 0  # removing every one would still leave no room: the write is skipped, they stay
        for pid in removable:
            if over <= 0:
                break
            log.info("disk cache %s: removing package %s (%d bytes, the least recently used) to make room for %s",
                     self.root, pid[:12], sizes[pid], what)
            shutil.rmtree(self.package_dir(pid), ignore_errors=True)
            removed.append(pid)
            over -= sizes[pid]
        return over <= 0

    def _failed(self, what: str, exc: OSError) -> bool:
        with self._lock:
            self.write_errors += 1
            count = self.write_errors
        log.warning("disk cache: could not write %s (%s); it stays in memory only (%d failed write(s) so far)",
                    what, exc.strerror or exc, count)
        return False


def _touch(folder: Path) -> None:
    """Mark ``folder`` used now, where the cache can (on a read-only one its packages are used all the same)."""
    try:
        os.utime(folder)
    except OSError as exc:
        log.debug("disk cache: cannot mark %s used (%s)", folder, exc.strerror or exc)


def _file_bytes(path: Path) -> int:
    """The size of the file at ``path`` (0: none there)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _folder_bytes(folder: Path) -> int:
    """The bytes of the files in ``folder`` but writes' temporary files: a write under way is counted as pending
    until it ends (counted twice, it got a write beside it near the bound refused); a crashed one's temporary
    files are swept when the cache opens."""
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            if is_temporary(name):
                continue
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


def _mtime(folder: Path) -> float:
    try:
        return folder.stat().st_mtime
    except OSError:
        return 0.0
