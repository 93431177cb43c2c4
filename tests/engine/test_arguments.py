"""What the engine is asked to run in (``device``, ``dtype``) and on (token ids): a typed error naming the
argument, before anything is built, for what it cannot take."""

import re

import numpy as np
import pytest
import torch

from pipecast.core.strictjson import describe
from pipecast.engine.engine import Engine, token_ids
from pipecast.engine.errors import DeviceError, EngineClosedError, InvalidRequestError
from pipecast.engine.loader import BlockLoader
from pipecast.engine.progressive import engine_device
from pipecast.engine.providers import PackageFolderProvider
from pipecast.engine.sampling import SamplingParams
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


def test_cuda_without_an_index_is_the_callers_current_device(monkeypatch):
    """Found in review: ``cuda`` stayed without an index, and each thread's current CUDA device is its own (a new
    thread starts on device 0): weights went to a caller's ``set_device(1)`` while the engine thread put ids and the
    KV cache on cuda:0, and every request failed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert engine_device("cuda") == torch.device("cuda", 1)
    assert engine_device("cuda:0") == torch.device("cuda", 0)


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
    # Found in review: a set ran in its iteration order, a dict its keys, bytes as byte ids.
    ({3, 1, 2}, r"token ids must be a sequence of integers, got set"),
    ({5: "x"}, r"token ids must be a sequence of integers, got dict"),
    (b"\x01\x02", r"token ids must be a sequence of integers, got bytes"),
])
def test_ids_that_are_not_integers_are_refused(provider, ids, message):
    """Finding 7: ``int()`` turned 5.9 into 5 and "5" into 5: another prompt than the one sent, silently."""
    with pytest.raises(InvalidRequestError, match=f"^{message}$"):
        token_ids(ids)
    engine = Engine(provider)
    with pytest.raises(InvalidRequestError, match=f"^{message}$"):
        engine.submit(ids)


def test_arguments_of_the_wrong_kind_are_refused_typed(provider):
    """Found in review: a list to logits, a dict or None as sampling parameters and a generator of prompts raised
    AttributeError or TypeError."""
    engine = Engine(provider)
    with pytest.raises(InvalidRequestError, match=r"^input_ids must be a torch tensor, got list$"):
        engine.logits([[1, 2]])
    with pytest.raises(InvalidRequestError, match=r"^sampling parameters must be SamplingParams, got dict$"):
        engine.submit([1], {"max_tokens": 2})
    with pytest.raises(InvalidRequestError, match=r"^sampling parameters must be SamplingParams, got NoneType$"):
        engine.submit_many([[1]], [None])
    with pytest.raises(InvalidRequestError, match=r"^prompts must be a sequence of prompts, got generator$"):
        engine.submit_many(p for p in [[1]])
    with pytest.raises(InvalidRequestError, match=r"^sampling parameters must be SamplingParams, got dict$"):
        engine.submit([1], {})  # empty: taken for the defaults by an `or`
    engine.close()


def test_a_batch_of_prompts_may_be_a_2d_tensor_or_array(provider):
    """Its rows are the prompts (the sequence check must not refuse what logits takes as a batch)."""
    import numpy as np
    import torch

    engine = Engine(provider)
    for batch in (torch.tensor([[1, 2], [3, 4]]), np.array([[1, 2], [3, 4]])):
        assert len(engine.submit_many(batch, SamplingParams(max_tokens=1))) == 2
    engine.close()


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1, "5", True, 10**400])
def test_a_calls_own_timeout_must_be_none_or_a_number_of_seconds_up_to_a_day(provider, timeout):
    """Found in review: NaN waited without a bound, infinity overflowed threading's timer, "5" raised TypeError."""
    import torch

    engine = Engine(provider)
    message = f"^{re.escape(f'timeout must be None or a number of seconds from 0 to 86400, got {describe(timeout)}')}$"
    for call in (lambda: engine.wait_loaded(timeout), lambda: engine.generate([1], timeout=timeout),
                 lambda: engine.logits(torch.tensor([[1]]), timeout)):
        with pytest.raises(InvalidRequestError, match=message):
            call()
    engine.close()


@pytest.mark.parametrize("name, value", [("max_batch", 0), ("max_batch", -1), ("max_batch", "4"), ("max_batch", 2.0),
                                         ("max_batch", True), ("max_queue", 0), ("max_queue", -5), ("max_queue", None)])
def test_batch_and_queue_bounds_must_be_integers_of_at_least_one(provider, name, value):
    """Finding 3: max_batch 0 left every request waiting forever, "4" stopped the engine thread at the first
    request (TypeError), and max_queue 0 refused every request as an overload."""
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(f'{name} must be an integer >= 1, got {value!r}')}$"):
        Engine(provider, **{name: value})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -1.0, "10", True, None, 10 ** 400],
                         ids=["nan", "inf", "0", "-1.0", "'10'", "True", "None", "10**400"])
def test_the_stall_timeout_must_be_a_positive_number_of_seconds(provider, value):
    """Finding 2: NaN never declared a stall, a string failed the loader thread with a raw TypeError and a
    negative value at its first poll."""
    message = f"stall_timeout_s must be a positive number of seconds, got {describe(value)}"
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        Engine(provider, stall_timeout_s=value)
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        BlockLoader(provider, Engine(provider).model, stall_timeout_s=value)


def test_integer_bounds_and_seconds_are_taken(provider):
    engine = Engine(provider, max_batch=1, max_queue=1, stall_timeout_s=2)
    assert (engine.scheduler.max_batch, engine.max_queue, engine.loader.stall_timeout_s) == (1, 1, 2.0)


def test_logits_of_a_closed_engine_is_refused(provider):
    """Finding 1: logits() still computed after close(), from weights close() should have let go of."""
    with Engine(provider).start() as engine:
        ids = torch.tensor([[1, 2, 3]])
        assert engine.logits(ids, timeout=30).shape == (1, 3, engine.model.vocab_size)
    with pytest.raises(EngineClosedError, match="^the engine is closed$"):
        engine.logits(ids, timeout=30)
    assert {p.device.type for p in engine.model.skeleton.model.parameters()} == {"meta"}  # dropped, not held
