"""``pipecast bench surge``: the orchestration. One emulated cluster, every strategy, ``repeat`` times.

Hosts (DESIGN 5): ``store`` (a seed agent serving the package, egress at the store rate), ``cp`` (the
control plane), ``router`` (``pipecast router``), ``load`` (the driver, :mod:`benchmarks.surge.loadgen`)
and workers ``w1..wN``, each running a node agent and a serving worker (``pipecast serve``) that reads
blocks from its agent's local socket. Every link runs at the link rate.

One run of one strategy starts every process afresh: the control plane; the driver, which publishes the
package; the store agent; the workers' agents (warm ones seed the package from disk, i.e. they hold it in
memory; cold ones register with the control plane and hold nothing); the serving workers (cold ones wait
for the package once they have imported torch); the router. When all of that is up the driver starts
the surge and replays the schedule through the router. Who scales the cold workers up depends on the
strategy: the scaling daemon (``pipecast scaler``, started on the control plane's host, with the
deployment the driver declared: it notices the surge through the router's ``/stats``), the driver at the
surge's first instant (``*-oracle`` and ``warm-pool``: a baseline no deployment has), or nobody (``fixed``).
A cold worker costs from the scale-up decision that brought it the package (the daemon's latest
``scale_up`` at or before its agent's first ``assignment`` event, and after its previous drop; that
assignment where the daemon's trail has none; the oracle's decision for the oracle strategies), where its
load against S/B is timed from too, until its agent dropped the package (a release) or the cost horizon: the
run's end plus the daemon's keep-alive and scale-down cooldown (:func:`cost_tail_seconds`), for every
strategy alike; after the last answer the driver watches a daemon-scaled pool until the daemon has released
it to its minimum or that horizon, so the replicas a daemon keeps after a surge are billed as a fixed pool's
idle is. Its processes were started (and torch imported) before, so process start-up, a container's own cold
start, is outside every strategy's figures alike.

Repeats interleave the strategies (unicast, warm-pool, pipecast, unicast, ...) so a slow phase of this
shared machine hits them alike; the CPU is sampled during every run and a saturated run is flagged.
"""

import json
import math
import os
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.checkout import module_argv
from benchmarks.cluster import EmulatedCluster, RequestedMode, store_egress_mbit
from benchmarks.cpu import CpuSampler
from benchmarks.cpuquota import CpuQuotas, open_quotas
from benchmarks.distribution import floor_seconds, worker_names
from benchmarks.processes import POLL_S, RunProcesses, cli, credentials_env, credentials_line, endpoint
from benchmarks.runinfo import versions
from benchmarks.surge.loadgen import DriverSpec, WorkerEndpoint
from benchmarks.surge.report import (
    FIRST_N,
    RequestResult,
    RunRecord,
    StrategySummary,
    WorkerTimeline,
    run_metrics,
    summarize,
)
from benchmarks.surge.plots import save_timeline, save_ttft_cdf
from benchmarks.surge.report import to_json, write_requests_csv
from benchmarks.surge.strategies import Strategy, check_pool
from control_plane.deployments import Deployment, ScalingPolicy
from benchmarks.surge.trace import PEAK_WINDOW_S, ScheduledRequest, TokenCaps, prompt_token_ids, schedule_facts
from packager.manifest import read_manifest
from pipecast.agent.ratelimit import mbit_to_bytes_per_s
from pipecast.core.errors import PipecastError
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.core.units import format_bytes
from pipecast.engine.engine import Engine
from pipecast.engine.providers import PackageFolderProvider
from pipecast.engine.sampling import SamplingParams

STORE, CONTROL, ROUTER, LOAD, SCALER = "store", "cp", "router", "load", "scaler"
START_TIMEOUT_S = 600.0  # for everything to be up before the surge (8 workers import torch on 2 cores)
PROGRESS_EVERY_S = 5.0
# Every serving worker computes on this many threads: the workers share the machine's cores, and torch's
# default (one thread per core in each of N processes) would oversubscribe them.
WORKER_THREADS = 1
PREFILL_REPEATS = 3
# How often a router that routes to pipelines asks the control plane for them: pipelines change as blocks
# land, every few hundred ms at these link rates.
DISCOVERY_INTERVAL_S = 0.5

ProgressCallback = Callable[[str], None]
# The daemon's policy here: replica_concurrency is the workers' batch; replica_rps a CPU worker's order of
# magnitude (the daemon measures it once requests queue); keep-alive and cooldowns short enough for a run of
# minutes.
DEFAULT_POLICY = ScalingPolicy(max_replicas=8, slo_ttft_p99_s=2.0, keep_alive_s=20.0, scale_up_cooldown_s=5.0,
                               scale_down_cooldown_s=30.0, replica_rps=0.5, replica_concurrency=8)
# Past the keep-alive and cooldown, a few of the daemon's ticks and the agents' drop reports.
COST_TAIL_MARGIN_S = 5.0


def cost_tail_seconds(policy: ScalingPolicy) -> float:
    """How long past a run's end every strategy is billed: by then the daemon has released what it keeps
    after the last request (idle for the keep-alive, no release within the scale-down cooldown of a scale-up)."""
    return policy.keep_alive_s + policy.scale_down_cooldown_s + COST_TAIL_MARGIN_S


class SurgeBenchError(PipecastError):
    """The surge benchmark was misconfigured (the caller's fault) or a run failed (the process named)."""


@dataclass(frozen=True)
class SurgeConfig:
    """What one ``pipecast bench surge`` measures."""

    package: Path
    schedule: tuple[ScheduledRequest, ...]
    load_description: str  # where the schedule came from: the trace, window and scale, or the synthetic load
    caps: TokenCaps
    strategies: tuple[Strategy, ...]
    workers: int = 8
    min_workers: int = 0
    link_mbit: float = 400.0
    store_mbit: float | None = None  # None: the link rate
    repeat: int = 3
    pre_surge_s: float = 60.0
    first_n: int = FIRST_N
    mode: RequestedMode = "auto"
    worker_max_batch: int = 8
    worker_max_queue: int = 64
    router_max_queue: int = 1024
    queue_timeout_s: float = 600.0
    request_timeout_s: float = 900.0
    calibrate: bool = True
    #: The daemon's policy for the "daemon" strategies (its minimum raised to the warm workers, its maximum
    #: capped at the pool).
    policy: ScalingPolicy = DEFAULT_POLICY
    scaler_tick_s: float = 1.0
    #: CPUs each serving worker may use (a CFS quota, see benchmarks.cpuquota): each emulated node's own
    #: compute capacity, as a GPU node has; None: none, every worker may use every core.
    worker_cpus: float | None = None
    #: Host memory each cold worker's agent populates at start and receives blocks into (its
    #: ``--reserve``, :mod:`pipecast.agent.reserve`); None: none.
    agent_reserve_bytes: int | None = None
    #: Credentials as in a cluster that has them: a fresh master token per run for the control plane, the
    #: scaler, the router and the driver, a node token per registered agent, so every block transfer starts
    #: with the data-plane hello and every completion and stage call carries the serving key. False: none.
    auth: bool = True

    def __post_init__(self) -> None:
        if not self.schedule:
            raise SurgeBenchError("the schedule holds no request")
        if self.link_mbit <= 0 or (self.store_mbit is not None and self.store_mbit <= 0):
            raise SurgeBenchError("link and store rates must be > 0 Mbit/s")
        if self.repeat < 1 or self.first_n < 1 or self.pre_surge_s < 0:
            raise SurgeBenchError(f"repeat and first_n must be >= 1 and pre_surge_s >= 0, got {self.repeat}, "
                                  f"{self.first_n}, {self.pre_surge_s}")
        check_pool(self.strategies, self.workers, self.min_workers)

    @property
    def store_rate_mbit(self) -> float:
        """The store's egress rate, Mbit/s."""
        return store_egress_mbit(self.link_mbit, self.store_mbit)

    @property
    def store_links(self) -> int:
        """The store's egress in whole links, as an operator tells the control plane (``--store-links``)."""
        return max(1, int(self.store_rate_mbit // self.link_mbit))


@dataclass(frozen=True)
class PackageFacts:
    """What the benchmark needs to know of the served package."""

    path: Path
    package_id: str
    model_name: str
    total_bytes: int
    blocks: int
    vocab_size: int

    @classmethod
    def of(cls, path: Path) -> "PackageFacts":
        manifest = read_manifest(Path(path))
        try:
            vocab = int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SurgeBenchError(f"package {path}: no usable vocab_size in config.json ({exc})") from None
        return cls(Path(path), manifest.package_id, manifest.model_name, manifest.total_bytes, len(manifest.blocks),
                   vocab)


@dataclass(frozen=True)
class SurgeReport:
    """Everything one invocation measured: its conditions and each strategy's runs."""

    meta: dict
    summaries: tuple[StrategySummary, ...]


# -- processes -----------------------------------------------------------------------------------------


class _RunProcesses(RunProcesses):
    """The processes of one run: the services (control plane, agents, workers, router) must live until it
    ends; the driver (LOAD) exits when its load is done."""

    def __init__(self, cluster: EmulatedCluster, folder: Path) -> None:
        super().__init__(cluster, folder, SurgeBenchError)

    def check_alive(self, names: Sequence[str] = (), until_event: str | None = None) -> None:
        """Raise, with its log, for any service that exited; for the driver, if it is among ``names`` and
        exited before logging ``until_event``."""
        super().check_alive([n for n in self.procs if n != LOAD])
        if LOAD in names and self.procs[LOAD].poll() is not None and not self.has(LOAD, until_event or ""):
            raise SurgeBenchError(f"the driver stopped before '{until_event}': {self.driver_error()}")

    def driver_error(self) -> str:
        results = self.folder / "results.json"
        try:
            return json.loads(results.read_text())["error"]
        except (OSError, ValueError, KeyError):
            return f"exit code {self.procs[LOAD].poll()}; last lines of its log:\n{self.log_tail(LOAD)}"

    def stop(self, last: Sequence[str] = (CONTROL,)) -> None:
        """Stop every process of the run: the control plane last, so agents can deregister on the way out."""
        super().stop(last)


# -- one run -------------------------------------------------------------------------------------------


def billed_intervals(events: Sequence[dict], package_id: str, t0: float, decisions: Sequence[float] = (),
                     held_from: float | None = None) -> tuple[tuple[float, float | None], ...]:
    """When a worker held a replica: from each first ``assignment`` of the package (after the start or a
    drop) to the ``dropped`` that ended it (None: still held at the end), in seconds from ``t0``. Each starts
    at the scale-up decision that brought it instead, where ``decisions`` (scale-up times from ``t0``) has one
    after the previous drop and at or before the assignment: the latest such. A worker that held it from the
    start (a warm one: ``held_from``, its provisioning) holds a first replica from then to its first drop."""
    intervals: list[tuple[float, float | None]] = []
    start = held_from
    for event in events:
        if event.get("package") != package_id:
            continue
        if event["event"] == "assignment" and start is None:
            assigned, dropped = event["t"] - t0, intervals[-1][1] if intervals else -math.inf
            start = max((t for t in decisions if dropped < t <= assigned), default=assigned)
        elif event["event"] == "dropped" and start is not None:
            intervals.append((start, event["t"] - t0))
            start = None
    if start is not None:
        intervals.append((start, None))
    return tuple(intervals)


def _timelines(spec: DriverSpec, results: dict, events: dict[str, list[dict]], package: PackageFacts,
               pre_surge_s: float) -> tuple[WorkerTimeline, ...]:
    """Each worker's provisioning, block arrivals (from its agent's events) and health changes (from the
    driver's polls), in seconds from the surge's start. A warm worker was provisioned and ready
    ``pre_surge_s`` before the surge and received nothing; a cold one scaled by the daemon is billed for
    each interval it held a replica, from the scale-up decision (:func:`billed_intervals`), and so is a warm
    one, from its provisioning: the daemon releases warm replicas as it does cold ones."""
    t0 = results["t0"]
    decisions = [e["t"] for e in results.get("scale_events", []) if e["action"] == "scale_up"]
    out = []
    for worker in spec.workers:
        history = results["health"].get(worker.name, [])
        partial = next((t for t, status, _ in history if status == "partial"), None)
        if worker.warm:
            # Elsewhere nobody releases it: billed to the horizon.
            billed = billed_intervals(events[worker.name], package.package_id, t0, decisions, held_from=-pre_surge_s) \
                if spec.scaled_by == "daemon" else None
            out.append(WorkerTimeline(worker.name, True, -pre_surge_s, package.blocks, partial_s=partial,
                                      ready_s=-pre_surge_s, billed=billed))
            continue
        verified = sorted(e["t"] - t0 for e in events[worker.name]
                          if e["event"] == "block_verified" and e.get("package") == package.package_id)
        ready = next((t for t, status, _ in history if status == "ready"), None)
        if spec.scaled_by == "oracle":
            billed = ((0.0, None),)
        else:
            billed = billed_intervals(events[worker.name], package.package_id, t0, decisions)
        provisioned = billed[0][0] if billed else None
        out.append(WorkerTimeline(worker.name, False, provisioned, package.blocks, tuple(verified), partial, ready,
                                  billed=billed))
    return tuple(out)


@dataclass(frozen=True)
class _Layout:
    """Where each service of one run listens (host:port)."""

    control: str
    store: str
    router: str
    agents: dict[str, str]
    serving: dict[str, str]

    @classmethod
    def of(cls, cluster: EmulatedCluster, workers: Sequence[str]) -> "_Layout":
        def at(host: str, service: str) -> str:
            return endpoint(cluster, host, service)

        return cls(at(CONTROL, "control"), at(STORE, "agent"), at(ROUTER, "router"),
                   {w: at(w, "agent") for w in workers}, {w: at(w, "serve") for w in workers})


def _start_services(run: _RunProcesses, layout: _Layout, spec: DriverSpec, strategy: Strategy, config: SurgeConfig,
                    package: PackageFacts, sockets: Path, deadline: float, quotas: CpuQuotas, master: str) -> None:
    """Start the run's processes in order (see the module docstring), with the credentials of the cluster
    whose master token is ``master`` (empty: none); return once the driver is up."""
    operator = credentials_env(master)
    host, port = layout.control.rsplit(":", 1)
    run.spawn(CONTROL, CONTROL, cli("control-plane", "--host", host, "--port", port,
                                     "--db", run.folder / "control.sqlite3", "--store-links", config.store_links),
              env=operator)
    run.spawn(LOAD, LOAD, module_argv("benchmarks.surge.loadgen", run.folder / "spec.json"), env=operator)
    run.wait_event([LOAD], "published", deadline, "publishing the package")
    if strategy.scaled_by == "daemon":
        run.spawn(SCALER, CONTROL, cli("scaler", "run", "--control-plane", layout.control, "--tick",
                                        config.scaler_tick_s, "--plan-strategy", strategy.plan_strategy), env=operator)
    agent = ("agent", "--transport", "tcp")
    run.spawn(STORE, STORE, cli(*agent, "--node-id", STORE, "--listen", layout.store, "--seed", package.path,
                                 "--control-plane", layout.control, "--events", run.events_path(STORE)),
              env=credentials_env(master, STORE))
    reserving = [w.name for w in spec.workers if not w.warm] if config.agent_reserve_bytes else []
    for worker in spec.workers:
        w = worker.name
        role = ["--seed", str(package.path)] if worker.warm else []
        if w in spec.registered:
            role += ["--control-plane", layout.control]
        if w in reserving:
            role += ["--reserve", str(config.agent_reserve_bytes)]
        # An agent without a control plane derives the cluster's keys from the master token.
        run.spawn(w, w, cli(*agent, "--node-id", w, "--listen", layout.agents[w], "--local-socket",
                             sockets / f"{w}.sock", "--events", run.events_path(w),
                             "--serve-url", f"http://{layout.serving[w]}", *role),
                  env=credentials_env(master, w if w in spec.registered else None))
    run.wait_event([STORE, *(w.name for w in spec.workers)], "listening", deadline, "agents starting")
    # Agents on nodes start long before a surge: their memory reserves are full when it comes.
    run.wait_event(reserving, "reserve_filled", deadline, "agents filling their memory reserves")
    threads = str(WORKER_THREADS)
    for worker in spec.workers:
        w = worker.name
        host, port = layout.serving[w].rsplit(":", 1)
        full = [] if strategy.execute_while_load else ["--wait-full-load"]
        serve = run.spawn(f"{w}-serve", w, cli(
            "serve", package.package_id, "--agent-socket", sockets / f"{w}.sock", "--host", host, "--port", port,
            "--max-batch", config.worker_max_batch, "--max-queue", config.worker_max_queue,
            "--agent-timeout", START_TIMEOUT_S + config.request_timeout_s, "--drain-timeout", 0, *full,
            verbose=False), env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
        quotas.limit(serve.pid)
    host, port = layout.router.rsplit(":", 1)
    pipelines = ["--control-plane", layout.control, "--discovery-interval", DISCOVERY_INTERVAL_S] \
        if strategy.pipelines else []
    run.spawn(ROUTER, ROUTER, cli(
        "router", "--host", host, "--port", port, *(a for e in spec.workers for a in ("--worker", e.url)),
        "--max-queue", config.router_max_queue, "--queue-timeout", config.queue_timeout_s, "--drain-timeout", 0,
        *pipelines, verbose=False), env=operator)


def _deployment(strategy: Strategy, config: SurgeConfig, package: PackageFacts, layout: "_Layout",
                registered_warm: int) -> dict | None:
    """The deployment the driver declares for the daemon (None for the other strategies)."""
    if strategy.scaled_by != "daemon":
        return None
    policy = deployment_policy(config.policy, config.workers, registered_warm)
    return Deployment(package.package_id, policy, (f"http://{layout.router}",)).to_json()


def registered_workers(strategy: Strategy, workers: Sequence[str], warm: Collection[str]) -> tuple[str, ...]:
    """The ``workers`` whose agents register with the control plane: the cold ones, and the ``warm`` ones where
    the strategy makes them sources. A registered holder is a source of every plan, unicast's too
    (``pick_sources``), so a unicast baseline's warm workers stay unregistered: its cold ones load from the
    store alone, and its daemon sees only the cold ones (:func:`deployment_policy`)."""
    return tuple(w for w in workers if w not in warm or strategy.warm_are_sources)


def deployment_policy(policy: ScalingPolicy, workers: int, registered_warm: int) -> ScalingPolicy:
    """``policy`` for a pool of ``workers`` of which ``registered_warm`` were loaded before the surge and
    registered with the control plane: the daemon counts those as replicas and keeps them (its minimum;
    released while the pool idles before the surge, they would not be warm when it comes), up to the whole
    pool. Warm workers it cannot see (unregistered, :func:`registered_workers`) raise no minimum: it would
    count 0 replicas against it and add as many cold ones before the surge."""
    return replace(policy, min_replicas=max(policy.min_replicas, registered_warm),
                   max_replicas=min(policy.max_replicas, workers))


def run_once(cluster: EmulatedCluster, folder: Path, package: PackageFacts, strategy: Strategy, repeat: int,
             config: SurgeConfig, progress: ProgressCallback) -> RunRecord:
    """One run of ``strategy`` (see the module docstring); its logs and events stay under ``folder``."""
    workers = worker_names(config.workers)
    warm = set(workers[:strategy.warm_count(config.min_workers)])
    layout = _Layout.of(cluster, workers)
    run = _RunProcesses(cluster, folder)
    registered = registered_workers(strategy, workers, warm)
    spec = DriverSpec(
        router_url=f"http://{layout.router}", control_plane=layout.control, package=str(package.path),
        store_node=STORE, store_address=layout.store,
        workers=tuple(WorkerEndpoint(w, f"http://{layout.serving[w]}", w in warm) for w in workers),
        registered=registered,
        plan_strategy=strategy.plan_strategy, schedule=config.schedule, vocab_size=package.vocab_size,
        package_id=package.package_id, events=str(run.events_path(LOAD)), results=str(folder / "results.json"),
        startup_timeout_s=START_TIMEOUT_S, request_timeout_s=config.request_timeout_s,
        scaled_by=strategy.scaled_by,
        deployment=_deployment(strategy, config, package, layout, len(warm.intersection(registered))),
        tail_s=cost_tail_seconds(config.policy) if strategy.scaled_by == "daemon" else 0.0)
    (folder / "spec.json").write_text(json.dumps(spec.to_json()))
    label = f"[{strategy.name} {repeat}/{config.repeat}]"
    sockets = Path(tempfile.mkdtemp(prefix="pcs-"))  # short: a unix socket path has at most 107 bytes
    quotas = open_quotas(config.worker_cpus)
    try:
        deadline = time.time() + START_TIMEOUT_S
        master = secrets.token_hex(16) if config.auth else ""
        _start_services(run, layout, spec, strategy, config, package, sockets, deadline, quotas, master)
        run.wait_event([LOAD], "surge", deadline, f"{label} arming (every worker up, cold ones waiting)")
        progress(f"{label} surge: {len(config.schedule)} requests to {len(warm)} warm + {len(workers) - len(warm)} "
                 f"cold workers")
        end_by = (time.time() + config.schedule[-1].at_s + config.request_timeout_s + spec.ready_grace_s + spec.tail_s
                  + 60)
        with CpuSampler() as cpu:
            _follow_driver(run, end_by, label, progress)
        if run.procs[LOAD].returncode != 0:
            raise SurgeBenchError(f"{label} the driver failed: {run.driver_error()}")
    finally:
        run.stop()
        quotas.close()
        shutil.rmtree(sockets, ignore_errors=True)
    results = json.loads((folder / "results.json").read_text())
    usage = cpu.usage()
    return RunRecord(strategy=strategy.name, repeat=repeat,
                     requests=tuple(RequestResult(**r) for r in results["requests"]),
                     workers=_timelines(spec, results, {w: run.events(w) for w in workers}, package,
                                        config.pre_surge_s),
                     cpu_mean_percent=usage.mean_percent, cpu_p95_percent=usage.p95_percent,
                     cpu_saturated=usage.saturated(),
                     notes={"scale_up": results["scale_up"], "scaled_by": strategy.scaled_by,
                            "scale_events": results.get("scale_events", []),
                            "observed_until_s": results.get("observed_until_s"),
                            "policy": spec.deployment["policy"] if spec.deployment else {}},
                     cost_tail_s=cost_tail_seconds(config.policy),
                     floor_s=floor_seconds(package.total_bytes, config.link_mbit, config.store_rate_mbit))


def _follow_driver(run: _RunProcesses, end_by: float, label: str, progress: ProgressCallback) -> None:
    """Wait for the driver to finish, printing its progress; raise if it or a service stops early."""
    shown = 0.0
    while run.procs[LOAD].poll() is None:
        run.check_alive()
        if time.time() > end_by:
            raise SurgeBenchError(f"{label} the driver did not finish in time; last lines of its log:\n"
                                  f"{run.log_tail(LOAD)}")
        if time.monotonic() - shown >= PROGRESS_EVERY_S:
            updates = [e for e in run.events(LOAD) if e["event"] == "progress"]
            if updates:
                p = updates[-1]
                progress(f"{label} {p['elapsed']:.0f} s: {p['ok']}/{p['requests']} answered, {p['rejected']} "
                         f"rejected, {p['failed']} failed, {p['in_flight']} in flight; workers serving "
                         f"{p['serving']}/{p['workers']}, ready {p['ready']}/{p['workers']}")
            shown = time.monotonic()
        time.sleep(POLL_S * 4)


# -- calibration and meta ------------------------------------------------------------------------------


def measure_request_seconds(package: Path, prompt_tokens: int, output_tokens: int,
                            threads: int = WORKER_THREADS) -> tuple[float, float]:
    """Median times of a prefill of ``prompt_tokens`` tokens (and its first token) and of a whole request
    (the prefill and ``output_tokens`` tokens in all) on ``threads`` threads, the model loaded from the
    package folder: what one request costs a worker here."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Engine(PackageFolderProvider(package, verify=False)).start() as engine:
            engine.wait_loaded(timeout=600)
            times: dict[int, list[float]] = {1: [], output_tokens: []}
            for i in range(PREFILL_REPEATS + 1):  # the first is a warm-up
                prompt = prompt_token_ids(ScheduledRequest(i, 0.0, prompt_tokens, 1, prompt_tokens, 1),
                                          engine.model.vocab_size, seed=99)
                for tokens, measured in times.items():
                    start = time.perf_counter()
                    engine.generate(prompt, SamplingParams(max_tokens=tokens), timeout=600)
                    measured.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return statistics.median(times[1][1:]), statistics.median(times[output_tokens][1:])


def _meta(config: SurgeConfig, package: PackageFacts, cluster: EmulatedCluster, prefill_s: float | None,
          request_s: float | None, quota: str) -> dict:
    facts = schedule_facts(config.schedule)
    floor = floor_seconds(package.total_bytes, config.link_mbit, config.store_rate_mbit)
    one_copy = package.total_bytes / mbit_to_bytes_per_s(config.link_mbit)
    worker_prefill_s = prefill_s / min(config.worker_cpus or 1.0, 1.0) if prefill_s else None
    ratio = one_copy / worker_prefill_s if worker_prefill_s else None
    headline = [
        f"pipecast bench surge: {package.model_name} package {package.package_id[:12]} "
        f"({format_bytes(package.total_bytes)}, {package.blocks} blocks), {config.workers} workers "
        f"(minimum pool {config.min_workers}), medians of {config.repeat} run(s)",
        f"links {config.link_mbit:g} Mbit/s, store egress {config.store_rate_mbit:g} Mbit/s; {cluster.describe()}",
        f"load: {config.load_description}; {facts.requests} requests over {facts.duration_s:.1f} s "
        f"(mean {facts.mean_rate_per_s:.2f}/s, at most {facts.peak_rate_per_s * PEAK_WINDOW_S:.0f} in "
        f"{PEAK_WINDOW_S:g} s); prompts <= "
        f"{config.caps.prompt_tokens} tokens, outputs <= {config.caps.output_tokens} tokens",
        f"floor S/B = {floor:.2f} s (no cold worker answers sooner); unicast from the store to every cold worker "
        f"takes about N_cold*S/B_store",
        credentials_line(config.auth),
        f"compute: {quota}; memory: "
        + (f"each cold worker's agent populates a {format_bytes(config.agent_reserve_bytes)} reserve at start "
           "(--agent-reserve)" if config.agent_reserve_bytes else "no agent memory reserve (--agent-reserve 0)"),
        ("transfer/compute: one model copy over a link takes "
         f"{one_copy:.2f} s, a {config.caps.prompt_tokens}-token prefill {prefill_s * 1000:.0f} ms on "
         f"{WORKER_THREADS} thread ({worker_prefill_s * 1000:.0f} ms at a worker's CPU share): ratio {ratio:.0f} "
         "(a GPU cluster: seconds against tens of ms, ~20-200); a whole request of "
         f"{config.caps.output_tokens} tokens {request_s * 1000:.0f} ms; the daemon's replica_rps "
         f"{config.policy.replica_rps:g} (a prefill's) until it measures one")
        if ratio else "transfer/compute ratio not calibrated (--no-calibrate)",
        f"cost: worker-seconds while holding a replica, from provisioning (warm: {config.pre_surge_s:g} s before the "
        f"surge) to the cost horizon, every strategy alike: each run's end (last answer, or last ready) + "
        f"{cost_tail_seconds(config.policy):g} s (keep-alive {config.policy.keep_alive_s:g} + scale-down cooldown "
        f"{config.policy.scale_down_cooldown_s:g} + {COST_TAIL_MARGIN_S:g}; the daemon's pool watched until back at "
        f"its minimum or then); TTFT from each request's scheduled arrival, percentiles over the answered requests; "
        f"first{config.first_n} = the first {config.first_n} requests",
    ]
    return {
        "benchmark": "surge", "versions": versions("torch", "transformers", "aiohttp", "grpcio"),
        "cpu_cores": os.cpu_count(), "mode": cluster.mode,
        "mode_reason": cluster.mode_reason, "cluster": cluster.describe(), "link_mbit": config.link_mbit,
        "store_mbit": config.store_rate_mbit, "package_id": package.package_id, "package_path": str(package.path),
        "model_name": package.model_name, "package_bytes": package.total_bytes, "blocks": package.blocks,
        "workers": config.workers, "min_workers": config.min_workers,
        "strategies": {s.name: s.description for s in config.strategies}, "load": config.load_description,
        "requests": facts.requests, "schedule_seconds": facts.duration_s, "mean_rate_per_s": facts.mean_rate_per_s,
        "peak_rate_per_s": facts.peak_rate_per_s, "prompt_cap_tokens": config.caps.prompt_tokens,
        "output_cap_tokens": config.caps.output_tokens, "repeat": config.repeat,
        "pre_surge_seconds": config.pre_surge_s, "cost_tail_seconds": cost_tail_seconds(config.policy),
        "first_n": config.first_n, "floor_seconds": floor, "policy": asdict(config.policy),
        "model_copy_seconds": one_copy,
        "prefill_seconds": prefill_s, "request_seconds": request_s, "worker_prefill_seconds": worker_prefill_s,
        "transfer_to_prefill_ratio": ratio,
        "worker_threads": WORKER_THREADS, "worker_cpus": config.worker_cpus, "worker_cpu_quota": quota,
        "agent_reserve_bytes": config.agent_reserve_bytes or 0, "auth": config.auth,
        "worker_max_batch": config.worker_max_batch, "worker_max_queue": config.worker_max_queue,
        "router_max_queue": config.router_max_queue, "queue_timeout_seconds": config.queue_timeout_s,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "headline": headline,
    }


def run(config: SurgeConfig, workdir: Path, progress: Progress = NO_PROGRESS) -> SurgeReport:
    """Measure every strategy ``repeat`` times in one emulated cluster; logs and events go under ``workdir``."""
    package = PackageFacts.of(config.package)
    prefill_s = request_s = None
    if config.calibrate:
        progress(f"calibrating: a {config.caps.prompt_tokens}-token prefill and a request of "
                 f"{config.caps.output_tokens} tokens on {WORKER_THREADS} thread")
        prefill_s, request_s = measure_request_seconds(package.path, config.caps.prompt_tokens,
                                                       config.caps.output_tokens)
        # The daemon's per-replica throughput until it measures one: a request per prefill at the worker's
        # CPU share. Not per whole request: a worker batches the decode steps of its requests, and sized on
        # the whole request's time the daemon added 5-7 replicas a surge for the same p99 (docs/benchmarks.md).
        cpus = min(config.worker_cpus or 1.0, 1.0)
        config = replace(config, policy=replace(config.policy, replica_rps=round(cpus / prefill_s, 3)))
    quota = open_quotas(config.worker_cpus).description
    runs: dict[str, list[RunRecord]] = {s.name: [] for s in config.strategies}
    hosts = [STORE, CONTROL, ROUTER, LOAD, *worker_names(config.workers)]
    with EmulatedCluster(hosts, config.link_mbit, store_mbit=config.store_mbit, store_host=STORE,
                         mode=config.mode) as cluster:
        meta = _meta(config, package, cluster, prefill_s, request_s, quota)
        for line in meta["headline"]:
            progress(line)
        meta["retried_runs"] = []
        progress.start(config.repeat * len(config.strategies), "surges", unit="run")
        for attempt in range(1, config.repeat + 1):
            for strategy in config.strategies:
                folder = Path(workdir) / f"repeat{attempt}" / strategy.name.replace(":", "-")
                try:
                    record = run_once(cluster, folder, package, strategy, attempt, config, progress)
                except SurgeBenchError as exc:
                    # This machine is shared: one run's process may die of something outside the benchmark.
                    # Retry once, say so in the output; a second failure ends the benchmark.
                    progress(f"[{strategy.name} {attempt}/{config.repeat}] FAILED, retrying once: {exc}")
                    meta["retried_runs"].append({"strategy": strategy.name, "repeat": attempt, "error": str(exc)})
                    record = run_once(cluster, folder.with_name(folder.name + "-retry"), package, strategy, attempt,
                                      config, progress)
                runs[strategy.name].append(record)
                progress.advance()
                done = run_metrics(record, config.first_n)
                p99 = done.first100_ttft_p99_seconds
                progress(f"[{strategy.name} {attempt}/{config.repeat}] done: first-{config.first_n} p99 TTFT "
                         f"{'-' if p99 is None else f'{p99:.2f} s'}, all ready "
                         f"{'-' if done.all_ready_seconds is None else f'{done.all_ready_seconds:.1f} s'}, "
                         f"{done.answered}/{done.requests} answered, {done.rejected} rejected, {done.failed} failed, "
                         f"CPU {done.cpu_mean_percent:.0f}%{' (saturated)' if done.cpu_saturated else ''}")
    summaries = tuple(summarize(s.name, s.description, s.warm_count(config.min_workers), runs[s.name], config.first_n)
                      for s in config.strategies)
    return SurgeReport(meta=meta, summaries=summaries)


def write_outputs(report: SurgeReport, *, json_path: Path | None = None, csv_path: Path | None = None,
                  plots_dir: Path | None = None) -> list[Path]:
    """Write the JSON figures, the CSV of every request and the PNGs (``ttft_cdf.png``, ``timeline.png``)
    where asked; return the paths written."""
    written = []
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(to_json(report.meta, report.summaries), indent=2, allow_nan=False))
        written.append(Path(json_path))
    if csv_path is not None:
        written.append(write_requests_csv(csv_path, report.summaries))
    if plots_dir is not None:
        meta = report.meta
        note = (f"{meta['model_name']}, {meta['workers']} workers, links {meta['link_mbit']:g} Mbit/s, store "
                f"{meta['store_mbit']:g} Mbit/s, {meta['mode']} mode; {meta['load']}; pipecast "
                f"{meta['versions']['pipecast']}")
        written.append(save_ttft_cdf(Path(plots_dir) / "ttft_cdf.png", report.summaries,
                                     floor_s=meta["floor_seconds"], note=note))
        written.append(save_timeline(Path(plots_dir) / "timeline.png", report.summaries, note=note))
    return written
