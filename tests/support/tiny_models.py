"""Tiny random Hugging Face checkpoints built from a config in-process (tests never download); the builders
live in :mod:`benchmarks.tiny_checkpoints`, which benchmarks use too."""

from benchmarks.tiny_checkpoints import ARCHS, make_checkpoint, tiny_config

__all__ = ["ARCHS", "make_checkpoint", "tiny_config"]
