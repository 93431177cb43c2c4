"""Static plan files: a multicast plan plus the package and the address of every node, for running
agents without a control plane (benchmarks, tests, air-gapped clusters).

Format: the JSON of :meth:`control_plane.planner.plan.Plan.to_json` with two more keys, and optionally a third::

    {"package_id": "...", "nodes": {"seed": "10.0.0.1:7070", "r1": "10.0.0.2:7070"},
     "strategy": "chain", "sources": ["seed"], "assignments": {"r1": [[0, "seed"], [1, "seed", 0, 8]]},
     "relay_bytes": 65536}

``relay_bytes``, as a control plane's ASSIGN gives it: the relay piece the plan asks of every node (a long chain's
smaller one; absent or 0: each node's own ``agent_relay_bytes``).

A fetch is ``[block, parent]`` for a whole block or ``[block, parent, first, end]`` for its chunks first ..
end - 1; each goes to the fetcher as it is. Without a control plane every requester is served, so a
child fetching a chunk range is admitted like one fetching a whole block.
"""

from dataclasses import dataclass
from pathlib import Path

from control_plane.messages import PeerInfo
from control_plane.planner.plan import Fetch, Plan, PlanError
from pipecast.agent.errors import PlanFileError
from pipecast.agent.transport.wire import PACKAGE_ID
from pipecast.core.strictjson import JSONInputError, loads_object
from pipecast.agent.transport.base import split_address


@dataclass(frozen=True)
class StaticPlan:
    """A plan file, parsed and checked: every node the plan names has an address."""

    package_id: str
    nodes: dict[str, str]
    plan: Plan
    relay_bytes: int = 0

    def peer(self, node_id: str) -> PeerInfo:
        """The node ``node_id`` with its address."""
        return PeerInfo(node_id, self.nodes[node_id])

    def fetches_of(self, node_id: str) -> list[Fetch[PeerInfo]]:
        """What ``node_id`` fetches, in order, each (a block or a chunk range of one) from its parent."""
        return [Fetch(f.block, self.peer(f.parent), f.chunks) for f in self.plan.assignments.get(node_id, [])]

    def sources(self) -> list[PeerInfo]:
        """The nodes that hold the whole package, in the plan's order: the fallback of every fetch."""
        return [self.peer(s) for s in self.plan.sources]

    def children_of(self, node_id: str) -> set[str]:
        """Nodes that fetch at least one block or chunk range from ``node_id``."""
        return {rx for rx, fetches in self.plan.assignments.items() if any(a.parent == node_id for a in fetches)}


def plan_file_data(plan: Plan, package_id: str, nodes: dict[str, str], relay_bytes: int = 0) -> dict:
    """The JSON-able content of a plan file (see the module docstring)."""
    return {"package_id": package_id, "nodes": dict(nodes), **plan.to_json(),
            **({"relay_bytes": relay_bytes} if relay_bytes else {})}


def read_plan_file(path: Path) -> StaticPlan:
    """Read and check a plan file; raise :class:`PlanFileError` naming the file and the problem."""
    try:
        data = loads_object(Path(path).read_bytes())
    except OSError as exc:
        raise PlanFileError(f"{path}: cannot read the plan file ({exc.strerror})") from None
    except JSONInputError as exc:
        raise PlanFileError(f"{path}: not a JSON object ({exc})") from None
    package_id, nodes, relay_bytes = data.pop("package_id", None), data.pop("nodes", None), data.pop("relay_bytes", 0)
    if not isinstance(package_id, str) or not PACKAGE_ID.fullmatch(package_id):
        raise PlanFileError(f"{path}: 'package_id' must be the package's id (64 hex digits)")
    if not isinstance(nodes, dict) or not all(isinstance(v, str) for v in nodes.values()):
        raise PlanFileError(f"{path}: 'nodes' must map node ids to host:port addresses")
    if isinstance(relay_bytes, bool) or not isinstance(relay_bytes, int) or relay_bytes < 0:
        raise PlanFileError(f"{path}: 'relay_bytes' must be an integer >= 0 (bytes; 0: each node's own), got "
                            f"{relay_bytes!r}")
    for node, address in nodes.items():
        try:
            split_address(address)
        except ValueError as exc:
            raise PlanFileError(f"{path}: node {node!r}: {exc}") from None
    try:
        plan = Plan.from_json(data)
    except PlanError as exc:
        raise PlanFileError(f"{path}: {exc}") from None
    named = set(plan.sources) | set(plan.assignments) | {a.parent for fs in plan.assignments.values() for a in fs}
    unplaced = sorted(named - nodes.keys())
    if unplaced:
        raise PlanFileError(f"{path}: nodes {', '.join(unplaced)} have no address in 'nodes'")
    return StaticPlan(package_id, nodes, plan, relay_bytes)
