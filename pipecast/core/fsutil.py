"""Small filesystem and process helpers shared by the packager, the agent and the benchmarks."""

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL_MARK = ".partial-"


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (even one we may not signal)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename, so a crash never
    leaves a half file under ``path`` (no fsync: durability is not promised)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_directory(out: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Build a folder in a hidden sibling and rename it to ``out`` only if the body succeeds.

    On any failure (Ctrl-C included) the partial folder is removed; folders left by killed processes
    (their pid is in the name) are removed on the next use.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}{PARTIAL_MARK}*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}{PARTIAL_MARK}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            if not overwrite:
                raise FileExistsError(f"{out} appeared while it was being built")
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
