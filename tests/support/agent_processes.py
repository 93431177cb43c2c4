"""Real agent processes for integration tests: started with a log and an event file each, waited on by
event, all stopped at the end (the ``agents`` fixture in conftest.py)."""

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

import pytest

from pipecast.agent.events import read_events
from pipecast.v1.manifest_pb2 import Manifest
from tests.support import REPO

LAUNCH = ("import logging, sys; logging.basicConfig(level=logging.INFO, "
          "format='%(created).6f %(name)s %(levelname)s: %(message)s'); "
          "from pipecast.agent.command import agent_command; agent_command(sys.argv[1:])")
# Longer than the seed is held stopped while the receivers start (their first requests wait meanwhile).
IO_TIMEOUT_S = 10.0
WAIT_S = 30.0


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Agents:
    """Agent processes of one test, their logs and event files; all stopped at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, node: str, *args: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = (self.tmp / f"{node}.log").open("w")
        self.procs[node] = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, "--node-id", node, "--events", str(self.tmp / f"{node}.jsonl"),
             *map(str, args)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PIPECAST_IO_TIMEOUT_S": str(IO_TIMEOUT_S), **(env or {})})
        log.close()
        return self.procs[node]

    def events(self, node: str, kind: str | None = None) -> list[dict]:
        path = self.tmp / f"{node}.jsonl"
        events = read_events(path) if path.exists() else []
        return [e for e in events if kind is None or e["event"] == kind]

    def log(self, node: str) -> str:
        return (self.tmp / f"{node}.log").read_text()

    def find(self, node: str, kind: str, where: Callable[[dict], bool] = lambda e: True) -> dict | None:
        found = [e for e in self.events(node, kind) if where(e)]
        if not found and self.procs[node].poll() is not None and kind != "stopped":
            pytest.fail(f"agent {node} exited ({self.procs[node].returncode}) before {kind}:\n{self.log(node)}")
        return found[0] if found else None

    def wait(self, node: str, kind: str, where: Callable[[dict], bool] = lambda e: True) -> dict:
        deadline = time.monotonic() + WAIT_S
        while (event := self.find(node, kind, where)) is None:
            assert time.monotonic() < deadline, f"no {kind} from {node}:\n{self.log(node)}"
            time.sleep(0.02)
        return event

    async def wait_async(self, node: str, kind: str) -> dict:
        deadline = time.monotonic() + WAIT_S
        while (event := self.find(node, kind)) is None:
            assert time.monotonic() < deadline, f"no {kind} from {node}:\n{self.log(node)}"
            await asyncio.sleep(0.02)
        return event

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def write_plan(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def assert_identical_copy(agents: Agents, rx: str, root: Path, manifest: Manifest) -> None:
    cached = agents.tmp / f"cache-{rx}" / manifest.package_id
    for block in manifest.blocks:
        assert (cached / block.file).read_bytes() == (root / block.file).read_bytes(), f"{rx} block {block.index}"
