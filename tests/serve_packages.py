"""Tiny packages a serving worker can serve (a random tiny model plus a byte-level tokenizer whose 256 ids
are the 256 byte values), and a fake node agent whose blocks the test releases one by one."""

import json
import mmap
import threading
from pathlib import Path
from types import SimpleNamespace

from pipecast.agent.errors import LocalApiError, LocalApiTimeoutError
from tests.engine_packages import INIT_RANGE
from tests.tiny_models import make_checkpoint


def _byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet of byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def write_byte_tokenizer(folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json of a byte-level tokenizer: token id = byte value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: byte for byte, symbol in _byte_symbols().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def make_served_package(root: Path, arch: str = "llama", *, seed: int = 0, layers_per_block: int = 1,
                        with_tokenizer: bool = True, **overrides) -> Path:
    """A package folder under ``root`` of a random tiny ``arch`` model with the byte tokenizer."""
    from packager.pack import pack

    name = f"{arch}-{seed}{'' if with_tokenizer else '-notok'}"
    ckpt = make_checkpoint(arch, root / f"{name}-ckpt", seed=seed, initializer_range=INIT_RANGE, **overrides)
    if with_tokenizer:
        write_byte_tokenizer(ckpt)
    pack(ckpt, root / f"{name}-pkg", model_name=f"tiny-{arch}", layers_per_block=layers_per_block)
    return root / f"{name}-pkg"


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

    def wait_block(self, index, timeout, package_id=None):
        self._check(package_id)
        if not self._released[index].wait(timeout):
            raise LocalApiTimeoutError(f"block {index} not verified within {timeout} s")
        return memoryview(self.buffers[index])

    def progress(self, package_id=None, timeout=30.0):
        self._check(package_id)
        return SimpleNamespace(blocks=[SimpleNamespace(index=i, verified_at=1.0 if e.is_set() else None)
                                       for i, e in enumerate(self._released)])
