"""Tiny packages and transformers reference models for the engine and hook tests (built in-process)."""

import random
from pathlib import Path

from tests.tiny_models import make_checkpoint

# Larger than transformers' default init (0.02), so a random tiny model's greedy tokens vary instead of
# repeating one token: token-level comparisons then mean something.
INIT_RANGE = 0.3


def make_package(root: Path, arch: str, *, dtype: str = "float32", seed: int = 0, layers_per_block: int = 1,
                 **overrides) -> tuple[Path, Path]:
    """(checkpoint folder, package folder) of a random tiny ``arch`` model under ``root``."""
    from packager.pack import pack

    name = f"{arch}-{dtype}-{seed}"
    ckpt = make_checkpoint(arch, root / f"{name}-ckpt", seed=seed, dtype=dtype, initializer_range=INIT_RANGE,
                           **overrides)
    pkg = root / f"{name}-pkg"
    pack(ckpt, pkg, layers_per_block=layers_per_block)
    return ckpt, pkg


def reference_model(ckpt: Path):
    """transformers' own model loaded from the original checkpoint (its dtype), in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype="auto").eval()


def reference_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generation: the new token ids, stopping at the model's EOS."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]
