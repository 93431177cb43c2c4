"""The control plane's state in one SQLite file (or ":memory:"): one control plane process. The tables, the
row encoding and the lease are :mod:`control_plane.store_sql`'s, shared with PostgreSQL.

Durability: the service answers an RPC (a published package, a plan) only after its flush, so the flush
must survive a power loss: ``synchronous=FULL`` syncs the WAL at every commit. A transaction starts with
``BEGIN IMMEDIATE``, taking the file's write lock before its first read. A control plane holds ``PATH.lock``
(``exclusive``) while it runs: a second process on the file is refused at start.
"""

import contextlib
import fcntl
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from control_plane.errors import StoreError
from control_plane.store_sql import Dialect, SqlStore

SQLITE = Dialect(param="?", types={"text": "TEXT", "bytes": "BLOB", "real": "REAL", "integer": "INTEGER"},
                 lock_row="", schema_lock="", tables="SELECT name FROM sqlite_master WHERE type = 'table'",
                 now="((julianday('now') - 2440587.5) * 86400.0)")  # Unix time, to the millisecond


class SqliteStore(SqlStore):
    """One SQLite file holding the control plane's state between restarts."""

    dialect = SQLITE
    remedy = "restore the file from a backup or start on another path"
    elsewhere = "use another path"
    shared = False

    def __init__(self, path: Path | str, *, exclusive: bool = False):
        """``exclusive``: hold ``PATH.lock`` locked for as long as the store is open, and refuse a file another
        process holds so (:class:`StoreError`): one SQLite file serves one control plane process, which leads
        from the start without a lease; a second one on the file would serve from a state of its own and write
        into the same tables."""
        where = str(path)
        try:
            # Autocommit: transactions are explicit (_transaction), so that reads can be inside them.
            # Used by one thread at a time (the store's lock), not always the one that opened it: a large flush
            # commits in a worker thread.
            db = sqlite3.connect(where, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"control plane database {where}: {exc}") from exc
        self._held: int | None = None
        try:  # before anything is read or written: the schema is made by the one process the file serves
            if exclusive and where != ":memory:":
                self._held = self._lock_file(where)
            super().__init__(where, db, sqlite3.Error)
        except BaseException:
            db.close()
            self._unlock()
            raise

    @staticmethod
    def _lock_file(where: str) -> int:
        # Beside the file itself: a symbolic link to it named another lock, and two processes served one file.
        lock = f"{os.path.realpath(where)}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StoreError(f"control plane database {where}: cannot open its lock file {lock} "
                             f"({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreError(f"control plane database {where} is in use by another control plane process (it holds "
                             f"{lock}): one SQLite file serves one process; use another path, or PostgreSQL for "
                             "replicas") from None
        return fd

    def _unlock(self) -> None:
        if self._held is not None:
            os.close(self._held)  # the lock goes with its descriptor
            self._held = None

    def close(self) -> None:
        super().close()
        self._unlock()

    def _configure(self) -> None:
        if self.where != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        # An acknowledged write survives a crash or a power loss (module docstring).
        self._db.execute("PRAGMA synchronous=FULL")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:  # SQLite may have rolled back already (a full disk, an I/O error)
                self._db.execute("ROLLBACK")
            raise
