"""The control plane and real node agents, each its own process on loopback: a scale-up multicasts a
package onto 4 agents; a killed relay's children are re-parented; a control plane restart does not stop
the transfer and its state converges; a wrong token is refused; a frozen worker leaves the plans.

The store agent seeds the package with its egress rate-limited (PIPECAST_EGRESS_MBIT), so a transfer
lasts about two seconds: long enough to break something in the middle of it. Leases are short.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from control_plane.client import ControlPlaneClient
from control_plane.command import cp_group
from packager.digest import digest_bytes
from pipecast.agent.ratelimit import burst_bytes_for, mbit_to_bytes_per_s
from pipecast.core.credentials import data_plane_key, serving_key
from pipecast.router.discovery import ControlPlaneDiscovery, DiscoveredWorker
from pipecast.v1.manifest_pb2 import Manifest
from tests.support import REPO
from tests.support.agent_processes import Agents, free_ports
from tests.support.packages import tiny_package

TOKEN = "e2e-token-of-the-cluster"
LEASE_S, HEARTBEAT_S, SCAN_S = 2.0, 0.4, 0.1
STORE_MBIT = "8"  # 1 MB/s: the 2 MB package leaves the store in about 2 s
AGENTS = ["a1", "a2", "a3", "a4"]
MEMORY = 64 << 20
SERVE_URL = "http://127.0.0.1:18001"
WAIT_S = 30.0
# How late a poll may see what happened: one poll interval plus one CLI call on a busy machine.
POLL_SLACK_S = 0.5
# How long a verified block may take to reach the control plane: the agents' report batching (50 ms) and a call,
# on a busy machine.
REPORT_WINDOW_S = 0.5
# A worker registered as holding the whole package that serves every chunk with its first byte flipped.
CORRUPTING_WORKER = """
import asyncio, sys
from control_plane.client import ControlPlaneClient
from control_plane.messages import PeerInfo, WorkerSpec
from control_plane.worker_session import WorkerSession
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.transport.tcp import TcpTransport
from pipecast.core.settings import Settings
from tests.support.agent_fixtures import WholeChunkServer, seed_store

class Corrupting(WholeChunkServer):
    async def wait_chunk(self, package_id, block, chunk):
        bad = bytearray(await super().wait_chunk(package_id, block, chunk))
        bad[0] ^= 0xFF
        return memoryview(bad)

async def main(control_plane, root, token):
    store, server = seed_store(root), Corrupting()
    server.add(store)
    transport = TcpTransport("faulty", Settings())
    listener = await transport.listen("127.0.0.1", 0, server)
    async with ControlPlaneClient(control_plane, token=token) as client:
        # A member of the cluster: it keys its data-plane hello with the key its registration brings. In the
        # receiver's rack, as the store is: of the holders near it, the scale-up's source is the first by id.
        session = WorkerSession(client, WorkerSpec(PeerInfo("faulty", listener.address), 1 << 30,
                                                   labels={"rack": "r0"}),
                                holdings=lambda: {store.package_id: store.verified_blocks()},
                                on_data_key=transport.set_key)
        await session.start()
        async for _ in session.assignments():
            pass

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> tuple[Path, Manifest]:
    root = tmp_path_factory.mktemp("e2e") / "pkg"
    return root, tiny_package(root, layers=8, layer_bytes=250_000, chunk_bytes=64 << 10).manifest


class Cluster(Agents):
    """A control plane, a store agent and worker agents of one test, their logs and event files; every
    process is stopped at the end."""

    def __init__(self, tmp: Path, root: Path, manifest: Manifest) -> None:
        super().__init__(tmp)
        self.root, self.manifest = root, manifest
        cp_port, store_port = free_ports(2)
        self.cp_address, self.store_address = f"127.0.0.1:{cp_port}", f"127.0.0.1:{store_port}"

    def _start(self, name: str, *args: str | Path, env: dict[str, str]) -> subprocess.Popen:
        with (self.tmp / f"{name}.log").open("a") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "pipecast.cli", "-v", *map(str, args)], cwd=REPO, stdout=log,
                stderr=subprocess.STDOUT, env={**os.environ, "PIPECAST_AUTH_TOKEN": TOKEN, **env},
                start_new_session=True)  # stopped as a process group, as Agents stops its own
        return self.procs[name]

    def start_control_plane(self, wait: bool = True) -> subprocess.Popen:
        """The control plane on its port with the test's SQLite file (the same one after a restart); with
        ``wait``, once it answers."""
        host, port = self.cp_address.split(":")
        proc = self._start("cp", "control-plane", "--host", host, "--port", port, "--db", self.tmp / "cp.sqlite3",
                           "--lease-s", LEASE_S, env={"PIPECAST_HEARTBEAT_S": str(HEARTBEAT_S),
                                                      "PIPECAST_CONTROL_SCAN_S": str(SCAN_S),
                                                      "PIPECAST_CONTROL_FLUSH_S": "0.1"})
        if wait:
            self.wait_for(lambda: self.try_cp("packages") is not None, "the control plane to answer")
        return proc

    def accepts(self) -> bool:
        """Whether the control plane's port takes connections (a probe without gRPC's reconnect backoff)."""
        try:
            socket.create_connection(self.cp_address.split(":"), timeout=1).close()
        except OSError:
            return False
        return True

    def start_agent(self, node: str, *args: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self._start(node, "agent", "--node-id", node, "--control-plane", self.cp_address,
                           "--events", self.processes.events_path(node), "--label", "rack=r0", *args, env=env or {})

    def up(self, store_mbit: str = STORE_MBIT, agents: tuple[str, ...] = tuple(AGENTS),
           agent_env: dict[str, str] | None = None) -> str:
        """Control plane, the published package, its store agent and the agents (each with ``agent_env``), all
        registered."""
        self.start_control_plane()
        package_id = self.cp("publish", self.root, "--store-node", "store",
                             "--store-address", self.store_address)["package_id"]
        self.start_agent("store", "--listen", self.store_address, "--seed", self.root,
                         env={"PIPECAST_EGRESS_MBIT": store_mbit})
        for node in agents:
            extra = ("--serve-url", SERVE_URL) if node == "a1" else ()
            self.start_agent(node, "--listen", "127.0.0.1:0", "--cache-dir", self.tmp / f"cache-{node}",
                             "--memory", str(MEMORY), *extra, env=agent_env)
        self.wait_for(lambda: self.alive() >= {"store", *agents}, "every agent to register")
        return package_id

    def try_cp(self, *args: str | Path, token: str = TOKEN) -> Any:
        """``pipecast cp --json ARGS`` against this control plane: the JSON, or None if it failed."""
        result = CliRunner().invoke(cp_group, ["--control-plane", self.cp_address, "--token", token, "--json",
                                               *map(str, args)])
        return json.loads(result.output) if result.exit_code == 0 else None

    def cp(self, *args: str | Path) -> Any:
        out = self.try_cp(*args)
        assert out is not None, f"pipecast cp {' '.join(map(str, args))} failed"
        return out

    def alive(self) -> set[str]:
        workers = self.try_cp("workers") or []
        return {w["worker"]["peer"]["node_id"] for w in workers if w.get("alive")}

    def in_plans(self, package_id: str) -> set[str]:
        """Every node that is a source or a receiver of an active plan of the package."""
        plans = self.try_cp("plans", "--package", package_id)
        assert plans is not None
        return {n for p in plans for n in [*p.get("sources", []), *p.get("receivers", [])]}

    def wait_event(self, node: str, kind: str, where: Callable[[dict], bool] = lambda e: True) -> dict:
        return self.wait(node, kind, where)

    def wait_for(self, check: Callable[[], Any], what: str, details: Callable[[], str] = lambda: "",
                 logs: tuple[str, ...] = ()) -> Any:
        deadline = time.monotonic() + WAIT_S
        while not (result := check()):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what} {details()}\n"
                            + "\n".join(f"--- {n}\n{self.log(n)}" for n in logs))
            time.sleep(0.05)
        return result

    def verified(self, node: str, before: float = float("inf")) -> set[int]:
        return {e["block"] for e in self.events(node, "block_verified") if e["t"] < before}

    def assert_identical_copy(self, node: str) -> None:
        """The node's cached blocks are the store's bytes and hash to the manifest's digests."""
        cached = self.tmp / f"cache-{node}" / self.manifest.package_id
        for block in self.manifest.blocks:
            data = (cached / block.file).read_bytes()
            assert data == (self.root / block.file).read_bytes(), f"{node} block {block.index}"
            assert digest_bytes(data) == block.digest

    def stop(self, name: str) -> dict:
        """SIGTERM one process; returns its last event (its ``stopped`` record for an agent)."""
        proc = self.procs[name]
        proc.terminate()
        assert proc.wait(10) == 0, self.log(name)
        return self.events(name)[-1]

    def stop_all(self) -> None:
        """Agents first (they deregister), then the control plane; whatever does not stop is killed."""
        self.processes.stop(last=["cp"])


@pytest.fixture
def cluster(tmp_path, package):
    running = Cluster(tmp_path, *package)
    yield running
    running.stop_all()


def initial_fetches(cluster: Cluster) -> dict[str, list[tuple[int, str]]]:
    """Each agent's first assignment: its (block, parent) fetches."""
    return {n: [tuple(f) for f in cluster.wait_event(n, "assignment")["fetch"]] for n in AGENTS}


def downstream(fetches: dict[str, list[tuple[int, str]]], node: str) -> set[tuple[str, int]]:
    """(receiver, block) pairs whose block reaches the receiver through ``node`` in the plan."""
    below: set[tuple[str, int]] = set()
    frontier = {(rx, block) for rx, fs in fetches.items() for block, parent in fs if parent == node}
    while frontier:
        below |= frontier
        frontier = {(rx, block) for rx, fs in fetches.items() for block, parent in fs
                    if (parent, block) in below} - below
    return below


def test_one_scale_up_multicasts_the_package_onto_every_agent(cluster, package):
    root, manifest = package
    blocks = list(range(len(manifest.blocks)))
    package_id = cluster.up()
    workers = {w["worker"]["peer"]["node_id"]: w["worker"] for w in cluster.cp("workers")}
    assert workers["a1"]["peer"]["transports"] == ["tcp"] and workers["a1"]["labels"] == {"rack": "r0"}
    assert int(workers["a1"]["memory_bytes"]) == MEMORY and workers["a1"]["accelerator"]["kind"] == "cpu"
    assert workers["a1"]["serve_url"] == SERVE_URL and "serve_url" not in workers["a2"]

    started = time.time()
    reply = cluster.cp("scale-up", package_id, "--count", "4")
    assert reply["sources"] == ["store"] and sorted(reply["receivers"]) == AGENTS
    completes = [cluster.wait_event(node, "complete") for node in AGENTS]
    for node in AGENTS:
        cluster.assert_identical_copy(node)
        assert cluster.events(node, "peer_failed") == []

    everyone = {node: blocks for node in ["store", *AGENTS]}
    view = cluster.wait_for(lambda: (v := cluster.cp("availability", package_id))["by_worker"] == everyone and v,
                            "availability to show every block on every worker")
    assert view["by_block"] == [sorted(everyone)] * len(blocks)
    cluster.wait_for(lambda: cluster.in_plans(package_id) == set(), "the plan to end")

    # Multicast: the store sent each block as often as the plan said (binomial: once), the agents the rest.
    planned = sum(parent == "store" for fs in initial_fetches(cluster).values() for _, parent in fs)
    assert len([e for e in cluster.events("store", "peer_request") if e["block"] is not None]) == planned
    seconds = max(c["t"] for c in completes) - started
    sent = cluster.stop("store")["bytes_sent"]
    store_rate = mbit_to_bytes_per_s(float(STORE_MBIT))
    store_s = (manifest.total_bytes - burst_bytes_for(store_rate)) / store_rate
    print(f"\n4 agents got {manifest.total_bytes / 1e6:.1f} MB through the control plane in {seconds:.2f} s from the "
          f"scale-up call (the store's rate alone needs {store_s:.2f} s after its burst); the store sent "
          f"{sent / manifest.total_bytes:.2f}x the package")
    assert sent < 1.5 * manifest.total_bytes  # unicast would send 4x

    # Scale-down: a released agent is told to drop the package, and does.
    cluster.cp("release", package_id, "a4")
    cluster.wait_event("a4", "dropped", lambda e: e["package"] == package_id)
    assert "a4" not in cluster.cp("availability", package_id)["by_worker"]
    # Its disk cache keeps the blocks: the control plane knows (placement prefers a4 for a local load).
    cluster.wait_for(lambda: {p["package_id"]: p["blocks"] for w in cluster.cp("workers")
                              if w["worker"]["peer"]["node_id"] == "a4" for p in w.get("cached", [])}
                     == {package_id: blocks}, "a4's disk cache to be known")

    async def discovered() -> list[DiscoveredWorker]:
        async with ControlPlaneClient(cluster.cp_address, token=TOKEN) as client:
            return await ControlPlaneDiscovery(client, cluster.cp_address).list_workers()
    key = serving_key(data_plane_key(TOKEN))  # what the router presents to a1's serving worker
    assert asyncio.run(discovered()) == [DiscoveredWorker("a1", SERVE_URL, serving_key=key)]


def test_a_holder_and_the_idle_store_are_two_sources_of_a_rotated_plan(cluster, package):
    root, manifest = package
    package_id = cluster.up()
    first = cluster.cp("scale-up", package_id, "--worker", "a1")
    assert first["sources"] == ["store"]
    cluster.wait_event("a1", "complete")
    cluster.wait_for(lambda: cluster.in_plans(package_id) == set(), "the first plan to end")
    store_served = len([e for e in cluster.events("store", "peer_request") if e["block"] is not None])
    second = cluster.cp("scale-up", package_id, "--worker", "a2", "--worker", "a3", "--worker", "a4")
    assert second["strategy"] == "rotated" and second["sources"] == ["a1", "store"], second
    for node in ("a2", "a3", "a4"):
        cluster.wait_event(node, "complete")
        cluster.assert_identical_copy(node)
    # Both sent: the store's egress counted beside the holder's.
    assert {e["requester"] for e in cluster.events("a1", "peer_request") if e["block"] is not None}
    assert len([e for e in cluster.events("store", "peer_request") if e["block"] is not None]) > store_served


def test_a_low_priority_deployment_multicasts_at_its_share_of_the_stores_link(cluster, package):
    root, manifest = package
    cluster.start_control_plane()
    package_id = cluster.cp("publish", root, "--store-node", "store", "--store-address", cluster.store_address)[
        "package_id"]
    # The store's link is 16 Mbit/s; low-priority packages take a quarter of it (4 Mbit/s), the others all.
    cluster.start_agent("store", "--listen", cluster.store_address, "--seed", root, "--link-mbit", "16",
                        env={"PIPECAST_PRIORITY_SHARES": '{"low": 0.25}'})
    cluster.start_agent("a1", "--listen", "127.0.0.1:0")
    cluster.wait_for(lambda: cluster.alive() >= {"store", "a1"}, "the store and a1 to register")
    assert cluster.cp("deploy", package_id, "--priority", "low")["priority"] == "low"
    started = time.time()
    cluster.cp("scale-up", package_id, "--worker", "a1")
    assert cluster.wait_event("store", "assignment")["priority"] == "low"
    assert cluster.wait_event("a1", "assignment")["priority"] == "low"
    seconds = cluster.wait_event("a1", "complete")["t"] - started
    share = mbit_to_bytes_per_s(4)
    floor = (manifest.total_bytes - burst_bytes_for(share)) / share  # the low share's bucket after its burst
    print(f"\na low-priority package of {manifest.total_bytes / 1e6:.1f} MB took {seconds:.2f} s at a 4 Mbit/s share "
          f"(floor {floor:.2f} s)")
    assert seconds >= floor * 0.9
    assert "packages of priority low capped at 4 Mbit/s each way" in cluster.log("store")


def test_a_second_scale_up_mid_transfer_hangs_behind_the_chain_and_the_store_sends_one_copy(cluster, package):
    root, manifest = package
    package_id = cluster.up()
    first = cluster.cp("scale-up", package_id, "--worker", "a1", "--worker", "a2")
    assert first["strategy"] == "chain" and first["sources"] == ["store"]
    cluster.wait_event("a1", "block_verified")  # the first chain is moving bytes
    second = cluster.cp("scale-up", package_id, "--worker", "a3", "--worker", "a4")
    assert second["strategy"] == "chain" and second["sources"] == ["a2"], second  # a2: the first chain's tail
    for node in AGENTS:
        cluster.wait_event(node, "complete")
        cluster.assert_identical_copy(node)
    # a2 served the second chain blocks it was still receiving; the store sent the package once.
    assert {e["requester"] for e in cluster.events("a2", "peer_request")} & {"a3", "a4"}
    assert cluster.stop("store")["bytes_sent"] < 1.5 * manifest.total_bytes


def test_a_killed_relay_is_replaced_and_the_store_sends_only_what_the_replan_asks(cluster, package):
    root, manifest = package
    package_id = cluster.up()
    cluster.cp("scale-up", package_id, "--count", "4")
    fetches = initial_fetches(cluster)
    relay = max(AGENTS, key=lambda n: len(downstream(fetches, n)))
    cluster.wait_event(relay, "block_verified")
    cluster.procs[relay].kill()
    cluster.procs[relay].wait()
    killed_at = time.time()
    survivors = [n for n in AGENTS if n != relay]
    for node in survivors:
        cluster.wait_event(node, "complete")
        cluster.assert_identical_copy(node)
    missed = {(rx, block) for rx, block in downstream(fetches, relay) if block not in cluster.verified(rx, killed_at)}
    assert missed, "the relay was killed after its subtree had everything: nothing was tested"
    assert any(e["peer"] == relay for n in survivors for e in cluster.events(n, "peer_failed"))

    # The re-plan sends to the store only blocks the dead relay's subtree still missed (or had verified so
    # shortly before that its report had not reached the control plane: the child reports the dead relay in a
    # round trip, within the agents' report batching; such a block is asked for and not fetched), and the
    # agents fetch from the store only what some version of their plan said.
    first = {(n, b) for n, fs in fetches.items() for b, parent in fs if parent == "store"}
    planned = {(n, b) for n in AGENTS for e in cluster.events(n, "assignment") for b, parent in e["fetch"]
               if parent == "store"}
    unreported = {(rx, block) for rx, block in downstream(fetches, relay)
                  if block not in cluster.verified(rx, killed_at - REPORT_WINDOW_S)}
    assert planned - first <= unreported
    requests = [(e["requester"], e["block"]) for e in cluster.events("store", "peer_request") if e["block"] is not None]
    assert set(requests) <= planned
    # No block's bytes went out twice: a request resumed after a re-plan repeats at most the chunk in flight.
    files = len(cluster.events("store", "peer_request")) - len(requests)
    largest_file = max(len((root / "manifest.json").read_bytes()), *(f.bytes for f in manifest.files))
    sizes = {block.index: block.bytes for block in manifest.blocks}
    allowed = (sum(sizes[b] for _, b in set(requests)) + files * largest_file
               + (len(requests) - len(set(requests))) * manifest.blocks[0].chunk_bytes)
    sent = cluster.stop("store")["bytes_sent"]
    assert sent <= allowed
    print(f"\nkilled relay {relay} with {len(missed)} (agent, block) pairs still missing below it; the re-plan "
          f"gave {len(planned - first)} of them to the store; the store sent {sent / manifest.total_bytes:.2f}x "
          f"the package")


def test_a_corrupting_source_is_reported_and_its_receiver_replanned_around_it(cluster, package):
    root, manifest = package
    blocks = list(range(len(manifest.blocks)))
    package_id = cluster.up(agents=("a1",))
    cluster.processes.launch("faulty", [sys.executable, "-c", CORRUPTING_WORKER, cluster.cp_address, root, TOKEN],
                             cwd=REPO)
    cluster.wait_for(lambda: cluster.cp("availability", package_id)["by_worker"].get("faulty") == blocks,
                     "the corrupting worker to register its blocks")
    reply = cluster.cp("scale-up", package_id, "--worker", "a1")
    assert sorted(reply["sources"]) == ["faulty", "store"]
    cluster.wait_event("a1", "complete")
    cluster.assert_identical_copy("a1")

    failures = cluster.events("a1", "peer_failed")
    assert failures and {(e["peer"], e["error"]) for e in failures} == {("faulty", "CorruptChunkError")}
    first, *replans = cluster.events("a1", "assignment")
    assert {parent for _, parent in first["fetch"]} == {"faulty"}  # one receiver, two sources: all from one
    assert replans and all(parent == "store" for _, parent in replans[-1]["fetch"])
    # The control plane no longer counts the block it was caught corrupting as held by the faulty worker.
    reported = failures[0]["what"]
    assert reported.startswith("block ")
    assert int(reported.split()[1]) not in cluster.cp("availability", package_id)["by_worker"]["faulty"]


def test_a_control_plane_restart_does_not_stop_the_transfer_and_state_converges(cluster, package):
    root, manifest = package
    blocks = set(range(len(manifest.blocks)))
    package_id = cluster.up(store_mbit="4")  # ~4 s: the control plane is back while blocks still move
    cluster.cp("scale-up", package_id, "--count", "4")
    initial_fetches(cluster)  # every agent has its part
    cluster.wait_for(lambda: any(cluster.events(n, "block_verified") for n in AGENTS), "a first block")
    cluster.procs["cp"].kill()
    cluster.procs["cp"].wait()
    down_at = time.time()
    time.sleep(1.0)  # two blocks' time at the store's rate
    proc = cluster.start_control_plane(wait=False)
    cluster.wait_for(lambda: proc.poll() is None and cluster.accepts(), "the control plane to listen again")
    up_at = time.time()
    for node in AGENTS:
        cluster.wait_event(node, "complete")
        cluster.assert_identical_copy(node)
    verified_at = [e["t"] for n in AGENTS for e in cluster.events(n, "block_verified")]
    during = [t for t in verified_at if down_at < t < up_at]
    assert during, "no block moved while the control plane was down"
    assert max(verified_at) > up_at, "the transfer ended before the control plane was back: its return was not tested"

    truth = {node: sorted(cluster.verified(node)) for node in AGENTS} | {"store": sorted(blocks)}
    assert all(set(held) == blocks for held in truth.values())
    seen: list[dict] = []
    cluster.wait_for(lambda: seen.append(cluster.cp("availability", package_id)["by_worker"]) or seen[-1] == truth,
                     "availability after the restart to equal what the agents hold", lambda: f"last: {seen[-1]}")
    cluster.wait_for(lambda: cluster.in_plans(package_id) == set(), "the restored plan to end")
    after = [t for t in verified_at if t > up_at]
    print(f"\n{len(during)} of {len(verified_at)} blocks verified during the {up_at - down_at:.1f} s the control plane "
          f"was down, {len(after)} after it was back")


def test_without_a_control_plane_the_children_of_a_dead_relay_fetch_around_it_from_the_store(cluster, package):
    package_id = cluster.up()
    cluster.cp("scale-up", package_id, "--count", "4")
    fetches = initial_fetches(cluster)
    relay = max(AGENTS, key=lambda n: len(downstream(fetches, n)))
    cluster.wait_event(relay, "block_verified")
    for name in ("cp", relay):
        cluster.procs[name].kill()
        cluster.procs[name].wait()
    killed_at = time.time()
    survivors = [n for n in AGENTS if n != relay]
    for node in survivors:
        cluster.wait_event(node, "complete")
        cluster.assert_identical_copy(node)
    assert any(block not in cluster.verified(rx, killed_at) for rx, block in downstream(fetches, relay))
    # Nobody re-planned (no new parts came): the children went to the plan's source on their own.
    assert all(e["t"] < killed_at for n in survivors for e in cluster.events(n, "assignment"))
    fell_back = {(n, e["block"]) for n in survivors for e in cluster.events(n, "block_started")
                 if e["peer"].startswith("store@") and (e["block"], "store") not in fetches[n]}
    assert fell_back and {n for n, _ in fell_back} <= {rx for rx, _ in downstream(fetches, relay)}


def test_an_agent_with_a_wrong_token_exits_with_a_clear_error_and_changes_nothing(cluster):
    cluster.start_control_plane()
    before = cluster.cp("workers")
    intruder = cluster.start_agent("intruder", "--listen", "127.0.0.1:0", env={"PIPECAST_AUTH_TOKEN": "wrong"})
    assert intruder.wait(WAIT_S) == 2
    assert (f"error: control plane at {cluster.cp_address} refused Register: missing or wrong token"
            in cluster.log("intruder"))
    assert cluster.events("intruder", "failed")[0]["error"] == "Unauthenticated"
    assert cluster.cp("workers") == before == []
    assert cluster.try_cp("workers", token="wrong") is None


def test_a_hung_relay_is_blamed_by_its_children_alone_and_its_subtree_waits_on_its_healthy_parents(cluster,
                                                                                                   package):
    """Found in review: a relay that hangs with its connections open (here: stopped by SIGSTOP, its lease not yet
    over) went silent to its children, whose own children then heard nothing either: at the I/O timeout the whole
    subtree blamed healthy parents and fetched around them (3x the package from the store). A relay waiting on its
    parent now says so (WAIT), and restarts a chunk it was passing on (RESTART) once its new parent sends it."""
    root, manifest = package
    # The children time out the hung relay well before its lease ends (LEASE_S), so the plan's repair is theirs.
    package_id = cluster.up(agent_env={"PIPECAST_IO_TIMEOUT_S": "1.0"})
    cluster.cp("scale-up", package_id, "--count", "4")
    fetches = initial_fetches(cluster)
    hung = max(AGENTS, key=lambda n: len(downstream(fetches, n)))
    below = {rx for rx, _ in downstream(fetches, hung)}
    assert len(below) >= 2, f"{hung} relays to fewer than two agents: nothing to cascade ({fetches})"
    cluster.wait_event(hung, "block_verified")
    cluster.procs[hung].send_signal(signal.SIGSTOP)
    try:
        hung_at = time.time()
        for node in below:
            cluster.wait_event(node, "complete")
            cluster.assert_identical_copy(node)
        assert any(not cluster.verified(rx, hung_at) >= set(range(len(manifest.blocks))) for rx in below), \
            "the relay hung after its subtree had everything: nothing was tested"
        blamed = {(n, e["peer"]) for n in AGENTS for e in cluster.events(n, "peer_failed")}
        children = {rx for rx, fs in fetches.items() for _, parent in fs if parent == hung}
        assert blamed and {peer for _, peer in blamed} == {hung}, blamed
        assert {node for node, _ in blamed} <= children
        sent = cluster.stop("store")["bytes_sent"]
        # What the hung relay got, then one copy for its child: under twice the package (three, before).
        assert sent < 2 * manifest.total_bytes, sent / manifest.total_bytes
        print(f"\nhung relay {hung}: blamed by {sorted(node for node, _ in blamed)} only; the store sent "
              f"{sent / manifest.total_bytes:.2f}x the package")
    finally:
        cluster.procs[hung].send_signal(signal.SIGCONT)


def test_a_package_the_disk_cache_removes_to_make_room_is_forgotten_by_the_control_plane(cluster, package,
                                                                                         tmp_path):
    """Found in review: the control plane kept counting a package the agent's disk cache had removed to make room,
    and placed scale-ups there first as a local load. The agent now registers again (a registration replaces what
    the control plane knew of its cache; reports only add to it)."""
    root, manifest = package
    other = tiny_package(tmp_path / "other", layers=8, layer_bytes=250_000, chunk_bytes=64 << 10, seed=7).manifest
    # Room for one package in a1's cache, not two.
    package_id = cluster.up(agents=("a1",), agent_env={
        "PIPECAST_AGENT_CACHE_MAX_BYTES": str(int(1.5 * max(manifest.total_bytes, other.total_bytes)))})
    store2 = f"127.0.0.1:{free_ports(1)[0]}"
    other_id = cluster.cp("publish", tmp_path / "other", "--store-node", "store2", "--store-address", store2)[
        "package_id"]
    cluster.start_agent("store2", "--listen", store2, "--seed", tmp_path / "other")
    cluster.wait_for(lambda: "store2" in cluster.alive(), "store2 to register")

    def cached() -> dict[str, int]:
        [a1] = [w for w in cluster.cp("workers") if w["worker"]["peer"]["node_id"] == "a1"]
        return {c["package_id"]: len(c["blocks"]) for c in a1.get("cached", [])}

    cluster.cp("scale-up", package_id, "--worker", "a1")
    cluster.wait_event("a1", "complete", lambda e: e["package"] == package_id)
    cluster.cp("release", package_id, "a1")  # dropped from memory, kept in the disk cache
    cluster.wait_for(lambda: cached() == {package_id: len(manifest.blocks)}, "the control plane to know a1 caches it")
    cluster.cp("scale-up", other_id, "--worker", "a1")
    cluster.wait_event("a1", "complete", lambda e: e["package"] == other_id)
    cluster.wait_event("a1", "cache_removed", lambda e: e["package"] == package_id)
    cluster.wait_for(lambda: package_id not in cached(), "the control plane to forget what a1's cache removed",
                     details=lambda: str(cached()))


def test_a_chain_relays_in_the_smaller_pieces_its_plan_asks_for_and_every_copy_is_exact(tmp_path_factory, tmp_path):
    """Issue #16, end to end: a chain whose hops' relay pieces would add more than 5% of its package (here 3 hops of
    256 KiB, a third of it) asks its receivers for pieces of 64 KiB; they pass chunks on in them, verified whole."""
    root = tmp_path_factory.mktemp("pieces") / "pkg"
    manifest = tiny_package(root, layers=4, layer_bytes=600_000, chunk_bytes=256 << 10).manifest
    cluster = Cluster(tmp_path, root, manifest)
    try:
        package_id = cluster.up()
        cluster.cp("scale-up", package_id, "--count", str(len(AGENTS)), "--strategy", "chain")
        assert [cluster.wait_event(node, "assignment")["relay_bytes"] for node in AGENTS] == [64 << 10] * len(AGENTS)
        for node in AGENTS:
            cluster.wait_event(node, "complete")
            cluster.assert_identical_copy(node)
            assert cluster.events(node, "peer_failed") == []
    finally:
        cluster.stop_all()


def test_a_frozen_worker_leaves_the_plans_within_lease_plus_one_scan(cluster, package):
    root, manifest = package
    package_id = cluster.up()
    cluster.cp("scale-up", package_id, "--count", "4")
    fetches = initial_fetches(cluster)
    frozen = max(AGENTS, key=lambda n: len(downstream(fetches, n)))
    cluster.wait_event(frozen, "block_verified")
    cluster.procs[frozen].send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    cluster.wait_for(lambda: frozen not in cluster.in_plans(package_id), f"{frozen} to leave the plan")
    removed_after = time.monotonic() - stopped_at
    assert removed_after <= LEASE_S + SCAN_S + POLL_SLACK_S
    assert frozen not in cluster.alive()
    for node in AGENTS:
        if node != frozen:
            cluster.wait_event(node, "complete")
            cluster.assert_identical_copy(node)

    # Thawed, it registers again with what it holds.
    cluster.procs[frozen].send_signal(signal.SIGCONT)
    cluster.wait_for(lambda: frozen in cluster.alive(), f"{frozen} to register again")
    cluster.wait_for(lambda: set(cluster.cp("availability", package_id)["by_worker"].get(frozen, []))
                     == cluster.verified(frozen), f"{frozen}'s blocks to be known again")
    print(f"\n{frozen} left the plan {removed_after:.2f} s after it froze (lease {LEASE_S} s, scan {SCAN_S} s)")

