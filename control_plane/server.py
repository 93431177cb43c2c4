"""The control plane server: the ControlPlane service, the health service, auth and TLS, the lease
scanner, the database flusher and the Prometheus endpoint, started and stopped together.

With a shared database (PostgreSQL) the server is one of several replicas: it serves only while it holds the
control plane lease (see :mod:`control_plane.store`), trying to take it every ``lease_s / 3``; a standby
answers every call UNAVAILABLE naming the leader (:mod:`control_plane.leadership`). A standby that takes the
lease loads the state from the database, as a restarted control plane does (workers' leases and availability
are rebuilt from the agents' registrations and reports), and starts serving. A leader that cannot renew its
lease, or whose write is refused as fenced, steps down at once: it stops serving and sets :attr:`deposed`
(``pipecast control-plane`` then exits with the reason, and its supervisor restarts it as a standby). So does
a leader whose lease is about to lapse while its renewal has not come back (stuck behind a slow commit or
database): it does not serve past the expiry it last secured, when a standby may take the lease over. That
expiry is timed by the replica's monotonic clock from when it sent the renewal that secured it (the lease itself
lapses by the database's clock, later), so no step of its wall clock keeps it leading.
"""

import asyncio
import inspect
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import start_http_server

from control_plane.auth import TokenAuthInterceptor, server_credentials
from control_plane.decoding import DecodeGuard
from control_plane.client import MAX_RECONNECT_BACKOFF_S
from control_plane.convert import MAX_MESSAGE_BYTES
from control_plane.deployments import DeploymentBook
from control_plane.errors import ControlPlaneError, InvalidRequest, StoreError
from control_plane.health import HealthService
from control_plane.leadership import StandbyGate
from control_plane.metrics import ControlMetrics
from control_plane.service import ControlPlaneService, host_port
from control_plane.planner.stragglers import StragglerPolicy
from control_plane.state import ControlState
from control_plane.store import FencedError, Lease, is_postgres_url, open_store
from pipecast.core.credentials import check_master_token, warn_if_auth_off, warn_if_cleartext
from pipecast.core.settings import Settings, SettingsError
from pipecast.v1 import control_pb2, control_pb2_grpc

log = logging.getLogger(__name__)

MAX_PENDING_CALLS = 100_000
SERVICE_NAME = control_pb2.DESCRIPTOR.services_by_name["ControlPlane"].full_name
GRPC_OPTIONS = [
    # gRPC binds with SO_REUSEPORT by default: a second control plane on the same port started too, and the kernel
    # split the clients between the two.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Clients ping idle assignment streams (see client.CHANNEL_OPTIONS); allow it.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
    # And never answer a client's pings with GOAWAY "too_many_pings": measured, a client idle between unary
    # calls for ~100 s (the surge benchmark's driver) had its next call fail UNAVAILABLE after the client's
    # keepalive and BDP pings counted as strikes.
    ("grpc.http2.max_ping_strikes", 0),
    # The server pings too: a connection whose node vanished (host down, partitioned) ends within ~30 s, and the
    # handlers of its streams with it, not after the 2 hours of gRPC's default.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Calls the server has received but not yet taken up: grpcio's limits (1,000, hard 3,000) cancel the rest
    # of a burst, e.g. every agent of a large fleet opening its assignment stream at once after a restart
    # (measured: of 5,000 streams opened together ~2,000 came back CANCELLED; none with these).
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]


# Twice the clients' longest reconnect backoff: room for its jitter and one heartbeat.
RESTART_LEASE_GRACE_S = 2 * MAX_RECONNECT_BACKOFF_S


class ServerStartError(ControlPlaneError):
    """The server could not listen where it was told to (address in use, bad host)."""


@dataclass
class ServerConfig:
    """How to run the control plane; :meth:`from_settings` maps pipecast's settings onto it."""

    host: str = "127.0.0.1"
    port: int = 7000
    db_path: Path | str = ":memory:"  # a SQLite path, or a postgresql:// URL (replicas; control_plane.store)
    advertise: str | None = None  # host:port clients reach this replica at (None: the host:port it listens on)
    token: str = ""  # the master token (empty: auth off); node tokens are derived from it
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    lease_s: float = 10.0
    heartbeat_s: float = 2.0
    scan_interval_s: float | None = None  # None: min(heartbeat_s, lease_s / 4)
    flush_interval_s: float = 0.5
    metrics_port: int | None = None  # None: no Prometheus endpoint; 0: any free port
    store_links: int = 1  # a store's egress in worker links (see ControlState)
    store_beside_holders: bool = True  # a rotated scale-up also sends from an idle store (see ControlState)
    straggler_factor: float = 0.5  # 0: stragglers are not looked for (see ControlState)
    straggler_window_s: float = 0.4

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> "ServerConfig":
        config = cls(host=settings.control_host, port=settings.control_port, db_path=settings.control_db,
                     advertise=settings.control_advertise or None,
                     token=settings.auth_token, tls_cert=settings.tls_cert, tls_key=settings.tls_key,
                     tls_ca=settings.tls_ca, lease_s=settings.lease_s, heartbeat_s=settings.heartbeat_s,
                     scan_interval_s=settings.control_scan_s, flush_interval_s=settings.control_flush_s,
                     metrics_port=settings.control_metrics_port, store_links=settings.control_store_links,
                     store_beside_holders=settings.control_store_beside_holders,
                     straggler_factor=settings.control_straggler_factor,
                     straggler_window_s=settings.control_straggler_window_s)
        for key, value in overrides.items():
            if value is not None:
                setattr(config, key, value)
        return config

    @property
    def scan_s(self) -> float:
        return self.scan_interval_s or min(self.heartbeat_s, self.lease_s / 4)

    def check(self) -> None:
        """Refuse (:class:`SettingsError`) settings that cannot work together: a lease shorter than two
        heartbeats lapses whenever one heartbeat is late (or between any two), and every worker re-registers
        again and again."""
        if self.heartbeat_s > self.lease_s / 2:
            raise SettingsError(f"heartbeat_s {self.heartbeat_s:g} is more than half of lease_s {self.lease_s:g}: "
                                "workers' leases would lapse between heartbeats; make lease_s at least twice "
                                "heartbeat_s")
        if self.scan_s > self.lease_s / 4:
            raise SettingsError(f"control_scan_s {self.scan_s:g} is more than a quarter of lease_s {self.lease_s:g}: "
                                "lapsed leases would be found late, and a gap of half a lease between scans is taken "
                                "for time the control plane did not watch")


class ControlPlaneServer:
    """One control plane: ``async with ControlPlaneServer(config) as server:`` serves on ``server.port``
    (with a shared database: once it leads; see the module docstring)."""

    def __init__(self, config: ServerConfig, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        """``clock``: the wall clock (workers' leases, releases); ``monotonic``: what times this replica's own
        hold on the control plane lease (the lease itself runs by the database's clock)."""
        check_master_token(config.token)
        config.check()
        self.config = config
        self.clock = clock
        self.monotonic = monotonic
        self.port = 0
        self.metrics_port: int | None = None
        self.advertise = ""
        self.holder = ""  # who holds the lease, in the database and in messages: set by start()
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self._stepping_down: asyncio.Task | None = None
        self._health = HealthService(("", SERVICE_NAME))
        self._metrics_httpd: Any = None
        self._credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_ca)
        self.gate = StandbyGate()
        #: Set when this replica stepped down (lost the lease or was fenced); :attr:`deposed_reason` says why.
        self.deposed = asyncio.Event()
        self.deposed_reason = ""
        self._lease: Lease | None = None  # the lease last taken or renewed (shared database)
        self.state = ControlState(lease_s=config.lease_s, store_links=config.store_links,
                                  store_beside_holders=config.store_beside_holders,
                                  stragglers=StragglerPolicy(config.straggler_factor, config.straggler_window_s))
        # A SQLite file this start creates is deleted if the start fails (found in review: a busy port left a new,
        # empty database and its lock file behind).
        self._new_file = None if is_postgres_url(config.db_path) or Path(config.db_path).exists() else \
            Path(config.db_path).resolve()
        self.store = open_store(config.db_path)
        self.book = DeploymentBook()
        self.metrics = ControlMetrics(self.state)
        self.metrics.watch_leadership(lambda: self.gate.leading)
        self.service = ControlPlaneService(self.state, self.metrics, heartbeat_s=config.heartbeat_s,
                                           store=self.store, clock=clock, master=config.token, book=self.book,
                                           on_fenced=self._fenced)
        if not self.store.shared:  # the only control plane on its file: it leads from the start
            try:
                self._load()
            except BaseException:  # else the file's lock stays held: a retry in this process found it in use
                self.store.close()
                raise

    def _abandon_start(self) -> None:
        """Close the store of a start that failed, and delete the SQLite file it created (and its lock): deleted
        first, while its lock is held (found in review: closed first, another process could open the path in between,
        and lose its new database)."""
        if self._new_file is not None:
            for path in (self._new_file, *(self._new_file.with_name(self._new_file.name + end)
                                           for end in ("-wal", "-shm", "-journal", ".lock"))):
                path.unlink(missing_ok=True)
        self.store.close()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def leading(self) -> bool:
        """Whether this control plane serves now (with a shared database: holds the lease)."""
        return self.gate.leading

    def _load(self) -> None:
        self._read_store()
        self.service.state_loaded()

    async def _load_keeping(self, fencing: int) -> None:
        """Load the state in a thread, renewing the lease (under ``fencing``) every third of its term meanwhile: the
        rows are decoded after the load's transaction, and decoding plans of thousands of receivers can outlast a
        lease (found in review: 11.5 s for five plans of 5,000 receivers, past the default 10 s lease, which another
        replica could then take, and the next load lose it too)."""
        loading = asyncio.ensure_future(asyncio.to_thread(self._read_store))
        while not loading.done():
            await asyncio.wait({loading}, timeout=self.config.lease_s / 3)
            if loading.done():
                break
            try:
                lease = await asyncio.to_thread(self.store.acquire_or_renew, self.holder, self.advertise,
                                                self.config.lease_s, self.monotonic)
            except StoreError as exc:  # the renewal after the load says so, or takes it again
                log.warning("control plane %s cannot renew its lease while loading the state: %s", self.holder, exc)
                continue
            if lease is None or lease.fencing != fencing:  # lost: not taken again meanwhile; the step-down follows
                log.warning("control plane %s lost its lease while loading the state", self.holder)
                break
        await loading

    def _read_store(self) -> None:
        """Fill the (empty) state and book from the store; a standby taking over does it in a thread (~3 s
        with plans of thousands of receivers), which is safe: until it leads, no call touches them."""
        # Workers notice the restart (or the new leader) only when their reconnect backoff ends: a lease
        # shorter than that must not mark them dead before they are back.
        self.store.load(self.state, self.clock(), lease_grace_s=RESTART_LEASE_GRACE_S)
        self.store.load_book(self.book)

    async def start(self) -> None:
        config, credentials = self.config, self._credentials
        auth_off = warn_if_auth_off(config.token, "control plane")
        warn_if_cleartext(config.token, credentials is not None, "control plane")
        # Auth first: a standby names the leader only to callers with a valid token; a request is parsed (and
        # refused if it does not) only for a caller let through.
        interceptors: list[grpc.aio.ServerInterceptor] = [] if auth_off else [
            TokenAuthInterceptor(config.token, self.metrics.refused_calls)]
        interceptors += [self.gate, DecodeGuard()]
        server = grpc.aio.server(interceptors=interceptors, options=GRPC_OPTIONS)
        control_pb2_grpc.add_ControlPlaneServicer_to_server(self.service, server)
        server.add_generic_rpc_handlers((self._health.handler(),))
        listen = f"{config.host}:{config.port}"
        try:
            port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
        except RuntimeError as exc:
            port, reason = 0, str(exc)
        else:
            reason = "address in use or not local"
        if port == 0:
            self._abandon_start()
            raise ServerStartError(f"control plane cannot listen on {listen}: {reason}")
        self.port = port
        self.advertise = config.advertise or self.address
        try:
            host_port(self.advertise, "advertised address")
        except InvalidRequest as exc:
            self._abandon_start()
            raise ServerStartError(f"control plane cannot advertise itself: {exc}") from None
        # Unique per process: a restarted replica is a new holder, with a new fencing number.
        self.holder = f"{self.advertise}#{secrets.token_hex(4)}"
        self.gate.advertise = self.advertise
        if config.metrics_port is not None:
            self.metrics.bind(asyncio.get_running_loop())
            try:
                self._metrics_httpd, _ = start_http_server(config.metrics_port, config.host, self.metrics.registry)
            except OSError as exc:
                self._abandon_start()
                raise ServerStartError(f"control plane cannot serve metrics on {config.host}:{config.metrics_port}: "
                                       f"{exc.strerror or exc}") from exc
            self.metrics_port = self._metrics_httpd.server_port
        if self.store.shared:
            await self._health.set(False)
        else:
            await self._lead()
        await server.start()
        self._server = server
        if self.store.shared:
            await self._campaign()
            self._tasks.append(asyncio.create_task(self._campaign_loop(), name="leadership"))
        log.info("control plane started address=%s advertise=%s role=%s tls=%s mtls=%s auth=%s db=%s lease_s=%.1f "
                 "scan_s=%.2f metrics_port=%s store_links=%d",
                 self.address, self.advertise, "leader" if self.leading else "standby", credentials is not None,
                 config.tls_ca is not None, bool(config.token), self.store.where, config.lease_s, config.scan_s,
                 self.metrics_port, config.store_links)

    async def _lead(self) -> None:
        """Serve: the gate opens, health says SERVING, the lease scan and the flusher start."""
        self.gate.leading = True
        await self._health.set(True)
        self._tasks += [
            asyncio.create_task(self._every(self.config.scan_s, self._scan), name="lease-scan"),
            asyncio.create_task(self._every(self.config.flush_interval_s, self.service.flush_encoded), name="flush")]

    # ----- leadership (shared database) -----

    async def _campaign_loop(self) -> None:
        while not self.deposed.is_set():
            await asyncio.sleep(self.config.lease_s / 3)
            try:
                await self._campaign()
            except Exception as exc:  # a bug or a row nothing checked: stopped, not a standby that never campaigns
                log.exception("control plane %s: its campaign for the lease failed", self.holder)
                self._step_down(f"control plane {self.holder}: its campaign for the lease failed: {exc!r}")

    async def _campaign(self) -> None:
        """Take or renew the lease: a standby that gets it takes over, a leader that does not steps down."""
        try:
            # In a thread: the store may be busy with a flush's commit, or the database slow to answer, and the
            # event loop serves meanwhile (and steps down if that outlasts the lease: _scan). The clock, not its
            # reading now: the lease's deadline runs lease_s from when the store sends the renewal.
            lease = await asyncio.to_thread(self.store.acquire_or_renew, self.holder, self.advertise,
                                            self.config.lease_s, self.monotonic)
            if lease is None:
                self.gate.leader = await asyncio.to_thread(self.store.leader)
        except StoreError as exc:
            if self.leading:
                self._step_down(f"control plane {self.holder} cannot renew its lease: {exc}")
            else:
                log.warning("standby %s cannot take the lease: %s", self.holder, exc)
            return
        if self.leading and lease is not None and self._lease is not None and lease.fencing != self._lease.fencing:
            # The lease lapsed and another replica held it (and may have written) before this one took it back:
            # its state is stale.
            self._step_down(f"control plane {self.holder} held the lease again under fencing number "
                            f"{lease.fencing}, not {self._lease.fencing}: another replica led meanwhile")
            await asyncio.to_thread(self._release_lease)
            return
        self._lease = lease
        if lease is None and self.leading:
            address, fencing = self.gate.leader
            self._step_down(f"control plane {self.holder} lost its lease to {address} (fencing number {fencing})")
        elif lease is not None and not self.leading:
            log.warning("control plane %s took the lease (fencing number %d): loading the state from %s",
                        self.holder, lease.fencing, self.store.where)
            taken = lease.fencing
            try:
                await self._load_keeping(taken)
                self.service.state_loaded()
            except StoreError as exc:
                self._step_down(f"control plane {self.holder} took the lease but cannot load the state: {exc}")
                return
            # The load takes seconds with thousands of plans: by now the lease taken before it may be so near its
            # end that the scan would step down at once. Renewed first, it runs a full term from here.
            try:
                lease = await asyncio.to_thread(self.store.acquire_or_renew, self.holder, self.advertise,
                                                self.config.lease_s, self.monotonic)
            except StoreError as exc:
                self._step_down(f"control plane {self.holder} loaded the state but cannot renew its lease: {exc}")
                return
            if lease is None or lease.fencing != taken:  # another replica led (and wrote) meanwhile: stale state
                self._step_down(f"control plane {self.holder} lost its lease while loading the state")
                # Taken again under another number (lapsed meanwhile): given up, so another standby takes it now,
                # not a lease later (found in review).
                await asyncio.to_thread(self._release_lease)
                return
            self._lease = lease
            await self._lead()
            log.warning("control plane %s leads: packages=%d workers=%d plans=%d deployments=%d", self.holder,
                        len(self.state.packages), len(self.state.workers), len(self.state.plans),
                        len(self.book.deployments))

    def _scan(self) -> None:
        """The lease scan, after checking that this replica's own lease runs on."""
        lease = self._lease
        # The margin is the scan's own period: the last check before the expiry comes before it, so the leader
        # stops serving before a standby may take the lease (a renewal in flight may yet come back: too late).
        # At most lease_s / 4: renewed every lease_s / 3, a healthy leader's lease never comes that close.
        margin = min(self.config.scan_s, self.config.lease_s / 4)
        if lease is not None and self.monotonic() >= lease.deadline - margin:
            self._step_down(f"control plane {self.holder} could not renew its lease (fencing number {lease.fencing}) "
                            "before it lapses")
            return
        self.service.tick()

    def _release_lease(self) -> None:
        try:
            self.store.release(self.holder)
        except StoreError as exc:
            log.warning("control plane %s cannot give up its lease (it lapses in lease_s): %s", self.holder, exc)

    def _fenced(self, error: FencedError) -> None:
        self._step_down(str(error))

    def _step_down(self, reason: str) -> None:
        """Stop serving at once (another replica leads, or may): calls and open streams end, and
        :attr:`deposed` is set; nothing more is written."""
        if self.deposed.is_set():
            return
        log.error("%s: stepping down", reason)
        self.gate.leading = False
        self.service.deposed = True
        self.deposed_reason = reason
        self.deposed.set()
        self._stepping_down = asyncio.get_running_loop().create_task(self._stop_serving(), name="step-down")

    async def _stop_serving(self) -> None:
        await self._health.set(False)
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            await self._server.stop(0)
            self._server = None

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (open streams end after ``grace_s``), then write the state out and close."""
        await self._health.stop()
        if self._stepping_down is not None:
            await self._stepping_down
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._server is not None:
            await self.service.end_streams(grace_s)
            await self._server.stop(grace_s)
            self._server = None
        await self.service.former.close()
        if self._metrics_httpd is not None:
            await asyncio.to_thread(self._metrics_httpd.shutdown)  # waits for its poll (0.5 s)
            self._metrics_httpd.server_close()
            self._metrics_httpd = None
        try:
            if self.leading:  # a deposed or standby replica writes nothing
                self.service.flush()
            # A standby takes over at once, not when the lease lapses; also the lease a renewal still under way at
            # a step-down took again (its thread outlived the campaign: the release waits for it). The store gives
            # up only a lease this replica holds.
            self._release_lease()
        finally:
            self.gate.leading = False
            self.store.close()
        log.info("control plane stopped address=%s", self.address)

    async def __aenter__(self) -> "ControlPlaneServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _every(self, interval_s: float, step: Callable[[], object]) -> None:
        # A failing step is logged and retried next time: a dead scanner would silently stop expiring leases.
        # With its traceback when the failure is new, in one line while it repeats (a full disk failed every flush
        # with a 30-line traceback twice a second, onto that disk).
        name, last = getattr(step, "__name__", step), ""
        while True:
            await asyncio.sleep(interval_s)
            try:
                done = step()
                if inspect.isawaitable(done):
                    await done
            except Exception as exc:
                if repr(exc) != last:
                    log.exception("periodic %s failed", name)
                else:
                    log.debug("periodic %s failed again: %r", name, exc)
                last = repr(exc)
            else:
                if last:
                    log.warning("periodic %s works again", name)
                last = ""
