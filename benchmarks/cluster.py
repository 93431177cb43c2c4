"""The emulated cluster every pipecast benchmark runs on (DESIGN 5).

In ``netns`` mode each host is a network namespace with one veth into a bridge that lives in a namespace
of its own, so nothing is added to the machine's own namespace and the private subnet (10.77.0.0/24)
never leaves the cluster. Each host's link is shaped with tc HTB in both directions: egress on the
host-side veth, ingress on the bridge-side veth. Each direction has one class per peer (rate B/(n-1),
ceil B) under a parent at rate B, so flows sharing a link split it per peer rather than per TCP flow.
With ``link_queue="fifo"`` each direction is one class at rate B instead: one first-in first-out queue
shared by every flow, as at a switch port, so a small flow waits behind a bulk flow's queued bytes.

In ``loopback`` mode (no namespaces allowed, or asked for) each host gets its own 127.0.0.x address and
the processes the cluster starts are told their link rate through ``PIPECAST_EGRESS_MBIT`` and
``PIPECAST_INGRESS_MBIT``; the agent's transport enforces them with a token bucket.

The cluster is a context manager. On exit (also after an exception, Ctrl-C or SIGTERM) it kills every
process it started and deletes its namespaces; a cluster left by a process that died (SIGKILL) is
removed by the next cluster started with the same ``name_prefix``.
"""

import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from types import FrameType, TracebackType
from typing import Any, Literal

from pipecast.core.errors import PipecastError
from pipecast.core.fsutil import pid_alive
from pipecast.core.settings import Settings
from pipecast.core.units import format_bytes

logger = logging.getLogger(__name__)

ClusterMode = Literal["netns", "loopback"]
RequestedMode = Literal["auto", "netns", "loopback"]
LinkQueue = Literal["per-peer", "fifo"]

EGRESS_ENV = "PIPECAST_EGRESS_MBIT"
INGRESS_ENV = "PIPECAST_INGRESS_MBIT"
PER_ADDRESS_ENV = "PIPECAST_AGENT_MAX_CONNECTIONS_PER_ADDRESS"

NETNS_SUBNET = "10.77.0."
NETNS_PREFIX_LEN = 24
LOOPBACK_SUBNET = "127.0.0."
# .1 is left to whatever else runs on loopback; .255 is the broadcast address of the /24.
MAX_HOSTS = 250
HOST_IFACE = "eth0"
BRIDGE = "br0"

# Bursts far below one chunk at rate B: larger ones let an idle hop send faster than B and fake a
# better-than-floor result (DESIGN 5). A burst as large as a relay's piece (256 KiB, the agents' default) lets it
# pass each piece on faster than B too, which hides a piece's time per hop of a chain: N = 32 at 50 Mbit/s, 256 KiB
# pieces, 1.10-1.12x S/B at this burst, 1.23-1.24x at 32 KiB (docs/benchmarks.md, "Simulated"); --link-burst sets it.
HTB_BURST_BYTES = 256 * 1024
DEFAULT_MTU = 9000
FRAME_HEADER_BYTES = 14  # an Ethernet frame's bytes beyond its MTU
# Unclassified traffic (ARP) gets a tiny guaranteed rate so the per-peer guarantees still sum to ~B.
HTB_DEFAULT_RATE_BPS = 8_000
HTB_FIRST_PEER_MINOR = 0x10

COMMAND_TIMEOUT_S = 30.0
STOP_GRACE_S = 3.0
_NAME_PREFIX = re.compile(r"^[a-z]{1,6}$")
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_instance_numbers = count()
# Tags of clusters (and probes) this process has up now; others carrying our pid are an older process's.
_live_tags: set[str] = set()


#: The caller's settings a benchmark's processes do not inherit: a disk cache left by an earlier run (or a config file
#: naming one) made cold workers warm (figures under the floor, a baseline mode reading what the mode before cached)
#: and gave every loopback worker one cache.
UNINHERITED_ENV = ("PIPECAST_AGENT_CACHE_DIR", "PIPECAST_CONFIG")


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment less :data:`UNINHERITED_ENV`, then ``env`` on top: a benchmark's processes'."""
    return {**{k: v for k, v in os.environ.items() if k not in UNINHERITED_ENV}, **(env or {})}


class ClusterError(PipecastError):
    """The emulated cluster could not be built, used or torn down."""


class _Interrupted(BaseException):
    """SIGINT/SIGTERM (default disposition) arrived while a cluster was up; re-delivered after cleanup."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _redeliver(signum: int) -> None:
    """Act on ``signum``, which arrived while a cluster was up, now that it is torn down and the handlers
    are restored: ignored, handled by its Python handler (SIGINT's raises KeyboardInterrupt), or, under the
    default disposition, SystemExit(128 + signum): the status a shell reports for a process that signal
    killed, while the caller's with and finally blocks (temporary folders, CPU quota cgroups) still run,
    which killing the process here would skip."""
    handler = signal.getsignal(signum)
    if handler == signal.SIG_IGN:
        return
    if handler in (signal.SIG_DFL, None):
        raise SystemExit(128 + signum)
    signal.raise_signal(signum)


@dataclass(frozen=True)
class HostPlan:
    """One emulated host: its name, position, address and link rates (Mbit/s) in each direction."""

    name: str
    index: int
    address: str
    egress_mbit: float
    ingress_mbit: float


@dataclass(frozen=True)
class ModeChoice:
    """The mode a cluster can run in here, and why."""

    mode: ClusterMode
    reason: str


def store_egress_mbit(link_mbit: float, store_mbit: float | None) -> float:
    """The store host's egress rate: ``store_mbit`` when given, else the common link rate."""
    return float(link_mbit if store_mbit is None else store_mbit)


def plan_hosts(
    hosts: Sequence[str],
    link_mbit: float,
    store_mbit: float | None,
    store_host: str,
    subnet: str,
    host_mbit: Mapping[str, float] | None = None,
    host_egress_mbit: Mapping[str, float] | None = None,
) -> tuple[HostPlan, ...]:
    """Give each host an address in ``subnet`` (``"a.b.c."``) and its link rates; reject a bad layout.

    A host named in ``host_mbit`` has that rate in both directions instead of ``link_mbit`` (a node below
    its spec), one named in ``host_egress_mbit`` that rate out (an egress cap); ``store_mbit``, when given,
    still sets the store's egress.
    """
    if not hosts:
        raise ClusterError("an emulated cluster needs at least one host")
    if len(hosts) > MAX_HOSTS:
        raise ClusterError(f"an emulated cluster holds at most {MAX_HOSTS} hosts, got {len(hosts)}")
    duplicates = sorted(h for h, n in Counter(hosts).items() if n > 1)
    if duplicates:
        raise ClusterError(f"host names must be unique, repeated: {', '.join(duplicates)}")
    if link_mbit <= 0:
        raise ClusterError(f"link_mbit must be > 0, got {link_mbit}")
    if store_mbit is not None:
        if store_mbit <= 0:
            raise ClusterError(f"store_mbit must be > 0, got {store_mbit}")
        if store_host not in hosts:
            raise ClusterError(f"store_mbit is set but the store host {store_host!r} is not among the hosts")
    own, out = dict(host_mbit or {}), dict(host_egress_mbit or {})
    for what, given in (("host_mbit", own), ("host_egress_mbit", out)):
        for name, rate in given.items():
            if name not in hosts:
                raise ClusterError(f"{what} names {name!r}, which is not among the hosts")
            if rate <= 0:
                raise ClusterError(f"{what} of {name!r} must be > 0, got {rate}")
    rates = {name: float(own.get(name, link_mbit)) for name in hosts}
    return tuple(
        HostPlan(
            name=name,
            index=i,
            address=f"{subnet}{i + 2}",
            egress_mbit=float(out[name]) if name in out else
            store_egress_mbit(rates[name], store_mbit) if name == store_host else rates[name],
            ingress_mbit=rates[name],
        )
        for i, name in enumerate(hosts)
    )


def htb_commands(dev: str, rate_mbit: float, peers: Sequence[HostPlan], match: Literal["dst", "src"],
                 mtu: int, queue: LinkQueue = "per-peer", burst_bytes: int = HTB_BURST_BYTES) -> list[str]:
    """tc batch lines shaping ``dev``'s egress at ``rate_mbit`` with one HTB class per peer.

    Each peer's class is guaranteed rate/len(peers) and may borrow up to the full rate; packets are
    classified by the peer's address as destination (a host's egress) or source (a host's ingress).
    Equal quanta make borrowing classes share spare rate equally. ``queue="fifo"``: one class (and its
    one FIFO) for every packet instead. Every class may send ``burst_bytes`` at once after an idle spell.
    """
    rate = int(rate_mbit * 1e6)
    shape = f"burst {burst_bytes} cburst {burst_bytes}"
    if queue == "fifo":
        return [f"qdisc replace dev {dev} root handle 1: htb default 1",
                f"class add dev {dev} parent 1: classid 1:1 htb rate {rate}bit ceil {rate}bit {shape}"]
    quantum = 2 * (mtu + FRAME_HEADER_BYTES)
    lines = [
        f"qdisc replace dev {dev} root handle 1: htb default 2",
        f"class add dev {dev} parent 1: classid 1:1 htb rate {rate}bit ceil {rate}bit {shape}",
        f"class add dev {dev} parent 1:1 classid 1:2 htb rate {HTB_DEFAULT_RATE_BPS}bit ceil {rate}bit "
        f"{shape} quantum {quantum}",
    ]
    for peer in peers:
        minor = f"{HTB_FIRST_PEER_MINOR + peer.index:x}"
        share = max(rate // len(peers), 1)
        lines.append(f"class add dev {dev} parent 1:1 classid 1:{minor} htb rate {share}bit ceil {rate}bit "
                     f"{shape} quantum {quantum}")
        lines.append(f"filter add dev {dev} parent 1: protocol ip prio 1 u32 "
                     f"match ip {match} {peer.address}/32 flowid 1:{minor}")
    return lines


def _tool(name: str) -> str:
    """Path of an iproute2 tool; they live in sbin, which a non-login PATH may lack."""
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if found is None:
        raise ClusterError(f"{name!r} (iproute2) is not installed; netns mode needs it")
    return found


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    """Run a setup command; a failure is a ClusterError carrying the command and its stderr."""
    try:
        done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"{' '.join(argv)} did not finish within {COMMAND_TIMEOUT_S:.0f} s") from e
    if done.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _instance_tag(name_prefix: str) -> str:
    """A prefix unique to one cluster: the family, this process's pid and a per-process number."""
    return f"{name_prefix}{os.getpid()}x{next(_instance_numbers)}"


def _tag_pattern(name_prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^({re.escape(name_prefix)}(\d+)x\d+)-[a-z0-9]+$")


def _list_netns() -> list[str]:
    # Lines read "name" or "name (id: N)".
    return [line.split()[0] for line in _run([_tool("ip"), "netns", "list"]).splitlines() if line.strip()]


def _delete_netns(names: Sequence[str]) -> list[str]:
    """Kill whatever still runs in the namespaces, then delete them; return the ones left behind."""
    if not names:
        return []
    ip = _tool("ip")
    for ns in names:
        try:
            pids = _run([ip, "netns", "pids", ns]).split()
        except ClusterError as e:
            logger.warning("cannot list processes in namespace %s: %s", ns, e)
            continue
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        _run([ip, "-force", "-batch", "-"], stdin="".join(f"netns del {ns}\n" for ns in names))
    except ClusterError as e:
        logger.warning("deleting namespaces: %s", e)
    left = set(_list_netns())
    return [ns for ns in names if ns in left]


def remove_stale_clusters(name_prefix: str) -> list[str]:
    """Delete the namespaces of clusters in this family whose owning process is gone; return their tags.

    A cluster is stale when the pid in its tag is dead, or is ours but the tag is not one this process
    has up (a dead process with the same pid left it).
    """
    pattern = _tag_pattern(name_prefix)
    stale: dict[str, list[str]] = {}
    for ns in _list_netns():
        m = pattern.match(ns)
        if not m or m.group(1) in _live_tags:
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or not pid_alive(pid):
            stale.setdefault(m.group(1), []).append(ns)
    for tag, names in stale.items():
        logger.warning("removing stale emulated cluster %s (its process is gone): %s", tag, ", ".join(names))
        left = _delete_netns(names)
        if left:
            logger.error("stale namespaces could not be deleted: %s", ", ".join(left))
    return sorted(stale)


def detect_mode(name_prefix: str = "pc") -> ModeChoice:
    """Probe whether network namespaces with veth and HTB work here; else choose loopback, saying why."""
    if os.geteuid() != 0:
        choice = ModeChoice("loopback", "network namespaces need root and this process is not root")
    else:
        tag = _instance_tag(name_prefix)
        ns = f"{tag}-probe"
        _live_tags.add(tag)
        try:
            ip, tc = _tool("ip"), _tool("tc")
            _run([ip, "netns", "add", ns])
            try:
                _run([ip, "-n", ns, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"])
                _run([tc, "-n", ns, "qdisc", "add", "dev", "a", "root", "handle", "1:", "htb"])
            finally:
                _run([ip, "netns", "del", ns])
            choice = ModeChoice("netns", "network namespaces, veth and tc htb work")
        except ClusterError as e:
            choice = ModeChoice("loopback", f"network namespaces are not usable here: {e}")
        finally:
            _live_tags.discard(tag)
    logger.info("emulated cluster mode: %s (%s)", choice.mode, choice.reason)
    return choice


class EmulatedCluster:
    """Hosts with shaped links on one machine; use as ``with EmulatedCluster([...], 400) as c:``.

    ``link_mbit`` is every host's rate in each direction but those named in ``host_mbit``, which get their
    own (and those in ``host_egress_mbit``, their own out); the store host (``store_host``, if among the
    hosts) sends at ``store_mbit`` (default: its link rate). ``mode="auto"`` uses namespaces where they work
    and loopback otherwise (logged, and in :attr:`mode_reason`). ``mtu``, ``link_queue`` (one class per
    peer, or one FIFO per link direction: see the module docstring) and ``burst_bytes`` (what a link sends at once
    after an idle spell, :data:`HTB_BURST_BYTES`) apply to netns mode.
    """

    def __init__(
        self,
        hosts: Sequence[str],
        link_mbit: float,
        store_mbit: float | None = None,
        store_host: str = "store",
        mode: RequestedMode = "auto",
        mtu: int = DEFAULT_MTU,
        name_prefix: str = "pc",
        link_queue: LinkQueue = "per-peer",
        host_mbit: Mapping[str, float] | None = None,
        host_egress_mbit: Mapping[str, float] | None = None,
        burst_bytes: int = HTB_BURST_BYTES,
    ) -> None:
        if mode not in ("auto", "netns", "loopback"):
            raise ClusterError(f"mode must be 'auto', 'netns' or 'loopback', got {mode!r}")
        if link_queue not in ("per-peer", "fifo"):
            raise ClusterError(f"link_queue must be 'per-peer' or 'fifo', got {link_queue!r}")
        if not _NAME_PREFIX.match(name_prefix):
            raise ClusterError(f"name_prefix must be 1-6 lowercase letters, got {name_prefix!r}")
        if not 1280 <= mtu <= 65535:
            raise ClusterError(f"mtu must be within 1280..65535, got {mtu}")
        if burst_bytes < mtu + FRAME_HEADER_BYTES:  # HTB must let a whole frame through
            raise ClusterError(f"a link's burst must hold one frame ({mtu + FRAME_HEADER_BYTES} bytes at mtu {mtu}), "
                               f"got {burst_bytes}")
        self._requested_mode: RequestedMode = mode
        self._hosts = tuple(hosts)
        self._link_mbit = float(link_mbit)
        self._store_mbit = store_mbit
        self._store_host = store_host
        self._mtu = mtu
        self._name_prefix = name_prefix
        self._link_queue: LinkQueue = link_queue
        self._burst_bytes = burst_bytes
        self._host_mbit = dict(host_mbit or {})
        self._host_egress_mbit = dict(host_egress_mbit or {})
        # Validate now, so a bad layout fails before anything is built.
        plan_hosts(self._hosts, self._link_mbit, store_mbit, store_host, NETNS_SUBNET, self._host_mbit,
                   self._host_egress_mbit)
        self._mode: ClusterMode | None = None
        self._mode_reason = ""
        self._prefix = ""
        self._plans: dict[str, HostPlan] = {}
        self._processes: list[subprocess.Popen[Any]] = []
        self._running = False
        self._previous_handlers: dict[int, Any] = {}
        self._deferring_signals = False
        self._pending_signals: list[int] = []

    # -- what the cluster is --------------------------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        """Host names, in the order given."""
        return list(self._hosts)

    @property
    def link_mbit(self) -> float:
        """Every host's link rate per direction (but those given their own), Mbit/s."""
        return self._link_mbit

    @property
    def store_mbit(self) -> float:
        """The store host's egress rate, Mbit/s."""
        return store_egress_mbit(self._host_mbit.get(self._store_host, self._link_mbit), self._store_mbit)

    @property
    def mode(self) -> ClusterMode:
        """``"netns"`` or ``"loopback"``: the mode this cluster runs in (known once entered)."""
        if self._mode is None:
            raise ClusterError("the cluster's mode is known only once it is entered (use it in a with block)")
        return self._mode

    @property
    def mode_reason(self) -> str:
        """Why this mode was chosen."""
        return self._mode_reason

    @property
    def prefix(self) -> str:
        """This instance's unique name prefix (every namespace it creates starts with it)."""
        return self._prefix

    def address(self, host: str) -> str:
        """The IPv4 address ``host`` listens and sends on."""
        return self._plan(host).address

    def interface(self, host: str) -> str:
        """The network interface of ``host`` (e.g. for ``UCX_NET_DEVICES``)."""
        self._plan(host)
        return HOST_IFACE if self.mode == "netns" else "lo"

    def describe(self) -> str:
        """One line for benchmark output: mode, size and link rates."""
        queue = "one class per peer" if self._link_queue == "per-peer" else "one FIFO shared by every flow"
        shaping = (f"tc htb per host and direction, {queue}, bursts of {format_bytes(self._burst_bytes)}"
                   if self.mode == "netns"
                   else f"application-level token buckets ({EGRESS_ENV}/{INGRESS_ENV}), no kernel shaping")
        store = (f", store {self._store_host!r} egress {self.store_mbit:g} Mbit/s"
                 if self._store_host in self._hosts else "")
        own = "".join(f", {host} at {rate:g}" for host, rate in self._host_mbit.items())
        own += "".join(f", {host} sending at {rate:g}" for host, rate in self._host_egress_mbit.items())
        return (f"emulated cluster {self._prefix}: {self.mode} mode ({self._mode_reason}); "
                f"{len(self._hosts)} hosts at {self._link_mbit:g} Mbit/s per direction{own}{store}; {shaping}")

    # -- processes ------------------------------------------------------------------------------------

    def spawn(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host`` in a process group of its own; the cluster kills it on exit.

        The child inherits this process's environment (:func:`child_environment`) plus the link rates it must
        enforce itself (loopback mode; 0 in netns mode, where the kernel shapes), then ``env`` on top.
        """
        plan = self._plan(host)
        if not self._running:
            raise ClusterError("the cluster is not running: spawn processes inside its with block")
        child_env = child_environment()
        if self.mode == "netns":
            child_env.update({EGRESS_ENV: "0", INGRESS_ENV: "0"})
            command = [_tool("ip"), "netns", "exec", self._host_netns(plan), *argv]
        else:
            child_env.update({EGRESS_ENV: f"{plan.egress_mbit:g}", INGRESS_ENV: f"{plan.ingress_mbit:g}"})
            # Every host has the same address here: an agent's per-address connection cap would be the
            # whole cluster's, so it gets the total cap instead.
            child_env.setdefault(PER_ADDRESS_ENV, str(Settings.model_fields["agent_max_connections"].default))
            command = list(argv)
        child_env.update(env or {})
        process = subprocess.Popen(command, env=child_env, start_new_session=True, **popen_kwargs)
        self._processes.append(process)
        logger.debug("spawned pid %d on %s: %s", process.pid, host, " ".join(argv))
        return process

    # -- life cycle -----------------------------------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        if self._running:
            raise ClusterError("this cluster is already running: leave its with block before entering it again")
        self._install_signal_handlers()
        try:
            choice = self._choose_mode()
            self._mode, self._mode_reason = choice.mode, choice.reason
            self._prefix = _instance_tag(self._name_prefix)
            subnet = NETNS_SUBNET if choice.mode == "netns" else LOOPBACK_SUBNET
            self._plans = {p.name: p for p in plan_hosts(self._hosts, self._link_mbit, self._store_mbit,
                                                          self._store_host, subnet, self._host_mbit,
                                                          self._host_egress_mbit)}
            self._running = True
            if choice.mode == "netns":
                _live_tags.add(self._prefix)
                remove_stale_clusters(self._name_prefix)
                self._build_netns()
        except BaseException as e:
            self._close(e)
            raise
        logger.info("%s", self.describe())
        return self

    def _choose_mode(self) -> ModeChoice:
        if self._requested_mode == "loopback":
            return ModeChoice("loopback", "asked for")
        choice = detect_mode(self._name_prefix)
        if choice.mode != "netns":
            if self._requested_mode == "netns":
                raise ClusterError(f"netns mode was asked for but {choice.reason}")
            logger.warning("falling back to loopback mode, shaped by the applications: %s", choice.reason)
        return choice

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._close(exc)

    def _close(self, exc: BaseException | None) -> None:
        """Tear down, restore signal handlers, then deliver any signal that arrived meanwhile (see
        :func:`_redeliver`: one whose disposition is the default exits by SystemExit(128 + signum))."""
        self._deferring_signals = True
        try:
            left = self._teardown()
        finally:
            self._running = False
            self._restore_signal_handlers()
        signums = [exc.signum] if isinstance(exc, _Interrupted) else []
        signums += self._pending_signals
        self._pending_signals = []
        if left:
            message = f"emulated cluster {self._prefix}: namespaces left behind: {', '.join(left)}"
            if exc is None and not signums:
                raise ClusterError(message)
            logger.error("%s", message)
        for signum in signums:
            _redeliver(signum)

    def _teardown(self) -> list[str]:
        """Stop every spawned process group, then delete this cluster's namespaces; return leftovers."""
        self._stop_processes()
        if self._mode != "netns" or not self._prefix:
            return []
        mine = [ns for ns in _list_netns() if ns.startswith(f"{self._prefix}-")]
        left = _delete_netns(mine)
        _live_tags.discard(self._prefix)
        return left

    def _stop_processes(self) -> None:
        # A group outlives its leader; killpg is safe since Linux never reuses a live group's id.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for process in self._processes:
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + STOP_GRACE_S
            for process in self._processes:
                try:
                    process.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    pass
            if all(process.poll() is not None for process in self._processes):
                break
        self._processes.clear()

    def _build_netns(self) -> None:
        ip, tc = _tool("ip"), _tool("tc")
        plans = list(self._plans.values())
        bridge_ns = f"{self._prefix}-br"
        _run([ip, "-batch", "-"], stdin="".join(
            f"netns add {ns}\n" for ns in [bridge_ns, *(self._host_netns(p) for p in plans)]))
        bridge_lines = [f"link add {BRIDGE} type bridge", f"link set {BRIDGE} addrgenmode none"]
        for p in plans:
            port = self._bridge_port(p)
            bridge_lines += [
                f"link add name {port} mtu {self._mtu} type veth peer name {HOST_IFACE} mtu {self._mtu} "
                f"netns {self._host_netns(p)}",
                f"link set {port} addrgenmode none",
                f"link set {port} master {BRIDGE} up",
            ]
        bridge_lines.append(f"link set {BRIDGE} up")
        _run([ip, "-n", bridge_ns, "-batch", "-"], stdin="\n".join(bridge_lines) + "\n")
        ingress_lines = []
        for p in plans:
            peers = [q for q in plans if q is not p]
            host_lines = [
                "link set lo up",
                f"link set {HOST_IFACE} addrgenmode none",
                f"addr add {p.address}/{NETNS_PREFIX_LEN} dev {HOST_IFACE}",
                f"link set {HOST_IFACE} up",
            ]
            _run([ip, "-n", self._host_netns(p), "-batch", "-"], stdin="\n".join(host_lines) + "\n")
            egress = htb_commands(HOST_IFACE, p.egress_mbit, peers, "dst", self._mtu, self._link_queue,
                                  self._burst_bytes)
            _run([tc, "-n", self._host_netns(p), "-batch", "-"], stdin="\n".join(egress) + "\n")
            ingress_lines += htb_commands(self._bridge_port(p), p.ingress_mbit, peers, "src", self._mtu,
                                          self._link_queue, self._burst_bytes)
        _run([tc, "-n", bridge_ns, "-batch", "-"], stdin="\n".join(ingress_lines) + "\n")

    # -- signals --------------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        self._deferring_signals = False
        self._pending_signals = []
        if threading.current_thread() is not threading.main_thread():
            logger.debug("not in the main thread: Ctrl-C/SIGTERM clean-up relies on the caller")
            return
        for signum in _HANDLED_SIGNALS:
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._deferring_signals:
            self._pending_signals.append(signum)
            return
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)  # e.g. KeyboardInterrupt: unwinds through __exit__, which cleans up
        elif previous != signal.SIG_IGN:
            raise _Interrupted(signum)  # default disposition: clean up first, then exit as it would have

    # -- names ----------------------------------------------------------------------------------------

    def _plan(self, host: str) -> HostPlan:
        if host not in self._hosts:
            raise ClusterError(f"unknown host {host!r}: this cluster's hosts are {', '.join(self._hosts)}")
        if not self._plans:
            raise ClusterError("the cluster is not running: use it inside its with block")
        return self._plans[host]

    def _host_netns(self, plan: HostPlan) -> str:
        return f"{self._prefix}-{plan.index}"

    @staticmethod
    def _bridge_port(plan: HostPlan) -> str:
        return f"p{plan.index}"
