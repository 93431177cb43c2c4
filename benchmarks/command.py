"""``pipecast bench``: the benchmarks. Each prints its result beside its floor and its baseline.

Each command imports its benchmark only when it runs, so that ``pipecast bench --help`` starts fast.
"""

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import click
from click.core import ParameterSource

from benchmarks.mlflow_log import with_mlflow_logging
from packager.command import SIZE
from pipecast.core.clitypes import Number
from pipecast.core.progress import Progress
from pipecast.core.settings import Settings


class _BenchGroup(click.Group):
    """The bench group: every command added gets --mlflow-uri, to log its run to MLflow (benchmarks.mlflow_log)."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        super().add_command(with_mlflow_logging(cmd), name)


# Options several bench commands share.
DEMO_CACHE = click.option("--cache", type=click.Path(file_okay=False, path_type=Path), default=Path(".cache/pipecast"),
                          show_default=True, help="Where the demo package is cached.")
EMULATION = click.option("--mode", type=click.Choice(["auto", "netns", "loopback"]), default="auto",
                         show_default=True, help="Emulated cluster: network namespaces with tc, or loopback with "
                                                 "app-level rate limits.")
CREDENTIALS = click.option(
    "--no-auth", is_flag=True,
    help="Run without credentials (no data-plane hello, no serving key), to compare with the default: a master "
         "token per run and a node token for each agent that registers, as in a cluster that has them.")


def _output_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A file the run writes at its end (--json, --plot, --csv): checked now that it can be written, so that a
    path it cannot write fails before the run instead of losing the run's figures after it. Missing folders are
    made when the file is written (:func:`write_json`), so a run refused later leaves nothing behind."""
    if value is None:
        return None
    existing = next(path for path in (value, *value.absolute().parents) if path.exists())
    if existing != value and not existing.is_dir():
        raise click.BadParameter(f"cannot make its folder {value.parent}: {existing} is not a folder")
    if not os.access(existing, os.W_OK):
        raise click.BadParameter(f"{existing} is not writable")
    return value


def write_json(path: Path, figures: object) -> None:
    """Write a run's ``figures`` as JSON to ``path`` (an --json option's value), its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2))


def output_file(*names: str, help: str) -> Callable:
    """An option naming a file the run writes at its end (:func:`_output_file`)."""
    return click.option(*names, type=click.Path(dir_okay=False, path_type=Path), callback=_output_file, help=help)


JSON_OUT = output_file("--json", "json_path", help="Write the figures as JSON.")


@click.group("bench", cls=_BenchGroup)
def bench_group():
    """Benchmarks; each prints measured / floor and the baseline, measured in the same run."""


def _echo_err(line: str) -> None:
    click.echo(line, err=True)


def _run_and_report(run, config, workdir: Path | None, format_report, json_path: Path | None) -> object:
    """Run a benchmark in ``workdir`` (default: a temp dir), print its report and write its JSON if asked.

    Its progress lines go to stderr; on a terminal a bar over its runs stays below them."""
    with tempfile.TemporaryDirectory(prefix="pipecast-bench-") as tmp, Progress.on_stderr(_echo_err) as progress:
        report = run(config, Path(workdir or tmp), progress=progress)
    click.echo(format_report(report))
    if json_path:
        write_json(json_path, report.to_json())
    return report


def _reserve_size(ctx: click.Context, param: click.Parameter, value: str) -> int | str | None:
    """--agent-reserve: a size in bytes, "package" (sized once the package is known) or None for 0."""
    if value in ("package", "0"):
        return None if value == "0" else value
    from pipecast.core.units import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(f"{exc} (a size such as 512MiB, package or 0)") from None


def _cpus_option(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """--worker-cpus: 0 (no quota) or at least the smallest CPU quota the kernel takes."""
    from benchmarks.cpuquota import MIN_CORES, MIN_QUOTA_US, PERIOD_US

    if value is not None and 0 < value < MIN_CORES:
        raise click.BadParameter(f"{value:g} is below the smallest CPU quota the kernel takes, {MIN_CORES:g} CPU "
                                 f"({MIN_QUOTA_US} us per {PERIOD_US} us period); 0: no quota")
    return value


def _worker_cpus(value: float | None, workers: int, what: str) -> float | None:
    """The CPU quota per serving worker: --worker-cpus (0: None, no quota), by default this machine's cores
    over ``workers``, refused where that falls below the kernel's smallest quota (the workers named by
    ``what``, e.g. "--workers 300")."""
    from benchmarks.cpuquota import MIN_CORES

    if value is not None:
        return value or None
    cores = os.cpu_count() or 1
    if cores / workers < MIN_CORES:
        raise click.BadParameter(f"the default, {cores} cores / {what} = {cores / workers:g} CPU per worker, is "
                                 f"below the smallest CPU quota the kernel takes ({MIN_CORES:g} CPU): give "
                                 "--worker-cpus 0 (no quota) or fewer workers", param_hint="'--worker-cpus'")
    return cores / workers


def _demo(cache: Path) -> Path:
    """The demo model's package, packed on first use."""
    from benchmarks.demo_model import demo_package

    return demo_package(cache)


@bench_group.command("pack")
@click.option("--size", type=SIZE, default="2GB", show_default=True, help="Synthetic checkpoint size.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Scratch folder (default: a temp dir).")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True)
@JSON_OUT
def bench_pack(size, workdir, repeat, json_path):
    """Pack throughput vs cp, peak RSS, and block-open throughput vs safetensors."""
    from benchmarks import pack_bench

    with tempfile.TemporaryDirectory(prefix="pipecast-bench-") as tmp:
        result = pack_bench.run(Path(workdir or tmp), size, repeat, progress=lambda m: click.echo(m, err=True))
    click.echo(pack_bench.report(result))
    if json_path:
        write_json(json_path, pack_bench.to_json(result))


@bench_group.command("distribution")
@click.option("--workers", default="1,2,4,8", show_default=True, help="Worker counts N, comma-separated.")
@click.option("--link-mbit", type=Number(min=0, min_open=True), default=400.0, show_default=True,
              help="Every host's link rate per direction, Mbit/s.")
@click.option("--store-mbit", type=Number(min=0, min_open=True),
              help="The store's egress rate, Mbit/s (default: the link rate).")
@click.option("--package", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Block package to distribute (default: the demo model's, packed on first use).")
@click.option("--strategy", "strategies", default="unicast,chain,tree,binomial", show_default=True,
              help="Planner strategies to measure, comma-separated; unicast is the baseline.")
@click.option("--transport", type=click.Choice(["tcp", "ucx"]), default="tcp", show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs per strategy and N; the medians are reported.")
@EMULATION
@JSON_OUT
@output_file("--plot", "plot_path", help="Write a PNG of completion time vs N per strategy, with the floor.")
@DEMO_CACHE
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the agents' plans, events and logs here (default: a temp dir, removed).")
@click.option("--no-auth", is_flag=True,
              help="Run the agents without credentials (no data-plane hello), to compare with the default: every "
                   "agent given the same master token.")
@click.option("--tls", is_flag=True, help="Mutual TLS between the agents (TCP transport; needs openssl for the "
                                          "run's certificates).")
@click.option("--link-burst", type=SIZE, default="256KiB", show_default=True,
              help="netns: what a link sends at once after an idle spell (tc htb burst); one as large as a relay's "
                   "piece hides that piece's time per hop.")
def bench_distribution(workers, link_mbit, store_mbit, package, strategies, transport, repeat, mode, json_path,
                       plot_path, cache, workdir, no_auth, tls, link_burst):
    """N workers receive a block package in about the time one does: every strategy vs the floor S/B."""
    from benchmarks import distribution

    try:
        counts, names = distribution.parse_workers(workers), distribution.parse_strategies(strategies)
    except distribution.DistributionBenchError as exc:
        raise click.BadParameter(str(exc)) from None
    from benchmarks.cluster import DEFAULT_MTU, FRAME_HEADER_BYTES

    if link_burst < DEFAULT_MTU + FRAME_HEADER_BYTES:
        raise click.BadParameter(f"{link_burst} bytes is less than one frame of the emulated links "
                                 f"({DEFAULT_MTU + FRAME_HEADER_BYTES} bytes)", param_hint="'--link-burst'")
    if package is None:
        package = _demo(cache)
    config = distribution.DistributionConfig(package=package, workers=counts, link_mbit=link_mbit,
                                             store_mbit=store_mbit, strategies=names, transport=transport,
                                             repeat=repeat, mode=mode, auth=not no_auth, tls=tls,
                                             relay_bytes=Settings().agent_relay_bytes,  # as the agents read it
                                             link_burst=link_burst)
    report = _run_and_report(distribution.run, config, workdir, distribution.format_report, json_path)
    if plot_path:
        distribution.save_plot(report, plot_path)


@bench_group.command("share")
@click.option("--link-mbit", type=Number(min=0, min_open=True), default=400.0, show_default=True,
              help="Every host's link rate per direction, Mbit/s (the agents' agent_link_mbit).")
@click.option("--share", type=Number(min=0, max=1, min_open=True, max_open=True), default=0.8,
              show_default=True, help="The multicast share measured against share 1 (the whole link).")
@click.option("--rate", type=Number(min=0, min_open=True), default=50.0, show_default=True,
              help="Serving requests per second, open loop (enough that each multicast phase has a p99).")
@click.option("--deadline", type=Number(min=0, min_open=True), default=2.0, show_default=True,
              help="Seconds a serving request may take; a later one counts as failed, at the deadline.")
@click.option("--idle-seconds", type=Number(min=0, min_open=True), default=10.0, show_default=True,
              help="Length of the idle-link phase.")
@click.option("--package-mib", type=click.IntRange(min=8), default=160, show_default=True,
              help="Size of the random package built (and cached) when --package is not given.")
@click.option("--package", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Block package to multicast (default: a random one of --package-mib).")
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), default=Path(".cache/pipecast"),
              show_default=True, help="Where the random package is cached.")
@EMULATION
@click.option("--link-queue", type=click.Choice(["fifo", "per-peer"]), default="fifo", show_default=True,
              help="netns mode: each link direction one FIFO shared by every flow (a switch port), or one tc class "
                   "per peer (which keeps the serving traffic out of the multicast's queue).")
@JSON_OUT
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the processes' logs and events here (default: a temp dir, removed).")
def bench_share(link_mbit, share, rate, deadline, idle_seconds, package_mib, package, cache, mode, link_queue,
                json_path, workdir):
    """Serving p99 on a link that is multicasting: idle, at the whole link, and at the multicast share."""
    from benchmarks import share as share_bench

    try:
        config = share_bench.ShareConfig(package=package or share_bench.share_package(cache, package_mib),
                                         link_mbit=link_mbit, share=share, rate_per_s=rate, deadline_s=deadline,
                                         idle_s=idle_seconds, mode=mode, link_queue=link_queue)
    except share_bench.ShareBenchError as exc:
        raise click.UsageError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="pipecast-bench-") as tmp, Progress.on_stderr(click.echo) as progress:
        report = share_bench.run(config, Path(workdir or tmp), progress=progress)
    click.echo(share_bench.format_report(report))
    if json_path:
        write_json(json_path, report.to_json())


# The Azure LLM inference trace 2023 (conversation), beside the repository (DESIGN 5).
SURGE_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"


@bench_group.command("surge")
@click.option("--workers", type=click.IntRange(min=1), default=8, show_default=True,
              help="Pool size N the surge scales to.")
@click.option("--min-workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="Workers holding the model before the surge in every strategy (the pool's minimum).")
@click.option("--strategy", "strategies", default="unicast,warm-pool,pipecast-oracle,pipecast", show_default=True,
              help="Strategies, comma-separated; NAME:W gives one W warm workers (e.g. warm-pool:4).")
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path), default=SURGE_TRACE, show_default=True,
              help="Trace CSV with columns TIMESTAMP, ContextTokens, GeneratedTokens.")
@click.option("--window-start", type=Number(min=0), default=120.0, show_default=True,
              help="Replay the trace from this many seconds after its first request (its first two minutes ramp "
                   "up; from 120 s the service runs at its full rate, so the surge arrives at once).")
@click.option("--window-seconds", type=Number(min=0, min_open=True),
              help="Replay this many seconds of the trace (and/or --window-requests).")
@click.option("--window-requests", type=click.IntRange(min=1), default=200, show_default=True,
              help="Replay at most this many requests.")
@click.option("--time-scale", type=Number(min=0, min_open=True), default=2.0, show_default=True,
              help="Replay seconds per trace second (0.5: twice as fast; 2, the default, keeps this 2-core machine "
                   "out of saturation).")
@click.option("--synthetic", metavar="step:rate=R,duration=D | burst:requests=K,spread=S",
              help="A synthetic surge instead of the trace (its requests use the caps as lengths).")
@click.option("--surges", type=click.IntRange(min=1), default=1, show_default=True,
              help="Play the load this many times, each after --quiet-seconds without a request (the long run: "
                   "scale-down in the quiet, a cold start at each surge).")
@click.option("--quiet-seconds", type=Number(min=0), default=90.0, show_default=True,
              help="The quiet period between two surges (longer than the keep-alive plus the scale-down cooldown).")
@click.option("--slo-ttft-p99", type=Number(min=0, min_open=True), default=2.0, show_default=True,
              help="The daemon's p99 TTFT SLO, seconds (strategies scaled by the daemon).")
@click.option("--keep-alive", type=Number(min=0), default=20.0, show_default=True,
              help="The daemon releases a replica idle this long, seconds.")
@click.option("--scale-down-cooldown", type=Number(min=0), default=30.0, show_default=True,
              help="The daemon releases nothing this long after a scale event, seconds.")
@click.option("--cold-start", type=Number(min=0), default=0.0, show_default=True,
              help="The daemon's cold_start_s: seconds a new replica takes to serve (0: not counted; S/B is about "
                   "it here).")
@click.option("--measure-cold-start", is_flag=True,
              help="The daemon sizes for the cold starts it measures once it has one (--cold-start until then).")
@click.option("--daemon-warm", type=click.IntRange(min=0), default=0, show_default=True,
              help="The daemon's warm pool: replicas it keeps loaded beyond the demand (its policy's warm; "
                   "pipecast:W instead keeps W as its minimum).")
@click.option("--prompt-cap", type=click.IntRange(min=1), default=64, show_default=True,
              help="Largest prompt sent, in tokens (this machine computes on CPU).")
@click.option("--output-cap", type=click.IntRange(min=1), default=4, show_default=True,
              help="Largest output asked for, in tokens.")
@click.option("--link-mbit", type=Number(min=0, min_open=True), default=400.0, show_default=True,
              help="Every host's link rate per direction, Mbit/s.")
@click.option("--store-mbit", type=Number(min=0, min_open=True),
              help="The store's egress rate, Mbit/s (default: the link rate).")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs per strategy, interleaved; the medians are reported.")
@click.option("--pre-surge-seconds", type=Number(min=0), default=60.0, show_default=True,
              help="Idle time before the surge charged to each warm worker (cost).")
@click.option("--first-n", type=click.IntRange(min=1), default=100, show_default=True,
              help="The first requests of the surge whose TTFT is reported apart.")
@click.option("--worker-max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Sequences a worker runs together.")
@click.option("--queue-timeout", type=Number(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds a request may wait in the router for a worker.")
@click.option("--worker-cpus", type=Number(min=0), callback=_cpus_option,
              help="CPUs each serving worker may use (a cgroup CFS quota, at least 0.01): each emulated node's own "
                   "compute, as a GPU node has. Default: the machine's cores / --workers; 0: no quota (workers share "
                   "every core).")
@click.option("--agent-reserve", metavar="SIZE|package|0", default="package", show_default=True,
              callback=_reserve_size,
              help="Host memory each cold worker's agent populates at start and receives blocks into (agent "
                   "--reserve, as an operator sets it on VMs that back memory lazily, as this one does; package: "
                   "the package's size; 0: none).")
@click.option("--package", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Block package to serve (default: the demo model's, packed on first use).")
@DEMO_CACHE
@EMULATION
@click.option("--no-calibrate", is_flag=True, help="Skip measuring one prefill (the transfer/compute ratio).")
@JSON_OUT
@output_file("--csv", "csv_path", help="Write every request (arrival, worker, TTFT, tokens) as CSV.")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write ttft_cdf.png and timeline.png into this folder.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep every process's log and events here (default: a temp dir, removed).")
@CREDENTIALS
def bench_surge(workers, min_workers, strategies, trace, window_start, window_seconds, window_requests, time_scale,
                synthetic, surges, quiet_seconds, slo_ttft_p99, keep_alive, scale_down_cooldown, cold_start,
                measure_cold_start, daemon_warm, prompt_cap,
                output_cap, link_mbit, store_mbit, repeat, pre_surge_seconds, first_n, worker_max_batch,
                queue_timeout, worker_cpus, agent_reserve, package, cache, mode, no_calibrate, json_path, csv_path,
                plots_dir, workdir, no_auth):
    """TTFT while a traffic surge scales the pool from its minimum to N: pipecast vs unicast and a warm pool."""
    from dataclasses import replace

    from benchmarks.surge import run as surge
    from benchmarks.surge import trace as traces
    from benchmarks.surge.strategies import parse_strategies
    from pipecast.core.errors import PipecastError

    worker_cpus = _worker_cpus(worker_cpus, workers, f"--workers {workers}")
    try:
        caps = traces.TokenCaps(prompt_cap, output_cap)
        if synthetic:
            load = traces.parse_synthetic(synthetic)
            schedule, description = traces.synthetic_schedule(load, caps), load.describe()
        else:
            window = traces.Window(window_start, window_seconds, window_requests)
            schedule = traces.replay_schedule(traces.read_trace(trace), window, time_scale, caps)
            description = f"trace {trace.name}, window {window.describe()}, time scale {time_scale:g}"
        if surges > 1:
            schedule = traces.repeat_surges(schedule, surges, quiet_seconds)
            description += f"; played {surges} times, {quiet_seconds:g} s quiet between"
        if package is None:
            package = _demo(cache)
        reserve = surge.PackageFacts.of(package).total_bytes if agent_reserve == "package" else agent_reserve
        config = surge.SurgeConfig(
            package=package, schedule=schedule, load_description=description, caps=caps,
            strategies=parse_strategies(strategies), workers=workers, min_workers=min_workers, link_mbit=link_mbit,
            store_mbit=store_mbit, repeat=repeat, pre_surge_s=pre_surge_seconds, first_n=first_n, mode=mode,
            worker_max_batch=worker_max_batch, queue_timeout_s=queue_timeout, calibrate=not no_calibrate,
            worker_cpus=worker_cpus,
            policy=replace(surge.DEFAULT_POLICY, slo_ttft_p99_s=slo_ttft_p99, keep_alive_s=keep_alive,
                           scale_down_cooldown_s=scale_down_cooldown, cold_start_s=cold_start,
                           cold_start_measured=measure_cold_start, warm=daemon_warm),
            agent_reserve_bytes=reserve, auth=not no_auth)
    except PipecastError as exc:
        raise click.UsageError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="pipecast-bench-") as tmp, Progress.on_stderr(_echo_err) as progress:
        report = surge.run(config, Path(workdir or tmp), progress=progress)
    from benchmarks.surge.report import format_report

    click.echo(format_report(report.meta, report.summaries))
    for path in surge.write_outputs(report, json_path=json_path, csv_path=csv_path, plots_dir=plots_dir):
        click.echo(f"wrote {path}", err=True)


@bench_group.command("coldstart")
@click.option("--engine", type=click.Choice(["pipecast", "vllm"]), default="pipecast", show_default=True,
              help="pipecast: one cold pipecast worker, execute-while-load vs load-then-serve. vllm: N cold `vllm "
                   "serve` workers from the scale-up, pipecast multicast vs the store vs vLLM's own loader from disk.")
@click.option("--prompt-tokens", help="Prompt lengths in tokens, comma-separated [default: 128,512,1024; with "
                                      "--engine vllm one length, 128].")
@click.option("--workers", default="1,4", show_default=True, help="--engine vllm: worker counts N, comma-separated.")
@click.option("--link-mbit", type=Number(min=0, min_open=True),
              help="Every host's link rate per direction, Mbit/s [default: 400; with --engine vllm 50, where the "
                   "transfer dominates vLLM's start-up].")
@click.option("--package", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Block package to start cold (default: the demo model's, packed on first use).")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="--engine vllm: the safetensors checkpoint the package was packed from, for vLLM's default "
                   "loader (default: the demo model's).")
@click.option("--vllm-venv", type=click.Path(file_okay=False, path_type=Path), envvar="PIPECAST_VLLM_VENV",
              default=Path(".venv-vllm"), show_default=True,
              help="--engine vllm: vLLM's environment with the pipecast-vllm plugin (make test-vllm builds it).")
@click.option("--repeat", type=click.IntRange(min=1),
              help="Cold starts per strategy (and prompt length or N); the medians are reported [default: 3; with "
                   "--engine vllm 1].")
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Tokens generated per request (compared between the strategies).")
@EMULATION
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Torch threads of each worker (OMP_NUM_THREADS) and of the compute measurement; more than one "
                   "lets other load on a shared machine stall torch's thread pool for whole seconds.")
@click.option("--device", default="cpu", show_default=True,
              help="--engine pipecast: where the worker and the compute measurement run (cpu, cuda, cuda:1 ...).")
@JSON_OUT
@DEMO_CACHE
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep every run's logs, events and answers here (default: a temp dir, removed).")
@CREDENTIALS
def bench_coldstart(engine, prompt_tokens, workers, link_mbit, package, checkpoint, vllm_venv, repeat, max_tokens,
                    mode, threads, device, json_path, cache, workdir, no_auth):
    """Time to first token of cold workers, beside the floor and the baseline (see --engine)."""
    from benchmarks import coldstart

    vllm = engine == "vllm"
    try:
        lengths = coldstart.parse_prompt_tokens(prompt_tokens or ("128" if vllm else "128,512,1024"))
        if vllm:
            from benchmarks import coldstart_vllm

            counts = coldstart_vllm.parse_workers(workers)
            if len(lengths) > 1:
                raise coldstart.ColdStartBenchError("--engine vllm takes one prompt length")
            if no_auth:
                raise coldstart.ColdStartBenchError("--no-auth: --engine vllm runs without credentials already "
                                                    "(vLLM's workers take no serving key)")
            if device != "cpu":
                raise coldstart.ColdStartBenchError("--device is for --engine pipecast (vLLM runs its workers "
                                                    "where its build targets)")
        else:
            # Typed ones only: PIPECAST_VLLM_VENV may be set for every run.
            given = [f"--{name.replace('_', '-')}" for name in ("workers", "checkpoint", "vllm_venv")
                     if click.get_current_context().get_parameter_source(name) is ParameterSource.COMMANDLINE]
            if given:
                raise coldstart.ColdStartBenchError(f"{', '.join(given)}: for --engine vllm only (the pipecast "
                                                    "engine starts one worker from --package)")
            coldstart.check_device(device)
    except coldstart.ColdStartBenchError as exc:
        raise click.BadParameter(str(exc)) from None
    if package is None:
        package = _demo(cache)
    if not vllm:
        config = coldstart.ColdStartConfig(package=package, prompt_tokens=lengths, link_mbit=link_mbit or 400.0,
                                           repeat=repeat or 3, max_tokens=max_tokens, mode=mode, threads=threads,
                                           device=device, auth=not no_auth)
        _run_and_report(coldstart.run, config, workdir, coldstart.format_report, json_path)
        return
    if checkpoint is None:
        from benchmarks.demo_model import demo_checkpoint

        checkpoint = demo_checkpoint(cache)
    try:
        config = coldstart_vllm.VllmColdStartConfig(
            package=package, checkpoint=checkpoint, vllm_venv=vllm_venv, workers=counts, link_mbit=link_mbit or 50.0,
            prompt_tokens=lengths[0], max_tokens=max_tokens, repeat=repeat or 1, threads=threads, mode=mode)
    except coldstart.ColdStartBenchError as exc:
        raise click.UsageError(str(exc)) from None
    _run_and_report(coldstart_vllm.run, config, workdir, coldstart_vllm.format_report, json_path)


@bench_group.command("pipelines")
@click.option("--sources", default="1,2,4,8", show_default=True, help="Source counts K, comma-separated.")
@click.option("--source-kind", "source_kinds", default="warm,store", show_default=True,
              help="warm: K warm workers hold the package; store: the store's egress is K links.")
@click.option("--strategy", "strategies", default="pipelines,whole-model", show_default=True,
              help="pipelines (the router routes to cross-node pipelines; a head whose pipeline dissolves under "
                   "a request moves it or not as it measures), pipelines-move and pipelines-finish (the same, heads "
                   "always moving such requests to their engine, or never) and/or whole-model (--no-pipelines).")
@click.option("--receivers", type=click.IntRange(min=2), default=8, show_default=True,
              help="Workers scaled up (N), each an agent and a serving worker.")
@click.option("--link-mbit", type=Number(min=0, min_open=True), default=400.0, show_default=True,
              help="Every host's link rate (B).")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--package", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Block package (default: the demo model's, packed on first use).")
@DEMO_CACHE
@EMULATION
@click.option("--worker-cpus", type=Number(min=0), callback=_cpus_option,
              help="CPUs each serving worker may use (a CFS quota of at least 0.01, each emulated node its own "
                   "capacity; default: this machine's cores / receivers; 0: no quota).")
@JSON_OUT
@output_file("--plot", "plot_path", help="Draw the first token against K (a share of S/B) as a PNG.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep logs and events here (default: a temp dir).")
@CREDENTIALS
def bench_pipelines(sources, source_kinds, strategies, receivers, link_mbit, prompt_tokens, max_tokens, package,
                    cache, mode, worker_cpus, json_path, plot_path, workdir, no_auth):
    """First token after a scale-up from K sources: cross-node pipelines vs waiting for a whole model."""
    from benchmarks import pipelines

    worker_cpus = _worker_cpus(worker_cpus, receivers, f"--receivers {receivers}")
    try:
        config = pipelines.PipelinesConfig(
            package=package or _demo(cache), sources=pipelines.parse_sources(sources),
            source_kinds=pipelines.parse_choice(source_kinds, pipelines.SOURCE_KINDS, "--source-kind"),
            strategies=pipelines.parse_choice(strategies, pipelines.STRATEGIES, "--strategy"),
            receivers=receivers, link_mbit=link_mbit, prompt_tokens=prompt_tokens, max_tokens=max_tokens, mode=mode,
            worker_cpus=worker_cpus,
            auth=not no_auth)
    except pipelines.PipelinesBenchError as exc:
        raise click.UsageError(str(exc)) from None
    report = _run_and_report(pipelines.run, config, workdir, pipelines.format_report, json_path)
    if plot_path:
        pipelines.save_plot(report, plot_path)


@bench_group.command("stragglers")
@click.option("--workers", type=click.IntRange(min=2), default=8, show_default=True,
              help="Receivers scaled up (N), each an agent.")
@click.option("--link-mbit", type=Number(min=0, min_open=True), default=400.0, show_default=True,
              help="Every host's link rate (B), which every agent declares, the slow one's too.")
@click.option("--slow-position", type=click.IntRange(min=1), default=3, show_default=True,
              help="The slow receiver's position in the scale-up's order (1-based).")
@click.option("--slow-factor", type=Number(min=0, max=1, min_open=True, max_open=True), default=0.25,
              show_default=True, help="The slow receiver's link rate, as a share of the link rate.")
@click.option("--slow-direction", type=click.Choice(["both", "up"]), default="both", show_default=True,
              help="Which of its link's directions is slow: both (a node below its spec) or up only (an egress "
                   "cap: it receives at the link rate and relays slowly).")
@click.option("--modes", default="handled,unhandled", show_default=True,
              help="handled (the control plane's straggler handling), unhandled (--straggler-factor 0) and/or "
                   "none (no slow receiver: the reference), comma-separated.")
@click.option("--kill-position", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also kill (SIGKILL) the agent of the receiver at this position during the transfer; 0: none.")
@click.option("--kill-after", type=Number(min=0), default=1.5, show_default=True,
              help="Seconds after the scale-up that --kill-position is killed.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs per mode, interleaved; the verdict takes the medians.")
@click.option("--package", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Block package (default: the demo model's, packed on first use).")
@DEMO_CACHE
@EMULATION
@JSON_OUT
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep logs and events here (default: a temp dir).")
def bench_stragglers(workers, link_mbit, slow_position, slow_factor, slow_direction, modes, kill_position, kill_after,
                     repeat, package, cache, mode, json_path, workdir):
    """A scale-up with one receiver below its link's spec: the others' time vs S/B, handled and not."""
    from benchmarks import stragglers

    try:
        config = stragglers.StragglersConfig(
            package=package or _demo(cache), workers=workers, link_mbit=link_mbit, slow_position=slow_position,
            slow_factor=slow_factor, slow_direction=slow_direction, modes=stragglers.parse_modes(modes),
            kill_position=kill_position, kill_after_s=kill_after, repeat=repeat, mode=mode)
    except stragglers.StragglersBenchError as exc:
        raise click.UsageError(str(exc)) from None
    _run_and_report(stragglers.run, config, workdir, stragglers.format_report, json_path)


@bench_group.command("hops")
@click.option("--stages", default="1,2,4,8", show_default=True,
              help="Stage counts, comma-separated (1: one worker alone, the baseline).")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True,
              help="Requests per stage count; the medians are reported.")
@click.option("--package", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Block package (default: the demo model's, packed on first use).")
@DEMO_CACHE
@JSON_OUT
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the workers' logs here (default: a temp dir).")
def bench_hops(stages, prompt_tokens, max_tokens, repeat, package, cache, json_path, workdir):
    """Per-token latency through a cross-node pipeline of k stages against one worker: the hops' cost."""
    from benchmarks import hops

    try:
        counts = tuple(int(part) for part in stages.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated counts, got {stages!r}") from None
    if not counts or min(counts) < 1 or counts[0] != 1 or len(set(counts)) != len(counts):
        raise click.BadParameter(f"distinct counts starting with 1 (the baseline), got {stages!r}")
    config = hops.HopsConfig(package=package or _demo(cache), stages=counts, prompt_tokens=prompt_tokens,
                             max_tokens=max_tokens, repeat=repeat)
    try:
        _run_and_report(hops.run, config, workdir, hops.format_report, json_path)
    except hops.HopsBenchError as exc:
        raise click.ClickException(str(exc)) from None


@bench_group.command("engine")
@click.option("--package", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Block package to run (default: the demo model's, packed on first use).")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Concurrent requests, comma-separated.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="Torch threads.")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs per concurrency; the median is reported.")
@JSON_OUT
@DEMO_CACHE
def bench_engine(package, concurrency, prompt_tokens, max_tokens, device, threads, repeat, json_path, cache):
    """Engine tokens/s at each concurrency, and memory (peak RSS) against the package's size."""
    from benchmarks import engine_bench

    try:
        concurrencies = tuple(int(c) for c in concurrency.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated counts, got {concurrency!r}") from None
    if not concurrencies or min(concurrencies) < 1:
        raise click.BadParameter(f"concurrencies must be >= 1, got {concurrency!r}")
    if package is None:
        package = _demo(cache)
    report = engine_bench.run(package, concurrencies=concurrencies, prompt_tokens=prompt_tokens,
                              max_tokens=max_tokens, device=device, threads=threads, repeat=repeat)
    click.echo(engine_bench.format_report(report))
    if json_path:
        write_json(json_path, report.to_json())


@bench_group.command("chaos")
@click.option("--short", is_flag=True, help="Smaller counts: the whole suite in under 3 minutes on 2 cores.")
@click.option("--only", metavar="NAME,...", help="Run only these scenarios, comma-separated (default: all).")
@output_file("--json", "json_path", help="Write the results as JSON.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep every process's log and events here (default: a temp dir, removed).")
def bench_chaos(short: bool, only: str | None, json_path: Path | None, workdir: Path | None) -> None:
    """Inject faults into real processes: survived, corrupt blocks served, hangs, peak RSS/fds vs bounds.

    Exits 1 if any scenario fails."""
    from benchmarks import chaos

    try:
        names = chaos.parse_only(only)
    except chaos.ChaosError as exc:
        raise click.BadParameter(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="pipecast-chaos-") as tmp, Progress.on_stderr(_echo_err) as progress:
        report = chaos.run(names, short, Path(workdir or tmp), progress=progress)
    click.echo(chaos.format_report(report))
    if json_path:
        write_json(json_path, report.to_json())
    if not report.passed:
        raise SystemExit(1)


@bench_group.command("simulate")
@click.option("--nodes", default="16,64,256,1024", show_default=True, help="Receiver counts N, comma-separated.")
@click.option("--strategy", "strategies", default="chain,binomial,unicast", show_default=True,
              help="Planner strategies to simulate, comma-separated (chain, binomial, tree, unicast; unicast is the "
                   "baseline).")
@click.option("--package", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Take the blocks' and chunks' sizes from this package's manifest (overrides --model-bytes, "
                   "--blocks and --chunk-bytes).")
@click.option("--model-bytes", type=SIZE, default="257MiB", show_default=True, help="Model size S (the demo model's).")
@click.option("--blocks", type=click.IntRange(min=1), default=8, show_default=True, help="Blocks of equal size.")
@click.option("--link-mbit", type=Number(min=0, min_open=True), default=400.0, show_default=True,
              help="Every node's link rate B, Mbit/s.")
@click.option("--chunk-bytes", type=SIZE, default="1MiB", show_default=True, help="The cut-through unit.")
@click.option("--hop-latency-ms", type=Number(min=0), default=0.2, show_default=True,
              help="Latency of each hop, ms.")
@click.option("--serve", type=click.Choice(["fair", "earliest"]), default="fair", show_default=True,
              help="How an uplink picks among its waiting children: fair (as agents serve them) or the child "
                   "furthest behind in its fetch list first.")
@click.option("--slow-position", type=click.IntRange(min=0), default=0, show_default=True,
              help="A receiver (1-based, in plan order; 0: none) whose link runs at --slow-factor x B; each plan is "
                   "also simulated with it demoted from the start (the straggler handling's best).")
@click.option("--slow-factor", type=Number(min=0, max=1, min_open=True), default=0.25, show_default=True,
              help="The slow receiver's link rate as a share of B.")
@click.option("--racks", type=click.IntRange(min=0), default=0, show_default=True,
              help="Put the receivers in this many racks (consecutive; the store in the first) and plan rack-aware; "
                   "0: one flat network.")
@click.option("--oversubscription", type=Number(min=1), default=1.0, show_default=True,
              help="A rack's uplink is its nodes' links over this (4: 4:1), each way (with --racks).")
@click.option("--fail-position", type=click.IntRange(min=0), default=0, show_default=True,
              help="A receiver (1-based, in plan order; 0: none) that dies --fail-at seconds after the start; the "
                   "plan is repaired --detect seconds later, as the control plane repairs it.")
@click.option("--fail-at", type=Number(min=0), default=1.0, show_default=True,
              help="When --fail-position dies, seconds after the start.")
@click.option("--detect", type=Number(min=0), default=0.7, show_default=True,
              help="Seconds from a death to the repair (a child reports its parent gone, or a lease lapses).")
@click.option("--calibrated", is_flag=True,
              help="The start delay per hop and the payload's share of a link fitted to this project's emulated "
                   "cluster (16 ms, 97.5%) instead of ideal links.")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="Units a receiver fetches at once from different parents (the agents' agent_fetch_concurrency; "
                   "1: one at a time, the model the calibration uses).")
@click.option("--relay-bytes", type=click.IntRange(min=0), show_default=True,
              default=Settings.model_fields["agent_relay_bytes"].default,
              help="A receiver passes a chunk on from its first piece of this many bytes, as the agents' TCP relay "
                   "does (agent_relay_bytes); 0: once the whole chunk is in.")
@JSON_OUT
def bench_simulate(nodes, strategies, package, model_bytes, blocks, link_mbit, chunk_bytes, hop_latency_ms, serve,
                   slow_position, slow_factor, racks, oversubscription, fail_position, fail_at, detect, calibrated,
                   concurrency, relay_bytes, json_path):
    """Multicast completion at any N in the chunk-level simulator, from the control plane's own plans."""
    from benchmarks import distribution, simulate
    from control_plane.planner.simulate import CALIBRATED_GOODPUT, CALIBRATED_START_DELAY_S
    from benchmarks.runinfo import parse_counts

    try:
        counts = parse_counts(nodes, "--nodes", distribution.DistributionBenchError)
        names = distribution.parse_strategies(strategies)
    except distribution.DistributionBenchError as exc:
        raise click.BadParameter(str(exc)) from None
    if fail_position == 1 and 1 in counts:  # no receiver would be left to time
        raise click.BadParameter("1 is the only receiver at --nodes 1: nothing would be left to time",
                                 param_hint="'--fail-position'")
    for position, name in ((slow_position, "--slow-position"), (fail_position, "--fail-position")):
        if position > min(counts):  # that N would run without it, while the report says it is in effect
            raise click.BadParameter(f"{position} is past the last receiver at --nodes {min(counts)}",
                                     param_hint=f"'{name}'")
    source = ""
    if package is not None:
        from packager.manifest import read_manifest
        from pipecast.core.units import format_bytes

        manifest = read_manifest(package)
        block_bytes = [b.bytes for b in manifest.blocks]
        chunk_bytes = max(b.chunk_bytes for b in manifest.blocks)
        source = f"{manifest.model_name} ({format_bytes(manifest.total_bytes)})"
    elif model_bytes < blocks:  # a block of no bytes has no chunk to simulate
        raise click.BadParameter(f"{model_bytes} bytes cannot be cut into --blocks {blocks}: every block needs a "
                                 "byte at least", param_hint="'--model-bytes'")
    else:
        block_bytes = simulate.equal_blocks(model_bytes, blocks)
    settings = dict(block_bytes=block_bytes, link_mbit=link_mbit, chunk_bytes=chunk_bytes,
                    hop_latency_s=hop_latency_ms / 1e3, serve=serve, goodput=CALIBRATED_GOODPUT if calibrated else 1.0,
                    start_delay_s=CALIBRATED_START_DELAY_S if calibrated else 0.0, slow_position=slow_position,
                    slow_factor=slow_factor if slow_position else 1.0, racks=racks, oversubscription=oversubscription,
                    fail_position=fail_position, fail_at_s=fail_at, detect_s=detect, concurrency=concurrency,
                    relay_bytes=relay_bytes)
    with Progress.on_stderr(_echo_err) as progress:
        progress.start(len(counts) * len(names), "simulate")
        results = simulate.run(list(counts), list(names), **settings,
                               progress=lambda line: (progress.status(line), progress.advance()))
    click.echo(simulate.report(results, **settings, source=source))
    if json_path:
        write_json(json_path, simulate.to_json(results, **settings, package=str(package or "")))


@bench_group.command("control-plane")
@click.option("--workers", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--blocks", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--chunks", type=click.IntRange(min=1), default=1, show_default=True,
              help="Chunks a block in the planned packages: with several, binomial plans fetch chunk ranges.")
@click.option("--duration", "duration_s", type=Number(min=0.5), default=10.0, show_default=True,
              help="Seconds of block reporting.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Blocks per report.")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="Planning repeats.")
@click.option("--db", help="The server's database: a postgresql:// URL (an empty database: the bench's state stays "
                           "in it) or a SQLite path; default: a SQLite file in a temp dir.")
@click.option("--heartbeat", "heartbeat_s", type=Number(min=0.1), default=2.0, show_default=True,
              help="Seconds between a simulated worker's heartbeats (the agents' default: 2; the lease is 5 of them).")
@click.option("--stall-workers", default="1000,5000", show_default=True,
              help="Worker counts at which the server's event-loop stalls are measured (comma-separated; '' for none).")
@JSON_OUT
def bench_control_plane(workers: int, blocks: int, chunks: int, duration_s: float, batch: int, repeat: int,
                        db: str | None, heartbeat_s: float, stall_workers: str, json_path: Path | None) -> None:
    """Plan time of a scale-up and block reports/s of the real server under simulated workers."""
    from benchmarks import control_plane_bench as bench

    from benchmarks.runinfo import parse_counts

    stalls = parse_counts(stall_workers, "--stall-workers", click.BadParameter) if stall_workers else ()
    try:
        result = bench.run(workers=workers, blocks=blocks, duration_s=duration_s, batch=batch, repeat=repeat, db=db,
                           heartbeat_s=heartbeat_s,
                           chunks=chunks, stall_workers=stalls, progress=lambda message: click.echo(message, err=True))
    except bench.ControlPlaneBenchError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(bench.report(result))
    if json_path:
        write_json(json_path, bench.to_json(result))


@bench_group.command("tenants")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="Serving workers.")
@click.option("--duration", "duration_s", type=Number(min=0, min_open=True), default=20.0,
              show_default=True, help="Seconds of load per phase.")
@click.option("--rate-b", type=Number(min=0, min_open=True),
              help="Tenant b's requests/s (default: 20% of the calibrated capacity).")
@click.option("--rate-a", type=Number(min=0, min_open=True),
              help="Tenant a's limit, requests/s (default: 20% of the calibrated capacity).")
@click.option("--burst-factor", type=Number(min=1, min_open=True), default=10.0, show_default=True,
              help="Tenant a sends this many times its limit in the burst phases.")
@click.option("--deadline", "deadline_s", type=Number(min=0, min_open=True), default=10.0,
              show_default=True, help="Seconds a request may take; a later one counts as failed, at the deadline.")
@click.option("--package", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Block package to serve (default: a random tiny Llama with a byte-level tokenizer, built on "
                   "first use).")
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), default=Path(".cache/pipecast"),
              show_default=True, help="Where the default package is cached.")
@JSON_OUT
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the processes' logs here (default: a temp dir, removed).")
def bench_tenants(workers, duration_s, rate_b, rate_a, burst_factor, deadline_s, package, cache, json_path, workdir):
    """Tenant b's p99 while tenant a bursts at 10x its rate, with per-tenant limits and without."""
    from benchmarks import tenants

    try:
        config = tenants.TenantsConfig(package=package or tenants.tenants_package(cache), workers=workers,
                                       duration_s=duration_s, rate_a=rate_a, rate_b=rate_b,
                                       burst_factor=burst_factor, deadline_s=deadline_s)
    except tenants.TenantsBenchError as exc:
        raise click.UsageError(str(exc)) from None
    _run_and_report(tenants.run, config, workdir, tenants.format_report, json_path)
