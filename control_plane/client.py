"""A typed async client of the control plane, for agents and the CLI.

Every unary call has a deadline (``timeout_s``) and raises :mod:`control_plane.errors` on failure: the
server's own error class and message, :class:`Unauthenticated` for a refused token,
:class:`PermissionDenied` for a call the token does not allow (another node's, an operator's), or
:class:`ControlPlaneUnavailable` naming the call that went unanswered. The assignment stream has no
deadline (it lives as long as the worker); HTTP/2 keepalive pings end it with ControlPlaneUnavailable
within about ``KEEPALIVE_S`` seconds if the server vanishes. Worker-facing calls take and return the
value types of :mod:`control_plane.messages`; operator listings return the protobuf messages as they are.
"""

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from control_plane.auth import auth_metadata, channel_credentials
from control_plane.convert import (
    MAX_MESSAGE_BYTES,
    blocks_to_proto,
    deployment_from_proto,
    deployment_to_proto,
    peer_from_proto,
    peer_to_proto,
    route_change_to_proto,
    route_from_proto,
    scale_event_from_proto,
    scale_event_to_proto,
    spec_to_proto,
    update_from_proto,
)
from control_plane.deployments import Deployment, ScaleEvent
from control_plane.routes import ModelRoute, RouteChange
from control_plane.errors import LEADER_TRAILER, REQUEST_ID_KEY, ControlPlaneUnavailable, error_from_rpc
from control_plane.messages import AssignmentUpdate, PeerInfo, WorkerSpec
from pipecast.core.credentials import check_client_token, warn_if_cleartext
from pipecast.core.settings import Settings
from pipecast.v1 import control_pb2 as pb
from pipecast.v1 import control_pb2_grpc
from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)

KEEPALIVE_S = 10.0
#: Between two passes over the replicas, when every one was down or a standby (a takeover under way), s.
REPLICA_PASS_PAUSE_S = 0.5
# The longest a client waits between attempts to reconnect after an outage (gRPC adds +-20% jitter).
MAX_RECONNECT_BACKOFF_S = 5.0
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    # After an outage the channel retries the connection with exponential backoff; capped low so that
    # agents are back within seconds of a control plane restart (gRPC's default cap is 120 s).
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF_S * 1000)),
]


@dataclass(frozen=True)
class Registration:
    """The server's answer to a registration: the lease, the heartbeat interval it expects, held
    packages it does not know (the worker may drop them), and the data-plane key (b"" with auth off)."""

    lease_s: float
    heartbeat_s: float
    unknown_packages: tuple[str, ...]
    data_key: bytes


@dataclass(frozen=True)
class Availability:
    """Both maps of one package, as the control plane knows them."""

    package_id: str
    num_blocks: int
    by_worker: dict[str, frozenset[int]]
    by_block: list[frozenset[str]]


def control_plane_addresses(target: str) -> tuple[str, ...]:
    """The addresses of ``target``: one "host:port", or several separated by commas (replicas)."""
    addresses = tuple(dict.fromkeys(a.strip() for a in target.split(",") if a.strip()))
    if not addresses:
        raise ControlPlaneUnavailable(f"no control plane address in {target!r}")
    for address in addresses:  # gRPC would take port 70000 as 4464 (mod 65536) and reach another service
        host, sep, port = address.rpartition(":")
        # "http://cp:7000" passed as host "http://cp" and failed at each call, on its name
        if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ControlPlaneUnavailable(f"control plane address {address!r} is not a host:port address (port "
                                          f"1-65535)")
    return addresses


class ControlPlaneClient:
    """Channels to the control plane at ``target``: "host:port", or the replicas' addresses separated by
    commas. A call goes to the replica that answered last; one that answers UNAVAILABLE (a standby, which
    names the leader in the ``pipecast-leader`` trailer, or a replica that is down) sends the call on to
    the leader it names, else to the next address, within the call's deadline. Use as ``async with``."""

    def __init__(self, target: str, *, token: str = "", credentials: grpc.ChannelCredentials | None = None,
                 timeout_s: float = 5.0):
        self.target = target
        self.addresses = control_plane_addresses(target)
        self.timeout_s = timeout_s
        self._metadata = auth_metadata(check_client_token(token))
        self._credentials = credentials
        warn_if_cleartext(token, credentials is not None, "control plane client")
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, control_pb2_grpc.ControlPlaneStub] = {}
        self.current = self.addresses[0]

    @property
    def _stub(self) -> control_pb2_grpc.ControlPlaneStub:
        """The stub of the replica that answered last (streams open there)."""
        return self._stub_of(self.current)

    def _stub_of(self, address: str) -> control_pb2_grpc.ControlPlaneStub:
        stub = self._stubs.get(address)
        if stub is None:
            credentials = self._credentials
            channel = (grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS) if credentials
                       else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
            self._channels[address] = channel
            stub = self._stubs[address] = control_pb2_grpc.ControlPlaneStub(channel)
        return stub

    @classmethod
    def from_settings(cls, settings: Settings) -> "ControlPlaneClient":
        """A client of ``settings.control_plane`` with the token, TLS files and RPC timeout set there
        (TLS is on when any tls_* is set: tls_ca verifies the server, tls_cert/tls_key are ours for mTLS)."""
        return cls(settings.control_plane, token=settings.auth_token, timeout_s=settings.rpc_timeout_s,
                   credentials=channel_credentials(settings.tls_ca, settings.tls_cert, settings.tls_key))

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self._channels.values()))

    async def __aenter__(self) -> "ControlPlaneClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        address, tried = self.current, []
        metadata = (*self._metadata, (REQUEST_ID_KEY, uuid.uuid4().hex))  # one id for every try of this call
        while True:
            try:
                reply = await getattr(self._stub_of(address), method)(
                    request, timeout=max(deadline - loop.time(), 0.0), metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                tried.append(address)
                address = self._next_replica(exc, tried)
                if (address is None and len(self.addresses) > 1 and exc.code() == grpc.StatusCode.UNAVAILABLE
                        and loop.time() + REPLICA_PASS_PAUSE_S < deadline):
                    # Every replica was down or a standby: during a takeover (a lease's length at most) one of
                    # them leads soon. Another pass within the deadline, rather than failing at once.
                    log.info("control plane %s: no replica leads (a takeover?); another pass in %g s", method,
                             REPLICA_PASS_PAUSE_S)
                    await asyncio.sleep(REPLICA_PASS_PAUSE_S)
                    address, tried = self.addresses[0], []
                    continue
                if address is None or loop.time() >= deadline:
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and len(self.addresses) > 1:
                        # A replica frozen (a paused VM, a partition): not retried within this call (a change
                        # may yet have been made there), but the next call goes to the next replica: every call
                        # went on to the frozen one, for a minute past another's takeover.
                        self.current = self.addresses[(self.addresses.index(tried[-1]) + 1) % len(self.addresses)] \
                            if tried[-1] in self.addresses else self.addresses[0]
                    raise error_from_rpc(exc, target=self.target, method=method) from None
                log.info("control plane %s: %s unavailable, trying %s", method, tried[-1], address)
                continue
            self.current = address
            return reply

    def _next_replica(self, exc: grpc.aio.AioRpcError, tried: list[str]) -> str | None:
        """Where a call that ``exc`` ended goes next: the leader a standby named, else an address not tried
        yet; None when the error is the server's answer (not UNAVAILABLE) or every replica was tried."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        leader = dict(exc.trailing_metadata() or ()).get(LEADER_TRAILER, "")
        if leader and leader not in tried:
            return leader
        return next((a for a in self.addresses if a not in tried), None)

    # ----- workers -----

    async def register(self, spec: WorkerSpec, held: Mapping[str, Iterable[int]] | None = None,
                       cached: Mapping[str, Iterable[int]] | None = None) -> Registration:
        """Register (or re-register) a worker; ``held`` is every verified block it holds now, per package,
        ``cached`` those in its disk cache only."""
        reply = await self._call("Register", pb.RegisterRequest(worker=spec_to_proto(spec),
                                                                held=blocks_to_proto(held or {}),
                                                                cached=blocks_to_proto(cached or {})))
        return Registration(reply.lease_s, reply.heartbeat_s, tuple(reply.unknown_packages), reply.data_key)

    async def heartbeat(self, node_id: str) -> float:
        """Renew the lease; returns its length. :class:`UnknownWorker` means: register again."""
        return (await self._call("Heartbeat", pb.HeartbeatRequest(node_id=node_id))).lease_s

    async def deregister(self, node_id: str) -> None:
        await self._call("Deregister", pb.DeregisterRequest(node_id=node_id))

    async def list_workers(self) -> list[pb.WorkerState]:
        return (await self.list_workers_keyed())[0]

    async def list_workers_keyed(self) -> tuple[list[pb.WorkerState], bytes]:
        """Every registered worker, and the serving key that requests to their serving workers present
        (b"" with auth off): what a router needs."""
        answer = await self._call("ListWorkers", pb.ListWorkersRequest())
        return list(answer.workers), answer.serving_key

    # ----- packages -----

    async def publish_package(self, manifest: Manifest, store: PeerInfo) -> str:
        """Publish a package served by ``store``; returns its id."""
        request = pb.PublishPackageRequest(manifest=manifest, store=peer_to_proto(store))
        return (await self._call("PublishPackage", request)).package_id

    async def get_package(self, package_id: str) -> tuple[Manifest, PeerInfo]:
        """A package's manifest and its store."""
        reply = await self._call("GetPackage", pb.GetPackageRequest(package_id=package_id))
        return reply.manifest, peer_from_proto(reply.store)

    async def list_packages(self) -> list[pb.PackageSummary]:
        return list((await self._call("ListPackages", pb.ListPackagesRequest())).packages)

    async def remove_package(self, package_id: str, *, force: bool = False) -> None:
        await self._call("RemovePackage", pb.RemovePackageRequest(package_id=package_id, force=force))

    # ----- availability -----

    async def report_blocks(self, node_id: str, verified: Mapping[str, Iterable[int]],
                            dropped: Mapping[str, Iterable[int]] | None = None,
                            cached: Mapping[str, Iterable[int]] | None = None,
                            progress: Mapping[str, int] | None = None) -> tuple[str, ...]:
        """Report newly verified, dropped and disk-cached blocks, and bytes held of packages being received;
        also renews the lease. Returns unknown package ids."""
        request = report_request(node_id, verified, dropped, cached, progress)
        return tuple((await self._call("ReportBlocks", request)).unknown_packages)

    def open_report_stream(self) -> "ReportStream":
        """A long-lived report stream (cheaper per report than :meth:`report_blocks`); see ReportStream."""
        return ReportStream(self, self._stub.StreamReports(metadata=self._metadata))

    async def report_bad_peer(self, node_id: str, peer_id: str, package_id: str, block: int, reason: str, *,
                              gone: bool = False) -> bool:
        """Report a parent that served bad data or failed (``gone``: nothing listens where it was); True if a
        plan was repaired without it."""
        request = pb.ReportBadPeerRequest(node_id=node_id, peer_id=peer_id, package_id=package_id, block=block,
                                          reason=reason, gone=gone)
        return (await self._call("ReportBadPeer", request)).replanned

    async def availability(self, package_id: str) -> Availability:
        reply = await self._call("GetAvailability", pb.GetAvailabilityRequest(package_id=package_id))
        return Availability(reply.package_id, reply.num_blocks,
                            {w.node_id: frozenset(w.blocks) for w in reply.by_worker},
                            [frozenset(b.node_ids) for b in reply.by_block])

    # ----- scaling -----

    async def scale_up(self, package_id: str, *, node_ids: Sequence[str] = (), count: int = 0, strategy: str = "",
                       fanout: int = 0, serving_only: bool = False) -> pb.ScaleUpResponse:
        """Bring a package onto ``node_ids`` or onto ``count`` more workers (serving ones only with
        ``serving_only``; see ControlState.scale_up)."""
        return await self._call("ScaleUp", pb.ScaleUpRequest(package_id=package_id, node_ids=node_ids, count=count,
                                                             strategy=strategy, fanout=fanout,
                                                             serving_only=serving_only))

    async def release(self, package_id: str, node_ids: Sequence[str], *, keep_alive_s: float = 0.0) -> float:
        """Release a package from workers after ``keep_alive_s``; returns the drop time (unix seconds)."""
        request = pb.ReleaseRequest(package_id=package_id, node_ids=node_ids, keep_alive_s=keep_alive_s)
        return (await self._call("Release", request)).drop_at_unix

    async def list_plans(self, package_id: str = "") -> list[pb.PlanSummary]:
        return list((await self._call("ListPlans", pb.ListPlansRequest(package_id=package_id))).plans)

    async def list_pipelines(self, package_id: str = "") -> list[pb.PipelineInfo]:
        """Cross-node pipelines of ``package_id`` (every package's if ""), formed from the blocks held now."""
        return list((await self._call("ListPipelines", pb.ListPipelinesRequest(package_id=package_id))).pipelines)

    async def watch_assignments(self, node_id: str) -> AsyncIterator[AssignmentUpdate]:
        """The worker's assignment stream: a SYNC, its part in each active plan, then every change."""
        call = self._stub.WatchAssignments(pb.WatchAssignmentsRequest(node_id=node_id), metadata=self._metadata)
        try:
            async for msg in call:
                yield update_from_proto(msg)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, target=self.target, method="WatchAssignments") from None
        finally:
            call.cancel()


    # ----- credentials -----

    async def issue_token(self, node_id: str) -> str:
        """A node token for ``node_id`` (operator only): it lets its holder act as that node, and only as it."""
        return (await self._call("IssueToken", pb.IssueTokenRequest(node_id=node_id))).token

    async def revoke_node(self, node_id: str = "", *, restore: bool = False) -> tuple[list[str], bool]:
        """Revoke ``node_id``'s token (operator only; ``restore``: admit it again; empty: change nothing); returns
        every node revoked now, and whether the call changed that."""
        reply = await self._call("RevokeNode", pb.RevokeNodeRequest(node_id=node_id, restore=restore))
        return list(reply.revoked), reply.changed


    async def put_deployment(self, deployment: Deployment) -> Deployment:
        reply = await self._call("PutDeployment", pb.PutDeploymentRequest(deployment=deployment_to_proto(deployment)))
        return deployment_from_proto(reply.deployment)

    async def list_deployments(self) -> list[Deployment]:
        reply = await self._call("ListDeployments", pb.ListDeploymentsRequest())
        return [deployment_from_proto(d) for d in reply.deployments]

    async def remove_deployment(self, package_id: str) -> None:
        await self._call("RemoveDeployment", pb.RemoveDeploymentRequest(package_id=package_id))

    async def append_scale_event(self, event: ScaleEvent) -> int:
        reply = await self._call("AppendScaleEvent", pb.AppendScaleEventRequest(event=scale_event_to_proto(event)))
        return reply.seq

    async def list_scale_events(self, package_id: str = "", *, after_seq: int = 0, limit: int = 0) -> list[ScaleEvent]:
        reply = await self._call("ListScaleEvents", pb.ListScaleEventsRequest(package_id=package_id,
                                                                              after_seq=after_seq, limit=limit))
        return [scale_event_from_proto(e) for e in reply.events]

    # ----- served model routes -----

    async def change_route(self, change: RouteChange) -> ModelRoute | None:
        """Apply ``change`` (operator only); the route after it, None once removed."""
        reply = await self._call("ChangeRoute", route_change_to_proto(change))
        return route_from_proto(reply.route) if reply.HasField("route") else None

    async def list_routes(self) -> list[ModelRoute]:
        reply = await self._call("ListRoutes", pb.ListRoutesRequest())
        return [route_from_proto(r) for r in reply.routes]


def report_request(node_id: str, verified: Mapping[str, Iterable[int]],
                   dropped: Mapping[str, Iterable[int]] | None,
                   cached: Mapping[str, Iterable[int]] | None,
                   progress: Mapping[str, int] | None = None) -> pb.ReportBlocksRequest:
    return pb.ReportBlocksRequest(node_id=node_id, verified=blocks_to_proto(verified),
                                  dropped=blocks_to_proto(dropped or {}), cached=blocks_to_proto(cached or {}),
                                  progress=[pb.PackageProgress(package_id=package_id, bytes_present=held)
                                            for package_id, held in (progress or {}).items()])


class ReportStream:
    """One worker's open report stream: each :meth:`report` is answered before the next is sent. A
    failure (the server refused a report, or did not answer within the client's deadline) raises the
    typed error and ends the stream: open a new one."""

    def __init__(self, client: ControlPlaneClient, call: grpc.aio.StreamStreamCall):
        self._client = client
        self._call = call
        self._lock = asyncio.Lock()
        self.closed = False

    async def report(self, node_id: str, verified: Mapping[str, Iterable[int]],
                     dropped: Mapping[str, Iterable[int]] | None = None,
                     cached: Mapping[str, Iterable[int]] | None = None,
                     progress: Mapping[str, int] | None = None) -> tuple[str, ...]:
        """Like :meth:`ControlPlaneClient.report_blocks`, on this stream. Returns unknown package ids."""
        request = report_request(node_id, verified, dropped, cached, progress)
        target = self._client.target
        async with self._lock:
            if self.closed:
                raise ControlPlaneUnavailable(f"report stream to control plane at {target} is closed")
            try:
                async with asyncio.timeout(self._client.timeout_s):
                    await self._call.write(request)
                    reply = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                self.close()
                raise error_from_rpc(exc, target=target, method="StreamReports") from None
            except TimeoutError:
                self.close()
                raise ControlPlaneUnavailable(f"control plane at {target} did not answer StreamReports within "
                                              f"{self._client.timeout_s} s") from None
            except asyncio.InvalidStateError:  # the call ended while idle (e.g. the server went away)
                self.close()
                raise ControlPlaneUnavailable(f"report stream to control plane at {target} had ended") from None
            if reply is grpc.aio.EOF:
                self.close()
                raise ControlPlaneUnavailable(f"control plane at {target} ended the report stream")
            return tuple(reply.unknown_packages)

    def close(self) -> None:
        self.closed = True
        self._call.cancel()
