"""Sampling at the edges of its parameters: what a request may give never breaks the arithmetic."""

import numpy as np
import pytest
import torch

from pipecast.engine.errors import InvalidRequestError
from pipecast.engine.sampling import MAX_SEED, MIN_SEED, SamplingParams, new_generator, sample_tokens

LOGITS = torch.tensor([[0.5, 3.0, -2.0, 1.0], [2.0, -1.0, 0.0, 1.5]])


@pytest.mark.parametrize("temperature, top_p", [
    (1e-320, 1.0), (2e-38, 1.0), (1e-45, 0.5),  # logits / t overflows float32 (found by fuzzing: a 500 before)
    (1.0, 1e-320),  # top_p below float32's least: every token dropped before
])
def test_extreme_but_valid_parameters_sample_the_top_token(temperature, top_p):
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=1)] * 2
    assert sample_tokens(LOGITS, params, [new_generator(p) for p in params]) == [1, 0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=float("nan")), "temperature must be a number >= 0, got nan"),
    (dict(temperature=float("inf")), "temperature must be a number >= 0, got inf"),
    (dict(seed=MAX_SEED + 1), "seed must be an integer from -2\\^63 to 2\\^64-1"),
])
def test_parameters_the_arithmetic_cannot_take_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)
    assert new_generator(SamplingParams(temperature=1.0, seed=MIN_SEED)) is not None


def test_a_masked_token_is_never_sampled_and_the_others_still_are():
    logits = torch.tensor([[0.0, float("-inf"), 0.0, 0.0]])
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(32)]
    assert {sample_tokens(logits, [p], [new_generator(p)])[0] for p in params} == {0, 2, 3}


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=2.5), r"max_tokens must be an integer, got 2.5 \(float\)"),
    (dict(max_tokens=True), r"max_tokens must be an integer, got True \(bool\)"),
    (dict(max_tokens="5"), r"max_tokens must be an integer, got '5' \(str\)"),
    (dict(temperature="0.5"), r"temperature must be a number >= 0, got '0.5' \(str\)"),
    (dict(temperature=True), r"temperature must be a number >= 0, got True \(bool\)"),
    (dict(temperature=10 ** 400), r"temperature must be a number >= 0, got \d+\.\.\.\d+ \(int\)"),
    (dict(top_p="1"), r"top_p must be a number in \(0, 1\], got '1' \(str\)"),
    (dict(seed=1.5), r"seed must be an integer from -2\^63 to 2\^64-1, got 1.5 \(float\)"),
    (dict(seed="1"), r"seed must be an integer from -2\^63 to 2\^64-1, got '1' \(str\)"),
    (dict(seed=False), r"seed must be an integer from -2\^63 to 2\^64-1, got False \(bool\)"),
    (dict(stop_token_ids=5), r"stop_token_ids must be a collection of token ids, got 5 \(int\)"),
    (dict(stop_token_ids="2"), r"stop_token_ids must be a collection of token ids, got '2' \(str\)"),
    (dict(stop_token_ids=["a"]), r"stop_token_ids must be integers, got 'a' \(str\)"),
    (dict(stop_token_ids=[2, 2.0]), r"stop_token_ids must be integers, got 2.0 \(float\)"),
])
def test_parameters_of_the_wrong_type_are_refused_not_rounded(kwargs, message):
    """Finding 7: max_tokens 2.5 ran 3 tokens and True 1, seed 1.5 was a RuntimeError at the first sampled token,
    "5" and stop_token_ids=5 raw TypeErrors, and ["a"] was taken (no token ever stopped generation)."""
    with pytest.raises(InvalidRequestError, match=f"^{message}$"):
        SamplingParams(**kwargs)


def test_numbers_of_other_types_are_taken_as_plain_ints_and_floats():
    params = SamplingParams(max_tokens=np.int64(3), temperature=1, top_p=np.float32(0.5), seed=np.int32(7),
                            stop_token_ids=[np.int64(2), 5, None])  # None: a config's eos_token_id of no token
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (3, 1.0, 0.5, 7)
    assert [type(v) for v in (params.max_tokens, params.temperature, params.top_p, params.seed)] == [
        int, float, float, int]
    assert params.stop_token_ids == {2, 5} and all(type(t) is int for t in params.stop_token_ids)
    assert new_generator(params) is not None
