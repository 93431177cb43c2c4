"""The control plane server: the ControlPlane service, the health service, auth and TLS, the lease
scanner, the SQLite flusher and the Prometheus endpoint, started and stopped together."""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from control_plane.auth import TokenAuthInterceptor, server_credentials
from control_plane.client import MAX_RECONNECT_BACKOFF_S
from control_plane.convert import MAX_MESSAGE_BYTES
from control_plane.deployments import DeploymentBook
from control_plane.errors import ControlPlaneError
from control_plane.metrics import ControlMetrics
from control_plane.service import ControlPlaneService
from control_plane.state import ControlState
from control_plane.store_sqlite import SqliteStore
from pipecast.core.credentials import warn_if_auth_off
from pipecast.core.settings import Settings
from pipecast.v1 import control_pb2, control_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = control_pb2.DESCRIPTOR.services_by_name["ControlPlane"].full_name
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Clients ping idle assignment streams (see client.KEEPALIVE_OPTIONS); allow it.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
    # And never answer a client's pings with GOAWAY "too_many_pings": measured, a client idle between unary
    # calls for ~100 s (the surge benchmark's driver) had its next call fail UNAVAILABLE after the client's
    # keepalive and BDP pings counted as strikes.
    ("grpc.http2.max_ping_strikes", 0),
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
    db_path: Path | str = ":memory:"
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

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> "ServerConfig":
        config = cls(host=settings.control_host, port=settings.control_port, db_path=settings.control_db,
                     token=settings.auth_token, tls_cert=settings.tls_cert, tls_key=settings.tls_key,
                     tls_ca=settings.tls_ca, lease_s=settings.lease_s, heartbeat_s=settings.heartbeat_s,
                     scan_interval_s=settings.control_scan_s, flush_interval_s=settings.control_flush_s,
                     metrics_port=settings.control_metrics_port, store_links=settings.control_store_links,
                     store_beside_holders=settings.control_store_beside_holders)
        for key, value in overrides.items():
            if value is not None:
                setattr(config, key, value)
        return config

    @property
    def scan_s(self) -> float:
        return self.scan_interval_s or min(self.heartbeat_s, self.lease_s / 4)


class ControlPlaneServer:
    """One control plane: ``async with ControlPlaneServer(config) as server:`` serves on ``server.port``."""

    def __init__(self, config: ServerConfig, *, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock
        self.port = 0
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self._health = health_aio.HealthServicer()
        self._metrics_httpd: Any = None
        self._credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_ca)
        self.state = ControlState(lease_s=config.lease_s, store_links=config.store_links,
                                  store_beside_holders=config.store_beside_holders)
        self.store = SqliteStore(config.db_path)
        # Workers notice the restart only when their reconnect backoff ends: a lease shorter than that
        # must not mark them dead before they are back.
        self.store.load(self.state, clock(), lease_grace_s=RESTART_LEASE_GRACE_S)
        self.book = DeploymentBook()
        self.store.load_book(self.book)
        self.metrics = ControlMetrics(self.state)
        self.service = ControlPlaneService(self.state, self.metrics, heartbeat_s=config.heartbeat_s,
                                           store=self.store, clock=clock, master=config.token, book=self.book)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        config, credentials = self.config, self._credentials
        auth_off = warn_if_auth_off(config.token, "control plane")
        interceptors = [] if auth_off else [TokenAuthInterceptor(config.token)]
        server = grpc.aio.server(interceptors=interceptors, options=GRPC_OPTIONS)
        control_pb2_grpc.add_ControlPlaneServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        listen = f"{config.host}:{config.port}"
        try:
            port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
        except RuntimeError as exc:
            port, reason = 0, str(exc)
        else:
            reason = "address in use or not local"
        if port == 0:
            self.store.close()
            raise ServerStartError(f"control plane cannot listen on {listen}: {reason}")
        if config.metrics_port is not None:
            try:
                self._metrics_httpd, _ = start_http_server(config.metrics_port, config.host, self.metrics.registry)
            except OSError as exc:
                self.store.close()
                raise ServerStartError(f"control plane cannot serve metrics on {config.host}:{config.metrics_port}: "
                                       f"{exc.strerror or exc}") from exc
            self.metrics_port = self._metrics_httpd.server_port
        await server.start()
        self._server, self.port = server, port
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._tasks = [asyncio.create_task(self._every(config.scan_s, self.service.tick), name="lease-scan"),
                       asyncio.create_task(self._every(config.flush_interval_s, self.service.flush), name="flush")]
        log.info("control plane serving address=%s tls=%s mtls=%s auth=%s db=%s lease_s=%.1f scan_s=%.2f "
                 "metrics_port=%s store_links=%d",
                 self.address, credentials is not None, config.tls_ca is not None, bool(config.token),
                 config.db_path, config.lease_s, config.scan_s, self.metrics_port, config.store_links)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (open streams end after ``grace_s``), then write the state out and close."""
        await self._health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._metrics_httpd is not None:
            await asyncio.to_thread(self._metrics_httpd.shutdown)  # waits for its poll (0.5 s)
            self._metrics_httpd.server_close()
            self._metrics_httpd = None
        try:
            self.service.flush()
        finally:
            self.store.close()
        log.info("control plane stopped address=%s", self.address)

    async def __aenter__(self) -> "ControlPlaneServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _every(self, interval_s: float, step: Callable[[], object]) -> None:
        # A failing step is logged and retried next time: a dead scanner would silently stop expiring leases.
        while True:
            await asyncio.sleep(interval_s)
            try:
                step()
            except Exception:
                log.exception("periodic %s failed", getattr(step, "__name__", step))
