"""The control plane's SQLite file: acknowledged writes are durable, and a damaged row stops the start-up
with a typed error naming its table and key (issue #12, finding 7)."""

import logging
import re
import sqlite3

import pytest

from control_plane.errors import StoreError
from control_plane.messages import PeerInfo, WorkerSpec
from control_plane.state import ControlState
from control_plane.store import CorruptStateError, open_store
from control_plane.store_sqlite import SqliteStore
from pipecast.v1.manifest_pb2 import Block, Manifest

STORE = PeerInfo("store", "10.0.0.1:7070", ("tcp",))


@pytest.fixture
def saved(tmp_path):
    """A database holding two packages, two workers, availability, a release and a plan."""
    path = tmp_path / "control.sqlite3"
    state = ControlState(lease_s=10.0)
    for package_id in ("pkg", "other"):
        state.publish(Manifest(package_id=package_id, blocks=[Block(index=i, bytes=100) for i in range(4)]),
                      STORE, now=0)
    for node in ("w0", "w1"):
        state.register(WorkerSpec(PeerInfo(node, f"{node}.local:7070", ("tcp",)), 10_000), {}, now=0)
    state.report("w0", {"pkg": range(4), "other": [0]}, {}, now=1)
    state.scale_up("pkg", node_ids=["w1"], now=1)
    state.release("other", ["w0"], keep_alive_s=60, now=2)
    store = SqliteStore(path)
    store.flush(state)
    store.close()
    return path


def load(path) -> ControlState:
    state = ControlState(lease_s=10.0)
    store = SqliteStore(path)
    try:
        store.load(state, now=100)
    finally:
        store.close()
    return state


def corrupt(path, sql: str, *args) -> None:
    db = sqlite3.connect(path)
    with db:
        assert db.execute(sql, args).rowcount == 1
    db.close()


def test_every_commit_is_synced():
    """Finding 7: synchronous=NORMAL in WAL mode could lose acknowledged plans on a power loss."""
    store = SqliteStore(":memory:")
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    store.close()


def test_an_intact_file_loads(saved):
    state = load(saved)
    assert set(state.packages) == {"pkg", "other"} and set(state.workers) == {"w0", "w1"}
    assert state.availability["pkg"].held("w0") == frozenset(range(4)) and len(state.plans) == 1


@pytest.mark.parametrize("sql, args, table, key", [
    ("UPDATE packages SET manifest = ? WHERE package_id = 'pkg'", b"\xff\xff\xff\xff", "packages", "'pkg'"),
    ("UPDATE packages SET manifest = ? WHERE package_id = 'pkg'",
     Manifest(package_id="someone-else").SerializeToString(), "packages", "'pkg'"),
    ("UPDATE packages SET store = ? WHERE package_id = 'other'", '{"node_id": "s"}', "packages", "'other'"),
    ("UPDATE packages SET published_at = ? WHERE package_id = 'pkg'", "yesterday", "packages", "'pkg'"),
    ("UPDATE workers SET spec = ? WHERE node_id = 'w1'", "[" * 100_000, "workers", "'w1'"),
    ("UPDATE workers SET spec = ? WHERE node_id = 'w1'", '{"node_id": "w1"}', "workers", "'w1'"),
    ("UPDATE availability SET blocks = ? WHERE package_id = 'pkg'", "[0, 99]", "availability", "('pkg', 'w0')"),
    ("UPDATE availability SET blocks = ? WHERE package_id = 'pkg'", "[0, 1e400]", "availability", "('pkg', 'w0')"),
    ("UPDATE releases SET drop_at = ? WHERE node_id = 'w0'", "soon", "releases", "('other', 'w0')"),
])
def test_a_corrupt_row_is_a_typed_error_naming_table_and_key(saved, sql, args, table, key):
    """Finding 7: an undecodable manifest blob raised protobuf's DecodeError (a JSON one ValueError or
    RecursionError) out of the start-up; now CorruptStateError names the table and the key."""
    corrupt(saved, sql, args)
    with pytest.raises(CorruptStateError) as info:
        load(saved)
    error = info.value
    assert isinstance(error, StoreError) and error.table == table
    assert f"table {table}, key {key}: corrupt row" in str(error) and str(saved) in str(error)


def test_an_undecodable_plan_is_skipped_with_a_warning(saved, caplog):
    corrupt(saved, "UPDATE plans SET plan = ?", '{"strategy": "x", "strategy": "y"}')
    with caplog.at_level(logging.WARNING):
        state = load(saved)
    assert state.plans == {} and "skipped stored plan" in caplog.text and "duplicate key" in caplog.text


def test_a_file_from_before_the_lease_opens_and_gains_its_table(saved):
    db = sqlite3.connect(saved)
    with db:
        db.execute("DROP TABLE leader")  # as pipecast wrote files before issue #17
    db.close()
    state = load(saved)
    assert set(state.packages) == {"pkg", "other"}
    store = SqliteStore(saved)
    assert store.leader() == ("", 0) and store.acquire_or_renew("cp", "cp:7000", 10, monotonic=lambda: 0).fencing == 1
    store.close()


def test_a_second_control_plane_on_one_sqlite_file_is_refused_while_the_first_runs(tmp_path):
    """Found in review: two processes on one file both led from the start, each serving a state of its own and
    writing into the same tables."""

    path = tmp_path / "cp.sqlite3"
    first = open_store(path)
    try:
        with pytest.raises(StoreError, match=rf"^control plane database {path} is in use by another control plane "
                                             rf"process \(it holds {path}.lock\): one SQLite file serves one "
                                             "process; use another path, or PostgreSQL for replicas$"):
            open_store(path)
        alias = tmp_path / "alias.sqlite3"
        alias.symlink_to(path)  # found in review: a link to the file named another lock file
        with pytest.raises(StoreError, match=rf"^control plane database {alias} is in use by another control "
                                             rf"plane process \(it holds {path}.lock\)"):
            open_store(alias)
    finally:
        first.close()
    open_store(path).close()  # free again once the first one is closed


def test_a_control_plane_that_fails_to_load_lets_go_of_its_file(saved):
    """Found in review: a start-up whose load failed kept the store open and its lock held: started again in the
    same process (an embedding, a test) once the file was mended, it was "in use by another control plane"."""
    from control_plane.server import ControlPlaneServer
    from tests.control_plane.test_service import config

    corrupt(saved, "UPDATE packages SET published_at = ? WHERE package_id = 'pkg'", "yesterday")
    with pytest.raises(CorruptStateError):
        ControlPlaneServer(config(saved))
    corrupt(saved, "DELETE FROM packages WHERE package_id = 'pkg'")
    ControlPlaneServer(config(saved)).store.close()


@pytest.mark.parametrize("target, shown", [
    ("host=127.0.0.1 port=1 password=hunter2pass", "host=127.0.0.1 port=1 password=***"),
    ("POSTGRESQL://cp:hunter2pass@db/cp", "POSTGRESQL://cp:***@db/cp"),
    (" postgresql://cp@db/cp", " postgresql://cp@db/cp"),
    ("mysql://db/cp", "mysql://db/cp"),
])
def test_a_database_value_that_is_neither_a_postgresql_url_nor_a_path_is_refused(target, shown, tmp_path,
                                                                                 monkeypatch):
    """Found in review: each opened a SQLite file of that name in the working directory (a libpq keyword string
    with its password in the file name; replicas so configured each led a database of their own)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match=re.escape(f"control plane database {shown!r}: neither a URL starting "
                                                   "postgresql:// or postgres:// (in lower case) nor a SQLite path")):
        open_store(target)
    assert list(tmp_path.iterdir()) == []
