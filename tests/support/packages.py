"""Tiny packages for the tests, built in-process with the real packager: :func:`tiny_package`.

Two kinds: a random tiny transformers model (torch builds it; the engine runs it, a serving worker serves
it with the byte-level tokenizer), or random bytes shaped like a llama checkpoint (no torch: fast, and as
large as a test of the agent or the transports needs; nothing can run it).
"""

from dataclasses import dataclass
from pathlib import Path

from benchmarks.tiny_checkpoints import INIT_RANGE, make_checkpoint, write_byte_tokenizer, write_random_checkpoint
from packager.pack import pack
from pipecast.core.units import DEFAULT_CHUNK_BYTES
from pipecast.v1.manifest_pb2 import Manifest


@dataclass(frozen=True)
class TinyPackage:
    """A packed tiny checkpoint: the checkpoint folder, the package folder and its manifest."""

    checkpoint: Path
    path: Path
    manifest: Manifest


def tiny_package(path: Path, arch: str = "llama", *, seed: int = 0, layers: int = 4, layers_per_block: int = 1,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, dtype: str = "float32", tokenizer: bool = False,
                 layer_bytes: int | None = None, tokenizer_bytes: int = 0, **config) -> TinyPackage:
    """Pack a tiny checkpoint of ``layers`` layers into the package folder ``path`` (model name
    ``tiny-<arch>``); the checkpoint is written beside it, at ``<path>-checkpoint``.

    By default a random ``arch`` model (see :mod:`benchmarks.tiny_checkpoints`; ``config`` overrides its
    config) in ``dtype``. With ``layer_bytes``, random bytes instead: ``layer_bytes`` per layer, shaped
    like a llama checkpoint, and ``tokenizer_bytes`` of random bytes as its ``tokenizer.json`` if asked
    (a small file to move). ``tokenizer`` adds the byte-level tokenizer a serving worker needs.
    """
    checkpoint = path.parent / f"{path.name}-checkpoint"
    if layer_bytes is None:
        if tokenizer_bytes:
            raise ValueError("tokenizer_bytes is for random-bytes packages (layer_bytes)")
        make_checkpoint(arch, checkpoint, seed=seed, dtype=dtype, initializer_range=INIT_RANGE,
                        num_hidden_layers=layers, **config)
    elif arch != "llama" or config:
        raise ValueError("a random-bytes package (layer_bytes) is shaped like a llama and has no model config")
    else:
        write_random_checkpoint(checkpoint, layers, layer_bytes, tokenizer_bytes, seed)
    if tokenizer:
        write_byte_tokenizer(checkpoint)
    manifest = pack(checkpoint, path, layers_per_block=layers_per_block, chunk_bytes=chunk_bytes,
                    model_name=f"tiny-{arch}")
    return TinyPackage(checkpoint, path, manifest)


def rewrite_unsealed(path: Path, text: str) -> None:
    """Write ``text`` over the package file ``path`` at its size, padded with spaces (JSON allows them): an edit
    the manifest does not know of that a reader without ``verify`` takes, since it checks only a file's size."""
    size = path.stat().st_size
    assert len(text.encode()) <= size, f"the edit of {path} is longer than the file ({size} bytes)"
    path.write_text(text.ljust(size))
