"""The control plane's state in PostgreSQL (psycopg 3, extra ``postgres``): several control plane replicas
share one database; the lease (:mod:`control_plane.store`) says which one leads. The tables, the row
encoding and the lease are :mod:`control_plane.store_sql`'s, shared with SQLite.

Durability: ``synchronous_commit=on`` for the session, so a commit returns only once its WAL is on disk
(and on a synchronous standby, where the operator configured one). A write transaction first reads the lease
row ``FOR UPDATE``: the fencing check and the writes after it are one unit, and a replica taking the lease
waits for them to commit. ``lock_timeout`` bounds that wait, and ``idle_in_transaction_session_timeout``
ends the session of a process that froze inside a transaction, so its lock cannot outlive it for long.
``statement_timeout`` and the connection's TCP settings (``tcp_user_timeout``, keepalives; a URL's own values
win) bound a statement whose database host vanished or went silent, which would otherwise hold the server's
event loop, or the flush it waits on, for the kernel's retransmissions (~15 min) or keepalive (~2 h).

A connection the server dropped (a restart, a failover, an administrator) is opened again by the next
transaction, which begins on the new one (nothing of it ran on the old).

The URL's password (user part or ``password`` parameter) is replaced by ``***`` in every message; libpq's
``PGPASSWORD`` and ``~/.pgpass`` keep it off the command line altogether.
"""

import contextlib
import logging
from collections.abc import Iterator
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict

from control_plane.errors import StoreError
from control_plane.store import redact_url, url_passwords
from control_plane.store_sql import Dialect, SqlStore

log = logging.getLogger(__name__)

# Any constant: the advisory lock that keeps replicas starting together from creating the tables at once.
SCHEMA_LOCK_KEY = 0x70697065
POSTGRES = Dialect(param="%s", types={"text": "TEXT", "bytes": "BYTEA", "real": "DOUBLE PRECISION",
                                      "integer": "BIGINT"},
                   lock_row=" FOR UPDATE", schema_lock=f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK_KEY})",
                   tables="SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()",
                   # clock_timestamp(), not now() (the transaction's start): read after any wait for the row's lock
                   now="CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)")
CONNECT_TIMEOUT_S = 10
# The statements run on the server's event loop: a lock held elsewhere must not stall it for long.
LOCK_TIMEOUT_MS = 2000
IDLE_IN_TRANSACTION_MS = 5000
# Longer than any statement takes here (the largest, a plan of thousands of receivers, ~1 s), shorter than
# a stalled leader may go unnoticed for.
STATEMENT_TIMEOUT_MS = 15000
# libpq connection parameters: data unacknowledged for 10 s, or an idle connection silent for 5 + 3 x 2 s,
# and the connection is given up (a URL naming one of them keeps its own).
TCP_PARAMETERS = {"tcp_user_timeout": "10000", "keepalives": "1", "keepalives_idle": "5",
                  "keepalives_interval": "2", "keepalives_count": "3"}


def _secrets(url: str) -> list[str]:
    """The passwords of ``url`` as written and decoded (what must never be shown), longest first."""
    written = url_passwords(url)
    return sorted({form for secret in written if secret for form in (secret, unquote(secret))}, key=len,
                  reverse=True)


class PostgresStore(SqlStore):
    """One PostgreSQL database, shared by the control plane's replicas."""

    dialect = POSTGRES
    remedy = "restore the database from a backup or start on another database"
    elsewhere = "use another database"
    shared = True

    def __init__(self, url: str):
        self._url = url
        self._secrets = _secrets(url)
        where = redact_url(url)
        try:
            db = self._connect()
        except psycopg.Error as exc:
            # from None: the driver's own exception is not chained into tracebacks, it is described here.
            raise StoreError(f"control plane database {where}: {self._describe(exc)}") from None
        super().__init__(where, db, psycopg.Error)

    def _describe(self, exc: Exception) -> str:
        text = " ".join(str(exc).split())
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _configure(self) -> None:
        self._db.execute("SET synchronous_commit TO on")
        self._db.execute(f"SET lock_timeout TO {LOCK_TIMEOUT_MS}")
        self._db.execute(f"SET idle_in_transaction_session_timeout TO {IDLE_IN_TRANSACTION_MS}")
        self._db.execute(f"SET statement_timeout TO {STATEMENT_TIMEOUT_MS}")

    def _connect(self) -> psycopg.Connection:
        named = conninfo_to_dict(self._url)
        return psycopg.connect(self._url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                               **{key: value for key, value in TCP_PARAMETERS.items() if key not in named})

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.push(self._begin().__exit__)
            yield

    def _begin(self) -> psycopg.Transaction:
        """A transaction begun (BEGIN sent), on a new session where the server closed this one while it idled (a
        database restart or failover, a pooler's recycling, pg_terminate_backend): nothing of the transaction ran
        then, so it begins again once. Without that retry the first statement after each such close failed, and
        when it was a lease renewal the leader stepped down with its lease and the database both healthy."""
        if self._db.broken:
            self._reconnect()
        transaction = self._db.transaction()
        try:
            transaction.__enter__()
        except psycopg.OperationalError as exc:
            if not self._db.broken:
                raise
            log.warning("control plane database %s: the server closed the session (%s); opening another",
                        self.where, self._describe(exc))
            self._reconnect()
            transaction = self._db.transaction()
            transaction.__enter__()
        return transaction

    def _reconnect(self) -> None:
        self._db = self._connect()
        self._configure()
