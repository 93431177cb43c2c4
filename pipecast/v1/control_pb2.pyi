from pipecast.v1 import manifest_pb2 as _manifest_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Peer(_message.Message):
    __slots__ = ("node_id", "address", "transports")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ...) -> None: ...

class Accelerator(_message.Message):
    __slots__ = ("kind", "name", "count", "memory_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    count: int
    memory_bytes: int
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., count: _Optional[int] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class WorkerSpec(_message.Message):
    __slots__ = ("peer", "memory_bytes", "accelerator", "labels", "serve_url", "engine", "link_mbit", "serve_package")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PEER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SERVE_URL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    LINK_MBIT_FIELD_NUMBER: _ClassVar[int]
    SERVE_PACKAGE_FIELD_NUMBER: _ClassVar[int]
    peer: Peer
    memory_bytes: int
    accelerator: Accelerator
    labels: _containers.ScalarMap[str, str]
    serve_url: str
    engine: str
    link_mbit: float
    serve_package: str
    def __init__(self, peer: _Optional[_Union[Peer, _Mapping]] = ..., memory_bytes: _Optional[int] = ..., accelerator: _Optional[_Union[Accelerator, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., serve_url: _Optional[str] = ..., engine: _Optional[str] = ..., link_mbit: _Optional[float] = ..., serve_package: _Optional[str] = ...) -> None: ...

class PackageBlocks(_message.Message):
    __slots__ = ("package_id", "blocks")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, package_id: _Optional[str] = ..., blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker", "held", "cached")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerSpec
    held: _containers.RepeatedCompositeFieldContainer[PackageBlocks]
    cached: _containers.RepeatedCompositeFieldContainer[PackageBlocks]
    def __init__(self, worker: _Optional[_Union[WorkerSpec, _Mapping]] = ..., held: _Optional[_Iterable[_Union[PackageBlocks, _Mapping]]] = ..., cached: _Optional[_Iterable[_Union[PackageBlocks, _Mapping]]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease_s", "heartbeat_s", "unknown_packages", "data_key")
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_PACKAGES_FIELD_NUMBER: _ClassVar[int]
    DATA_KEY_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    heartbeat_s: float
    unknown_packages: _containers.RepeatedScalarFieldContainer[str]
    data_key: bytes
    def __init__(self, lease_s: _Optional[float] = ..., heartbeat_s: _Optional[float] = ..., unknown_packages: _Optional[_Iterable[str]] = ..., data_key: _Optional[bytes] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_s",)
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    def __init__(self, lease_s: _Optional[float] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("worker", "alive", "lease_remaining_s", "held", "cached")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerSpec
    alive: bool
    lease_remaining_s: float
    held: _containers.RepeatedCompositeFieldContainer[PackageBlocks]
    cached: _containers.RepeatedCompositeFieldContainer[PackageBlocks]
    def __init__(self, worker: _Optional[_Union[WorkerSpec, _Mapping]] = ..., alive: _Optional[bool] = ..., lease_remaining_s: _Optional[float] = ..., held: _Optional[_Iterable[_Union[PackageBlocks, _Mapping]]] = ..., cached: _Optional[_Iterable[_Union[PackageBlocks, _Mapping]]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "serving_key")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SERVING_KEY_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerState]
    serving_key: bytes
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerState, _Mapping]]] = ..., serving_key: _Optional[bytes] = ...) -> None: ...

class PublishPackageRequest(_message.Message):
    __slots__ = ("manifest", "store")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    manifest: _manifest_pb2.Manifest
    store: Peer
    def __init__(self, manifest: _Optional[_Union[_manifest_pb2.Manifest, _Mapping]] = ..., store: _Optional[_Union[Peer, _Mapping]] = ...) -> None: ...

class PublishPackageResponse(_message.Message):
    __slots__ = ("package_id",)
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    def __init__(self, package_id: _Optional[str] = ...) -> None: ...

class GetPackageRequest(_message.Message):
    __slots__ = ("package_id",)
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    def __init__(self, package_id: _Optional[str] = ...) -> None: ...

class GetPackageResponse(_message.Message):
    __slots__ = ("manifest", "store")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    manifest: _manifest_pb2.Manifest
    store: Peer
    def __init__(self, manifest: _Optional[_Union[_manifest_pb2.Manifest, _Mapping]] = ..., store: _Optional[_Union[Peer, _Mapping]] = ...) -> None: ...

class ListPackagesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PackageSummary(_message.Message):
    __slots__ = ("package_id", "model_name", "num_blocks", "total_bytes", "store", "complete_holders", "block_replicas", "published_unix")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    model_name: str
    num_blocks: int
    total_bytes: int
    store: Peer
    complete_holders: int
    block_replicas: int
    published_unix: float
    def __init__(self, package_id: _Optional[str] = ..., model_name: _Optional[str] = ..., num_blocks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., store: _Optional[_Union[Peer, _Mapping]] = ..., complete_holders: _Optional[int] = ..., block_replicas: _Optional[int] = ..., published_unix: _Optional[float] = ...) -> None: ...

class ListPackagesResponse(_message.Message):
    __slots__ = ("packages",)
    PACKAGES_FIELD_NUMBER: _ClassVar[int]
    packages: _containers.RepeatedCompositeFieldContainer[PackageSummary]
    def __init__(self, packages: _Optional[_Iterable[_Union[PackageSummary, _Mapping]]] = ...) -> None: ...

class RemovePackageRequest(_message.Message):
    __slots__ = ("package_id", "force")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    force: bool
    def __init__(self, package_id: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class RemovePackageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportBlocksRequest(_message.Message):
    __slots__ = ("node_id", "verified", "dropped", "cached", "progress")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    verified: _containers.RepeatedCompositeFieldContainer[PackageBlocks]
    dropped: _containers.RepeatedCompositeFieldContainer[PackageBlocks]
    cached: _containers.RepeatedCompositeFieldContainer[PackageBlocks]
    progress: _containers.RepeatedCompositeFieldContainer[PackageProgress]
    def __init__(self, node_id: _Optional[str] = ..., verified: _Optional[_Iterable[_Union[PackageBlocks, _Mapping]]] = ..., dropped: _Optional[_Iterable[_Union[PackageBlocks, _Mapping]]] = ..., cached: _Optional[_Iterable[_Union[PackageBlocks, _Mapping]]] = ..., progress: _Optional[_Iterable[_Union[PackageProgress, _Mapping]]] = ...) -> None: ...

class PackageProgress(_message.Message):
    __slots__ = ("package_id", "bytes_present")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_PRESENT_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    bytes_present: int
    def __init__(self, package_id: _Optional[str] = ..., bytes_present: _Optional[int] = ...) -> None: ...

class ReportBlocksResponse(_message.Message):
    __slots__ = ("unknown_packages",)
    UNKNOWN_PACKAGES_FIELD_NUMBER: _ClassVar[int]
    unknown_packages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_packages: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportBadPeerRequest(_message.Message):
    __slots__ = ("node_id", "peer_id", "package_id", "block", "reason", "gone")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer_id: str
    package_id: str
    block: int
    reason: str
    gone: bool
    def __init__(self, node_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., package_id: _Optional[str] = ..., block: _Optional[int] = ..., reason: _Optional[str] = ..., gone: _Optional[bool] = ...) -> None: ...

class ReportBadPeerResponse(_message.Message):
    __slots__ = ("replanned",)
    REPLANNED_FIELD_NUMBER: _ClassVar[int]
    replanned: bool
    def __init__(self, replanned: _Optional[bool] = ...) -> None: ...

class GetAvailabilityRequest(_message.Message):
    __slots__ = ("package_id",)
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    def __init__(self, package_id: _Optional[str] = ...) -> None: ...

class BlockHolders(_message.Message):
    __slots__ = ("block", "node_ids")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    block: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerBlocks(_message.Message):
    __slots__ = ("node_id", "blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class GetAvailabilityResponse(_message.Message):
    __slots__ = ("package_id", "num_blocks", "by_worker", "by_block")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BY_WORKER_FIELD_NUMBER: _ClassVar[int]
    BY_BLOCK_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    num_blocks: int
    by_worker: _containers.RepeatedCompositeFieldContainer[WorkerBlocks]
    by_block: _containers.RepeatedCompositeFieldContainer[BlockHolders]
    def __init__(self, package_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., by_worker: _Optional[_Iterable[_Union[WorkerBlocks, _Mapping]]] = ..., by_block: _Optional[_Iterable[_Union[BlockHolders, _Mapping]]] = ...) -> None: ...

class ScaleUpRequest(_message.Message):
    __slots__ = ("package_id", "node_ids", "count", "strategy", "fanout", "serving_only")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    FANOUT_FIELD_NUMBER: _ClassVar[int]
    SERVING_ONLY_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    count: int
    strategy: str
    fanout: int
    serving_only: bool
    def __init__(self, package_id: _Optional[str] = ..., node_ids: _Optional[_Iterable[str]] = ..., count: _Optional[int] = ..., strategy: _Optional[str] = ..., fanout: _Optional[int] = ..., serving_only: _Optional[bool] = ...) -> None: ...

class ScaleUpResponse(_message.Message):
    __slots__ = ("plan_id", "strategy", "sources", "receivers", "unchanged")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    strategy: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    receivers: _containers.RepeatedScalarFieldContainer[str]
    unchanged: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, plan_id: _Optional[str] = ..., strategy: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ..., receivers: _Optional[_Iterable[str]] = ..., unchanged: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("package_id", "node_ids", "keep_alive_s")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_S_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    keep_alive_s: float
    def __init__(self, package_id: _Optional[str] = ..., node_ids: _Optional[_Iterable[str]] = ..., keep_alive_s: _Optional[float] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("drop_at_unix",)
    DROP_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    drop_at_unix: float
    def __init__(self, drop_at_unix: _Optional[float] = ...) -> None: ...

class ListPlansRequest(_message.Message):
    __slots__ = ("package_id",)
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    def __init__(self, package_id: _Optional[str] = ...) -> None: ...

class PlanSummary(_message.Message):
    __slots__ = ("plan_id", "package_id", "strategy", "sources", "receivers", "pending", "replans", "created_unix", "demoted")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    REPLANS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    package_id: str
    strategy: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    receivers: _containers.RepeatedScalarFieldContainer[str]
    pending: _containers.RepeatedScalarFieldContainer[str]
    replans: int
    created_unix: float
    demoted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, plan_id: _Optional[str] = ..., package_id: _Optional[str] = ..., strategy: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ..., receivers: _Optional[_Iterable[str]] = ..., pending: _Optional[_Iterable[str]] = ..., replans: _Optional[int] = ..., created_unix: _Optional[float] = ..., demoted: _Optional[_Iterable[str]] = ...) -> None: ...

class ListPlansResponse(_message.Message):
    __slots__ = ("plans",)
    PLANS_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedCompositeFieldContainer[PlanSummary]
    def __init__(self, plans: _Optional[_Iterable[_Union[PlanSummary, _Mapping]]] = ...) -> None: ...

class ListPipelinesRequest(_message.Message):
    __slots__ = ("package_id",)
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    def __init__(self, package_id: _Optional[str] = ...) -> None: ...

class PipelineStage(_message.Message):
    __slots__ = ("node_id", "serve_url", "layer_start", "layer_end")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SERVE_URL_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    serve_url: str
    layer_start: int
    layer_end: int
    def __init__(self, node_id: _Optional[str] = ..., serve_url: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class PipelineInfo(_message.Message):
    __slots__ = ("package_id", "stages", "bottleneck_layers", "waiting_blocks")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    stages: _containers.RepeatedCompositeFieldContainer[PipelineStage]
    bottleneck_layers: float
    waiting_blocks: int
    def __init__(self, package_id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[PipelineStage, _Mapping]]] = ..., bottleneck_layers: _Optional[float] = ..., waiting_blocks: _Optional[int] = ...) -> None: ...

class ListPipelinesResponse(_message.Message):
    __slots__ = ("pipelines",)
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    pipelines: _containers.RepeatedCompositeFieldContainer[PipelineInfo]
    def __init__(self, pipelines: _Optional[_Iterable[_Union[PipelineInfo, _Mapping]]] = ...) -> None: ...

class WatchAssignmentsRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class Transfers(_message.Message):
    __slots__ = ("block", "peer", "first_chunk", "end_chunk")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_CHUNK_FIELD_NUMBER: _ClassVar[int]
    block: _containers.RepeatedScalarFieldContainer[int]
    peer: _containers.RepeatedScalarFieldContainer[int]
    first_chunk: _containers.RepeatedScalarFieldContainer[int]
    end_chunk: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block: _Optional[_Iterable[int]] = ..., peer: _Optional[_Iterable[int]] = ..., first_chunk: _Optional[_Iterable[int]] = ..., end_chunk: _Optional[_Iterable[int]] = ...) -> None: ...

class AssignmentUpdate(_message.Message):
    __slots__ = ("kind", "plan_id", "package_id", "version", "strategy", "plan_ids", "sources", "receivers", "priority", "report_progress", "fetch", "serve", "peers", "relay_bytes")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[AssignmentUpdate.Kind]
        ASSIGN: _ClassVar[AssignmentUpdate.Kind]
        CANCEL: _ClassVar[AssignmentUpdate.Kind]
        DROP: _ClassVar[AssignmentUpdate.Kind]
        SYNC: _ClassVar[AssignmentUpdate.Kind]
    KIND_UNSPECIFIED: AssignmentUpdate.Kind
    ASSIGN: AssignmentUpdate.Kind
    CANCEL: AssignmentUpdate.Kind
    DROP: AssignmentUpdate.Kind
    SYNC: AssignmentUpdate.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    PLAN_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REPORT_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    SERVE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    RELAY_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: AssignmentUpdate.Kind
    plan_id: str
    package_id: str
    version: int
    strategy: str
    plan_ids: _containers.RepeatedScalarFieldContainer[str]
    sources: _containers.RepeatedCompositeFieldContainer[Peer]
    receivers: _containers.RepeatedScalarFieldContainer[str]
    priority: str
    report_progress: bool
    fetch: Transfers
    serve: Transfers
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    relay_bytes: int
    def __init__(self, kind: _Optional[_Union[AssignmentUpdate.Kind, str]] = ..., plan_id: _Optional[str] = ..., package_id: _Optional[str] = ..., version: _Optional[int] = ..., strategy: _Optional[str] = ..., plan_ids: _Optional[_Iterable[str]] = ..., sources: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., receivers: _Optional[_Iterable[str]] = ..., priority: _Optional[str] = ..., report_progress: _Optional[bool] = ..., fetch: _Optional[_Union[Transfers, _Mapping]] = ..., serve: _Optional[_Union[Transfers, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., relay_bytes: _Optional[int] = ...) -> None: ...

class IssueTokenRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class IssueTokenResponse(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class RevokeNodeRequest(_message.Message):
    __slots__ = ("node_id", "restore")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    restore: bool
    def __init__(self, node_id: _Optional[str] = ..., restore: _Optional[bool] = ...) -> None: ...

class RevokeNodeResponse(_message.Message):
    __slots__ = ("revoked", "changed")
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    revoked: _containers.RepeatedScalarFieldContainer[str]
    changed: bool
    def __init__(self, revoked: _Optional[_Iterable[str]] = ..., changed: _Optional[bool] = ...) -> None: ...

class ScalingPolicy(_message.Message):
    __slots__ = ("min_replicas", "max_replicas", "slo_ttft_p99_s", "warm", "keep_alive_s", "scale_up_cooldown_s", "scale_down_cooldown_s", "replica_rps", "replica_concurrency", "warm_auto_factor", "cold_start_s", "cold_start_measured")
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_P99_S_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_S_FIELD_NUMBER: _ClassVar[int]
    SCALE_UP_COOLDOWN_S_FIELD_NUMBER: _ClassVar[int]
    SCALE_DOWN_COOLDOWN_S_FIELD_NUMBER: _ClassVar[int]
    REPLICA_RPS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    WARM_AUTO_FACTOR_FIELD_NUMBER: _ClassVar[int]
    COLD_START_S_FIELD_NUMBER: _ClassVar[int]
    COLD_START_MEASURED_FIELD_NUMBER: _ClassVar[int]
    min_replicas: int
    max_replicas: int
    slo_ttft_p99_s: float
    warm: int
    keep_alive_s: float
    scale_up_cooldown_s: float
    scale_down_cooldown_s: float
    replica_rps: float
    replica_concurrency: int
    warm_auto_factor: float
    cold_start_s: float
    cold_start_measured: bool
    def __init__(self, min_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ..., slo_ttft_p99_s: _Optional[float] = ..., warm: _Optional[int] = ..., keep_alive_s: _Optional[float] = ..., scale_up_cooldown_s: _Optional[float] = ..., scale_down_cooldown_s: _Optional[float] = ..., replica_rps: _Optional[float] = ..., replica_concurrency: _Optional[int] = ..., warm_auto_factor: _Optional[float] = ..., cold_start_s: _Optional[float] = ..., cold_start_measured: _Optional[bool] = ...) -> None: ...

class Deployment(_message.Message):
    __slots__ = ("package_id", "policy", "routers", "created_unix", "updated_unix", "priority")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    policy: ScalingPolicy
    routers: _containers.RepeatedScalarFieldContainer[str]
    created_unix: float
    updated_unix: float
    priority: str
    def __init__(self, package_id: _Optional[str] = ..., policy: _Optional[_Union[ScalingPolicy, _Mapping]] = ..., routers: _Optional[_Iterable[str]] = ..., created_unix: _Optional[float] = ..., updated_unix: _Optional[float] = ..., priority: _Optional[str] = ...) -> None: ...

class PutDeploymentRequest(_message.Message):
    __slots__ = ("deployment",)
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: Deployment
    def __init__(self, deployment: _Optional[_Union[Deployment, _Mapping]] = ...) -> None: ...

class PutDeploymentResponse(_message.Message):
    __slots__ = ("deployment",)
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: Deployment
    def __init__(self, deployment: _Optional[_Union[Deployment, _Mapping]] = ...) -> None: ...

class ListDeploymentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDeploymentsResponse(_message.Message):
    __slots__ = ("deployments",)
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    deployments: _containers.RepeatedCompositeFieldContainer[Deployment]
    def __init__(self, deployments: _Optional[_Iterable[_Union[Deployment, _Mapping]]] = ...) -> None: ...

class RemoveDeploymentRequest(_message.Message):
    __slots__ = ("package_id",)
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    def __init__(self, package_id: _Optional[str] = ...) -> None: ...

class RemoveDeploymentResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScaleEvent(_message.Message):
    __slots__ = ("seq", "at_unix", "package_id", "action", "count", "node_ids", "reason", "inputs_json", "desired", "actual")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INPUTS_JSON_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at_unix: float
    package_id: str
    action: str
    count: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    inputs_json: str
    desired: int
    actual: int
    def __init__(self, seq: _Optional[int] = ..., at_unix: _Optional[float] = ..., package_id: _Optional[str] = ..., action: _Optional[str] = ..., count: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., inputs_json: _Optional[str] = ..., desired: _Optional[int] = ..., actual: _Optional[int] = ...) -> None: ...

class AppendScaleEventRequest(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: ScaleEvent
    def __init__(self, event: _Optional[_Union[ScaleEvent, _Mapping]] = ...) -> None: ...

class AppendScaleEventResponse(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class ListScaleEventsRequest(_message.Message):
    __slots__ = ("package_id", "after_seq", "limit")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    after_seq: int
    limit: int
    def __init__(self, package_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListScaleEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[ScaleEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[ScaleEvent, _Mapping]]] = ...) -> None: ...

class CanaryGate(_message.Message):
    __slots__ = ("ttft_p95_margin", "error_rate_margin", "min_requests")
    TTFT_P95_MARGIN_FIELD_NUMBER: _ClassVar[int]
    ERROR_RATE_MARGIN_FIELD_NUMBER: _ClassVar[int]
    MIN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ttft_p95_margin: float
    error_rate_margin: float
    min_requests: int
    def __init__(self, ttft_p95_margin: _Optional[float] = ..., error_rate_margin: _Optional[float] = ..., min_requests: _Optional[int] = ...) -> None: ...

class RouteVersion(_message.Message):
    __slots__ = ("package_id", "weight")
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    package_id: str
    weight: int
    def __init__(self, package_id: _Optional[str] = ..., weight: _Optional[int] = ...) -> None: ...

class ModelRoute(_message.Message):
    __slots__ = ("name", "stable", "versions", "gate", "updated_unix")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STABLE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    name: str
    stable: str
    versions: _containers.RepeatedCompositeFieldContainer[RouteVersion]
    gate: CanaryGate
    updated_unix: float
    def __init__(self, name: _Optional[str] = ..., stable: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[RouteVersion, _Mapping]]] = ..., gate: _Optional[_Union[CanaryGate, _Mapping]] = ..., updated_unix: _Optional[float] = ...) -> None: ...

class ChangeRouteRequest(_message.Message):
    __slots__ = ("name", "action", "package_id", "weight", "gate", "reason", "no_gate")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NO_GATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    action: str
    package_id: str
    weight: int
    gate: CanaryGate
    reason: str
    no_gate: bool
    def __init__(self, name: _Optional[str] = ..., action: _Optional[str] = ..., package_id: _Optional[str] = ..., weight: _Optional[int] = ..., gate: _Optional[_Union[CanaryGate, _Mapping]] = ..., reason: _Optional[str] = ..., no_gate: _Optional[bool] = ...) -> None: ...

class ChangeRouteResponse(_message.Message):
    __slots__ = ("route",)
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    route: ModelRoute
    def __init__(self, route: _Optional[_Union[ModelRoute, _Mapping]] = ...) -> None: ...

class ListRoutesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRoutesResponse(_message.Message):
    __slots__ = ("routes",)
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    routes: _containers.RepeatedCompositeFieldContainer[ModelRoute]
    def __init__(self, routes: _Optional[_Iterable[_Union[ModelRoute, _Mapping]]] = ...) -> None: ...
