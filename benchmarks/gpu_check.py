"""The GPU path's check: one prepared run for a machine with CUDA (README "On a GPU node").

1. **Exactness**: random tiny Llama, Qwen2 and Mistral models in fp32 and bf16, each packed here: the greedy
   tokens of ``pipecast.load(package, device=...)`` against transformers' ``generate`` on the same device,
   and the largest difference between their logits over each prompt.
2. **Cold start**: a random Llama of ``--cold-layers`` layers at hidden 2048 in bf16, packed here. The first
   token after ``pipecast.load`` (execute-while-load, from the package folder: the unicast fallback, no
   agent) against transformers' ``from_pretrained`` onto the device and then ``generate`` (load-then-serve),
   and safetensors' ``load_file`` onto the device (the raw copy: the floor of any load). The files were just
   written, so they are read from the page cache: no disk and no network in these figures.

``python -m benchmarks.gpu_check --device cuda --json out.json``; ``--device cpu`` runs the same on a CPU.
"""

import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import click

ARCHS = ("llama", "qwen2", "mistral")
DTYPES = ("float32", "bfloat16")
NEW_TOKENS = 16


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 40)]


def exactness(device: str, work: Path) -> list[dict]:
    """One row per architecture and dtype: tokens equal to transformers' and the largest logit difference."""
    import torch
    import transformers

    import pipecast
    from benchmarks.tiny_checkpoints import INIT_RANGE, make_checkpoint
    from packager.pack import pack

    rows = []
    for arch in ARCHS:
        for dtype in DTYPES:
            ckpt, pkg = work / f"{arch}-{dtype}-ckpt", work / f"{arch}-{dtype}"
            make_checkpoint(arch, ckpt, dtype=dtype, initializer_range=INIT_RANGE)
            pack(ckpt, pkg, layers_per_block=1, model_name=f"tiny-{arch}")
            ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype="auto").to(device).eval()
            equal, worst = 0, 0.0
            prompts = _prompts(ref.config.vocab_size)
            with pipecast.load(pkg, device=device) as model:
                model.wait_loaded(120)
                for prompt in prompts:
                    ids = torch.tensor([prompt], device=device)
                    with torch.no_grad():
                        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                           do_sample=False, pad_token_id=0)
                        expected = ref(ids).logits[0].float()
                    equal += model.generate(prompt, max_new_tokens=NEW_TOKENS, timeout=120) == \
                        out[0, len(prompt):].tolist()
                    got = model.logits(prompt, timeout=120).float().to(expected.device)
                    worst = max(worst, (got - expected).abs().max().item())
            rows.append({"arch": arch, "dtype": dtype, "prompts": len(prompts), "tokens_equal": equal,
                         "max_abs_logit_diff": worst})
            click.echo(f"exactness {arch:8} {dtype:9} tokens equal {equal}/{len(prompts)}, "
                       f"max |logit diff| {worst:.3g}")
            del ref
    return rows


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)  # the device named (cuda:1 too), not the current one


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def cold_start(device: str, work: Path, layers: int, repeat: int, prompt_tokens: int) -> dict:
    """First token of a cold model on ``device``: execute-while-load, load-then-serve and the raw copy."""
    import safetensors.torch
    import torch
    import transformers

    import pipecast
    from benchmarks.tiny_checkpoints import make_checkpoint, write_byte_tokenizer
    from packager.pack import pack

    ckpt, pkg = work / "cold-ckpt", work / "cold"
    started = time.monotonic()
    make_checkpoint("llama", ckpt, dtype="bfloat16", initializer_range=0.02, vocab_size=32000, hidden_size=2048,
                    intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                    max_position_embeddings=4096)
    write_byte_tokenizer(ckpt)  # so that `pipecast serve` and `bench coldstart` can run the kept package too
    manifest = pack(ckpt, pkg, layers_per_block=1, model_name="cold-llama")
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    click.echo(f"cold start: random Llama, {layers} layers at hidden 2048, {size / 2**30:.2f} GiB bf16, "
               f"{len(manifest.blocks)} blocks (built and packed in {time.monotonic() - started:.1f} s)")
    prompt = _prompts(32000)[0] * (prompt_tokens // 5 + 1)
    prompt = prompt[:prompt_tokens]
    times: dict[str, list[float]] = {"raw_copy": [], "execute_while_load": [], "load_then_serve": [],
                                     "execute_while_load_all_loaded": [], "execute_while_load_unverified": []}
    firsts = set()
    for _ in range(repeat):
        t0 = time.monotonic()
        for f in sorted(ckpt.glob("*.safetensors")):
            tensors = safetensors.torch.load_file(f, device=device)
        _sync(device)
        times["raw_copy"].append(time.monotonic() - t0)
        del tensors
        _free(device)

        t0 = time.monotonic()
        with pipecast.load(pkg, device=device) as model:
            first = model.generate(prompt, max_new_tokens=1, timeout=300)
            times["execute_while_load"].append(time.monotonic() - t0)
            model.wait_loaded(300)
            times["execute_while_load_all_loaded"].append(time.monotonic() - t0)
        firsts.add(first[0])
        _free(device)

        t0 = time.monotonic()  # the same with no digest checked: where the verification's time goes
        with pipecast.load(pkg, device=device, verify=False) as model:
            firsts.add(model.generate(prompt, max_new_tokens=1, timeout=300)[0])
            times["execute_while_load_unverified"].append(time.monotonic() - t0)
        _free(device)

        t0 = time.monotonic()
        ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(device).eval()
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                               pad_token_id=0)
        _sync(device)
        times["load_then_serve"].append(time.monotonic() - t0)
        firsts.add(out[0, -1].item())
        del ref, out
        _free(device)
    medians = {k: statistics.median(v) for k, v in times.items()}
    click.echo(f"cold start, median of {repeat} ({prompt_tokens}-token prompt, first token from the call): "
               f"execute-while-load {medians['execute_while_load']:.2f} s "
               f"(all loaded {medians['execute_while_load_all_loaded']:.2f} s; digests unchecked "
               f"{medians['execute_while_load_unverified']:.2f} s), "
               f"load-then-serve {medians['load_then_serve']:.2f} s, raw copy {medians['raw_copy']:.2f} s "
               f"(floor); execute-while-load / floor {medians['execute_while_load'] / medians['raw_copy']:.2f}x; "
               f"first tokens {'equal' if len(firsts) == 1 else 'DIFFER'}")
    return {"layers": layers, "bytes": size, "blocks": len(manifest.blocks), "prompt_tokens": prompt_tokens,
            "repeat": repeat, "seconds": times, "median_seconds": medians,
            "ratio_to_floor": medians["execute_while_load"] / medians["raw_copy"],
            "first_tokens_equal": len(firsts) == 1}


@click.command()
@click.option("--device", default="cuda", show_default=True, help="torch device to check.")
@click.option("--cold-layers", type=click.IntRange(min=1), default=16, show_default=True,
              help="Layers of the cold-start model (hidden 2048, bf16: about 100 MiB a layer).")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Cold starts per strategy (medians reported).")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the figures as JSON.")
@click.option("--keep", "keep_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the checkpoints and packages in this new folder (default: a temp dir, removed); the "
                   "cold-start model's package is DIR/cold, for `pipecast bench coldstart --device cuda --package`.")
def main(device: str, cold_layers: int, repeat: int, prompt_tokens: int, json_path: Path | None,
         keep_dir: Path | None) -> None:
    """Check pipecast's GPU path: exactness against transformers, then a cold start's first token."""
    if keep_dir is not None and keep_dir.exists() and any(keep_dir.iterdir()):
        raise click.BadParameter(f"{keep_dir} is not empty", param_hint="--keep")
    import torch
    import transformers

    from pipecast.engine.errors import DeviceError
    from pipecast.engine.progressive import engine_device

    try:  # the engine's own check, before torch.cuda is asked about a device this host lacks
        parsed = engine_device(device)
    except DeviceError as exc:
        raise click.BadParameter(exc.problem, param_hint="--device") from None
    logging.basicConfig(level=logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    name = torch.cuda.get_device_name(parsed) if parsed.type == "cuda" else "cpu"
    click.echo(f"device {device} ({name}); torch {torch.__version__}, transformers {transformers.__version__}")
    if parsed.type == "cuda":
        torch.ones(1, device=device).matmul(torch.ones(1, device=device))  # the CUDA context, outside the timings
    with tempfile.TemporaryDirectory(prefix="pipecast-gpu-") as tmp:
        work = keep_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = {"device": device, "device_name": name, "torch": torch.__version__,
                  "transformers": transformers.__version__, "exactness": exactness(device, work)}
        result["cold_start"] = cold_start(device, work, cold_layers, repeat, prompt_tokens)
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
