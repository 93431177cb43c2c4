"""``pipecast bench control-plane``: how fast the control plane plans, and how much load it takes.

Planning, in-process and pure: a scale-up of N workers x B blocks (source pick, schedule,
every node's part), from the store (binomial) and from K holders (rotated), p50 and p99 of ``repeat``; and in
each of those plans, a transfer under way (every receiver holding a quarter of the blocks, every other one
half), 10 relays dying one after another, each re-plan timed (p50 and p99 of them all). At each of the
``stall_workers`` counts: the event loop's stalls (:func:`measure_stall`) and a scale-up of 8 beside that many warm
holders (:func:`measure_warm_fleet`: the notices it makes and their rendering).
Load, against the real server (``pipecast control-plane``) in a subprocess with its SQLite file (or the
database ``db`` names, PostgreSQL) and authentication on (every call carries the master token and passes
the server's token check): N simulated workers register, watch their assignment streams and heartbeat
every ``heartbeat_s``; a scale-up onto all of them is timed until every stream has its ASSIGN; then for
``duration_s`` the workers report verified blocks, ``batch`` per report (1: each block as it is verified), each on its
own report stream as agents do, ``in_flight`` reports outstanding at a time (the first package's blocks are
reported in full whatever the duration: its plan completes on the way, and the driver waits, up to
``CANCEL_TIMEOUT_S``, until every stream got its CANCEL before closing them). Printed: blocks/s, report latency
percentiles, heartbeats kept, workers alive at the end, and the CPU of the server and of this driver
(both on this machine: the driver's share is CPU the server did not get).
"""

import asyncio
import gc
import random
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import psutil

from benchmarks.cluster import child_environment
from benchmarks.processes import cli
from control_plane.client import ControlPlaneClient
from control_plane.errors import ControlPlaneError, ControlPlaneUnavailable
from control_plane.messages import PeerInfo, UpdateKind, WorkerSpec
from control_plane.planner.plan import Plan
from control_plane.collector import collector_off, tune_collector
from control_plane.metrics import ControlMetrics
from control_plane.server import ControlPlaneServer, ServerConfig
from control_plane.service import ControlPlaneService
from control_plane.state import ControlState
from control_plane.store import is_postgres_url, open_store, redact_url
from packager.digest import DIGEST_ALGORITHM, digest_bytes
from packager.manifest import MANIFEST_FORMAT_VERSION, seal_manifest
from pipecast.core.errors import PipecastError
from pipecast.v1.manifest_pb2 import Block, Manifest

PLAN_TARGET_MS = 100.0  # p99, as the re-plan's: every repeat's plan under it
REPLAN_TARGET_MS = 50.0  # p99
DEATHS = 10  # relays that die one after another in each planning repeat
STALL_TARGET_MS = 50.0
#: Routers polling the control plane at once in the stall measure (each lists the workers and the pipelines).
POLLING_ROUTERS = 4
#: Workers a scale-up adds beside a fleet of warm holders in the warm-fleet measure (the daemon's step).
WARM_RECEIVERS = 8
REPORT_TARGET_PER_S = 5000.0
STREAMS_TIMEOUT_S = 60.0  # for the next assignment stream to open, while the driver opens them all
CANCEL_TIMEOUT_S = 30.0  # for every stream's CANCEL of the first package's plan, once all of its blocks are reported
REPLAN_TIMEOUT_S = 30.0  # in the stall measure, for the re-plan after the relay's lease lapses (scans: every 50 ms)
TOKEN = "bench-token-of-the-control-plane"
STORE = PeerInfo("store", "10.255.0.1:7070", ("tcp",))


class ControlPlaneBenchError(PipecastError):
    """The bench could not drive the load it was asked for on this machine."""


@dataclass
class PlanningResult:
    workers: int
    blocks: int
    sources: int
    strategy: str
    scale_up_ms: float  # median over repeats: source pick + schedule + every node's part, as the server plans
    # Median over every re-plan: one relay's lease lapses, its children get new parents; None: no receiver serves
    # others (a plan too small to have a relay), so there was none to time.
    replan_ms: float | None
    chunks: int = 1  # a block's
    scale_up_p99_ms: float = 0.0
    replan_p99_ms: float | None = None
    replans: int = 0  # re-plans timed: ``deaths`` relays, one after another, in each repeat's plan


@dataclass
class LoadResult:
    workers: int
    blocks: int
    duration_s: float
    batch: int
    register_s: float
    scale_up_rpc_ms: float
    all_assigned_s: float  # from the ScaleUp call until every stream had its ASSIGN
    blocks_reported: int
    reports: int
    blocks_per_s: float
    reports_per_s: float  # what the target counts: a report carries --batch blocks
    report_p50_ms: float | None  # None: no report answered
    report_p99_ms: float | None
    heartbeats: int
    heartbeat_failures: int
    alive_at_end: int
    plan_cancelled_streams: int
    server_cpu_percent: float  # of one core
    driver_cpu_percent: float
    machine_busy_percent: float


@dataclass
class StallResult:
    """The longest the real server's event loop went without running during a ScaleUp RPC, during routers'
    polls while the package moves (four routers listing the workers and the pipelines at once, each receiver
    holding a quarter of the blocks, a rotated quarter as from four sources, every worker with a serve URL:
    pipelines of four stages form) and during the re-plan after a relay's
    lease lapses (its flush of the plan included): a 5 ms probe's worst lateness."""

    workers: int
    blocks: int
    scale_up_rpc_ms: float
    scale_up_stall_ms: float
    replan_stall_ms: float | None  # None: no receiver serves others, so no relay's death to re-plan around
    chunks: int = 1  # a block's
    poll_ms: float = 0.0  # the routers' polls, all answered
    poll_stall_ms: float = 0.0
    pipelines: int = 0  # formed among the receivers at the polls


@dataclass
class WarmFleetResult:
    """A scale-up of a few workers beside many warm holders of the package (the scaling daemon adding replicas
    to a large fleet): the sources the plan names, the assignment notices it makes and their messages, rendered
    as the service renders them for the streams (on its event loop), in-process."""

    holders: int
    receivers: int
    sources: int
    notices: int
    rendered_bytes: int
    render_ms: float
    plan_ms: float  # the whole scale-up in-process (source pick, schedule, parts, install)
    resume_ms: float = 0.0  # a receiver whose lease lapsed halfway registering again: its plan for the rest


@dataclass
class BenchResult:
    planning: list[PlanningResult] = field(default_factory=list)
    stalls: list[StallResult] = field(default_factory=list)
    warm: list[WarmFleetResult] = field(default_factory=list)
    load: LoadResult | None = None
    database: str = "its SQLite file"  # where the server subprocess kept its state


def manifest(name: str, blocks: int, chunks: int = 1) -> Manifest:
    """A valid manifest (the control plane validates what is published) of ``blocks`` 64 MiB blocks of
    ``chunks`` chunks each, with made-up digests; ``name`` makes it, and so its id, differ from the others.
    With several chunks a block, binomial plans fetch chunk ranges (more units, a bigger plan)."""
    size = 64 << 20
    return seal_manifest(Manifest(
        format_version=MANIFEST_FORMAT_VERSION, model_name=name, digest_algorithm=DIGEST_ALGORITHM,
        num_layers=blocks, total_bytes=blocks * size,
        blocks=[Block(index=i, file=f"blocks/block-{i:04d}.safetensors", bytes=size, layer_start=i, layer_end=i + 1,
                      tensor_names=[f"model.layers.{i}.w"], digest=digest_bytes(f"{name} {i}".encode()),
                      chunk_bytes=-(-size // chunks),
                      chunk_digests=[digest_bytes(f"{name} {i} {c}".encode()) for c in range(chunks)])
                for i in range(blocks)]))


def worker_spec(i: int, racks: int = 8) -> WorkerSpec:
    return WorkerSpec(PeerInfo(f"w{i:05d}", f"10.{i // 250}.{i % 250}.1:7070", ("tcp",)), 1 << 40,
                      labels={"rack": f"r{i % racks}"})


def measure_planning(workers: int, blocks: int, sources: int, repeat: int, chunks: int = 1,
                     deaths: int = DEATHS) -> PlanningResult:
    """Times (p50, p99) of ControlState.scale_up onto ``workers`` fresh workers from ``sources`` holders (0: the
    store), and of the re-plans when ``deaths`` receivers that serve others die one after another."""
    plan_times, replan_times, strategy = [], [], ""
    for _ in range(repeat):
        state = ControlState(lease_s=10.0)
        package_id = state.publish(manifest("pkg", blocks, chunks), STORE, now=0)
        for i in range(workers + sources):
            state.register(worker_spec(i), {package_id: range(blocks)} if i >= workers else {}, now=0)
        # As the server plans (ControlPlaneService.ScaleUp): drafted, then the schedule and every node's part
        # made with the cyclic collector off and frozen after, then installed; its stored form, which the server
        # makes in the same thread before its durable write, is not part of this figure.
        start = time.perf_counter()
        draft = state.draft_scale_up(package_id, count=workers)
        plan = collector_off(lambda: _with_parts(draft.build()), freeze=True)
        result = state.install_scale_up(draft, plan, now=1)
        plan_times.append((time.perf_counter() - start) * 1000)
        strategy = result.strategy
        active = state.plans[result.plan_id]
        # A transfer under way, unevenly: every receiver holds the first quarter of the blocks, every other
        # one the first half (a dead relay's children then take holders of what they miss).
        for k, node in enumerate(result.receivers):
            state.report(node, {package_id: range(blocks // (2 if k % 2 else 4))}, {}, now=1)
        for _ in range(deaths):
            victim = next((node for node, part in active.parts.items() if part.serve and node in active.pending), None)
            if victim is None:
                break
            state.workers[victim].lease_expires = 0  # every other lease runs to 10
            start = time.perf_counter()
            state.tick(now=1)
            replan_times.append((time.perf_counter() - start) * 1000)
        gc.unfreeze()  # this repeat's plan may go
    return PlanningResult(workers, blocks, sources, strategy, statistics.median(plan_times),
                          _median(replan_times), chunks, scale_up_p99_ms=_percentile(plan_times, 0.99),
                          replan_p99_ms=_percentile(replan_times, 0.99),
                          replans=len(replan_times))


def measure_warm_fleet(holders: int, blocks: int, chunks: int = 1, receivers: int = WARM_RECEIVERS) -> WarmFleetResult:
    """A scale-up of ``receivers`` fresh workers beside ``holders`` workers holding the whole package, and
    every assignment notice it makes rendered as the server renders it (:class:`WarmFleetResult`)."""
    state = ControlState(lease_s=10.0)
    package_id = state.publish(manifest("warm", blocks, chunks), STORE, now=0)
    for i in range(holders):
        state.register(worker_spec(i), {package_id: range(blocks)}, now=0)
    for i in range(holders, holders + receivers):
        state.register(worker_spec(i), {}, now=0)
    service = ControlPlaneService(state, ControlMetrics(state), heartbeat_s=2.0)
    state.notices.clear()
    start = time.perf_counter()
    result = state.scale_up(package_id, count=receivers, now=1)
    plan_ms = (time.perf_counter() - start) * 1000
    notices = [n for n in state.notices if n.plan_id == result.plan_id]
    start = time.perf_counter()
    rendered = sum(service._render(notice).ByteSize() for notice in notices)
    render_ms = (time.perf_counter() - start) * 1000
    # One receiver, halfway, misses its lease: registering again (on the event loop) it gets a plan for the rest.
    back = state.workers[result.receivers[0]].spec
    state.report(back.node_id, {package_id: range(blocks // 2)}, {}, now=1)
    state.workers[back.node_id].lease_expires = 0
    state.tick(now=1)
    start = time.perf_counter()
    state.register(back, {package_id: range(blocks // 2)}, now=2)
    resume_ms = (time.perf_counter() - start) * 1000
    assert any(back.node_id in a.pending for a in state.plans.values()), "the returning receiver got no plan"
    return WarmFleetResult(holders, receivers, len(result.sources), len(notices), rendered, render_ms, plan_ms,
                           resume_ms)


def _with_parts(plan: Plan) -> Plan:
    plan.parts()
    return plan


class _LoopProbe:
    """Wakes every ``interval_s`` and keeps the worst lateness of its wake-ups: how long the loop was held."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s, self.worst_s = interval_s, 0.0

    async def run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.worst_s = max(self.worst_s, time.perf_counter() - before - self.interval_s)

    def take(self) -> float:
        """The worst lateness since the last call, in ms."""
        worst, self.worst_s = self.worst_s, 0.0
        return worst * 1000


def measure_stall(workers: int, blocks: int, chunks: int = 1) -> StallResult:
    """A ScaleUp RPC of ``workers`` (registered in-process) to the real server in this process, then a relay's
    lease lapsing, with the loop probe running beside the server (its SQLite file in a temporary folder); where
    no receiver serves others (too few workers for a relay), that step is skipped and its stall is None."""
    async def main(tmp: str) -> StallResult:
        server = ControlPlaneServer(ServerConfig(host="127.0.0.1", port=0, db_path=str(Path(tmp) / "cp.sqlite3"),
                                                 token=TOKEN, lease_s=600.0, scan_interval_s=0.05))
        await server.start()
        probe = _LoopProbe()
        task = asyncio.create_task(probe.run())
        try:
            state = server.state
            package_id = state.publish(manifest("stall", blocks, chunks), STORE, now=time.time())
            for i in range(workers):
                spec = worker_spec(i)
                state.register(replace(spec, serve_url=f"http://{spec.peer.address.split(':')[0]}:8000"), {},
                               now=time.time())
            server.service.flush()  # as registrations over time would have: the stall is the scale-up's alone
            async with ControlPlaneClient(server.address, token=TOKEN, timeout_s=300.0) as client:
                await asyncio.sleep(0.05)
                probe.take()
                start = time.perf_counter()
                reply = await client.scale_up(package_id, count=workers)
                rpc_ms = (time.perf_counter() - start) * 1000
                scale_up_stall = probe.take()
                parts = state.plans[reply.plan_id].parts
                # fewer blocks than the package (none of 1): a receiver with them all is done and the plan could
                # end, leaving no relay whose death is re-planned
                quarter = min(max(1, blocks // 4), blocks - 1)
                for k, node in enumerate(reply.receivers):  # as from four sources in rotated orders
                    first = (k % 4) * quarter % blocks
                    state.report(node, {package_id: range(first, min(first + quarter, blocks))}, {}, now=time.time())
                await asyncio.sleep(0.05)
                probe.take()
                start = time.perf_counter()
                polls = [call for _ in range(POLLING_ROUTERS)
                         for call in (client.list_workers(), client.list_pipelines(package_id))]
                answers = await asyncio.gather(*polls)
                poll_ms = (time.perf_counter() - start) * 1000
                poll_stall = probe.take()
            victim = next((node for node in reply.receivers if parts[node].serve), None)
            replan_stall = None
            if victim is not None:
                state.workers[victim].lease_expires = 0  # the next scan finds it lapsed
                deadline = time.monotonic() + REPLAN_TIMEOUT_S
                while state.replan_count == 0:
                    if time.monotonic() > deadline:
                        raise ControlPlaneBenchError(
                            f"stall measure at {workers} workers x {blocks} blocks: no re-plan within "
                            f"{REPLAN_TIMEOUT_S:g} s after relay {victim}'s lease lapsed")
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.6)  # the periodic flush (every 0.5 s) of the repaired plan
                replan_stall = probe.take()
            return StallResult(workers, blocks, rpc_ms, scale_up_stall, replan_stall, chunks, poll_ms, poll_stall,
                               len(answers[1]))
        finally:
            task.cancel()
            await server.stop(grace_s=0)

    thresholds = gc.get_threshold()
    tune_collector()  # as `pipecast control-plane` runs: its collector settings are part of its stalls
    try:
        with tempfile.TemporaryDirectory(prefix="pipecast-cp-stall-") as tmp:
            return asyncio.run(main(tmp))
    finally:
        gc.set_threshold(*thresholds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median(values: list[float]) -> float | None:
    """The median of ``values``; None for none (a figure with nothing to measure)."""
    return statistics.median(values) if values else None


def _ms(value: float | None, digits: int = 1) -> str:
    """A figure in ms for the report, "-" for none."""
    return "-" if value is None else f"{value:.{digits}f} ms"


def _percentile(values: list[float], q: float) -> float | None:
    """The sorted ``values``' element at index ``q`` x n (``q`` in 0..1; the largest past the end): of 3 repeats the
    p99 is the slowest. None for no value, as :func:`_median` (a NaN would reach the JSON)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


async def _wait_ready(client: ControlPlaneClient, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ControlPlaneUnavailable(f"control plane subprocess exited with {proc.returncode} before "
                                          f"serving: {log_path.read_text(errors='replace')[-2000:]}")
        try:
            await client.list_packages()
            return
        except ControlPlaneUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


class _Fleet:
    """Simulated workers sharing a few channels; counts what they see."""

    def __init__(self, address: str, workers: int, channels: int, packages: list[str]):
        self.clients = [ControlPlaneClient(address, token=TOKEN, timeout_s=30.0) for _ in range(channels)]
        self.specs = [worker_spec(i) for i in range(workers)]
        self.client_of = {s.node_id: self.clients[i % channels] for i, s in enumerate(self.specs)}
        self.packages = packages
        self.synced = asyncio.Semaphore(0)
        self.assigned: dict[str, float] = {}  # node -> when its ASSIGN of the first package came
        self.all_assigned = asyncio.Event()
        self.cancelled: set[str] = set()  # nodes told that the first package's plan ended
        self.all_cancelled = asyncio.Event()
        self.heartbeats = self.heartbeat_failures = 0
        self.latencies: list[float] = []
        self.blocks_reported = self.reports = 0

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    async def register_all(self, in_flight: int) -> None:
        limit = asyncio.Semaphore(in_flight)

        async def register(spec: WorkerSpec) -> None:
            async with limit:
                await self.client_of[spec.node_id].register(spec)

        await asyncio.gather(*(register(s) for s in self.specs))

    async def watch(self, node: str) -> None:
        async for update in self.client_of[node].watch_assignments(node):
            if update.kind is UpdateKind.SYNC:
                self.synced.release()
            elif update.package_id == self.packages[0] and update.kind is UpdateKind.ASSIGN:
                self.assigned.setdefault(node, time.monotonic())
                if len(self.assigned) == len(self.specs):
                    self.all_assigned.set()
            elif update.package_id == self.packages[0] and update.kind is UpdateKind.CANCEL:
                self.cancelled.add(node)
                if len(self.cancelled) == len(self.specs):
                    self.all_cancelled.set()

    async def heartbeat(self, node: str, interval_s: float) -> None:
        await asyncio.sleep(random.uniform(0, interval_s))
        while True:
            try:
                await self.client_of[node].heartbeat(node)
                self.heartbeats += 1
            except ControlPlaneError:
                self.heartbeat_failures += 1
            await asyncio.sleep(interval_s)

    async def report(self, nodes: list[str], blocks: int, batch: int, deadline: float) -> None:
        """Each of ``nodes`` reports on its own stream: its blocks in order, package after package, until
        ``deadline``; the first package in full whatever the deadline (it ends the scale-up's plan)."""
        streams = {node: self.client_of[node].open_report_stream() for node in nodes}
        try:
            for package_id in self.packages:
                for first in range(0, blocks, batch):
                    chunk = list(range(first, min(first + batch, blocks)))
                    for node in nodes:
                        if package_id != self.packages[0] and time.monotonic() >= deadline:
                            return
                        start = time.perf_counter()
                        await streams[node].report(node, {package_id: chunk})
                        self.latencies.append(time.perf_counter() - start)
                        self.blocks_reported += len(chunk)
                        self.reports += 1
        finally:
            for stream in streams.values():
                stream.close()


async def _drive(address: str, server: psutil.Process, workers: int, blocks: int, duration_s: float, batch: int,
                 heartbeat_s: float, channels: int, in_flight: int, progress: Callable[[str], None]) -> LoadResult:
    # Enough packages that reporting never runs out of blocks within duration_s (up to 5x the target rate).
    manifests = [manifest(f"pkg{k}", blocks)
                 for k in range(2 + int(duration_s * REPORT_TARGET_PER_S * 5 / (workers * blocks)))]
    fleet = _Fleet(address, workers, channels, [m.package_id for m in manifests])
    tasks: list[asyncio.Task] = []
    try:
        for m in manifests:
            await fleet.clients[0].publish_package(m, STORE)
        start = time.monotonic()
        await fleet.register_all(in_flight)
        register_s = time.monotonic() - start
        progress(f"registered {workers} workers in {register_s:.2f} s")
        nodes = list(fleet.client_of)
        tasks = [asyncio.create_task(fleet.watch(node)) for node in nodes]
        for opened in range(len(nodes)):
            try:
                await asyncio.wait_for(fleet.synced.acquire(), STREAMS_TIMEOUT_S)
            except TimeoutError:
                raise ControlPlaneBenchError(
                    f"only {opened} of {workers} assignment streams opened, none more within {STREAMS_TIMEOUT_S:g} s: "
                    "this machine cannot drive that many workers (try fewer --workers)") from None
        progress(f"{workers} assignment streams open")
        tasks += [asyncio.create_task(fleet.heartbeat(node, heartbeat_s)) for node in nodes]

        start = time.monotonic()
        await fleet.clients[0].scale_up(fleet.packages[0], count=workers)
        scale_up_rpc_ms = (time.monotonic() - start) * 1000
        await asyncio.wait_for(fleet.all_assigned.wait(), 120)
        all_assigned_s = max(fleet.assigned.values()) - start
        progress(f"scale-up: RPC {scale_up_rpc_ms:.0f} ms, all {workers} streams assigned after {all_assigned_s:.2f} s")

        cpu_server, cpu_driver, machine = server.cpu_times(), psutil.Process().cpu_times(), psutil.cpu_times()
        start = time.monotonic()
        # `in_flight` reporters share the workers: that many reports are outstanding at any time.
        await asyncio.gather(*(fleet.report(nodes[k::in_flight], blocks, batch, start + duration_s)
                               for k in range(in_flight)))
        elapsed = time.monotonic() - start
        server_cpu = _cpu(cpu_server, server.cpu_times()) / elapsed
        driver_cpu = _cpu(cpu_driver, psutil.Process().cpu_times()) / elapsed
        machine_busy = _busy(machine, psutil.cpu_times())
        try:  # the CANCELs are on their way: counting them now would race their delivery
            await asyncio.wait_for(fleet.all_cancelled.wait(), CANCEL_TIMEOUT_S)
        except TimeoutError:
            progress(f"only {len(fleet.cancelled)} of {workers} streams got the first plan's CANCEL within "
                     f"{CANCEL_TIMEOUT_S:g} s")
        alive = sum(w.alive for w in await fleet.clients[0].list_workers())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await fleet.close()
    latencies_ms = [seconds * 1000 for seconds in fleet.latencies]
    return LoadResult(
        workers=workers, blocks=blocks, duration_s=elapsed, batch=batch, register_s=register_s,
        scale_up_rpc_ms=scale_up_rpc_ms, all_assigned_s=all_assigned_s, blocks_reported=fleet.blocks_reported,
        reports=fleet.reports, blocks_per_s=fleet.blocks_reported / elapsed, reports_per_s=fleet.reports / elapsed,
        report_p50_ms=_percentile(latencies_ms, 0.5), report_p99_ms=_percentile(latencies_ms, 0.99),
        heartbeats=fleet.heartbeats, heartbeat_failures=fleet.heartbeat_failures, alive_at_end=alive,
        plan_cancelled_streams=len(fleet.cancelled), server_cpu_percent=100 * server_cpu,
        driver_cpu_percent=100 * driver_cpu, machine_busy_percent=100 * machine_busy)


def _cpu(before, after) -> float:
    return (after.user + after.system) - (before.user + before.system)


def _busy(before, after) -> float:
    total = sum(after) - sum(before)
    idle = (after.idle + getattr(after, "iowait", 0.0)) - (before.idle + getattr(before, "iowait", 0.0))
    return 1 - idle / total if total > 0 else 0.0


def run(workers: int = 1000, blocks: int = 64, duration_s: float = 10.0, batch: int = 1, heartbeat_s: float = 2.0,
        channels: int = 8, in_flight: int = 64, repeat: int = 3, db: str | None = None, chunks: int = 1,
        stall_workers: Sequence[int] = (), progress: Callable[[str], None] = lambda message: None) -> BenchResult:
    """Measure planning in-process, then load against a server subprocess (its state in ``db``: a
    postgresql:// URL of an empty database or a SQLite path; None: a SQLite file in a temporary folder);
    returns every figure. ``stall_workers``: worker counts at which the server's event-loop stalls are
    measured in this process (:func:`measure_stall`). ``chunks``: chunks a block in the planned packages."""
    result = BenchResult()
    if db is not None:
        open_store(db).close()  # a database the server cannot open fails now, not after the in-process phases
        result.database = f"PostgreSQL {redact_url(db)}" if is_postgres_url(db) else f"SQLite {db}"
    for sources in (0, 4):
        result.planning.append(measure_planning(workers, blocks, sources, repeat, chunks))
        planning = result.planning[-1]
        progress(f"planning {workers}x{blocks} from {f'{sources} worker sources' if sources else 'the store'}: "
                 f"{planning.scale_up_ms:.1f} ms, re-plan after a death {_ms(planning.replan_ms)} p50 "
                 f"{_ms(planning.replan_p99_ms)} p99")
    for count in stall_workers:
        result.stalls.append(measure_stall(count, blocks, chunks))
        stall = result.stalls[-1]
        progress(f"event loop at {count} workers: longest stall {stall.scale_up_stall_ms:.0f} ms during the "
                 f"ScaleUp RPC ({stall.scale_up_rpc_ms:.0f} ms), {_ms(stall.replan_stall_ms, 0)} during a re-plan")
    for count in stall_workers:
        result.warm.append(measure_warm_fleet(count, blocks, chunks))
        warm = result.warm[-1]
        progress(f"scale-up of {warm.receivers} beside {count} warm holders: {warm.notices} notices, "
                 f"{warm.rendered_bytes / 1e6:.1f} MB rendered in {warm.render_ms:.0f} ms")
    with tempfile.TemporaryDirectory(prefix="pipecast-cp-bench-") as tmp:
        port, log_path = _free_port(), Path(tmp) / "server.log"
        env = child_environment({"PIPECAST_AUTH_TOKEN": TOKEN, "PIPECAST_HEARTBEAT_S": str(heartbeat_s),
                                 "PIPECAST_LEASE_S": str(5 * heartbeat_s)})
        cmd = cli("control-plane", "--host", "127.0.0.1", "--port", port, "--db", db or Path(tmp) / "cp.sqlite3",
                  verbose=False)
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            async def main() -> LoadResult:
                address = f"127.0.0.1:{port}"
                async with ControlPlaneClient(address, token=TOKEN, timeout_s=2.0) as probe:
                    await _wait_ready(probe, proc, log_path, timeout_s=30.0)
                return await _drive(address, psutil.Process(proc.pid), workers, blocks, duration_s, batch,
                                    heartbeat_s, channels, in_flight, progress)
            result.load = asyncio.run(main())
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return result


def _blocks(figure: PlanningResult | StallResult) -> str:
    return f"{figure.blocks} blocks" + (f" of {figure.chunks} chunks" if figure.chunks > 1 else "")


def report(result: BenchResult) -> str:
    """The figures, each beside its target."""
    lines = [f"control plane bench (grpcio {grpc.__version__}, {psutil.cpu_count()} cores, server in a subprocess "
             f"with {result.database}, driver in this process)"]
    for p in result.planning:
        source = f"{p.sources} worker sources" if p.sources else "the store"
        verdict = "ok" if p.scale_up_p99_ms < PLAN_TARGET_MS else "OVER"
        if p.replan_p99_ms is None:
            replan = "no receiver serves others: no relay's death to re-plan around"
        else:
            verdict_replan = "ok" if p.replan_p99_ms < REPLAN_TARGET_MS else "OVER"
            replan = (f"re-plan after a relay's death {p.replan_ms:.1f} ms p50, {p.replan_p99_ms:.1f} ms p99 of "
                      f"{p.replans} (target < {REPLAN_TARGET_MS:.0f} ms p99: {verdict_replan})")
        lines.append(f"  plan scale-up {p.workers} workers x {_blocks(p)} from {source} ({p.strategy}): "
                     f"{p.scale_up_ms:.1f} ms p50, {p.scale_up_p99_ms:.1f} ms p99 (target < {PLAN_TARGET_MS:.0f} ms "
                     f"p99: {verdict}); {replan}")
    for st in result.stalls:
        stalls = [st.scale_up_stall_ms, st.poll_stall_ms, st.replan_stall_ms or 0.0]
        verdict = "ok" if max(stalls) <= STALL_TARGET_MS else "OVER"
        replan = ("no re-plan (no receiver serves others)" if st.replan_stall_ms is None
                  else f"{st.replan_stall_ms:.0f} ms during a re-plan after a relay's death")
        lines.append(f"  event loop at {st.workers} workers x {_blocks(st)}: longest stall {st.scale_up_stall_ms:.0f} "
                     f"ms during the ScaleUp RPC ({st.scale_up_rpc_ms:.0f} ms), {st.poll_stall_ms:.0f} ms during "
                     f"{POLLING_ROUTERS} routers' polls of the workers and pipelines ({st.poll_ms:.0f} ms, "
                     f"{st.pipelines} pipelines), {replan} (target <= {STALL_TARGET_MS:.0f} ms: {verdict})")
    for w in result.warm:
        verdict = "ok" if max(w.render_ms, w.resume_ms) <= STALL_TARGET_MS else "OVER"
        lines.append(f"  scale-up of {w.receivers} beside {w.holders} warm holders: planned in {w.plan_ms:.1f} ms "
                     f"in-process, {w.sources} sources, {w.notices} assignment notices, {w.rendered_bytes / 1e6:.2f} "
                     f"MB rendered in {w.render_ms:.1f} ms on the event loop; a receiver back after its lease lapsed "
                     f"re-planned in {w.resume_ms:.1f} ms on the event loop (target <= {STALL_TARGET_MS:.0f} ms: "
                     f"{verdict})")
    load = result.load
    if load is not None:
        # Reports, not blocks: with --batch N a report carries N blocks, and blocks/s passed the target at 1/N of it.
        verdict = "ok" if load.reports_per_s >= REPORT_TARGET_PER_S else "UNDER"
        lines += [
            f"  {load.workers} workers registered in {load.register_s:.2f} s; "
            f"ScaleUp RPC {load.scale_up_rpc_ms:.0f} ms, "
            f"every stream had its ASSIGN after {load.all_assigned_s:.2f} s",
            f"  block reports: {load.reports_per_s:.0f} reports/s ({load.blocks_per_s:.0f} blocks/s) sustained over "
            f"{load.duration_s:.1f} s (target >= {REPORT_TARGET_PER_S:.0f} reports/s: {verdict}); {load.reports} "
            f"reports of {load.batch} block(s) "
            f"on {load.workers} report streams, "
            f"latency p50 {_ms(load.report_p50_ms)} p99 {_ms(load.report_p99_ms)}",
            f"  heartbeats: {load.heartbeats} sent, {load.heartbeat_failures} failed; workers alive at the end "
            f"{load.alive_at_end}/{load.workers}; plan finished on {load.plan_cancelled_streams} streams",
            f"  CPU: server {load.server_cpu_percent:.0f}% of a core, driver {load.driver_cpu_percent:.0f}%, "
            f"machine {load.machine_busy_percent:.0f}% busy"
            + ("; the machine was saturated: the driver took CPU the server did not get"
               if load.machine_busy_percent >= 90 else ""),
        ]
    return "\n".join(lines)


def to_json(result: BenchResult) -> dict:
    return asdict(result)
