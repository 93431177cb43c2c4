"""Tiny packages and transformers reference models for the engine and hook tests (built in-process), and
a fake node agent whose blocks a test releases one by one."""

import mmap
import random
import threading
from pathlib import Path
from types import SimpleNamespace

from pipecast.agent.errors import LocalApiError, LocalApiTimeoutError

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


class GatedAgent:
    """The node agent's local client (LocalAgentClient's methods) over a package folder, each block
    verified only once the test releases it."""

    def __init__(self, pkg: Path) -> None:
        from packager.package import Package

        self.root = pkg
        self._manifest = Package.open(pkg).manifest
        self.buffers = []
        for block in self._manifest.blocks:
            with (pkg / block.file).open("rb") as f:
                self.buffers.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        self._released = [threading.Event() for _ in self.buffers]
        self.mapped_ahead: set[int] = set()

    def release(self, *blocks: int) -> None:
        for i in blocks or range(len(self._released)):
            self._released[i].set()

    def _check(self, package_id: str | None) -> None:
        if package_id not in (None, self._manifest.package_id):
            raise LocalApiError(f"agent: unknown package {package_id}")

    def manifest(self, package_id=None, timeout=30.0):
        self._check(package_id)
        return self._manifest

    def package_file(self, path, package_id=None, timeout=30.0):
        self._check(package_id)
        return (self.root / path).read_bytes()

    def map_ahead(self, index, package_id=None, timeout=30.0):
        self._check(package_id)
        self.mapped_ahead.add(index)

    def wait_block(self, index, timeout, package_id=None):
        self._check(package_id)
        if not self._released[index].wait(timeout):
            raise LocalApiTimeoutError(f"block {index} not verified within {timeout} s")
        return memoryview(self.buffers[index])

    def progress(self, package_id=None, timeout=30.0):
        self._check(package_id)
        return SimpleNamespace(blocks=[SimpleNamespace(index=i, verified_at=1.0 if e.is_set() else None)
                                       for i, e in enumerate(self._released)])
