"""The processes of one benchmark run on the emulated cluster: each spawned into its host with a log and
an events file, waited on by the events it logs, and stopped as a process group at the end.

Shared by the distribution, surge and cold-start benchmarks and the demo, which differ only in what they
start and what they wait for, and by the tests' agent processes (:class:`Processes`, started on this
machine without a cluster).
"""

import asyncio
import json
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from subprocess import DEVNULL, Popen, TimeoutExpired

from benchmarks.cluster import EmulatedCluster, child_environment
from pipecast.core.credentials import issue_node_token

POLL_S = 0.05
LOG_TAIL_LINES = 20
STOP_GRACE_S = 5.0  # after SIGTERM, before SIGKILL


def cli(*args: str | Path, verbose: bool = True) -> list[str]:
    """A ``pipecast`` command line; ``verbose`` logs at INFO (not for HTTP servers: a line per health poll)."""
    return [sys.executable, "-m", "pipecast.cli", *(["-v"] if verbose else []), *map(str, args)]


#: The setting that gives a process the cluster's credentials (``auth_token``: the master or a node token).
AUTH_TOKEN_ENV = "PIPECAST_AUTH_TOKEN"


def credentials_env(master: str, node: str | None = None) -> dict[str, str]:
    """The environment that gives a process the credentials of the cluster whose master token is ``master``:
    agent ``node``, which registers with the control plane, its node token; ``node`` None the master itself
    (the control plane, the operator's tools, a router, the scaler, and an agent without a control plane,
    which derives the data-plane key from it). Empty ``master``: auth off (an empty token, whatever this
    process has)."""
    return {AUTH_TOKEN_ENV: issue_node_token(master, node) if master and node else master}


def credentials_line(auth: bool) -> str:
    """A benchmark headline's line on the run's credentials (:func:`credentials_env`)."""
    return ("credentials: on, as in a cluster that has them (a master token per run, a node token for each agent "
            "that registers: the data-plane hello on every transfer, the serving key on every completion and stage "
            "call)" if auth else "credentials: off (--no-auth)")


def driver_token() -> str:
    """The token a benchmark's driver process was given (:func:`credentials_env`; empty: auth off)."""
    return os.environ.get(AUTH_TOKEN_ENV, "")


FREE_PORT_FLOOR = 20000  # above the well-known and most services' ports
FREE_PORT_TRIES = 100


def free_port(host: str) -> int:
    """A port free on ``host`` now (loopback mode, where every host shares one network stack), below the
    kernel's ephemeral range: one the kernel hands out could go to an outgoing connection before the service
    binds it (seen once: a chaos agent's "address already in use")."""
    for _ in range(FREE_PORT_TRIES):
        port = random.randrange(FREE_PORT_FLOOR, max(_ephemeral_floor(), FREE_PORT_FLOOR + 1000))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken: whatever the kernel gives
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


#: A service's port on its host in netns mode, where every host has its own ports.
SERVICE_PORTS = {"agent": 7070, "serve": 8000, "router": 8080, "control": 7000}


def endpoint(cluster: EmulatedCluster, host: str, service: str) -> str:
    """``address:port`` for ``service`` (a key of :data:`SERVICE_PORTS`) on ``host``: its fixed port in netns
    mode; in loopback mode, where hosts share the machine's ports, a free one."""
    address = cluster.address(host)
    return f"{address}:{SERVICE_PORTS[service] if cluster.mode == 'netns' else free_port(address)}"


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log ("" if it does not exist yet)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def stop_processes(procs: Sequence[Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each process group, then SIGKILL what is left after ``grace_s``; every process is reaped."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                try:
                    if sig == signal.SIGTERM:
                        os.killpg(proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except TimeoutExpired:
                pass
        if all(proc.poll() is not None for proc in procs):
            return


class Processes:
    """Named processes, each in a process group of its own, in ``folder``: ``<name>.log`` and
    ``<name>.events.jsonl`` each.

    Failures raise ``error`` (the caller's own exception type) with the process's log tail.
    """

    def __init__(self, folder: Path, error: type[Exception]) -> None:
        self.folder = folder
        self.error = error
        self.procs: dict[str, Popen] = {}
        folder.mkdir(parents=True, exist_ok=True)

    def log_path(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def events_path(self, name: str) -> Path:
        return self.folder / f"{name}.events.jsonl"

    def events(self, name: str) -> list[dict]:
        """The events ``name`` logged so far; a line still being written (no newline yet) is left for later."""
        path = self.events_path(name)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]

    def has(self, name: str, kind: str) -> bool:
        return any(e["event"] == kind for e in self.events(name))

    def launch(self, name: str, argv: Sequence[str | Path], env: dict[str, str] | None = None,
               cwd: Path | None = None, stdout: int | None = None) -> Popen:
        """Start ``argv`` on this machine in a process group of its own, with this process's environment
        (:func:`~benchmarks.cluster.child_environment`) plus ``env``; its output to ``name``'s log (standard output
        to ``stdout`` instead, e.g. PIPE, if given)."""
        return self._logged(name, partial(Popen, [str(a) for a in argv], env=child_environment(env),
                                          cwd=cwd, start_new_session=True), stdout)

    def _logged(self, name: str, start: Callable[..., Popen], stdout: int | None) -> Popen:
        """``start(stdin=, stdout=, stderr=)`` with the output to ``name``'s log; the process is ``name``."""
        with self.log_path(name).open("w") as log:
            self.procs[name] = start(stdin=DEVNULL, stdout=log if stdout is None else stdout, stderr=log)
        return self.procs[name]

    def log(self, name: str) -> str:
        """Everything ``name`` logged so far ("" before it starts)."""
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, name: str) -> str:
        return tail(self.log_path(name))

    def check_alive(self, names: Sequence[str], until_event: str | None = None) -> None:
        """Raise ``error``, with its log, for a process that logged ``failed`` or exited (before logging
        ``until_event``, when one is given)."""
        for name in names:
            code = self.procs[name].poll()
            failed = [e for e in self.events(name) if e["event"] == "failed"]
            if failed or (code is not None and (until_event is None or not self.has(name, until_event))):
                why = failed[0]["message"] if failed else f"exited with code {code}"
                when = f"before '{until_event}'" if until_event else "during the run"
                raise self.error(f"{name} failed {when}: {why}\n--- last lines of {self.log_path(name)}:\n"
                                 f"{self.log_tail(name)}")

    def wait_event(self, names: Sequence[str], kind: str, deadline: float, what: str,
                   late: type[Exception] | None = None) -> None:
        """Wait until each of ``names`` logged ``kind``; at ``deadline`` (time.time) raise ``late`` (default
        ``error``) naming the stragglers, and ``error`` at once for one that died."""
        pending = list(names)
        while pending:
            self.check_alive(pending, kind)
            pending = [n for n in pending if not self.has(n, kind)]
            if pending and time.time() >= deadline:
                raise (late or self.error)(f"{what}: {', '.join(pending)} had not logged '{kind}' in time; last "
                                           f"lines of {self.log_path(pending[0])}:\n{self.log_tail(pending[0])}")
            if pending:
                time.sleep(POLL_S)

    def stop(self, last: Sequence[str] = ()) -> None:
        """Stop every process, those named in ``last`` after the others (e.g. a control plane, so that
        agents can deregister on the way out)."""
        stop_processes([p for name, p in self.procs.items() if name not in last])
        stop_processes([p for name, p in self.procs.items() if name in last])


class RunProcesses(Processes):
    """The processes of one run, each spawned into a host of the emulated cluster."""

    def __init__(self, cluster: EmulatedCluster, folder: Path, error: type[Exception]) -> None:
        super().__init__(folder, error)
        self.cluster = cluster

    def spawn(self, name: str, host: str, argv: Sequence[str | Path], env: dict[str, str] | None = None,
              stdout: int | None = None) -> Popen:
        """Start ``argv`` on ``host`` (its own process group), its output to ``name``'s log (standard output
        to ``stdout`` instead, e.g. PIPE, if given)."""
        return self._logged(name, partial(self.cluster.spawn, host, [str(a) for a in argv], env=env), stdout)


async def publish_when_up(cp, manifest, store_id: str, store_address: str, deadline: float,
                          poll_s: float = 0.05) -> None:
    """Publish ``manifest`` on the control plane client ``cp``, served by the store agent ``store_id`` at
    ``store_address`` (TCP), once the control plane answers (a driver starts beside it); raises its
    ``ControlPlaneUnavailable`` after ``deadline`` (``time.monotonic``)."""
    from control_plane.errors import ControlPlaneUnavailable
    from control_plane.messages import PeerInfo

    while True:
        try:
            await cp.publish_package(manifest, PeerInfo(store_id, store_address, ("tcp",)))
            return
        except ControlPlaneUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(poll_s)
