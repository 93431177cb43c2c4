"""Real agent processes for integration tests: started with a log and an event file each, waited on by
event, all stopped at the end (the ``agents`` fixture in conftest.py). Starting, reading and stopping them
is the benchmarks' :class:`benchmarks.processes.Processes`."""

import asyncio
import json
import random
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen

from benchmarks.processes import Processes
from pipecast.v1.manifest_pb2 import Manifest
from tests.support import REPO

LAUNCH = ("import logging, sys; logging.basicConfig(level=logging.INFO, "
          "format='%(created).6f %(name)s %(levelname)s: %(message)s'); "
          "from pipecast.agent.command import agent_command; agent_command(sys.argv[1:])")
# Longer than the seed is held stopped while the receivers start (their first requests wait meanwhile).
IO_TIMEOUT_S = 10.0
WAIT_S = 30.0
POLL_S = 0.02  # finer than the benchmarks': some tests act between two blocks of a transfer
LISTEN_PORTS = (20000, 32768)  # [first, end): below the ephemeral range, see free_ports
MAX_PORT_TRIES = 1000


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now, picked below the kernel's ephemeral range (32768-60999 by
    default): a port the kernel hands out for port 0 may be taken, before the process it is meant for binds
    it, as the local port of any outgoing connection (a UCX endpoint's, another test's client's); one below
    that range only by an explicit bind."""
    rng = random.Random()
    ports: list[int] = []
    for _ in range(MAX_PORT_TRIES):
        if len(ports) == n:
            return ports
        port = rng.randrange(*LISTEN_PORTS)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
        ports.append(port)
    if len(ports) == n:
        return ports
    raise AssertionError(f"no {n} free loopback ports in {LISTEN_PORTS[0]}-{LISTEN_PORTS[1] - 1} after "
                         f"{MAX_PORT_TRIES} tries")


class Agents:
    """Agent processes of one test, their logs and event files in ``tmp``; all stopped at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.processes = Processes(tmp, AssertionError)
        self.procs = self.processes.procs

    def start(self, node: str, *args: str | Path, env: dict[str, str] | None = None) -> Popen:
        """``pipecast agent ARGS`` as ``node``, logging at INFO and recording its events."""
        argv = [sys.executable, "-c", LAUNCH, "--node-id", node, "--events", self.processes.events_path(node), *args]
        return self.processes.launch(node, argv, env={"PIPECAST_IO_TIMEOUT_S": str(IO_TIMEOUT_S), **(env or {})},
                                     cwd=REPO)

    def events(self, node: str, kind: str | None = None) -> list[dict]:
        """The events ``node`` recorded so far (of ``kind`` only, if given)."""
        return [e for e in self.processes.events(node) if kind is None or e["event"] == kind]

    def log(self, node: str) -> str:
        return self.processes.log(node)

    def wait(self, node: str, kind: str, where: Callable[[dict], bool] = lambda e: True) -> dict:
        """The first ``kind`` event of ``node`` that ``where`` accepts, once there (failing after WAIT_S, or
        at once when the agent failed or exited before recording ``kind``)."""
        deadline = time.monotonic() + WAIT_S
        while (event := self._first(node, kind, where, deadline)) is None:
            time.sleep(POLL_S)
        return event

    async def wait_async(self, node: str, kind: str) -> dict:
        """:meth:`wait` without blocking the event loop (for tests that serve peers in-process)."""
        deadline = time.monotonic() + WAIT_S
        while (event := self._first(node, kind, lambda e: True, deadline)) is None:
            await asyncio.sleep(POLL_S)
        return event

    def _first(self, node: str, kind: str, where: Callable[[dict], bool], deadline: float) -> dict | None:
        self.processes.check_alive([node], kind)
        found = [e for e in self.events(node, kind) if where(e)]
        assert found or time.monotonic() < deadline, f"no {kind} from {node} within {WAIT_S} s:\n{self.log(node)}"
        return found[0] if found else None

    def stop_all(self) -> None:
        """SIGTERM every agent, SIGKILL those still running a few seconds later."""
        self.processes.stop()


def write_plan(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def assert_identical_copy(agents: Agents, rx: str, root: Path, manifest: Manifest) -> None:
    cached = agents.tmp / f"cache-{rx}" / manifest.package_id
    for block in manifest.blocks:
        assert (cached / block.file).read_bytes() == (root / block.file).read_bytes(), f"{rx} block {block.index}"


def assert_auth_was_on(workdir: Path) -> None:
    """Every process a benchmark run started under ``workdir`` had the cluster's credentials: none of their
    logs warns that authentication is off (a control plane without a master token, an agent whose data plane
    is open)."""
    logs = list(workdir.rglob("*.log"))
    assert logs, f"no process log under {workdir}"
    off = [str(log.relative_to(workdir)) for log in logs if "authentication is off" in log.read_text().lower()]
    assert not off, f"processes without credentials: {off}"
