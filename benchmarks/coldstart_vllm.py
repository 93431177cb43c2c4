"""``pipecast bench coldstart --engine vllm``: time from a scale-up to the first token of N cold vLLM workers.

One emulated cluster (DESIGN 5): ``store`` runs an agent seeding the package; ``w1`` .. ``wN`` are the new
workers, each behind its own shaped link. As on a real node the worker's agent is a daemon that is already up;
the scale-up at t0 starts the serving process, ``vllm serve``, and hands the agents their plan (``--start-at
t0``). A client on each worker host polls vLLM's ``/health`` from t0, sends one greedy completion as soon as
it answers 200 and records its first streamed token. Three strategies, everything else identical:

- ``pipecast``: the agents follow the plan the control plane would choose for N receivers of one store
  (:func:`control_plane.placement.default_strategy`: a chain up to 64), each forwarding a chunk on as it
  lands; vLLM loads with ``--load-format pipecast`` from its agent, block by block as each is verified,
  while it starts. Floor: max(vLLM's start-up, S/B).
- ``store``: the baseline a fleet without pipecast runs: every worker fetches the whole package from the
  store over the same links (the store's uplink is shared: N x S/B), loaded the same way.
- ``local-disk``: vLLM's default loader on the original safetensors checkpoint on the worker's disk, no
  network: vLLM's own start-up, the floor of any loader.

The figure of a strategy at N is the last worker's first token (N workers are serving only then), median over
the runs. Every strategy must give the default loader's tokens. N vLLM processes start at once on this
machine's cores: where their start-up, not the transfer, bounds the time, the report says so (``cpu``).
"""

import json
import os
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import TimeoutExpired

from benchmarks.cluster import EmulatedCluster, RequestedMode
from benchmarks.coldstart import (AGENT_START_DELAY_S, ColdStartBenchError, start_seed, client_argv,
                                  make_prompts, transfer_floor_seconds, transfer_times, write_start_file)
from benchmarks.cpu import CpuSampler, CpuUsage
from benchmarks.processes import RunProcesses, cli, endpoint
from benchmarks.runinfo import parse_counts, versions
from control_plane.placement import default_strategy
from control_plane.planner.schedules import make_plan
from packager.manifest import read_manifest
from pipecast.agent.plan_file import plan_file_data
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.core.units import format_bytes

PIPECAST, STORE_UNICAST, LOCAL_DISK = "pipecast", "store", "local-disk"
STRATEGIES = (LOCAL_DISK, PIPECAST, STORE_UNICAST)
DEFAULT_WORKERS = (1, 4)
STORE = "store"
#: Targets of issue #15, with the transfer dominating: N = 1 within this multiple of max(start-up, S/B) ...
N1_TARGET = 1.15
#: ... and N workers at least this many times faster than all of them loading from the store.
STORE_SPEEDUP_TARGET = 3.0
#: What keeps each vLLM small on a shared machine: 1 GiB of KV cache, nothing fetched or reported; eager (no
#: graph capture on CPU), a context of at most MAX_MODEL_LEN tokens.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
VLLM_ARGS = ("--enforce-eager", "--disable-log-stats")
MAX_MODEL_LEN = 2048
# vLLM's start-up alone is ~15 s on an idle 2-core machine and several times that with 4 starting at once.
STARTUP_ALLOWANCE_S = 300.0
RUN_DEADLINE_FACTOR = 3.0  # x the strategy's transfer floor, plus the start-up allowance


@dataclass(frozen=True)
class VllmColdStartConfig:
    """What one ``pipecast bench coldstart --engine vllm`` measures."""

    package: Path
    checkpoint: Path  # the original safetensors checkpoint the package was packed from (local-disk strategy)
    vllm_venv: Path
    workers: tuple[int, ...] = DEFAULT_WORKERS
    link_mbit: float = 50.0
    prompt_tokens: int = 128
    max_tokens: int = 16
    repeat: int = 1
    threads: int = 1  # OpenMP threads of each vLLM worker
    mode: RequestedMode = "auto"

    def __post_init__(self) -> None:
        if not self.workers or any(n < 1 for n in self.workers):
            raise ColdStartBenchError(f"worker counts must be >= 1, got {self.workers}")
        if self.link_mbit <= 0:
            raise ColdStartBenchError(f"the link rate must be > 0 Mbit/s, got {self.link_mbit}")
        if min(self.prompt_tokens, self.max_tokens, self.repeat, self.threads) < 1:
            raise ColdStartBenchError("prompt_tokens, max_tokens, repeat and threads must be >= 1")
        vllm = self.vllm_venv / "bin" / "vllm"
        if not vllm.is_file():
            raise ColdStartBenchError(f"no vLLM at {vllm}: build vLLM's environment with `make test-vllm` or "
                                      f"`vllm_plugin/setup_venv.sh {self.vllm_venv}`")
        if not (self.checkpoint / "config.json").is_file():
            raise ColdStartBenchError(f"{self.checkpoint} is not a checkpoint folder (no config.json)")


def parse_workers(text: str) -> tuple[int, ...]:
    """``"1,4"`` to ``(1, 4)``."""
    return parse_counts(text, "--workers", ColdStartBenchError)


# -- results (pure) ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerResult:
    """One worker of one run, times in seconds after t0 (the scale-up)."""

    host: str
    ready_seconds: float                  # vLLM's /health first answered 200
    first_token_seconds: float
    transfer_seconds: float | None        # its agent's last block verified (None: local disk)
    tokens: tuple[int, ...]

    def to_json(self) -> dict:
        return {"host": self.host, "ready_seconds": self.ready_seconds,
                "first_token_seconds": self.first_token_seconds, "transfer_seconds": self.transfer_seconds,
                "tokens": list(self.tokens)}


@dataclass(frozen=True)
class RunResult:
    """N workers scaled up at once."""

    workers: tuple[WorkerResult, ...]
    cpu: CpuUsage

    @property
    def last_first_token_seconds(self) -> float:
        """When the last worker had answered: the N workers are all serving from then on."""
        return max(w.first_token_seconds for w in self.workers)

    @property
    def last_transfer_seconds(self) -> float | None:
        times = [w.transfer_seconds for w in self.workers if w.transfer_seconds is not None]
        return max(times) if times else None


@dataclass(frozen=True)
class StrategyResult:
    """A strategy at one N: medians over its runs."""

    strategy: str
    workers: int
    runs: tuple[RunResult, ...]

    @property
    def first_token_seconds(self) -> float:
        return statistics.median(r.last_first_token_seconds for r in self.runs)

    @property
    def ready_seconds(self) -> float:
        return statistics.median(max(w.ready_seconds for w in r.workers) for r in self.runs)

    @property
    def transfer_seconds(self) -> float | None:
        times = [r.last_transfer_seconds for r in self.runs if r.last_transfer_seconds is not None]
        return statistics.median(times) if times else None

    @property
    def cpu_mean_percent(self) -> float:
        return statistics.median(r.cpu.mean_percent for r in self.runs)

    @property
    def tokens(self) -> set[tuple[int, ...]]:
        """Every distinct token sequence any of its workers generated."""
        return {w.tokens for r in self.runs for w in r.workers}

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "workers": self.workers, "first_token_seconds": self.first_token_seconds,
                "ready_seconds": self.ready_seconds, "transfer_seconds": self.transfer_seconds,
                "cpu_mean_percent": self.cpu_mean_percent,
                "runs": [{"last_first_token_seconds": r.last_first_token_seconds, "cpu_mean_percent":
                          r.cpu.mean_percent, "workers": [w.to_json() for w in r.workers]} for r in self.runs]}


def transfer_floor(strategy: str, workers: int, package_bytes: int, link_mbit: float) -> float:
    """No schedule moves the package sooner: S/B for multicast, N x S/B through the store's one link."""
    one = transfer_floor_seconds(package_bytes, link_mbit)
    return {PIPECAST: one, STORE_UNICAST: workers * one, LOCAL_DISK: 0.0}[strategy]


@dataclass(frozen=True)
class VllmColdStartReport:
    """Everything one invocation measured."""

    meta: dict
    results: tuple[StrategyResult, ...] = field(default_factory=tuple)

    def result(self, strategy: str, workers: int) -> StrategyResult | None:
        return next((r for r in self.results if r.strategy == strategy and r.workers == workers), None)

    def floor_seconds(self, r: StrategyResult) -> float:
        """max(vLLM's start-up at this N, measured from local disk; the strategy's transfer floor)."""
        disk = self.result(LOCAL_DISK, r.workers)
        startup = disk.first_token_seconds if disk else 0.0
        return max(startup, transfer_floor(r.strategy, r.workers, self.meta["package_bytes"], self.meta["link_mbit"]))

    def to_json(self) -> dict:
        return {"meta": self.meta, "results": [{**r.to_json(), "floor_seconds": self.floor_seconds(r),
                                                "ratio_to_floor": r.first_token_seconds / self.floor_seconds(r)}
                                               for r in self.results]}


def verdicts(report: VllmColdStartReport) -> list[str]:
    """One line per N: pipecast against its floor (the N = 1 target), against the store (N > 1) and tokens."""
    lines = []
    reference = {t for r in report.results if r.strategy == LOCAL_DISK for t in r.tokens}
    sb = report.meta["transfer_floor_seconds"]
    for n in report.meta["workers"]:
        ours, store, disk = (report.result(s, n) for s in (PIPECAST, STORE_UNICAST, LOCAL_DISK))
        if not ours or not disk:
            continue
        floor = report.floor_seconds(ours)
        ratio = ours.first_token_seconds / floor
        line = (f"verdict N = {n}: pipecast {ours.first_token_seconds:.1f} s = {ratio:.2f}x max(vLLM start-up from "
                f"local disk {disk.first_token_seconds:.1f} s, S/B {sb:.1f} s)")
        if n == 1:
            line += f" (target <= {N1_TARGET:g}x: {'met' if ratio <= N1_TARGET else 'NOT met'})"
        if store:
            speedup = store.first_token_seconds / ours.first_token_seconds
            line += (f"; {speedup:.2f}x faster than every worker loading from the store "
                     f"({store.first_token_seconds:.1f} s)")
            if n > 1:
                line += (f" (target >= {STORE_SPEEDUP_TARGET:g}x: "
                         f"{'met' if speedup >= STORE_SPEEDUP_TARGET else 'NOT met'})")
        if disk.first_token_seconds > sb:
            line += (f"; vLLM's start-up ({disk.first_token_seconds:.1f} s for {n} at once on "
                     f"{report.meta['cpu_cores']} cores), not the transfer, bounds it")
        same = len(reference) == 1 and all(r.tokens <= reference for r in report.results if r.workers == n)
        lines.append(f"{line}; tokens identical to vLLM's default loader: {'yes' if same else 'NO'}")
    return lines


def format_report(report: VllmColdStartReport) -> str:
    """The figures as one table, then a verdict per N."""
    meta = report.meta
    lines = [f"pipecast bench coldstart --engine vllm: {meta['model_name']} package {meta['package_id'][:12]} "
             f"({format_bytes(meta['package_bytes'])} in {meta['blocks']} blocks) over {meta['link_mbit']:g} "
             f"Mbit/s: S/B = {meta['transfer_floor_seconds']:.1f} s; vLLM {meta['versions'].get('vllm', '?')}",
             meta["cluster"],
             f"medians of {meta['repeat']} run(s); times from the scale-up (t0: vllm serve started, the agents handed "
             f"their plan) to the last worker's first streamed token of a {meta['prompt_tokens']}-token prompt; "
             f"floor = max(vLLM start-up from local disk, transfer floor: S/B multicast, N x S/B from the store)",
             "",
             f"{'N':>3} {'strategy':<11} {'first token s':>14} {'floor s':>8} {'x floor':>8} {'ready s':>8} "
             f"{'transfer s':>11} {'CPU':>5}"]
    for r in report.results:
        floor = report.floor_seconds(r)
        transfer = f"{r.transfer_seconds:.1f}" if r.transfer_seconds is not None else "-"
        lines.append(f"{r.workers:>3} {r.strategy:<11} {r.first_token_seconds:>14.1f} {floor:>8.1f} "
                     f"{r.first_token_seconds / floor:>8.2f} {r.ready_seconds:>8.1f} {transfer:>11} "
                     f"{r.cpu_mean_percent:>4.0f}%")
    return "\n".join([*lines, "", *verdicts(report)])


# -- running (I/O) -------------------------------------------------------------------------------------


@dataclass
class _Bench:
    cluster: EmulatedCluster
    config: VllmColdStartConfig
    workdir: Path
    package_id: str
    package_bytes: int
    num_blocks: int
    store_address: str
    prompt_file: Path
    sockets: Path  # short paths for unix sockets (a socket path has ~100 characters at most)
    max_model_len: int
    runs: int = 0


def _hosts(n: int) -> list[str]:
    return [f"w{i}" for i in range(1, n + 1)]


def _socket(bench: _Bench, host: str) -> Path:
    return bench.sockets / f"{bench.runs}-{host}.sock"


def _vllm_command(bench: _Bench, strategy: str, host: str, folder: Path, socket: Path) -> tuple[list[str], int]:
    """The scale-up's serving process on ``host`` and its port: the default loader on the checkpoint, or the
    package's folder made from the agent's manifest (``pipecast-vllm-folder``) then ``vllm serve --load-format
    pipecast``."""
    c, bin_ = bench.config, bench.config.vllm_venv.resolve() / "bin"
    port = int(endpoint(bench.cluster, host, "serve").rsplit(":", 1)[1])  # its fixed port in netns mode
    model = c.checkpoint if strategy == LOCAL_DISK else folder / "model"
    serve = [str(bin_ / "vllm"), "serve", str(model), "--host", bench.cluster.address(host), "--port", str(port),
             "--served-model-name", bench.package_id, "--max-model-len", str(bench.max_model_len), *VLLM_ARGS]
    if strategy == LOCAL_DISK:
        return serve, port
    serve += ["--load-format", "pipecast", "--model-loader-extra-config", json.dumps({"agent_socket": str(socket)})]
    make_folder = [str(bin_ / "pipecast-vllm-folder"), bench.package_id, str(model), "--agent", str(socket)]
    return ["sh", "-c", f"{shlex.join(make_folder)} && exec {shlex.join(serve)}"], port


def run_once(bench: _Bench, strategy: str, n: int) -> RunResult:
    """N workers scaled up at once with ``strategy`` (see the module docstring)."""
    c = bench.config
    bench.runs += 1
    folder = bench.workdir / f"run-{bench.runs:03d}-{strategy}-n{n}"
    folder.mkdir(parents=True)
    hosts = _hosts(n)
    floor = transfer_floor(strategy, n, bench.package_bytes, c.link_mbit)
    deadline_s = RUN_DEADLINE_FACTOR * floor + STARTUP_ALLOWANCE_S
    run = RunProcesses(bench.cluster, folder, ColdStartBenchError)
    start_file = folder / "t0"
    start_at = time.time() + AGENT_START_DELAY_S
    try:
        if strategy != LOCAL_DISK:
            agents = {h: endpoint(bench.cluster, h, "agent") for h in hosts}
            plan = make_plan("unicast" if strategy == STORE_UNICAST else default_strategy(1, n), [STORE], hosts,
                             bench.num_blocks)
            (folder / "plan.json").write_text(json.dumps(plan_file_data(
                plan, bench.package_id, {STORE: bench.store_address, **agents})))
            for h in hosts:  # the node agents, up before the scale-up as on a real node
                run.spawn(f"agent-{h}", h, cli("agent", "--node-id", h, "--listen", agents[h], "--plan",
                                               folder / "plan.json", "--events", run.events_path(f"agent-{h}"),
                                               "--local-socket", _socket(bench, h), "--start-at",
                                               f"{start_at:.6f}"))
            run.wait_event([f"agent-{h}" for h in hosts], "listening", start_at, "the workers' agents starting")
        write_start_file(start_file, start_at)
        time.sleep(max(start_at - time.time(), 0.0))
        env = {**VLLM_ENV, "OMP_NUM_THREADS": str(c.threads)}
        for h in hosts:  # t0: the scale-up starts each worker's vLLM and its client
            command, port = _vllm_command(bench, strategy, h, folder / h, _socket(bench, h))
            run.spawn(f"vllm-{h}", h, command, env=env)
            url = f"http://{bench.cluster.address(h)}:{port}"
            run.spawn(f"client-{h}", h, client_argv(url, bench.package_id, folder / f"{h}.ready", start_file,
                                                    bench.prompt_file, c.max_tokens, deadline_s,
                                                    folder / f"{h}.client.json", ready_timeout_s=deadline_s))
        with CpuSampler() as cpu:
            for h in hosts:
                try:
                    run.procs[f"client-{h}"].wait(max(start_at + deadline_s - time.time(), 1.0))
                except TimeoutExpired:
                    raise ColdStartBenchError(f"{strategy}, N = {n}: {h} had no first token within {deadline_s:.0f} "
                                              f"s; its vLLM's log:\n{run.log_tail(f'vllm-{h}')}") from None
        workers = tuple(_worker_result(bench, run, strategy, h, folder, start_at) for h in hosts)
    finally:
        run.stop()
    return RunResult(workers, cpu.usage())


def _worker_result(bench: _Bench, run: RunProcesses, strategy: str, host: str, folder: Path,
                   start_at: float) -> WorkerResult:
    path = folder / f"{host}.client.json"
    answer = json.loads(path.read_text()) if path.exists() else {"error": run.log_tail(f"client-{host}")}
    if "error" in answer or answer.get("first_token_at") is None:
        raise ColdStartBenchError(f"{strategy}, {host}: {answer.get('error', 'no token')}\n--- last lines of its "
                                  f"vLLM's log:\n{run.log_tail(f'vllm-{host}')}")
    transfer = None
    if strategy != LOCAL_DISK:
        transfer = transfer_times(run.events(f"agent-{host}"), start_at, bench.package_id, bench.num_blocks)[1]
    return WorkerResult(host, answer["started_at"] - start_at, answer["first_token_at"] - start_at, transfer,
                        tuple(answer["tokens"]))


def run(config: VllmColdStartConfig, workdir: Path, progress: Progress = NO_PROGRESS) -> VllmColdStartReport:
    """Every strategy at every N; logs, events and answers go under ``workdir``."""
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest = read_manifest(config.package)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    prompt_file = workdir / "prompt.json"
    prompt_file.write_text(json.dumps(make_prompts(config.package, [config.prompt_tokens])[config.prompt_tokens]))
    runs: dict[tuple[str, int], list[RunResult]] = {(s, n): [] for n in config.workers for s in STRATEGIES}
    with EmulatedCluster([STORE, *_hosts(max(config.workers))], config.link_mbit, mode=config.mode) as cluster, \
            tempfile.TemporaryDirectory(prefix="pc-sock-") as sockets:
        progress(cluster.describe())
        seed, store_address = start_seed(cluster, config.package, workdir)
        try:
            bench = _Bench(cluster, config, workdir, manifest.package_id, manifest.total_bytes, len(manifest.blocks),
                           store_address, prompt_file, Path(sockets), _max_model_len(config.package))
            progress.start(config.repeat * len(config.workers) * len(STRATEGIES), "scale-ups", unit="run")
            for attempt in range(1, config.repeat + 1):
                for n in config.workers:
                    for strategy in STRATEGIES:
                        result = run_once(bench, strategy, n)
                        runs[strategy, n].append(result)
                        progress.advance()
                        transfer = result.last_transfer_seconds
                        progress(f"run {attempt}/{config.repeat} N = {n} {strategy}: last first token "
                                 f"{result.last_first_token_seconds:.1f} s"
                                 + (f", transfer {transfer:.1f} s" if transfer is not None else "")
                                 + f"; {result.cpu.summary()}")
        finally:
            seed.stop()
        meta = {
            "benchmark": "coldstart-vllm", "engine": "vllm", "cpu_cores": os.cpu_count(),
            "versions": {**versions("torch"), **_vllm_version(config.vllm_venv)}, "mode": cluster.mode,
            "mode_reason": cluster.mode_reason, "cluster": cluster.describe(), "link_mbit": config.link_mbit,
            "package_id": manifest.package_id, "package_path": str(config.package),
            "checkpoint": str(config.checkpoint), "model_name": manifest.model_name,
            "package_bytes": manifest.total_bytes, "blocks": len(manifest.blocks),
            "transfer_floor_seconds": transfer_floor_seconds(manifest.total_bytes, config.link_mbit),
            "workers": list(config.workers), "repeat": config.repeat, "prompt_tokens": config.prompt_tokens,
            "max_tokens": config.max_tokens, "threads": config.threads, "strategies": list(STRATEGIES),
            "started_at": started_at,
        }
    results = tuple(StrategyResult(s, n, tuple(runs[s, n])) for n in config.workers for s in STRATEGIES)
    return VllmColdStartReport(meta=meta, results=results)


def _max_model_len(package: Path) -> int:
    """:data:`MAX_MODEL_LEN`, or the model's own context where it is shorter."""
    context = json.loads((package / "config.json").read_text()).get("max_position_embeddings", MAX_MODEL_LEN)
    return min(MAX_MODEL_LEN, context)


def _vllm_version(venv: Path) -> dict[str, str]:
    """vLLM's version in its own environment (read from its dist-info: importing vLLM takes seconds)."""
    found = sorted(venv.glob("lib/python*/site-packages/vllm-*.dist-info"))
    return {"vllm": found[-1].name.removeprefix("vllm-").removesuffix(".dist-info")} if found else {}
