"""Value types shared by the control plane's state, its service and its client (agents, CLI).

They mirror messages of ``proto/pipecast/v1/control.proto``; :mod:`control_plane.convert` maps one to
the other, so nothing outside the service and the client handles protobuf except the Manifest, which
is the package schema and travels as it is.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from control_plane.planner.plan import Fetch
from control_plane.rows import known_fields
from pipecast.core.engines import DEFAULT_ENGINE
from pipecast.core.priorities import DEFAULT_PRIORITY


@dataclass(frozen=True)
class PeerInfo:
    """A node that moves blocks: a worker's agent or a package store."""

    node_id: str
    address: str
    transports: tuple[str, ...] = ("tcp",)

    def __str__(self) -> str:
        return f"{self.node_id}@{self.address}"


@dataclass(frozen=True)
class AcceleratorInfo:
    """What a worker computes on; informational for operators and for placement later."""

    kind: str = "cpu"
    name: str = ""
    count: int = 0
    memory_bytes: int = 0



@dataclass(frozen=True)
class WorkerSpec:
    """What a worker says about itself when it registers."""

    peer: PeerInfo
    memory_bytes: int
    accelerator: AcceleratorInfo = AcceleratorInfo()
    labels: Mapping[str, str] = field(default_factory=dict)
    serve_url: str = ""  # HTTP base URL of the worker's serving API; the router lists workers by it
    engine: str = DEFAULT_ENGINE  # what answers at serve_url (SERVING_ENGINES)
    link_mbit: float = 0.0  # the rate the data plane may take of its link (0: unknown): stragglers are below it
    serve_package: str = ""  # the package id its serving worker serves ("": not said, any package)

    @property
    def node_id(self) -> str:
        return self.peer.node_id

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.peer.node_id, "address": self.peer.address,
                "transports": list(self.peer.transports), "memory_bytes": self.memory_bytes,
                "accelerator": {"kind": self.accelerator.kind, "name": self.accelerator.name,
                                "count": self.accelerator.count,
                                "memory_bytes": self.accelerator.memory_bytes},
                "labels": dict(self.labels), "serve_url": self.serve_url, "engine": self.engine,
                "link_mbit": self.link_mbit, "serve_package": self.serve_package}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "WorkerSpec":
        return cls(peer=PeerInfo(data["node_id"], data["address"], tuple(data["transports"])),
                   memory_bytes=int(data["memory_bytes"]),
                   accelerator=AcceleratorInfo(**known_fields(AcceleratorInfo, data["accelerator"])),
                   labels=dict(data["labels"]), serve_url=data.get("serve_url", ""),  # absent before field 5
                   engine=data.get("engine", DEFAULT_ENGINE),  # absent before field 6
                   link_mbit=float(data.get("link_mbit", 0.0)),  # absent before field 7
                   serve_package=data.get("serve_package", ""))  # absent before field 8


#: The WorkerSpec label that held a serving worker's HTTP base URL before WorkerSpec.serve_url; the router
#: still reads it when the field is empty.
SERVE_URL_LABEL = "serve_url"


def serve_url_of(spec: WorkerSpec) -> str:
    """The worker's serving URL: WorkerSpec.serve_url, else the older label; "" if it serves nothing."""
    return spec.serve_url or spec.labels.get(SERVE_URL_LABEL, "")


class UpdateKind(Enum):
    """What an :class:`AssignmentUpdate` tells a worker (see AssignmentUpdate.Kind in control.proto)."""

    SYNC = "sync"      # first on every stream: plan_ids lists every plan the worker is part of now
    ASSIGN = "assign"  # the worker's whole part in plan_id now
    CANCEL = "cancel"  # plan_id no longer involves the worker
    DROP = "drop"      # free package_id


@dataclass(frozen=True)
class AssignmentUpdate:
    """One message of a worker's assignment stream."""

    kind: UpdateKind
    plan_id: str = ""
    package_id: str = ""
    version: int = 0
    strategy: str = ""
    fetch: tuple[Fetch[PeerInfo], ...] = ()  # ASSIGN: in this order, each from its parent
    serve: tuple[tuple[int, str], ...] = ()  # ASSIGN: (block, child id), as in a plan's Part
    plan_ids: tuple[str, ...] = ()
    sources: tuple[PeerInfo, ...] = ()  # ASSIGN: nodes holding every block, the fallback of any fetch
    receivers: tuple[str, ...] = ()  # ASSIGN to a source: every receiver of the plan, whom it may serve
    priority: str = DEFAULT_PRIORITY  # ASSIGN: the package's priority (its deployment's), for the link shares
    report_progress: bool = False  # ASSIGN: report the bytes held while receiving (the plan is watched for stragglers)
    relay_bytes: int = 0  # ASSIGN: pass the package's chunks on in pieces of at most this (0: the agent's own)
