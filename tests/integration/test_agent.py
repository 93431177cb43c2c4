"""Real agent processes on loopback following static plans: identical bytes, cut-through, faults, shutdown,
and data-plane authentication from the master token (issue #12).

The seed's egress is rate-limited (PIPECAST_EGRESS_MBIT) so a transfer lasts long enough to observe,
and it is held with SIGSTOP until every receiver is up, so all of them are connected when bytes start.
"""

import signal
import subprocess
import time
from pathlib import Path

import pytest

from control_plane.planner.plan import Fetch, Plan
from control_plane.planner.schedules import make_plan
from pipecast.agent.local_client import LocalAgentClient
from pipecast.agent.plan_file import plan_file_data
from pipecast.agent.transport.tcp import TcpTransport
from pipecast.core.settings import Settings
from pipecast.v1.manifest_pb2 import Manifest
from tests.support.agent_fixtures import FlippingServer, seed_store
from tests.support.agent_processes import IO_TIMEOUT_S, Agents, assert_identical_copy, free_ports, write_plan
from tests.support.packages import tiny_package

SEED_MBIT = "16"  # 2 MB/s: the 1.2 MB package takes ~0.6 s from the seed


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> tuple[Path, Manifest]:
    root = tmp_path_factory.mktemp("integration") / "pkg"
    return root, tiny_package(root, layers=4, layer_bytes=300_000, chunk_bytes=64 << 10).manifest


def start_seed_held(agents: Agents, root: Path, plan: Path) -> subprocess.Popen:
    seed = agents.start("seed", "--seed", root, "--plan", plan, env={"PIPECAST_EGRESS_MBIT": SEED_MBIT})
    agents.wait("seed", "listening")
    seed.send_signal(signal.SIGSTOP)  # hold the bytes back until every receiver is connected
    return seed


def start_receivers(agents: Agents, plan: Path, receivers: list[str], *extra: str | Path) -> None:
    for rx in receivers:
        agents.start(rx, "--plan", plan, "--cache-dir", agents.tmp / f"cache-{rx}", *extra)
        agents.wait(rx, "listening")


def test_chain_of_four_copies_the_package_exactly_with_cut_through(agents, package, tmp_path):
    root, manifest = package
    chain = ["seed", "r1", "r2", "r3", "r4"]
    nodes = {node: f"127.0.0.1:{port}" for node, port in zip(chain, free_ports(len(chain)))}
    plan = write_plan(tmp_path / "plan.json", plan_file_data(
        make_plan("chain", ["seed"], chain[1:], len(manifest.blocks)), manifest.package_id, nodes))
    seed = start_seed_held(agents, root, plan)
    try:
        start_receivers(agents, plan, chain[1:4])
        # r4 receives into pages its memory reserve populated at start (pipecast.agent.reserve).
        start_receivers(agents, plan, ["r4"], "--local-socket", tmp_path / "r4.sock", "--reserve", "1MiB")
        assert agents.wait("r4", "reserve_filled")["bytes"] == 1 << 20
        with LocalAgentClient(tmp_path / "r4.sock") as client, pytest.raises(TimeoutError):
            client.wait_block(0, timeout=0.1)  # nothing can be verified while the seed is held
    finally:
        seed.send_signal(signal.SIGCONT)
    for rx in chain[1:]:
        agents.wait(rx, "complete")
        assert_identical_copy(agents, rx, root, manifest)
        assert agents.events(rx, "peer_failed") == []
        # One block at a time from a parent: blocks complete in layer order, as an engine needs them.
        assert [e["block"] for e in agents.events(rx, "block_verified")] == list(range(len(manifest.blocks)))

    # Cut-through: each relay's child starts every block before the relay has all of it. Block 0 is left
    # out of the timing check: it overlaps each hop's setup (manifest, store, files), which on a loaded
    # machine can outlast a block.
    blocks = range(len(manifest.blocks))
    for parent, child in zip(chain[1:], chain[2:]):
        verified = {e["block"]: e["t"] for e in agents.events(parent, "block_verified")}
        started = {e["block"]: (e["t"], e["peer"]) for e in agents.events(child, "block_started")}
        for block in blocks:
            assert started[block][1] == f"{parent}@{nodes[parent]}"
            if block:
                assert started[block][0] < verified[block], f"{child} waited for {parent} to finish {block}"

    with LocalAgentClient(tmp_path / "r4.sock") as client:
        assert client.manifest() == manifest
        for block in manifest.blocks:
            assert bytes(client.wait_block(block.index, timeout=5)) == (root / block.file).read_bytes()
        assert client.package_file("config.json") == (root / "config.json").read_bytes()
        progress = client.progress()
        assert progress.complete and progress.bytes_present == manifest.total_bytes
        assert all(b.verified_at is not None for b in progress.blocks)
        status = client.status()
        assert status["node"] == "r4" and status["bytes_received"] >= manifest.total_bytes
        # The block buffers took the reserve's pages, a step before populating each; the package (1.2 MB) takes
        # all of it unless a block's bytes outran its prefault (a loaded machine), which then skips the block.
        reserve = status["reserve"]
        assert reserve["bytes"] == 1 << 20 and reserve["held_bytes"] + reserve["handed_over_bytes"] == 1 << 20
        assert reserve["handed_over_bytes"] > 0
        assert status["packages"][manifest.package_id]["goodput_bytes_per_s"] > 0
        stream = client.events(timeout=5)  # past events first: every block was verified already
        assert sorted(next(stream)["block"] for _ in blocks) == list(blocks)
        stream.close()

    for node in chain:
        agents.procs[node].terminate()
        assert agents.procs[node].wait(10) == 0, agents.log(node)
        assert agents.events(node)[-1]["event"] == "stopped"
    assert not (tmp_path / "r4.sock").exists()


def test_receivers_fetching_chunk_ranges_from_the_seed_and_each_other_each_end_with_every_block(agents, package,
                                                                                                tmp_path):
    """Issue #16: each receiver fetches one third of every block's chunks from the seed and the other two
    thirds from the other receivers, who relay them cut-through; the seed sends the package once."""
    root, manifest = package
    receivers = ["r1", "r2", "r3"]
    nodes = {node: f"127.0.0.1:{port}" for node, port in zip(["seed", *receivers], free_ports(4))}
    assignments: dict[str, list[Fetch[str]]] = {rx: [] for rx in receivers}
    for block in manifest.blocks:
        count = len(block.chunk_digests)
        thirds = [(0, count // 3), (count // 3, 2 * count // 3), (2 * count // 3, count)]
        assert all(first < end for first, end in thirds)
        for i, rx in enumerate(receivers):
            # Its own third from the seed first, then the others' from them: each parent fetches what it
            # serves before it, so the plan validates (no receiver waits on one that waits on it).
            assignments[rx] += [Fetch(block.index, "seed", thirds[i]),
                                *(Fetch(block.index, receivers[k], thirds[k]) for k in ((i + 1) % 3, (i + 2) % 3))]
    ranged = Plan("binomial", ("seed",), assignments)
    ranged.validate()
    plan = write_plan(tmp_path / "plan.json", plan_file_data(ranged, manifest.package_id, nodes))
    seed = start_seed_held(agents, root, plan)
    try:
        start_receivers(agents, plan, receivers)
    finally:
        seed.send_signal(signal.SIGCONT)
    blocks = [b.index for b in manifest.blocks]
    for rx in receivers:
        agents.wait(rx, "complete")
        assert_identical_copy(agents, rx, root, manifest)
        assert agents.events(rx, "peer_failed") == []
        assert sorted(e["block"] for e in agents.events(rx, "block_verified")) == blocks  # once each
        # It served each block's third to both other receivers.
        served = [(e["requester"], e["block"]) for e in agents.events(rx, "peer_request")]
        assert sorted(served) == sorted((other, b) for other in receivers if other != rx for b in blocks)
        log = agents.log(rx)
        other = receivers[(receivers.index(rx) + 1) % 3]
        first, end = assignments[rx][1].chunks
        assert f"block 0 chunks {first}-{end} from {other}@{nodes[other]}: " in log
    seed.terminate()
    assert seed.wait(10) == 0, agents.log("seed")
    # The seed's uplink carried every chunk once (a third of each block to each receiver), besides the
    # manifest and the small files each receiver asked it for.
    asked = [(e["requester"], e["block"]) for e in agents.events("seed", "peer_request") if e["block"] is not None]
    assert sorted(asked) == sorted((rx, b) for rx in receivers for b in blocks)
    files = (root / "manifest.json").stat().st_size + sum(f.bytes for f in manifest.files)
    assert agents.events("seed", "stopped")[0]["bytes_sent"] == manifest.total_bytes + len(receivers) * files


def test_killed_parent_is_a_typed_error_on_its_children_within_the_deadline(agents, package, tmp_path):
    root, manifest = package
    names = ["seed", "r1", "r2", "r3"]
    nodes = {node: f"127.0.0.1:{port}" for node, port in zip(names, free_ports(len(names)))}
    blocks = range(len(manifest.blocks))
    plan = write_plan(tmp_path / "plan.json", {
        "package_id": manifest.package_id, "nodes": nodes, "strategy": "tree", "sources": ["seed"],
        "assignments": {"r1": [[b, "seed"] for b in blocks], "r2": [[b, "r1"] for b in blocks],
                        "r3": [[b, "r1"] for b in blocks]}})
    seed = start_seed_held(agents, root, plan)
    try:
        start_receivers(agents, plan, ["r1", "r2", "r3"])
    finally:
        seed.send_signal(signal.SIGCONT)
    agents.wait("r2", "block_verified", lambda e: e["block"] == 0)
    agents.procs["r1"].kill()
    killed_at = time.time()
    for child in ("r2", "r3"):
        agents.wait(child, "complete")
        failure = agents.events(child, "peer_failed")[0]
        assert failure["peer"] == "r1"
        # Closed mid-answer; or a request the kill closed before any of its answer, sent again on a new
        # connection (an idle close looks the same), which nothing listens for any more.
        assert failure["error"] in ("PeerClosedError", "PeerConnectError", "PeerConnectTimeoutError",
                                    "PeerNotListeningError")
        assert failure["message"].startswith(f"peer r1@{nodes['r1']}: ")
        assert failure["t"] - killed_at < IO_TIMEOUT_S
        assert f"parent r1@{nodes['r1']} failed; falling back to source seed@{nodes['seed']}" in agents.log(child)
        assert_identical_copy(agents, child, root, manifest)


async def test_corrupting_relay_is_named_never_trusted_and_bypassed(agents, package, tmp_path):
    root, manifest = package
    relay_store = seed_store(root)
    faulty = FlippingServer(flip=(0, 1))
    faulty.add(relay_store)
    listener = await TcpTransport("faulty", Settings()).listen("127.0.0.1", 0, faulty)
    seed_port, rx_port = free_ports(2)
    nodes = {"seed": f"127.0.0.1:{seed_port}", "faulty": listener.address, "r1": f"127.0.0.1:{rx_port}"}
    blocks = list(range(len(manifest.blocks)))
    plan = write_plan(tmp_path / "plan.json", {
        "package_id": manifest.package_id, "nodes": nodes, "strategy": "tree", "sources": ["seed"],
        "held": {"faulty": blocks}, "assignments": {"r1": [[b, "faulty"] for b in blocks]}})
    try:
        agents.start("seed", "--seed", root, "--plan", plan)
        await agents.wait_async("seed", "listening")
        rx = agents.start("r1", "--plan", plan, "--cache-dir", tmp_path / "cache-r1", "--exit-when-complete")
        await agents.wait_async("r1", "stopped")
        assert rx.wait(5) == 0, agents.log("r1")
    finally:
        await listener.close()
        relay_store.close()
    failures = agents.events("r1", "peer_failed")
    assert [(e["what"], e["peer"], e["error"], e["message"]) for e in failures] == [
        ("block 0", "faulty", "CorruptChunkError",
         f"peer faulty@{listener.address}: sent a corrupt chunk 1 of block 0 (digest mismatch)")]
    # Block 0 was finished from the seed (blocks fetched from the relay in parallel were verified too).
    verified = {e["block"]: e["peer"] for e in agents.events("r1", "block_verified")}
    assert sorted(verified) == blocks and verified[0] == f"seed@{nodes['seed']}"
    assert_identical_copy(agents, "r1", root, manifest)


def test_a_parent_exiting_when_complete_gives_up_a_child_that_never_comes(agents, package, tmp_path):
    root, manifest = package
    nodes = {node: f"127.0.0.1:{port}" for node, port in zip(["seed", "r1"], free_ports(2))}
    plan = write_plan(tmp_path / "plan.json", plan_file_data(
        make_plan("chain", ["seed"], ["r1"], len(manifest.blocks)), manifest.package_id, nodes))
    seed = agents.start("seed", "--seed", root, "--plan", plan, "--exit-when-complete",
                        env={"PIPECAST_AGENT_IDLE_TIMEOUT_S": "1"})  # r1 is never started
    assert seed.wait(30) == 0, agents.log("seed")
    assert "no peer for 1 s and children r1 never came; exiting without them" in agents.log("seed")


def test_agents_given_the_master_token_authenticate_and_one_with_another_token_gets_nothing(agents, package,
                                                                                            tmp_path):
    root, manifest = package
    names = ["seed", "r1", "intruder"]
    nodes = {node: f"127.0.0.1:{port}" for node, port in zip(names, free_ports(len(names)))}
    plan = write_plan(tmp_path / "plan.json", plan_file_data(
        make_plan("tree", ["seed"], ["r1", "intruder"], len(manifest.blocks)), manifest.package_id, nodes))
    cluster, other = {"PIPECAST_AUTH_TOKEN": "the-cluster-master"}, {"PIPECAST_AUTH_TOKEN": "the-other-master"}
    agents.start("seed", "--seed", root, "--plan", plan, env=cluster)
    agents.wait("seed", "listening")
    rx = agents.start("r1", "--plan", plan, "--cache-dir", tmp_path / "cache-r1", "--exit-when-complete", env=cluster)
    intruder = agents.start("intruder", "--plan", plan, env=other)
    assert intruder.wait(30) != 0
    assert agents.events("intruder", "failed")[0]["error"] == "FetchFailedError"
    refusals = agents.events("intruder", "peer_failed")
    assert refusals and {e["error"] for e in refusals} == {"PeerAuthError"}
    assert refusals[0]["message"].startswith(f"peer seed@{nodes['seed']}: authentication failed: the peer holds "
                                             "another data-plane key: data-plane keys differ")
    assert not list((tmp_path).glob("cache-intruder*"))
    agents.wait("r1", "stopped")
    assert rx.wait(10) == 0, agents.log("r1")
    assert agents.events("r1", "peer_failed") == []
    assert_identical_copy(agents, "r1", root, manifest)
    assert "intruder" not in {e["requester"] for e in agents.events("seed", "peer_request")}
    assert "data-plane authentication is off" not in agents.log("seed")
