"""What the engine and loading tests compare with and load through: transformers' reference models, random
prompts, a poll for a condition, and a fake node agent whose blocks a test releases one by one (the packages:
tests.support.packages)."""

import mmap
import random
import threading
import time
from pathlib import Path

from packager.package import Package
from pipecast.agent.errors import LocalApiError, LocalApiTimeoutError


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


def wait_until(predicate, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def random_prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    """``length`` token ids drawn from ``vocab``, the same for the same ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


class GatedAgent:
    """The node agent's local client (LocalAgentClient's methods) over a package folder, each block (or a
    prefix of it) verified only once the test releases it."""

    def __init__(self, pkg: Path) -> None:
        self.root = pkg
        self._manifest = Package.open(pkg).manifest
        self.buffers = []
        for block in self._manifest.blocks:
            with (pkg / block.file).open("rb") as f:
                self.buffers.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        self._verified = [0] * len(self.buffers)  # bytes of each block released so far
        self._cond = threading.Condition()
        self.mapped_ahead: set[int] = set()

    def release(self, *blocks: int) -> None:
        """Verify the given blocks (all of them if none is named)."""
        for i in blocks or range(len(self.buffers)):
            self.release_prefix(i, len(self.buffers[i]))

    def release_prefix(self, block: int, nbytes: int) -> None:
        """Verify the first ``nbytes`` bytes of ``block``, as its chunks landing one by one would."""
        with self._cond:
            self._verified[block] = max(self._verified[block], nbytes)
            self._cond.notify_all()

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

    def wait_prefix(self, index, nbytes, timeout, package_id=None):
        self._check(package_id)
        with self._cond:
            if not self._cond.wait_for(lambda: self._verified[index] >= nbytes, timeout):
                raise LocalApiTimeoutError(f"the first {nbytes} bytes of block {index} not verified within "
                                           f"{timeout} s")
        return memoryview(self.buffers[index])[:nbytes]

    def wait_block(self, index, timeout, package_id=None):
        self.wait_prefix(index, len(self.buffers[index]), timeout, package_id)
        return memoryview(self.buffers[index])

    def verified_bytes(self, index, package_id=None):
        self._check(package_id)
        with self._cond:
            return self._verified[index]

    def verified_blocks(self, package_id=None):
        self._check(package_id)
        with self._cond:
            return {i for i, (n, b) in enumerate(zip(self._verified, self.buffers)) if n == len(b)}
