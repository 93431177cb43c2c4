"""Shared pieces of the agent's tests: small random packages (real packager, no torch), a faulty relay."""

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from packager.pack import pack
from pipecast.agent.budget import MemoryBudget
from pipecast.agent.buffers import SharedMemoryAllocator
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.source import PackageFolderSource
from pipecast.agent.store import BlockStore
from pipecast.v1.manifest_pb2 import Manifest


def make_package(path: Path, *, layers: int = 4, layer_bytes: int = 1 << 20, chunk_bytes: int = 256 << 10,
                 seed: int = 0, tokenizer_bytes: int = 0) -> Manifest:
    """Pack a random checkpoint of ``layers`` layers (one block each) into the package folder ``path``,
    with a random ``tokenizer.json`` of ``tokenizer_bytes`` bytes among its small files if asked."""
    rng = np.random.default_rng(seed)
    checkpoint = path.parent / f"{path.name}-checkpoint"
    checkpoint.mkdir(parents=True)
    tensors = {"model.embed_tokens.weight": rng.integers(0, 256, (16, 256), dtype=np.uint8),
               "model.norm.weight": rng.integers(0, 256, (256,), dtype=np.uint8)}
    for layer in range(layers):
        tensors[f"model.layers.{layer}.mlp.weight"] = rng.integers(0, 256, (layer_bytes,), dtype=np.uint8)
    save_file(tensors, str(checkpoint / "model.safetensors"))
    (checkpoint / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers}))
    if tokenizer_bytes:
        (checkpoint / "tokenizer.json").write_bytes(rng.integers(0, 256, tokenizer_bytes, dtype=np.uint8).tobytes())
    return pack(checkpoint, path, layers_per_block=1, chunk_bytes=chunk_bytes)


def receiving_store(manifest: Manifest, budget_bytes: int = 1 << 30, **kwargs) -> BlockStore:
    """An empty store for ``manifest``, as a receiving agent opens it (shared memory, nothing verified)."""
    return BlockStore.open(manifest, allocator=SharedMemoryAllocator(), budget=MemoryBudget(budget_bytes),
                           manifest_origin="test", **kwargs)


def block_file_bytes(root: Path, manifest: Manifest, block: int) -> bytes:
    """The bytes of block ``block``'s file in the package folder ``root``."""
    return (root / manifest.blocks[block].file).read_bytes()


def land_chunk(store: BlockStore, data: bytes, block: int, chunk: int) -> None:
    """Land ``chunk`` of ``block`` (whose bytes are ``data``) in ``store`` as if an upstream parent sent it."""
    buffer = store.chunk_buffer(block, chunk)
    start = chunk * store.manifest.blocks[block].chunk_bytes
    buffer[:] = data[start:start + len(buffer)]
    store.chunk_landed(block, chunk, "upstream")


def corrupt_copy(package: Path, dest: Path) -> Path:
    """A copy of the package folder ``package`` at ``dest`` whose first block file has its last byte flipped."""
    shutil.copytree(package, dest)
    block = min((dest / "blocks").iterdir())
    data = bytearray(block.read_bytes())
    data[-1] ^= 0xFF
    block.write_bytes(bytes(data))
    return dest


def seed_store(root: Path) -> BlockStore:
    """A store serving the package folder ``root``, as a seed agent holds it."""
    source = PackageFolderSource(root)
    return BlockStore.open(source.manifest, allocator=SharedMemoryAllocator(), budget=MemoryBudget(1 << 30),
                           local=source, require_complete=True)


class FlippingServer(PeerServer):
    """A faulty relay: serves its stores but flips a byte of one chunk (block, chunk)."""

    def __init__(self, flip: tuple[int, int]) -> None:
        super().__init__()
        self.flip = flip

    async def wait_chunk(self, package_id: str, block: int, chunk: int) -> memoryview:
        data = await super().wait_chunk(package_id, block, chunk)
        if (block, chunk) == self.flip:
            bad = bytearray(data)
            bad[7] ^= 0xFF
            return memoryview(bad)
        return data
