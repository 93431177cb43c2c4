"""Choosing the next token: greedy, or temperature and top-p sampling from a per-request seeded generator.

Each sampled request owns its ``torch.Generator``, so its tokens depend on its seed alone, not on which
other requests share its batch.
"""

import math
import numbers
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipecast.core.strictjson import describe
from pipecast.engine.errors import InvalidRequestError
from pipecast.engine.streams import FINISH_LENGTH, FINISH_STOP

if TYPE_CHECKING:
    import torch


#: The seeds a request may give: what the engine's generator takes (a signed or unsigned 64-bit integer).
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to generate: ``temperature`` 0 is greedy; ``top_p`` keeps the smallest set of tokens whose
    probability reaches it; generation ends at a token of ``stop_token_ids`` (which is returned) or after
    ``max_tokens`` tokens."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        # Each value is checked for its type first: int() or a comparison would take 2.5 tokens as 3 and True
        # as 1, or fail on "5" with a raw TypeError; each is then stored as a plain int or float.
        if not _integer(self.max_tokens):
            raise InvalidRequestError(f"max_tokens must be an integer, got {_described(self.max_tokens)}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        temperature = _real(self.temperature)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise InvalidRequestError(f"temperature must be a number >= 0, got {_described(self.temperature)}")
        top_p = _real(self.top_p)
        if not 0 < top_p <= 1:
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {_described(self.top_p)}")
        if self.seed is not None and not (_integer(self.seed) and MIN_SEED <= self.seed <= MAX_SEED):
            raise InvalidRequestError(f"seed must be an integer from -2^63 to 2^64-1, got {_described(self.seed)}")
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(self.stop_token_ids, Iterable):
            raise InvalidRequestError(f"stop_token_ids must be a collection of token ids, got "
                                      f"{_described(self.stop_token_ids)}")
        # None is no token: what transformers' eos_token_id is for a model without one.
        stops = [t for t in self.stop_token_ids if t is not None]
        for token in stops:
            if not _integer(token):
                raise InvalidRequestError(f"stop_token_ids must be integers, got {_described(token)}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "seed", None if self.seed is None else int(self.seed))
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def finish_reason(self, token: int, generated: int) -> str | None:
        """Why generation ends with ``token``, the ``generated``-th: ``stop``, ``length``, or None (it goes on)."""
        if token in self.stop_token_ids:
            return FINISH_STOP
        return FINISH_LENGTH if generated >= self.max_tokens else None


def _integer(value: object) -> bool:
    """An integer (numpy's too), not a bool: Python counts True as 1."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: object) -> float:
    """``value`` as a float if it is a real number (not a bool); NaN otherwise, which every range check refuses."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return math.nan
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        return math.inf


def _described(value: object) -> str:
    return f"{describe(value)} ({type(value).__name__})"


def new_generator(params: SamplingParams) -> "torch.Generator | None":
    """The request's own random generator (None for greedy requests)."""
    import torch

    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed)


def sample_tokens(logits: "torch.Tensor", params: Sequence[SamplingParams],
                  generators: Sequence["torch.Generator | None"]) -> list[int]:
    """Next token of each row of ``logits`` [n, vocab] (float32, on the CPU)."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, gen)
    return tokens


def _sample_row(logits: "torch.Tensor", params: SamplingParams, generator: "torch.Generator") -> int:
    import torch

    scaled = logits / params.temperature
    if not bool(torch.isfinite(scaled.max())):
        # A temperature so small that logits / t overflows float32 to +inf (or t rounds to 0 in it): the
        # distribution is the limit's, all on the top token. A -inf below a finite top (a masked token) is
        # softmax's 0, but a NaN or a +inf top would make every probability NaN.
        return int(logits.argmax())
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep a token if the tokens before it do not reach top_p yet, and the top token always (a top_p below
        # float32's least would otherwise drop it: 0 >= 0)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[0] = False
        sorted_probs[drop] = 0
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))
