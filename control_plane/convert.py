"""Between the control plane's value types (:mod:`control_plane.messages`) and their protobuf messages."""

from collections.abc import Callable, Iterable, Mapping, Sequence

from control_plane.deployments import Deployment, ScaleEvent, ScalingPolicy
from control_plane.errors import MalformedUpdate
from control_plane.messages import AcceleratorInfo, AssignmentUpdate, PeerInfo, UpdateKind, WorkerSpec
from control_plane.planner.plan import Fetch
from control_plane.routes import CanaryGate, ModelRoute, RouteChange
from pipecast.core.engines import DEFAULT_ENGINE
from pipecast.core.priorities import DEFAULT_PRIORITY
from pipecast.v1 import control_pb2 as pb

# The largest message either side accepts: a 70B model's manifest with 1 MiB chunk digests is ~10 MB.
MAX_MESSAGE_BYTES = 64 << 20

KIND_TO_PROTO = {
    UpdateKind.SYNC: pb.AssignmentUpdate.SYNC,
    UpdateKind.ASSIGN: pb.AssignmentUpdate.ASSIGN,
    UpdateKind.CANCEL: pb.AssignmentUpdate.CANCEL,
    UpdateKind.DROP: pb.AssignmentUpdate.DROP,
}
_KIND_FROM_PROTO = {v: k for k, v in KIND_TO_PROTO.items()}


def peer_to_proto(peer: PeerInfo) -> pb.Peer:
    return pb.Peer(node_id=peer.node_id, address=peer.address, transports=peer.transports)


def peer_from_proto(msg: pb.Peer) -> PeerInfo:
    return PeerInfo(msg.node_id, msg.address, tuple(msg.transports))


def spec_to_proto(spec: WorkerSpec) -> pb.WorkerSpec:
    acc = spec.accelerator
    return pb.WorkerSpec(peer=peer_to_proto(spec.peer), memory_bytes=spec.memory_bytes,
                         accelerator=pb.Accelerator(kind=acc.kind, name=acc.name, count=acc.count,
                                                    memory_bytes=acc.memory_bytes),
                         labels=dict(spec.labels), serve_url=spec.serve_url, engine=spec.engine,
                         link_mbit=spec.link_mbit, serve_package=spec.serve_package)


def spec_from_proto(msg: pb.WorkerSpec) -> WorkerSpec:
    acc = msg.accelerator
    return WorkerSpec(peer=peer_from_proto(msg.peer), memory_bytes=msg.memory_bytes,
                      accelerator=AcceleratorInfo(acc.kind, acc.name, acc.count, acc.memory_bytes),
                      labels=dict(msg.labels), serve_url=msg.serve_url, engine=msg.engine or DEFAULT_ENGINE,
                      link_mbit=msg.link_mbit, serve_package=msg.serve_package)


def blocks_to_proto(held: Mapping[str, Iterable[int]]) -> list[pb.PackageBlocks]:
    return [pb.PackageBlocks(package_id=package_id, blocks=sorted(blocks)) for package_id, blocks in held.items()]


def blocks_from_proto(msgs: Iterable[pb.PackageBlocks]) -> dict[str, set[int]]:
    """Block sets per package; a package listed twice gets the union."""
    out: dict[str, set[int]] = {}
    for msg in msgs:
        out.setdefault(msg.package_id, set()).update(msg.blocks)
    return out


def part_to_proto(fetch: Sequence[Fetch[str]], serve: Sequence[tuple[int, str]],
                  peer: Callable[[str], pb.Peer]) -> tuple[pb.Transfers, pb.Transfers, list[pb.Peer]]:
    """A node's part as the assignment stream carries it: its fetches and serves as columns that name each
    parent and child by its index in one table of peers (``peer(node)``: the node's message), each once."""
    index: dict[str, int] = {}
    table: list[pb.Peer] = []

    def at(node: str) -> int:
        i = index.get(node)
        if i is None:
            i = index[node] = len(table)
            table.append(peer(node))
        return i

    fetches = pb.Transfers(block=[a.block for a in fetch], peer=[at(a.parent) for a in fetch])
    if any(a.chunks for a in fetch):  # whole blocks only: no chunk columns
        fetches.first_chunk.extend(a.chunks[0] if a.chunks else 0 for a in fetch)
        fetches.end_chunk.extend(a.chunks[1] if a.chunks else 0 for a in fetch)
    serves = pb.Transfers(block=[block for block, _ in serve], peer=[at(child) for _, child in serve])
    return fetches, serves, table


def update_from_proto(msg: pb.AssignmentUpdate) -> AssignmentUpdate:
    """The update's fetches keep their parents' addresses; a serve list needs only the children's ids.
    Raises :class:`MalformedUpdate` for a kind this worker does not know, transfer columns that do not line up,
    name no peer or give a chunk range that is none."""
    kind = _KIND_FROM_PROTO.get(msg.kind)
    if kind is None:
        raise MalformedUpdate(f"assignment update of plan {msg.plan_id!r} has kind {msg.kind}, which this worker "
                              "does not know")
    peers = tuple(peer_from_proto(p) for p in msg.peers)
    fetch = tuple(Fetch(block, peers[i], (first, end) if end else None)
                  for block, i, first, end in _transfers(msg, "fetch", peers))
    serve = tuple((block, peers[i].node_id) for block, i, _, _ in _transfers(msg, "serve", peers))
    return AssignmentUpdate(
        kind=kind, plan_id=msg.plan_id, package_id=msg.package_id, version=msg.version,
        strategy=msg.strategy, fetch=fetch, serve=serve,
        plan_ids=tuple(msg.plan_ids), sources=tuple(peer_from_proto(p) for p in msg.sources),
        receivers=tuple(msg.receivers), priority=msg.priority or DEFAULT_PRIORITY,
        report_progress=msg.report_progress, relay_bytes=msg.relay_bytes)


def _transfers(msg: pb.AssignmentUpdate, field: str,
               peers: Sequence[PeerInfo]) -> Iterable[tuple[int, int, int, int]]:
    """(block, peer index, first chunk, end chunk) of the update's ``field`` columns, checked."""
    columns: pb.Transfers = getattr(msg, field)
    count = len(columns.block)
    chunks = (columns.first_chunk, columns.end_chunk) if columns.end_chunk or columns.first_chunk else None
    where = f"assignment update of plan {msg.plan_id!r}: {field}"
    if len(columns.peer) != count or (chunks and (len(chunks[0]), len(chunks[1])) != (count, count)):
        raise MalformedUpdate(f"{where} has {count} blocks, {len(columns.peer)} peers, {len(columns.first_chunk)} "
                              f"first and {len(columns.end_chunk)} end chunks (each must have one per block, or "
                              "no chunks at all)")
    bad = next((i for i in columns.peer if i >= len(peers)), None)
    if bad is not None:
        raise MalformedUpdate(f"{where} names peer {bad}, but the update lists {len(peers)} peers")
    if chunks is None:
        return ((block, i, 0, 0) for block, i in zip(columns.block, columns.peer))
    # (0, 0) is a whole block; a range has first < end
    bad = next(((first, end) for first, end in zip(*chunks) if (first, end) != (0, 0) and not first < end), None)
    if bad is not None:
        raise MalformedUpdate(f"{where} gives chunks {bad[0]}..{bad[1]}, which is no range (first < end)")
    return zip(columns.block, columns.peer, chunks[0], chunks[1])


def deployment_to_proto(deployment: Deployment) -> pb.Deployment:
    p = deployment.policy
    policy = pb.ScalingPolicy(
        min_replicas=p.min_replicas, max_replicas=p.max_replicas, slo_ttft_p99_s=p.slo_ttft_p99_s, warm=p.warm,
        keep_alive_s=p.keep_alive_s, scale_up_cooldown_s=p.scale_up_cooldown_s,
        scale_down_cooldown_s=p.scale_down_cooldown_s, replica_rps=p.replica_rps,
        replica_concurrency=p.replica_concurrency, warm_auto_factor=p.warm_auto_factor, cold_start_s=p.cold_start_s,
        cold_start_measured=p.cold_start_measured)
    return pb.Deployment(package_id=deployment.package_id, policy=policy, routers=deployment.routers,
                         created_unix=deployment.created_at, updated_unix=deployment.updated_at,
                         priority=deployment.priority)


def deployment_from_proto(msg: pb.Deployment) -> Deployment:
    p = msg.policy
    policy = ScalingPolicy(
        min_replicas=p.min_replicas, max_replicas=p.max_replicas, slo_ttft_p99_s=p.slo_ttft_p99_s, warm=p.warm,
        keep_alive_s=p.keep_alive_s, scale_up_cooldown_s=p.scale_up_cooldown_s,
        scale_down_cooldown_s=p.scale_down_cooldown_s, replica_rps=p.replica_rps,
        replica_concurrency=p.replica_concurrency, warm_auto_factor=p.warm_auto_factor, cold_start_s=p.cold_start_s,
        cold_start_measured=p.cold_start_measured)
    return Deployment(msg.package_id, policy, tuple(msg.routers), msg.created_unix, msg.updated_unix,
                      msg.priority or DEFAULT_PRIORITY)


def scale_event_to_proto(event: ScaleEvent) -> pb.ScaleEvent:
    return pb.ScaleEvent(seq=event.seq, at_unix=event.at, package_id=event.package_id, action=event.action,
                         count=event.count, node_ids=event.node_ids, reason=event.reason,
                         inputs_json=event.inputs_json, desired=event.desired, actual=event.actual)


def scale_event_from_proto(msg: pb.ScaleEvent) -> ScaleEvent:
    return ScaleEvent(at=msg.at_unix, package_id=msg.package_id, action=msg.action, count=msg.count,
                      node_ids=tuple(msg.node_ids), reason=msg.reason, inputs_json=msg.inputs_json,
                      desired=msg.desired, actual=msg.actual, seq=msg.seq)


def gate_to_proto(gate: CanaryGate) -> pb.CanaryGate:
    return pb.CanaryGate(ttft_p95_margin=gate.ttft_p95_margin, error_rate_margin=gate.error_rate_margin,
                         min_requests=gate.min_requests)


def _gate_from_proto(owner: pb.ModelRoute | pb.ChangeRouteRequest) -> CanaryGate | None:
    if not owner.HasField("gate"):
        return None
    g = owner.gate
    return CanaryGate(g.ttft_p95_margin, g.error_rate_margin, g.min_requests)


def route_to_proto(route: ModelRoute) -> pb.ModelRoute:
    return pb.ModelRoute(name=route.name, stable=route.stable,
                         versions=[pb.RouteVersion(package_id=p, weight=w) for p, w in route.versions],
                         gate=gate_to_proto(route.gate) if route.gate else None, updated_unix=route.updated_at)


def route_from_proto(msg: pb.ModelRoute) -> ModelRoute:
    return ModelRoute(msg.name, msg.stable, tuple((v.package_id, v.weight) for v in msg.versions),
                      _gate_from_proto(msg), msg.updated_unix)


def route_change_to_proto(change: RouteChange) -> pb.ChangeRouteRequest:
    return pb.ChangeRouteRequest(name=change.name, action=change.action, package_id=change.package_id,
                                 weight=change.weight, gate=gate_to_proto(change.gate) if change.gate else None,
                                 reason=change.reason, no_gate=change.no_gate)


def route_change_from_proto(msg: pb.ChangeRouteRequest) -> RouteChange:
    return RouteChange(msg.name, msg.action, msg.package_id, msg.weight, _gate_from_proto(msg), msg.reason,
                       msg.no_gate)
