"""``pipecast bench hops``: what a token costs through a cross-node pipeline against one node.

Real processes on loopback: ``max(--stages)`` ``pipecast serve`` workers of the same package folder (one
torch thread each, the whole model loaded), and this process as the client. For each stage count k it
sends ``--repeat`` streamed greedy requests to the first worker with a route that splits the layers into
k near-equal ranges over k workers (k = 1: no route, the worker alone) and records the time to the first
token and the mean time between two tokens after it. The difference to k = 1, divided by the k - 1 hops,
is the cost of one hop per token: a ``POST /v1/stage`` with the hidden state, the answer back, and the
stage's session bookkeeping. No link is shaped: this is the hops' own cost, not a transfer.

The module is pure logic (configuration, figures, report) above :func:`run`, which does the I/O.
"""

import asyncio
import json
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from subprocess import PIPE

from benchmarks.processes import Processes, cli
from benchmarks.runinfo import versions
from packager.manifest import read_manifest
from pipecast.core.errors import PipecastError

START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 120.0


class HopsBenchError(PipecastError):
    """The hops benchmark was misconfigured (the caller's fault) or a worker failed."""


@dataclass(frozen=True)
class HopsConfig:
    package: Path
    stages: tuple[int, ...] = (1, 2, 4, 8)  # starting with 1 (the baseline)
    prompt_tokens: int = 16
    max_tokens: int = 32
    repeat: int = 5


@dataclass(frozen=True)
class HopsResult:
    stages: int
    ttft_seconds: float          # median over the repeats
    per_token_seconds: float     # median of each request's mean time between two tokens
    hop_seconds: float | None    # (per token - one node's) / (stages - 1)
    tokens_identical: bool       # every request's tokens equal one node's


@dataclass
class HopsReport:
    meta: dict
    results: list[HopsResult] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"meta": self.meta, "results": [asdict(r) for r in self.results]}


def split_layers(num_layers: int, stages: int) -> list[range]:
    """``num_layers`` in ``stages`` consecutive near-equal ranges."""
    if not 1 <= stages <= num_layers:
        raise HopsBenchError(f"--stages: {stages} stages for a model of {num_layers} layers")
    cuts = [round(i * num_layers / stages) for i in range(stages + 1)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def format_report(report: HopsReport) -> str:
    m = report.meta
    lines = [f"hops: {m['model_name']} ({m['num_layers']} layers), {m['prompt_tokens']}-token prompt, "
             f"{m['max_tokens']} tokens out, {m['repeat']} requests per stage count; one torch thread per worker, "
             "loopback, no shaping",
             f"{'stages':>6} {'TTFT ms':>8} {'ms/token':>9} {'ms/hop':>7} {'same tokens':>11}"]
    for r in report.results:
        hop = "-" if r.hop_seconds is None else f"{r.hop_seconds * 1000:.1f}"
        lines.append(f"{r.stages:>6} {r.ttft_seconds * 1000:>8.1f} {r.per_token_seconds * 1000:>9.1f} {hop:>7} "
                     f"{'yes' if r.tokens_identical else 'NO':>11}")
    return "\n".join(lines)


async def _one(http, url: str, body: dict, headers: dict) -> tuple[float, float, list[int]]:
    """One streamed request: (TTFT, mean time between two tokens after the first, tokens)."""
    import aiohttp

    sent = time.monotonic()
    times, tokens = [], []
    async with http.post(f"{url}/v1/completions", json=body, headers=headers,
                         timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as answer:
        if answer.status != 200:
            raise HopsBenchError(f"a request was answered {answer.status}: {(await answer.text())[:300]}")
        async for line in answer.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise HopsBenchError(f"a request failed mid-stream: {event['error']}")
                ids = event["choices"][0].get("token_ids") or []
                if ids:
                    times.append(time.monotonic() - sent)
                    tokens += ids
    if len(times) < 2:
        raise HopsBenchError(f"a request answered {len(tokens)} tokens; the figure needs 2 or more")
    return times[0], (times[-1] - times[0]) / (len(times) - 1), tokens


async def _measure(urls: list[str], config: HopsConfig, model: str, num_layers: int) -> list[HopsResult]:
    import aiohttp

    from pipecast.serve.pipeline import PIPELINE_HEADER, Hop, route_header

    vocab = json.loads((config.package / "config.json").read_text())["vocab_size"]
    body = {"model": model, "prompt": [(11 + 53 * i) % vocab for i in range(config.prompt_tokens)],
            "max_tokens": config.max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}
    results: list[HopsResult] = []
    reference: list[int] = []  # one worker's tokens
    async with aiohttp.ClientSession() as http:
        for k in config.stages:  # the first is 1: one worker alone, the baseline
            route = [Hop(url, layers) for url, layers in zip(urls, split_layers(num_layers, k))]
            headers = {PIPELINE_HEADER: route_header(route)} if k > 1 else {}
            await _one(http, urls[0], body, headers)  # warm-up: each process's first forward pass
            runs = [await _one(http, urls[0], body, headers) for _ in range(config.repeat)]
            reference = reference or runs[0][2]
            per_token = statistics.median(r[1] for r in runs)
            hop = (per_token - results[0].per_token_seconds) / (k - 1) if results else None
            results.append(HopsResult(k, statistics.median(r[0] for r in runs), per_token, hop,
                                      all(r[2] == reference for r in runs)))
    return results


def run(config: HopsConfig, workdir: Path, progress=lambda line: None) -> HopsReport:
    """Start the workers, measure every stage count, stop them."""
    manifest = read_manifest(config.package)
    num_layers = manifest.num_layers
    if config.stages[0] != 1:
        raise HopsBenchError(f"--stages must start with 1 (one worker, the baseline), got {config.stages}")
    for k in config.stages:
        split_layers(num_layers, k)
    count = max(config.stages)
    procs = Processes(Path(workdir), HopsBenchError)
    # One torch thread each; no agent from this machine's settings: each worker loads the package folder.
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PIPECAST_AGENT_LOCAL_SOCKET": ""}
    try:
        urls = []
        for i in range(count):
            name = f"w{i + 1}"
            proc = procs.launch(name, cli("serve", config.package, "--host", "127.0.0.1", "--port", 0,
                                          verbose=False), env=env, stdout=PIPE)
            line = proc.stdout.readline().decode(errors="replace")
            match = re.fullmatch(r"pipecast serve: listening on (http://\S+)\n", line)
            if not match:
                raise HopsBenchError(f"worker {name} did not start: {line!r}\n{procs.log_tail(name)}")
            urls.append(match.group(1))
        progress(f"{count} workers listening; waiting for their models")
        asyncio.run(_wait_ready(urls))
        progress("measuring")
        results = asyncio.run(_measure(urls, config, manifest.model_name, num_layers))
    finally:
        procs.stop()
    meta = {"benchmark": "hops", "versions": versions(), "cpu_cores": os.cpu_count(),
            "load_average_at_start": os.getloadavg()[0], "model_name": manifest.model_name,
            "num_layers": num_layers, "prompt_tokens": config.prompt_tokens, "max_tokens": config.max_tokens,
            "repeat": config.repeat, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return HopsReport(meta, results)


async def _wait_ready(urls: list[str]) -> None:
    import aiohttp

    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        for url in urls:
            while True:
                try:
                    async with http.get(f"{url}/health") as answer:
                        if (await answer.json()).get("status") == "ready":
                            break
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise HopsBenchError(f"worker {url} not ready within {START_TIMEOUT_S:g} s")
                await asyncio.sleep(0.2)

