"""A real ``mlflow server`` subprocess for the MLflow tests: a SQLite backend and a local artifact folder under
one test folder, on a free loopback port, ready within a deadline, stopped with its whole process group."""

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.agent_processes import free_ports

READY_DEADLINE_S = 120.0  # a cold start takes ~10 s on an idle 2-core machine; several times that under load
STOP_DEADLINE_S = 10.0
# No job runner (it starts a handful of worker processes the tests do not use), no usage telemetry (the tests
# reach nothing beyond loopback).
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}


def free_loopback_port() -> int:
    """A TCP port nothing listens on now (the server binds it right after)."""
    return free_ports(1)[0]


class MlflowServer:
    """``mlflow server`` storing everything under ``root``; :attr:`uri` once :meth:`start` returned."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_loopback_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        self._proc: subprocess.Popen | None = None

    def start(self) -> "MlflowServer":
        """Start the server and wait until ``/health`` answers; RuntimeError with its log's end if it does not
        within :data:`READY_DEADLINE_S`, or exits."""
        argv = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
                "--artifacts-destination", str(self.root / "artifacts")]
        with self.log.open("wb") as log:
            # Its own session: stop() ends the server and the workers it forks, and nothing else.
            self._proc = subprocess.Popen(argv, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, **SERVER_ENV}, start_new_session=True)
        deadline = time.monotonic() + READY_DEADLINE_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self._proc.returncode}:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server not ready within {READY_DEADLINE_S:g} s:\n{self._log_tail()}")

    def stop(self) -> None:
        """End the server's process group: SIGTERM, then SIGKILL to what is left after :data:`STOP_DEADLINE_S`."""
        if self._proc is None or self._proc.poll() is not None:
            return
        os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever of the group is left, the server itself included if it did not stop
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]
