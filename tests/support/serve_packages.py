"""Tiny packages a serving worker can serve: a random tiny model plus a byte-level tokenizer whose 256 ids
are the 256 byte values."""

import json
from pathlib import Path

from tests.support.engine_packages import INIT_RANGE
from tests.support.tiny_models import make_checkpoint


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
