"""Sampling at the edges of its parameters: what a request may give never breaks the arithmetic."""

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
