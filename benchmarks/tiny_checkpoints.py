"""Small checkpoints built in-process for benchmarks and tests (nothing is downloaded): random bytes shaped
like a Llama checkpoint for moving data, a random tiny transformers model built from a config, and a
byte-level tokenizer for serving a tiny model."""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def write_random_checkpoint(folder: Path, layers: int, layer_bytes: int, tokenizer_bytes: int = 0,
                            seed: int = 0) -> None:
    """A checkpoint folder of ``layers`` layers of ``layer_bytes`` random bytes each (Llama tensor names;
    nothing can run it), and ``tokenizer_bytes`` of random bytes as its tokenizer.json if asked."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    tensors = {"model.embed_tokens.weight": rng.integers(0, 256, (16, 256), dtype=np.uint8),
               "model.norm.weight": rng.integers(0, 256, (256,), dtype=np.uint8)}
    for layer in range(layers):
        tensors[f"model.layers.{layer}.mlp.weight"] = rng.integers(0, 256, (layer_bytes,), dtype=np.uint8)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers}))
    if tokenizer_bytes:
        (folder / "tokenizer.json").write_bytes(rng.integers(0, 256, tokenizer_bytes, dtype=np.uint8).tobytes())


def _byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet of byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


#: A small chat template for the tiny models: each message as <|role|>content, the assistant's turn last; it
#: refuses tool messages, as templates refuse what they cannot render.
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool messages') }}"
                      "{% endif %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_byte_tokenizer(folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with :data:`BYTE_CHAT_TEMPLATE`) of a byte-level
    tokenizer: token id = byte value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: byte for byte, symbol in _byte_symbols().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "chat_template": BYTE_CHAT_TEMPLATE}))


# Larger than transformers' default init (0.02), so a random tiny model's greedy tokens vary instead of
# repeating one token: token-level comparisons then mean something.
INIT_RANGE = 0.3
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_config(arch: str, **overrides):
    """A transformers config for a tiny model of ``arch`` (hidden 64, 4 layers, vocab 256)."""
    import transformers

    # Overrides go to the constructor: some fields derive others there (Qwen2's per-layer layer_types).
    if arch == "llama":
        return transformers.LlamaConfig(**{**_COMMON, "tie_word_embeddings": False, **overrides})
    if arch == "qwen2":
        return transformers.Qwen2Config(**{**_COMMON, "tie_word_embeddings": True, **overrides})
    if arch == "qwen3":  # head_dim set apart from hidden / heads, as Qwen3's is
        return transformers.Qwen3Config(**{**_COMMON, "head_dim": 32, "tie_word_embeddings": True, **overrides})
    if arch == "mistral":
        return transformers.MistralConfig(**{**_COMMON, "tie_word_embeddings": False, "sliding_window": None,
                                             **overrides})
    if arch == "gemma3_text":
        # Sliding (local rotary base, window 6) and global layers alternating, global rotary scaled as in
        # Gemma 3 4B; softcapped logits and a query scale apart from head_dim exercise what Gemma adds.
        return transformers.Gemma3TextConfig(**{
            **_COMMON, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 6,
            "sliding_window_pattern": 2, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "final_logit_softcapping": 4.0, "tie_word_embeddings": True, **overrides})
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=128,
                                         bos_token_id=0, eos_token_id=0)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _gemma_weights(model) -> None:
    """Gemma multiplies its embeddings by sqrt(hidden), and its norms by (1 + weight), zero when drawn. Drawn
    as the other types' are, the embeddings would outweigh every layer and the tied head echo each token back:
    they are drawn sqrt(hidden) times smaller, and the norms random, as a trained model's are (so that each
    norm matters to the tests)."""
    model.model.embed_tokens.weight.div_(model.config.hidden_size ** 0.5)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.normal_(0.0, 1.0)


def make_checkpoint(arch: str, path: Path, *, seed: int = 0, dtype: str = "float32",
                    max_shard_size: str | None = None, **overrides) -> Path:
    """Write a random tiny ``arch`` model as a safetensors checkpoint folder at ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if arch == "gemma3_text":
        with torch.no_grad():
            _gemma_weights(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return Path(path)
