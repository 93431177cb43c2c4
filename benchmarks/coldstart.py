"""``pipecast bench coldstart``: time to first token of one cold worker behind a shaped link.

One emulated cluster (DESIGN 5) with two hosts: ``store`` runs an agent seeding the package; ``worker``
runs, fresh for every run, a ``pipecast serve`` attached to the local socket of an agent that fetches
the package from the store. The serving process starts first and waits for its agent; once it has
imported its code, the agent starts, to begin fetching at t0 (``--start-at``), and a client on the
worker host sends one prompt at t0, streaming, and records when its first token arrives. So TTFT counts
from the first byte of the transfer, with the serving process already started (its Python imports are
not part of a weight cold start).

Two strategies in the same run, everything else identical:

- ``execute-while-load`` (pipecast): the prompt runs layer by layer as blocks are verified, so only the
  last block's compute is left once the transfer ends. Floor: S/B + compute(last block).
- ``load-then-serve`` (the baseline): the same worker with ``--wait-full-load`` holds the request until
  the whole model is in. Floor: S/B + compute(all blocks).

The compute of each prompt length is measured on this machine in the same run (the engine's layers
timed one by one once fully loaded). The verdict compares each TTFT with the measured transfer time
(the links' goodput is below their nominal rate B, and that is not the engine's doing): the target is
TTFT <= transfer + 1.1 x compute(last block), i.e. all the prefill but the last block hidden behind the
transfer. Both strategies must produce identical tokens.

The module is pure logic (configuration, summaries, report) above the I/O (:func:`run`); run as
``python -m benchmarks.coldstart`` it is the client that each run starts on the worker host.
"""

import argparse
import asyncio
import json
import logging
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import TimeoutExpired

from benchmarks.checkout import module_argv
from benchmarks.cluster import EmulatedCluster, RequestedMode
from benchmarks.cpu import CpuSampler, CpuUsage
from benchmarks.processes import POLL_S, Processes, RunProcesses, cli, credentials_env, credentials_line, free_port
from benchmarks.runinfo import parse_counts, versions
from control_plane.planner.schedules import make_plan
from packager.manifest import read_manifest
from pipecast.agent.errors import LocalApiError
from pipecast.agent.plan_file import plan_file_data
from pipecast.agent.ratelimit import mbit_to_bytes_per_s
from pipecast.core.errors import PipecastError
from pipecast.core.fsutil import atomic_write
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.core.units import format_bytes
from pipecast.engine.engine import Engine
from pipecast.engine.kv_cache import PrefillCache, prefill_mask
from pipecast.engine.providers import PackageFolderProvider
from pipecast.serve.text import TextCodec

logger = logging.getLogger(__name__)

EXECUTE_WHILE_LOAD = "execute-while-load"
LOAD_THEN_SERVE = "load-then-serve"
STRATEGIES = (EXECUTE_WHILE_LOAD, LOAD_THEN_SERVE)
DEFAULT_PROMPT_TOKENS = (128, 512, 1024)
# The target: what is left after the transfer is at most this multiple of the last block's compute.
TARGET_FACTOR = 1.1
STORE, WORKER = "store", "worker"
AGENT_PORT, SERVE_PORT = 7070, 8000  # netns mode: each host has its own network stack
# The serving process's start-up (python, torch and transformers imports) may take this long on a busy
# machine; the agent's (lighter) start-up this long: t0 is that far after it is started.
SERVE_START_TIMEOUT_S = 180.0
AGENT_START_DELAY_S = 4.0
SEED_START_TIMEOUT_S = 60.0
RUN_DEADLINE_FACTOR = 4.0   # x S/B, plus the slack, before a run is declared stuck
RUN_DEADLINE_SLACK_S = 60.0
COMPUTE_REPEATS = 5
# Text the prompts are cut from (the package's tokenizer gives each length exactly).
PROMPT_TEXT = ("The history of computing is a story of ideas that took decades to become practical. "
               "Early machines filled rooms and consumed enormous power, yet their designers already asked how "
               "information could be stored, moved and transformed reliably. ")


class ColdStartBenchError(PipecastError):
    """The cold-start benchmark was misconfigured (the caller's fault) or a run failed (a process's)."""


# -- configuration -------------------------------------------------------------------------------------


def parse_prompt_tokens(text: str) -> tuple[int, ...]:
    """``"128,512"`` to ``(128, 512)``: distinct positive prompt lengths, in the order given."""
    return parse_counts(text, "--prompt-tokens", ColdStartBenchError)


@dataclass(frozen=True)
class ColdStartConfig:
    """What one ``pipecast bench coldstart`` measures."""

    package: Path
    prompt_tokens: tuple[int, ...] = DEFAULT_PROMPT_TOKENS
    link_mbit: float = 400.0
    repeat: int = 3
    max_tokens: int = 16
    mode: RequestedMode = "auto"
    threads: int = 1  # torch threads of the worker and of the compute measurement
    device: str = "cpu"  # where the worker and the compute measurement run (cpu, cuda, cuda:1 ...)
    #: The cluster's credentials, as a deployment has them: a master token per run for both agents (a static
    #: plan: they derive the data-plane key from it), and the client presents the serving key the worker's
    #: agent gives, as a router would. False: none.
    auth: bool = True

    def __post_init__(self) -> None:
        if not self.prompt_tokens or any(n < 1 for n in self.prompt_tokens):
            raise ColdStartBenchError(f"prompt lengths must be >= 1, got {self.prompt_tokens}")
        if self.link_mbit <= 0:
            raise ColdStartBenchError(f"the link rate must be > 0 Mbit/s, got {self.link_mbit}")
        if self.repeat < 1 or self.max_tokens < 1 or self.threads < 1:
            raise ColdStartBenchError("repeat, max_tokens and threads must be >= 1")


# -- results (pure) ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComputeProfile:
    """The prefill compute of one prompt length on this machine, fully loaded (medians of repeats)."""

    prompt_tokens: int
    all_seconds: float         # embeddings, every layer, head: what load-then-serve pays after the transfer
    last_block_seconds: float  # the last block's layers and the head: what execute-while-load cannot hide


@dataclass(frozen=True)
class RunResult:
    """One cold start: a fresh worker, one request at t0."""

    ttft_seconds: float       # t0 to the first token at the client
    transfer_seconds: float   # t0 to the worker agent's last block verified
    first_block_seconds: float
    tokens: tuple[int, ...]
    text: str
    serve_start_seconds: float  # the serving process's start-up (spawn to imports done), before t0
    cpu: CpuUsage

    @property
    def exposed_seconds(self) -> float:
        """What the request waited after the transfer ended."""
        return self.ttft_seconds - self.transfer_seconds

    def to_json(self) -> dict:
        return {"ttft_seconds": self.ttft_seconds, "transfer_seconds": self.transfer_seconds,
                "exposed_seconds": self.exposed_seconds, "first_block_seconds": self.first_block_seconds,
                "tokens": list(self.tokens), "text": self.text, "serve_start_seconds": self.serve_start_seconds,
                "cpu_mean_percent": self.cpu.mean_percent, "cpu_p95_percent": self.cpu.p95_percent,
                "cpu_saturated": self.cpu.saturated()}


def transfer_floor_seconds(package_bytes: int, link_mbit: float) -> float:
    """S/B: no block package crosses the link sooner."""
    return package_bytes / mbit_to_bytes_per_s(link_mbit)


@dataclass(frozen=True)
class StrategyResult:
    """A strategy at one prompt length: medians over its runs, beside its floor."""

    strategy: str
    prompt_tokens: int
    package_bytes: int
    link_mbit: float
    compute: ComputeProfile
    runs: tuple[RunResult, ...]

    @property
    def ttft_seconds(self) -> float:
        return statistics.median(r.ttft_seconds for r in self.runs)

    @property
    def transfer_seconds(self) -> float:
        return statistics.median(r.transfer_seconds for r in self.runs)

    @property
    def exposed_seconds(self) -> float:
        """Median wait after the transfer ended."""
        return statistics.median(r.exposed_seconds for r in self.runs)

    @property
    def compute_bound_seconds(self) -> float:
        """The compute no schedule can move before the transfer's end: the last block's, or all of it."""
        c = self.compute
        return c.last_block_seconds if self.strategy == EXECUTE_WHILE_LOAD else c.all_seconds

    @property
    def floor_seconds(self) -> float:
        """DESIGN 4: S/B + compute(last block) while loading; S/B + compute(all blocks) after loading. Not strict
        while loading: layers run as their own chunks land, so part of the last block's compute may come before
        the transfer's end (docs/benchmarks.md, "Cold start of one worker")."""
        return transfer_floor_seconds(self.package_bytes, self.link_mbit) + self.compute_bound_seconds

    @property
    def ratio_to_floor(self) -> float:
        return self.ttft_seconds / self.floor_seconds

    @property
    def hidden_fraction(self) -> float:
        """The share of the prefill compute that did not add to TTFT (it ran during the transfer)."""
        return max(0.0, 1.0 - max(self.exposed_seconds, 0.0) / self.compute.all_seconds)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.runs[0].tokens

    @property
    def identical_tokens(self) -> bool:
        """Every run generated the same tokens."""
        return all(r.tokens == self.tokens for r in self.runs)

    def to_json(self) -> dict:
        return {
            "strategy": self.strategy, "prompt_tokens": self.prompt_tokens, "ttft_seconds": self.ttft_seconds,
            "floor_seconds": self.floor_seconds, "ratio_to_floor": self.ratio_to_floor,
            "transfer_seconds": self.transfer_seconds,
            "transfer_floor_seconds": transfer_floor_seconds(self.package_bytes, self.link_mbit),
            "exposed_seconds": self.exposed_seconds, "compute_all_seconds": self.compute.all_seconds,
            "compute_last_block_seconds": self.compute.last_block_seconds,
            "hidden_fraction": self.hidden_fraction, "tokens": list(self.tokens),
            "identical_tokens_across_runs": self.identical_tokens, "text": self.runs[0].text,
            "cpu_mean_percent": statistics.median(r.cpu.mean_percent for r in self.runs),
            "runs": [r.to_json() for r in self.runs],
        }


@dataclass(frozen=True)
class ColdStartReport:
    """Everything one benchmark invocation measured."""

    meta: dict
    results: tuple[StrategyResult, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return {"meta": self.meta, "results": [r.to_json() for r in self.results]}


def verdict(ewl: StrategyResult, lts: StrategyResult) -> str:
    """One line on a prompt length: execute-while-load against the target and against the baseline."""
    target = TARGET_FACTOR * ewl.compute.last_block_seconds
    met = "met" if ewl.exposed_seconds <= target else "NOT met"
    same = ewl.tokens == lts.tokens and ewl.identical_tokens and lts.identical_tokens
    return (f"verdict {ewl.prompt_tokens} tokens: execute-while-load {ewl.ttft_seconds:.2f} s vs load-then-serve "
            f"{lts.ttft_seconds:.2f} s ({lts.ttft_seconds - ewl.ttft_seconds:+.2f} s saved, "
            f"{lts.ttft_seconds / ewl.ttft_seconds:.2f}x); after the transfer it waited {ewl.exposed_seconds:.3f} s "
            f"= {ewl.exposed_seconds / ewl.compute.last_block_seconds:.2f}x the last block's compute "
            f"(target <= {TARGET_FACTOR:g}x: {met}); {ewl.hidden_fraction:.0%} of the prefill hidden "
            f"(baseline {lts.hidden_fraction:.0%}); identical tokens: {'yes' if same else 'NO'}")


def format_report(report: ColdStartReport) -> str:
    """The figures as one table, then a verdict per prompt length."""
    meta = report.meta
    lines = [f"pipecast bench coldstart: {meta['model_name']} package {meta['package_id'][:12]} "
             f"({format_bytes(meta['package_bytes'])} in {meta['blocks']} blocks) over {meta['link_mbit']:g} Mbit/s: "
             f"S/B = {meta['transfer_floor_seconds']:.2f} s",
             f"{meta['cluster']}",
             credentials_line(meta.get("auth", True)),
             f"medians of {meta['repeat']} run(s); TTFT from t0 (the transfer's first byte, request sent then) to "
             f"the first streamed token of a {meta['max_tokens']}-token greedy completion on {meta['device']}, "
             f"{meta['threads']} torch thread(s); floor = S/B + the compute left after the transfer (last block / all "
             "blocks, measured here)",
             "",
             f"{'prompt':>6} {'strategy':<19} {'TTFT s':>7} {'floor s':>8} {'x floor':>8} {'transfer s':>11} "
             f"{'after s':>8} {'compute last/all s':>19} {'hidden':>7} {'CPU':>5}"]
    for r in report.results:
        cpu = statistics.median(run.cpu.mean_percent for run in r.runs)
        lines.append(f"{r.prompt_tokens:>6} {r.strategy:<19} {r.ttft_seconds:>7.3f} {r.floor_seconds:>8.3f} "
                     f"{r.ratio_to_floor:>8.3f} {r.transfer_seconds:>11.3f} {r.exposed_seconds:>8.3f} "
                     f"{f'{r.compute.last_block_seconds:.3f} / {r.compute.all_seconds:.3f}':>19} "
                     f"{r.hidden_fraction:>7.0%} {cpu:>4.0f}%")
    lines.append("")
    for n in dict.fromkeys(r.prompt_tokens for r in report.results):
        by = {r.strategy: r for r in report.results if r.prompt_tokens == n}
        if set(by) == set(STRATEGIES):
            lines.append(verdict(by[EXECUTE_WHILE_LOAD], by[LOAD_THEN_SERVE]))
    return "\n".join(lines)


def transfer_times(events: Sequence[dict], start_at: float, package_id: str, num_blocks: int) -> tuple[float, float]:
    """(first, last) block verified, in seconds after ``start_at``, from an agent's events.

    Raises :class:`ColdStartBenchError` when a block was never verified.
    """
    verified = {e["block"]: e["t"] for e in events
                if e.get("event") == "block_verified" and e.get("package") == package_id}
    missing = sorted(set(range(num_blocks)) - verified.keys())
    if missing:
        raise ColdStartBenchError(f"the worker agent did not verify block(s) {', '.join(map(str, missing))}")
    return min(verified.values()) - start_at, max(verified.values()) - start_at


# -- measuring the compute (torch, in this process) -----------------------------------------------------


def check_device(device: str) -> str:
    """The name of torch ``device`` (``cpu``, ``cuda``, ``cuda:1`` ...) on this machine; ColdStartBenchError
    when torch does not know it or this machine has no such device, before any worker starts."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ColdStartBenchError(f"--device {device}: not a torch device (cpu, cuda, cuda:1 ...)") from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type != "cuda":
        raise ColdStartBenchError(f"--device {device}: only cpu and cuda devices are benchmarked")
    if not torch.cuda.is_available():
        raise ColdStartBenchError(f"--device {device}: torch {torch.__version__} sees no CUDA device here")
    index = parsed.index or 0
    if index >= torch.cuda.device_count():
        raise ColdStartBenchError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.cuda.get_device_name(index)


def measure_compute(package: Path, prompts: Mapping[int, Sequence[int]], threads: int, device: str = "cpu",
                    repeat: int = COMPUTE_REPEATS) -> dict[int, ComputeProfile]:
    """The prefill compute of each prompt on ``device`` with ``threads`` torch threads, fully loaded, layer by
    layer as the engine runs it. Each prompt runs once to warm up, then ``repeat`` times; each figure is the
    median.
    """
    import torch

    profiles = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Engine(PackageFolderProvider(package), device=device) as engine, torch.inference_mode():
            engine.start().wait_loaded(timeout=600)
            last = engine.provider.manifest.blocks[-1]
            for n, prompt in prompts.items():
                times = [_time_prefill(engine.model, list(prompt), last.layer_start) for _ in range(repeat + 1)][1:]
                profiles[n] = ComputeProfile(n, statistics.median(t for t, _ in times),
                                             statistics.median(t for _, t in times))
    finally:
        torch.set_num_threads(previous)
    return profiles


def _time_prefill(model, prompt: list[int], last_block_start: int) -> tuple[float, float]:
    """Seconds of one prefill as the engine's scheduler runs it: in all, and from ``last_block_start``'s
    layer to the first token's logits."""
    import torch

    m = model
    start = time.perf_counter()
    ids = torch.tensor([prompt], device=m.device)
    positions = torch.arange(len(prompt), device=m.device).unsqueeze(0)
    hidden = m.embed(ids)
    rope = m.position_embeddings(hidden, positions)
    masks = {w: prefill_mask(len(prompt), w, m.device) for w in set(m.skeleton.windows)}
    cache = PrefillCache()
    for layer in range(m.num_layers):
        if layer == last_block_start:
            if m.device.type == "cuda":  # the earlier layers' kernels finish first: they are not the last block's
                torch.cuda.synchronize(m.device)
            last_start = time.perf_counter()
        hidden = m.run_layer(layer, hidden, position_embeddings=rope, position_ids=positions,
                             mask=masks[m.window(layer)], cache=cache)
    m.head(hidden, last_only=True)[:, -1].float().cpu()
    end = time.perf_counter()
    return end - start, end - last_start


def make_prompts(package: Path, lengths: Sequence[int]) -> dict[int, list[int]]:
    """A prompt of exactly each length, cut from English text by the package's tokenizer."""
    names = [f.path for f in read_manifest(package).files]
    codec = TextCodec.from_files(lambda name: (package / name).read_bytes(), names, f"package {package}")
    ids = codec.encode(PROMPT_TEXT)
    return {n: (ids * (n // len(ids) + 1))[:n] for n in lengths}


# -- the client, on the worker host (python -m benchmarks.coldstart) ------------------------------------


async def _wait_serve_started(http, url: str, timeout_s: float) -> float:
    """When the worker at ``url`` had started (time.time()); ColdStartBenchError after ``timeout_s``.

    pipecast's worker has started once its /health JSON leaves stage ``starting`` (its imports done); vLLM's
    /health answers 200 with an empty body once its model is loaded (nothing listens before)."""
    import aiohttp

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            async with http.get(f"{url}/health") as response:
                body = await response.read()
                if json.loads(body).get("stage") != "starting" if body else response.status == 200:
                    return time.time()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass  # not listening yet
        await asyncio.sleep(POLL_S)
    raise ColdStartBenchError(f"the worker at {url} did not start within {timeout_s:g} s")


async def _wait_path(path: Path, deadline: float, what: str) -> None:
    """Until ``path`` exists; ColdStartBenchError naming ``what`` after ``deadline`` (``time.time``)."""
    while not path.exists():
        if time.time() > deadline:
            raise ColdStartBenchError(f"no {what} at {path} in time")
        await asyncio.sleep(POLL_S)


async def _serving_headers(agent_socket: Path, timeout_s: float) -> dict[str, str]:
    """The headers presenting the serving key the agent at ``agent_socket`` gives, its socket waited for."""
    from pipecast.agent.local_client import LocalAgentClient
    from pipecast.core.credentials import serving_headers

    deadline = time.time() + timeout_s
    await _wait_path(agent_socket, deadline, "socket of the worker's agent")
    with LocalAgentClient(agent_socket) as agent:
        return serving_headers(await asyncio.to_thread(agent.serving_key, max(deadline - time.time(), 1.0)))


async def _wait_start_file(path: Path, deadline: float) -> float:
    """t0 once the benchmark has written it to ``path``."""
    await _wait_path(path, deadline, "t0 (the benchmark did not start the transfer)")
    return float(path.read_text())


def _say(event: str, **fields) -> None:
    """One JSON line on stdout for whoever watches the client live (the demo prints the text as it comes)."""
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


async def _client(url: str, model: str, ready_file: Path, start_file: Path, prompt: list[int], max_tokens: int,
                  timeout_s: float, ready_timeout_s: float = SERVE_START_TIMEOUT_S,
                  agent_socket: Path | None = None) -> dict:
    """Wait for the worker to have started, say so in ``ready_file``, read t0 from ``start_file``, send the
    prompt at t0 and time its stream (each piece also goes to stdout, see :func:`_say`). With
    ``agent_socket`` (the worker's node agent) the request presents the cluster's serving key, as the
    router's would."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=timeout_s)
    # Asked for beside the waits below: the agent may start after the worker (bench coldstart starts it
    # once the worker is up, listening by t0), or run already (the demo).
    key = asyncio.create_task(_serving_headers(agent_socket, ready_timeout_s + SEED_START_TIMEOUT_S)) \
        if agent_socket is not None else None
    async with aiohttp.ClientSession(timeout=timeout) as http:
        started = await _wait_serve_started(http, url, ready_timeout_s)
        ready_file.write_text(f"{started:.6f}")
        start_at = await _wait_start_file(start_file, time.time() + SEED_START_TIMEOUT_S)
        headers = await key if key is not None else {}
        await asyncio.sleep(max(start_at - time.time(), 0.0))
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "return_token_ids": True}
        first = None
        tokens, texts = [], []
        sent = time.time()
        _say("sent")
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                return {"error": f"HTTP {response.status}: {await response.text()}"}
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    return {"error": event["error"]["message"]}
                choice = event["choices"][0]
                if choice["token_ids"] and first is None:
                    first = time.time()
                tokens += choice["token_ids"]
                texts.append(choice["text"])
                _say("piece", text=choice["text"], token_ids=choice["token_ids"])
    return {"started_at": started, "start_at": start_at, "sent_at": sent, "first_token_at": first, "tokens": tokens,
            "text": "".join(texts)}


def client_argv(url: str, model: str, ready_file: Path, start_file: Path, prompt_file: Path, max_tokens: int,
                timeout_s: float, out: Path, ready_timeout_s: float = SERVE_START_TIMEOUT_S,
                agent_socket: Path | None = None) -> list[str]:
    """The command line of a client (see :func:`client_main`) to start on a worker host; with
    ``agent_socket`` (the worker's agent, running already) its request presents the cluster's serving key."""
    return module_argv("benchmarks.coldstart", "--url", url, "--model", model, "--ready-file", ready_file,
                       "--start-file", start_file, "--prompt", prompt_file, "--max-tokens", max_tokens, "--timeout",
                       f"{timeout_s:g}", "--ready-timeout", f"{ready_timeout_s:g}", "--out", out,
                       *(["--agent-socket", agent_socket] if agent_socket is not None else []))


def write_start_file(path: Path, start_at: float) -> None:
    """Tell waiting clients t0 (``time.time()``); written whole or not at all, as they poll for it."""
    atomic_write(path, f"{start_at:.6f}".encode())


def client_main(argv: Sequence[str] | None = None) -> int:
    """The client of one run (spawned on the worker host): writes its timings as JSON to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coldstart", description=client_main.__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True, help="the model name or package id the worker serves")
    parser.add_argument("--ready-file", type=Path, required=True, help="written once the worker has started")
    parser.add_argument("--start-file", type=Path, required=True, help="t0 (time.time()), written by the benchmark")
    parser.add_argument("--prompt", type=Path, required=True, help="JSON list of token ids")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True, help="longest silence from the worker, seconds")
    parser.add_argument("--ready-timeout", type=float, default=SERVE_START_TIMEOUT_S,
                        help="how long the worker may take to start, seconds")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--agent-socket", type=Path,
                        help="the worker's node agent: the request presents the cluster's serving key it gives")
    args = parser.parse_args(argv)
    import aiohttp

    prompt = json.loads(args.prompt.read_text())
    try:
        result = asyncio.run(_client(args.url, args.model, args.ready_file, args.start_file, prompt, args.max_tokens,
                                     args.timeout, args.ready_timeout, args.agent_socket))
    except (ColdStartBenchError, LocalApiError) as exc:
        result = {"error": str(exc)}
    except (aiohttp.ClientError, TimeoutError) as exc:  # the worker went away or fell silent
        result = {"error": f"worker {args.url}: {type(exc).__name__}: {exc}"}
    args.out.write_text(json.dumps(result))
    return 0 if "error" not in result else 1


# -- running (I/O) -------------------------------------------------------------------------------------


@dataclass
class _Bench:
    """The cluster of one benchmark invocation, its seed agent and what the runs share."""

    cluster: EmulatedCluster
    config: ColdStartConfig
    workdir: Path
    sockets: Path             # short paths for unix sockets (a socket path has ~100 characters at most)
    package_id: str
    package_bytes: int
    num_blocks: int
    store_address: str
    master: str  # the run's master token ("": auth off)
    runs: int = 0

    def address(self, host: str, port: int) -> str:
        return f"{self.cluster.address(host)}:{port}"

    def port(self, base: int) -> int:
        """A port for this run: netns hosts have their own stacks; loopback hosts share this one."""
        return base + self.runs if self.cluster.mode == "netns" else free_port(self.cluster.address(WORKER))

    def write_plan(self, path: Path, worker_address: str) -> None:
        """The static plan of a run: the worker fetches every block from the store."""
        plan = make_plan("unicast", [STORE], [WORKER], self.num_blocks)
        path.write_text(json.dumps(plan_file_data(plan, self.package_id, {STORE: self.store_address,
                                                                           WORKER: worker_address})))



def start_seed(cluster: EmulatedCluster, package: Path, folder: Path,
               env: dict[str, str] | None = None) -> tuple[RunProcesses, str]:
    """The store's agent seeding ``package`` (``env`` on top of this process's: its credentials); returns it
    once it listens, with its address."""
    port = AGENT_PORT if cluster.mode == "netns" else free_port(cluster.address(STORE))
    address = f"{cluster.address(STORE)}:{port}"
    seed = RunProcesses(cluster, folder, ColdStartBenchError)
    seed.spawn(STORE, STORE, cli("agent", "--node-id", STORE, "--listen", address, "--seed", package,
                                 "--events", seed.events_path(STORE)), env=env)
    try:
        seed.wait_event([STORE], "listening", time.time() + SEED_START_TIMEOUT_S, "the store's agent starting")
    except ColdStartBenchError:
        seed.stop()
        raise
    return seed, address


def _wait_file(path: Path, run: Processes, deadline: float, what: str, log: str) -> None:
    """Until ``path`` exists; ColdStartBenchError with the log tail of a process that exited (the client's
    own when it is the one that died), or with ``log``'s when time runs out."""
    while not path.exists():
        try:
            run.check_alive(list(run.procs))
        except ColdStartBenchError as exc:
            raise ColdStartBenchError(f"{what}: {exc}") from None
        if time.monotonic() > deadline:
            raise ColdStartBenchError(f"{what}:\n--- last lines of {run.log_path(log)}:\n{run.log_tail(log)}")
        time.sleep(POLL_S)


def run_once(bench: _Bench, strategy: str, prompt: list[int]) -> RunResult:
    """One cold start of ``strategy`` (see the module docstring).

    The worker starts first and waits for its agent's socket; once the worker has imported its code, the
    agent is started with t0 a moment ahead, and the client (already waiting) sends the prompt at t0.
    """
    c = bench.config
    bench.runs += 1
    folder = bench.workdir / f"run-{bench.runs:03d}-{strategy}-{len(prompt)}"
    folder.mkdir(parents=True)
    floor = transfer_floor_seconds(bench.package_bytes, c.link_mbit)
    agent_address, serve_port = bench.address(WORKER, bench.port(AGENT_PORT)), bench.port(SERVE_PORT)
    url = f"http://{bench.cluster.address(WORKER)}:{serve_port}"
    socket = bench.sockets / f"agent-{bench.runs}.sock"
    answer_path = folder / "client.json"
    ready, start = folder / "serve.ready", folder / "t0"
    (folder / "prompt.json").write_text(json.dumps(prompt))
    bench.write_plan(folder / "plan.json", agent_address)

    spawned = time.time()
    run = RunProcesses(bench.cluster, folder, ColdStartBenchError)
    serve = cli("serve", bench.package_id, "--agent-socket", socket, "--host", bench.cluster.address(WORKER),
                "--port", serve_port, "--agent-timeout", f"{SERVE_START_TIMEOUT_S + SEED_START_TIMEOUT_S:.0f}",
                "--device", c.device)
    threads = {"OMP_NUM_THREADS": str(c.threads), "MKL_NUM_THREADS": str(c.threads)}
    run.spawn("serve", WORKER, serve + (["--wait-full-load"] if strategy == LOAD_THEN_SERVE else []), env=threads)
    client = run.spawn("client", WORKER, client_argv(url, bench.package_id, ready, start, folder / "prompt.json",
                                                     c.max_tokens, RUN_DEADLINE_FACTOR * floor + RUN_DEADLINE_SLACK_S,
                                                     answer_path, agent_socket=socket))
    try:
        _wait_file(ready, run, time.monotonic() + SERVE_START_TIMEOUT_S, "the worker did not start", "serve")
        start_at = time.time() + AGENT_START_DELAY_S
        run.spawn("agent", WORKER, cli("agent", "--node-id", WORKER, "--plan", folder / "plan.json",
                                       "--events", run.events_path("agent"), "--local-socket", socket,
                                       "--start-at", f"{start_at:.6f}"), env=credentials_env(bench.master))
        write_start_file(start, start_at)
        with CpuSampler() as cpu:
            try:
                client.wait(start_at - time.time() + RUN_DEADLINE_FACTOR * floor + RUN_DEADLINE_SLACK_S)
            except TimeoutExpired:
                raise ColdStartBenchError(f"{strategy}, {len(prompt)} tokens: no answer in time; serve log:\n"
                                          f"{run.log_tail('serve')}") from None
        answer = (json.loads(answer_path.read_text()) if answer_path.exists()
                  else {"error": run.log_tail("client")})
    finally:
        run.stop()
    if "error" in answer:
        raise ColdStartBenchError(f"{strategy}, {len(prompt)} tokens: {answer['error']}\n--- last lines of the "
                                  f"worker's log:\n{run.log_tail('serve')}")
    if answer["first_token_at"] is None:
        raise ColdStartBenchError(f"{strategy}, {len(prompt)} tokens: the worker answered without any token")
    agent_events = run.events("agent")
    listening = next((e["t"] for e in agent_events if e["event"] == "listening"), None)
    if listening is None or listening > start_at:
        raise ColdStartBenchError(f"the worker's agent was not listening by t0 ({AGENT_START_DELAY_S:g} s after "
                                  f"it was started): the machine is too busy; see {run.log_path('agent')}")
    first, last = transfer_times(agent_events, start_at, bench.package_id, bench.num_blocks)
    return RunResult(ttft_seconds=answer["first_token_at"] - start_at, transfer_seconds=last,
                     first_block_seconds=first, tokens=tuple(answer["tokens"]), text=answer["text"],
                     serve_start_seconds=answer["started_at"] - spawned, cpu=cpu.usage())


def run(config: ColdStartConfig, workdir: Path, progress: Progress = NO_PROGRESS) -> ColdStartReport:
    """Measure both strategies at every prompt length; logs, events and answers go under ``workdir``."""
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest = read_manifest(config.package)
    prompts = make_prompts(config.package, config.prompt_tokens)
    device_name = check_device(config.device)
    progress(f"measuring the prefill compute of {', '.join(map(str, config.prompt_tokens))} tokens, fully loaded, "
             f"on {config.device} ({device_name}), {config.threads} thread(s)")
    compute = measure_compute(config.package, prompts, config.threads, config.device)
    for p in compute.values():
        progress(f"  {p.prompt_tokens} tokens: all blocks {p.all_seconds:.3f} s, last block "
                 f"{p.last_block_seconds:.3f} s")
    runs: dict[tuple[str, int], list[RunResult]] = {(s, n): [] for n in config.prompt_tokens for s in STRATEGIES}
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with EmulatedCluster([STORE, WORKER], config.link_mbit, mode=config.mode) as cluster, \
            tempfile.TemporaryDirectory(prefix="pc-sock-") as sockets:
        progress(cluster.describe())
        master = secrets.token_hex(16) if config.auth else ""
        seed, store_address = start_seed(cluster, config.package, workdir, credentials_env(master))
        try:
            bench = _Bench(cluster, config, workdir, Path(sockets), manifest.package_id, manifest.total_bytes,
                           len(manifest.blocks), store_address, master)
            progress.start(config.repeat * len(config.prompt_tokens) * len(STRATEGIES), "cold starts", unit="run")
            for attempt in range(1, config.repeat + 1):
                for n in config.prompt_tokens:
                    for strategy in STRATEGIES:
                        result = run_once(bench, strategy, prompts[n])
                        runs[strategy, n].append(result)
                        progress.advance()
                        progress(f"run {attempt}/{config.repeat} {n} tokens {strategy}: TTFT "
                                 f"{result.ttft_seconds:.3f} s, transfer {result.transfer_seconds:.3f} s, after it "
                                 f"{result.exposed_seconds:.3f} s; "
                                 f"{result.cpu.summary()}")
        finally:
            seed.stop()
        meta = {
            "benchmark": "coldstart", "versions": versions("torch", "transformers"), "cpu_cores": os.cpu_count(),
            "mode": cluster.mode,
            "mode_reason": cluster.mode_reason, "cluster": cluster.describe(), "link_mbit": config.link_mbit,
            "package_id": manifest.package_id, "package_path": str(config.package), "model_name": manifest.model_name,
            "package_bytes": manifest.total_bytes, "blocks": len(manifest.blocks),
            "transfer_floor_seconds": transfer_floor_seconds(manifest.total_bytes, config.link_mbit),
            "repeat": config.repeat, "max_tokens": config.max_tokens, "prompt_tokens": list(config.prompt_tokens),
            "strategies": list(STRATEGIES), "target_factor": TARGET_FACTOR, "threads": config.threads,
            "device": config.device, "device_name": device_name, "auth": config.auth,
            "compute": {n: vars(p) for n, p in compute.items()},
            "started_at": started_at,
        }
    results = tuple(StrategyResult(s, n, manifest.total_bytes, config.link_mbit, compute[n], tuple(runs[s, n]))
                    for n in config.prompt_tokens for s in STRATEGIES)
    return ColdStartReport(meta=meta, results=results)


if __name__ == "__main__":
    sys.exit(client_main())
