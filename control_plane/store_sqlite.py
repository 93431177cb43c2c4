"""The control plane's state in SQLite: packages, workers, availability, releases, active plans, and the
deployments with the scaling daemon's audit trail (:class:`~control_plane.deployments.DeploymentBook`).

Writes are incremental: :meth:`SqliteStore.flush` writes exactly the keys in the state's dirty set,
in one transaction. Leases are not stored: after a restart every worker that was alive gets one fresh
lease to heartbeat (or re-register) in, so availability converges from what the agents report.

Durability: the service answers an RPC (a published package, a plan) only after its flush, so the flush
must survive a power loss: ``synchronous=FULL`` syncs the WAL at every commit. Reading: a row that does
not decode (a damaged file, a hand edit) stops the start-up with :class:`CorruptStateError` naming the
table and the key, except an undecodable plan, which is skipped with a warning (plans are re-made).
"""

import json
import logging
import math
import sqlite3
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from control_plane.deployments import EVENTS_IN_MEMORY, Deployment, DeploymentBook, ScaleEvent
from control_plane.routes import ModelRoute
from control_plane.errors import StoreError
from control_plane.messages import PeerInfo, WorkerSpec
from control_plane.planner.plan import Plan, PlanError
from control_plane.state import ControlState, Dirty
from pipecast.core.strictjson import JSONInputError, describe, loads
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
CREATE TABLE IF NOT EXISTS deployments (package_id TEXT PRIMARY KEY, deployment TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS scale_events (seq INTEGER PRIMARY KEY, package_id TEXT NOT NULL, event TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS routes (name TEXT PRIMARY KEY, route TEXT NOT NULL);
"""


def _compact(data: object) -> str:
    return json.dumps(data, separators=(",", ":"))


class CorruptStateError(StoreError):
    """A row of the control plane's database that does not decode; ``table`` and ``key`` name it."""

    def __init__(self, path: str, table: str, key: object, problem: str) -> None:
        super().__init__(f"control plane database {path}: table {table}, key {describe(key)}: corrupt row "
                         f"({problem}); restore the file from a backup or start on another path")
        self.path, self.table, self.key, self.problem = path, table, key, problem


# What decoding a damaged row can raise: the JSON, the protobuf, and the checks below.
_DECODE_ERRORS = (JSONInputError, DecodeError, KeyError, TypeError, ValueError, AttributeError, IndexError)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} {describe(value)} is not a finite number")
    return value


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} {describe(value)} is not an integer")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} {describe(value)} is not text")
    return value


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
        # An acknowledged write survives a crash or a power loss (module docstring).
        self._db.execute("PRAGMA synchronous=FULL")
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
        for package_id, manifest_bytes, store, published_at in self._db.execute("SELECT * FROM packages"):
            try:
                manifest = Manifest.FromString(manifest_bytes)
                if manifest.package_id != package_id:
                    raise ValueError(f"the manifest is that of package {describe(manifest.package_id)}")
                peer = loads(store)
                origin = PeerInfo(_text(peer["node_id"], "node id"), _text(peer["address"], "address"),
                                  tuple(_text(t, "transport") for t in peer["transports"]))
                published_at = _number(published_at, "published_at")
            except _DECODE_ERRORS as exc:
                raise CorruptStateError(self.path, "packages", package_id, _problem(exc)) from None
            state.restore_package(manifest, origin, published_at)
        for node, spec, alive in self._db.execute("SELECT * FROM workers"):
            try:
                worker = WorkerSpec.from_json(loads(spec))
                if worker.node_id != node:
                    raise ValueError(f"the spec is that of worker {describe(worker.node_id)}")
                alive = _integer(alive, "alive")
            except _DECODE_ERRORS as exc:
                raise CorruptStateError(self.path, "workers", node, _problem(exc)) from None
            state.restore_worker(worker, bool(alive), now, lease_grace_s)
        for package_id, node, blocks in self._db.execute("SELECT * FROM availability"):
            worker = state.workers.get(node)
            if package_id in state.packages and worker is not None and worker.alive:
                num_blocks = len(state.packages[package_id].manifest.blocks)
                try:
                    held = loads(blocks)
                    if not isinstance(held, list) or not all(
                            _integer(b, "block") in range(num_blocks) for b in held):
                        raise ValueError(f"blocks {describe(held)} are not a list of blocks 0..{num_blocks - 1}")
                except _DECODE_ERRORS as exc:
                    raise CorruptStateError(self.path, "availability", (package_id, node), _problem(exc)) from None
                state.restore_availability(package_id, node, held)
        for package_id, node, drop_at in self._db.execute("SELECT * FROM releases"):
            if package_id in state.packages and node in state.workers:
                try:
                    drop_at = _number(drop_at, "drop_at")
                except ValueError as exc:
                    raise CorruptStateError(self.path, "releases", (package_id, node), _problem(exc)) from None
                state.restore_release(package_id, node, drop_at)
        for plan_id, package_id, plan, fanout, created_at, version, replans in self._db.execute("SELECT * FROM plans"):
            if package_id not in state.packages:
                continue
            try:
                parsed = Plan.from_json(loads(plan))
                numbers = (_integer(fanout, "fanout"), _number(created_at, "created_at"),
                           _integer(version, "version"), _integer(replans, "replans"))
            except (PlanError, *_DECODE_ERRORS) as exc:
                log.warning("skipped stored plan=%s package=%s: %s", plan_id, package_id, _problem(exc))
                continue
            fanout, created_at, version, replans = numbers
            state.restore_plan(plan_id, package_id, parsed, fanout=fanout, created_at=created_at,
                               version=version, replans=replans)

    def load_book(self, book: DeploymentBook) -> None:
        """Fill an empty ``book``: every deployment and route and the latest audit events."""
        try:
            deployments = []
            for package_id, text in self._db.execute("SELECT * FROM deployments"):
                try:
                    deployments.append(Deployment.from_json(loads(text)))
                except _DECODE_ERRORS as exc:
                    raise CorruptStateError(self.path, "deployments", package_id, _problem(exc)) from None
            events = []
            rows = self._db.execute("SELECT seq, event FROM scale_events ORDER BY seq DESC LIMIT ?",
                                    (EVENTS_IN_MEMORY,))
            for seq, text in reversed(rows.fetchall()):
                try:
                    events.append(ScaleEvent.from_json(loads(text)))
                except _DECODE_ERRORS as exc:
                    raise CorruptStateError(self.path, "scale_events", seq, _problem(exc)) from None
            routes = []
            for name, text in self._db.execute("SELECT name, route FROM routes"):
                try:
                    routes.append(ModelRoute.from_json(loads(text)))
                except _DECODE_ERRORS as exc:
                    raise CorruptStateError(self.path, "routes", name, _problem(exc)) from None
        except sqlite3.Error as exc:
            raise StoreError(f"control plane database {self.path}: cannot read: {exc}") from exc
        book.restore(deployments, events, routes)

    def flush_book(self, book: DeploymentBook) -> int:
        """Write the book's changed deployments and routes and its new events in one transaction (kept dirty
        on failure)."""
        dirty, events, routes = book.dirty_deployments, book.new_events, book.dirty_routes
        if not dirty and not events and not routes:
            return 0
        book.dirty_deployments, book.new_events, book.dirty_routes = set(), [], set()
        try:
            with self._db:
                for package_id in dirty:
                    deployment = book.deployments.get(package_id)
                    if deployment is None:
                        self._db.execute("DELETE FROM deployments WHERE package_id = ?", (package_id,))
                    else:
                        self._db.execute("INSERT OR REPLACE INTO deployments VALUES (?, ?)",
                                         (package_id, _compact(deployment.to_json())))
                for name in routes:
                    route = book.routes.get(name)
                    if route is None:
                        self._db.execute("DELETE FROM routes WHERE name = ?", (name,))
                    else:
                        self._db.execute("INSERT OR REPLACE INTO routes VALUES (?, ?)", (name, _compact(route.to_json())))
                self._db.executemany("INSERT INTO scale_events VALUES (?, ?, ?)",
                                     [(e.seq, e.package_id, _compact(e.to_json())) for e in events])
        except sqlite3.Error as exc:
            book.dirty_deployments |= dirty
            book.dirty_routes |= routes
            book.new_events[:0] = events
            raise StoreError(f"control plane database {self.path}: cannot write: {exc}") from exc
        return len(dirty) + len(events) + len(routes)

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


def _problem(exc: BaseException) -> str:
    """What is wrong with a row, from the exception decoding it raised."""
    if isinstance(exc, KeyError):
        return f"missing field {exc}"
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
