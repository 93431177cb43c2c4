"""The packages the chaos scenarios move, built in-process with the real packager (benchmarks may not
import the tests' builders): random bytes shaped like a llama checkpoint for the data plane, and a tiny
random llama with a byte-level tokenizer that a serving worker can load."""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from packager.pack import pack
from pipecast.v1.manifest_pb2 import Manifest


def random_package(path: Path, layers: int, layer_bytes: int, chunk_bytes: int, seed: int = 0) -> Manifest:
    """Pack ``layers`` layers of ``layer_bytes`` random bytes each, one block per layer, into ``path``
    (the checkpoint is written beside it). Nothing can run it; it is as large as a transfer needs."""
    checkpoint = path.parent / f"{path.name}-checkpoint"
    checkpoint.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": rng.integers(0, 256, (16, 256), dtype=np.uint8),
               "model.norm.weight": rng.integers(0, 256, (256,), dtype=np.uint8)}
    for layer in range(layers):
        tensors[f"model.layers.{layer}.mlp.weight"] = rng.integers(0, 256, (layer_bytes,), dtype=np.uint8)
    save_file(tensors, str(checkpoint / "model.safetensors"))
    (checkpoint / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers}))
    return pack(checkpoint, path, layers_per_block=1, chunk_bytes=chunk_bytes, model_name="chaos-random")


def _byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet of byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def model_package(path: Path, seed: int = 0) -> Manifest:
    """Pack a random llama of 2 layers (hidden 64, vocab 256) with a byte-level tokenizer into ``path``:
    small enough to load in a second on CPU, real enough for ``pipecast serve`` to answer requests."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    checkpoint = path.parent / f"{path.name}-checkpoint"
    transformers.utils.logging.disable_progress_bar()  # the benchmark's output is its table
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    tokenizer = Tokenizer(models.BPE(vocab={s: b for b, s in _byte_symbols().items()}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return pack(checkpoint, path, layers_per_block=1, model_name="chaos-llama")
