"""A real PostgreSQL server for the tests: ``initdb`` into a temporary folder, ``pg_ctl start`` on a free
loopback port with its unix socket in that folder, ready within a deadline, one database per test, stopped
and removed at the end.

PostgreSQL refuses to run as root: when the tests run as root (CI), the server runs as the system user
:data:`SERVER_USER`, created if missing. Clients connect over TCP with a password (SCRAM), so the URLs the
tests hand the control plane carry one, as an operator's may. Where no PostgreSQL binaries are installed the
fixture skips its tests with the reason, or fails them when ``PIPECAST_REQUIRE_POSTGRES=1`` (CI sets it).
"""

import importlib
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.agent_processes import free_ports

REQUIRE_ENV = "PIPECAST_REQUIRE_POSTGRES"
SERVER_USER = "pipecast-pg"  # the server's own system user when the tests run as root
DB_USER, DB_PASSWORD = "pipecast", "pg-test-s3cret"
READY_DEADLINE_S = 60.0
STOP_DEADLINE_S = 30.0
# Debian's packages put the binaries here (only psql and friends go on PATH).
DEBIAN_BINARIES = Path("/usr/lib/postgresql")


def find_binaries() -> Path | None:
    """The folder of initdb, pg_ctl and postgres: on PATH, else the newest of Debian's; None if neither."""
    on_path = shutil.which("initdb")
    if on_path is not None:
        return Path(on_path).resolve().parent  # /usr/local/bin/initdb may link to Debian's folder
    found = [p.parent for p in DEBIAN_BINARIES.glob("*/bin/initdb")]

    def version(bindir: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", bindir.parent.name))

    return max(found, key=version) if found else None


def unavailable(reason: str) -> None:
    """Skip the test for ``reason``, or fail it where PostgreSQL is required."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"PostgreSQL is required ({REQUIRE_ENV}=1) but {reason}")
    pytest.skip(f"PostgreSQL tests skipped: {reason} (set {REQUIRE_ENV}=1 to fail instead)")


def _server_user() -> dict:
    """subprocess arguments that run a command as the server's user: none unless we are root."""
    if os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", SERVER_USER], check=True, capture_output=True)
        entry = pwd.getpwnam(SERVER_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


class PostgresServer:
    """One PostgreSQL cluster in a temporary folder; :meth:`database` hands each test a database of its own."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.port = free_ports(1)[0]
        self.as_server = _server_user()
        # Not under pytest's tmp_path: that is root's (0700), and the server's user must reach its folder.
        self.root = Path(tempfile.mkdtemp(prefix="pipecast-pg-"))
        self.data, self.sockets, self.log = self.root / "data", self.root / "sockets", self.root / "server.log"
        self._databases = 0
        self._started = False

    def _run(self, *argv: str, timeout_s: float) -> None:
        done = subprocess.run([str(self.bindir / argv[0]), *argv[1:]], capture_output=True, text=True,
                              timeout=timeout_s, cwd=self.root, env={"PATH": os.environ.get("PATH", ""),
                                                                    "LC_ALL": "C"}, **self.as_server)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited with {done.returncode}:\n{done.stdout}{done.stderr}"
                               f"{self._log_tail()}")

    def start(self) -> "PostgresServer":
        """initdb, then pg_ctl start and wait until a client connects (RuntimeError past the deadline)."""
        import psycopg

        self.sockets.mkdir()
        password_file = self.root / "password"
        password_file.write_text(DB_PASSWORD + "\n")
        if self.as_server:
            for path in (self.root, self.sockets, password_file):
                os.chown(path, self.as_server["user"], self.as_server["group"])
        self._run("initdb", "-D", str(self.data), "-U", DB_USER, f"--pwfile={password_file}",
                  "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8", "--locale=C", "--no-sync",
                  timeout_s=READY_DEADLINE_S)
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.sockets}"
        self._run("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
                  "-t", str(int(READY_DEADLINE_S)), timeout_s=READY_DEADLINE_S + 10)
        self._started = True
        deadline = time.monotonic() + READY_DEADLINE_S
        while True:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return self
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL not ready within {READY_DEADLINE_S:g} s: {exc}"
                                       f"{self._log_tail()}") from None
                time.sleep(0.1)

    def url(self, database: str) -> str:
        """A client URL of ``database``, with the password in it."""
        return f"postgresql://{DB_USER}:{DB_PASSWORD}@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        self._databases += 1
        name = f"test_{self._databases}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        """Stop the server (fast shutdown, then SIGKILL to the postmaster past the deadline) and remove its folder."""
        try:
            if self._started:
                try:
                    self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w",
                              "-t", str(int(STOP_DEADLINE_S)), timeout_s=STOP_DEADLINE_S + 10)
                except (RuntimeError, subprocess.TimeoutExpired):
                    pid = int((self.data / "postmaster.pid").read_text().split()[0])
                    os.kill(pid, 9)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            return "\nserver log:\n" + self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def start_server() -> PostgresServer:
    """A started server, or the test skipped (failed where required) when PostgreSQL or psycopg is missing."""
    bindir = find_binaries()
    if bindir is None:
        unavailable(f"no initdb on PATH or in {DEBIAN_BINARIES}/*/bin (apt-get install postgresql)")
    try:
        importlib.import_module("psycopg")
    except ImportError as exc:
        unavailable(f"psycopg cannot be imported ({exc}; pip install -e '.[postgres]')")
    server = PostgresServer(bindir)
    try:
        return server.start()
    except BaseException:
        server.stop()
        raise
