"""Tiny random Hugging Face checkpoints built from a config in-process (tests never download)."""

from pathlib import Path

ARCHS = ("llama", "qwen2", "mistral", "gpt2")

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_config(arch: str, **overrides):
    """A transformers config for a tiny model of ``arch`` (hidden 64, 4 layers, vocab 256)."""
    import transformers

    if arch == "llama":
        config = transformers.LlamaConfig(**_COMMON, tie_word_embeddings=False)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True)
    elif arch == "mistral":
        config = transformers.MistralConfig(**_COMMON, tie_word_embeddings=False, sliding_window=None)
    elif arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=128,
                                         bos_token_id=0, eos_token_id=0)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def make_checkpoint(arch: str, path: Path, *, seed: int = 0, dtype: str = "float32",
                    max_shard_size: str | None = None, **overrides) -> Path:
    """Write a random tiny ``arch`` model as a safetensors checkpoint folder at ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return Path(path)
