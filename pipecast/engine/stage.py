"""Stages of cross-node pipelines: a layer range of the model run for requests served elsewhere.

While a package is still arriving, a node holding layers 0-14 and another holding 15-29 serve together
(``control_plane.planner.pipelines``): the first stage embeds the tokens and runs its layers, each next
stage runs its own on the hidden states it is sent, the last applies the head and samples the token.
:class:`StageRunner` is one node's side of that: a session per pipelined request, holding the keys and
values of this node's layers only, so decoding goes on through the pipeline one token per round.

Each layer is waited for just before it runs (execute-while-load inside a stage), each wait bounded by
the call's timeout. The arithmetic is the engine's: the same modules, masks and rotary embeddings, and a
cache that grows by concatenation as transformers' does, so greedy tokens through a pipeline are the
single-node ones bit for bit (the exactness tests check it for 2, 3 and 8 stages). Calls of one session
must come in order; calls of different sessions may run on different threads at once.
"""

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pipecast.engine.errors import EngineError, InvalidRequestError
from pipecast.engine.kv_cache import decode_mask, prefill_mask
from pipecast.engine.sampling import SamplingParams, new_generator, sample_tokens
from pipecast.engine.weights import EMBED, FINAL_NORM, HEAD, LM_HEAD, Part

if TYPE_CHECKING:
    import torch

    from pipecast.engine.progressive import ProgressiveModel

log = logging.getLogger(__name__)

#: Sessions not called for this long are dropped (their head stage died or forgot to close them) (s).
SESSION_IDLE_S = 120.0
#: Most sessions one node keeps at once; a new session beyond it is refused.
MAX_SESSIONS = 256
#: The parts :meth:`StageRunner.sample` reads.
SAMPLE_PARTS = (LM_HEAD,)


class StageSessionError(EngineError):
    """A stage call that does not fit the session's state: unknown session, out-of-order position, a
    different layer range (the caller's fault, or this node lost the session: it restarted or expired it)."""


class StageCapacityError(EngineError):
    """This node holds :data:`MAX_SESSIONS` pipelined sessions already (retry elsewhere or later)."""

    def __init__(self, sessions: int):
        super().__init__(f"this node already runs {sessions} pipelined sessions")
        self.sessions = sessions


@dataclass(frozen=True)
class StageOutput:
    """What a stage call produced: the hidden states for the next stage (in host memory), or, from the last
    stage, the sampled token (and the last position's logits, float32, when asked for); ``seconds``: the
    call's time less its waits for layers, ``cpu_seconds``: its thread's CPU time (what the computing took,
    for a head's estimates)."""

    hidden: "torch.Tensor | None" = None
    token: int | None = None
    logits: "torch.Tensor | None" = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0


class _AppendCache:
    """Keys and values of one session's layers, grown by concatenation (transformers' dynamic cache); a
    sliding-window layer (``windows``: each layer's size or None) keeps only the keys its next step attends
    over (transformers' sliding-window cache layer, and :func:`~pipecast.engine.kv_cache.window_start`)."""

    def __init__(self, windows: Sequence[int | None]) -> None:
        self.windows = windows
        self.keys: dict[int, "torch.Tensor"] = {}
        self.values: dict[int, "torch.Tensor"] = {}

    def update(self, keys: "torch.Tensor", values: "torch.Tensor",
               layer_idx: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        import torch

        if layer_idx in self.keys:
            keys = torch.cat([self.keys[layer_idx], keys], dim=-2)
            values = torch.cat([self.values[layer_idx], values], dim=-2)
        window = self.windows[layer_idx]
        keep = 0 if window is None else max(keys.shape[-2] - window + 1, 0)
        self.keys[layer_idx], self.values[layer_idx] = keys[:, :, keep:], values[:, :, keep:]
        return keys, values


@dataclass
class _Deadline:
    """One call's deadline: the monotonic instant ``at`` and the ``seconds`` it was given; ``waited``
    counts the seconds the call spent waiting for its layers."""

    at: float
    seconds: float
    waited: float = 0.0


@dataclass
class _Session:
    layers: range
    params: SamplingParams
    generator: "torch.Generator | None"
    cache: _AppendCache
    length: int = 0  # positions cached
    used_at: float = 0.0
    busy_until: float = 0.0  # the deadline of its last step: later stages may compute it until then
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call at a time


def check_final_norm(normed: "torch.Tensor", width: int) -> None:
    """Raise :class:`InvalidRequestError` unless ``normed`` is a last stage's final norm of one position."""
    if normed.dim() != 3 or tuple(normed.shape[:2]) != (1, 1) or normed.shape[2] != width:
        raise InvalidRequestError(f"the final norm must be [1, 1, {width}], got {list(normed.shape)}")


class StageRunner:
    """Runs layer ranges of ``model`` for pipelined sessions (module docstring)."""

    def __init__(self, model: "ProgressiveModel", *, idle_s: float = SESSION_IDLE_S,
                 max_sessions: int = MAX_SESSIONS, clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    @property
    def sessions(self) -> int:
        """Sessions held now."""
        with self._lock:
            return len(self._sessions)

    def live_sessions(self) -> int:
        """Sessions that may still get a call: one running, or whose last step's deadline has not passed (one whose
        head went away without closing it is held until it expires, but is not live)."""
        now = self._clock()
        with self._lock:
            return sum(1 for state in self._sessions.values() if state.lock.locked() or now < state.busy_until)

    def holds(self, session: str) -> bool:
        """Whether ``session`` is held here (opened and neither closed nor expired)."""
        with self._lock:
            return session in self._sessions

    def run(self, session: str, layers: range, position: int, *, tokens: Sequence[int] | None = None,
            hidden: "torch.Tensor | None" = None, params: SamplingParams | None = None,
            want_logits: bool = False, norm_only: bool = False, timeout: float) -> StageOutput:
        """Run ``layers`` for ``session`` on the tokens at ``position`` onwards.

        The first stage (``layers`` from 0) gets ``tokens`` (the prompt at position 0, then one token a
        call), the others ``hidden`` [1, n, hidden_size]; the last stage (``layers`` to the model's end)
        returns the sampled token, or with ``norm_only`` the last position's final norm [1, 1, hidden_size]
        for the first stage to finish with :meth:`sample` (a tied LM head is the embeddings, which the
        first stage holds). A call at position 0 opens the session (``params``: how the stage that samples
        samples); later calls must continue where the previous one ended, within the model's positions.
        The parts the call needs are waited for within ``timeout`` seconds in all (TimeoutError beyond).
        Raises :class:`StageSessionError`, :class:`StageCapacityError`, :class:`InvalidRequestError` for bad
        inputs.
        """
        import torch

        m = self.model
        first, last = layers.start == 0, layers.stop == m.num_layers
        if not self._in_model(layers):
            raise InvalidRequestError(f"layers {layers.start}-{layers.stop - 1} are not a range of the model's "
                                      f"{m.num_layers} layers")
        if first == (tokens is None) or first == (hidden is not None):
            got = "token ids" if tokens is not None else "hidden states" if hidden is not None else "neither"
            raise InvalidRequestError("the first stage takes token ids, the others hidden states"
                                      f" (layers {layers.start}-{layers.stop - 1} got {got})")
        width = m.config.hidden_size
        if not first and (hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[2] != width):
            raise InvalidRequestError(f"hidden states must be [1, positions, {width}], got {list(hidden.shape)}")
        n = len(tokens) if first else hidden.shape[1]
        if n < 1 or (n > 1 and position > 0):
            raise InvalidRequestError(f"a call carries the whole prompt at position 0 or one token after it; "
                                      f"got {n} positions at {position}")
        limit = getattr(m.config, "max_position_embeddings", None)
        if limit and position + n > limit:  # a session's keys and values never grow past the model
            raise InvalidRequestError(f"positions {position}-{position + n - 1} exceed the model's {limit}")
        started, cpu = time.monotonic(), time.thread_time()
        deadline = _Deadline(started + timeout, timeout)
        state = self._session(session, layers, position, params)
        with state.lock:
            if state.length != position:
                raise StageSessionError(f"session {session!r} is at position {state.length}, the call is at "
                                        f"{position}")
            state.busy_until = max(state.busy_until, self._clock() + timeout)
            try:
                with torch.inference_mode():
                    if first:
                        self._wait(EMBED, deadline)
                        if not all(0 <= t < m.vocab_size for t in tokens):  # before torch: past int64 too
                            raise InvalidRequestError(f"token ids outside the vocabulary (0-{m.vocab_size - 1})")
                        ids = torch.tensor([list(tokens)], device=m.device)
                        hidden = m.embed(ids)
                    else:
                        hidden = hidden.to(device=m.device, dtype=m.dtype)
                    out = self._forward(state, hidden, position, deadline, last, want_logits, norm_only)
            except BaseException:
                self.close(session)  # some layers may have cached this call's keys: the session is spent
                raise
            state.length, state.used_at = position + n, self._clock()
        elapsed = time.monotonic() - started
        log.debug("stage call %s layers %d-%d at %d: %d position(s) in %.3f s, %.3f s of it waiting for layers",
                  session[:8], layers.start, layers.stop - 1, position, n, elapsed, deadline.waited)
        return replace(out, seconds=max(elapsed - deadline.waited, 0.0), cpu_seconds=time.thread_time() - cpu)

    def sample(self, session: str, normed: "torch.Tensor", *, want_logits: bool = False,
               timeout: float) -> StageOutput:
        """Apply the LM head to the last stage's final norm (:meth:`run` with ``norm_only``) and sample
        the token with ``session``'s parameters; the first stage calls this."""
        import torch

        m = self.model
        check_final_norm(normed, m.config.hidden_size)
        with self._lock:
            state = self._sessions.get(session)
        if state is None:
            raise StageSessionError(f"session {session!r} is not held here (expired, or this node restarted)")
        started, cpu = time.monotonic(), time.thread_time()
        deadline = _Deadline(started + timeout, timeout)
        with state.lock, torch.inference_mode():
            self._wait(LM_HEAD, deadline)
            out = self._sample(state, m.lm_head(normed.to(device=m.device, dtype=m.dtype)), want_logits)
            state.used_at = self._clock()
        return replace(out, seconds=max(time.monotonic() - started - deadline.waited, 0.0),
                       cpu_seconds=time.thread_time() - cpu)

    def parts(self, layers: range, *, norm_only: bool = False) -> list[Part]:
        """The parts a :meth:`run` of ``layers`` reads: the embeddings for the first stage, its layers, and for
        the last the final norm (``norm_only``) or the head; :data:`SAMPLE_PARTS` for :meth:`sample`. Empty
        for a range that is not the model's (:meth:`run` refuses it, naming why)."""
        if not self._in_model(layers):
            return []
        first, last = layers.start == 0, layers.stop == self.model.num_layers
        return [*([EMBED] if first else []), *layers, *([FINAL_NORM if norm_only else HEAD] if last else [])]

    def waiter(self, parts: Sequence[Part]) -> Callable[[float], None] | None:
        """None when every one of ``parts`` is bound; else a function that waits for the missing ones within
        its ``timeout`` argument in all (TimeoutError beyond), for a caller that waits before it computes."""
        missing = [part for part in parts if not self.model.is_ready(part)]
        if not missing:
            return None

        def wait(timeout: float) -> None:
            deadline = _Deadline(time.monotonic() + timeout, timeout)
            for part in missing:
                self._wait(part, deadline)

        return wait

    def close(self, session: str) -> bool:
        """Forget ``session`` (its request ended); False if it was not held."""
        with self._lock:
            return self._sessions.pop(session, None) is not None

    def expire(self) -> int:
        """Drop sessions idle for longer than ``idle_s``, none with a call running (one waiting long for its
        layers is not idle) and none before its last step's deadline (the step goes on in later stages while
        this one waits for their answer); the number dropped."""
        with self._lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        now = self._clock()
        stale = [s for s, state in self._sessions.items()
                 if now - max(state.used_at, state.busy_until - self.idle_s) > self.idle_s
                 and not state.lock.locked()]
        for s in stale:
            del self._sessions[s]
        return len(stale)

    def _session(self, session: str, layers: range, position: int, params: SamplingParams | None) -> _Session:
        with self._lock:
            state = self._sessions.get(session)
            if position == 0:
                if state is not None:
                    raise StageSessionError(f"session {session!r} is open already")
                # full: idle ones go first (the worker's timer drops them too, but only every so often)
                if len(self._sessions) >= self.max_sessions and not self._expire_locked():
                    raise StageCapacityError(len(self._sessions))
                params = params or SamplingParams()
                state = _Session(layers, params, new_generator(params), _AppendCache(self.model.skeleton.windows),
                                 used_at=self._clock())
                self._sessions[session] = state
            elif state is None:
                raise StageSessionError(f"session {session!r} is not held here (expired, or this node restarted)")
            elif state.layers != layers:
                raise StageSessionError(f"session {session!r} runs layers {state.layers.start}-"
                                        f"{state.layers.stop - 1} here, the call asks for {layers.start}-"
                                        f"{layers.stop - 1}")
            return state

    def _in_model(self, layers: range) -> bool:
        return 0 <= layers.start < layers.stop <= self.model.num_layers and layers.step == 1

    def _wait(self, part, deadline: _Deadline) -> None:
        """Until ``part`` is bound; every wait of one call shares the call's deadline."""
        if not self.model.is_ready(part):
            since = time.monotonic()
            try:
                self.model.wait_ready(part, max(deadline.at - since, 0.0), deadline_s=deadline.seconds)
            finally:
                deadline.waited += time.monotonic() - since

    @staticmethod
    def _sample(state: _Session, logits: "torch.Tensor", want_logits: bool) -> StageOutput:
        """The session's next token from the LM head's output [1, positions, vocab]."""
        last = logits[:, -1].float().cpu()
        token = sample_tokens(last, [state.params], [state.generator])[0]
        return StageOutput(token=token, logits=last[0] if want_logits else None)

    def _forward(self, state: _Session, hidden: "torch.Tensor", position: int, deadline: _Deadline, last: bool,
                 want_logits: bool, norm_only: bool) -> StageOutput:
        import torch

        m = self.model
        n = hidden.shape[1]
        positions = torch.arange(position, position + n, device=m.device).unsqueeze(0)
        rope = m.position_embeddings(hidden, positions)
        windows = set(m.skeleton.windows)
        masks = ({w: prefill_mask(n, w, m.device) for w in windows} if position == 0
                 else {w: decode_mask([position], w, m.device) for w in windows})
        for layer in state.layers:
            self._wait(layer, deadline)
            hidden = m.run_layer(layer, hidden, position_embeddings=rope, position_ids=positions,
                                 mask=masks[m.window(layer)], cache=state.cache)
        # Hidden states go over the network next: copied to the host here, on the stage's thread, which on
        # an accelerator also waits for the kernels (so the call's seconds are its compute, and the event
        # loop that sends them never waits on the device).
        if not last:
            return StageOutput(hidden=hidden.cpu())
        if norm_only:
            self._wait(FINAL_NORM, deadline)
            return StageOutput(hidden=m.final_norm(hidden, last_only=True).cpu())
        self._wait(HEAD, deadline)
        return self._sample(state, m.head(hidden, last_only=True), want_logits)
