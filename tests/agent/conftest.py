"""Fixtures of the agent's tests: one torch-free package per test module."""

from pathlib import Path

import pytest

from pipecast.v1.manifest_pb2 import Manifest
from tests.support.packages import tiny_package

CHUNK = 64 << 10  # small chunks: a 200 kB layer spans several, so chunk-level paths run


@pytest.fixture(scope="module")
def package(request, tmp_path_factory) -> tuple[Path, Manifest]:
    """A package of 3 random-byte layers in CHUNK-sized chunks; a test module sets ``TOKENIZER_BYTES`` to
    give it a tokenizer file of that size (the small file that moves in ranges)."""
    root = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2]) / "pkg"
    tokenizer_bytes = getattr(request.module, "TOKENIZER_BYTES", 0)
    return root, tiny_package(root, layers=3, layer_bytes=200_000, chunk_bytes=CHUNK,
                              tokenizer_bytes=tokenizer_bytes).manifest
