"""Engine benchmarks: decode throughput against concurrency, time to first token while blocks arrive,
and memory against package size. ``python -m benchmarks.engine_measure PACKAGE`` prints all three;
``benchmarks/`` calls the functions.

Figures from a shared machine are noisy: compare rows of one run (ratios), not absolute numbers.
"""

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipecast.agent.ratelimit import mbit_to_bytes_per_s
from pipecast.engine.engine import Engine
from pipecast.engine.memory import MemoryReport, process_memory
from pipecast.engine.providers import DelayedProvider, PackageFolderProvider
from pipecast.engine.sampling import SamplingParams


@dataclass(frozen=True)
class ThroughputResult:
    """Requests run together, all generating ``max_tokens`` tokens."""

    concurrency: int
    tokens: int
    seconds: float
    decode_steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def throughput(package: Path | str, *, concurrencies: Sequence[int] = (1, 4, 16), prompt_tokens: int = 16,
               max_tokens: int = 32, device: str = "cpu", seed: int = 0) -> list[ThroughputResult]:
    """Tokens/s with ``c`` concurrent greedy requests, for each ``c`` (one engine, fully loaded first)."""
    results = []
    with Engine(PackageFolderProvider(package), device=device, max_batch=max(concurrencies)).start() as engine:
        engine.wait_loaded(timeout=600)
        vocab = engine.model.vocab_size
        engine.generate(_prompts(1, prompt_tokens, vocab, seed)[0], SamplingParams(max_tokens=2))  # warm-up
        params = SamplingParams(max_tokens=max_tokens)  # no stop tokens: every request runs max_tokens
        for c in concurrencies:
            steps0 = engine.scheduler.steps
            start = time.perf_counter()
            streams = engine.submit_many(_prompts(c, prompt_tokens, vocab, seed + c), params)
            tokens = sum(len(s.result(timeout=600)) for s in streams)
            seconds = time.perf_counter() - start
            results.append(ThroughputResult(c, tokens, seconds, engine.scheduler.steps - steps0))
    return results


@dataclass(frozen=True)
class TtftResult:
    """Time to first token of one request submitted when loading starts, blocks arriving at a link rate."""

    bytes_per_s: float
    package_bytes: int
    execute_while_load_s: float
    load_then_serve_s: float

    @property
    def floor_s(self) -> float:
        """No token can come before the whole model has crossed the link: S/B."""
        return self.package_bytes / self.bytes_per_s


def ttft_while_loading(package: Path | str, *, bytes_per_s: float, prompt_tokens: int = 64,
                       device: str = "cpu", seed: int = 0) -> TtftResult:
    """First-token latency with blocks arriving in order at ``bytes_per_s``: layer-wise execution while
    loading against waiting for the whole model first (same link, same prompt, one run each)."""
    times = {}
    for mode in ("execute_while_load", "load_then_serve"):
        provider = DelayedProvider.at_bandwidth(PackageFolderProvider(package), bytes_per_s)
        with Engine(provider, device=device) as engine:
            prompt = _prompts(1, prompt_tokens, engine.model.vocab_size, seed)[0]
            start = time.perf_counter()
            engine.start()
            if mode == "load_then_serve":
                engine.wait_loaded(timeout=600)
            stream = engine.submit(prompt, SamplingParams(max_tokens=1))
            stream.result(timeout=600)
            times[mode] = time.perf_counter() - start
    return TtftResult(bytes_per_s, provider.manifest.total_bytes, **{f"{k}_s": v for k, v in times.items()})


def memory_report(package: Path | str, *, device: str = "cpu") -> MemoryReport:
    """RSS growth (and on a GPU, device memory) while loading ``package`` and generating a few tokens, against the
    package's size.

    The engine is built (imports, empty model) before the first reading so only the load is counted.
    """
    engine = Engine(PackageFolderProvider(package), device=device)
    on_device = engine.model.device.type == "cuda"
    # The peak reset: an earlier peak of the process (a benchmark run before) would count as the load's.
    before, device_before = process_memory(reset_peak=True), _device_allocated(engine) if on_device else 0
    with engine.start():
        engine.wait_loaded(timeout=600)
        engine.generate(_prompts(1, 16, engine.model.vocab_size, 0)[0], SamplingParams(max_tokens=8))
        after, kv_bytes = process_memory(), engine.scheduler.kv.nbytes  # closing frees the KV cache
        device_bytes = _device_allocated(engine) - device_before if on_device else None
    return MemoryReport(engine.provider.manifest.total_bytes, kv_bytes, before, after, device_bytes)


def _device_allocated(engine: Engine) -> int:
    """Bytes torch holds allocated on the engine's CUDA device, once its work so far is done."""
    import torch

    torch.cuda.synchronize(engine.model.device)
    return torch.cuda.memory_allocated(engine.model.device)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_measure", description=__doc__)
    parser.add_argument("package", type=Path)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--link-mbit", type=float, default=400.0, help="link rate for the TTFT benchmark")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    print(memory_report(args.package, device=args.device))
    base = None
    for r in throughput(args.package, concurrencies=args.concurrency, prompt_tokens=args.prompt_tokens,
                        max_tokens=args.max_tokens, device=args.device):
        base = base or r.tokens_per_s
        print(f"concurrency {r.concurrency:3d}: {r.tokens_per_s:9.1f} tokens/s ({r.tokens_per_s / base:.2f}x "
              f"concurrency {args.concurrency[0]}), {r.tokens} tokens in {r.seconds:.2f} s, "
              f"{r.decode_steps} decode steps")
    t = ttft_while_loading(args.package, bytes_per_s=mbit_to_bytes_per_s(args.link_mbit), device=args.device)
    print(f"TTFT at {args.link_mbit:g} Mbit/s (floor S/B {t.floor_s:.3f} s): execute-while-load "
          f"{t.execute_while_load_s:.3f} s ({t.execute_while_load_s / t.floor_s:.2f}x floor), load-then-serve "
          f"{t.load_then_serve_s:.3f} s ({t.load_then_serve_s / t.floor_s:.2f}x floor)")


if __name__ == "__main__":
    main()
