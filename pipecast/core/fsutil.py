"""Small filesystem and process helpers shared by the packager, the agent and the benchmarks."""

import fcntl
import glob
import itertools
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL_MARK = ".partial-"
#: The lock file of a :func:`locked_folder`.
FOLDER_LOCK = ".lock"
TEMPORARY_MARK = ".tmp-"
# What atomic_write names its temporary files: ".<name>.tmp-<pid>.<n>", n counting this process's writes
# (two threads writing the same path at once must not share one temporary file).
_TEMPORARY = re.compile(r"^\..+" + re.escape(TEMPORARY_MARK) + r"([0-9]{1,10})(?:\.[0-9]+)?$")
#: A pid as this module writes it into a name: ASCII digits ("²" is a digit to str.isdigit, not to int), bounded.
_PID = re.compile(r"[0-9]{1,10}")
_WRITES = itertools.count()

logger = logging.getLogger(__name__)


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (even one we may not signal)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # too large for a pid_t: no process has it
        return False
    except PermissionError:
        return True
    return True


def atomic_write(path: Path, data: bytes | memoryview, *, durable: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename, so a crash never
    leaves a half file under ``path``. ``durable``: the temporary file is fsynced before the rename and the
    folder after it, so that after a crash of the host too ``path`` holds its old bytes or all of ``data``
    (without it durability is not promised)."""
    commit_temporary(write_temporary(path, data, durable=durable), path, durable=durable)


def write_temporary(path: Path, data: bytes | memoryview, *, durable: bool = False) -> Path:
    """The first step of :func:`atomic_write`, for a caller that must rename in a step of its own (under its
    lock): write ``data`` to a new temporary file beside ``path`` (removed again if that fails) and return it,
    for :func:`commit_temporary`. ``durable``: fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TEMPORARY_MARK}{os.getpid()}.{next(_WRITES)}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def commit_temporary(tmp: Path, path: Path, *, durable: bool = False) -> None:
    """The second step of :func:`atomic_write`: rename ``tmp`` (of :func:`write_temporary`) to ``path``, or
    remove it if the rename fails. ``durable``: the folder is fsynced after the rename."""
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)  # the rename itself


def fsync_path(path: Path | str) -> None:
    """fsync a file or a folder (a folder: the names in it, such as a rename's)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (``root`` too), the folders after what they hold."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def is_temporary(name: str) -> bool:
    """Whether ``name`` is that of a temporary file :func:`atomic_write` writes before its rename."""
    return _TEMPORARY.match(name) is not None


def start_ticks(pid: int | str = "self") -> int | None:
    """Process ``pid``'s start in clock ticks since boot (``/proc/<pid>/stat``'s starttime), which tells it apart
    from any other given the same pid; None where /proc cannot tell (not Linux, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[19])  # field 22; the name before it may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def process_started() -> float | None:
    """When this process started, in seconds since the epoch, to a clock tick and never after it did; None where
    /proc cannot tell. From its :func:`start_ticks` (psutil's counts from the boot time in whole seconds: up to a
    second early, which took a predecessor's leftovers of the second before for this one's)."""
    ticks = start_ticks()
    try:
        return None if ticks is None else (
            time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, AttributeError):  # no CLOCK_BOOTTIME: not Linux
        return None


def _predecessors(pid: int, changed: float, started: float | None) -> bool:
    """Whether what a process named ``pid`` left, last changed at ``changed`` (epoch s), is a gone process's: its
    pid is not alive, or it is this process's own pid but the thing predates it (a restarted container's process
    gets the same pid, pid 1 often). Own-pid things are kept where ``started`` is unknown (None)."""
    if pid == os.getpid():
        return started is not None and changed < started
    return not pid_alive(pid)


def sweep_stale_temporaries(root: Path) -> int:
    """Remove the temporary files that :func:`atomic_write` calls left under ``root`` (at any depth) by
    processes that are gone; return how many were removed. A file named with this process's own pid is
    stale too when it is older than the process (a restarted container's agent gets the same pid)."""
    started = process_started()
    removed = 0
    for folder, _, names in os.walk(root):
        for name in names:
            match = _TEMPORARY.match(name)
            if match is None:
                continue
            path = Path(folder) / name
            pid = int(match.group(1))
            try:
                if not _predecessors(pid, path.stat().st_mtime, started):
                    continue
                path.unlink()
                removed += 1
            except OSError:
                pass  # gone meanwhile, or not ours to remove
    return removed


@contextmanager
def locked_folder(parent: Path, prefix: str) -> Iterator[Path]:
    """A new folder ``parent/<prefix>...`` for the duration of the block, removed after it, holding a lock file
    (:data:`FOLDER_LOCK`) locked meanwhile: :func:`sweep_unlocked_folders`, run by any process on any host that
    shares the file system, leaves it alone (a pid would not tell: other hosts' and containers' are not ours)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        with open(folder / FOLDER_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield folder
    finally:
        _remove(folder)


def sweep_unlocked_folders(parent: Path, prefix: str, min_age_s: float = 60.0) -> None:
    """Remove the folders of :func:`locked_folder` under ``parent`` whose lock nobody holds: those of killed runs
    (a SIGKILL runs no clean-up), which would otherwise hold their disk space for good. A folder whose lock file is
    younger than ``min_age_s`` (being made), or that has none, is left."""
    for folder in parent.glob(f"{glob.escape(prefix)}*"):
        try:
            # opened for writing: NFS emulates flock with POSIX locks, whose exclusive kind needs it
            with open(folder / FOLDER_LOCK, "r+") as lock:
                if time.time() - os.fstat(lock.fileno()).st_mtime < min_age_s:
                    continue
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: in use
            continue
        except OSError as exc:  # no lock file to tell (or one that cannot be locked): not judged
            logger.debug("%s: left as it is (%s)", folder, exc)
            continue
        _remove(folder)


def _owner_gone(partial: Path) -> bool:
    """Whether the process named at the end of ``partial`` (``.NAME.partial-[old-]PID``) is gone: also a process
    with this one's pid before it (the folder's inode changed last, by the rename that named it, before this
    process started)."""
    pid = partial.name.rsplit("-", 1)[-1]
    if _PID.fullmatch(pid) is None:
        return False
    try:
        changed = partial.lstat().st_ctime
    except OSError:  # gone meanwhile
        return False
    return _predecessors(int(pid), changed, process_started())


def restore_moved_aside(out: Path) -> None:
    """Put back the ``out`` that a process killed while replacing it (:func:`atomic_directory`'s ``overwrite``)
    moved aside, when ``out`` is missing: the replacement never came, and the next run must not take the folder
    for a leftover to delete (nor ``out`` for one it may create without ``--force``)."""
    if os.path.lexists(out):
        return
    for stale in sorted(out.parent.glob(f"{glob.escape(f'.{out.name}{PARTIAL_MARK}')}old-*")):
        if _owner_gone(stale):
            try:
                os.rename(stale, out)
            except FileNotFoundError:  # another run put it back first
                return
            logger.warning("%s: put back as %s (a process that was replacing it was killed)", stale, out)
            return


@contextmanager
def atomic_directory(out: Path, *, overwrite: bool = False, durable: bool = False) -> Iterator[Path]:
    """Build a folder in a hidden sibling and rename it to ``out`` only if the body succeeds.

    On any failure (Ctrl-C included) the partial folder is removed; folders left by killed processes
    (their pid is in the name) are removed on the next use. With ``overwrite`` an existing ``out`` is
    moved aside first and removed only once the new one is in place: an interruption never leaves a
    half-removed folder under ``out``, and the next use puts one moved aside by a killed process back when
    ``out`` is missing (one whose removal began is renamed first, so that it is never put back half removed).
    ``durable``: everything built is fsynced before the rename and the parent folder after it, before the old
    ``out`` is removed, so that after a crash of the host too ``out`` is the old folder or the whole new one.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    restore_moved_aside(out)  # before the sweep below would take it for a leftover
    for stale in out.parent.glob(f"{glob.escape(f'.{out.name}{PARTIAL_MARK}')}*"):
        if _owner_gone(stale):
            _remove(stale)
    tmp = out.parent / f".{out.name}{PARTIAL_MARK}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if durable:  # before the old one moves aside: OUT stays there while the new one reaches the disk
            _fsync_tree(tmp)
        old = None
        if os.path.lexists(out):
            if not overwrite:
                raise FileExistsError(f"{out} appeared while it was being built")
            # a file or a symlink is moved aside itself, never what a symlink points at
            old = out.parent / f".{out.name}{PARTIAL_MARK}old-{os.getpid()}"
            _remove(old)
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if durable:
        fsync_path(out.parent)
    if old is not None:
        # Renamed before its removal starts: a run killed during it leaves a folder restore_moved_aside never
        # puts back (half removed), which the next use sweeps as any leftover of a process gone.
        dead = out.parent / f".{out.name}{PARTIAL_MARK}dead-{os.getpid()}"
        _remove(dead)
        os.rename(old, dead)
        _remove(dead)


def _remove(path: Path) -> None:
    """Remove ``path`` if it is there: a folder with what it holds, a file or a symlink itself. What cannot be
    removed is left there with a warning naming it: unnoticed, it would hold its disk space for good."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)  # as much of it as can go; what is left then says why
            if os.path.lexists(path):
                shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
    except OSError as exc:
        logger.warning("%s: cannot remove it (%s); it is left there, remove it by hand", path, exc)
