"""What the engine is asked to run in (``device``, ``dtype``) and on (token ids): a typed error naming the
argument, before anything is built, for what it cannot take."""

import re

import numpy as np
import pytest
import torch

from pipecast.engine.engine import Engine, token_ids
from pipecast.engine.errors import DeviceError, InvalidRequestError
from pipecast.engine.providers import PackageFolderProvider
from tests.support import packages


@pytest.fixture(scope="module")
def provider(tmp_path_factory):
    return PackageFolderProvider(packages.tiny_package(tmp_path_factory.mktemp("args") / "pkg", layers=2).path)


def _missing_cuda() -> tuple[str, str]:
    """A CUDA device this host lacks, and what the error says of it."""
    if not torch.cuda.is_available():
        return "cuda", "CUDA is not available on this host"
    count = torch.cuda.device_count()
    return f"cuda:{count}", f"this host has {count} CUDA device(s)"


@pytest.mark.parametrize("device, problem", [
    ("bogus", "not a torch device (use cpu, cuda or cuda:N)"),
    ("meta", "the engine runs on cpu or cuda devices only"),
    _missing_cuda(),
])
def test_a_device_the_engine_cannot_run_on_is_a_device_error(provider, device, problem):
    """Finding 6: a missing CUDA was blamed on config.json (ModelConfigError), "bogus" was a raw RuntimeError
    and "meta" failed only when a block was bound."""
    with pytest.raises(DeviceError, match=f"^{re.escape(f'device={device!r}: {problem}')}$"):
        Engine(provider, device=device)


@pytest.mark.parametrize("dtype", ["float16", torch.int8, torch.bool])
def test_a_dtype_the_engine_cannot_run_in_is_a_device_error(provider, dtype):
    """Finding 6: the string "float16" was taken, and loading failed later on ``Invalid device string``."""
    message = (f"dtype={dtype!r}: not a dtype the engine runs in (torch.float16, torch.bfloat16, torch.float32, "
               "torch.float64)")
    with pytest.raises(DeviceError, match=f"^{re.escape(message)}$"):
        Engine(provider, dtype=dtype)


def test_the_cpu_and_a_floating_dtype_are_taken(provider):
    engine = Engine(provider, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert engine.model.device == torch.device("cpu") and engine.model.dtype == torch.bfloat16


@pytest.mark.parametrize("ids", [[1, 2, 3], (1, 2, 3), [np.int64(1), np.int32(2), 3], np.array([1, 2, 3]),
                                 torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3], dtype=torch.int32),
                                 list(torch.tensor([1, 2, 3]))])
def test_integer_token_ids_are_taken(ids):
    got = token_ids(ids)
    assert got == [1, 2, 3] and all(type(t) is int for t in got)


@pytest.mark.parametrize("ids, message", [
    ([5.9, 6], r"token ids must be integers, got 5.9 \(float\) at position 0"),
    ([5, 6.0], r"token ids must be integers, got 6.0 \(float\) at position 1"),
    ([True, 2], r"token ids must be integers, got True \(bool\) at position 0"),
    (["5"], r"token ids must be integers, got '5' \(str\) at position 0"),
    ([[1, 2, 3]], r"token ids must be integers, got \[1, 2, 3\] \(list\) at position 0"),
    (torch.tensor([5.5, 6.5]), r"token ids must be integers, got a Tensor of torch.float32"),
    (torch.tensor([True]), r"token ids must be integers, got a Tensor of torch.bool"),
    (np.array([1.0]), r"token ids must be integers, got a ndarray of float64"),
    (5, r"token ids must be a sequence of integers, got int"),
])
def test_ids_that_are_not_integers_are_refused(provider, ids, message):
    """Finding 7: ``int()`` turned 5.9 into 5 and "5" into 5: another prompt than the one sent, silently."""
    with pytest.raises(InvalidRequestError, match=f"^{message}$"):
        token_ids(ids)
    engine = Engine(provider)
    with pytest.raises(InvalidRequestError, match=f"^{message}$"):
        engine.submit(ids)
