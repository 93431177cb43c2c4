"""What only the PostgreSQL backend has: its selection by the URL's scheme, durable commits, and a password
that never shows in a message (the shared behaviour is tests/control_plane/test_store_conformance.py)."""

import sys

import pytest

from control_plane.errors import StoreError
from control_plane.store import is_postgres_url, open_store, redact_url
from control_plane.store_postgres import TCP_PARAMETERS
from control_plane.store_sqlite import SqliteStore
from tests.support.agent_processes import free_ports
from tests.support.postgres import DB_PASSWORD


@pytest.mark.parametrize("target, postgres", [
    ("postgresql://u:p@db:5432/cp", True), ("postgres://db/cp", True), ("/var/lib/pipecast/cp.sqlite3", False),
    ("postgresql.sqlite3", False), (":memory:", False)])
def test_the_scheme_picks_the_backend(target, postgres):
    assert is_postgres_url(target) is postgres


def test_a_path_opens_sqlite(tmp_path):
    store = open_store(tmp_path / "cp.sqlite3")
    assert isinstance(store, SqliteStore) and not store.shared
    store.close()


@pytest.mark.parametrize("url, shown", [
    ("postgresql://cp:s3cret@db:5432/control", "postgresql://cp:***@db:5432/control"),
    ("postgresql://cp@db/control", "postgresql://cp@db/control"),
    ("postgres://db/control?sslmode=require&password=s3cret", "postgres://db/control?sslmode=require&password=***"),
    ("postgresql://cp:s3c?ret@db:5432/control", "postgresql://cp:***@db:5432/control"),
    ("postgresql://cp:s3c#ret@db/control?sslmode=require", "postgresql://cp:***@db/control?sslmode=require"),
    ("postgresql://cp:s3c@ret@db/control", "postgresql://cp:***@db/control"),
    ("postgresql://cp:s3cret@db?password=x", "postgresql://cp:***@db?password=***"),
    ("postgres://db/control?password=s3c#ret&sslmode=require", "postgres://db/control?password=***&sslmode=require"),
])
def test_a_urls_password_is_redacted(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", [
    "postgresql://cp:Tops?Tail@db:5432/control", "postgresql://cp:Tops#Tail@db:5432/control?sslmode=require",
    "postgresql://cp:Tops%3FTail@db/control", "postgres://db/control?password=Tops#Tail&sslmode=require"])
def test_a_password_holding_what_urllib_splits_at_is_never_shown(monkeypatch, url):
    """libpq reads the user part up to an '@' before the first '/' and the parameters to the end, '?' and '#'
    included: split as urllib splits, such a password was shown in the startup line and every StoreError."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    from control_plane import store_postgres

    password = conninfo_to_dict(url)["password"]
    assert password in ("Tops?Tail", "Tops#Tail")  # what libpq sends

    def refuse(conninfo, **options):  # as a driver echoing the password would
        raise psycopg.OperationalError(f"connection refused for {conninfo} (password {password})")

    monkeypatch.setattr(store_postgres.psycopg, "connect", refuse)
    with pytest.raises(StoreError) as info:
        open_store(url)
    message = str(info.value)
    assert "Tops" not in message and "Tail" not in message
    assert message.startswith(f"control plane database {redact_url(url)}: ")


def test_without_psycopg_a_postgres_url_is_a_store_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg raises ImportError
    monkeypatch.delitem(sys.modules, "control_plane.store_postgres", raising=False)
    with pytest.raises(StoreError, match=r"control plane database postgresql://cp:\*\*\*@db/control: PostgreSQL "
                                         r"needs psycopg \(pip install 'pipecast\[postgres\]'\)"):
        open_store("postgresql://cp:s3cret@db/control")


def test_every_commit_waits_for_its_wal_and_the_password_is_never_shown(postgres_server):
    url = postgres_server.database()
    store = open_store(url)
    try:
        assert store.shared and DB_PASSWORD not in store.where and "***" in store.where
        assert store._db.execute("SHOW synchronous_commit").fetchone() == ("on",)
    finally:
        store.close()


def test_a_statement_or_a_silent_database_host_cannot_hold_the_control_plane_for_long(postgres_server):
    url = postgres_server.database()
    store = open_store(url)
    try:
        assert store._db.execute("SHOW statement_timeout").fetchone() == ("15s",)
        assert store._db.info.get_parameters().items() >= TCP_PARAMETERS.items()
    finally:
        store.close()
    own = open_store(url + ("&" if "?" in url else "?") + "keepalives_idle=30")  # the URL's own value wins
    try:
        assert own._db.info.get_parameters()["keepalives_idle"] == "30"
    finally:
        own.close()


def test_a_wrong_password_or_no_server_is_a_store_error_without_the_password(postgres_server):
    wrong = postgres_server.url("postgres").replace(DB_PASSWORD, "not-the-password")
    with pytest.raises(StoreError) as info:
        open_store(wrong)
    message = str(info.value)
    assert message.startswith(f"control plane database {redact_url(wrong)}: ") and "not-the-password" not in message
    assert "password authentication failed" in message
    nobody = f"postgresql://cp:{DB_PASSWORD}@127.0.0.1:{free_ports(1)[0]}/control"
    with pytest.raises(StoreError, match="Connection refused") as info:
        open_store(nobody)
    assert DB_PASSWORD not in str(info.value) and info.value.__cause__ is None


def test_without_postgresql_its_tests_skip_unless_required(monkeypatch):
    from tests.support import postgres

    monkeypatch.setattr(postgres, "find_binaries", lambda: None)
    monkeypatch.delenv(postgres.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no initdb on PATH or in /usr/lib/postgresql"):
        postgres.start_server()
    monkeypatch.setenv(postgres.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=r"PostgreSQL is required \(PIPECAST_REQUIRE_POSTGRES=1\) but no "):
        postgres.start_server()


def test_a_connection_the_server_dropped_is_opened_again_by_the_next_call_which_then_runs(postgres_server, caplog):
    """Found in review: the first call after the server closed the session failed (a new one was opened only by the
    call after it), and when that was a lease renewal the leader stepped down, the database healthy."""
    import psycopg

    url = postgres_server.database()
    store = open_store(url)
    try:
        assert store.acquire_or_renew("a", "a:7000", 10, monotonic=lambda: 0).fencing == 1
        with psycopg.connect(url, autocommit=True) as admin:  # as a server restart or failover would
            admin.execute("SELECT pg_terminate_backend(%s)", (store._db.info.backend_pid,))
        assert store.acquire_or_renew("a", "a:7000", 10, monotonic=lambda: 1).fencing == 1  # renewed, not failed
        assert "the server closed the session" in caplog.text and DB_PASSWORD not in caplog.text
        assert store.leader() == ("a:7000", 1)
        assert store._db.execute("SHOW synchronous_commit").fetchone() == ("on",)  # set up again
    finally:
        store.close()
