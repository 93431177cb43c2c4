"""``pipecast bench pack``: pack and block-open throughput against their baselines, in one run.

- pack throughput vs ``cp`` of the same shard files (the baseline a user would run; not a floor: pack was
  measured faster than cp on this machine);
- peak RSS of the pack process vs the checkpoint size (packing streams through a small buffer);
- block-open throughput (map every block, check its digest, view its tensors) vs
  ``safetensors.torch.load_file`` on the original shards.
The checkpoint is synthetic (Llama tensor names, random bytes), written once under the work folder.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from packager.package import Package
from packager.safetensors_format import build_header
from pipecast.core.units import format_bytes

_LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                  "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")


# What checking a block's digests costs (packager.package.check_block_bytes): a good block is hashed once, on
# every core; its chunk digests only for a bad one, to name what is wrong.
VERIFY_NOTE = "BLAKE3 of each block, one pass on all cores"


@dataclass
class PackBenchResult:
    checkpoint_bytes: int
    cp_seconds: float
    pack_seconds: float
    pack_peak_rss_bytes: int
    open_seconds: float
    open_verified_seconds: float
    safetensors_load_seconds: float

    @property
    def pack_vs_cp(self) -> float:
        return self.cp_seconds / self.pack_seconds

    @property
    def open_vs_safetensors(self) -> float:
        return self.safetensors_load_seconds / self.open_seconds


def write_synthetic_checkpoint(path: Path, total_bytes: int, shards: int = 4) -> Path:
    """A Llama-named F16 checkpoint of about ``total_bytes`` in ``shards`` shards (random bytes)."""
    layers = 16
    per_tensor = max(1024, total_bytes // (layers * len(_LAYER_TENSORS) + 2)) // 2 * 2
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{t}" for i in range(layers) for t in _LAYER_TENSORS]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "num_hidden_layers": layers}))
    pattern = os.urandom(per_tensor)
    weight_map = {}
    for s in range(shards):
        shard_names = names[s::shards]
        header, _ = build_header([(n, "F16", (per_tensor // 2,), per_tensor) for n in shard_names], {})
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        with (path / shard).open("wb") as f:
            f.write(header)
            for _ in shard_names:
                f.write(pattern)
        weight_map.update({n: shard for n in shard_names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _timed_child(argv: list[str]) -> tuple[float, int]:
    """Run a child process; return its wall time and peak RSS in bytes."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv[:3]} failed with status {status}")
    return seconds, usage.ru_maxrss * 1024


def run(workdir: Path, size_bytes: int, repeat: int = 3, progress=print) -> PackBenchResult:
    """Measure on a synthetic checkpoint of ``size_bytes``; copy times are medians of ``repeat`` runs."""
    src = workdir / "checkpoint"
    if not (src / "config.json").exists():
        progress(f"writing a synthetic {format_bytes(size_bytes)} checkpoint to {src}")
        write_synthetic_checkpoint(src, size_bytes)
    shards = sorted(src.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    for p in shards:  # warm the page cache so both sides read from memory
        with p.open("rb") as f:
            while f.read(64 << 20):
                pass
    copy_dir, out = workdir / "cp", workdir / "package"
    cp_times, pack_times, pack_rss = [], [], 0
    for attempt in range(repeat):
        progress(f"timing cp and pipecast pack ({attempt + 1}/{repeat}) ...")
        shutil.rmtree(copy_dir, ignore_errors=True)
        copy_dir.mkdir()
        os.sync()  # flush dirty pages so that writeback of one copy does not slow the next
        cp_times.append(_timed_child(["cp", *map(str, shards), str(copy_dir)])[0])
        shutil.rmtree(copy_dir)
        os.sync()
        # Before torch is imported here: a forked child's peak RSS starts at its parent's (Linux keeps
        # the high-water mark across exec), so the parent must be small when the pack child starts.
        seconds, rss = _timed_child([sys.executable, "-m", "pipecast.cli", "pack", str(src), str(out), "--force"])
        pack_times.append(seconds)
        pack_rss = max(pack_rss, rss)
    cp_seconds, pack_seconds = statistics.median(cp_times), statistics.median(pack_times)
    import safetensors.torch

    def open_all(verify: bool) -> float:
        start = time.perf_counter()
        pkg = Package.open(out)
        for i in range(pkg.num_blocks):
            pkg.block_tensors(i, verify=verify)
        return time.perf_counter() - start

    progress(f"timing block open (zero-copy; then with {VERIFY_NOTE}) ...")
    open_seconds, verified_seconds = open_all(False), open_all(True)
    progress("timing safetensors.torch.load_file on the original ...")
    start = time.perf_counter()
    for p in shards:
        safetensors.torch.load_file(p)
    load_seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return PackBenchResult(total, cp_seconds, pack_seconds, pack_rss, open_seconds, verified_seconds,
                           load_seconds)


def report(r: PackBenchResult) -> str:
    gb = r.checkpoint_bytes / 1e9
    return "\n".join([
        f"checkpoint        {format_bytes(r.checkpoint_bytes)} (synthetic, 4 shards); times are medians",
        f"cp (baseline)     {r.cp_seconds:7.2f} s  {gb / r.cp_seconds:6.2f} GB/s",
        f"pipecast pack     {r.pack_seconds:7.2f} s  {gb / r.pack_seconds:6.2f} GB/s  "
        f"= {r.pack_vs_cp:.2f} x cp throughput",
        f"pack peak RSS     {format_bytes(r.pack_peak_rss_bytes)} "
        f"({r.pack_peak_rss_bytes / r.checkpoint_bytes:.1%} of the checkpoint)",
        f"safetensors load  {r.safetensors_load_seconds:7.3f} s  {gb / r.safetensors_load_seconds:6.2f} GB/s",
        f"block open        {r.open_seconds:7.3f} s  {gb / r.open_seconds:6.2f} GB/s  "
        f"= {r.open_vs_safetensors:.2f} x safetensors load (both map the file, no copy)",
        f"open + verify     {r.open_verified_seconds:7.3f} s  {gb / r.open_verified_seconds:6.2f} GB/s  "
        f"({VERIFY_NOTE})",
    ])


def to_json(r: PackBenchResult) -> dict:
    return asdict(r) | {"pack_vs_cp": r.pack_vs_cp, "open_vs_safetensors": r.open_vs_safetensors}
