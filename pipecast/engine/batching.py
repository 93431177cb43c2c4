"""The step scheduler: continuous batching at step granularity over a progressively loaded model.

Each :meth:`StepScheduler.step` does, in order:

1. drop cancelled sequences;
2. advance every prefilling sequence through all the parts that are bound (embeddings, each stage of
   each layer, head), each prompt on its own so its numerics are the single-sequence ones; a sequence
   whose next stage is still in transit waits there, while the others (and newcomers) go on. A prompt
   that reaches the head yields its first token and joins the decode batch;
3. run one decode step for all decoding sequences together (one forward pass, one new token each);
   finished sequences leave the batch at once, and their rows are refilled from the end.

Single-threaded: the engine thread owns the scheduler.
"""

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipecast.engine.errors import EngineError
from pipecast.engine.kv_cache import PrefillCache, SlotKVCache, decode_mask, prefill_mask
from pipecast.engine.sampling import SamplingParams, new_generator, sample_tokens
from pipecast.engine.streams import FINISH_CANCELLED, TokenStream, emit
from pipecast.engine.weights import EMBED, HEAD, LAYER_STAGES, Part

if TYPE_CHECKING:
    import torch

    from pipecast.engine.progressive import ProgressiveModel

logger = logging.getLogger(__name__)


@dataclass
class PrefillState:
    """What every layer of one prompt's prefill reuses."""

    position_ids: "torch.Tensor"
    rope: dict[str | None, tuple["torch.Tensor", "torch.Tensor"]]  # by rotary variant (position_embeddings)
    masks: dict[int | None, "torch.Tensor | None"]  # by sliding-window size (None: full attention)
    cache: PrefillCache


@dataclass(eq=False)
class Sequence:
    """One request inside the scheduler."""

    prompt: list[int]
    params: SamplingParams
    stream: TokenStream
    generator: "torch.Generator | None" = None
    cancelled: bool = False
    generated: int = 0
    # prefill progress: the stage to run next, the hidden state (and the MLP's inner activation, between
    # its stages) before it, and what every layer reuses
    next_layer: int = 0
    next_stage: int = 0
    hidden: "torch.Tensor | None" = None
    carry: "torch.Tensor | None" = None
    prefill: PrefillState | None = None
    # decode state: row in the slot cache, tokens whose keys/values are cached, token to feed next
    row: int = -1
    length: int = 0
    last_token: int = -1
    # tokens generated elsewhere, fed as the steps' tokens (not sampled, not emitted) before sampling goes on
    forced: deque[int] = field(default_factory=deque)

    @classmethod
    def new(cls, prompt: list[int], params: SamplingParams, stream: TokenStream,
            forced: list[int] | None = None) -> "Sequence":
        return cls(prompt=prompt, params=params, stream=stream, generator=new_generator(params),
                   forced=deque(forced or ()))

    def next_token(self, sampled: int) -> bool:
        """Take the step's token: the next forced one, else ``sampled`` (handed to the stream); True if the
        sequence is finished with it."""
        if self.forced:
            self.last_token = self.forced.popleft()
            return False
        return self.emit(sampled)

    def emit(self, token: int) -> bool:
        """Hand ``token`` to the stream; True if the sequence is finished with it."""
        self.generated += 1
        self.last_token = token
        return emit(self.stream, token, self.generated, self.params)


def device_check(device: "torch.device") -> None:
    """Run one small kernel on ``device`` and read its result: a sticky accelerator fault fails any kernel."""
    import torch

    torch.ones(1, device=device).add_(1).sum().item()


class StepScheduler:
    """Prefills and decodes the sequences it holds; at most ``max_batch`` at a time."""

    def __init__(self, model: "ProgressiveModel", *, max_batch: int):
        self.model = model
        self.max_batch = max_batch
        self.prefilling: list[Sequence] = []
        self.decoding: list[Sequence] = []  # decoding[i].row == i
        sk = model.skeleton
        self.kv = SlotKVCache(windows=sk.windows, num_kv_heads=sk.num_kv_heads, head_dim=sk.head_dim,
                              rows=max_batch, dtype=model.dtype, device=model.device,
                              max_positions=getattr(model.config, "max_position_embeddings", None))
        self.steps = 0
        """Decode steps run (each a forward pass shared by every decoding sequence)."""
        self.failed_in_a_row = 0
        """Requests failed by errors in steps since a step last made a token (:meth:`probe` says whose fault)."""

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.prefilling) - len(self.decoding)

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def add(self, seq: Sequence) -> None:
        """Take a new sequence (the caller checked :attr:`free_slots`)."""
        self.prefilling.append(seq)

    def can_progress(self) -> bool:
        """True if :meth:`step` would do something now."""
        if self.decoding or any(s.cancelled for s in self.prefilling):
            return True
        return any(self._next_part(s) is None or self.model.is_ready(self._next_part(s))
                   for s in self.prefilling)

    def step(self) -> None:
        """One scheduling step (see the module docstring).

        A failure while running a prompt fails that request; one in a decode step fails the batch's
        requests. Either way the scheduler stays usable for the others and for new requests.
        """
        self._drop_cancelled()
        for seq in list(self.prefilling):
            try:
                self._advance_prefill(seq)
            except Exception as exc:  # a failing request must not stall the others
                self._abort([seq], exc)
        if self.decoding:
            try:
                self._decode()
            except Exception as exc:
                self._abort(list(self.decoding), exc)

    def probe(self) -> None:
        """Run a one-token prompt through the parts loaded, its answer dropped, and raise what the device raises:
        whether the engine can still compute at all after requests failed one after another (each its own
        fault, or the device's). Without the embeddings yet (a stage holding later layers) it runs one small
        kernel on the device instead (:func:`device_check`). Nothing else is touched: the probe takes no KV cache
        row."""
        seq = Sequence(prompt=[0], params=SamplingParams(max_tokens=1), stream=TokenStream(-1, lambda _: None))
        self.prefilling.append(seq)
        try:
            self._advance_prefill(seq)
            if seq.hidden is not None:  # a device's errors surface at a synchronisation: one read of the result
                seq.hidden.sum().item()
            else:  # nothing ran (found in review: the probe passed a stage-only worker's broken device)
                device_check(self.model.device)
        finally:
            if seq in self.prefilling:
                self.prefilling.remove(seq)

    def fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """End every sequence held with an error ``make_error()`` gives (the engine is closing), a new one each: an
        error shared by streams would gather every consumer's traceback and keep their frames alive."""
        for seq in self.prefilling + self.decoding:
            seq.stream.fail(make_error())
        self.prefilling.clear()
        self.decoding.clear()

    def _abort(self, seqs: list[Sequence], exc: Exception) -> None:
        logger.exception("engine step failed for requests %s", [s.stream.request_id for s in seqs])
        self.failed_in_a_row += len(seqs)
        for seq in seqs:  # an error each (see fail_all)
            seq.stream.fail(EngineError(f"the engine failed while running this request: {exc}"))
            if seq in self.prefilling:
                self.prefilling.remove(seq)
        if any(seq in self.decoding for seq in seqs):
            self._remove_rows(sorted(s.row for s in seqs if s in self.decoding))

    # --- prefill -------------------------------------------------------------------------------------

    def _next_part(self, seq: Sequence) -> Part | None:
        """The part ``seq`` waits for; None if it cannot progress because loading failed."""
        if self.model.failed:
            return None
        if seq.hidden is None:
            return EMBED
        return (seq.next_layer, seq.next_stage) if seq.next_layer < self.model.num_layers else HEAD

    def _advance_prefill(self, seq: Sequence) -> None:
        import torch

        m = self.model
        if m.failed and not self._can_finish_prefill(seq):
            self.prefilling.remove(seq)
            try:
                m.check_failed()
            except EngineError as exc:
                seq.stream.fail(exc)
            return
        if seq.hidden is None:
            if not m.is_ready(EMBED):
                return
            ids = torch.tensor([seq.prompt], device=m.device)
            positions = torch.arange(len(seq.prompt), device=m.device).unsqueeze(0)
            seq.hidden = m.embed(ids)
            seq.prefill = PrefillState(
                position_ids=positions,
                rope=m.position_embeddings(seq.hidden, positions),
                masks={w: prefill_mask(len(seq.prompt), w, m.device) for w in set(m.skeleton.windows)},
                cache=PrefillCache(),
            )
        p = seq.prefill
        while seq.next_layer < m.num_layers and m.is_ready((seq.next_layer, seq.next_stage)):
            seq.hidden, seq.carry = m.run_stage(seq.next_layer, seq.next_stage, seq.hidden, seq.carry,
                                                position_embeddings=p.rope, position_ids=p.position_ids,
                                                mask=p.masks[m.window(seq.next_layer)], cache=p.cache)
            seq.next_stage += 1
            if seq.next_stage == len(LAYER_STAGES):
                seq.next_layer, seq.next_stage = seq.next_layer + 1, 0
        if seq.next_layer < m.num_layers or not m.is_ready(HEAD):
            return
        # Sampled also where the token is forced: a seeded generator draws as it did where the tokens were made.
        logits = m.head(seq.hidden, last_only=True)[:, -1].float().cpu()
        token = sample_tokens(logits, [seq.params], [seq.generator])[0]
        self.failed_in_a_row = 0
        self.prefilling.remove(seq)
        if seq.next_token(token):
            return
        seq.row, seq.length = len(self.decoding), len(seq.prompt)
        self.kv.write_prompt(seq.row, p.cache, seq.length)
        seq.hidden, seq.prefill = None, None
        self.decoding.append(seq)

    def _can_finish_prefill(self, seq: Sequence) -> bool:
        m = self.model
        stages = [(seq.next_layer, s) for s in LAYER_STAGES[seq.next_stage:] if seq.next_layer < m.num_layers]
        needed = ([EMBED] if seq.hidden is None else []) + stages + list(range(seq.next_layer + 1, m.num_layers))
        return all(m.is_ready(part) for part in needed + [HEAD])

    # --- decode --------------------------------------------------------------------------------------

    def _decode(self) -> None:
        import torch

        m = self.model
        positions = [s.length for s in self.decoding]
        ids = torch.tensor([[s.last_token] for s in self.decoding], device=m.device)
        position_ids = torch.tensor(positions, device=m.device).unsqueeze(1)
        hidden = m.embed(ids)
        rope = m.position_embeddings(hidden, position_ids)
        masks = {w: decode_mask(positions, w, m.device) for w in set(m.skeleton.windows)}
        try:
            cache = self.kv.step(positions)
        except RuntimeError as exc:  # out of memory growing the cache (torch's OOM errors are RuntimeErrors)
            # Only the sequences past the room held needed more: they fail, the others go on in the next step.
            needing = [s for s in self.decoding if s.length >= self.kv.capacity]
            if len(needing) == len(self.decoding):
                raise
            self._abort(needing, exc)
            return
        for layer in range(m.num_layers):
            hidden = m.run_layer(layer, hidden, position_embeddings=rope, position_ids=position_ids,
                                 mask=masks[m.window(layer)], cache=cache)
        logits = m.head(hidden, last_only=True)[:, -1].float().cpu()
        tokens = sample_tokens(logits, [s.params for s in self.decoding], [s.generator for s in self.decoding])
        self.steps += 1
        self.failed_in_a_row = 0
        finished = []
        for seq, token in zip(self.decoding, tokens):
            seq.length += 1
            if seq.next_token(token):
                finished.append(seq.row)
        self._remove_rows(finished)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.prefilling if s.cancelled]:
            self.prefilling.remove(seq)
            seq.stream.finish(FINISH_CANCELLED)
        rows = [s.row for s in self.decoding if s.cancelled]
        for row in rows:
            self.decoding[row].stream.finish(FINISH_CANCELLED)
        self._remove_rows(rows)

    def _remove_rows(self, rows: list[int]) -> None:
        # Highest row first: every row above the one removed is then live, so the last row can fill it.
        for row in sorted(rows, reverse=True):
            last = self.decoding.pop()
            if last.row != row:
                self.kv.move_row(last.row, row, last.length)
                last.row = row
                self.decoding[row] = last
        if not self.decoding:
            self.kv.shrink()
        elif rows:  # a long request ended beside short ones: its room is not kept for them
            try:
                self.kv.fit(max(s.length for s in self.decoding) + 1, len(self.decoding))
            except RuntimeError as exc:  # no memory for the smaller copy: the cache stays as it was, usable
                logger.warning("engine: could not give back KV cache room: %s", exc)
