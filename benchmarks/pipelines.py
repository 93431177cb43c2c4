"""``pipecast bench pipelines``: the first token after a scale-up, fed by K sources: through pipelines
across the receivers before any of them holds the model, against waiting for a whole model.

One emulated cluster (DESIGN 5) per source setting, every link shaped at B: a control plane, a store
agent, N receivers each with an agent and a ``pipecast serve`` worker (one torch thread), a router that
learns workers and pipelines from the control plane, and a driver. Source kinds:

- ``warm``: K warm workers' agents hold the package in host memory (seeded, registered as holders); the
  store is not a holder, so the scale-up sends from the K warm ones.
- ``store``: no holder; the store's egress is K x B and the control plane counts it as K sources
  (``--store-links K``).

The scale-up is the control plane's default plan (rotated by bytes over K sources; a chain from one). Two
strategies in the same cluster, everything else identical: ``pipelines`` (the router routes to the
pipelines the control plane forms as blocks land) and ``whole-model`` (``--no-pipelines``: the request
waits for a worker holding, or about to hold, the whole model; execute-while-load still overlaps its
prefill with the last block). When a pipeline dissolves under its request (the head came to hold the
whole model), ``pipelines`` heads choose from their measured step times whether to move the request to
their own engine or to finish it through the stages (``pipecast serve --pipeline-dissolve auto``, the
default), ``pipelines-move`` heads always move it, ``pipelines-finish`` heads never; with a request that
outlasts the transfer (``--max-tokens``) the three compare how long it runs on once its head holds the
whole model. Each run
starts every process, waits until all are up (the serving workers
waiting for the package, torch imported), then the driver scales up and, at the same instant, sends one
streamed request through the router; its TTFT counts from the scale-up, against the floor S/B of one
link. The driver also records when each receiver holds the whole package.

The module is pure logic (configuration, results, report) above :func:`run`; run as ``python -m
benchmarks.pipelines SPEC`` it is the driver, on its own host.
"""

import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.checkout import module_argv
from benchmarks.cluster import EmulatedCluster, RequestedMode
from benchmarks.cpu import CpuSampler
from benchmarks.cpuquota import CpuQuotas, open_quotas
from benchmarks.distribution import floor_seconds, worker_names
from benchmarks.plots import Series, save_line_chart
from benchmarks.processes import (RunProcesses, cli, credentials_env, credentials_line, driver_token, endpoint,
                                  publish_when_up)
from benchmarks.runinfo import RunsReport, versions
from packager.manifest import read_manifest
from pipecast.core.errors import PipecastError
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.core.units import format_bytes
from pipecast.router.discovery import PIPELINE_KEY_PREFIX

PIPELINES, PIPELINES_MOVE, PIPELINES_FINISH, WHOLE = "pipelines", "pipelines-move", "pipelines-finish", "whole-model"
STRATEGIES = (PIPELINES, PIPELINES_MOVE, PIPELINES_FINISH, WHOLE)
#: Each pipelined strategy's ``pipecast serve --pipeline-dissolve``.
DISSOLVE_OF = {PIPELINES: "auto", PIPELINES_MOVE: "move", PIPELINES_FINISH: "finish"}
DEFAULT_STRATEGIES = (PIPELINES, WHOLE)
WARM, STORE_KIND = "warm", "store"
SOURCE_KINDS = (WARM, STORE_KIND)
STORE, CONTROL, ROUTER, DRIVER = "store", "cp", "router", "driver"
#: The issue's targets: first token within this share of S/B, by source count.
TARGETS = {2: 0.6, 4: 0.35, 8: 0.3}
START_TIMEOUT_S = 600.0  # N workers import torch on 2 cores
RUN_TIMEOUT_S = 300.0
COLD_STAGE = "waiting_for_package"
POLL_S = 0.05


class PipelinesBenchError(PipecastError):
    """The pipelines benchmark was misconfigured (the caller's fault) or a run failed (a process's)."""


class PipelinesTimeout(PipelinesBenchError):
    """The run did not get ready, or its request did not finish, in time."""


def parse_sources(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> (1, 2, 4, 8); :class:`PipelinesBenchError` for anything else."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise PipelinesBenchError(f"--sources: expected distinct positive counts, comma-separated, got {text!r}")
    return counts


def parse_choice(text: str, allowed: Sequence[str], option: str) -> tuple[str, ...]:
    """Comma-separated names, each one of ``allowed``."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise PipelinesBenchError(f"{option}: expected some of {', '.join(allowed)}, got {text!r}")
    return names


@dataclass(frozen=True)
class PipelinesConfig:
    """What one ``bench pipelines`` measures."""

    package: Path
    sources: tuple[int, ...] = (1, 2, 4, 8)
    source_kinds: tuple[str, ...] = SOURCE_KINDS
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    receivers: int = 8
    link_mbit: float = 400.0
    prompt_tokens: int = 16
    max_tokens: int = 8
    mode: RequestedMode = "auto"
    #: CPUs each serving worker may use (a CFS quota: each emulated node its own capacity); None: no quota.
    worker_cpus: float | None = None
    #: Credentials as in a cluster that has them (a master token per run, node tokens for the agents that
    #: register): every transfer starts with the data-plane hello, every stage call carries the serving key.
    auth: bool = True


@dataclass(frozen=True)
class RunResult:
    """One run: the request's first token after the scale-up, beside the floor and the transfer."""

    sources: int
    source_kind: str
    strategy: str
    ttft_seconds: float | None
    floor_seconds: float
    ratio_to_floor: float | None
    pipeline_stages: int  # of the pipeline that answered; 0: a whole worker did
    served_by: str
    tokens: list[int]
    inter_token_seconds: float | None  # mean time between two tokens after the first (the hops' cost)
    last_token_seconds: float | None  # the request's end, after the scale-up
    #: A pipelined request's end after its head held the whole model (the pipeline dissolving under it);
    #: None if it ended before, or no pipeline served it.
    after_dissolution_seconds: float | None
    moved: bool  # moved to its head's engine when its pipeline dissolved
    plan_strategy: str
    first_complete_seconds: float | None  # the first receiver holding the whole package
    all_complete_seconds: float | None
    cpu_mean_percent: float
    cpu_saturated: bool
    error: str = ""


class PipelinesReport(RunsReport[RunResult]):
    result_type = RunResult

    def verdicts(self) -> list[str]:
        return verdicts(self.results)


def stages_of(served_by: str) -> int:
    """Stages of the pipeline named by the router's ``x-pipecast-worker`` (``pipeline:a+b``), 0 otherwise."""
    return served_by.count("+") + 1 if served_by.startswith(PIPELINE_KEY_PREFIX) else 0


def verdicts(results: Sequence[RunResult]) -> list[str]:
    """Each target of the issue met or not, and whether every run's tokens match the whole-model ones."""
    lines = []
    for r in results:
        target = TARGETS.get(r.sources)
        if r.strategy != PIPELINES or target is None:
            continue
        got = "no first token" if r.ratio_to_floor is None else f"{r.ratio_to_floor:.2f} x S/B"
        met = r.ratio_to_floor is not None and r.ratio_to_floor <= target
        lines.append(f"K={r.sources} {r.source_kind}: first token {got} (target <= {target} x S/B: "
                     f"{'met' if met else 'NOT met'})")
    by_setting: dict[tuple[int, str], dict[str, RunResult]] = {}
    for r in results:
        by_setting.setdefault((r.sources, r.source_kind), {})[r.strategy] = r
    pairs = [(v[s].tokens, v[WHOLE].tokens) for v in by_setting.values() if WHOLE in v
             for s in DISSOLVE_OF if s in v]
    if pairs:
        same = sum(1 for piped, whole in pairs if piped and piped == whole)
        lines.append(f"tokens identical to whole-model generation: {same} of {len(pairs)} runs")
    for (k, kind), v in by_setting.items():
        move, finish, auto = v.get(PIPELINES_MOVE), v.get(PIPELINES_FINISH), v.get(PIPELINES)
        if move and finish and None not in (move.after_dissolution_seconds, finish.after_dissolution_seconds):
            better = "moving" if move.after_dissolution_seconds < finish.after_dissolution_seconds else "finishing"
            line = (f"K={k} {kind}: after its head held the whole model the request ran on "
                    f"{move.after_dissolution_seconds:.2f} s when moved to the head "
                    f"({'moved' if move.moved else 'NOT moved'}), {finish.after_dissolution_seconds:.2f} s "
                    f"through the pipeline: {better} is better")
            if auto and auto.after_dissolution_seconds is not None:
                chose = "moving" if auto.moved else "finishing"
                line += (f"; the head's own choice (auto): {chose}, {auto.after_dissolution_seconds:.2f} s "
                         f"({'the better' if chose == better else 'NOT the better'})")
            lines.append(line)
    return lines


def format_report(report: PipelinesReport) -> str:
    m = report.meta
    lines = [f"pipelines: {m['model_name']} ({format_bytes(m['package_bytes'])}, {m['blocks']} blocks), "
             f"{m['receivers']} receivers, links {m['link_mbit']:g} Mbit/s ({m['mode']}), floor S/B "
             f"{m['floor_seconds']:.2f} s; one request of {m['prompt_tokens']} tokens at the scale-up; "
             f"{m['worker_cpus']}",
             credentials_line(m.get("auth", True)),
             *(f"RETRIED: K={r['sources']} {r['source_kind']} {r['strategy']} failed once: "
               f"{str(r['error']).splitlines()[0]}" for r in m.get("retried_runs", ())),
             f"{'sources':>7} {'kind':<5} {'strategy':<16} {'plan':<8} {'TTFT s':>7} {'/ S/B':>6} {'stages':>6} "
             f"{'ms/token':>8} {'1st whole s':>11} {'all whole s':>11} {'end s':>6} {'after s':>7} {'CPU':>5}"]
    for r in report.results:
        ttft = "-" if r.ttft_seconds is None else f"{r.ttft_seconds:.2f}"
        ratio = "-" if r.ratio_to_floor is None else f"{r.ratio_to_floor:.2f}"
        first = "-" if r.first_complete_seconds is None else f"{r.first_complete_seconds:.2f}"
        every = "-" if r.all_complete_seconds is None else f"{r.all_complete_seconds:.2f}"
        cpu = f"{r.cpu_mean_percent:.0f}%{'!' if r.cpu_saturated else ''}"
        per_token = "-" if r.inter_token_seconds is None else f"{r.inter_token_seconds * 1000:.0f}"
        end = "-" if r.last_token_seconds is None else f"{r.last_token_seconds:.2f}"
        after = "-" if r.after_dissolution_seconds is None else \
            f"{r.after_dissolution_seconds:.2f}{'m' if r.moved else ''}"
        lines.append(f"{r.sources:>7} {r.source_kind:<5} {r.strategy:<16} {r.plan_strategy:<8} {ttft:>7} "
                     f"{ratio:>6} {r.pipeline_stages:>6} {per_token:>8} {first:>11} {every:>11} {end:>6} {after:>7} "
                     f"{cpu:>5}"
                     + (f"  error: {r.error}" if r.error else ""))
    lines += [f"verdict: {line}" for line in verdicts(report.results)]
    if "largest_block_share" in m:
        lines.append(f"bound: the largest block alone takes {m['largest_block_share']:.2f} x S/B over one link: no "
                     "pipeline answers before it is in")
    lines.append("end: the request's last token after the scale-up; after: how long a pipelined request ran on "
                 "after its head held the whole model ('m': moved to the head's engine)")
    lines.append("CPU: mean of the machine's cores during the run; '!' marks a saturated run (the CPU, not the "
                 "plan, bounds its figures)")
    return "\n".join(lines)


def save_plot(report: PipelinesReport, path: Path) -> Path:
    """PNG of the first token against K, as a share of S/B, per source kind and strategy, with the floor
    (one copy over one link) and the targets."""
    m = report.meta
    series = []
    for kind, strategy in dict.fromkeys((r.source_kind, r.strategy) for r in report.results):
        points = sorted((r.sources, r.ratio_to_floor) for r in report.results
                        if (r.source_kind, r.strategy) == (kind, strategy) and r.ratio_to_floor is not None)
        series.append(Series(f"{strategy}, {kind} sources", [k for k, _ in points], [y for _, y in points]))
    counts = sorted({r.sources for r in report.results})
    series.append(Series("floor S/B (one copy, one link)", counts, [1.0] * len(counts), reference=True))
    targets = [k for k in counts if k in TARGETS]
    if len(targets) > 1:
        series.append(Series("target (issue #14)", targets, [TARGETS[k] for k in targets], reference=True))
    return save_line_chart(
        path, series, x_ticks=counts, log2_x=len(counts) > 1,
        title=f"{m['model_name']} ({format_bytes(m['package_bytes'])}, {m['blocks']} blocks): first token after "
              f"a scale-up of {m['receivers']}",
        xlabel="sources (K)", ylabel="first token / S/B",
        note=f"links {m['link_mbit']:g} Mbit/s ({m['mode']}), S/B {m['floor_seconds']:.2f} s; {m['worker_cpus']}")


# -- the driver (runs on its own host) -----------------------------------------------------------------


@dataclass(frozen=True)
class DriverSpec:
    control_plane: str
    router_url: str
    package: str
    model: str  # the name requests use
    store_address: str
    receivers: dict[str, str]  # name -> serve URL
    holders: tuple[str, ...]   # warm sources that must be registered first
    prompt: list[int]
    max_tokens: int
    events: str
    results: str


async def _drive(spec: DriverSpec) -> dict:
    import aiohttp

    from control_plane.client import ControlPlaneClient
    from pipecast.agent.events import EventLog
    from pipecast.core.credentials import data_plane_key, serving_headers, serving_key

    events = EventLog(Path(spec.events), DRIVER)
    manifest = read_manifest(Path(spec.package))
    package_id, blocks = manifest.package_id, len(manifest.blocks)
    deadline = time.monotonic() + START_TIMEOUT_S
    # The serving key (none with auth off): a router with credentials names the worker or pipeline that served a
    # request (x-pipecast-worker) only to its holders.
    keyed = serving_headers(serving_key(data_plane_key(driver_token())))
    async with ControlPlaneClient(spec.control_plane, token=driver_token()) as cp, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), headers=keyed) as http:
        await publish_when_up(cp, manifest, STORE, spec.store_address, deadline, POLL_S)
        events.emit("published", package=package_id)
        await _arm(spec, cp, http, package_id, deadline)
        events.emit("armed")
        t0 = time.monotonic()
        reply = await cp.scale_up(package_id, node_ids=list(spec.receivers))
        complete: dict[str, float] = {}
        watcher = asyncio.create_task(_watch_complete(cp, package_id, blocks, set(spec.receivers), t0, complete))
        try:
            ttft, last, tokens, served_by = await _request(http, spec, t0)
            async with asyncio.timeout(RUN_TIMEOUT_S):
                await watcher
        finally:
            watcher.cancel()
        piped = served_by.startswith(PIPELINE_KEY_PREFIX)
        head = served_by.removeprefix(PIPELINE_KEY_PREFIX).split("+")[0] if piped else None
        moved = bool(head and ((await _probe(http, f"{spec.receivers[head]}/health")) or {}).get("pipeline_moved"))
    events.emit("done")
    between = (last - ttft) / (len(tokens) - 1) if len(tokens) > 1 else None
    return {"plan_strategy": reply.strategy, "sources": list(reply.sources), "ttft_seconds": ttft,
            "last_token_seconds": last, "inter_token_seconds": between, "tokens": tokens, "served_by": served_by,
            "head": head, "moved": moved, "complete": complete}


async def _arm(spec: DriverSpec, cp, http, package_id: str, deadline: float) -> None:
    """Until the holders hold the package, every receiver is registered, its worker waits for the package
    (torch imported) and the router answers."""
    while True:
        pending = []
        alive = {w.worker.peer.node_id for w in await cp.list_workers() if w.alive}
        holders = (await cp.availability(package_id)).by_worker
        pending += [f"{h} (not holding the package)" for h in spec.holders if len(holders.get(h, ())) == 0]
        pending += [f"{r} (not registered)" for r in spec.receivers if r not in alive]
        for name, url in spec.receivers.items():
            state = await _probe(http, f"{url}/health")
            if not state or state.get("stage") != COLD_STAGE:
                pending.append(f"{name} (health {state or 'unreachable'})")
        if await _probe(http, f"{spec.router_url}/health") is None:
            pending.append("the router")
        if not pending:
            return
        if time.monotonic() > deadline:
            raise PipelinesTimeout(f"not armed within {START_TIMEOUT_S:g} s: waiting for {'; '.join(pending)}")
        await asyncio.sleep(0.2)


async def _probe(http, url: str) -> dict | None:
    import aiohttp

    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as answer:
            return await answer.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def _request(http, spec: DriverSpec, t0: float) -> tuple[float | None, float | None, list[int], str]:
    """One streamed greedy completion through the router; (first and last token after ``t0``, tokens,
    served by)."""
    import aiohttp

    body = {"model": spec.model, "prompt": spec.prompt,
            "max_tokens": spec.max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}
    ttft, last, tokens = None, None, []
    async with http.post(f"{spec.router_url}/v1/completions", json=body,
                         timeout=aiohttp.ClientTimeout(total=RUN_TIMEOUT_S)) as answer:
        served_by = answer.headers.get("x-pipecast-worker", "")
        if answer.status != 200:
            raise PipelinesBenchError(f"the request was answered {answer.status}: {(await answer.text())[:300]}")
        async for line in answer.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise PipelinesBenchError(f"the request failed mid-stream: {event['error']}")
            ids = event["choices"][0].get("token_ids") or []
            if ids:
                last = time.monotonic() - t0
                ttft = last if ttft is None else ttft
            tokens += ids
    return ttft, last, tokens, served_by


async def _watch_complete(cp, package_id: str, blocks: int, receivers: set[str], t0: float,
                          complete: dict[str, float]) -> None:
    while len(complete) < len(receivers):
        view = await cp.availability(package_id)
        now = time.monotonic() - t0
        for node in receivers - set(complete):
            if len(view.by_worker.get(node, ())) == blocks:
                complete[node] = now
        await asyncio.sleep(0.1)


def _driver_main(spec_path: str) -> int:
    spec = DriverSpec(**json.loads(Path(spec_path).read_text()))
    try:
        result = asyncio.run(_drive(spec))
    except Exception as exc:  # the orchestrator reads why from the results file
        Path(spec.results).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    Path(spec.results).write_text(json.dumps(result))
    return 0


# -- the orchestrator ----------------------------------------------------------------------------------


def run_once(cluster: EmulatedCluster, folder: Path, config: PipelinesConfig, manifest, k: int, kind: str,
             strategy: str, sockets: Path, quotas: CpuQuotas) -> RunResult:
    """One run (module docstring) of ``config.package`` (its ``manifest``); logs, events and the driver's
    results stay under ``folder``."""
    receivers = worker_names(config.receivers)
    holders = [f"s{i + 1}" for i in range(k)] if kind == WARM else []
    control, store, router = (endpoint(cluster, CONTROL, "control"), endpoint(cluster, STORE, "agent"),
                              endpoint(cluster, ROUTER, "router"))
    agents = {w: endpoint(cluster, w, "agent") for w in receivers}
    serving = {w: endpoint(cluster, w, "serve") for w in receivers}
    run = RunProcesses(cluster, folder, PipelinesBenchError)
    spec = DriverSpec(control, f"http://{router}", str(config.package), manifest.model_name, store,
                      {w: f"http://{serving[w]}" for w in receivers}, tuple(holders),
                      prompt_ids(config.package, config.prompt_tokens), config.max_tokens,
                      str(run.events_path(DRIVER)), str(folder / "results.json"))
    (folder / "spec.json").write_text(json.dumps(asdict(spec)))
    floor = floor_seconds(sum(b.bytes for b in manifest.blocks), config.link_mbit, config.link_mbit)
    master = secrets.token_hex(16) if config.auth else ""
    operator = credentials_env(master)
    try:
        host, port = control.rsplit(":", 1)
        # warm: the K holders alone are the sources (the store sits out: K is the count measured)
        links = ["--store-links", str(k)] if kind == STORE_KIND else ["--no-store-beside-holders"]
        run.spawn(CONTROL, CONTROL, cli("control-plane", "--host", host, "--port", port, "--db",
                                         folder / "control.sqlite3", *links), env=operator)
        run.spawn(DRIVER, DRIVER, module_argv("benchmarks.pipelines", folder / "spec.json"), env=operator)
        deadline = time.time() + START_TIMEOUT_S
        run.wait_event([DRIVER], "published", deadline, "publishing the package")
        agent = ("agent", "--transport", "tcp")
        # The store has no control plane: it derives the cluster's keys from the master token.
        run.spawn(STORE, STORE, cli(*agent, "--node-id", STORE, "--listen", store, "--seed", config.package,
                                     "--events", run.events_path(STORE)), env=operator)
        for h in holders:
            run.spawn(h, h, cli(*agent, "--node-id", h, "--listen", endpoint(cluster, h, "agent"), "--seed",
                                config.package, "--control-plane", control, "--events", run.events_path(h)),
                      env=credentials_env(master, h))
        for w in receivers:
            run.spawn(w, w, cli(*agent, "--node-id", w, "--listen", agents[w], "--local-socket", sockets / f"{w}.sock",
                                "--control-plane", control, "--serve-url", f"http://{serving[w]}",
                                "--events", run.events_path(w)), env=credentials_env(master, w))
            host, port = serving[w].rsplit(":", 1)
            serve = run.spawn(f"{w}-serve", w, cli(
                "serve", manifest.package_id, "--agent-socket", sockets / f"{w}.sock", "--host", host, "--port", port,
                "--agent-timeout", START_TIMEOUT_S, "--drain-timeout", 0, "--pipeline-dissolve",
                DISSOLVE_OF.get(strategy, "auto")),
                env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
            quotas.limit(serve.pid)
        host, port = router.rsplit(":", 1)
        run.spawn(ROUTER, ROUTER, cli("router", "--host", host, "--port", port, "--control-plane", control,
                                       "--discovery-interval", "0.2", "--health-interval", "0.2", "--health-timeout", 3,
                                       "--drain-timeout", 0, *(["--no-pipelines"] if strategy == WHOLE else [])),
                  env=operator)
        run.wait_event([DRIVER], "armed", deadline, "every process up")
        with CpuSampler() as cpu:
            run.wait_event([DRIVER], "done", time.time() + RUN_TIMEOUT_S + 30, "the request and the transfer")
        run.procs[DRIVER].wait(30)
    finally:
        run.stop(last=[CONTROL])
    data = json.loads((folder / "results.json").read_text())
    if "error" in data:
        raise PipelinesBenchError(f"the driver failed: {data['error']}")
    usage = cpu.usage()
    done = sorted(data["complete"].values())
    ttft, last = data["ttft_seconds"], data["last_token_seconds"]
    head_whole = data["complete"].get(data["head"]) if data["head"] else None
    after = None if head_whole is None or last is None or last <= head_whole else last - head_whole
    return RunResult(sources=k, source_kind=kind, strategy=strategy, ttft_seconds=ttft, floor_seconds=floor,
                     ratio_to_floor=None if ttft is None else ttft / floor,
                     pipeline_stages=stages_of(data["served_by"]), served_by=data["served_by"], tokens=data["tokens"],
                     inter_token_seconds=data["inter_token_seconds"], last_token_seconds=last,
                     after_dissolution_seconds=after, moved=data["moved"],
                     plan_strategy=data["plan_strategy"], first_complete_seconds=done[0] if done else None,
                     all_complete_seconds=done[-1] if len(done) == config.receivers else None,
                     cpu_mean_percent=usage.mean_percent, cpu_saturated=usage.saturated())


def prompt_ids(package: Path, count: int) -> list[int]:
    """``count`` token ids spread over the package's vocabulary (the same for every run)."""
    vocab = json.loads((Path(package) / "config.json").read_text())["vocab_size"]
    return [(7 + 37 * i) % vocab for i in range(count)]


def run(config: PipelinesConfig, workdir: Path, progress: Progress = NO_PROGRESS) -> PipelinesReport:
    """Every source count and kind, both strategies each; logs and events under ``workdir``."""
    manifest = read_manifest(config.package)
    total = sum(b.bytes for b in manifest.blocks)
    report = PipelinesReport(meta={
        "benchmark": "pipelines", "versions": versions(), "cpu_cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0], "model_name": manifest.model_name,
        "package_id": manifest.package_id, "package_bytes": total, "blocks": len(manifest.blocks),
        "receivers": config.receivers, "link_mbit": config.link_mbit, "prompt_tokens": config.prompt_tokens,
        "max_tokens": config.max_tokens, "floor_seconds": floor_seconds(total, config.link_mbit, config.link_mbit),
        # no stage can run the layers of a block before it is in: the largest block bounds any pipeline
        "largest_block_share": max(b.bytes for b in manifest.blocks) / total,
        "auth": config.auth, "targets": TARGETS, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    receivers = worker_names(config.receivers)
    sockets = Path(tempfile.mkdtemp(prefix="pcp-"))  # short: a unix socket path has at most 107 bytes
    quotas = open_quotas(config.worker_cpus)
    report.meta["worker_cpus"] = quotas.description
    report.meta["retried_runs"] = []
    progress(f"serving workers: {quotas.description}")
    progress.start(len(config.source_kinds) * len(config.sources) * len(config.strategies), "scale-ups", unit="run")
    try:
        for kind in config.source_kinds:
            for k in config.sources:
                holders = [f"s{i + 1}" for i in range(k)] if kind == WARM else []
                store_mbit = config.link_mbit * k if kind == STORE_KIND else None
                with EmulatedCluster([STORE, CONTROL, ROUTER, DRIVER, *holders, *receivers], config.link_mbit,
                                     store_mbit=store_mbit, mode=config.mode) as cluster:
                    report.meta["mode"] = cluster.mode
                    for strategy in config.strategies:
                        label = f"[K={k} {kind} {strategy}]"
                        folder = Path(workdir) / f"{kind}-{k}" / strategy
                        try:
                            result = run_once(cluster, folder, config, manifest, k, kind, strategy, sockets,
                                              quotas)
                        except PipelinesBenchError as exc:
                            # A shared machine may kill a run for reasons outside the benchmark: retry once, and
                            # say so in the report, not only on stderr.
                            progress(f"{label} FAILED, retrying once: {exc}")
                            report.meta["retried_runs"].append({"sources": k, "source_kind": kind,
                                                                "strategy": strategy, "error": str(exc)})
                            result = run_once(cluster, folder.with_name(strategy + "-retry"), config, manifest,
                                              k, kind, strategy, sockets, quotas)
                        report.results.append(result)
                        progress.advance()
                        first = ("no first token" if result.ttft_seconds is None else
                                 f"first token {result.ttft_seconds:.2f} s ({result.ratio_to_floor:.2f} x S/B)")
                        whole = result.first_complete_seconds
                        progress(f"{label} {first} via {result.served_by or '?'}; the first receiver held the "
                                 f"whole model at {'-' if whole is None else f'{whole:.2f} s'}")
    finally:
        quotas.close()
        shutil.rmtree(sockets, ignore_errors=True)
    return report


if __name__ == "__main__":
    sys.exit(_driver_main(sys.argv[1]))
