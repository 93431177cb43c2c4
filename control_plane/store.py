"""Where the control plane keeps its state: one interface (:class:`Store`), two backends.

- a SQLite file (:mod:`control_plane.store_sqlite`): one control plane process;
- PostgreSQL (:mod:`control_plane.store_postgres`, extra ``postgres``): several replicas on one database,
  one of which leads.

:func:`open_store` picks the backend from the ``--db`` value (setting ``control_db``): a URL starting with
``postgresql://`` or ``postgres://`` is PostgreSQL, anything else a SQLite path.

Leadership: the database holds one lease (table ``leader``: holder, its advertised address, a fencing
number, expiry). :meth:`Store.acquire_or_renew` takes it atomically when it is free, expired or already
the caller's; a new holder increments the fencing number. The expiry is written and judged by the database's
clock, the one clock every replica shares: a replica whose own clock is ahead (or stepped back) can neither
take a running lease nor keep a lapsed one. The holder stops acting on it by its own monotonic clock instead
(:attr:`Lease.deadline`), read just before the statement is sent, so a renewal that waited (behind a flush's
commit) lasts its full term from when it was sent, and never past the database's expiry. Once a store has
taken the lease, every write transaction first checks, inside the same transaction and holding the lease
row's lock, that the stored fencing number is still its own, and raises :class:`FencedError` otherwise: a
deposed leader's late write is refused whole. A password in a PostgreSQL URL never appears in messages or
logs (:func:`redact_url`).
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from control_plane.deployments import DeploymentBook
from control_plane.errors import StoreError
from control_plane.state import ControlState
from pipecast.core.strictjson import describe

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


@dataclass(frozen=True)
class Lease:
    """The control plane lease as its holder took it: who, where clients reach it, its fencing number
    (grows with every new holder) and its ``deadline``: until when, by the holder's monotonic clock, it may act
    as the leader unless it renews the lease (the database's expiry, by the database's clock, comes no sooner)."""

    holder: str
    address: str
    fencing: int
    deadline: float


class CorruptStateError(StoreError):
    """A row of the control plane's database that does not decode; ``table`` and ``key`` name it."""

    def __init__(self, path: str, table: str, key: object, problem: str, remedy: str) -> None:
        super().__init__(f"control plane database {path}: table {table}, key {describe(key)}: corrupt row "
                         f"({problem}); {remedy}")
        self.path, self.table, self.key, self.problem = path, table, key, problem


class FencedError(StoreError):
    """A write of a control plane that lost the lease: another replica took it since (a higher fencing
    number). Nothing of the write was stored; the caller must stop serving."""

    # Clients retry elsewhere: the leader now is another replica.
    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, holder: str, fencing: int, current: int) -> None:
        super().__init__(f"control plane {holder} was deposed: fencing number {fencing} is no longer the "
                         f"leader's (now {current})")
        self.holder, self.fencing, self.current = holder, fencing, current


class PendingFlush(Protocol):
    """Dirty keys taken from the state with their rows (:meth:`Store.begin_flush`), not written yet."""

    def commit(self) -> None:
        """Write them in one durable transaction, in any thread, and let the store go (raises
        :class:`StoreError`, :class:`FencedError` when deposed)."""

    def restore(self) -> None:
        """After a failed :meth:`commit`, on the state's thread: the keys are dirty again."""


class Store(Protocol):
    """What the server and the service need of a database; both backends pass one conformance suite
    (tests/control_plane/test_store_conformance.py)."""

    #: The database as messages name it (a path, or a URL without its password).
    where: str
    #: Whether several control planes may share the database: then only the lease holder serves and writes.
    shared: bool

    def load(self, state: ControlState, now: float, *, lease_grace_s: float = 0.0) -> None:
        """Fill an empty ``state``; alive workers get a lease plus ``lease_grace_s`` to reconnect in."""

    def load_book(self, book: DeploymentBook) -> None:
        """Fill an empty ``book``: every deployment and route and the latest audit events."""

    def flush(self, state: ControlState) -> int:
        """Write the state's dirty keys in one durable transaction; returns how many. On failure they stay
        dirty and :class:`StoreError` (:class:`FencedError` when deposed) is raised."""

    def flush_book(self, book: DeploymentBook) -> int:
        """Write the book's changes in one durable transaction; returns how many (kept dirty on failure)."""

    def begin_flush(self, state: ControlState | None = None,
                    book: DeploymentBook | None = None, *, wait: bool = True) -> PendingFlush | None:
        """Take the dirty keys of ``state`` and ``book`` for one transaction that may be committed in another
        thread; None if nothing is dirty or, with ``wait`` False, another thread is using the store (the changes
        stay dirty for the next flush). The store is held until the commit: flushes are written in the order
        they were taken."""

    def acquire_or_renew(self, holder: str, address: str, ttl_s: float,
                         monotonic: Callable[[], float]) -> Lease | None:
        """Take the lease for ``ttl_s`` from now by the database's clock if it is free, expired or ``holder``'s
        already (then renewed, same fencing number); None if another holder's lease is still running. The
        lease's deadline is ``monotonic()`` (the holder's monotonic clock), read inside the transaction just before
        the lease is written, plus ``ttl_s``. A lease this store held taken again under a new number (another
        holder had it meanwhile) is returned, but the store's writes stay fenced by the old one (its state is
        stale: the holder steps down) until :meth:`release` ends it."""

    def release(self, holder: str) -> None:
        """End ``holder``'s lease now, if it still holds it, so that a standby takes over at once."""

    def leader(self) -> tuple[str, int]:
        """The lease holder's advertised address and fencing number (``("", 0)``: never taken)."""

    def close(self) -> None:
        """Close the connection."""


def is_postgres_url(target: str | Path) -> bool:
    """Whether a ``--db`` value names a PostgreSQL database (else it is a SQLite path)."""
    return str(target).startswith(POSTGRES_SCHEMES)


def redact_url(url: str) -> str:
    """``url`` with its password, in the user part or a ``password`` parameter, replaced by ``***``."""
    return _redacted(url)[0]


def url_passwords(url: str) -> list[str]:
    """The passwords ``url`` holds (user part, ``password`` parameters), as written: percent-encoded."""
    return _redacted(url)[1]


def _redacted(url: str) -> tuple[str, list[str]]:
    """``url`` with its passwords replaced by ``***``, and those passwords as written. Split as libpq reads it,
    not as urllib does: the user part ends at an '@' before the first '/', whatever it holds ('?' and '#'
    included), and the parameters run from the first '?' after it to the end ('#' included)."""
    from urllib.parse import unquote

    scheme, sep, rest = url.partition("://")
    slash = rest.find("/")
    head = rest if slash < 0 else rest[:slash]
    # The last such '@', where libpq takes the first: an unencoded '@' in a password is not shown either.
    user, at, host = head.rpartition("@")
    name, colon, password = user.partition(":")
    passwords = [password] if colon else []
    user = f"{name}:***" if colon else user
    where, question, query = (host + rest[len(head):]).partition("?")
    params = []
    for param in query.split("&"):
        key, equals, value = param.partition("=")
        if equals and unquote(key) == "password":
            passwords.append(value)
            param = f"{key}=***"
        params.append(param)
    return f"{scheme}{sep}{user}{at}{where}{question}{'&'.join(params)}", passwords


#: A ``--db`` value that is neither a PostgreSQL URL of the schemes above nor a path: another scheme, one in other
#: letters or after a space, a libpq keyword string (``host=... password=...``). As a path it became a SQLite file
#: of that name (a password in a file name, each replica leading a database of its own).
_NOT_A_PATH = re.compile(r"^\s|://|^[a-z_]+=\S*(\s|$)", re.IGNORECASE)


def open_store(target: str | Path) -> Store:
    """The store ``target`` names: a PostgreSQL URL or a SQLite path (see the module docstring); raises
    :class:`StoreError` for a value that is neither."""
    if not is_postgres_url(target) and isinstance(target, str) and _NOT_A_PATH.search(target):
        shown = re.sub(r"(password=)[^\s&]*", r"\1***", redact_url(target), flags=re.IGNORECASE)
        raise StoreError(f"control plane database {shown!r}: neither a URL starting postgresql:// or "
                         "postgres:// (in lower case) nor a SQLite path; give a PostgreSQL URL, as "
                         "postgresql://USER:PASSWORD@HOST:PORT/DATABASE")
    if is_postgres_url(target):
        try:
            from control_plane.store_postgres import PostgresStore
        except ImportError as exc:
            raise StoreError(f"control plane database {redact_url(str(target))}: PostgreSQL needs psycopg "
                             f"(pip install 'pipecast[postgres]'): {exc}") from None
        return PostgresStore(str(target))
    from control_plane.store_sqlite import SqliteStore

    return SqliteStore(target, exclusive=True)
