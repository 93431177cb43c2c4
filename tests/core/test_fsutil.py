"""Writing files and folders so that an interruption never leaves a half one under the final name."""

import os
import subprocess
import sys
import time

import pytest

from pipecast.core import fsutil
from pipecast.core.fsutil import atomic_directory, atomic_write, sweep_stale_temporaries


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_overwriting_a_folder_keeps_the_old_one_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    out = tmp_path / "pkg"
    with atomic_directory(out) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError):  # the body fails: the old folder stays as it was
        with atomic_directory(out, overwrite=True) as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("interrupted")
    assert (out / "a").read_text() == "old"
    renames = []

    def rename_failing_into_place(src, dst):
        renames.append((os.path.basename(src), os.path.basename(dst)))
        if len(renames) == 2:  # the new folder into place (after the old one moved aside)
            raise OSError("disk gone")
        os.replace(src, dst)

    monkeypatch.setattr(fsutil.os, "rename", rename_failing_into_place)
    with pytest.raises(OSError, match="disk gone"):
        with atomic_directory(out, overwrite=True) as tmp:
            (tmp / "a").write_text("new")
    monkeypatch.undo()
    assert renames[0] == ("pkg", f".pkg{fsutil.PARTIAL_MARK}old-{os.getpid()}")  # moved aside, not removed
    assert (out / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]
    with atomic_directory(out, overwrite=True) as tmp:
        (tmp / "a").write_text("new")
    assert (out / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


def test_each_write_has_a_temporary_file_of_its_own_and_stale_ones_are_swept(tmp_path, monkeypatch):
    names = []
    real_open = type(tmp_path).open

    def spying_open(self, *args, **kwargs):
        names.append(self.name)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "open", spying_open)
    atomic_write(tmp_path / "f", b"1")
    atomic_write(tmp_path / "f", b"2")
    monkeypatch.undo()
    assert len(set(names)) == 2 and (tmp_path / "f").read_bytes() == b"2"
    dead = _dead_pid()
    (tmp_path / f".f{fsutil.TEMPORARY_MARK}{dead}.7").write_bytes(b"half")
    (tmp_path / f".g{fsutil.TEMPORARY_MARK}{dead}").write_bytes(b"half")  # as older versions named them
    assert sweep_stale_temporaries(tmp_path) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_leftovers_named_with_a_pid_no_process_can_have_are_no_crash(tmp_path):
    """Found in review: a pid past pid_t overflowed os.kill, and "²" (a digit to str.isdigit) failed int()."""
    for pid in ("99999999999999999999", "\u00b2"):
        (tmp_path / f".out{fsutil.PARTIAL_MARK}{pid}").mkdir()
    with atomic_directory(tmp_path / "out") as building:
        (building / "x").write_bytes(b"1")
    assert (tmp_path / "out" / "x").read_bytes() == b"1"
    (tmp_path / f".f{fsutil.TEMPORARY_MARK}99999999999").write_bytes(b"half")  # 11 digits: never a pid written
    (tmp_path / f".g{fsutil.TEMPORARY_MARK}9999999999").write_bytes(b"half")
    assert sweep_stale_temporaries(tmp_path) == 1
    assert not fsutil.pid_alive(10**20)


def test_a_folder_that_cannot_be_removed_is_named_in_a_warning(tmp_path, monkeypatch, caplog):
    """Found in review: the old folder ``--force`` replaced (and a killed run's partial folder, in the later
    sweep) was removed ignoring errors: one that could not be removed stayed there, unnoticed, for good."""
    real_rmtree = fsutil.shutil.rmtree

    def rmtree_failing_in(path, ignore_errors=False):
        if not os.path.isdir(path) or "stuck" not in os.listdir(path):
            return real_rmtree(path, ignore_errors=ignore_errors)
        if not ignore_errors:
            raise PermissionError(13, "Permission denied", os.path.join(path, "stuck"))

    out = tmp_path / "pkg"
    with atomic_directory(out) as tmp:
        (tmp / "stuck").write_text("old")
    monkeypatch.setattr(fsutil.shutil, "rmtree", rmtree_failing_in)
    old = tmp_path / f".pkg{fsutil.PARTIAL_MARK}dead-{os.getpid()}"  # renamed before its removal
    stale = tmp_path / f".pkg{fsutil.PARTIAL_MARK}{_dead_pid()}"
    (stale / "stuck").mkdir(parents=True)
    with caplog.at_level("WARNING", logger="pipecast.core.fsutil"):
        with atomic_directory(out, overwrite=True) as tmp:
            (tmp / "a").write_text("new")
    assert os.listdir(out) == ["a"]
    assert caplog.messages == [
        f"{stale}: cannot remove it ([Errno 13] Permission denied: '{stale / 'stuck'}'); it is left there, remove "
        "it by hand",
        f"{old}: cannot remove it ([Errno 13] Permission denied: '{old / 'stuck'}'); it is left there, remove it "
        "by hand"]


KILLED_WHILE_REMOVING = """
import os, shutil, signal, sys
from pathlib import Path
from pipecast.core.fsutil import atomic_directory

def killed_midway(path, *args, **kwargs):  # SIGKILL once part of the old folder is gone
    os.remove(os.path.join(path, "blocks", "block-0"))
    os.kill(os.getpid(), signal.SIGKILL)

with atomic_directory(Path(sys.argv[1]), overwrite=True) as tmp:
    (tmp / "manifest.json").write_text("new")
    shutil.rmtree = killed_midway
"""


def test_a_folder_half_removed_by_a_process_killed_after_its_replacement_is_never_put_back(tmp_path):
    """Found in review: killed while removing the folder it replaced, ``pack --force`` left it half removed under
    the name of one moved aside before its replacement came; once OUT was gone (removed by hand), the next pack put
    it back as OUT: a manifest without its blocks, a folder that looks like a package (and the pack was refused)."""
    out = tmp_path / "pkg"
    with atomic_directory(out) as tmp:
        (tmp / "manifest.json").write_text("old")
        (tmp / "blocks").mkdir()
        (tmp / "blocks" / "block-0").write_text("weights")
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_REMOVING, str(out)], timeout=60)
    assert killed.returncode == -9 and (out / "manifest.json").read_text() == "new"
    fsutil._remove(out)  # the operator removes it
    with atomic_directory(out) as tmp:
        (tmp / "manifest.json").write_text("newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"] and (out / "manifest.json").read_text() == "newer"


def test_a_durable_folder_is_fsynced_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    """Found in review: ``pack`` fsynced nothing, then removed the package it replaced: after a crash of the host
    OUT could hold a manifest whose blocks never reached the disk, the good package gone."""
    out = tmp_path / "pkg"
    with atomic_directory(out) as tmp:
        (tmp / "a").write_text("old")
    events, real_fsync, real_rename = [], os.fsync, os.rename
    monkeypatch.setattr(fsutil.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                        real_fsync(fd)))
    monkeypatch.setattr(fsutil.os, "rename", lambda a, b: (events.append(("rename", os.path.basename(b))),
                                                           real_rename(a, b)))
    with atomic_directory(out, overwrite=True, durable=True) as tmp:
        (tmp / "b").mkdir()
        (tmp / "b" / "c").write_text("new")
    into_place, aside = events.index(("rename", "pkg")), events.index(("rename", f".pkg{fsutil.PARTIAL_MARK}old-"
                                                                                 f"{os.getpid()}"))
    synced = {os.path.relpath(path, tmp) for kind, path in events[:aside] if kind == "fsync"}
    assert synced == {"b/c", "b", "."}  # before the old one moved aside: OUT is never missing for a long fsync
    assert aside == into_place - 1
    assert events[into_place + 1] == ("fsync", str(tmp_path)) and not (tmp_path / "pkg" / "a").exists()


def test_a_folder_moved_aside_by_a_process_killed_before_its_replacement_is_put_back(tmp_path, caplog):
    """Found in review: killed between its two renames, ``pack --force`` left OUT missing, the package it replaced
    and the finished new one beside it; the next pack to OUT deleted both (and then failed: disk full)."""
    out = tmp_path / "pkg"
    dead = _dead_pid()
    old = tmp_path / f".pkg{fsutil.PARTIAL_MARK}old-{dead}"
    (old / "manifest.json").parent.mkdir()
    (old / "manifest.json").write_text("old")
    (tmp_path / f".pkg{fsutil.PARTIAL_MARK}{dead}").mkdir()
    with pytest.raises(RuntimeError):
        with caplog.at_level("WARNING", logger="pipecast.core.fsutil"), atomic_directory(out, overwrite=True) as tmp:
            raise RuntimeError("failed again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]
    assert (out / "manifest.json").read_text() == "old"
    assert caplog.messages == [f"{old}: put back as {out} (a process that was replacing it was killed)"]
    # with ``out`` in place (killed after its replacement), one moved aside is removed
    old.mkdir()
    with atomic_directory(out, overwrite=True) as tmp:
        (tmp / "manifest.json").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"] and (out / "manifest.json").read_text() == "new"


def test_a_folder_moved_aside_under_this_processs_pid_before_it_started_is_put_back(tmp_path, monkeypatch):
    """A container's process is pid 1 at every start: one killed between its two renames left ``.OUT.partial-old-1``,
    which the next run, pid 1 again, judged its own (alive) and never put back; OUT stayed missing for good. Moved
    aside before this process started, it is a predecessor's; moved aside since, it is this process's own."""
    out = tmp_path / "pkg"
    old = tmp_path / f".pkg{fsutil.PARTIAL_MARK}old-{os.getpid()}"
    old.mkdir()
    (old / "manifest.json").write_text("old")
    fsutil.restore_moved_aside(out)  # moved aside since this process started: its own, in use
    assert not out.exists() and old.is_dir()
    monkeypatch.setattr(fsutil, "process_started", lambda: time.time() + 60)  # this process started after it
    fsutil.restore_moved_aside(out)
    assert (out / "manifest.json").read_text() == "old" and not old.exists()


def test_a_name_with_glob_characters_takes_no_other_folders_leftovers(tmp_path):
    """Found in review: the leftovers were found by a glob of the name unescaped: restoring OUT ``a?`` put package
    ``ab``'s folder moved aside in its place (and a --force to ``a?`` would then have deleted it)."""
    other = tmp_path / f".ab{fsutil.PARTIAL_MARK}old-{_dead_pid()}"
    other.mkdir()
    fsutil.restore_moved_aside(tmp_path / "a?")
    with atomic_directory(tmp_path / "a[b]") as building:
        (building / "x").write_bytes(b"1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "a[b]"]


def test_a_download_folder_is_swept_only_once_its_lock_is_free_and_old(tmp_path):
    with fsutil.locked_folder(tmp_path, ".dl-") as in_use:
        os.utime(in_use / fsutil.FOLDER_LOCK, (0, 0))  # old, but held
        fsutil.sweep_unlocked_folders(tmp_path, ".dl-")
        assert in_use.is_dir()
    assert not in_use.exists()  # removed on leaving the block
    left = tmp_path / ".dl-killed"
    left.mkdir()
    (left / fsutil.FOLDER_LOCK).touch()
    fsutil.sweep_unlocked_folders(tmp_path, ".dl-")
    assert left.is_dir()  # its lock file just made: a folder being set up
    os.utime(left / fsutil.FOLDER_LOCK, (0, 0))
    fsutil.sweep_unlocked_folders(tmp_path, ".dl-")
    assert list(tmp_path.iterdir()) == []
