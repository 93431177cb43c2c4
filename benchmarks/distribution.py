"""``pipecast bench distribution``: N workers receive a block package in about the time one does.

For each worker count N, one emulated cluster (a store host plus N workers, DESIGN 5) runs every strategy
``repeat`` times, the strategies interleaved within each repeat so that a slow phase of this shared
machine hits them alike. One run: a seed agent on the store serves the package; each worker runs an
agent with the strategy's static plan; the workers are started with ``--start-at`` a moment ahead, so
they all listen first and then fetch together; a worker's time runs from that instant to its last block
verified (read from its events file); every agent exits when complete.

Each result stands beside the floor S/min(B, B_store), the strategy's theory (DESIGN 4), the fluid model's
prediction for the very plan that ran (:mod:`control_plane.planner.simulate`) and unicast from the store, the
baseline, measured in the same cluster. The machine's CPU load is sampled during every transfer: all
hosts share this machine, so a busy CPU, not the links, may be what a run measured, and it is flagged.

Data-plane authentication is on by default, as in a cluster with credentials: every run gives all its
agents one fresh master token (``PIPECAST_AUTH_TOKEN``), so every connection starts with the HMAC hello;
``auth=False`` (``--no-auth``) runs them without, for comparison.

The module is pure logic (parsing, theory, summaries, report) above :func:`run`, which does the I/O.
"""

import json
import math
import os
import resource
import secrets
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import TimeoutExpired

import psutil

from benchmarks.certs import make_certs
from benchmarks.cluster import HTB_BURST_BYTES, EmulatedCluster, RequestedMode, store_egress_mbit
from benchmarks.cpu import CPU_BOUND_NOTE, CpuSampler, CpuUsage
from benchmarks.plots import Series, save_line_chart
from benchmarks.processes import RunProcesses, cli, credentials_env, free_port
from benchmarks.runinfo import parse_counts, versions
from benchmarks.simulate import planned_relay, relay_modelled
from control_plane.placement import plan_relay_piece, relay_piece
from control_plane.planner.plan import STRATEGIES
from control_plane.planner.schedules import GROUP_CHAIN_MAX, make_plan
from control_plane.planner.simulate import CALIBRATED_GOODPUT, CALIBRATED_START_DELAY_S, simulate
from packager.manifest import read_manifest
from pipecast.agent.plan_file import plan_file_data
from pipecast.agent.ratelimit import mbit_to_bytes_per_s
from pipecast.agent.transport.base import relay_piece_taken
from pipecast.agent.transport.registry import resolve_transport_name
from pipecast.core.errors import PipecastError
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.core.settings import Settings
from pipecast.core.units import format_bytes
from pipecast.v1.manifest_pb2 import Manifest

DEFAULT_WORKERS = (1, 2, 4, 8)
DEFAULT_STRATEGIES = ("unicast", "chain", "tree", "binomial")
BASELINE = "unicast"
# The bar for the best multicast strategy, in multiples of the floor.
TARGET_RATIO = 1.15
MODEL_TOLERANCE = 0.10  # issue #16: the calibrated simulator within 10% of the measured completion
STORE = "store"
FANOUT = 2  # make_plan's default: the tree is binary
# Planned per block in hypercube rounds, while DESIGN 4's figure for them assumes chunk-sized units.
BLOCK_ROUND_STRATEGIES = ("binomial",)
AGENT_PORT = 7070  # netns mode: every host has its own network stack
# The workers start together this long after they were spawned (python start-up, on a busy machine);
# a missed start is retried with twice the delay, which then stays for the rest of that cluster's runs.
START_DELAY_S = 2.0
START_DELAY_PER_WORKER_S = 0.25
START_ATTEMPTS = 3
SEED_START_TIMEOUT_S = 60.0  # the seed verifies the whole package before it listens
# A run may take this multiple of its strategy's theory (plus the slack) before it is declared stuck.
RUN_DEADLINE_FACTOR = 4.0
RUN_DEADLINE_SLACK_S = 30.0
EXIT_TIMEOUT_S = 15.0  # for agents to leave once every worker is complete

ProgressCallback = Callable[[str], None]


class DistributionBenchError(PipecastError):
    """The distribution benchmark was misconfigured (the caller's fault) or a run failed (an agent's)."""


class StartMissedError(DistributionBenchError):
    """Some workers were not listening at the common start (a busy machine); the run is retried."""


# -- configuration -------------------------------------------------------------------------------------


def parse_workers(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` to ``(1, 2, 4, 8)``: distinct positive worker counts, in the order given."""
    return parse_counts(text, "--workers", DistributionBenchError)


def parse_strategies(text: str) -> tuple[str, ...]:
    """``"unicast,chain"`` to ``("unicast", "chain")``: distinct planner strategies, in the order given."""
    names = tuple(part.strip() for part in text.split(","))
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown or len(set(names)) != len(names) or not all(names):
        raise DistributionBenchError(f"--strategy must list distinct strategies among {', '.join(STRATEGIES)}, "
                                     f"got {text!r}")
    return names


@dataclass(frozen=True)
class DistributionConfig:
    """What one ``pipecast bench distribution`` measures."""

    package: Path
    workers: tuple[int, ...] = DEFAULT_WORKERS
    link_mbit: float = 400.0
    store_mbit: float | None = None  # None: the link rate
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    transport: str = "tcp"
    repeat: int = 3
    mode: RequestedMode = "auto"
    auth: bool = True  # every agent given the same master token: data-plane hello on every connection
    tls: bool = False  # every agent given a certificate of the run's CA: mutual TLS on every connection
    # The agents' agent_relay_bytes (they inherit this process's settings): a TCP relay passes a chunk on from
    # its first piece this big, which sets a hop's cost in the theory and the model.
    relay_bytes: int = Settings.model_fields["agent_relay_bytes"].default
    link_burst: int = HTB_BURST_BYTES  # netns: what a link sends at once after an idle spell

    @property
    def relay_piece(self) -> int:
        """Bytes a relay passes on at a time (0: whole chunks, as UCX and ``agent_relay_bytes`` 0 do)."""
        return self.relay_bytes if self.transport == "tcp" else 0

    def __post_init__(self) -> None:
        if not self.workers or any(n < 1 for n in self.workers):
            raise DistributionBenchError(f"workers must be counts >= 1, got {self.workers}")
        if not self.strategies or any(s not in STRATEGIES for s in self.strategies):
            raise DistributionBenchError(f"strategies must be among {', '.join(STRATEGIES)}, got {self.strategies}")
        if self.link_mbit <= 0 or (self.store_mbit is not None and self.store_mbit <= 0):
            raise DistributionBenchError("link and store rates must be > 0 Mbit/s")
        if self.repeat < 1:
            raise DistributionBenchError(f"repeat must be >= 1, got {self.repeat}")

    @property
    def store_rate_mbit(self) -> float:
        """The store's egress rate, Mbit/s."""
        return store_egress_mbit(self.link_mbit, self.store_mbit)


@dataclass(frozen=True)
class PackageFacts:
    """What the benchmark needs to know of the package it distributes."""

    path: Path
    package_id: str
    model_name: str
    total_bytes: int  # S: the blocks' bytes
    files_bytes: int  # the small files (tokenizer, config), fetched before the blocks
    block_bytes: tuple[int, ...]
    chunk_bytes: int
    chunk_counts: tuple[int, ...]  # each block's chunks: a binomial plan's units are ranges of them

    @classmethod
    def of(cls, path: Path, manifest: Manifest) -> "PackageFacts":
        return cls(path=Path(path), package_id=manifest.package_id, model_name=manifest.model_name,
                   total_bytes=manifest.total_bytes, files_bytes=sum(f.bytes for f in manifest.files),
                   block_bytes=tuple(b.bytes for b in manifest.blocks),
                   chunk_bytes=max(b.chunk_bytes for b in manifest.blocks),
                   chunk_counts=tuple(len(b.chunk_digests) for b in manifest.blocks))


# -- bounds (pure) -------------------------------------------------------------------------------------


def worker_names(n: int) -> list[str]:
    """The worker hosts of an N-worker cluster: w1 .. wN."""
    return [f"w{i}" for i in range(1, n + 1)]


def floor_seconds(total_bytes: int, link_mbit: float, store_mbit: float) -> float:
    """S / min(B, B_store): no worker holds the package sooner (every byte leaves the store once)."""
    return total_bytes / mbit_to_bytes_per_s(min(link_mbit, store_mbit))


#: A completion under this share of its floor of at least GUARDED_FLOOR_S cannot have been a transfer over the links:
#: its workers were not cold (a shorter floor may be beaten by the links' bursts: 256 KiB each by default).
UNDER_FLOOR = 0.5
GUARDED_FLOOR_S = 1.0


def check_over_floor(seconds: float, floor: float, what: str) -> None:
    """Raise :class:`DistributionBenchError` if ``what`` took ``seconds``, well under its ``floor``."""
    if floor >= GUARDED_FLOOR_S and seconds < UNDER_FLOOR * floor:
        raise DistributionBenchError(f"{what} took {seconds:.2f} s, {seconds / floor:.2f}x its floor of {floor:.2f} s: "
                                     "no transfer over the links is that fast (were its workers' blocks there "
                                     "before the run?)")


def tree_levels(n: int, fanout: int) -> int:
    """Levels of receivers in a breadth-first ``fanout``-ary tree of ``n`` receivers under one root."""
    levels, reached, width = 0, 0, 1
    while reached < n:
        width *= fanout
        reached += width
        levels += 1
    return levels


def theory_seconds(strategy: str, n: int, total_bytes: int, chunk_bytes: int, link_mbit: float,
                   store_mbit: float, fanout: int = FANOUT, relay_bytes: int = 0) -> float:
    """The strategy's closed-form time for ``n`` receivers (DESIGN 4), with links of B and a store of B_store.

    c is what a relay passes on at a time: the chunk, or its pieces of ``relay_bytes`` where smaller (a long
    chain's smaller ones, :func:`~control_plane.placement.plan_relay_piece`).
    unicast: every byte N times from the store, N*S/B_store; chain with cut-through: S/B + (N-1)*c/B; the
    planner's tree forwards chunk by chunk, so its busiest uplink carries ``fanout`` copies: fanout*S/B
    plus one chunk per level; binomial pipeline: S/B + (log2(N+1) - 1)*c/B, the figure of a pipeline whose
    unit is the chunk (the planner's unit is the block: see the fluid model's figure beside it).
    ``rotated`` from one source is one group: a chain up to GROUP_CHAIN_MAX receivers, else the binomial
    pipeline.
    """
    size, link, store = float(total_bytes), mbit_to_bytes_per_s(link_mbit), mbit_to_bytes_per_s(store_mbit)
    first, hop = min(link, store), min(chunk_bytes, relay_bytes or chunk_bytes) / link
    if strategy == "unicast":
        return max(n * size / store, size / link)
    if strategy == "rotated":  # from the one source of this benchmark: a single group
        strategy = "chain" if n <= GROUP_CHAIN_MAX else "binomial"
    if strategy == "chain":  # in the smaller pieces a long chain's plan asks for
        piece = relay_piece_taken(relay_bytes, plan_relay_piece(n, total_bytes, relay_piece(chunk_bytes)))
        return size / first + (n - 1) * min(chunk_bytes, piece or chunk_bytes) / link
    if strategy == "tree":
        inner = min(fanout, n - fanout) * size / link if n > fanout else 0.0
        return max(min(n, fanout) * size / store, inner, size / link) + (tree_levels(n, fanout) - 1) * hop
    if strategy in BLOCK_ROUND_STRATEGIES:
        return size / first + (math.log2(n + 1) - 1) * hop
    raise DistributionBenchError(f"no theory for strategy {strategy!r}")


def model_seconds(strategy: str, n: int, facts: PackageFacts, link_mbit: float, relay_bytes: int) -> float:
    """The simulator's time for the plan this benchmark runs (links shared fairly, chunks relayed from their first
    piece of ``relay_bytes`` as the agents do, where :func:`~benchmarks.simulate.relay_modelled` says), with the
    start delay per hop and the payload's share of a link calibrated to this emulated cluster."""
    plan = make_plan(strategy, [STORE], worker_names(n), len(facts.block_bytes), chunk_counts=facts.chunk_counts)
    finished = simulate(plan, list(facts.block_bytes), mbit_to_bytes_per_s(link_mbit) * CALIBRATED_GOODPUT,
                        facts.chunk_bytes, start_delay_s=CALIBRATED_START_DELAY_S,
                        relay_bytes=relay_modelled(plan, relay_bytes, facts.total_bytes, facts.chunk_bytes))
    return max(finished.values())


def completion_seconds(events: Mapping[str, Sequence[dict]], start_at: float, package_id: str,
                       num_blocks: int) -> dict[str, float]:
    """Seconds from ``start_at`` to each worker's last ``block_verified`` event, from its events.

    Raises :class:`DistributionBenchError` naming a worker that did not verify every block.
    """
    out = {}
    for worker, records in events.items():
        verified = {e["block"]: e["t"] for e in records
                    if e.get("event") == "block_verified" and e.get("package") == package_id}
        missing = sorted(set(range(num_blocks)) - verified.keys())
        if missing:
            raise DistributionBenchError(f"worker {worker} did not verify block(s) {', '.join(map(str, missing))} "
                                         f"of package {package_id[:12]}")
        out[worker] = max(verified.values()) - start_at
    return out


# -- results (pure) ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    """One run of one strategy: each worker's time, and the CPU it cost."""

    seconds: float  # until every worker held the verified package
    per_worker_seconds: dict[str, float]
    cpu: CpuUsage  # the whole machine (this run and whatever else runs here), during the transfer
    agent_cpu_seconds: float  # user+system of this run's agents from the start until they exited
    agent_window_seconds: float  # from the start until the last agent exited
    killed: tuple[str, ...] = ()  # agents that did not exit by themselves once the run was complete

    @property
    def agent_cpu_percent(self) -> float:
        """The agents' own share of the machine's cores from the start until they exited (the rest of the
        machine's load was other work, or the kernel forwarding their packets)."""
        return 100.0 * self.agent_cpu_seconds / (self.agent_window_seconds * self.cpu.cores)

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "per_worker_seconds": self.per_worker_seconds,
                "cpu_mean_percent": self.cpu.mean_percent, "cpu_p95_percent": self.cpu.p95_percent,
                "cpu_saturated": self.cpu.saturated(), "agent_cpu_seconds": self.agent_cpu_seconds,
                "agent_cpu_percent": self.agent_cpu_percent, "agents_killed": list(self.killed)}


@dataclass(frozen=True)
class StrategyResult:
    """A strategy at one worker count: medians over its runs, beside the floor, theory and model."""

    strategy: str
    workers: int
    bytes: int
    link_mbit: float
    store_mbit: float
    floor_seconds: float
    theory_seconds: float
    model_seconds: float | None  # None where the model does not apply (a store rate unlike the links')
    runs: tuple[RunResult, ...]

    @property
    def seconds(self) -> float:
        """Median over the runs of the time until every worker held the verified package."""
        return statistics.median(r.seconds for r in self.runs)

    @property
    def ratio_to_floor(self) -> float:
        return self.seconds / self.floor_seconds

    @property
    def theory_ratio(self) -> float:
        return self.theory_seconds / self.floor_seconds

    @property
    def model_ratio(self) -> float | None:
        return None if self.model_seconds is None else self.model_seconds / self.floor_seconds

    @property
    def per_worker_seconds(self) -> dict[str, float]:
        """Each worker's median completion time."""
        return {w: statistics.median(r.per_worker_seconds[w] for r in self.runs)
                for w in self.runs[0].per_worker_seconds}

    @property
    def goodput_mbit(self) -> float:
        """The rate at which every worker got the package: S over the time until all held it, Mbit/s."""
        return self.bytes * 8 / self.seconds / 1e6

    @property
    def cpu_mean_percent(self) -> float:
        return statistics.median(r.cpu.mean_percent for r in self.runs)

    @property
    def agent_cpu_percent(self) -> float:
        return statistics.median(r.agent_cpu_percent for r in self.runs)

    @property
    def cpu_saturated_runs(self) -> int:
        return sum(r.cpu.saturated() for r in self.runs)

    @property
    def cpu_saturated(self) -> bool:
        """Whether most runs were CPU-bound, so the median measures the machine rather than the links."""
        return 2 * self.cpu_saturated_runs > len(self.runs)

    def to_json(self) -> dict:
        return {
            "strategy": self.strategy, "workers": self.workers, "bytes": self.bytes,
            "link_mbit": self.link_mbit, "store_mbit": self.store_mbit,
            "seconds": self.seconds, "floor_seconds": self.floor_seconds, "ratio_to_floor": self.ratio_to_floor,
            "theory_seconds": self.theory_seconds, "theory_ratio": self.theory_ratio,
            "model_seconds": self.model_seconds, "model_ratio": self.model_ratio,
            "per_worker_seconds": self.per_worker_seconds, "goodput_mbit": self.goodput_mbit,
            "cpu_mean_percent": self.cpu_mean_percent, "cpu_saturated": self.cpu_saturated,
            "cpu_saturated_runs": self.cpu_saturated_runs,
            "agent_cpu_percent": self.agent_cpu_percent, "repeats": [r.to_json() for r in self.runs],
        }


def summarize(strategy: str, n: int, facts: PackageFacts, config: DistributionConfig,
              runs: Sequence[RunResult]) -> StrategyResult:
    """The result of ``runs`` of ``strategy`` with ``n`` workers, beside its bounds."""
    store = config.store_rate_mbit
    floor = floor_seconds(facts.total_bytes, config.link_mbit, store)
    for run in runs:
        check_over_floor(run.seconds, floor, f"{strategy} to N = {n}")
    return StrategyResult(
        strategy=strategy, workers=n, bytes=facts.total_bytes, link_mbit=config.link_mbit, store_mbit=store,
        floor_seconds=floor,
        theory_seconds=theory_seconds(strategy, n, facts.total_bytes, facts.chunk_bytes, config.link_mbit, store,
                                      relay_bytes=config.relay_piece),
        model_seconds=(model_seconds(strategy, n, facts, config.link_mbit, config.relay_piece)
                       if store == config.link_mbit else None),
        runs=tuple(runs))


@dataclass(frozen=True)
class DistributionReport:
    """Everything one benchmark invocation measured."""

    meta: dict
    results: tuple[StrategyResult, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return {"meta": self.meta, "results": [r.to_json() for r in self.results]}


def verdict(results: Sequence[StrategyResult]) -> str:
    """One line on the results of one worker count: the best multicast strategy against the target and
    against unicast, and whether the CPU bounded any run."""
    n = results[0].workers
    baseline = next((r for r in results if r.strategy == BASELINE), None)
    multicast = [r for r in results if r.strategy != BASELINE]
    parts = []
    if n == 1:
        parts.append(f"one worker: every strategy is one transfer from the store, "
                     f"{min(r.ratio_to_floor for r in results):.2f}x the floor at best")
    elif multicast:
        best = min(multicast, key=lambda r: r.seconds)
        met = "met" if best.ratio_to_floor <= TARGET_RATIO else "NOT met"
        parts.append(f"best multicast {best.strategy} {best.ratio_to_floor:.2f}x the floor "
                     f"(target <= {TARGET_RATIO:.2f}x: {met})")
        if baseline is not None:
            parts.append(f"{baseline.seconds / best.seconds:.1f}x faster than unicast from the store "
                         f"({baseline.ratio_to_floor:.2f}x the floor, theory {baseline.theory_ratio:.2f}x)")
    elif baseline is not None:
        parts.append(f"unicast from the store {baseline.ratio_to_floor:.2f}x the floor "
                     f"(theory {baseline.theory_ratio:.2f}x)")
    modelled = [r for r in results if r.model_seconds is not None]
    if modelled:  # issue #16: the calibrated simulator within 10% of what was measured
        worst = max(modelled, key=lambda r: abs(r.seconds / r.model_seconds - 1))
        off = worst.seconds / worst.model_seconds - 1
        met = "met" if abs(off) <= MODEL_TOLERANCE else "NOT met"
        parts.append(f"model within {abs(off):.0%} of the measured ({worst.strategy} the furthest; target <= "
                     f"{MODEL_TOLERANCE:.0%}: {met})")
    saturated = [r.strategy for r in results if r.cpu_saturated]
    parts.append(f"{CPU_BOUND_NOTE} ({', '.join(saturated)})" if saturated else "CPU not saturated")
    return f"verdict N={n}: " + "; ".join(parts)


def format_report(report: DistributionReport) -> str:
    """The figures as a table per worker count, each followed by its verdict."""
    meta = report.meta
    lines = [f"pipecast bench distribution: {meta['model_name']} package {meta['package_id'][:12]} "
             f"({format_bytes(meta['package_bytes'])} in {meta['blocks']} blocks, "
             f"{format_bytes(meta['chunk_bytes'])} chunks), {meta['transport']} transport",
             f"links {meta['link_mbit']:g} Mbit/s, store {meta['store_mbit']:g} Mbit/s; emulated cluster in "
             f"{meta['mode']} mode ({meta['mode_reason']})",
             ("data-plane auth: on (HMAC hello)" if meta.get("auth", True) else "data-plane auth: off (--no-auth)")
             + ("; mutual TLS (--tls)" if meta.get("tls") else ""),
             f"medians of {meta['repeat']} run(s); x floor = time / (S/B); theory: DESIGN 4; "
             f"model: the simulator on the same plan, calibrated; CPU: the whole machine during the transfer, "
             f"agents: their own share of it"]
    if any(r.strategy in BLOCK_ROUND_STRATEGIES for r in report.results):
        lines.append(f"note: {', '.join(BLOCK_ROUND_STRATEGIES)} theory is the chunk-level pipeline's; the planner "
                     "schedules units (chunk ranges of blocks; rotated chains of up to 8: whole blocks) in rounds, "
                     "about (k+d)/k x the floor for k units and d = floor(log2(N+1)): see model x")
    header = (f"{'strategy':<10} {'time s':>8} {'x floor':>8} {'theory x':>9} {'model x':>8} {'goodput':>9} "
              f"{'workers s (first-last)':>23} {'CPU':>5} {'agents':>7}")
    for n in dict.fromkeys(r.workers for r in report.results):
        group = [r for r in report.results if r.workers == n]
        first = group[0]
        floor = "S/B" if meta["store_mbit"] >= meta["link_mbit"] else "S/min(B, the store's rate)"
        lines += ["", f"N={n} worker(s): floor {floor} = {first.floor_seconds:.2f} s", header]
        for r in group:
            per_worker = sorted(r.per_worker_seconds.values())
            model = "-" if r.model_ratio is None else f"{r.model_ratio:.2f}"
            flag = f" CPU-bound in {r.cpu_saturated_runs}/{len(r.runs)}" if r.cpu_saturated_runs else ""
            lines.append(f"{r.strategy:<10} {r.seconds:>8.2f} {r.ratio_to_floor:>8.2f} "
                         f"{r.theory_ratio:>9.2f} {model:>8} {r.goodput_mbit:>5.0f} Mb/s "
                         f"{f'{per_worker[0]:.2f}-{per_worker[-1]:.2f}':>23} {r.cpu_mean_percent:>4.0f}% "
                         f"{r.agent_cpu_percent:>6.0f}%{flag}")
        lines.append(verdict(group))
    return "\n".join(lines)


def save_plot(report: DistributionReport, path: Path) -> Path:
    """PNG of the time until every worker holds the package against N, per strategy, with the floor."""
    meta = report.meta
    counts = sorted({r.workers for r in report.results})
    series = []
    for strategy in dict.fromkeys(r.strategy for r in report.results):
        points = sorted((r.workers, r.seconds) for r in report.results if r.strategy == strategy)
        series.append(Series(strategy, [x for x, _ in points], [y for _, y in points]))
    floor = report.results[0].floor_seconds
    series.append(Series("floor S/B", counts, [floor] * len(counts), reference=True))
    return save_line_chart(
        path, series, x_ticks=counts, log2_x=len(counts) > 1,
        title=f"{meta['model_name']} ({format_bytes(meta['package_bytes'])}) to N workers",
        xlabel="workers (N)", ylabel="seconds until every worker holds the package",
        note=(f"links {meta['link_mbit']:g} Mbit/s, store {meta['store_mbit']:g} Mbit/s, {meta['mode']} mode, "
              f"{meta['transport']}; median of {meta['repeat']}; pipecast {meta['versions']['pipecast']}"))


# -- running (I/O) -------------------------------------------------------------------------------------


def _agent_argv(host: str, address: str, plan: Path, events: Path, transport: str) -> list[str]:
    return cli("agent", "--node-id", host, "--listen", address, "--plan", plan, "--events", events,
               "--exit-when-complete", "--transport", transport)


def _reaped_children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _Run(RunProcesses):
    """The agents of one run: spawned into the cluster, watched through their events files and logs."""

    def __init__(self, cluster: EmulatedCluster, folder: Path, transport: str, auth_token: str,
                 tls: bool) -> None:
        super().__init__(cluster, folder, DistributionBenchError)
        self.transport = transport
        self.auth_token = auth_token
        self.tls_env: dict[str, str] = {}
        if tls:  # one certificate for every node: the CA's signature is what the data plane checks
            certs = make_certs(folder)
            self.tls_env = {"PIPECAST_TLS_CERT": str(certs["server.pem"]),
                            "PIPECAST_TLS_KEY": str(certs["server.key"]), "PIPECAST_TLS_CA": str(certs["ca.pem"])}

    def spawn_agent(self, host: str, address: str, plan: Path, *extra: str) -> None:
        # The same master token for every agent of the run: a static plan's agents derive the key from it.
        env = {**credentials_env(self.auth_token), **self.tls_env}
        if self.transport == "ucx":
            env["UCX_NET_DEVICES"] = self.cluster.interface(host)
        self.spawn(host, host, [*_agent_argv(host, address, plan, self.events_path(host), self.transport), *extra],
                   env)

    def wait_exits(self, timeout_s: float) -> tuple[str, ...]:
        """Wait for every agent to exit; stop (and return) those still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except TimeoutExpired:
                pass
        stuck = tuple(h for h, p in self.procs.items() if p.poll() is None)
        self.stop()
        return stuck

    def cpu_seconds(self) -> float:
        """User+system CPU time the running agents have used so far."""
        total = 0.0
        for proc in self.procs.values():
            try:
                times = psutil.Process(proc.pid).cpu_times()
            except psutil.NoSuchProcess:
                continue  # it died: waiting for its 'complete' reports that, with its log
            total += times.user + times.system
        return total


def run_once(cluster: EmulatedCluster, folder: Path, facts: PackageFacts, strategy: str, n: int,
             config: DistributionConfig, start_delay_s: float) -> RunResult:
    """One run of ``strategy`` to ``n`` workers in ``cluster`` (see the module docstring), the workers
    starting ``start_delay_s`` after they are spawned; raises :class:`StartMissedError` if some were not
    listening by then (its agents stopped)."""
    workers = worker_names(n)
    hosts = [STORE, *workers]
    ports = {h: AGENT_PORT if cluster.mode == "netns" else free_port(cluster.address(h)) for h in hosts}
    nodes = {h: f"{cluster.address(h)}:{ports[h]}" for h in hosts}
    plan = make_plan(strategy, [STORE], workers, len(facts.block_bytes), chunk_counts=facts.chunk_counts)
    run = _Run(cluster, folder, config.transport, secrets.token_hex(16) if config.auth else "", config.tls)
    plan_path = folder / "plan.json"
    # As a control plane would ask (a long chain's smaller relay pieces): the agents follow a static plan here.
    relay = planned_relay(plan, facts.total_bytes, facts.chunk_bytes)
    plan_path.write_text(json.dumps(plan_file_data(plan, facts.package_id, nodes, relay)))

    run.spawn_agent(STORE, nodes[STORE], plan_path, "--seed", str(facts.path))
    run.wait_event([STORE], "listening", time.time() + SEED_START_TIMEOUT_S, "seed agent")
    start_at = time.time() + start_delay_s
    for worker in workers:
        run.spawn_agent(worker, nodes[worker], plan_path, "--start-at", f"{start_at:.6f}")
    try:
        run.wait_event(workers, "listening", start_at, f"synchronised start {start_delay_s:.1f} s after spawning "
                       "the workers (the machine may be too busy)", late=StartMissedError)
    except StartMissedError:
        run.stop()
        raise
    time.sleep(max(start_at - time.time(), 0.0))
    # The agents' CPU from now until they exit: all of it once reaped, less what they had used by now.
    cpu_before = _reaped_children_cpu_seconds() + run.cpu_seconds()
    theory = theory_seconds(strategy, n, facts.total_bytes, facts.chunk_bytes, config.link_mbit,
                            config.store_rate_mbit, relay_bytes=config.relay_piece)
    with CpuSampler() as cpu:
        run.wait_event(workers, "complete", start_at + RUN_DEADLINE_FACTOR * theory + RUN_DEADLINE_SLACK_S,
                       f"{strategy} to {n} worker(s)")
    killed = run.wait_exits(EXIT_TIMEOUT_S)
    window = time.time() - start_at
    per_worker = completion_seconds({w: run.events(w) for w in workers}, start_at, facts.package_id,
                                    len(facts.block_bytes))
    return RunResult(seconds=max(per_worker.values()), per_worker_seconds=per_worker, cpu=cpu.usage(),
                     agent_cpu_seconds=_reaped_children_cpu_seconds() - cpu_before, agent_window_seconds=window,
                     killed=killed)


def _run_started_in_time(cluster: EmulatedCluster, folder: Path, facts: PackageFacts, strategy: str, n: int,
                         config: DistributionConfig, delay: float, progress: ProgressCallback
                         ) -> tuple[RunResult, float]:
    """:func:`run_once`, again with twice the start delay after a missed start; returns the delay used."""
    attempt, where = 1, folder
    while True:
        try:
            return run_once(cluster, where, facts, strategy, n, config, delay), delay
        except StartMissedError as exc:
            if attempt == START_ATTEMPTS:
                raise
            attempt, delay = attempt + 1, delay * 2
            where = folder.with_name(f"{folder.name}-start{attempt}")
            progress(f"{str(exc).splitlines()[0]}; retrying with a {delay:.1f} s start delay")


def _meta(config: DistributionConfig, facts: PackageFacts, cluster: EmulatedCluster) -> dict:
    return {
        "benchmark": "distribution", "versions": versions("blake3"), "cpu_cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],  # others' work on this shared machine adds to "CPU"
        "mode": cluster.mode, "mode_reason": cluster.mode_reason, "clusters": [],
        "transport": config.transport, "auth": config.auth, "tls": config.tls, "link_mbit": config.link_mbit,
        "store_mbit": config.store_rate_mbit,
        "link_burst_bytes": config.link_burst if cluster.mode == "netns" else None,  # loopback: no tc
        "package_id": facts.package_id, "package_path": str(facts.path), "model_name": facts.model_name,
        "package_bytes": facts.total_bytes, "files_bytes": facts.files_bytes, "blocks": len(facts.block_bytes),
        "chunk_bytes": facts.chunk_bytes, "repeat": config.repeat, "strategies": list(config.strategies),
        "workers": list(config.workers), "target_ratio": TARGET_RATIO,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run(config: DistributionConfig, workdir: Path, progress: Progress = NO_PROGRESS) -> DistributionReport:
    """Measure every strategy at every worker count; agents' plans, events and logs go under ``workdir``."""
    try:
        resolve_transport_name(config.transport)
    except PipecastError as exc:
        raise DistributionBenchError(f"--transport {config.transport}: {exc}") from None
    facts = PackageFacts.of(config.package, read_manifest(Path(config.package)))
    meta: dict = {}
    results: list[StrategyResult] = []
    progress.start(len(config.workers) * config.repeat * len(config.strategies), "transfers", unit="run")
    for n in config.workers:
        runs: dict[str, list[RunResult]] = {s: [] for s in config.strategies}
        with EmulatedCluster([STORE, *worker_names(n)], config.link_mbit, store_mbit=config.store_mbit,
                             mode=config.mode, burst_bytes=config.link_burst) as cluster:
            meta = meta or _meta(config, facts, cluster)
            meta["clusters"].append(cluster.describe())
            progress(cluster.describe())
            delay = START_DELAY_S + START_DELAY_PER_WORKER_S * n
            for attempt in range(1, config.repeat + 1):
                for strategy in config.strategies:
                    folder = Path(workdir) / f"n{n}" / f"{strategy}-{attempt}"
                    result, delay = _run_started_in_time(cluster, folder, facts, strategy, n, config, delay,
                                                         progress)
                    runs[strategy].append(result)
                    progress.advance()
                    floor = floor_seconds(facts.total_bytes, config.link_mbit, config.store_rate_mbit)
                    killed = f"; killed {', '.join(result.killed)} (did not exit)" if result.killed else ""
                    progress(f"N={n} {strategy} run {attempt}/{config.repeat}: {result.seconds:.2f} s "
                             f"({result.seconds / floor:.2f}x the floor); {result.cpu.summary()}{killed}")
        results += [summarize(s, n, facts, config, runs[s]) for s in config.strategies]
    return DistributionReport(meta=meta, results=tuple(results))
