"""The engine: a progressively loaded model serving many requests with continuous batching.

Two daemon threads: the block loader binds blocks as they arrive; the engine thread runs the step
scheduler whenever something can progress (a request arrived, a layer was bound, sequences are
decoding). Callers on any thread or event loop submit prompts and read tokens from a
:class:`~pipecast.engine.streams.TokenStream`::

    engine = Engine(PackageFolderProvider("pkg")).start()
    async for token in engine.submit(prompt_ids, SamplingParams(max_tokens=32)):
        ...
"""

import itertools
import logging
import numbers
import threading
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pipecast.core.errors import PipecastError
from pipecast.core.strictjson import describe
from pipecast.engine.batching import Sequence, StepScheduler
from pipecast.engine.errors import (
    DeviceFaultError,
    EngineClosedError,
    EngineError,
    EngineFailedError,
    EngineOverloadedError,
    InvalidRequestError,
)
from pipecast.engine.loader import BlockLoader, check_stall_timeout, check_wait
from pipecast.engine.progressive import ProgressiveModel, check_dtype, engine_device
from pipecast.engine.providers import BlockProvider
from pipecast.engine.sampling import SamplingParams
from pipecast.engine.streams import FINISH_CANCELLED, TokenStream
from pipecast.engine.weights import package_dtype

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Requests failed in a row by errors in their steps, no token made between them, after which the engine checks
#: its device with a one-token probe: a sticky device fault fails every step while the engine thread lives on, and
#: the worker would look ready while it fails every request. A few requests of their own making (poison prompts,
#: one out of memory) only cost the probe.
PROBE_AFTER_FAILURES = 3


@dataclass(frozen=True)
class LoadProgress:
    """How much of the model is in: blocks bound out of the package's, whether it is complete, and whether
    loading failed (then it never completes: :meth:`Engine.wait_loaded` raises the error)."""

    blocks_present: int
    blocks_total: int
    fully_loaded: bool
    failed: bool = False  # last, with a default: positional and keyword construction as before still work

    @property
    def fraction(self) -> float:
        return self.blocks_present / self.blocks_total


def model_config(provider: BlockProvider) -> dict:
    """The config the model is built from: the package's config.json, its head untied where the blocks carry
    their own ``lm_head.weight`` (the manifest's ``tied_embeddings`` false) though the config ties it, as
    transformers unties such a checkpoint's head where it differs from the embeddings (a fine-tune that untied
    or resized them); where the two are equal the logits are the same either way."""
    config = provider.config
    return config if provider.manifest.tied_embeddings else {**config, "tie_word_embeddings": False}


class Engine:
    """Execute-while-load inference over a :class:`BlockProvider`. Call :meth:`start`, then submit.

    Raises :class:`UnsupportedModelError` or :class:`ModelConfigError` for a config.json it cannot run, and
    :class:`PackageMismatchError` for a package whose blocks do not hold the model config.json describes; first,
    before anything is built, what :func:`check_engine_arguments` raises.
    """

    def __init__(self, provider: BlockProvider, *, device: "str | torch.device" = "cpu",
                 dtype: "torch.dtype | None" = None, max_batch: int = 16, max_queue: int = 64,
                 stall_timeout_s: float = 600.0):
        check_engine_arguments(device, dtype, max_batch=max_batch, max_queue=max_queue,
                               stall_timeout_s=stall_timeout_s)
        self.provider = provider
        dtype = dtype or package_dtype(provider.manifest, provider.config)
        self.model = ProgressiveModel(model_config(provider), dtype=dtype, device=device)
        self.model.check_package(provider.manifest, provider.origin)
        self.loader = BlockLoader(provider, self.model, stall_timeout_s=stall_timeout_s)
        self.scheduler = StepScheduler(self.model, max_batch=max_batch)
        self.max_queue = max_queue
        self.fully_loaded = threading.Event()
        """Set once every block is bound."""
        self._cond = threading.Condition()
        self._incoming: deque[Sequence] = deque()
        self._cancelled: set[TokenStream] = set()
        self._closed = False
        self._thread_error: Exception | None = None  # what stopped the engine thread, if not close()
        # Set under _cond: the engine thread has ended its last step / close() gave up waiting for it (the thread
        # then frees the KV cache and drops the weights as it exits, with close()'s timeout for the loader).
        self._thread_done = False
        self._release_owed: float | None = None
        # Forward passes outside the engine thread (stage calls, logits) failed in a row by an error not theirs:
        # counted with the scheduler's own toward the device probe.
        self._outside_failed = 0
        #: Scheduler steps run (the engine thread's count; read by others): work going on, for the worker's health.
        self.steps = 0
        self._ids = itertools.count()
        self._max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.model.add_listener(self._on_model_change)
        self._thread = threading.Thread(target=self._run, name="pipecast-engine", daemon=True)

    def start(self) -> "Engine":
        """Start loading blocks and serving; returns at once."""
        self.loader.start()
        self._thread.start()
        return self

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- requests ------------------------------------------------------------------------------------

    def submit(self, prompt_ids: Seq[int], params: SamplingParams | None = None, *,
               generated: Seq[int] = ()) -> TokenStream:
        """Queue a prompt (token ids); return the stream of its generated token ids.

        ``generated``: tokens the request generated elsewhere (one moved off a pipeline), fed one decode step
        each after the prompt's prefill, as one node made them, before sampling goes on (the stream has the
        tokens after them): one prefill of them all rounds otherwise in bf16, and the tokens after would differ.

        Raises InvalidRequestError (bad prompt or parameters), EngineOverloadedError (queue full), ModelLoadError
        (loading failed), EngineFailedError (the engine thread died), DeviceFaultError (the engine stopped: its
        device fails every step) or EngineClosedError.
        """
        return self.submit_many([prompt_ids], params, generated=[generated])[0]

    def submit_many(self, prompts: Seq[Seq[int]],
                    params: SamplingParams | Seq[SamplingParams] | None = None, *,
                    generated: Seq[Seq[int]] | None = None) -> list[TokenStream]:
        """Queue several prompts at once (``params``: one for all or one each; ``generated``: none, or one
        sequence each, as :meth:`submit` takes): all are queued, or none is (those the batch has no room for yet
        are admitted as rows free, in order). Raises as :meth:`submit`."""
        if getattr(prompts, "ndim", None) == 2:  # a [batch, seq] tensor or array: its rows
            prompts = list(prompts)
        if not isinstance(prompts, Seq) or isinstance(prompts, str | bytes | bytearray):
            raise InvalidRequestError(f"prompts must be a sequence of prompts, got {type(prompts).__name__}")
        each = list(params) if isinstance(params, Seq) else \
            [SamplingParams() if params is None else params] * len(prompts)
        if len(each) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(each)} sampling parameters")
        for sp in each:
            if not isinstance(sp, SamplingParams):
                raise InvalidRequestError(f"sampling parameters must be SamplingParams, got {type(sp).__name__}")
        made = [()] * len(prompts) if generated is None else list(generated)
        if len(made) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(made)} sequences of generated tokens")
        checked = []
        for p, g, sp in zip(prompts, made, each):
            prompt, forced = self._check_tokens(token_ids(p)), token_ids(g)  # the prompt alone must not be empty
            self.check_prompt([*prompt, *forced], sp)  # what was generated takes positions as the prompt does
            checked.append((prompt, forced, sp))
        with self._cond:
            if self._closed:
                raise EngineClosedError()
            if self._thread_error is not None:
                raise self._stopped_by(self._thread_error)
            self.model.check_failed()
            if len(self._incoming) + len(checked) > self.max_queue:
                raise EngineOverloadedError(len(self._incoming))
            seqs = [Sequence.new(p, sp, TokenStream(next(self._ids), self._cancel), forced=g) for p, g, sp in checked]
            self._incoming.extend(seqs)
            self._cond.notify_all()
        return [seq.stream for seq in seqs]

    def generate(self, prompt_ids: Seq[int], params: SamplingParams | None = None,
                 timeout: float | None = None) -> list[int]:
        """Submit and wait: the generated token ids (blocking; for scripts and tests). A request that times out
        (or is interrupted) is cancelled."""
        check_wait(timeout)
        stream = self.submit(prompt_ids, params)
        try:
            return stream.result(timeout)
        except BaseException:
            stream.cancel()  # else it goes on running, and holding its place, for nobody
            raise

    def logits(self, input_ids: "torch.Tensor", timeout: float | None = None) -> "torch.Tensor":
        """Logits of every position of ``input_ids`` [batch, seq], computed on the calling thread.

        Waits for each part just before it is needed, each wait bounded by ``timeout`` seconds. Raises
        :class:`InvalidRequestError` unless ``input_ids`` is a non-empty [batch, seq] tensor of int64 or int32
        token ids of the vocabulary, at most the model's positions long.
        """
        import torch

        if self._closed:  # its weights are gone (close() drops them)
            raise EngineClosedError()
        check_wait(timeout)
        if not isinstance(input_ids, torch.Tensor):
            raise InvalidRequestError(f"input_ids must be a torch tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2 or not input_ids.numel() or input_ids.dtype not in (torch.int64, torch.int32):
            raise InvalidRequestError(f"input_ids must be a non-empty [batch, seq] tensor of int64 or int32 token "
                                      f"ids, got {input_ids.dtype} of shape {list(input_ids.shape)}")
        if self._max_positions and input_ids.shape[1] > self._max_positions:
            raise InvalidRequestError(f"input_ids of {input_ids.shape[1]} positions exceed the model's "
                                      f"{self._max_positions}")
        for row in input_ids.tolist():  # an id outside the vocabulary would index past the embeddings
            self._check_tokens(row)
        return self.while_open(self.model.forward_logits, input_ids, timeout)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the weights are dropped, or about to be)."""
        return self._closed

    def while_open(self, compute: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``compute(*args, **kwargs)`` on this model's weights (a forward pass run outside the engine thread, as
        :meth:`logits` and pipeline stage calls are); :class:`EngineClosedError` instead once the engine is closed,
        also when it closed during the call, and :class:`DeviceFaultError` once the engine stopped for one.

        Its failures count toward the device probe as the engine's own requests' do: after
        :data:`PROBE_AFTER_FAILURES` in a row (engine steps and these together) that are neither this project's
        typed errors (a bad input, a session unknown), a wait for layers that timed out, nor out of memory, the
        engine thread runs its one-token probe; a success here counts afresh."""
        if self._closed:  # its weights are gone (close() drops them)
            raise EngineClosedError()
        if isinstance(self._thread_error, DeviceFaultError):
            raise self._stopped_by(self._thread_error)
        try:
            result = compute(*args, **kwargs)
        except Exception as exc:
            if self._closed:  # close() dropped the weights this pass was using: whatever failed, that is why
                raise EngineClosedError() from None
            if not isinstance(exc, PipecastError | TimeoutError) and not _out_of_memory(exc):
                with self._cond:
                    self._outside_failed += 1
                    self._cond.notify_all()
            raise
        if self._closed:  # computed in part from the meta tensors close() left: not a result
            raise EngineClosedError()
        if self._outside_failed:
            with self._cond:
                self._outside_failed = 0
        return result

    def check_prompt(self, prompt_ids: Seq[int], params: SamplingParams) -> list[int]:
        """The prompt as a list, if the model can take it with ``params``; else :class:`InvalidRequestError`
        (not integers, empty, token ids outside the vocabulary, more positions than the model has)."""
        prompt = self._check_tokens(token_ids(prompt_ids))
        if self._max_positions and len(prompt) + params.max_tokens > self._max_positions:
            raise InvalidRequestError(f"prompt of {len(prompt)} tokens plus max_tokens {params.max_tokens} "
                                      f"exceeds the model's {self._max_positions} positions")
        return prompt

    def _check_tokens(self, prompt: list[int]) -> list[int]:
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                      f"(0-{self.model.vocab_size - 1})")
        return prompt

    def _cancel(self, stream: TokenStream) -> None:
        with self._cond:
            # One still queued leaves at once: left for the engine thread, it would hold its place in the
            # queue (and count against max_queue) until a batch slot frees.
            queued = next((seq for seq in self._incoming if seq.stream is stream), None)
            if queued is not None:
                self._incoming.remove(queued)
                stream.finish(FINISH_CANCELLED)
                return
            self._cancelled.add(stream)
            self._cond.notify_all()

    # --- state ---------------------------------------------------------------------------------------

    def progress(self) -> LoadProgress:
        """Blocks bound so far out of the package's."""
        loaded = self.model.fully_loaded
        # The loader stamps a block just after its last tensor is bound: a loaded model has them all.
        bound = self.provider.num_blocks if loaded else self.loader.blocks_bound
        return LoadProgress(bound, self.provider.num_blocks, loaded, failed=self.model.failed)

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until every block is bound; raise ModelLoadError if loading failed, EngineClosedError if the engine
        closed before, TimeoutError."""
        check_wait(timeout)
        with self._cond:
            if not self._cond.wait_for(lambda: self.model.fully_loaded or self.model.failed, timeout):
                raise TimeoutError(f"model not fully loaded within {timeout:g} s "
                                   f"({self.loader.blocks_bound}/{self.provider.num_blocks} blocks)")
        self.model.check_failed()

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving: pending and running requests, and :meth:`logits` (any :meth:`while_open`), fail with
        EngineClosedError; threads are joined, then the weights and the KV cache are dropped.

        A thread still running after ``timeout`` seconds (the engine thread in a long step, the loader in a block
        origin's call) is left to end: the engine thread then fails its requests, frees the KV cache and drops the
        weights as it exits (once the loader has ended, waiting up to ``timeout`` for it)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        loader_stopped = self.loader.stop(timeout)
        if not self.model.fully_loaded:
            self.model.fail(EngineClosedError())
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._cond:  # the engine thread reads the flag under the same lock: one of the two releases
            thread_done = self._thread_done or not self._thread.is_alive()
            if not thread_done:
                self._release_owed = timeout
        if thread_done:
            self._fail_unfinished()
            # The loader may have ended during the engine thread's join: asked again, not taken as still running.
            self._release(loader_stopped or self.loader.stop(0))
        self.model.clear_listeners()  # the weights go with the last reference, not at the next cyclic collection

    def _release(self, loader_stopped: bool) -> None:
        """Free the KV cache, and drop the weights if the loader has ended (the engine thread has)."""
        self.scheduler.kv.free()
        if loader_stopped:  # else a thread still running could bind or use a weight after they are dropped
            self._drop_weights()
        else:
            logger.warning("engine: the block loader did not stop; the weights are left to it")

    def _drop_weights(self) -> None:
        """Put every parameter back on the meta device. On CPU they are views of the provider's buffers (the
        agent's shared memory): held on, they would keep the agent client from unmapping it when it closes
        (a BufferError it swallows) while the agent counts the package freed; on a GPU they are copies."""
        self.model.skeleton.model.to_empty(device="meta")

    def _fail_unfinished(self, stopped_by: Exception | None = None) -> None:
        """End every request held with :class:`EngineClosedError`, or with what a request gets from an engine whose
        thread ``stopped_by`` stopped (:meth:`_stopped_by`); a new error for each request."""
        def make_error() -> EngineError:
            return EngineClosedError() if stopped_by is None else self._stopped_by(stopped_by)

        self.scheduler.fail_all(make_error)
        with self._cond:
            for seq in self._incoming:
                seq.stream.fail(make_error())
            self._incoming.clear()

    def _on_model_change(self) -> None:
        if self.model.fully_loaded:
            self.fully_loaded.set()
        with self._cond:
            self._cond.notify_all()

    # --- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        import torch

        error = None
        try:
            with torch.inference_mode():
                while self._next_step():
                    if self.scheduler.active:  # else woken for the probe alone
                        self.scheduler.step()
                        self.steps += 1
                    if self._failed_in_a_row() >= PROBE_AFTER_FAILURES:
                        self._probe()
        except DeviceFaultError as exc:
            logger.error("%s", exc)
            with self._cond:
                self._thread_error = error = exc
        except Exception as exc:  # a bug outside step()'s guards: fail the requests rather than leave them waiting
            logger.exception("the engine thread failed")
            with self._cond:
                self._thread_error = error = exc  # refuse later requests: nothing would run them
        self._fail_unfinished(error)
        with self._cond:
            self._thread_done = True
            owed = self._release_owed
        if owed is not None:  # close() gave up waiting for this thread's last step: what it would have done
            self._release(self.loader.stop(owed))

    def _failed_in_a_row(self) -> int:
        """Requests failed in a row: in the engine's steps, and forward passes outside them (:meth:`while_open`)."""
        return self.scheduler.failed_in_a_row + self._outside_failed

    def _probe(self) -> None:
        """After :data:`PROBE_AFTER_FAILURES` requests failed in a row: raise :class:`DeviceFaultError` if a
        one-token probe fails too, else count afresh (the failures were the requests' own)."""
        failed = self._failed_in_a_row()
        try:
            self.scheduler.probe()
        except Exception as exc:
            if not _out_of_memory(exc):
                raise DeviceFaultError(failed, exc) from exc
            logger.warning("engine: %d requests failed in a row, and a one-token probe ran out of memory: %s",
                           failed, exc)
        else:
            logger.info("engine: %d requests failed in a row, but a one-token probe ran: their own errors", failed)
        self.scheduler.failed_in_a_row = 0
        with self._cond:
            self._outside_failed = 0

    @property
    def failure(self) -> str | None:
        """Why the engine thread stopped running requests (its device fails every step, or a bug outside a step's
        guards), None while it runs."""
        error = self._thread_error
        return None if error is None else str(self._stopped_by(error))

    @staticmethod
    def _stopped_by(error: Exception) -> EngineError:
        """The error a request gets from an engine whose thread ``error`` stopped (a new one each time)."""
        if isinstance(error, DeviceFaultError):
            return DeviceFaultError(error.failed, error.error)
        return EngineFailedError(error)

    def _next_step(self) -> bool:
        """Wait until a step can make progress and admit new sequences; False once closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._cancelled
                                or (self._incoming and self.scheduler.free_slots > 0)
                                or self.scheduler.can_progress()
                                or self._failed_in_a_row() >= PROBE_AFTER_FAILURES)
            if self._closed:
                return False
            for seq in self.scheduler.prefilling + self.scheduler.decoding:  # queued ones left in _cancel
                if seq.stream in self._cancelled:
                    seq.cancelled = True
            self._cancelled.clear()
            while self._incoming and self.scheduler.free_slots > 0:
                self.scheduler.add(self._incoming.popleft())
            return True


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed (memory taken by the requests running comes back): torch's
    OutOfMemoryError, or a plain RuntimeError saying so (the CPU allocator's, a CUDA library's)."""
    import torch

    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or any(
        words in text for words in ("out of memory", "can't allocate memory", "alloc_failed"))


def check_engine_arguments(device: "str | torch.device", dtype: "torch.dtype | None", *, max_batch: int,
                           max_queue: int, stall_timeout_s: float) -> None:
    """Raise :class:`DeviceError` for a ``device`` or ``dtype`` (None: the package's) the engine cannot run in here,
    :class:`InvalidRequestError` for ``max_batch`` or ``max_queue`` that is not an integer >= 1 (0 slots would
    leave every request waiting, a string stop the engine thread) or a ``stall_timeout_s`` that is not a positive
    number of seconds; for callers that must know before they do other work (``pipecast.load`` asks the agent)."""
    engine_device(device)
    if dtype is not None:
        check_dtype(dtype)
    for name, value in (("max_batch", max_batch), ("max_queue", max_queue)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name} must be an integer >= 1, got {describe(value)}")
    check_stall_timeout(stall_timeout_s)


def token_ids(ids: Any) -> list[int]:
    """``ids`` (a sequence of ints or numpy integers, or a 1-D integer tensor or array) as a list of ints.

    :class:`InvalidRequestError` naming what is not a token id (a float, a bool, a string, a nested list, a
    float tensor): ``int()`` would silently turn 5.9 into 5 and "5" into 5, another prompt than the one sent.
    """
    if hasattr(ids, "dtype"):  # a tensor or an array: its dtype says whether it holds integers
        check_integer_dtype(ids)
        ids = ids.tolist()
    # Not a set or a dict (its order is not the prompt's), nor bytes (bytes are no token ids).
    if not isinstance(ids, Seq) or isinstance(ids, str | bytes | bytearray):
        raise InvalidRequestError(f"token ids must be a sequence of integers, got {type(ids).__name__}")
    items = list(ids)
    if all(type(t) is int for t in items):  # the common case, checked ~10x faster (a long prompt, on the loop)
        return items
    for position, t in enumerate(items):
        if isinstance(t, bool) or not (isinstance(t, numbers.Integral) or _integer_scalar(t)):
            raise InvalidRequestError(f"token ids must be integers, got {describe(t)} ({type(t).__name__}) "
                                      f"at position {position}")
    return [int(t) for t in items]


def check_integer_dtype(ids: Any) -> None:
    """:class:`InvalidRequestError` unless ``ids``, a tensor or an array, is of integers."""
    if not _integer_dtype(ids.dtype):
        raise InvalidRequestError(f"token ids must be integers, got a {type(ids).__name__} of {ids.dtype}")


def _integer_dtype(dtype: Any) -> bool:
    """Whether a numpy or torch dtype is of integers (bool is not: True is no token id)."""
    kind = getattr(dtype, "kind", None)  # numpy's: "i" or "u" for integers
    if kind is not None:
        return kind in ("i", "u")
    return not (dtype.is_floating_point or dtype.is_complex) and str(dtype) != "torch.bool"


def _integer_scalar(value: Any) -> bool:
    """A 0-d integer tensor or array (what indexing one yields)."""
    return getattr(value, "ndim", None) == 0 and _integer_dtype(value.dtype)
