"""The control plane's in-memory model: workers and leases, packages, the two availability maps per
package (:mod:`control_plane.availability`), releases with keep-alive, and active multicast plans.

Pure and synchronous: no sockets, no files, no clock (every call that depends on time takes ``now``,
in seconds). What agents must be told goes to :attr:`ControlState.notices` (the service drains it into
the assignment streams); what changed goes to :attr:`ControlState.dirty` (the store drains it into
SQLite or PostgreSQL). Which workers a scale-up takes and which nodes it sends from is decided by
:mod:`control_plane.placement`; plans come from the pure planner (:mod:`control_plane.planner`).
"""

from __future__ import annotations

import functools
import logging
import math
import uuid
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from control_plane.availability import Availability
from control_plane.deployments import MAX_DURATION_S
from control_plane.errors import (
    Conflict, DraftStale, InsufficientWorkers, InvalidRequest, NodeIdInUse, NoSource, Unauthenticated,
    UnknownPackage, UnknownWorker)
from control_plane.messages import PeerInfo, UpdateKind, WorkerSpec, serve_url_of
from control_plane.pipeline_forming import PipelineQuery
from control_plane.placement import (
    DEFAULT_FANOUT, MAX_PLAN_SOURCES, Candidate, counted_targets, default_strategy, named_targets, pick_sources,
    plan_relay_piece, relay_piece)
from control_plane.planner.pipelines import ModelLayout, Pipeline
from control_plane.planner.plan import STRATEGIES, Fetch, Part, Plan, PlanError
from control_plane.planner.racks import RACK_LABEL
from control_plane.planner.replan import INLINE_REPLAN_MAX_RECEIVERS, drop_held, parts_of, repair, reroute
from control_plane.planner.schedules import InFlight, make_plan
from control_plane.planner.stragglers import (
    Sample, StragglerPolicy, chain_pairs, demote, find_stragglers, follow, pair_verdict, receive_rate)
from pipecast.core.credentials import CredentialError, validate_node_id
from pipecast.core.engines import DEFAULT_ENGINE
from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)

# Progress samples kept per receiver: at the agents' default 0.1 s, several windows' worth.
PROGRESS_SAMPLES = 32
#: The most of a bad-peer report's reason kept (logged): the rest of a long one is cut off.
MAX_REASON_CHARS = 1024
#: The most characters a registration may describe its worker in (address, transports, labels, accelerator, serve
#: URL, engine) and the most labels: every listing of the workers carries them, and a few nodes registering
#: megabytes would push ListWorkers past gRPC's message limit for every router and scaler.
MAX_SPEC_CHARS = 4096
MAX_LABELS = 64


@dataclass
class Worker:
    """A registered worker; ``alive`` turns False when its lease lapses (the record stays a while). ``restored``:
    known from the store only, since a restart or a takeover; it must register again before its heartbeats and
    reports count (the reports the last control plane acknowledged may not have been written)."""

    spec: WorkerSpec
    lease_expires: float
    alive: bool = True
    restored: bool = False


@dataclass
class Package:
    """A published package: its manifest and the store node that serves every block."""

    manifest: Manifest
    store: PeerInfo
    published_at: float

    @property
    def package_id(self) -> str:
        return self.manifest.package_id

    @property
    def num_blocks(self) -> int:
        return len(self.manifest.blocks)

    @functools.cached_property
    def total_bytes(self) -> int:
        return sum(block.bytes for block in self.manifest.blocks)

    @functools.cached_property
    def block_bytes(self) -> tuple[int, ...]:
        """Each block's size, by index: rotated plans rotate by bytes."""
        return tuple(block.bytes for block in self.manifest.blocks)

    @functools.cached_property
    def chunk_counts(self) -> tuple[int, ...]:
        """Each block's chunks, by index: a binomial plan's units are ranges of them."""
        return tuple(len(block.chunk_digests) for block in self.manifest.blocks)

    @functools.cached_property
    def relay_piece(self) -> int:
        """What a chain's hop waits for of its largest chunk before passing it on, with the agents' default
        relay (:func:`~control_plane.placement.relay_piece`)."""
        return relay_piece(max((block.chunk_bytes for block in self.manifest.blocks), default=0))

    @functools.cached_property
    def layout(self) -> ModelLayout | None:
        """What the pipeline former needs of the package; None if its blocks hold no decoder layers."""
        if not any(b.layer_end > b.layer_start for b in self.manifest.blocks):
            return None
        return ModelLayout.from_manifest(self.manifest)


@dataclass
class ActivePlan:
    """A scale-up in progress. ``pending``: receivers still missing blocks; the plan ends when none are."""

    plan_id: str
    package_id: str
    plan: Plan
    fanout: int
    created_at: float
    version: int = 1
    replans: int = 0
    pending: set[str] = field(default_factory=set)
    parts: dict[str, Part] = field(default_factory=dict)
    demoted: set[str] = field(default_factory=set)  # receivers found straggling and moved aside (judged once)
    limits: set[str] = field(default_factory=set)  # sources, holders a straggler was demoted under (find_stragglers)
    suspects: set[str] = field(default_factory=set)  # receiving relays a straggler was demoted under (likewise)
    # A slow child -> the chain relay demoted beside it, until one of them is found the slow one (chain_pairs).
    pairs: dict[str, str] = field(default_factory=dict)
    healthy: set[str] = field(default_factory=set)  # of the demoted, those a pair's verdict cleared
    checked_at: float = float("-inf")  # when it was last looked at for stragglers
    # Re-planned since it was last looked at, and until when its receivers' rates are not judged: the first window
    # after a change is a transition (relays re-connect and resume), not a rate.
    changed: bool = False
    settle_until: float | None = None
    # The relay piece its receivers are asked for (ControlState._set_relay_caps; 0: the agents' own), set whenever a
    # plan of its package starts or is re-planned.
    relay_bytes: int = 0


@dataclass(frozen=True)
class Notice:
    """Something to tell a worker on its stream (ASSIGN and CANCEL name a plan, DROP only a package)."""

    node_id: str
    kind: UpdateKind
    package_id: str
    plan_id: str = ""


@dataclass
class Dirty:
    """Keys changed since the store's last flush; a key no longer in the state means: delete it."""

    packages: set[str] = field(default_factory=set)
    workers: set[str] = field(default_factory=set)
    availability: set[tuple[str, str]] = field(default_factory=set)  # (package id, node id)
    plans: set[str] = field(default_factory=set)
    releases: set[tuple[str, str]] = field(default_factory=set)  # (package id, node id)
    drops: set[tuple[str, str]] = field(default_factory=set)  # (package id, node id): ControlState.dropping
    revoked: set[str] = field(default_factory=set)  # node ids: ControlState.revoked
    lapsed: set[str] = field(default_factory=set)  # node ids: ControlState.lapsed

    def _sets(self) -> tuple[set, ...]:
        return (self.packages, self.workers, self.availability, self.plans, self.releases, self.drops, self.revoked,
                self.lapsed)

    def __len__(self) -> int:
        return sum(map(len, self._sets()))

    def merge(self, other: Dirty) -> None:
        """Add ``other``'s keys (a flush that failed gives its keys back)."""
        for mine, theirs in zip(self._sets(), other._sets()):
            mine.update(theirs)


@dataclass(frozen=True)
class ScaleUpResult:
    """What a scale-up did; ``plan_id`` is "" when every target already held (or was receiving) the package."""

    plan_id: str
    strategy: str
    sources: tuple[str, ...]
    receivers: tuple[str, ...]
    unchanged: tuple[str, ...]


@dataclass(frozen=True)
class ScaleUpDraft:
    """A scale-up decided but not planned yet (:meth:`ControlState.draft_scale_up`): its own copies of what the
    plan is made from, so that :meth:`build` may run in another thread while the state goes on changing."""

    package_id: str
    receivers: tuple[str, ...]
    unchanged: tuple[str, ...]
    sources: tuple[str, ...] = ()
    strategy: str = ""
    fanout: int = DEFAULT_FANOUT
    labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    links: Mapping[str, int] = field(default_factory=dict)
    num_blocks: int = 0
    block_bytes: tuple[int, ...] = ()
    chunk_counts: tuple[int, ...] = ()
    held: Mapping[str, frozenset[int]] = field(default_factory=dict)  # only when a receiver holds some
    in_flight: tuple[InFlight, ...] = ()  # the receivers of the package in flight under other plans
    transport: str | None = None  # the data-plane transport its receivers and sources all speak

    def build(self) -> Plan:
        """The plan (pure; nothing a receiver already verified is fetched again)."""
        plan = make_plan(self.strategy, self.sources, self.receivers, self.num_blocks, fanout=self.fanout,
                         labels=self.labels, block_bytes=self.block_bytes, source_links=self.links,
                         chunk_counts=self.chunk_counts or None, in_flight=self.in_flight)
        # One pass over the receivers that hold blocks, not a re-plan of the whole plan (~0.5 s at 1,000).
        return drop_held(plan, self.held) if self.held else plan


class ControlState:
    """Everything the control plane knows. Methods raise :mod:`control_plane.errors` on bad requests
    and change nothing then."""

    def __init__(self, *, lease_s: float, forget_after_s: float | None = None, store_links: int = 1,
                 store_beside_holders: bool = True, stragglers: StragglerPolicy = StragglerPolicy()):
        if isinstance(store_links, bool) or not isinstance(store_links, int) or store_links < 1:
            raise ValueError(f"store_links must be a positive integer, got {store_links!r}")
        self.lease_s = lease_s
        # A store's egress in worker links: a scale-up gives the store that many rotated groups.
        self.store_links = store_links
        # A rotated scale-up also sends from an idle store beside the complete holders (see _plan_sources).
        self.store_beside_holders = store_beside_holders
        # A dead worker's record stays visible (ListWorkers) this long, then is forgotten.
        self.forget_after_s = forget_after_s if forget_after_s is not None else 30 * lease_s
        self.workers: dict[str, Worker] = {}
        self.packages: dict[str, Package] = {}
        self.availability: dict[str, Availability] = {}
        self.plans: dict[str, ActivePlan] = {}
        self.releases: dict[tuple[str, str], float] = {}  # (package id, node id) -> drop at
        # Receivers whose lease lapsed while a plan still fed them: node id -> package ids. When one registers
        # again it gets a plan for the blocks it still lacks. Stored (found in review: a restart forgot them, and
        # such a receiver kept a partial copy with no plan, which the scaling daemon counted as loading for good).
        self.lapsed: dict[str, set[str]] = {}
        # (package id, node id) told to DROP and not assigned the package since: verified reports the node sent
        # before it dropped may still arrive (batched, on another stream than the DROP) and must not count, and a
        # registration that still holds the package is told again (the DROP may never have reached it). Stored.
        self.dropping: set[tuple[str, str]] = set()
        # Blocks in a worker's disk cache that it does not hold in memory: package id -> node id -> blocks.
        # Soft state from registrations and reports (placement prefers such a worker: a local load).
        self.cached: dict[str, dict[str, set[int]]] = {}
        # Nodes whose token the operator revoked (RevokeNode): refused, whatever they call. Stored.
        self.revoked: set[str] = set()
        # Stragglers are looked for from receivers' progress: (package id, node id) -> (seconds, bytes held),
        # recent ones only, since the node's part last changed (soft state: a restart forgets it).
        self.stragglers = stragglers
        self.progress: dict[tuple[str, str], deque[Sample]] = {}
        self.notices: list[Notice] = []
        self.dirty = Dirty()
        self.replan_count = 0

    # ----- workers -----

    def register(self, spec: WorkerSpec, held: Mapping[str, Iterable[int]], now: float, *,
                 cached: Mapping[str, Iterable[int]] | None = None) -> list[str]:
        """Add or replace a worker; ``held`` replaces all it was known to hold, ``cached`` all it was known to
        have in its disk cache; refused (:class:`NodeIdInUse`) from another address while the worker's lease
        runs: a second agent given its id. Blocks it no longer holds leave the plans that count on them, as
        :meth:`report`'s dropped blocks do (its agent restarted within its lease, or its session registered again
        mid-plan). A worker whose lease lapsed while a plan fed it gets a plan for the rest; one still holding a
        package it was told to drop is told again (and does not hold it here). Returns unknown package ids (of
        either)."""
        node = spec.node_id
        # An id no node token can name (IssueToken refuses it) would also garble every listing it is shown in.
        try:
            validate_node_id(node)
        except CredentialError as exc:
            raise InvalidRequest(f"worker registration refused: {exc}") from None
        if not spec.peer.address:
            raise InvalidRequest(f"worker {node!r} registered without an address")
        described = sum(map(len, (spec.peer.address, spec.accelerator.kind, spec.accelerator.name, spec.serve_url,
                                  spec.engine, *spec.peer.transports, *spec.labels, *spec.labels.values())))
        if described > MAX_SPEC_CHARS or len(spec.labels) > MAX_LABELS:
            raise InvalidRequest(f"worker {node!r} registered with {len(spec.labels)} labels and {described} "
                                 f"characters of address, transports, labels, accelerator, serve URL and engine: "
                                 f"at most {MAX_LABELS} labels and {MAX_SPEC_CHARS} characters")
        if spec.memory_bytes <= 0:
            raise InvalidRequest(f"worker {node!r} registered with memory budget {spec.memory_bytes}: "
                                 "it must be positive")
        # Not finite, it would be stored and then refuse the next start-up; negative, it means nothing.
        if not math.isfinite(spec.link_mbit) or spec.link_mbit < 0:
            raise InvalidRequest(f"worker {node!r} registered with link rate {spec.link_mbit} Mbit/s: it must be a "
                                 "finite number >= 0 (0: unknown)")
        blocks, unknown = self._parse_reports(node, held)
        on_disk, unknown_cached = self._parse_reports(node, cached or {})
        old = self.workers.get(node)
        # A live lease at another address is another agent's (a restored one is unproven: it may have moved).
        if (old is not None and old.alive and not old.restored and old.lease_expires > now
                and old.spec.peer.address != spec.peer.address):
            raise NodeIdInUse.by(node, old.spec.peer.address, spec.peer.address, old.lease_expires - now)
        self.workers[node] = Worker(spec, now + self.lease_s)
        self.dirty.workers.add(node)
        # ``held`` is what it holds now; a package it was told to drop and still holds, it never heard of that
        # (its lease lapsed, its mailbox went with the DROP): told again, not a holder.
        undropped = sorted(p for p, n in self.dropping if n == node and blocks.get(p))
        self._clear_dropping(node, keep=undropped)
        for package_id in undropped:
            del blocks[package_id]
            self.notices.append(Notice(node, UpdateKind.DROP, package_id))
            log.info("worker %s registered holding package=%s it was told to drop: told again", node, package_id)
        self._forget_cached(node)
        for package_id, cached_blocks in on_disk.items():
            self.cached.setdefault(package_id, {})[node] = cached_blocks
        if old is not None and old.alive and old.spec.peer.transports != spec.peer.transports:
            self._leave_plans_spoken_otherwise(node)
        if old is not None and old.alive and old.spec.peer != spec.peer:
            self._readdressed(node)
        for package_id, availability in self.availability.items():
            mine = blocks.get(package_id, set())
            if availability.held(node) != mine:
                lost = availability.held(node) - mine
                availability.remove_worker(node)
                availability.add(node, mine)
                self.dirty.availability.add((package_id, node))
                if lost:  # as a report of them dropped: no plan counts on them (an agent restarted, within its lease)
                    self._lost(package_id, node, lost)
            if availability.is_complete(node):
                self._receiver_done(package_id, node)
        self._leave_plans_too_large(node)
        self._resume(node, now)
        return sorted(set(unknown) | set(unknown_cached))

    def _leave_plans_too_large(self, node: str) -> None:
        """``node`` registered again with a memory budget that no longer fits a package it is receiving beside what
        else it is committed to (as a scale-up checks it): it leaves that package's plans, as a dead receiver would.
        Its agent cannot take the package in: it would stay a receiver for good (the plan never ending), and a
        chain's tail that later scale-ups hang behind."""
        budget = self.workers[node].spec.memory_bytes
        for package_id in sorted({p.package_id for p in self.plans.values() if node in p.pending}):
            need = self.packages[package_id].total_bytes
            committed = self._committed_bytes(excluding=package_id).get(node, 0)
            if committed + need <= budget:
                continue
            log.warning("worker %s registered with a memory budget of %d bytes, %d of them committed to other "
                        "packages: package=%s (%d bytes) no longer fits; it leaves the package's plans", node, budget,
                        committed, package_id, need)
            for active in [p for p in self.plans.values() if p.package_id == package_id and node in p.pending]:
                self._repair(active, {node})

    def _leave_plans_spoken_otherwise(self, node: str) -> None:
        """``node`` registered again with other transports (its agent restarted and fell back from UCX to TCP): it
        leaves the plans whose other nodes speak none of them, as a dead node would (it can neither fetch from them
        nor serve them); where it was receiving, it gets a plan for the rest (:meth:`_resume`)."""
        for active in [p for p in self.plans.values() if node in p.parts and not self._plan_transports(p)]:
            log.warning("worker %s registered with transports=%s, which plan=%s of package=%s does not speak; it "
                        "leaves the plan", node, ",".join(self.peer(node).transports), active.plan_id,
                        active.package_id)
            if node in active.pending:
                self._add_lapsed(node, {active.package_id})
            if not self._repair(active, {node}):
                # It was the plan's only source, and no other speaks the plan's transport: kept, it would have its
                # receivers fail on it and report it for good.
                self._abandon(active, f"no source speaking {','.join(sorted(self._plan_transports(active, {node})))}, "
                                      "the transport of its receivers")
        # Resumed, it receives again: not while it still sends a package it lacks in a plan it speaks (a chain
        # hung behind it), which would refuse the scale-up that resumes it.
        for active in [p for p in self.plans.values() if node in p.parts and p.package_id in self.lapsed.get(node, ())]:
            self._repair(active, {node})

    def _abandon(self, active: ActivePlan, why: str) -> None:
        """End ``active``, which no source can feed (``why``): its receivers leave it (a scale-up of them finds them
        a source, or says there is none), and so do the plans that hang behind one of them (a chain's tail, fed by
        nothing now), repaired from another source or ended in turn."""
        if self.plans.get(active.plan_id) is not active:  # ended already (a loop over plans that changed meanwhile)
            return
        log.warning("plan=%s of package=%s has %s: it ends, and %s with it (a scale-up of them finds them a source, "
                    "or says there is none)", active.plan_id, active.package_id, why, ", ".join(sorted(active.pending)))
        stranded = set(active.pending)
        self._end_plan(active)
        for other in [p for p in self.plans.values() if p.package_id == active.package_id]:
            unfed = stranded & set(other.plan.sources)
            if unfed and not self._repair(other, unfed):
                self._abandon(other, f"sources {', '.join(sorted(unfed))} that lack the package and are fed by nothing")

    def _resume(self, node: str, now: float) -> None:
        """Plan the rest of every package ``node`` was receiving when its lease lapsed."""
        self._drop_lapsed(node)
        for package_id in sorted(self.lapsed.pop(node, ())):
            if package_id not in self.packages:
                continue
            try:
                result = self.scale_up(package_id, node_ids=[node], now=now)
            except (InsufficientWorkers, NoSource, Conflict) as exc:  # its registration goes through all the same
                log.warning("worker %s is back but cannot resume package=%s: %s", node, package_id, exc)
                continue
            if result.receivers:
                log.info("worker %s is back: plan=%s resumes package=%s", node, result.plan_id, package_id)

    def revoke(self, node: str, *, restore: bool = False) -> bool:
        """Revoke ``node``'s token (with ``restore``: admit it again); returns whether that changed anything. A
        revoked node leaves every plan and availability at once, as if it had deregistered, and is no source of
        a plan from then on (a package whose store it is has none until published with another); a plan left
        with no source ends (:meth:`_abandon`)."""
        try:
            validate_node_id(node)
        except CredentialError as exc:
            raise InvalidRequest(f"revocation refused: {exc}") from None
        if restore:
            if node not in self.revoked:
                return False
            self.revoked.discard(node)
            self.dirty.revoked.add(node)
            log.warning("node %s: its token is admitted again", node)
            return True
        # Revoked already, it may have registered since (with auth off): it goes all the same, which is a change.
        if node in self.revoked and node not in self.workers and not any(node in p.parts for p in self.plans.values()):
            return False
        self.revoked.add(node)
        self.dirty.revoked.add(node)
        stores = sorted(p.package_id[:12] for p in self.packages.values() if p.store.node_id == node)
        log.warning("node %s: its token is revoked; it leaves every plan%s", node,
                    f"; the store of packages {', '.join(stores)}, which have none until published with another"
                    if stores else "")
        if node in self.workers:
            self._remove_nodes({node})
            self._forget(node)
        for active in [p for p in self.plans.values() if node in p.parts]:  # a store without an agent; or no other
            if not self._repair(active, {node}):
                self._abandon(active, f"no source but {node}, whose token is revoked")
        return True

    def check_not_revoked(self, node: str) -> None:
        """Raise :class:`Unauthenticated` if ``node``'s token is revoked."""
        if node in self.revoked:
            raise Unauthenticated(f"the token of node {node!r} is revoked (`pipecast cp revoke-node {node} --restore` "
                                  "admits it again)")

    def heartbeat(self, node: str, now: float) -> None:
        """Renew ``node``'s lease (:class:`UnknownWorker` if it must register again: :meth:`registered_worker`)."""
        self.registered_worker(node).lease_expires = now + self.lease_s

    def deregister(self, node: str) -> None:
        """Remove a worker that shuts down: it leaves every plan and its blocks leave availability."""
        if node not in self.workers:
            raise UnknownWorker.named(node)
        self._remove_nodes({node})
        self._forget(node)

    def tick(self, now: float) -> list[str]:
        """Mark workers whose lease lapsed dead (they leave every plan), drop releases that are due,
        forget long-dead workers. Returns the newly dead."""
        dead = sorted(node for node, w in self.workers.items() if w.alive and w.lease_expires <= now)
        self._lapse(dead)
        for (package_id, node), drop_at in sorted(self.releases.items()):
            if drop_at <= now:
                self._drop(package_id, node)
        forget = [n for n, w in self.workers.items() if not w.alive and w.lease_expires + self.forget_after_s <= now]
        for node in forget:
            self._forget(node)
        return dead

    def shift_deadlines(self, seconds: float) -> None:
        """Move every lease's and keep-alive release's end ``seconds`` later (earlier if negative): the clock
        ``now`` comes from moved that much while this control plane did not watch it (a step of the wall clock, a
        suspended host or process), so each keeps the time it had left. Straggler measurements restart (their
        rates would span the step)."""
        for worker in self.workers.values():
            worker.lease_expires += seconds
        for key in self.releases:
            self.releases[key] += seconds
            self.dirty.releases.add(key)
        self.progress.clear()

    def _lapse(self, nodes: Collection[str], *, keep_releases: bool = False) -> None:
        """``nodes`` are dead as if their lease lapsed: they leave every plan and availability, must register
        again, and then get a plan for the rest of what they were receiving. ``keep_releases``: their keep-alive
        releases still end as planned (a node only reported gone may be alive: it registers again holding them)."""
        for node in nodes:
            self.workers[node].alive = False
            self.dirty.workers.add(node)
        for node in nodes:
            receiving = {p.package_id for p in self.plans.values() if node in p.pending}
            if receiving:
                self._add_lapsed(node, receiving)
        if nodes:
            self._remove_nodes(set(nodes), keep_releases=keep_releases)

    def _add_lapsed(self, node: str, package_ids: Collection[str]) -> None:
        self.lapsed.setdefault(node, set()).update(package_ids)
        self.dirty.lapsed.add(node)

    def _drop_lapsed(self, node: str) -> None:
        """``node``'s stored row goes with its entry, if it has one (every registration comes here: no write else)."""
        if node in self.lapsed:
            self.dirty.lapsed.add(node)

    def restore_lapsed(self, node: str, package_ids: Collection[str]) -> None:
        """Loading: ``node`` was receiving ``package_ids`` when its lease lapsed (those still published count)."""
        known = {p for p in package_ids if p in self.packages}
        if known and node in self.workers:
            self.lapsed[node] = known

    def _forget(self, node: str) -> None:
        """Remove every trace of ``node`` (it left every plan and availability already)."""
        del self.workers[node]
        self._drop_lapsed(node)
        self.lapsed.pop(node, None)
        self._clear_dropping(node)
        self._forget_cached(node)
        self.dirty.workers.add(node)

    # ----- packages -----

    def publish(self, manifest: Manifest, store: PeerInfo, now: float) -> str:
        """Publish (or re-point the store of) a package; returns its id. Plans in progress that send from a store
        node re-pointed away are repaired without it (:meth:`_repair`: the new store, or a holder, sends in its
        place): it no longer serves the package as its store, and a store that is no worker has no address left
        to give the receivers."""
        package_id = manifest.package_id
        if not package_id:
            raise InvalidRequest("published manifest has no package_id")
        if not manifest.blocks:
            raise InvalidRequest(f"published manifest of package {package_id!r} has no blocks")
        for position, block in enumerate(manifest.blocks):
            if block.index != position:
                raise InvalidRequest(f"published manifest of package {package_id!r}: block at position "
                                     f"{position} has index {block.index}")
        if not store.node_id or not store.address:
            raise InvalidRequest(f"package {package_id!r} published without a store node id and address, got "
                                 f"{store.node_id!r} at {store.address!r}")
        old = self.packages.get(package_id)
        if old is not None and old.num_blocks != len(manifest.blocks):
            raise Conflict(f"package {package_id!r} is already published with {old.num_blocks} blocks, "
                           f"this manifest has {len(manifest.blocks)}")
        self.packages[package_id] = Package(manifest, store, old.published_at if old else now)
        self.availability.setdefault(package_id, Availability(len(manifest.blocks)))
        self.dirty.packages.add(package_id)
        if old is not None and old.store.node_id != store.node_id:
            moved = old.store.node_id
            # _repair cannot fail here: the new store, never excluded, is left to send from.
            for active in [a for a in self.plans.values() if a.package_id == package_id and moved in a.plan.sources]:
                self._repair(active, {moved})
        return package_id

    def remove_package(self, package_id: str, *, force: bool = False) -> None:
        """Forget a package. Refused while workers other than its store hold it or plans use it, unless ``force``:
        then its plans are cancelled. Every holder (its store too) and receiver is told to drop it."""
        store = self.package(package_id).store.node_id
        availability = self.availability[package_id]
        plans = [p for p in self.plans.values() if p.package_id == package_id]
        # The store is left out: it cannot be released, so counting it would refuse every removal but a forced one.
        holders = availability.by_worker.keys() - {store}
        if (holders or plans) and not force:
            raise Conflict(f"package {package_id!r} is held by {len(holders)} workers besides its store and used "
                           f"by {len(plans)} active plans: release it first, or remove it with force")
        told = set(availability.by_worker)
        for active in plans:
            told.update(n for n in active.plan.assignments)
            self._end_plan(active)
        for node in sorted(told & self.workers.keys()):
            self.notices.append(Notice(node, UpdateKind.DROP, package_id))
        for key in [k for k in self.releases if k[0] == package_id]:
            del self.releases[key]
            self.dirty.releases.add(key)
        gone = {k for k in self.dropping if k[0] == package_id}
        self.dropping -= gone
        self.dirty.drops |= gone
        self.progress = {k: samples for k, samples in self.progress.items() if k[0] != package_id}
        self.cached.pop(package_id, None)
        self.dirty.availability.update((package_id, node) for node in availability.by_worker)
        del self.availability[package_id]
        del self.packages[package_id]
        self.dirty.packages.add(package_id)

    # ----- availability -----

    def report(self, node: str, verified: Mapping[str, Iterable[int]], dropped: Mapping[str, Iterable[int]],
               now: float, *, cached: Mapping[str, Iterable[int]] | None = None,
               progress: Mapping[str, int] | None = None) -> list[str]:
        """Apply a worker's batched report (it also renews the lease); ``cached`` blocks are now in its disk
        cache (e.g. kept there after a drop); ``progress``: bytes it holds of packages it receives (a plan
        whose receiver straggles is changed around it). Returns unknown package ids."""
        worker = self.registered_worker(node)
        gained, unknown = self._parse_reports(node, verified)
        lost, unknown_dropped = self._parse_reports(node, dropped)
        on_disk, unknown_cached = self._parse_reports(node, cached or {})
        worker.lease_expires = now + self.lease_s
        for package_id, blocks in on_disk.items():
            self.cached.setdefault(package_id, {}).setdefault(node, set()).update(blocks)
        for package_id, blocks in lost.items():
            if self.availability[package_id].remove(node, blocks):
                self.dirty.availability.add((package_id, node))
                self._lost(package_id, node, blocks)
        for package_id, blocks in gained.items():
            if (package_id, node) in self.dropping:
                log.info("ignored verified blocks of package=%s from node=%s: reported before it dropped them",
                         package_id, node)
                continue
            availability = self.availability[package_id]
            if availability.add(node, blocks):
                self.dirty.availability.add((package_id, node))
                if availability.is_complete(node):
                    self._receiver_done(package_id, node)
        for package_id, held in (progress or {}).items():
            if package_id in self.packages:  # a node cannot claim more than the package
                self._progressed(package_id, node, min(held, self.packages[package_id].total_bytes), now)
        return sorted(set(unknown) | set(unknown_dropped) | set(unknown_cached))

    def _set_relay_caps(self, package_id: str, *, tell: bool, told: str = "") -> None:
        """Set the relay piece each plan of ``package_id`` in progress asks of its receivers
        (:func:`~control_plane.placement.plan_relay_piece`; 0: the agents' own). A plan one of whose sources still
        receives in another (a chain hung behind another's tail) takes every chunk through that one: plans so linked
        are one row of relays, the hops above a plan's sources counted with its own, and all ask for the piece of
        the longest row through them. A plan's piece only gets smaller while it runs (a repair that shortens its row
        leaves it: a little more CPU, no notices; a restart, which recomputes it, may give a larger one); the nodes
        of a plan whose piece changed are ``tell``-ed, but for those of plan ``told``, whose caller tells them all.
        Linear in the plans and their sources."""
        package = self.packages.get(package_id)
        plans = {active.plan_id: active for active in self.plans.values() if active.package_id == package_id}
        if package is None or not plans:
            return
        # Only sources can link plans: looked up among the few sources, not every receiver (each repair calls this).
        sources = {source for active in plans.values() for source in active.plan.sources}
        receiving = {node: (plan_id, active.plan.depth(node))
                     for plan_id, active in plans.items() for node in sources.intersection(active.pending)}
        # plan -> [(a plan one of its sources receives in, that source's place in its row)]
        up = {plan_id: [receiving[s] for s in active.plan.sources if s in receiving and receiving[s][0] != plan_id]
              for plan_id, active in plans.items()}
        above: dict[str, int] = {}  # hops above a plan's sources, up the longest of its rows
        on_path: set[str] = set()  # a link back to one of these closes a cycle of plans: it counts 0
        for start in plans:
            stack = [start]
            while stack:  # depth first, a plan's links done before it (no recursion: rows of hundreds of plans)
                plan_id = stack[-1]
                if plan_id in above:
                    stack.pop()
                    continue
                todo = [upper for upper, _ in up[plan_id] if upper not in above and upper not in on_path]
                if todo and plan_id not in on_path:
                    on_path.add(plan_id)
                    stack.extend(todo)
                    continue
                stack.pop()
                on_path.discard(plan_id)
                above[plan_id] = max((place + above.get(upper, 0) for upper, place in up[plan_id]), default=0)
        root = {plan_id: plan_id for plan_id in plans}  # linked plans share a root (union-find)

        def find(plan_id: str) -> str:
            while root[plan_id] != plan_id:
                root[plan_id] = root[root[plan_id]]  # path halving
                plan_id = root[plan_id]
            return plan_id

        for plan_id, links in up.items():
            for upper, _ in links:
                root[find(plan_id)] = find(upper)
        longest: dict[str, int] = {}
        for plan_id, active in plans.items():
            group = find(plan_id)
            longest[group] = max(longest.get(group, 0), above.get(plan_id, 0) + active.plan.hops())
        for plan_id, active in plans.items():
            cap = plan_relay_piece(longest[find(plan_id)], package.total_bytes, package.relay_piece)
            if cap and (not active.relay_bytes or cap < active.relay_bytes):
                active.relay_bytes = cap
                if tell and plan_id != told:
                    self.notices.extend(Notice(node, UpdateKind.ASSIGN, package_id, plan_id) for node in active.parts)

    def watches(self, active: ActivePlan) -> bool:
        """Whether ``active`` is watched for stragglers, so that its receivers report their progress: only a plan
        small enough to re-plan on the event loop (:data:`INLINE_REPLAN_MAX_RECEIVERS`); a larger one's reports,
        ten a second from every receiver, would outnumber what the control plane takes, for no demotion."""
        return self.stragglers.enabled and len(active.plan.assignments) <= INLINE_REPLAN_MAX_RECEIVERS

    def _progressed(self, package_id: str, node: str, held: int, now: float) -> None:
        """Record that ``node`` holds ``held`` bytes of ``package_id``; look for stragglers in its watched plans
        (at most every quarter window per plan)."""
        plans = [p for p in self.plans.values() if p.package_id == package_id and node in p.pending and self.watches(p)]
        if not plans:
            return
        samples = self.progress.setdefault((package_id, node), deque(maxlen=PROGRESS_SAMPLES))
        samples.append((now, held))
        for active in plans:
            if now - active.checked_at >= self.stragglers.window_s / 4:
                active.checked_at = now
                self._find_stragglers(active, now)

    def _find_stragglers(self, active: ActivePlan, now: float) -> None:
        """Demote the receivers of ``active`` that straggle (:mod:`control_plane.planner.stragglers`); after a
        re-plan, only on the rates of a window that starts a window later."""
        policy, package_id = self.stragglers, active.package_id
        if active.changed:
            active.changed, active.settle_until = False, now + policy.window_s
            return
        if active.settle_until is not None:
            if now < active.settle_until:
                return
            active.settle_until = None
            for node in active.pending:
                self.progress.pop((package_id, node), None)
            return
        rates = {}
        for node in active.pending:
            samples = self.progress.get((package_id, node))
            rate = receive_rate(samples, now=now, window_s=policy.window_s) if samples else None
            if rate is not None:
                rates[node] = rate
        if not rates:
            return
        expected = {node: w.spec.link_mbit * 1e6 / 8 for node in active.parts
                    if (w := self.workers.get(node)) is not None and w.spec.link_mbit > 0}
        if active.pairs and self._settle_pairs(active, rates, expected):
            return
        found = find_stragglers(active.parts, rates, active.pending, expected, factor=policy.factor,
                                skip=active.demoted, limits=active.limits, suspects=active.suspects)
        slow, relays = found.slow, found.relays
        if not slow:
            return
        package = self.packages[package_id]
        held = self._senders(active)
        parents = {node: {f.parent for f in active.parts[node].fetch} for node in slow}
        # Pairs at a plan's first demotion only: past a slow leaf (the tail's one slot taken) a pair would wait
        # behind it, where no verdict can be made, its healthy member at that leaf's rate for good.
        pairs = {} if active.demoted else chain_pairs([node for node in slow if node not in relays], active.parts,
                                                      active.pending)
        beside = set(pairs.values())
        plan = demote(active.plan, {*slow, *beside}, held=held, sources=active.plan.sources,
                      num_blocks=package.num_blocks, labels=self._labels(set(active.parts) | set(held)),
                      demoted=active.demoted, last=relays | beside,
                      beside={relay: child for child, relay in pairs.items()}, healthy=active.healthy)
        for node in slow:
            why = ("its children got a fraction of its own %.1f Mbit/s one after another: its uplink is the limit"
                   if node in relays else "receiving %.1f Mbit/s")
            log.warning("straggler node=%s plan=%s package=%s: " + why + "; its children move to faster parents and "
                        "it becomes a leaf", node, active.plan_id, package_id, rates[node] * 8 / 1e6)
        for node, relay in pairs.items():
            log.warning("straggler node=%s plan=%s package=%s: its one child %s gets %.1f Mbit/s of its %.1f, and in "
                        "a chain nothing tells a slow child from a slow uplink: it leaves the middle too, beside "
                        "that child, until one of them keeps up past the tail", relay, active.plan_id, package_id,
                        node, rates[node] * 8 / 1e6, rates.get(relay, 0.0) * 8 / 1e6)
        active.demoted.update(slow, beside)
        active.pairs.update(pairs)
        for node in slow:
            if node not in relays and node not in pairs and not parents[node] & relays:
                active.limits.update(parents[node] - active.pending)
                active.suspects.update(parents[node] & active.pending)
        self._replanned(active, plan)

    def _settle_pairs(self, active: ActivePlan, rates: Mapping[str, float], expected: Mapping[str, float]) -> bool:
        """The pairs of ``active`` whose verdict is in (:func:`~control_plane.planner.stragglers.pair_verdict`): the
        slow one fetches behind the other from now on. Returns whether the plan changed."""
        plan = active.plan
        for child, relay in sorted(active.pairs.items()):
            if child not in active.pending or relay not in active.pending:
                del active.pairs[child]  # one of them is done: the other goes on past the tail alone
                continue
            verdict = pair_verdict(child, relay, active.parts, rates, active.pending, expected,
                                   factor=self.stragglers.factor)
            if verdict is None:
                continue
            del active.pairs[child]
            slow, fine = (child, relay) if verdict == "child" else (relay, child)
            active.healthy.add(fine)
            plan = self._behind(active, plan, slow, fine)
            if verdict == "child":
                log.warning("straggler node=%s plan=%s package=%s: past the tail it still gets %.1f Mbit/s: the slow "
                            "one; %s, demoted beside it, fetches ahead of it", child, active.plan_id,
                            active.package_id, rates[child] * 8 / 1e6, relay)
            else:
                log.warning("straggler node=%s plan=%s package=%s: its child %s, demoted beside it, keeps up past the "
                            "tail at %.1f Mbit/s: its uplink was the limit; it fetches behind that child", relay,
                            active.plan_id, active.package_id, child, rates[child] * 8 / 1e6)
        if plan is active.plan:
            return False
        self._replanned(active, plan)
        return True

    def _behind(self, active: ActivePlan, plan: Plan, slow: str, fine: str) -> Plan:
        """``plan`` with the leaf ``slow`` fetching behind the leaf ``fine`` (:func:`follow`); where a re-plan since
        the pair's (a death, a later straggler) made ``fine`` depend on ``slow``, both joined again past the tail,
        ``slow`` last (:func:`demote`); where neither makes a valid plan, ``plan`` as it is."""
        held = self._senders(active)
        try:
            moved = follow(plan, slow, fine, held.get(fine, ()))
            moved.validate()
            return moved
        except PlanError:
            pass
        try:
            moved = demote(plan, {slow, fine}, held=dict(held), sources=plan.sources,
                           num_blocks=self.packages[active.package_id].num_blocks,
                           labels=self._labels(set(active.parts) | set(held)), demoted=active.demoted - {slow, fine},
                           last={slow}, healthy=active.healthy)
            moved.validate()
            return moved
        except PlanError as exc:
            log.warning("plan=%s: %s stays where it is, not behind %s: %s", active.plan_id, slow, fine, exc)
            return plan

    def report_bad_peer(self, node: str, peer: str, package_id: str, block: int, reason: str, now: float, *,
                        gone: bool = False) -> bool:
        """A child says ``peer`` served it bad data (or failed) for ``block``: the peer loses that block's
        availability, and in every plan of the package where it is the child's parent for the block (for any
        unit of it) the child fetches the block from elsewhere. A peer still receiving the plan stays in it and
        fetches what it lacks now (:func:`~control_plane.planner.replan.reroute`), and the child fetches every
        other block it lacks from elsewhere too (a relay failing the child would fail it again for each, one I/O
        timeout at a time, while its lease holds); one that is not (a source, a holder, a receiver done) leaves
        it, as a dead node would. A peer ``gone`` (its host refused the
        connection: nothing listens there; the service checks that first, :mod:`control_plane.probe`) is taken
        for dead at once, as if its lease had lapsed: it leaves
        every plan, its children taking its slots, and all availability; an agent that is in fact alive (it
        restarted, or refused only this child) is told to register again at its next heartbeat, with all it
        holds, and gets a plan for the rest. Returns whether any plan was re-planned."""
        worker = self.registered_worker(node)
        self.check_bad_peer_report(node, peer, package_id, block)
        worker.lease_expires = now + self.lease_s
        reason = reason[:MAX_REASON_CHARS]  # logged: a member may not fill the control plane's log
        # By block and parent alone: a fetch of a chunk range of the block names its range too.
        plans = [p for p in self.plans.values() if p.package_id == package_id and node in p.parts
                 and any(f.block == block and f.parent == peer for f in p.parts[node].fetch)]
        if not plans:
            log.warning("bad-peer report ignored node=%s peer=%s package=%s block=%d: not its parent for "
                        "that block in any active plan", node, peer, package_id, block)
            return False
        log.warning("bad peer node=%s peer=%s package=%s block=%d gone=%s reason=%r", node, peer, package_id, block,
                    gone, reason)
        if gone:
            worker = self.workers.get(peer)
            if worker is not None and worker.alive:
                self._lapse([peer], keep_releases=True)
                return True
            return any(self._repair(active, {peer}) for active in plans)  # e.g. a store that never registered
        if self.availability[package_id].remove(peer, [block]):
            self.dirty.availability.add((package_id, peer))
        held = self.availability[package_id].held(node)  # what the child lacks moves, not what it has
        changed = False
        for active in plans:
            if peer not in active.pending:
                changed |= self._repair(active, {peer})
                continue
            others = {f.block for f in active.parts[node].fetch if f.parent == peer} - held - {block}
            changed |= self._reroute(active, node, peer, block, others)
        self._lost(package_id, peer, [block], handled={active.plan_id for active in plans})
        return changed

    def check_bad_peer_report(self, node: str, peer: str, package_id: str, block: int) -> None:
        """Raise unless a report by ``node`` of ``peer`` for ``block`` of ``package_id`` names a published
        package's block and a peer id a node could have (:class:`InvalidRequest` for one no token can name: it
        would be logged as sent, new lines and all)."""
        try:
            validate_node_id(peer)
        except CredentialError as exc:
            raise InvalidRequest(f"bad-peer report refused: {exc}") from None
        self._check_blocks(node, self.package(package_id), [block])

    def _lost(self, package_id: str, node: str, blocks: Iterable[int], handled: Collection[str] = ()) -> None:
        """``node`` no longer holds ``blocks`` of ``package_id``: no plan of the package it has a part in (but those
        ``handled``) counts on them any more. Where it receives, it fetches again those it held when the plan
        was made (else it stayed pending for good); where it only sends (a source, a holder), it leaves the plan
        (a receiver picked for a new plan while a source of another no draft could place)."""
        for active in [p for p in self.plans.values() if p.package_id == package_id and p.plan_id not in handled
                       and (node in p.parts or node in p.plan.held)]:
            if node not in active.pending:
                self._repair(active, {node})
                continue
            for block in blocks:
                if not any(f.block == block for f in active.plan.assignments.get(node, ())):
                    self._reroute(active, None, node, block)

    def _reroute(self, active: ActivePlan, child: str | None, peer: str, block: int,
                 others: Collection[int] = ()) -> bool:
        """Move ``child``'s fetches of ``block`` (and of ``others``, which ``peer`` keeps) off ``peer``, a receiver
        of ``active`` that keeps receiving."""
        held = self._senders(active)
        plan, changed = reroute(active.plan, child=child, peer=peer, block=block, held=held,
                                labels=self._labels(set(active.parts) | set(held)), fanout=active.fanout,
                                parts=active.parts, leaves=active.demoted, others=others)
        self._replanned(active, plan, changed)
        if child is None:
            log.info("re-planned plan=%s package=%s: node=%s lost block=%d and fetches it again; version=%d",
                     active.plan_id, active.package_id, peer, block, active.version)
        else:
            log.info("re-planned plan=%s package=%s: node=%s fetches block=%d (and %d more) from others than "
                     "peer=%s, which keeps receiving; version=%d", active.plan_id, active.package_id, child, block,
                     len(others), peer, active.version)
        return True

    # ----- scaling -----

    def scale_up(self, package_id: str, *, node_ids: Sequence[str] = (), count: int = 0, strategy: str = "",
                 fanout: int = 0, serving_only: bool = False, now: float) -> ScaleUpResult:
        """Bring a package onto ``node_ids``, or onto ``count`` more workers picked here (workers in a
        keep-alive release of it first, then those holding most of it, then those in a source's rack, then
        the least loaded). Sources are alive workers holding all of it, one per receiver at most
        (:meth:`_pick_sources`), and its store while no plan in progress sends from it
        (:attr:`store_beside_holders`), else its store alone; several sources, or a
        store of :attr:`store_links` > 1 links feeding two receivers or more, give a plan rotated by bytes
        (see :mod:`control_plane.placement`). While a chain from the store is still in progress, a
        new chain hangs behind its last node instead (one copy leaves the store, not two), unless the store
        has a link to spare. Otherwise a few receivers added beside others in flight get a plan rotated to
        start where those lack most (:func:`~control_plane.planner.schedules.complement_starts`), so that
        together they soon hold every layer and serve as a pipeline. Its receivers and sources all speak one
        data-plane transport (:func:`~control_plane.placement.plan_transport`), and so do the parents its repairs
        give them.

        The same as :meth:`draft_scale_up`, :meth:`ScaleUpDraft.build` and :meth:`install_scale_up`, which
        the service calls apart to plan off its event loop."""
        draft = self.draft_scale_up(package_id, node_ids=node_ids, count=count, strategy=strategy, fanout=fanout,
                                    serving_only=serving_only)
        return self.install_scale_up(draft, draft.build() if draft.receivers else None, now=now)

    def draft_scale_up(self, package_id: str, *, node_ids: Sequence[str] = (), count: int = 0, strategy: str = "",
                       fanout: int = 0, serving_only: bool = False) -> "ScaleUpDraft":
        """Who receives the package from whom (:meth:`scale_up`), with copies of everything the plan is made
        from, so that :meth:`ScaleUpDraft.build` may run in another thread; changes nothing. Raises what
        :meth:`scale_up` raises for bad requests. ``serving_only``: ``count`` workers with a serve URL only (the
        scaling daemon's: an agent alone holds the package but serves nothing, and the daemon never releases it)."""
        package = self.package(package_id)
        if bool(node_ids) == bool(count):
            raise InvalidRequest(f"scale-up of package {package_id!r}: give either target workers or a count")
        if strategy and strategy not in STRATEGIES:
            raise InvalidRequest(f"scale-up of package {package_id!r}: unknown strategy {strategy!r} "
                                 f"(expected one of {', '.join(STRATEGIES)})")
        if len(set(node_ids)) != len(node_ids):
            raise InvalidRequest(f"scale-up of package {package_id!r}: a target worker is listed twice")
        if node_ids:
            for node in node_ids:
                self.alive_worker(node)
            senders = self._partial_senders(package_id)
            sending = next((n for n in node_ids if n in senders), None)
            if sending is not None:  # no draft could place it: a plan's part is no receiver of another
                raise Conflict(f"scale-up of package {package_id!r}: worker {sending!r} sends the blocks it holds in "
                               f"plan {senders[sending]} in progress; scale it up once that plan ends")
            targets = named_targets(package_id, package.total_bytes, self._candidates(package_id, node_ids),
                                    self._offered(package, receivers=node_ids))
        else:
            alive = [n for n, w in self.workers.items() if w.alive]
            # Sources as for ``count`` receivers not picked yet: their racks are those receivers are picked from
            # first. The plan's own are picked again for the receivers chosen (those in their racks first).
            sources, _ = self._plan_sources(package, strategy, exclude=(), receivers=count)
            source_racks = {rack for n in sources if (rack := self._rack(n)) is not None}
            targets = counted_targets(package_id, package.total_bytes, self._candidates(package_id, alive), count,
                                      source_racks, store=package.store.node_id, offered=self._offered(package),
                                      serving_only=serving_only)
        receivers = tuple(targets.receivers)
        if not receivers:
            return ScaleUpDraft(package_id, receivers, tuple(targets.unchanged))
        availability = self.availability[package_id]
        sources, strategy = self._plan_sources(package, strategy, exclude=set(receivers), receivers=receivers,
                                               transport=targets.transport)
        if not sources:  # only the store holds it, and it is named a receiver: nothing to send from
            raise NoSource(f"scale-up of package {package_id!r}: no node holds the whole package to send it from "
                           f"(its store {package.store.node_id!r} is among the receivers and no worker holds all "
                           "of it)")
        # Only a rotated plan uses them (not a chain behind a chain in progress: it gets what that gets).
        in_flight = self._in_flight(package_id) if strategy in ("", "rotated") else ()
        links = self._source_links(package, sources, len(receivers), bool(in_flight))
        slots = sum(links.get(s, 1) for s in sources)
        strategy = strategy or default_strategy(slots, len(receivers), bool(in_flight),
                                               package_bytes=package.total_bytes, piece_bytes=package.relay_piece)
        held = dict(availability.by_worker) \
            if any(n in availability.by_worker for n in receivers) else {}
        return ScaleUpDraft(package_id, receivers, tuple(targets.unchanged), tuple(sources), strategy,
                            fanout or DEFAULT_FANOUT, self._labels({*held, *sources, *receivers}), links,
                            package.num_blocks, package.block_bytes, package.chunk_counts, held,
                            in_flight=in_flight if strategy == "rotated" else (), transport=targets.transport)

    def install_scale_up(self, draft: "ScaleUpDraft", plan: Plan | None, *, now: float) -> ScaleUpResult:
        """Start ``plan``, built from ``draft``, and tell its nodes. :class:`DraftStale`, and nothing changes, if
        the cluster changed since the draft (a receiver or source gone, a receiver taken by another plan of the
        package or holding other blocks of it, a source or unchanged worker told to drop it): the caller drafts and
        plans it again, the service in a thread (planning here, on its event loop, held it 0.5 s at 2,000 workers)."""
        package_id, receivers = draft.package_id, draft.receivers
        if not self._draft_holds(draft):
            raise DraftStale(f"scale-up of package {package_id!r}: the cluster changed while its plan was made (a "
                             "receiver or source gone or taken by another scale-up); try again")
        for node in [*draft.unchanged, *receivers]:
            if self.releases.pop((package_id, node), None) is not None:
                self.dirty.releases.add((package_id, node))
                log.info("release cancelled by scale-up package=%s node=%s", package_id, node)
        self._reclaim(self.packages[package_id], receivers)
        if plan is None:
            return ScaleUpResult("", "", (), (), draft.unchanged)
        availability = self.availability[package_id]
        active = ActivePlan(uuid.uuid4().hex[:12], package_id, plan, draft.fanout, now, version=0)
        active.pending = {n for n in plan.assignments if not availability.is_complete(n)}
        self._install(active, plan)
        active.changed = False  # a new plan: nothing to settle from
        log.info("scale-up plan=%s package=%s strategy=%s transport=%s sources=%d source_slots=%d receivers=%d",
                 active.plan_id, package_id, draft.strategy, draft.transport, len(draft.sources),
                 sum(draft.links.get(s, 1) for s in draft.sources), len(receivers))
        if not active.pending:
            self._end_plan(active)
        return ScaleUpResult(active.plan_id, draft.strategy, draft.sources, receivers, draft.unchanged)

    def _draft_holds(self, draft: "ScaleUpDraft") -> bool:
        """Whether ``draft``'s receivers and worker sources are still alive, no receiver has joined another
        plan of the package meanwhile, every receiver still holds the blocks the draft took it to hold (a release
        or a report of dropped blocks may have taken some: its plan would never fetch them) and has the memory
        for the package (another scale-up, of another package, may have taken it meanwhile), and its worker
        sources and unchanged workers still hold the package (a keep-alive release may have fallen due
        meanwhile: told to drop it, one is neither), and its receivers and sources still speak its transport (one
        may have registered again with another)."""
        package_id = draft.package_id
        if package_id not in self.packages:
            return False
        package = self.packages[package_id]
        store = package.store.node_id
        if not all(n == store or (n in self.workers and self.workers[n].alive) for n in (*draft.receivers,
                                                                                         *draft.sources)):
            return False
        if draft.transport is not None and not all(self._speaks(n, (draft.transport,))
                                                   for n in (*draft.receivers, *draft.sources)):
            return False
        plans = [p for p in self.plans.values() if p.package_id == package_id]
        receivers = set(draft.receivers)
        if any(receivers & p.parts.keys() for p in plans):
            return False
        availability = self.availability[package_id]
        if any(availability.held(n) != draft.held.get(n, frozenset()) for n in receivers):
            return False
        if receivers:
            committed = self._committed_bytes(excluding=package_id)
            reclaimable = self._reclaimable_bytes(excluding=package_id)
            if any(committed.get(n, 0) - reclaimable.get(n, 0) + package.total_bytes > self.workers[n].spec.memory_bytes
                   for n in receivers):
                return False
        # Receiving counts for a source too: the tail of a chain in progress that new receivers hang behind.
        receiving = {n for p in plans for n in p.pending}
        return all((availability.is_complete(n) or n in receiving) and (package_id, n) not in self.dropping
                   for n in (*draft.unchanged, *draft.sources) if n != store)

    def release(self, package_id: str, node_ids: Sequence[str], keep_alive_s: float, now: float) -> float:
        """Drop a package from workers: each stays a source for ``keep_alive_s`` (a later scale-up may
        take it back), then leaves the package's plans and is told to drop it. Returns the drop time. The
        package's store is refused: it is the source of the scale-ups no worker can send from."""
        store = self.package(package_id).store.node_id
        # NaN would never fall due, and neither it nor infinity could be stored and loaded again; years would be
        # a mistake (a deployment's keep-alive has the same bound) whose drop time no clock can show.
        if not math.isfinite(keep_alive_s) or not 0 <= keep_alive_s <= MAX_DURATION_S:
            raise InvalidRequest(f"release of package {package_id!r}: keep-alive must be a finite number >= 0 and "
                                 f"<= {MAX_DURATION_S:g} s, got {keep_alive_s}")
        if not node_ids:
            raise InvalidRequest(f"release of package {package_id!r}: no worker named")
        if len(set(node_ids)) != len(node_ids):
            raise InvalidRequest(f"release of package {package_id!r}: a worker is listed twice")
        availability = self.availability[package_id]
        for node in node_ids:
            if node == store:
                raise InvalidRequest(f"release of package {package_id!r} from {node!r} refused: {node!r} is its "
                                     "store node, which keeps it to send to scale-ups (removing the package "
                                     "drops it there)")
            self.alive_worker(node)
            in_plan = any(p.package_id == package_id and node in p.parts for p in self.plans.values())
            if node not in availability.by_worker and not in_plan:
                raise Conflict(f"worker {node!r} does not hold package {package_id!r}: nothing to release")
        drop_at = now + keep_alive_s
        for node in node_ids:
            if keep_alive_s == 0:
                self._drop(package_id, node)
            else:
                self.releases[package_id, node] = drop_at
                self.dirty.releases.add((package_id, node))
        return drop_at

    # ----- queries -----

    def alive_worker(self, node: str) -> Worker:
        """The worker ``node`` if it is registered and alive, else :class:`UnknownWorker`."""
        worker = self.workers.get(node)
        if worker is None or not worker.alive:
            raise UnknownWorker.named(node)
        return worker

    def registered_worker(self, node: str) -> Worker:
        """:meth:`alive_worker`, and registered with this control plane: one restored from the store is
        :class:`UnknownWorker` until it registers again, with all it holds (the reports a crashed control plane
        acknowledged but had not written are in that registration, and only there)."""
        worker = self.alive_worker(node)
        if worker.restored:
            raise UnknownWorker.restored(node)
        return worker

    def package(self, package_id: str) -> Package:
        """The published package ``package_id``, else :class:`UnknownPackage`."""
        package = self.packages.get(package_id)
        if package is None:
            raise UnknownPackage.named(package_id)
        return package

    def peer(self, node: str) -> PeerInfo:
        """How to reach ``node``: a worker, or the store of some package."""
        worker = self.workers.get(node)
        if worker is not None:
            return worker.spec.peer
        for package in self.packages.values():
            if package.store.node_id == node:
                return package.store
        return PeerInfo(node, "", ())

    def plans_of(self, node: str) -> list[str]:
        """Ids of the active plans ``node`` has a part in."""
        return [plan_id for plan_id, active in self.plans.items() if node in active.parts]

    def pipelines(self, package_id: str) -> list[tuple[Pipeline, int]]:
        """Cross-node pipelines of ``package_id`` now: :meth:`pipeline_query`, run."""
        query = self.pipeline_query(package_id)
        return query.run() if query is not None else []

    def pipeline_query(self, package_id: str) -> "PipelineQuery | None":
        """What :class:`PipelineQuery` needs of the state now, copied (None: the package has no layout).
        Its alive serving workers (those with a serve URL, bound to this package or to none) that hold part of
        the package are its candidates, and those still receiving it count with the block each receives next too."""
        package = self.package(package_id)
        if package.layout is None:
            return None
        availability = self.availability[package_id]
        # Only pipecast's serving workers run stages (a vLLM worker serves the whole model alone), each of its own
        # package only (a stage call for another one is refused).
        urls = {n: url for n, w in self.workers.items()
                if w.alive and w.spec.engine == DEFAULT_ENGINE and w.spec.serve_package in ("", package_id)
                and (url := serve_url_of(w.spec))}
        verified = {n: b for n, b in availability.by_worker.items() if n in urls and b}
        receiving: dict[str, tuple[frozenset[int], tuple[tuple[Fetch[str], ...], ...]]] = {}
        for active in self.plans.values():
            if active.package_id == package_id:
                for node in active.pending & urls.keys():  # where each goes next is found in the thread
                    have, fetches = receiving.get(node, (availability.held(node), ()))
                    receiving[node] = (have, (*fetches, active.parts[node].fetch))
        return PipelineQuery(package.layout, urls, verified, receiving)

    # ----- restoring from the store (no dirty marks, no notices) -----

    def restore_package(self, manifest: Manifest, store: PeerInfo, published_at: float) -> None:
        self.packages[manifest.package_id] = Package(manifest, store, published_at)
        self.availability[manifest.package_id] = Availability(len(manifest.blocks))

    def restore_worker(self, spec: WorkerSpec, alive: bool, now: float, grace_s: float = 0.0) -> None:
        """A worker from before a restart; an alive one gets a fresh lease, plus ``grace_s``, to register again in
        (:meth:`registered_worker`)."""
        self.workers[spec.node_id] = Worker(spec, now + self.lease_s + grace_s, alive, restored=True)

    def restore_availability(self, package_id: str, node: str, blocks: Iterable[int]) -> None:
        self.availability[package_id].add(node, blocks)

    def restore_release(self, package_id: str, node: str, drop_at: float) -> None:
        self.releases[package_id, node] = drop_at

    def restore_dropping(self, package_id: str, node: str) -> None:
        """``node`` was told to drop ``package_id`` before the restart (its registration says if it did)."""
        self.dropping.add((package_id, node))

    def restore_plan(self, plan_id: str, package_id: str, plan: Plan, *, fanout: int, created_at: float,
                     version: int, replans: int) -> None:
        availability = self.availability[package_id]
        active = ActivePlan(plan_id, package_id, plan, fanout, created_at, version, replans,
                            pending={n for n in plan.assignments if not availability.is_complete(n)},
                            parts=plan.parts())
        self.plans[plan_id] = active
        self._set_relay_caps(package_id, tell=False)  # each node hears of its plans again as its stream reconnects

    # ----- internals -----

    def _check_blocks(self, node: str, package: Package, blocks: Iterable[int]) -> None:
        for block in blocks:
            if not 0 <= block < package.num_blocks:
                raise InvalidRequest(f"worker {node!r} reported block {block} of package {package.package_id!r}, "
                                     f"which has blocks 0..{package.num_blocks - 1}")

    def _parse_reports(self, node: str, reports: Mapping[str, Iterable[int]]) -> tuple[dict[str, set[int]], list[str]]:
        """Validate a report before anything changes: block sets of known packages, unknown package ids."""
        known: dict[str, set[int]] = {}
        unknown: list[str] = []
        for package_id, blocks in reports.items():
            package = self.packages.get(package_id)
            if package is None:
                unknown.append(package_id)
                continue
            blocks = set(blocks)
            self._check_blocks(node, package, blocks)
            known.setdefault(package_id, set()).update(blocks)
        return known, unknown

    def _forget_cached(self, node: str) -> None:
        for by_node in self.cached.values():
            by_node.pop(node, None)

    def _committed_bytes(self, *, excluding: str) -> dict[str, int]:
        """Per worker, the bytes of the packages (other than ``excluding``) it holds or is receiving."""
        committed: dict[str, int] = {}
        for package_id, package in self.packages.items():
            if package_id == excluding:
                continue
            nodes = set(self.availability[package_id].by_worker)
            nodes.update(n for p in self.plans.values() if p.package_id == package_id for n in p.pending)
            for node in nodes:
                committed[node] = committed.get(node, 0) + package.total_bytes
        return committed

    def _reclaimable(self, *, excluding: str) -> dict[str, list[tuple[float, str]]]:
        """Per worker, the packages (other than ``excluding``) it gives up when a scale-up needs its memory, each
        with its rank (the first given up first): a stray copy, of a package its serving worker is bound against
        (``serve_package``: never served there; placed before its agent said what it serves, or by a scale-up not
        serving-only), held or being received, ranks first; then one kept only in a keep-alive release, due
        first. Counting a stray as committed kept the worker's own package off it, which its pool counts it free
        for: the scaling daemon asked in vain, for good."""
        reclaimable: dict[str, list[tuple[float, str]]] = {}
        for package_id, package in self.packages.items():
            if package_id == excluding:
                continue
            nodes = set(self.availability[package_id].by_worker)
            nodes.update(n for p in self.plans.values() if p.package_id == package_id for n in p.pending)
            for node in nodes - {package.store.node_id}:
                if self._bound_elsewhere(node, package_id):
                    reclaimable.setdefault(node, []).append((-math.inf, package_id))
        for (package_id, node), drop_at in self.releases.items():
            if package_id != excluding and node in self.availability[package_id].by_worker \
                    and not self._bound_elsewhere(node, package_id):  # a stray released: counted above
                reclaimable.setdefault(node, []).append((drop_at, package_id))
        return reclaimable

    def _bound_elsewhere(self, node: str, package_id: str) -> bool:
        """Whether ``node``'s serving worker is bound to a package other than ``package_id`` (``serve_package``)."""
        worker = self.workers.get(node)
        return worker is not None and worker.spec.serve_package not in ("", package_id)

    def _reclaimable_bytes(self, *, excluding: str) -> dict[str, int]:
        """Per worker, the bytes of the packages (other than ``excluding``) it gives up when a scale-up needs its
        memory (:meth:`_reclaimable`)."""
        return {node: sum(self.packages[p].total_bytes for _, p in kept)
                for node, kept in self._reclaimable(excluding=excluding).items()}

    def _reclaim(self, package: Package, receivers: Iterable[str]) -> None:
        """Drop, from each of ``receivers`` short of memory for ``package``, the packages it gives up for it
        (:meth:`_reclaimable`), the first first, until it fits: a warm copy is kept until the memory is needed."""
        committed = self._committed_bytes(excluding=package.package_id)
        short = {node: over for node in receivers
                 if (over := committed.get(node, 0) + package.total_bytes - self.workers[node].spec.memory_bytes) > 0}
        if not short:
            return
        reclaimable = self._reclaimable(excluding=package.package_id)
        for node, over in short.items():
            for drop_at, released in sorted(reclaimable.get(node, ())):
                if over <= 0:
                    break
                log.info("%s for memory package=%s node=%s (for package=%s)",
                         "keep-alive release ended early" if drop_at > -math.inf else "stray copy dropped", released,
                         node, package.package_id)
                self._drop(released, node)
                over -= self.packages[released].total_bytes

    def _partial_senders(self, package_id: str) -> dict[str, str]:
        """The workers that send blocks of ``package_id`` in a plan in progress (a holder made so by a repair)
        without holding all of it nor receiving it there, each with that plan's id; never the package's store (a
        source whatever it reported)."""
        store, availability = self.packages[package_id].store.node_id, self.availability[package_id]
        return {n: p.plan_id for p in self.plans.values() if p.package_id == package_id for n in p.parts
                if n not in p.pending and n != store and not availability.is_complete(n)}

    def _candidates(self, package_id: str, nodes: Iterable[str]) -> list[Candidate]:
        """``nodes`` (alive workers) as placement sees them for a scale-up of ``package_id``."""
        availability = self.availability[package_id]
        # A part in a plan of the package is no receiver of a new one (_draft_holds), a sender not holding all
        # of it included.
        receiving = {n for p in self.plans.values() if p.package_id == package_id for n in p.pending}
        receiving.update(self._partial_senders(package_id))
        releasing = {n for (p, n) in self.releases if p == package_id}
        committed = self._committed_bytes(excluding=package_id)
        reclaimable = self._reclaimable_bytes(excluding=package_id)
        on_disk = self.cached.get(package_id, {})
        return [Candidate(n, self.workers[n].spec.memory_bytes, committed.get(n, 0), availability.count(n),
                          availability.is_complete(n), n in receiving, n in releasing, self._rack(n),
                          len(on_disk.get(n, set()) - availability.held(n)), bool(self.workers[n].spec.serve_url),
                          reclaimable.get(n, 0), self.workers[n].spec.peer.transports,
                          self.workers[n].spec.serve_package) for n in nodes]

    def _chain_tail(self, package_id: str) -> str | None:
        """The last node of the newest active chain plan of ``package_id`` still receiving it (None if none, or if
        it is a demoted straggler)."""
        chains = [a for a in self.plans.values() if a.package_id == package_id and a.plan.strategy == "chain"
                  and a.pending]
        if not chains:
            return None
        newest = max(chains, key=lambda a: a.created_at)
        parents = {f.parent for part in newest.parts.values() for f in part.fetch}
        tails = [n for n in newest.plan.assignments if n not in parents and self.workers.get(n) is not None
                 and self.workers[n].alive]
        # A demoted straggler is last in its chain, but receivers behind it would crawl at its rate.
        return tails[0] if len(tails) == 1 and tails[0] not in newest.demoted else None

    def _pick_sources(self, package: Package, exclude: Collection[str], receivers: int | Collection[str]) -> list[str]:
        """Sources for ``receivers`` (or that many, not picked yet): :func:`pick_sources`, one per receiver at
        most, those serving no plan in progress first, then those in the receivers' racks."""
        # Availability lists alive workers only: a dead one's blocks leave it when it dies.
        holders = self.availability[package.package_id].complete_holders()
        exclude = {*exclude, *self.revoked}
        count = receivers if isinstance(receivers, int) else len(receivers)
        racks = set() if isinstance(receivers, int) else {r for n in receivers if (r := self._rack(n)) is not None}
        busy = {n for a in self.plans.values() if a.pending for n, part in a.parts.items() if part.serve}
        return pick_sources(holders, package.store.node_id, exclude, limit=min(count, MAX_PLAN_SOURCES), busy=busy,
                            near={n for n in holders if self._rack(n) in racks} if racks else ())

    def _speaks(self, node: str, transports: Collection[str]) -> bool:
        """Whether ``node`` (a worker or a store) speaks one of the data-plane ``transports``."""
        return not set(transports).isdisjoint(self.peer(node).transports)

    def _offered(self, package: Package, receivers: Collection[str] = ()) -> list[str]:
        """The transports of the nodes that may send ``package`` to ``receivers``, in order of preference: its
        store's (unless it is among them; :meth:`peer`'s, as published where it registered no agent) in their
        order, then its complete holders' others by name."""
        store = package.store.node_id
        offered = [] if store in receivers else list(self.peer(store).transports)
        spoken = {t for n in self.availability[package.package_id].complete_holders()
                  for t in self.workers[n].spec.peer.transports}
        return [*offered, *sorted(spoken - set(offered))]

    def _unheard(self, package: Package, transports: Collection[str]) -> set[str]:
        """The nodes that may send ``package`` (its store, its complete holders) that speak none of ``transports``:
        no source of a plan whose nodes speak those."""
        return {n for n in (package.store.node_id, *self.availability[package.package_id].complete_holders())
                if not self._speaks(n, transports)}

    def _plan_transports(self, active: ActivePlan, without: Collection[str] = ()) -> set[str]:
        """The data-plane transports every node of ``active`` but ``without`` (those leaving it) speaks (the one it
        was planned on, at least)."""
        spoken: set[str] | None = None
        for node in active.parts.keys() - set(without):  # the sources among them
            peer = self.peer(node)
            if peer.address:  # else no node any more: a store re-pointed away (publish), which leaves the plan
                spoken = set(peer.transports) if spoken is None else spoken.intersection(peer.transports)
        return spoken or set()

    def _senders(self, active: ActivePlan, without: Collection[str] = ()) -> dict[str, frozenset[int]]:
        """Verified blocks per node of ``active``'s package, of the nodes a re-plan of it may take a parent from:
        those speaking a transport that all of its nodes but ``without`` (those leaving it) speak (a receiver
        cannot fetch from a holder of another transport)."""
        spoken = self._plan_transports(active, without)
        return {n: blocks for n, blocks in self.availability[active.package_id].by_worker.items()
                if n not in without and n not in self.revoked and self._speaks(n, spoken)}

    def _plan_sources(self, package: Package, strategy: str, exclude: Collection[str],
                      receivers: int | Collection[str], transport: str | None = None) -> tuple[list[str], str]:
        """The sources of a new plan of ``package`` to ``receivers`` (none of ``exclude``, and with ``transport``
        only nodes speaking it; :meth:`_pick_sources`) and its strategy (``strategy``, or "chain" where it hangs
        behind a chain in progress from a store with no link to spare).

        Beside complete holders, a rotated plan (or one whose strategy is left to the state) also sends from
        the store while no plan in progress does: its egress is a source like theirs."""
        exclude = {*exclude, *self.revoked}  # a revoked store too: its agent is gone for good
        if transport is not None:
            exclude |= self._unheard(package, (transport,))
        sources = self._pick_sources(package, exclude, receivers)
        store = package.store.node_id
        if self.store_beside_holders and sources and store not in sources and store not in exclude \
                and strategy in ("", "rotated") and not self._store_busy(store):
            sources.append(store)
        from_store = sources == [store]
        spare_link = self.store_links > 1 and self._store_links_free(store) > 0
        tail = self._chain_tail(package.package_id) if strategy in ("", "chain") and from_store and not spare_link \
            else None
        if tail is not None and tail not in self.revoked and (transport is None or self._speaks(tail, (transport,))):
            # A chain is still bringing the package from the store, whose links are all taken: hang the new
            # receivers behind its last node (it forwards each chunk as it lands) instead of splitting the
            # store's egress between two plans, which would slow the first one down.
            return [tail], "chain"
        return sources, strategy

    def _source_links(self, package: Package, sources: Sequence[str], receivers: int,
                      in_flight: bool) -> dict[str, int]:
        """Links per source of a new plan: the store's links not taken by plans in progress
        (:meth:`_store_links_free`) when it has :attr:`store_links` > 1 and sends to two receivers or more,
        or to one beside receivers ``in_flight`` (alone, or beside holders while it is idle:
        :meth:`_plan_sources`)."""
        store = package.store.node_id
        if self.store_links > 1 and (receivers > 1 or in_flight) and store in sources:
            free = self._store_links_free(store)
            return {store: free} if free else {}
        return {}

    def _store_busy(self, store: str) -> bool:
        """Whether a plan in progress sends from ``store`` (the state does not track its links one by one)."""
        return any(store in a.plan.sources for a in self.plans.values() if a.pending)

    def _store_links_free(self, store: str) -> int:
        """``store``'s links not taken by plans in progress: one per receiver still fetching from it."""
        taking = {n for a in self.plans.values() for n in a.pending
                  if n in a.parts and any(f.parent == store for f in a.parts[n].fetch)}
        return max(0, self.store_links - len(taking))

    def _in_flight(self, package_id: str) -> tuple[InFlight, ...]:
        """Each receiver of ``package_id`` that an active plan still feeds: the blocks it lacks in its fetch
        order, and the bytes it holds of them, its last progress report less its verified blocks, 0 without
        a report (what ``make_plan``'s ``in_flight`` takes). Plans of more than
        :data:`INLINE_REPLAN_MAX_RECEIVERS` are left out: listing theirs would hold the event loop (the
        complement is for the small scale-ups a scaling daemon makes as the load grows)."""
        availability, sizes = self.availability[package_id], self.packages[package_id].block_bytes
        found = []
        for active in self.plans.values():
            if active.package_id != package_id or len(active.plan.assignments) > INLINE_REPLAN_MAX_RECEIVERS:
                continue
            for node in sorted(active.pending):
                have = availability.held(node)
                part = active.parts.get(node)
                if part is not None:
                    lacking = tuple(dict.fromkeys(f.block for f in part.fetch if f.block not in have))
                    samples = self.progress.get((package_id, node))
                    held = samples[-1][1] - sum(sizes[b] for b in have) if samples else 0
                    found.append(InFlight(lacking, min(max(held, 0), sum(sizes[b] for b in lacking))))
        return tuple(found)

    def _rack(self, node: str) -> str | None:
        """The ``rack`` label of ``node``, None where it has none or is no worker (a store)."""
        worker = self.workers.get(node)
        return worker.spec.labels.get(RACK_LABEL) if worker is not None else None

    def _labels(self, nodes: Iterable[str]) -> dict[str, Mapping[str, str]]:
        return {n: self.workers[n].spec.labels for n in nodes if n in self.workers}

    def _replanned(self, active: ActivePlan, plan: Plan, changed: set[str] | None = None) -> None:
        """Install ``plan`` in place of the one ``active`` runs (:meth:`_install`), counted as a re-plan."""
        self._install(active, plan, changed)
        active.replans += 1
        self.replan_count += 1

    def _install(self, active: ActivePlan, plan: Plan, changed: set[str] | None = None) -> None:
        """Make ``plan`` the plan of ``active`` and tell every node whose part changed; ``changed``: the only
        nodes whose parts may differ from the old plan's (a repair), None: any node's. Only those parts are made
        again, also where the sources changed (a source's death: every part of thousands was made again on the
        event loop, 0.39 s at 5,000 receivers), though then every node is told."""
        old = active.parts
        if changed is None:
            parts = plan.parts()
            changed = old.keys() | parts.keys()
        else:
            parts = {node: part for node, part in old.items() if node not in changed}
            parts.update(parts_of(plan, changed, old))
        # Every part's ASSIGN names the plan's sources (a receiver's fallbacks and manifest peers): with new ones, all
        # are told.
        new_sources = active.plan.sources != plan.sources
        told = old.keys() | parts.keys() if new_sources else changed
        # Every receiver's rate so far was under the old plan (its parents', or its parents' parents', now
        # differ): measured afresh once the change settled.
        for node in active.pending:
            self.progress.pop((active.package_id, node), None)
        active.changed = True
        for node in told:
            if node in old and node not in parts:
                self.notices.append(Notice(node, UpdateKind.CANCEL, active.package_id, active.plan_id))
            elif node in parts:
                if old.get(node) != parts[node] or new_sources:
                    self.notices.append(Notice(node, UpdateKind.ASSIGN, active.package_id, active.plan_id))
                if (active.package_id, node) in self.dropping:
                    self.dropping.discard((active.package_id, node))
                    self.dirty.drops.add((active.package_id, node))
        active.plan, active.parts = plan, parts
        active.version += 1
        active.pending.intersection_update(plan.assignments)
        self.plans[active.plan_id] = active
        # Where every node of it was told (a new plan, new sources), not twice.
        self._set_relay_caps(active.package_id, tell=True, told=active.plan_id if new_sources or not old else "")
        self.dirty.plans.add(active.plan_id)

    def _repair(self, active: ActivePlan, gone: set[str]) -> bool:
        """Re-plan ``active`` without the ``gone`` nodes: their children get new parents for exactly the
        blocks they still miss. False if no source is left to plan from (the plan stays as it was). A plan that
        ended meanwhile (a loop over plans that changed under it) stays ended: True, nothing to repair."""
        if self.plans.get(active.plan_id) is not active:
            return True
        package = self.packages[active.package_id]
        sources = [s for s in active.plan.sources if s not in gone]
        if not sources:
            sources = self._pick_sources(package, gone | self._unheard(package, self._plan_transports(active, gone)),
                                         active.pending)
        if not sources:
            log.warning("plan=%s package=%s cannot drop %s: no other source holds the package and speaks its "
                        "transport", active.plan_id, active.package_id, sorted(gone))
            return False
        held = self._senders(active, gone)
        nodes = set(active.parts) | set(held) | set(sources)
        labels = self._labels(nodes)
        plan, changed = repair(active.plan, dead=gone, held=held, sources=sources, labels=labels,
                               fanout=active.fanout, parts=active.parts, leaves=active.demoted - gone)
        active.pending.difference_update(gone)
        for node in gone:  # out of the plan: _install clears only the receivers left
            self.progress.pop((active.package_id, node), None)
        self._replanned(active, plan, changed)
        log.info("re-planned plan=%s package=%s without=%s version=%d pending=%d", active.plan_id,
                 active.package_id, sorted(gone), active.version, len(active.pending))
        if not active.pending:
            self._end_plan(active)
        return True

    def _readdressed(self, node: str) -> None:
        """``node`` came back at another address: in each of its plans the nodes whose parts name it get parts
        that say so (it, its parents and its children; every node where it is a source: each part lists the
        sources), not every node of the plan (thousands, each part rendered on the event loop)."""
        for active in self.plans.values():
            part = active.parts.get(node)
            if part is None:
                continue
            active.version += 1
            self.dirty.plans.add(active.plan_id)
            told = active.parts.keys() if node in active.plan.sources else sorted(
                {node, *(f.parent for f in part.fetch), *(child for _, child in part.serve)})
            for other in told:
                self.notices.append(Notice(other, UpdateKind.ASSIGN, active.package_id, active.plan_id))

    def _end_plan(self, active: ActivePlan) -> None:
        for node in active.parts:
            self.progress.pop((active.package_id, node), None)
            self.notices.append(Notice(node, UpdateKind.CANCEL, active.package_id, active.plan_id))
        del self.plans[active.plan_id]
        self.dirty.plans.add(active.plan_id)
        log.info("plan ended plan=%s package=%s replans=%d", active.plan_id, active.package_id, active.replans)

    def _receiver_done(self, package_id: str, node: str) -> None:
        self.progress.pop((package_id, node), None)
        for active in [p for p in self.plans.values() if p.package_id == package_id and node in p.pending]:
            active.pending.discard(node)
            if not active.pending:
                self._end_plan(active)

    def _remove_nodes(self, nodes: set[str], *, keep_releases: bool = False) -> None:
        """``nodes`` are gone (dead or deregistered): out of availability, releases (unless ``keep_releases``)
        and every plan."""
        for package_id, availability in self.availability.items():
            for node in nodes:
                if availability.remove_worker(node):
                    self.dirty.availability.add((package_id, node))
        for key in [] if keep_releases else [k for k in self.releases if k[1] in nodes]:
            del self.releases[key]
            self.dirty.releases.add(key)
        # Of every package, also where _repair keeps them (no other source): node ids churn, samples would pile up.
        self.progress = {k: samples for k, samples in self.progress.items() if k[1] not in nodes}
        for active in list(self.plans.values()):
            gone = nodes & (active.parts.keys() | active.plan.held.keys())  # a holder serving no child has no part
            if gone:
                self._repair(active, gone)

    def _clear_dropping(self, node: str, keep: Collection[str] = ()) -> None:
        """``node`` is no longer being dropped from any package but those of ``keep``."""
        gone = {k for k in self.dropping if k[1] == node and k[0] not in keep}
        if gone:
            self.dropping -= gone
            self.dirty.drops |= gone

    def _drop(self, package_id: str, node: str) -> None:
        """``node`` no longer holds ``package_id``: out of its availability and plans, and told to drop it."""
        if self.releases.pop((package_id, node), None) is not None:
            self.dirty.releases.add((package_id, node))
        if self.availability[package_id].remove_worker(node):
            self.dirty.availability.add((package_id, node))
        for active in [p for p in self.plans.values() if p.package_id == package_id
                       and (node in p.parts or node in p.plan.held)]:
            self._repair(active, {node})
        self.dropping.add((package_id, node))
        self.dirty.drops.add((package_id, node))
        self.notices.append(Notice(node, UpdateKind.DROP, package_id))
        log.info("dropped package=%s node=%s", package_id, node)
