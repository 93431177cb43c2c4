"""The control plane's state in SQLite: packages, workers, availability, releases and active plans.

Writes are incremental: :meth:`SqliteStore.flush` writes exactly the keys in the state's dirty set,
in one transaction. Leases are not stored: after a restart every worker that was alive gets one fresh
lease to heartbeat (or re-register) in, so availability converges from what the agents report.
"""

import json
import logging
import sqlite3
from pathlib import Path

from control_plane.errors import StoreError
from control_plane.messages import PeerInfo, WorkerSpec
from control_plane.planner.plan import Plan, PlanError
from control_plane.state import ControlState, Dirty
from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS packages (
  package_id TEXT PRIMARY KEY, manifest BLOB NOT NULL, store TEXT NOT NULL, published_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS workers (node_id TEXT PRIMARY KEY, spec TEXT NOT NULL, alive INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS availability (
  package_id TEXT NOT NULL, node_id TEXT NOT NULL, blocks TEXT NOT NULL, PRIMARY KEY (package_id, node_id));
CREATE TABLE IF NOT EXISTS releases (
  package_id TEXT NOT NULL, node_id TEXT NOT NULL, drop_at REAL NOT NULL, PRIMARY KEY (package_id, node_id));
CREATE TABLE IF NOT EXISTS plans (
  plan_id TEXT PRIMARY KEY, package_id TEXT NOT NULL, plan TEXT NOT NULL, fanout INTEGER NOT NULL,
  created_at REAL NOT NULL, version INTEGER NOT NULL, replans INTEGER NOT NULL);
"""


def _compact(data: object) -> str:
    return json.dumps(data, separators=(",", ":"))


class SqliteStore:
    """One SQLite file (or ":memory:") holding the control plane's state between restarts."""

    def __init__(self, path: Path | str):
        self.path = str(path)
        try:
            self._db = sqlite3.connect(self.path)
        except sqlite3.Error as exc:
            raise StoreError(f"control plane database {self.path}: {exc}") from exc
        try:
            version = self._prepare()
        except sqlite3.Error as exc:
            self._db.close()
            raise StoreError(f"control plane database {self.path}: {exc}") from exc
        if version != str(SCHEMA_VERSION):
            self._db.close()
            raise StoreError(f"control plane database {self.path} has schema version {version}, this "
                             f"version of pipecast reads {SCHEMA_VERSION}: use another path")

    def _prepare(self) -> str:
        """Set the connection up and create missing tables; returns the file's schema version."""
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        # A crash may lose the last transaction, never corrupt the file; agents re-report anyway.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is not None:
            return row[0]
        with self._db:
            self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        return str(SCHEMA_VERSION)

    def close(self) -> None:
        self._db.close()

    def load(self, state: ControlState, now: float, *, lease_grace_s: float = 0.0) -> None:
        """Fill an empty ``state`` from the database; alive workers get a lease plus ``lease_grace_s`` to
        reconnect in."""
        try:
            self._load(state, now, lease_grace_s)
        except sqlite3.Error as exc:
            raise StoreError(f"control plane database {self.path}: cannot read: {exc}") from exc
        log.info("loaded state path=%s packages=%d workers=%d plans=%d", self.path, len(state.packages),
                 len(state.workers), len(state.plans))

    def _load(self, state: ControlState, now: float, lease_grace_s: float) -> None:
        for _, manifest_bytes, store, published_at in self._db.execute("SELECT * FROM packages"):
            manifest = Manifest.FromString(manifest_bytes)
            peer = json.loads(store)
            state.restore_package(manifest, PeerInfo(peer["node_id"], peer["address"], tuple(peer["transports"])),
                                  published_at)
        for _, spec, alive in self._db.execute("SELECT * FROM workers"):
            state.restore_worker(WorkerSpec.from_json(json.loads(spec)), bool(alive), now, lease_grace_s)
        for package_id, node, blocks in self._db.execute("SELECT * FROM availability"):
            worker = state.workers.get(node)
            if package_id in state.packages and worker is not None and worker.alive:
                state.restore_availability(package_id, node, json.loads(blocks))
        for package_id, node, drop_at in self._db.execute("SELECT * FROM releases"):
            if package_id in state.packages and node in state.workers:
                state.restore_release(package_id, node, drop_at)
        for plan_id, package_id, plan, fanout, created_at, version, replans in self._db.execute("SELECT * FROM plans"):
            if package_id not in state.packages:
                continue
            try:
                parsed = Plan.from_json(json.loads(plan))
            except (PlanError, ValueError) as exc:
                log.warning("skipped stored plan=%s package=%s: %s", plan_id, package_id, exc)
                continue
            state.restore_plan(plan_id, package_id, parsed, fanout=fanout, created_at=created_at,
                               version=version, replans=replans)

    def flush(self, state: ControlState) -> int:
        """Write every dirty key of ``state`` in one transaction; returns the number of keys written.
        On failure the keys stay dirty (the next flush retries them) and :class:`StoreError` is raised."""
        dirty, state.dirty = state.dirty, Dirty()
        if not dirty:
            return 0
        try:
            with self._db:
                self._write(state, dirty)
        except sqlite3.Error as exc:
            state.dirty.merge(dirty)
            raise StoreError(f"control plane database {self.path}: cannot write: {exc}") from exc
        return len(dirty)

    def _write(self, state: ControlState, dirty: Dirty) -> None:
        db = self._db
        for package_id in dirty.packages:
            package = state.packages.get(package_id)
            if package is None:
                db.execute("DELETE FROM packages WHERE package_id = ?", (package_id,))
            else:
                store = {"node_id": package.store.node_id, "address": package.store.address,
                         "transports": list(package.store.transports)}
                db.execute("INSERT OR REPLACE INTO packages VALUES (?, ?, ?, ?)",
                           (package_id, package.manifest.SerializeToString(), _compact(store), package.published_at))
        for node in dirty.workers:
            worker = state.workers.get(node)
            if worker is None:
                db.execute("DELETE FROM workers WHERE node_id = ?", (node,))
            else:
                db.execute("INSERT OR REPLACE INTO workers VALUES (?, ?, ?)",
                           (node, _compact(worker.spec.to_json()), int(worker.alive)))
        upserts, deletes = [], []
        for package_id, node in dirty.availability:
            availability = state.availability.get(package_id)
            held = availability.by_worker.get(node) if availability is not None else None
            if held:
                upserts.append((package_id, node, _compact(sorted(held))))
            else:
                deletes.append((package_id, node))
        db.executemany("INSERT OR REPLACE INTO availability VALUES (?, ?, ?)", upserts)
        db.executemany("DELETE FROM availability WHERE package_id = ? AND node_id = ?", deletes)
        for key in dirty.releases:
            drop_at = state.releases.get(key)
            if drop_at is None:
                db.execute("DELETE FROM releases WHERE package_id = ? AND node_id = ?", key)
            else:
                db.execute("INSERT OR REPLACE INTO releases VALUES (?, ?, ?)", (*key, drop_at))
        for plan_id in dirty.plans:
            active = state.plans.get(plan_id)
            if active is None:
                db.execute("DELETE FROM plans WHERE plan_id = ?", (plan_id,))
            else:
                db.execute("INSERT OR REPLACE INTO plans VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (plan_id, active.package_id, _compact(active.plan.to_json()), active.fanout,
                            active.created_at, active.version, active.replans))
