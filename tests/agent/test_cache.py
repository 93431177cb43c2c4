"""The disk cache degrades instead of failing (issue #12, finding 7): a full or broken disk is logged and
counted and the agent goes on from memory; temporary files of an interrupted write are swept when the
cache opens."""

import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import pipecast.agent.cache as cache_module
from packager.manifest import MANIFEST_FILE, manifest_to_json
from pipecast.agent.cache import LOCK_FILE, BlockCache
from pipecast.agent.errors import CacheInUseError
from tests.support.agent_fixtures import receiving_store
from tests.support.packages import tiny_package


def verified_store(package):
    """A receiving store of the package holding every block, verified."""
    root, manifest = package
    store = receiving_store(manifest)
    for block in range(len(manifest.blocks)):
        data = (root / manifest.blocks[block].file).read_bytes()
        size = manifest.blocks[block].chunk_bytes
        for chunk in range(store.chunk_count(block)):
            store.chunk_buffer(block, chunk)[:] = data[chunk * size:(chunk + 1) * size]
            store.chunk_landed(block, chunk, "p1")
    return store


def write_everything(cache: BlockCache, package, store) -> list[bool]:
    root, manifest = package
    results = [cache.write_manifest(manifest)]
    results += [cache.write_file(manifest.package_id, f.path, (root / f.path).read_bytes()) for f in manifest.files]
    results += [cache.write_block(manifest, block, store.block_view(block)) for block in range(len(manifest.blocks))]
    return results


def test_writes_on_a_broken_disk_are_logged_and_counted_not_raised(package, tmp_path, caplog):
    """Finding 7: write_manifest and write_file raised OSError into the agent (a full disk failed the
    fetch of a package the agent held in memory); now every write reports False and is counted."""
    _, manifest = package
    (tmp_path / "not-a-folder").write_text("")  # every write under it fails with ENOTDIR, a real error
    cache = BlockCache(tmp_path / "not-a-folder" / "cache")
    store = verified_store(package)
    try:
        results = write_everything(cache, package, store)
        assert results == [False] * len(results)
        assert cache.write_errors == 1 + len(manifest.files)  # the blocks not tried: no manifest in the cache
        assert "it stays in memory only" in caplog.text
        assert bytes(store.block_view(0)) == (package[0] / manifest.blocks[0].file).read_bytes()  # still served
        assert cache.local_package(manifest.package_id) is None
    finally:
        store.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_full_disk_mid_write_leaves_no_temporary_file(package, tmp_path, monkeypatch, code):
    """Finding 7: ENOSPC or EIO while the bytes are written: False, counted, and no half file left."""
    real_open = type(tmp_path).open

    def failing_open(self, mode="r", *args, **kwargs):
        handle = real_open(self, mode, *args, **kwargs)
        if "w" in mode:
            def write(data):
                raise OSError(code, os.strerror(code))
            handle.write = write
        return handle

    cache = BlockCache(tmp_path / "cache")
    store = verified_store(package)
    monkeypatch.setattr(type(tmp_path), "open", failing_open)
    try:
        results = write_everything(cache, package, store)
    finally:
        monkeypatch.undo()
        store.close()
    assert not any(results) and cache.write_errors == 1 + len(package[1].files)  # blocks: no manifest, not tried
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == [LOCK_FILE]  # the cache's lock only


def test_a_working_cache_writes_and_reads_back(package, tmp_path):
    _, manifest = package
    cache = BlockCache(tmp_path / "cache")
    store = verified_store(package)
    try:
        assert all(write_everything(cache, package, store)) and cache.write_errors == 0
    finally:
        store.close()
    assert cache.local_package(manifest.package_id).manifest == manifest


def test_stale_temporary_files_are_swept_when_the_cache_opens(package, tmp_path):
    """Finding 7: a crash mid-write left ``.<name>.tmp-<pid>`` files for ever; opening the cache removes
    those of dead processes (and this process's own pid from before it started: a container's agent
    restarts with the same pid), and keeps those of live ones."""
    _, manifest = package
    folder = tmp_path / "cache" / manifest.package_id / "blocks"
    folder.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = folder / f".block-0000.safetensors.tmp-{dead_pid}"
    mine_old = folder / f".block-0001.safetensors.tmp-{os.getpid()}"
    live = folder / f".block-0002.safetensors.tmp-{os.getppid()}"
    keep = folder / "block-0000.safetensors"
    for path in (stale, mine_old, live, keep):
        path.write_bytes(b"x")
    long_ago = time.time() - 10 * 365 * 86400
    os.utime(mine_old, (long_ago, long_ago))
    cache_manifest = tmp_path / "cache" / manifest.package_id / f".manifest.json.tmp-{dead_pid}"
    cache_manifest.write_bytes(b"{")

    BlockCache(tmp_path / "cache")
    assert sorted(p.name for p in folder.iterdir()) == sorted([live.name, keep.name])
    assert not cache_manifest.exists()


@pytest.mark.parametrize("found", ["torn", "invalid", "foreign"])
def test_a_manifest_that_is_not_this_packages_valid_one_is_written_again(package, tmp_path, found):
    """Found in review: a manifest.json already there kept the write from happening, whatever it held: a
    zero-length one (a host crash before the rename's data reached the disk), an invalid one, or another
    package's left the cache folder useless for good."""
    root, manifest = package
    cache = BlockCache(tmp_path / "cache")
    path = cache.package_dir(manifest.package_id) / MANIFEST_FILE
    path.parent.mkdir(parents=True)
    if found == "foreign":
        other = tiny_package(tmp_path / "other", layers=1, layer_bytes=1_000)
        path.write_bytes((other.path / MANIFEST_FILE).read_bytes())
    else:
        path.write_bytes({"torn": b"", "invalid": b"{"}[found])
    assert cache.local_package(manifest.package_id) is None
    assert cache.write_manifest(manifest)
    assert path.read_bytes() == (root / MANIFEST_FILE).read_bytes()
    assert cache.local_package(manifest.package_id).manifest == manifest
    assert cache.write_manifest(manifest) and cache.write_errors == 0  # a valid one is kept as it is


def test_the_manifest_reaches_the_disk_before_its_rename(package, tmp_path, monkeypatch):
    """Found in review: without an fsync before the rename a host crash could leave manifest.json empty."""
    _, manifest = package
    done = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (done.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda src, dst: (done.append(("replace", str(src), str(dst))),
                                                         real_replace(src, dst))[1])
    cache = BlockCache(tmp_path / "cache")
    assert cache.write_manifest(manifest)
    folder = cache.package_dir(manifest.package_id)
    [(_, synced), (_, renamed, final), (_, folder_synced)] = done
    assert synced == renamed and os.path.basename(renamed).startswith(f".{MANIFEST_FILE}.tmp-")
    assert (final, folder_synced) == (str(folder / MANIFEST_FILE), str(folder))


def test_a_block_is_not_written_where_its_manifest_is_not(package, tmp_path):
    """Found in review: with the manifest's write failed, the blocks were written all the same into a folder no
    store could ever use (and that nothing removed)."""
    _, manifest = package
    cache = BlockCache(tmp_path / "cache")
    store = verified_store(package)
    try:
        assert not cache.write_block(manifest, 0, store.block_view(0))
        assert not (tmp_path / "cache" / manifest.package_id).exists() and cache.write_errors == 0
    finally:
        store.close()


def test_a_bounded_cache_removes_the_packages_used_least_recently_and_not_held_to_make_room(tmp_path):
    """Found in review: nothing ever left the cache (dropped and removed packages included): a node's disk filled
    and every later write failed."""
    packages = [tiny_package(tmp_path / name, layers=2, layer_bytes=50_000, seed=seed)
                for seed, name in enumerate(("a", "b", "c"))]
    size = max(p.manifest.total_bytes for p in packages) + 20_000  # one package and its files, not two
    held: set[str] = set()
    removed: list[str] = []  # the agent is told each (it tells its control plane)
    cache = BlockCache(tmp_path / "cache", max_bytes=size * 2, in_use=lambda: held, on_removed=removed.append)
    stores = [verified_store((p.path, p.manifest)) for p in packages]
    try:
        assert all(write_everything(cache, (packages[0].path, packages[0].manifest), stores[0]))
        time.sleep(0.01)
        assert all(write_everything(cache, (packages[1].path, packages[1].manifest), stores[1]))
        held.add(packages[1].manifest.package_id)  # b is in memory: never removed for room
        time.sleep(0.01)
        assert all(write_everything(cache, (packages[2].path, packages[2].manifest), stores[2]))
        assert cache.packages() == sorted([packages[1].manifest.package_id, packages[2].manifest.package_id])
        assert removed == [packages[0].manifest.package_id]
        # Too large beside what is held: skipped, counted, not written.
        held.add(packages[2].manifest.package_id)
        other = tiny_package(tmp_path / "d", layers=2, layer_bytes=50_000, seed=9)
        assert cache.write_manifest(other.manifest)
        stores.append(verified_store((other.path, other.manifest)))
        assert not cache.write_block(other.manifest, 0, stores[-1].block_view(0))
        assert cache.skipped_writes == 1 and cache.write_errors == 0 and removed == [packages[0].manifest.package_id]
    finally:
        for store in stores:
            store.close()


def test_a_manifest_counts_against_the_bound_too(package, tmp_path):
    """Found in review: manifests were written past agent_cache_max_bytes (only blocks and small files counted)."""
    _, manifest = package
    cache = BlockCache(tmp_path / "cache", max_bytes=100)  # less than any manifest
    assert not cache.write_manifest(manifest)
    assert cache.skipped_writes == 1 and cache.packages() == []


def test_a_look_at_what_the_cache_holds_is_no_use_of_it(tmp_path):
    """Found in review of the bound: each registration lists the cached blocks, which made every package "used now",
    and the one removed for room was then any, not the least recently used."""
    packages = [tiny_package(tmp_path / name, layers=2, layer_bytes=50_000, seed=seed)
                for seed, name in enumerate(("a", "b", "c"))]
    size = max(p.manifest.total_bytes for p in packages) + 20_000
    cache = BlockCache(tmp_path / "cache", max_bytes=size * 2)
    stores = [verified_store((p.path, p.manifest)) for p in packages]
    try:
        for package, store in zip(packages[:2], stores):
            assert all(write_everything(cache, (package.path, package.manifest), store))
            time.sleep(0.01)
        assert cache.cached_blocks(packages[0].manifest.package_id) == [0, 1]  # a look, as a registration's
        assert all(write_everything(cache, (packages[2].path, packages[2].manifest), stores[2]))
        assert cache.packages() == sorted(p.manifest.package_id for p in packages[1:])  # a went: the oldest use
    finally:
        for store in stores:
            store.close()


def cached_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _write_beside_one_under_way(cache: BlockCache, manifest, store, monkeypatch, temporary_on_disk: bool) -> bool:
    """Write block 1 while block 0's write is under way (with its temporary file on disk, whole, if
    ``temporary_on_disk``); whether block 1 was written (block 0's write must be)."""
    writing, finish = threading.Event(), threading.Event()
    real_write = cache_module.write_temporary

    def slow_write(path, data, **kwargs):
        if writing.is_set():
            return real_write(path, data, **kwargs)
        # the first write is under way while the second asks for room
        temporary = real_write(path, data, **kwargs) if temporary_on_disk else None
        writing.set()
        finish.wait(5)
        return temporary or real_write(path, data, **kwargs)

    monkeypatch.setattr(cache_module, "write_temporary", slow_write)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(cache.write_block, manifest, 0, store.block_view(0))
        assert writing.wait(5)
        second = cache.write_block(manifest, 1, store.block_view(1))
        finish.set()
        assert first.result(5)
    monkeypatch.setattr(cache_module, "write_temporary", real_write)
    return second


def test_writes_running_at_once_stay_under_the_bound_together(package, tmp_path, monkeypatch):
    """Found in review: room was checked per write but the bytes of writes still under way were not counted, so
    blocks written at once (a worker thread each) all passed the check and the cache grew past its bound."""
    _, manifest = package
    store = verified_store(package)
    manifest_bytes = len(manifest_to_json(manifest).encode())
    bound = manifest_bytes + max(manifest.blocks[0].bytes, manifest.blocks[1].bytes) * 3 // 2  # one block, not two
    cache = BlockCache(tmp_path / "cache", max_bytes=bound, in_use=lambda: {manifest.package_id})
    try:
        assert cache.write_manifest(manifest)
        assert not _write_beside_one_under_way(cache, manifest, store, monkeypatch, temporary_on_disk=False)
        assert cache.skipped_writes == 1 and cached_bytes(tmp_path / "cache") <= bound
        assert cache.write_block(manifest, 0, store.block_view(0))  # what block 0 was counted for is counted no more
    finally:
        store.close()


def test_a_write_under_way_is_counted_once_not_also_as_its_temporary_file(package, tmp_path, monkeypatch):
    """Found in review: the bytes of a write under way counted as pending and again as its temporary file on disk,
    so near the bound a write beside it that fit was refused."""
    _, manifest = package
    store = verified_store(package)
    manifest_bytes = len(manifest_to_json(manifest).encode())
    bound = manifest_bytes + manifest.blocks[0].bytes + manifest.blocks[1].bytes  # both blocks, exactly
    cache = BlockCache(tmp_path / "cache", max_bytes=bound, in_use=lambda: {manifest.package_id})
    try:
        assert cache.write_manifest(manifest)
        assert _write_beside_one_under_way(cache, manifest, store, monkeypatch, temporary_on_disk=True)
        assert cache.skipped_writes == 0 and cached_bytes(tmp_path / "cache") == bound
    finally:
        store.close()


def test_a_finished_write_is_counted_once_not_also_as_pending(tmp_path, monkeypatch):
    """Found in review: a write's file was renamed into place before its bytes stopped counting as pending, so a
    write asking for room between the two counted them twice and removed a package it had room for."""
    a, b = (tiny_package(tmp_path / name, layers=2, layer_bytes=50_000, seed=seed)
            for seed, name in ((1, "a"), (2, "b")))
    stores = [verified_store((p.path, p.manifest)) for p in (a, b)]
    held: set[str] = set()
    removed: list[str] = []
    cache = BlockCache(tmp_path / "cache", max_bytes=10**9, in_use=lambda: held, on_removed=removed.append)
    try:
        assert all(write_everything(cache, (a.path, a.manifest), stores[0]))
        manifest_bytes = len(manifest_to_json(b.manifest).encode())
        # a and all of b fit, exactly
        cache.max_bytes = (cached_bytes(cache.package_dir(a.manifest.package_id)) + manifest_bytes
                           + b.manifest.blocks[0].bytes + b.manifest.blocks[1].bytes)
        held.add(b.manifest.package_id)
        assert cache.write_manifest(b.manifest)
        real_utime, renamed, finish = os.utime, threading.Event(), threading.Event()

        def slow_utime(path, *args, **kwargs):  # block 0 is in place; its write has not ended
            real_utime(path, *args, **kwargs)
            if not renamed.is_set() and os.path.basename(path) == b.manifest.package_id:
                renamed.set()
                finish.wait(5)

        monkeypatch.setattr(os, "utime", slow_utime)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(cache.write_block, b.manifest, 0, stores[1].block_view(0))
            assert renamed.wait(5)
            assert cache.write_block(b.manifest, 1, stores[1].block_view(1))
            finish.set()
            assert first.result(5)
        assert removed == [] and cache.holds(a.manifest.package_id)
        assert cached_bytes(tmp_path / "cache") == cache.max_bytes
    finally:
        for store in stores:
            store.close()


def test_a_rotten_block_is_written_again_in_a_cache_at_its_bound(package, tmp_path):
    """Found in review: the room asked for counted the file being replaced beside its new bytes, so in a full
    cache a block that rotted on disk was never written again (and stayed rotten for every restart)."""
    _, manifest = package
    store = verified_store(package)
    try:
        assert all(write_everything(BlockCache(tmp_path / "cache"), package, store))
        bound = cached_bytes(tmp_path / "cache")
        rotten = tmp_path / "cache" / manifest.package_id / manifest.blocks[0].file
        data = bytearray(rotten.read_bytes())
        data[0] ^= 0xFF  # bit rot: same size
        rotten.write_bytes(data)
        cache = BlockCache(tmp_path / "cache", max_bytes=bound, in_use=lambda: {manifest.package_id})
        assert cache.write_block(manifest, 0, store.block_view(0)) and cache.skipped_writes == 0
        assert rotten.read_bytes() == bytes(store.block_view(0))
    finally:
        store.close()


def test_a_write_that_cannot_fit_removes_nothing_and_what_is_no_package_is_never_removed(tmp_path):
    """Found in review: a write that could not fit even with every unused package gone removed them all first
    (and was skipped all the same); eviction removed any folder in the cache's root (a volume's lost+found,
    another program's data)."""
    small, big = (tiny_package(tmp_path / name, layers=2, layer_bytes=size, seed=seed)
                  for seed, (name, size) in enumerate((("small", 20_000), ("big", 200_000))))
    root = tmp_path / "cache"
    (root / "lost+found").mkdir(parents=True)
    (root / "other-app").mkdir()
    (root / "other-app" / "data.db").write_bytes(b"x" * 100_000)
    cache = BlockCache(root, max_bytes=small.manifest.total_bytes + 60_000)
    stores = [verified_store((p.path, p.manifest)) for p in (small, big)]
    try:
        assert all(write_everything(cache, (small.path, small.manifest), stores[0]))
        assert cache.packages() == [small.manifest.package_id]
        assert not cache.write_block(big.manifest, 0, stores[1].block_view(0))  # no manifest there: not written
        cache.write_manifest(big.manifest)
        assert not cache.write_block(big.manifest, 0, stores[1].block_view(0))
        assert small.manifest.package_id in cache.packages()  # removing it would not have made room
        assert (root / "other-app" / "data.db").exists() and (root / "lost+found").is_dir()
    finally:
        for store in stores:
            store.close()


def test_a_cache_that_cannot_mark_a_package_used_still_opens_it(package, tmp_path, monkeypatch):
    """Found in review: on a read-only cache os.utime failed and every open ignored the package, while
    registrations still listed its blocks as cached (placement sent local loads that then went over the net)."""
    root, manifest = package
    cache = BlockCache(tmp_path / "cache")
    store = verified_store(package)
    try:
        assert all(write_everything(cache, package, store))
    finally:
        store.close()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cache_module.os, "utime", read_only)
    assert cache.local_package(manifest.package_id, use=True) is not None


def test_a_second_agent_on_one_cache_folder_is_refused_naming_it(tmp_path):
    """Found in review: two agents on one --cache-dir removed each other's packages for room, and the victim's later
    writes were skipped without a word."""
    root = tmp_path / "cache"
    first = BlockCache(root)
    with pytest.raises(CacheInUseError, match=rf"^the disk cache {root} is held by another agent \(its lock "
                                              rf"{root}/\.lock is taken\): two agents on one cache folder remove each "
                                              r"other's packages; give each agent a --cache-dir of its own$"):
        BlockCache(root)
    first.close()
    first.close()  # idempotent
    BlockCache(root).close()  # given back: the next agent opens it


def test_a_block_whose_manifest_is_gone_is_skipped_counted_and_said_once(package, tmp_path, caplog):
    """Found in review: a block written after another agent removed its package's folder was skipped silently."""
    _, manifest = package
    cache = BlockCache(tmp_path / "cache")
    store = verified_store(package)
    try:
        assert cache.write_manifest(manifest) and cache.write_block(manifest, 0, store.block_view(0))
        shutil.rmtree(cache.package_dir(manifest.package_id))  # as the other agent's eviction did
        assert not cache.write_block(manifest, 1, store.block_view(1))
        assert not cache.write_block(manifest, 2, store.block_view(2))
    finally:
        store.close()
    assert cache.skipped_writes == 2
    said = [r.getMessage() for r in caplog.records if "no manifest of package" in r.getMessage()]
    assert said == [f"disk cache {cache.root}: no manifest of package {manifest.package_id[:12]} here (its write "
                    f"failed, or its folder was removed): block 1 of {manifest.package_id[:12]} and its later blocks "
                    "stay in memory only (1 write(s) skipped so far)"]
