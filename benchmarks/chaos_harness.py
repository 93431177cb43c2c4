"""What every chaos scenario shares: its real processes, the faults it records, deadlines on every
operation (a missed one is a hang), sampling of each agent's RSS, fds and threads against the bounds, the
re-hash of every block an agent reports verified, and a cleanup that leaves nothing behind.

The bounds below are per agent process, for the small packages the scenarios move (a few MiB).
"""

import asyncio
import json
import logging
import os
import signal
import socket
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Any, TypeVar

import blake3
import psutil

from benchmarks.processes import Processes, cli, credentials_env, free_port
from pipecast.core.credentials import data_plane_key
from pipecast.core.errors import PipecastError
from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)

# An idle agent is ~100-150 MiB: Python, grpc, numpy and the package's buffers (a few MiB here). Hundreds
# of connections add their socket buffers (64 KiB each); 384 MiB leaves room for those, while a queue or a
# table that grows per connection or per requester name under a flood goes through it.
AGENT_RSS_BOUND_BYTES = 384 << 20
# An agent needs a few dozen fds of its own (memfds per block, its listener, grpc, logs). 512 leaves room
# for a few hundred peers at once; the connection flood opens more than that, so an agent that accepts
# without limit goes over it.
AGENT_FD_BOUND = 512
# asyncio runs on one thread; grpc and to_thread pools add a few dozen. A thread per connection or per
# request would go far beyond.
AGENT_THREAD_BOUND = 64
SAMPLE_S = 0.1
POLL_S = 0.05
CALL_TIMEOUT_S = 10.0  # one call to the control plane or an agent's local API
# Faster failure detection than the defaults, so that each scenario's recovery fits its deadlines.
AGENT_ENV = {"PIPECAST_IO_TIMEOUT_S": "3", "PIPECAST_CONNECT_TIMEOUT_S": "2", "PIPECAST_AGENT_REPLAN_WAIT_S": "2",
             "PIPECAST_HEARTBEAT_S": "0.5", "PIPECAST_RPC_TIMEOUT_S": "3"}
LEASE_S = 3.0

T = TypeVar("T")


class ChaosError(PipecastError):
    """A chaos scenario could not be set up (the harness's fault, not the system's)."""


@dataclass(frozen=True)
class Bounds:
    """What each agent process must stay within during a scenario."""

    rss_bytes: int = AGENT_RSS_BOUND_BYTES
    fds: int = AGENT_FD_BOUND
    threads: int = AGENT_THREAD_BOUND


@dataclass
class ScenarioResult:
    """The outcome of one scenario: what it injected and what it measured."""

    name: str
    faults: list[str] = field(default_factory=list)
    survived: bool = False
    corrupt_served: int = 0
    blocks_rehashed: int = 0  # verified blocks read back from the agents and re-hashed
    hangs: int = 0
    peak_rss_bytes: int = 0
    peak_fds: int = 0
    peak_threads: int = 0
    bounds: Bounds = field(default_factory=Bounds)
    seconds: float = 0.0
    detail: list[str] = field(default_factory=list)

    @property
    def within_bounds(self) -> bool:
        return (self.peak_rss_bytes <= self.bounds.rss_bytes and self.peak_fds <= self.bounds.fds
                and self.peak_threads <= self.bounds.threads)

    @property
    def passed(self) -> bool:
        return self.survived and self.corrupt_served == 0 and self.hangs == 0 and self.within_bounds

    def to_json(self) -> dict:
        return {"name": self.name, "faults": self.faults, "survived": self.survived,
                "corrupt_served": self.corrupt_served, "blocks_rehashed": self.blocks_rehashed,
                "hangs": self.hangs, "passed": self.passed,
                "peak_rss_bytes": self.peak_rss_bytes, "peak_fds": self.peak_fds,
                "peak_threads": self.peak_threads, "bounds": asdict(self.bounds), "seconds": self.seconds,
                "detail": "; ".join(self.detail)}


@dataclass(frozen=True)
class Peak:
    """RSS, open fds and threads of a process (a sample, or the largest of each over samples)."""

    rss_bytes: int = 0
    fds: int = 0
    threads: int = 0


def measure(pid: int) -> Peak | None:
    """RSS, open fds and threads of ``pid`` now (None once it is gone)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return Peak(proc.memory_info().rss, proc.num_fds(), proc.num_threads())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


class _Sampler(threading.Thread):
    """Samples the watched agents every SAMPLE_S; keeps each one's peaks."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="chaos sampler")
        self.pids: dict[str, int] = {}
        self.peaks: dict[str, Peak] = {}
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def watch(self, name: str, pid: int) -> None:
        with self._lock:
            self.pids[name] = pid

    def sample(self) -> None:
        with self._lock:
            pids = dict(self.pids)
        for name, pid in pids.items():
            now = measure(pid)
            if now is not None:
                old = self.peaks.get(name, Peak())
                self.peaks[name] = Peak(max(old.rss_bytes, now.rss_bytes), max(old.fds, now.fds),
                                        max(old.threads, now.threads))

    def run(self) -> None:
        while not self._halt.wait(SAMPLE_S):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(5.0)
        self.sample()


def local_call(socket_path: Path, request: dict, timeout_s: float = CALL_TIMEOUT_S) -> dict:
    """One request to an agent's local API (a JSON line each way)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(socket_path))
        sock.sendall(json.dumps(request).encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            piece = sock.recv(1 << 16)
            if not piece:
                raise ConnectionError(f"{socket_path}: closed before answering {request.get('op')}")
            answer += piece
    return json.loads(answer)


class Harness:
    """One scenario's processes and measurements, in ``folder``; ``close()`` ends them all."""

    def __init__(self, name: str, folder: Path, token: str) -> None:
        self.result = ScenarioResult(name)
        self.folder = folder
        self.token = token
        self.key = data_plane_key(token)  # what the cluster's insiders (and their impostors) hold
        self.processes = Processes(folder, ChaosError)
        self.sockets: dict[str, Path] = {}
        # Unix socket paths are limited to ~107 bytes: the agents' local sockets live in a short folder of
        # their own, whatever --workdir is.
        self._socket_dir = Path(tempfile.mkdtemp(prefix="pc-chaos-"))
        self.mounts: list[Path] = []
        self.expected_dead: set[str] = set()
        self.failures = 0
        self.control_address: str | None = None
        self._sampler = _Sampler()
        self._sampler.start()
        self._started = time.monotonic()

    # -- recording --------------------------------------------------------------------------------------

    def fault(self, description: str) -> None:
        """Record a fault injected."""
        log.info("%s: fault: %s", self.result.name, description)
        self.result.faults.append(description)

    def check(self, ok: bool, failure: str) -> bool:
        """Record ``failure`` unless ``ok``; returns ``ok``."""
        if not ok:
            log.info("%s: check failed: %s", self.result.name, failure)
            self.failures += 1
            self.result.detail.append(failure)
        return ok

    def note(self, text: str) -> None:
        """Record what the scenario saw (not a failure)."""
        self.result.detail.append(text)

    def hang(self, what: str) -> None:
        """Record an operation that missed its deadline."""
        self.result.hangs += 1
        self.result.detail.append(f"hang: {what}")

    def wait_until(self, what: str, done: Callable[[], bool], timeout_s: float, watch: Sequence[str] = ()) -> bool:
        """Poll ``done`` until true; after ``timeout_s`` it counts as a hang and returns False, as it does
        at once (a failure, not a hang) when a process named in ``watch`` exits meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not done():
            exited = [n for n in watch if not self.alive(n)]
            if exited:
                self.check(False, f"{what}: {exited[0]} exited (code {self.processes.procs[exited[0]].returncode}) "
                                  f"first: {self.processes.log_tail(exited[0]).splitlines()[-1:]}")
                return False
            if time.monotonic() > deadline:
                self.hang(f"{what} not within {timeout_s:g} s")
                return False
            time.sleep(POLL_S)
        return True

    def call(self, what: str, work: Callable[[], Coroutine[Any, Any, T]], timeout_s: float = CALL_TIMEOUT_S
             ) -> T | None:
        """Run the coroutine ``work()`` under a deadline: None (and a hang) if it misses it, None (and a
        failure) if it raises."""
        async def bounded() -> T:
            return await asyncio.wait_for(work(), timeout_s)

        try:
            return asyncio.run(bounded())
        except TimeoutError:
            self.hang(f"{what} not answered within {timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - any failure of the call is the scenario's finding
            self.check(False, f"{what}: {type(exc).__name__}: {exc}")
        return None

    # -- processes --------------------------------------------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Every process's environment: the cluster's master token, the fast timeouts, ``extra``."""
        return {**credentials_env(self.token), **AGENT_ENV, **(extra or {})}

    def node_env(self, node: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of an agent under the control plane: its own node token, not the master's."""
        return {**(extra or {}), **credentials_env(self.token, node)}

    def agent(self, node: str, *args: str | Path, env: dict[str, str] | None = None, address: str | None = None,
              name: str | None = None) -> str:
        """Start ``pipecast agent`` as ``node`` (process ``name``, default the node id) on loopback with a
        local API, watched by the sampler; returns its data-plane address."""
        name = name or node
        address = address or f"127.0.0.1:{free_port('127.0.0.1')}"
        self.sockets[name] = self._socket_dir / f"{name}.sock"
        proc = self.processes.launch(name, cli("agent", "--node-id", node, "--listen", address, "--events",
                                               self.processes.events_path(name), "--local-socket",
                                               self.sockets[name], *args), env=self.env(env))
        self._sampler.watch(name, proc.pid)
        return address

    def control_plane(self, port: int | None = None) -> str:
        """Start (or restart, on the same port and database) the control plane; its address once it
        listens."""
        port = port or free_port("127.0.0.1")
        name = f"control-plane-{sum(n.startswith('control-plane') for n in self.processes.procs) + 1}"
        self.processes.launch(name, cli("control-plane", "--host", "127.0.0.1", "--port", str(port), "--db",
                                        self.folder / "control.sqlite3", "--lease-s", str(LEASE_S)),
                              env=self.env())
        self.wait_until(f"{name} listening", lambda: "control plane listening" in self.processes.log(name)
                        or self.processes.procs[name].poll() is not None, 60.0)
        if self.processes.procs[name].poll() is not None:
            raise ChaosError(f"{name} exited: {self.processes.log_tail(name)}")
        self.control_address = f"127.0.0.1:{port}"
        return self.control_address

    def client(self):
        """A gRPC client of the control plane with the master token (use with ``async with``)."""
        from control_plane.client import ControlPlaneClient

        return ControlPlaneClient(self.control_address, token=self.token, timeout_s=CALL_TIMEOUT_S)

    def launch(self, name: str, argv: list, env: dict[str, str] | None = None) -> Popen:
        """Start any other process (a serving worker, a router) with the cluster's environment."""
        return self.processes.launch(name, argv, env=self.env(env))

    def kill9(self, name: str) -> None:
        """SIGKILL ``name`` (its process group) and reap it."""
        proc = self.processes.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        self.expected_dead.add(name)

    def events(self, name: str, kind: str | None = None, since: float = 0.0) -> list[dict]:
        """The events ``name`` logged at or after ``since`` (time.time()), of ``kind`` if given."""
        return [e for e in self.processes.events(name)
                if (kind is None or e["event"] == kind) and e.get("t", 0.0) >= since]

    def has(self, name: str, kind: str, since: float = 0.0, **fields: Any) -> bool:
        """Whether ``name`` logged ``kind`` with ``fields`` at or after ``since``."""
        return any(all(e.get(k) == v for k, v in fields.items()) for e in self.events(name, kind, since))

    def wait_event(self, name: str, kind: str, timeout_s: float, since: float = 0.0, **fields: Any) -> bool:
        """Wait for ``name`` to log ``kind`` (with ``fields``); a hang if it does not in time, a failure at
        once if it exits."""
        proc = self.processes.procs[name]
        ok = self.wait_until(f"{name} '{kind}'", lambda: self.has(name, kind, since, **fields)
                             or proc.poll() is not None, timeout_s)
        if ok and not self.has(name, kind, since, **fields):
            self.check(False, f"{name} exited (code {proc.returncode}) before '{kind}': "
                              f"{self.processes.log_tail(name).splitlines()[-1:]}")
            return False
        return ok

    def alive(self, name: str) -> bool:
        """Whether process ``name`` still runs."""
        return self.processes.procs[name].poll() is None

    def mount_tmpfs(self, path: Path, size: str) -> bool:
        """Mount a tmpfs of ``size`` at ``path`` (needs root); False, with the reason noted, if not."""
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
        if done.returncode != 0:
            self.check(False, f"cannot mount a tmpfs at {path}: {done.stderr.strip()}")
            return False
        self.mounts.append(path)
        return True

    # -- the end of a scenario --------------------------------------------------------------------------

    def corrupt_served(self, manifests: dict[str, Manifest]) -> tuple[int, int]:
        """Re-hash every block each live agent reports verified against its manifest: how many differ, and
        how many were re-hashed."""
        corrupt = checked = 0
        for node, sock in self.sockets.items():
            if not self.alive(node) or not sock.exists():
                continue
            try:
                status = local_call(sock, {"op": "status"})["status"]
                for package_id, package in status["packages"].items():
                    manifest = manifests.get(package_id)
                    if manifest is None:
                        self.check(False, f"{node} holds package {package_id[:12]}, which no one published")
                        continue
                    for block in package["blocks"]:
                        if block["verified_at"] is None:
                            continue
                        answer = local_call(sock, {"op": "buffer", "block": block["index"], "package": package_id})
                        with open(answer["path"], "rb") as buffer:
                            data = buffer.read(answer["bytes"])
                        checked += 1
                        if blake3.blake3(data).hexdigest() != manifest.blocks[block["index"]].digest:
                            corrupt += 1
                            self.note(f"{node} serves block {block['index']} of {package_id[:12]} as verified "
                                      "but its bytes do not match the manifest")
            except (OSError, KeyError, ValueError) as exc:
                self.hang(f"{node}'s local API did not answer the re-hash ({type(exc).__name__}: {exc})")
        return corrupt, checked

    def finish(self, manifests: dict[str, Manifest], goal: bool) -> ScenarioResult:
        """Re-hash what the agents hold, check that those not killed on purpose are alive, and fill in the
        result (``goal``: whether the scenario's own check held)."""
        self.result.corrupt_served, self.result.blocks_rehashed = self.corrupt_served(manifests)
        # A process that exited 0 finished its job (an agent with --exit-when-complete, a client).
        died = [n for n, p in self.processes.procs.items()
                if n not in self.expected_dead and p.poll() not in (None, 0)]
        for name in died:
            self.note(f"{name} died (code {self.processes.procs[name].returncode}): "
                      f"{' | '.join(self.processes.log_tail(name).splitlines()[-2:])}")
        self.result.survived = goal and not died and self.failures == 0
        return self.result

    def close(self) -> ScenarioResult:
        """Stop every process (the control plane last), unmount, and record the peaks."""
        self.processes.stop(last=[n for n in self.processes.procs if n.startswith("control-plane")])
        self._sampler.stop()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
        for path in self.mounts:
            done = subprocess.run(["umount", str(path)], capture_output=True, timeout=CALL_TIMEOUT_S)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=CALL_TIMEOUT_S)
        peaks = list(self._sampler.peaks.values()) or [Peak()]
        self.result.peak_rss_bytes = max(p.rss_bytes for p in peaks)
        self.result.peak_fds = max(p.fds for p in peaks)
        self.result.peak_threads = max(p.threads for p in peaks)
        self.result.seconds = time.monotonic() - self._started
        if not self.result.within_bounds:
            over = [f"{n}: {p.rss_bytes >> 20} MiB, {p.fds} fds, {p.threads} threads"
                    for n, p in self._sampler.peaks.items()
                    if p.rss_bytes > self.result.bounds.rss_bytes or p.fds > self.result.bounds.fds
                    or p.threads > self.result.bounds.threads]
            self.note(f"over the bounds: {', '.join(over)}")
        return self.result
