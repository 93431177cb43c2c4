"""``pipecast bench engine``: the engine fully loaded: decode throughput against concurrency, and memory
against the package's size (the measurements are :mod:`benchmarks.engine_measure`'s; this module reports them).

Throughput is judged against concurrency 1 measured in the same run (the continuous batching speed-up),
each figure the median of ``repeat`` runs on ``threads`` torch threads (one by default: on a shared machine
a larger thread pool stalls for whole seconds whenever another process takes a core); memory against the
package's size: on CPU the weights are views of the block files, so the private (anonymous) memory should
grow by little more than the KV cache, not by a copy of the weights.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.engine_measure import ThroughputResult
from benchmarks.engine_measure import memory_report, throughput
from packager.manifest import read_manifest
from pipecast.core.units import format_bytes
from pipecast.engine.memory import MemoryReport


@dataclass(frozen=True)
class EngineReport:
    """Everything one ``pipecast bench engine`` measured."""

    package: Path
    model_name: str
    prompt_tokens: int
    max_tokens: int
    threads: int
    repeat: int
    throughput: tuple[ThroughputResult, ...]  # the median run of each concurrency
    memory: MemoryReport

    def to_json(self) -> dict:
        m = self.memory
        return {
            "meta": {"benchmark": "engine", "package": str(self.package), "model_name": self.model_name,
                     "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens, "threads": self.threads,
                     "repeat": self.repeat},
            "throughput": [{"concurrency": r.concurrency, "tokens": r.tokens, "seconds": r.seconds,
                            "tokens_per_s": r.tokens_per_s, "decode_steps": r.decode_steps} for r in self.throughput],
            "memory": {"package_bytes": m.package_bytes, "kv_cache_bytes": m.kv_cache_bytes,
                       "peak_growth_bytes": m.peak_growth, "anon_growth_bytes": m.anon_growth,
                       "peak_rss_bytes": m.after.peak_rss, "peak_growth_to_package": m.peak_growth / m.package_bytes,
                       "anon_growth_to_package": m.anon_growth / m.package_bytes},
        }


def median_run(runs: Sequence[ThroughputResult]) -> ThroughputResult:
    """The run of median tokens/s (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r.tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


def run(package: Path, *, concurrencies: Sequence[int], prompt_tokens: int, max_tokens: int, device: str,
        threads: int, repeat: int) -> EngineReport:
    """Measure memory first (the process's peak RSS must be the load's, not the batch runs'), then
    throughput at each concurrency, ``repeat`` times."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        memory = memory_report(package, device=device)
        runs = [throughput(package, concurrencies=concurrencies, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                           device=device) for _ in range(repeat)]
    finally:
        torch.set_num_threads(previous)
    medians = tuple(median_run([r[i] for r in runs]) for i in range(len(concurrencies)))
    return EngineReport(Path(package), read_manifest(package).model_name, prompt_tokens, max_tokens, threads, repeat,
                        medians, memory)


def format_report(report: EngineReport) -> str:
    """Tokens/s per concurrency against concurrency 1, then memory against the package."""
    base = report.throughput[0]
    lines = [f"pipecast bench engine: {report.model_name} ({format_bytes(report.memory.package_bytes)}), "
             f"{report.prompt_tokens}-token prompts, {report.max_tokens} tokens each, greedy, {report.threads} torch "
             f"thread(s); median of {report.repeat} run(s)",
             f"{'concurrency':>11} {'tokens/s':>9} {f'x c={base.concurrency}':>7} {'tokens':>7} {'seconds':>8} "
             f"{'decode steps':>13}"]
    for r in report.throughput:
        lines.append(f"{r.concurrency:>11} {r.tokens_per_s:>9.1f} {r.tokens_per_s / base.tokens_per_s:>7.2f} "
                     f"{r.tokens:>7} {r.seconds:>8.2f} {r.decode_steps:>13}")
    lines.append(f"memory: {report.memory}")
    return "\n".join(lines)
