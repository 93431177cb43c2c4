"""``pipecast bench share``: serving latency on a link that is multicasting, with and without the share.

One emulated cluster (DESIGN 5) of four hosts: ``store``, ``w1``, ``w2`` and ``client``. A small HTTP
server on ``w1`` stands in for the serving worker's API: it answers every POST with 4 KiB (a streamed
answer's size) and computes nothing, so its latency measures the links' queueing, not compute. The
``client`` host sends it requests at a steady rate, open loop, each with a deadline, for the whole run.
Meanwhile real agents multicast a block package along the chain store -> w1 -> w2 (the distribution
benchmark's run, :func:`benchmarks.distribution.run_once`, on a static chain plan), twice: with
``multicast_share`` 1 (the whole link) and with the share asked for, every agent told its link rate.
So w1's link carries the package in and out while the serving traffic crosses it.

Three phases, in one run: the link idle, multicasting with share 1, multicasting with the share. Each
gives the requests' latency p50/p95/p99 (sent in the phase's window; a request past its deadline counts
as the deadline) and, for the multicasts, the time until w2 held the package against its floor: S/B at
the whole link, S/(share x B) with the share.

The module is pure logic (configuration, phases, report) above :func:`run`, which does the I/O; the two
actors run in the cluster as ``python -m benchmarks.share serve|load``.
"""

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from benchmarks.chaos_package import random_package
from benchmarks.checkout import module_argv
from benchmarks.cluster import EmulatedCluster, LinkQueue, RequestedMode
from benchmarks.cpu import CPU_BOUND_NOTE, CpuSampler, CpuUsage
from benchmarks.distribution import STORE, DistributionConfig, PackageFacts, run_once, worker_names
from benchmarks.processes import Processes, RunProcesses, free_port
from benchmarks.runinfo import versions
from benchmarks.surge.report import percentile
from packager.errors import PackageError
from packager.manifest import read_manifest
from pipecast.agent.events import EventLog
from pipecast.agent.ratelimit import mbit_to_bytes_per_s
from pipecast.core.errors import PipecastError
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.core.units import DEFAULT_CHUNK_BYTES, format_bytes

WORKERS = tuple(worker_names(2))
SERVER_HOST = "w1"  # in the middle of the chain: its link carries the package both ways
CLIENT = "client"
REQUESTS = "client-requests"  # the client's file of requests, a line each: never rate-limited as its events are
HOSTS = (STORE, *WORKERS, CLIENT)
STRATEGY = "chain"
SERVER_PORT = 8000  # netns mode: every host has its own network stack
ANSWER_BYTES = 4096  # a streamed answer's size
REQUEST_BODY = b'{"prompt": "How far is the moon?", "max_tokens": 64}'
PACKAGE_BLOCKS = 8
START_TIMEOUT_S = 60.0  # the actors import aiohttp on a busy machine
AGENT_START_DELAY_S = 4.0  # run_once starts the workers together this long after spawning them
WARMUP_S = 1.0  # the client's first connections are not part of the idle phase
PAUSE_S = 2.0  # between phases: the agents have exited, the links drain
LINK_ENV = "PIPECAST_AGENT_LINK_MBIT"
SHARE_ENV = "PIPECAST_MULTICAST_SHARE"

IDLE, FULL, SHARED = "idle", "multicast", "multicast+share"
LINK_QUEUES = {"fifo": "one FIFO per link direction (a switch port's)",
               "per-peer": "one tc class per peer on each link direction"}


class ShareBenchError(PipecastError):
    """The share benchmark was misconfigured (the caller's fault) or a run failed (named)."""


# -- configuration and figures (pure) ------------------------------------------------------------------


@dataclass(frozen=True)
class ShareConfig:
    """What one ``pipecast bench share`` measures."""

    package: Path
    link_mbit: float = 400.0
    share: float = 0.8
    rate_per_s: float = 50.0
    deadline_s: float = 2.0
    idle_s: float = 10.0
    mode: RequestedMode = "auto"
    link_queue: LinkQueue = "fifo"  # a switch port's: the serving traffic queues behind the multicast

    def __post_init__(self) -> None:
        if not 0 < self.share < 1:
            raise ShareBenchError(f"--share must be within (0, 1) (share 1 is the phase it is compared with), "
                                  f"got {self.share:g}")
        for name, value in (("--link-mbit", self.link_mbit), ("--rate", self.rate_per_s),
                            ("--deadline", self.deadline_s), ("--idle-seconds", self.idle_s)):
            if value <= 0:
                raise ShareBenchError(f"{name} must be > 0, got {value:g}")


def floor_seconds(total_bytes: int, link_mbit: float, share: float) -> float:
    """S / (share x B): no receiver holds the package sooner when every link carries it at that rate."""
    return total_bytes / mbit_to_bytes_per_s(share * link_mbit)


@dataclass(frozen=True)
class RequestRecord:
    """One request the client sent: when (time.time()) and its latency, None if it failed or missed its deadline."""

    sent: float
    seconds: float | None


def request_records(events: Iterable[Mapping]) -> list[RequestRecord]:
    """The client's ``request`` lines (its requests file, :func:`load`) as records."""
    return [RequestRecord(e["sent"], e["seconds"]) for e in events if e.get("event") == "request"]


def multicast_window(events: Mapping[str, Sequence[Mapping]]) -> tuple[float, float]:
    """From the first block request any agent served to the last block any agent verified (time.time())."""
    starts = [e["t"] for records in events.values() for e in records if e.get("event") == "peer_request"]
    ends = [e["t"] for records in events.values() for e in records if e.get("event") == "block_verified"]
    if not starts or not ends:
        raise ShareBenchError("the agents' events hold no served request or no verified block: no multicast window")
    return min(starts), max(ends)


@dataclass(frozen=True)
class PhaseResult:
    """The serving requests of one phase, and the multicast that ran meanwhile (None: the idle phase)."""

    phase: str
    share: float | None
    requests: int
    failed: int  # errors and missed deadlines, counted at the deadline in the percentiles
    p50_seconds: float
    p95_seconds: float
    p99_seconds: float
    cpu: CpuUsage  # the whole machine during the phase: a busy one, not the link, may set the latency
    multicast_seconds: float | None = None
    floor_seconds: float | None = None

    @property
    def ratio_to_floor(self) -> float | None:
        if self.multicast_seconds is None or self.floor_seconds is None:
            return None
        return self.multicast_seconds / self.floor_seconds

    def to_json(self) -> dict:
        return {"phase": self.phase, "share": self.share, "requests": self.requests, "failed": self.failed,
                "p50_seconds": self.p50_seconds, "p95_seconds": self.p95_seconds, "p99_seconds": self.p99_seconds,
                "multicast_seconds": self.multicast_seconds, "floor_seconds": self.floor_seconds,
                "ratio_to_floor": self.ratio_to_floor, "cpu_mean_percent": self.cpu.mean_percent,
                "cpu_saturated": self.cpu.saturated()}


def summarize_phase(phase: str, share: float | None, records: Sequence[RequestRecord], window: tuple[float, float],
                    deadline_s: float, cpu: CpuUsage, multicast_seconds: float | None = None,
                    floor: float | None = None) -> PhaseResult:
    """The requests sent within ``window`` (start inclusive), a failed one counted at ``deadline_s``."""
    start, end = window
    sent = [r for r in records if start <= r.sent < end]
    if not sent:
        raise ShareBenchError(f"phase {phase}: no request was sent in its {end - start:.2f} s window")
    p50, p95, p99 = (percentile([deadline_s if r.seconds is None else r.seconds for r in sent], q)
                     for q in (50, 95, 99))
    return PhaseResult(phase=phase, share=share, requests=len(sent), failed=sum(r.seconds is None for r in sent),
                       p50_seconds=p50, p95_seconds=p95, p99_seconds=p99, cpu=cpu,
                       multicast_seconds=multicast_seconds, floor_seconds=floor)


@dataclass(frozen=True)
class ShareReport:
    """Everything one benchmark invocation measured."""

    meta: dict
    results: tuple[PhaseResult, ...]

    def to_json(self) -> dict:
        return {"meta": self.meta, "results": [r.to_json() for r in self.results]}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def verdict(results: Sequence[PhaseResult]) -> str:
    """One line: p99 while multicasting with the whole link and with the share, against the idle link."""
    by_phase = {r.phase: r for r in results}
    idle, full, shared = by_phase[IDLE], by_phase[FULL], by_phase[SHARED]
    busy = [r.phase for r in results if r.cpu.saturated()]
    return (f"verdict: serving p99 {_ms(full.p99_seconds)} ms while multicasting at the whole link, "
            f"{_ms(shared.p99_seconds)} ms at share {shared.share:g} ({shared.p99_seconds / full.p99_seconds:.2f}x), "
            f"{_ms(idle.p99_seconds)} ms on the idle link; the multicast took "
            f"{shared.multicast_seconds / full.multicast_seconds:.2f}x as long with the share; "
            + (f"{CPU_BOUND_NOTE} ({', '.join(busy)})" if busy else "CPU not saturated"))


def _shaping(meta: Mapping) -> str:
    if meta["mode"] == "netns":
        return LINK_QUEUES[meta["link_queue"]]
    # Loopback: only the agents limit themselves; nothing queues the serving traffic behind them.
    return "agents' token buckets only, the serving traffic unshaped (the figures measure this machine, not a link)"


def format_report(report: ShareReport) -> str:
    """The three phases as a table, with the multicast's time beside its floor, and the verdict."""
    meta = report.meta
    lines = [f"pipecast bench share: random package {meta['package_id'][:12]} ({format_bytes(meta['package_bytes'])} "
             f"in {meta['blocks']} blocks, {format_bytes(meta['chunk_bytes'])} chunks), {STRATEGY} "
             f"{' -> '.join((STORE, *WORKERS))}, tcp transport",
             f"links {meta['link_mbit']:g} Mbit/s, {_shaping(meta)}; emulated cluster in {meta['mode']} mode "
             f"({meta['mode_reason']})",
             f"serving stand-in on {SERVER_HOST} ({ANSWER_BYTES} B answers, no compute), {CLIENT} sending "
             f"{meta['rate_per_s']:g} req/s open loop, deadline {meta['deadline_s']:g} s (a failed request counts "
             "at it); floor = S / (share x B); CPU: the whole machine during the phase",
             "",
             f"{'phase':<16} {'share':>5} {'requests':>8} {'failed':>6} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} "
             f"{'multicast s':>11} {'floor s':>8} {'x floor':>7} {'CPU':>5}"]
    for r in report.results:
        share = "-" if r.share is None else f"{r.share:.2f}"
        multicast = "-" if r.multicast_seconds is None else f"{r.multicast_seconds:.2f}"
        floor = "-" if r.floor_seconds is None else f"{r.floor_seconds:.2f}"
        ratio = "-" if r.ratio_to_floor is None else f"{r.ratio_to_floor:.2f}"
        lines.append(f"{r.phase:<16} {share:>5} {r.requests:>8} {r.failed:>6} {_ms(r.p50_seconds):>8} "
                     f"{_ms(r.p95_seconds):>8} {_ms(r.p99_seconds):>8} {multicast:>11} {floor:>8} {ratio:>7} "
                     f"{r.cpu.mean_percent:>4.0f}%")
    lines.append(verdict(report.results))
    return "\n".join(lines)


# -- the package ---------------------------------------------------------------------------------------


def share_package(cache: Path, mib: int) -> Path:
    """A package of ``mib`` MiB of random bytes in :data:`PACKAGE_BLOCKS` blocks, packed on first use."""
    out = Path(cache) / "packages" / f"share-random-{mib}mib"
    try:
        read_manifest(out)
        return out
    except PackageError:
        pass
    checkpoint = out.parent / f"{out.name}-checkpoint"
    for stale in (out, checkpoint):  # a build that was interrupted
        shutil.rmtree(stale, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    random_package(out, PACKAGE_BLOCKS, (mib << 20) // PACKAGE_BLOCKS, DEFAULT_CHUNK_BYTES)
    shutil.rmtree(checkpoint)  # the package is what moves; its checkpoint would double the disk used
    return out


# -- running (I/O) -------------------------------------------------------------------------------------


def _actor_argv(role: str, *args: str | Path) -> list[str]:
    return module_argv("benchmarks.share", role, *args)


@contextmanager
def _agents_link(link_mbit: float, share: float) -> Iterator[None]:
    """Agents spawned meanwhile are told their link rate and share: they inherit this process's
    environment (:meth:`EmulatedCluster.spawn`), and :func:`run_once` passes no other way to them."""
    saved = {name: os.environ.get(name) for name in (LINK_ENV, SHARE_ENV)}
    os.environ.update({LINK_ENV: f"{link_mbit:g}", SHARE_ENV: f"{share:g}"})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _meta(config: ShareConfig, facts: PackageFacts, cluster: EmulatedCluster) -> dict:
    return {"benchmark": "share", "versions": versions("aiohttp"), "cpu_cores": os.cpu_count(),
            "load_average_at_start": os.getloadavg()[0], "mode": cluster.mode, "mode_reason": cluster.mode_reason,
            "cluster": cluster.describe(), "link_queue": config.link_queue, "link_mbit": config.link_mbit,
            "share": config.share, "rate_per_s": config.rate_per_s, "deadline_s": config.deadline_s,
            "idle_s": config.idle_s,
            "strategy": STRATEGY, "package_id": facts.package_id, "package_path": str(facts.path),
            "package_bytes": facts.total_bytes, "blocks": len(facts.block_bytes), "chunk_bytes": facts.chunk_bytes,
            "answer_bytes": ANSWER_BYTES, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run(config: ShareConfig, workdir: Path, progress: Progress = NO_PROGRESS) -> ShareReport:
    """Measure the three phases (module docstring); the processes' logs and events go under ``workdir``."""
    facts = PackageFacts.of(config.package, read_manifest(Path(config.package)))
    multicast = DistributionConfig(package=config.package, workers=(len(WORKERS),), link_mbit=config.link_mbit,
                                   strategies=(STRATEGY,), repeat=1, mode=config.mode)
    with EmulatedCluster(list(HOSTS), config.link_mbit, mode=config.mode, link_queue=config.link_queue) as cluster:
        meta = _meta(config, facts, cluster)
        progress(cluster.describe())
        address = cluster.address(SERVER_HOST)
        port = SERVER_PORT if cluster.mode == "netns" else free_port(address)
        actors = RunProcesses(cluster, Path(workdir) / "serving", ShareBenchError)
        try:
            actors.spawn("server", SERVER_HOST, _actor_argv("serve", "--host", address, "--port", str(port),
                                                            "--events", actors.events_path("server")))
            actors.wait_event(["server"], "listening", time.time() + START_TIMEOUT_S, "serving stand-in")
            actors.spawn(CLIENT, CLIENT, _actor_argv(
                "load", "--url", f"http://{address}:{port}/", "--rate", f"{config.rate_per_s:g}", "--deadline",
                f"{config.deadline_s:g}", "--events", actors.events_path(CLIENT), "--requests",
                actors.events_path(REQUESTS)))
            actors.wait_event([CLIENT], "started", time.time() + START_TIMEOUT_S, "client")
            idle_start = time.time() + WARMUP_S
            progress.start(3, "phases", unit="phase")
            progress(f"phase {IDLE}: {config.idle_s:g} s of requests on the idle link")
            time.sleep(WARMUP_S)
            with CpuSampler() as sampler:
                time.sleep(config.idle_s)
            windows = {IDLE: (idle_start, idle_start + config.idle_s)}
            cpu, seconds = {IDLE: sampler.usage()}, {}
            progress.advance()
            for phase, share in ((FULL, 1.0), (SHARED, config.share)):
                progress(f"phase {phase}: multicasting {format_bytes(facts.total_bytes)} {STRATEGY} "
                         f"{' -> '.join((STORE, *WORKERS))} at share {share:g}")
                folder = Path(workdir) / f"share-{share:g}"
                with _agents_link(config.link_mbit, share):
                    result = run_once(cluster, folder, facts, STRATEGY, len(WORKERS), multicast, AGENT_START_DELAY_S)
                agents = Processes(folder, ShareBenchError)
                windows[phase] = multicast_window({h: agents.events(h) for h in (STORE, *WORKERS)})
                seconds[phase], cpu[phase] = result.seconds, result.cpu
                progress.advance()
                progress(f"phase {phase}: multicast {result.seconds:.2f} s "
                         f"({result.seconds / floor_seconds(facts.total_bytes, config.link_mbit, share):.2f}x "
                         f"S/(share x B)); {result.cpu.summary()}")
                actors.check_alive(["server", CLIENT])
                time.sleep(PAUSE_S)
        finally:
            actors.stop()
        records = request_records(actors.events(REQUESTS))
    results = [summarize_phase(IDLE, None, records, windows[IDLE], config.deadline_s, cpu[IDLE])]
    results += [summarize_phase(phase, share, records, windows[phase], config.deadline_s, cpu[phase],
                                seconds[phase], floor_seconds(facts.total_bytes, config.link_mbit, share))
                for phase, share in ((FULL, 1.0), (SHARED, config.share))]
    return ShareReport(meta=meta, results=tuple(results))


# -- the actors (``python -m benchmarks.share serve|load``) -----------------------------------------------


async def serve(host: str, port: int, events: EventLog) -> None:
    """Answer every POST with :data:`ANSWER_BYTES` bytes until killed."""
    from aiohttp import web

    answer = b"x" * ANSWER_BYTES

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/", complete)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    events.emit("listening", address=f"{host}:{port}")
    await asyncio.Event().wait()


async def load(url: str, rate_per_s: float, deadline_s: float, events: EventLog, requests: TextIO) -> None:
    """POST to ``url`` at ``rate_per_s``, open loop (each on schedule, whatever the others do), until killed;
    each request's scheduled time and latency from it (None: failed or past ``deadline_s``) go to ``requests``,
    a line each: not to ``events``, whose rate limit per kind would drop them above 200/s, the slow ones first
    (they end together after a stall). A request that starts late (the client starved of CPU) counts its wait,
    as the surge and tenants benchmarks count from each request's scheduled arrival."""
    import aiohttp

    def record(sent: float, **fields) -> None:
        requests.write(json.dumps({"t": time.time(), "event": "request", "sent": sent, **fields}) + "\n")

    async def one(session: aiohttp.ClientSession, due: float, due_wall: float) -> None:
        """The request due at ``due`` (time.monotonic(); ``due_wall`` the same in time.time())."""
        left = max(due + deadline_s - time.monotonic(), 0.001)  # its deadline counts from the schedule too
        try:
            async with session.post(url, data=REQUEST_BODY, timeout=aiohttp.ClientTimeout(total=left)) as resp:
                await resp.read()
                resp.raise_for_status()
            record(due_wall, seconds=time.monotonic() - due)
        except (TimeoutError, aiohttp.ClientError) as exc:
            record(due_wall, seconds=None, error=type(exc).__name__)

    async with aiohttp.ClientSession() as session:
        events.emit("started", url=url, rate_per_s=rate_per_s)
        tasks: set[asyncio.Task] = set()  # the loop holds tasks weakly: keep each until it is done
        origin, origin_wall, sent = time.monotonic(), time.time(), 0
        while True:
            due = origin + sent / rate_per_s
            await asyncio.sleep(max(due - time.monotonic(), 0.0))
            task = asyncio.create_task(one(session, due, origin_wall + sent / rate_per_s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the share benchmark's actors (run by `pipecast bench share`)")
    roles = parser.add_subparsers(dest="role", required=True)
    server = roles.add_parser("serve", help="the serving stand-in")
    server.add_argument("--host", required=True)
    server.add_argument("--port", type=int, required=True)
    client = roles.add_parser("load", help="the client")
    client.add_argument("--url", required=True)
    client.add_argument("--rate", type=float, required=True)
    client.add_argument("--deadline", type=float, required=True)
    client.add_argument("--requests", type=Path, required=True, help="a JSON line per request, none dropped")
    for role in (server, client):
        role.add_argument("--events", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    events = EventLog(args.events, args.role)
    if args.role == "serve":
        asyncio.run(serve(args.host, args.port, events))
    else:
        with args.requests.open("a", buffering=1) as requests:  # line-buffered: each record on disk as it ends
            asyncio.run(load(args.url, args.rate, args.deadline, events, requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
