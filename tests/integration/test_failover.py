"""The control plane's leader killed mid-multicast (issue #17): two `pipecast control-plane` replicas on one
real PostgreSQL database, a store agent and four agents given both replicas' addresses. The leader is
killed with SIGKILL while blocks move; the standby takes over within the lease plus a try, the agents
follow it (a standby's answer names the leader; a dead replica is skipped), the transfer completes with
identical copies, every block verified once per agent, and the restored plan ends."""

import time
from collections import Counter

import pytest

from tests.integration.test_cluster import (  # noqa: F401 (package: a fixture)
    AGENTS, HEARTBEAT_S, LEASE_S, Cluster, initial_fetches, package)
from tests.support.agent_processes import free_ports

pytestmark = pytest.mark.timeout(300)


class ReplicatedCluster(Cluster):
    """The test cluster with two control-plane replicas on ``db_url``; ``cp_address`` lists both."""

    def __init__(self, tmp, root, manifest, db_url: str) -> None:
        super().__init__(tmp, root, manifest)
        self.db_url = db_url
        self.replicas = [f"127.0.0.1:{port}" for port in free_ports(2)]
        self.cp_address = ",".join(self.replicas)

    def start_control_plane(self, wait: bool = True):
        """The first replica (the leader, once it listens as one), then the standby."""
        for index, role in enumerate(("leader", "standby")):
            host, port = self.replicas[index].split(":")
            self._start(f"cp{index}", "control-plane", "--host", host, "--port", port, "--db", self.db_url,
                        "--advertise", self.replicas[index], "--lease-s", LEASE_S,
                        env={"PIPECAST_HEARTBEAT_S": str(HEARTBEAT_S)})
            self.wait_for(lambda: f"listening on {self.replicas[index]}" in self.log(f"cp{index}")
                          and f", {role})" in self.log(f"cp{index}"), f"replica {index} to listen as the {role}",
                          logs=(f"cp{index}",))
        return self.procs["cp0"]

    def stop_all(self) -> None:
        self.processes.stop(last=["cp0", "cp1"])


def test_the_multicast_completes_when_the_leader_is_killed_mid_transfer(postgres_server, tmp_path, package):
    root, manifest = package
    cluster = ReplicatedCluster(tmp_path, root, manifest, postgres_server.database())
    try:
        package_id = cluster.up(store_mbit="4")  # ~4 s of transfer: the takeover happens while blocks move
        cluster.cp("scale-up", package_id, "--count", "4")
        initial_fetches(cluster)
        assert len(cluster.cp("plans")) == 1
        cluster.wait_for(lambda: any(cluster.events(n, "block_verified") for n in AGENTS), "a first block")
        cluster.procs["cp0"].kill()
        cluster.procs["cp0"].wait()
        killed_at = time.time()
        cluster.wait_for(lambda: "took the lease" in cluster.log("cp1"), "the standby to take over", logs=("cp1",))
        for node in AGENTS:
            cluster.wait_event(node, "complete")
            cluster.assert_identical_copy(node)
        verified = {node: Counter(e["block"] for e in cluster.events(node, "block_verified")) for node in AGENTS}
        assert all(set(counts.values()) == {1} for counts in verified.values()), verified  # none fetched twice
        assert all(len(counts) == len(manifest.blocks) for counts in verified.values())
        late = [e for n in AGENTS for e in cluster.events(n, "block_verified") if e["t"] > killed_at]
        assert late, "the transfer ended before the leader died: the takeover was not tested"
        # The new leader restored the plan from the database and ended it once every agent reported.
        assert " plans=1 " in cluster.log("cp1")
        cluster.wait_for(lambda: cluster.in_plans(package_id) == set(), "the restored plan to end")
        truth = {node: list(range(len(manifest.blocks))) for node in AGENTS} | {
            "store": list(range(len(manifest.blocks)))}
        cluster.wait_for(lambda: cluster.cp("availability", package_id)["by_worker"] == truth,
                         "the new leader's availability to equal what the agents hold")
    finally:
        cluster.stop_all()
