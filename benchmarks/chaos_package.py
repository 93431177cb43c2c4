"""The packages the chaos scenarios move, built in-process with the real packager (from
:mod:`benchmarks.tiny_checkpoints`, which the tests' builders use too): random bytes shaped like a llama checkpoint for
the data plane, and a tiny random llama with a byte-level tokenizer that a serving worker can load."""

from pathlib import Path

from benchmarks.tiny_checkpoints import write_byte_tokenizer, write_random_checkpoint
from packager.pack import pack
from pipecast.v1.manifest_pb2 import Manifest


def random_package(path: Path, layers: int, layer_bytes: int, chunk_bytes: int, seed: int = 0) -> Manifest:
    """Pack ``layers`` layers of ``layer_bytes`` random bytes each, one block per layer, into ``path``
    (the checkpoint is written beside it). Nothing can run it; it is as large as a transfer needs."""
    checkpoint = path.parent / f"{path.name}-checkpoint"
    write_random_checkpoint(checkpoint, layers, layer_bytes, seed=seed)
    return pack(checkpoint, path, layers_per_block=1, chunk_bytes=chunk_bytes, model_name="chaos-random")


def model_package(path: Path, seed: int = 0) -> Manifest:
    """Pack a random llama of 2 layers (hidden 64, vocab 256) with a byte-level tokenizer into ``path``:
    small enough to load in a second on CPU, real enough for ``pipecast serve`` to answer requests."""
    import torch
    import transformers

    checkpoint = path.parent / f"{path.name}-checkpoint"
    transformers.utils.logging.disable_progress_bar()  # the benchmark's output is its table
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    write_byte_tokenizer(checkpoint)
    return pack(checkpoint, path, layers_per_block=1, model_name="chaos-llama")
