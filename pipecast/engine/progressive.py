"""The layer-wise model: transformers' own modules, driven one decoder layer at a time.

The model is built from config.json with no weights; blocks are bound as they arrive (by the loader), and
each part (embeddings, layer i, head), and each stage of a layer, becomes usable the moment its last tensor
is bound. Compute methods run one step of the forward pass; they never wait.
:meth:`ProgressiveModel.forward_logits` is the one convenience that walks the whole model, waiting for
each part just before it needs it.
"""

import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from pipecast.engine.architectures import build_skeleton
from pipecast.engine.errors import BlockBindError, DeviceError, EngineClosedError, ModelLoadError, PackageMismatchError
from pipecast.engine.weights import ATTENTION, EMBED, FINAL_NORM, HEAD, LM_HEAD, MLP_IN, Part, WeightBinder

if TYPE_CHECKING:
    import torch

    from pipecast.v1.manifest_pb2 import Manifest


ENGINE_DTYPES = ("float16", "bfloat16", "float32", "float64")


def engine_device(device: "torch.device | str") -> "torch.device":
    """``device`` as a ``torch.device`` the engine can run on here (the CPU, or a CUDA device this host has, with
    its index: ``cuda`` is the calling thread's current device); :class:`DeviceError` otherwise."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError("device", device, "not a torch device (use cpu, cuda or cuda:N)") from None
    if parsed.type not in ("cpu", "cuda"):  # the weight binder copies to CUDA devices only
        raise DeviceError("device", device, "the engine runs on cpu or cuda devices only")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("device", device, "CUDA is not available on this host")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise DeviceError("device", device, f"this host has {count} CUDA device(s)")
        if parsed.index is None:  # the caller's current device, fixed here: each thread's current device is its
            parsed = torch.device("cuda", torch.cuda.current_device())  # own, and new threads start on device 0
    return parsed


def check_dtype(dtype: "torch.dtype") -> "torch.dtype":
    """``dtype`` if the engine can run in it (a floating-point ``torch.dtype``, not a string); else
    :class:`DeviceError`."""
    import torch

    if not isinstance(dtype, torch.dtype) or str(dtype).removeprefix("torch.") not in ENGINE_DTYPES:
        raise DeviceError("dtype", dtype, f"not a dtype the engine runs in (torch.{', torch.'.join(ENGINE_DTYPES)})")
    return dtype


class ProgressiveModel:
    """A decoder-only causal LM whose parameters are bound block by block while it already runs."""

    def __init__(self, config: dict, *, dtype: "torch.dtype", device: "torch.device | str" = "cpu"):
        """Raises :class:`DeviceError` for a ``device`` or ``dtype`` the engine cannot run in here (checked
        first: building the skeleton would blame config.json for them, or fail only when a block binds)."""
        self.device = engine_device(device)
        self.dtype = check_dtype(dtype)
        self.skeleton = build_skeleton(config, dtype=dtype, device=self.device)
        self.config = self.skeleton.model.config
        self.num_layers = self.config.num_hidden_layers
        self.vocab_size = self.config.vocab_size
        self._inner = self.skeleton.model.model
        self._binder = WeightBinder(self.skeleton.model, dtype=dtype, device=self.device,
                                    tied_embeddings=self.skeleton.tied_embeddings,
                                    sandwich_norms=self.skeleton.sandwich_norms)
        self._logit_cap = getattr(self.config, "final_logit_softcapping", None)
        self._cond = threading.Condition()
        self._ready: set[Part] = set()
        self._error: Exception | None = None
        self._listeners: list[Callable[[], None]] = []
        self.layer_first_run_at: dict[int, float] = {}
        """``time.monotonic()`` at which each layer first ran (evidence of execute-while-load)."""

    # --- loading -------------------------------------------------------------------------------------

    def bind_block(self, index: int, layers: range, tensors: Mapping[str, "torch.Tensor"], origin: str) -> None:
        """Bind block ``index`` (holding ``layers``) and publish the parts it completes."""
        self.bind_tensors(index, tensors, origin)
        self.check_block(index, layers, origin)

    def bind_tensors(self, index: int, tensors: Mapping[str, "torch.Tensor"], origin: str) -> None:
        """Bind some of block ``index``'s tensors and publish the parts (layers) they complete."""
        done = self._binder.bind(index, tensors, origin)
        if done:
            with self._cond:
                self._ready |= done
                self._cond.notify_all()
            self._notify()

    def check_block(self, index: int, layers: range, origin: str) -> None:
        """Raise :class:`BlockBindError` if block ``index``, wholly bound, left any of ``layers`` incomplete."""
        incomplete = sorted(n for layer in layers for n in self._binder.missing(layer))
        if incomplete:
            raise BlockBindError(index, origin, f"holds layers {layers.start}-{layers.stop - 1} but lacks "
                                                f"tensors {incomplete[:8]}")

    def check_package(self, manifest: "Manifest", origin: str) -> None:
        """Raise :class:`PackageMismatchError` unless ``manifest``'s blocks hold exactly this model's layers and
        every parameter it binds (loading would otherwise fail halfway, or never complete)."""
        if manifest.num_layers != self.num_layers:
            raise PackageMismatchError(origin, f"config.json has {self.num_layers} layers but the blocks hold "
                                               f"{manifest.num_layers}")
        self.check_complete(origin, held={name for block in manifest.blocks for name in block.tensor_names})

    def check_complete(self, origin: str, held: Collection[str] = ()) -> None:
        """Raise :class:`PackageMismatchError` if some parameter is neither bound nor among ``held`` (names of
        tensors still to come): the model could never be wholly loaded."""
        missing = self._binder.unbound(held)
        if missing:
            raise PackageMismatchError(origin, f"no block holds {len(missing)} of its parameters: {missing[:8]}")

    def fail(self, error: Exception) -> None:
        """Record that loading failed: waiters and later calls raise :class:`ModelLoadError`."""
        with self._cond:
            self._error = error
            self._cond.notify_all()
        self._notify()

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the loader thread) whenever parts become ready or loading fails."""
        self._listeners.append(callback)

    def clear_listeners(self) -> None:
        """Call no listener any more: a closed engine's (its bound method made a cycle that kept every weight in
        memory until the cyclic garbage collector ran) and those of whoever served it."""
        self._listeners = []

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    @property
    def failed(self) -> bool:
        """True if loading failed (some parts will never be bound)."""
        return self._error is not None

    def check_failed(self) -> None:
        """Raise :class:`ModelLoadError` (caused by the original error) if loading failed; if the engine closed
        before it completed, :class:`EngineClosedError` (a new one each call)."""
        if isinstance(self._error, EngineClosedError):  # not a failure of the model: callers tell the two apart
            raise EngineClosedError()
        if self._error is not None:
            raise ModelLoadError(f"loading the model failed: {self._error}") from self._error

    def is_ready(self, part: Part) -> bool:
        """True if ``part`` (a layer index, EMBED, HEAD or a layer's stage) can run now."""
        return part in self._ready

    @property
    def fully_loaded(self) -> bool:
        """True once every part is bound."""
        return self.is_ready(EMBED) and self.is_ready(HEAD) and all(map(self.is_ready, range(self.num_layers)))

    def wait_ready(self, part: Part, timeout: float | None, *, deadline_s: float | None = None) -> None:
        """Block until ``part`` is bound; raise ModelLoadError if loading failed, EngineClosedError if the engine
        closed before it was, TimeoutError on timeout.

        ``deadline_s`` is the whole deadline the error names when ``timeout`` is what is left of it.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: part in self._ready or self._error is not None, timeout):
                raise TimeoutError(f"{_part_name(part)} not loaded within {deadline_s or timeout:.3g} s")
            if part not in self._ready:
                self.check_failed()

    # --- compute (callers hold torch.inference_mode) -------------------------------------------------

    def embed(self, input_ids: "torch.Tensor") -> "torch.Tensor":
        """Token embeddings, [batch, seq] -> [batch, seq, hidden]."""
        return self._inner.embed_tokens(input_ids)

    def position_embeddings(self, hidden: "torch.Tensor",
                            position_ids: "torch.Tensor") -> dict[str | None, tuple["torch.Tensor", "torch.Tensor"]]:
        """Rotary (cos, sin) for ``position_ids`` [batch, seq], computed from the config as transformers does:
        one pair per rotary variant the layers use (keyed as ``skeleton.rope_types``; Gemma 3's local and
        global layers differ), for :meth:`run_layer` and :meth:`run_stage` to pick each layer's from."""
        rotary = self.skeleton.rotary
        return {t: rotary(hidden, position_ids) if t is None else rotary(hidden, position_ids, t)
                for t in set(self.skeleton.rope_types)}

    def run_layer(self, layer: int, hidden: "torch.Tensor", *, position_embeddings: Mapping[str | None, tuple],
                  position_ids: "torch.Tensor", mask: "torch.Tensor | None", cache: Any) -> "torch.Tensor":
        """Run decoder layer ``layer``; ``cache`` has ``update(k, v, layer_idx) -> (k, v)`` or is None."""
        self._mark_run(layer)
        return self._inner.layers[layer](hidden, attention_mask=mask, position_ids=position_ids,
                                         position_embeddings=self._layer_rope(position_embeddings, layer),
                                         past_key_values=cache, use_cache=cache is not None)

    def run_stage(self, layer: int, stage: int, hidden: "torch.Tensor", carry: "torch.Tensor | None", *,
                  position_embeddings: Mapping[str | None, tuple], position_ids: "torch.Tensor",
                  mask: "torch.Tensor | None", cache: Any) -> tuple["torch.Tensor", "torch.Tensor | None"]:
        """Run one stage of decoder layer ``layer``: ``(hidden, carry)`` in, ``(hidden, carry)`` for the next
        stage out (``carry`` is the MLP's inner activation between MLP_IN and MLP_OUT, else None).

        The three stages are the decoder layer's forward (the supported types share one, Gemma's adding its
        sandwich norms) cut in three: the same modules and tensor operations in the same order, so the result
        is bitwise :meth:`run_layer`'s (the exactness tests run prefills this way).
        """
        module = self._inner.layers[layer]
        mlp = module.mlp
        sandwich = self.skeleton.sandwich_norms
        if stage == ATTENTION:
            self._mark_run(layer)
            attended, _ = module.self_attn(hidden_states=module.input_layernorm(hidden), attention_mask=mask,
                                           position_ids=position_ids, past_key_values=cache,
                                           use_cache=cache is not None,
                                           position_embeddings=self._layer_rope(position_embeddings, layer))
            return hidden + (module.post_attention_layernorm(attended) if sandwich else attended), None
        if stage == MLP_IN:
            normed = (module.pre_feedforward_layernorm if sandwich else module.post_attention_layernorm)(hidden)
            return hidden, mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed)
        out = mlp.down_proj(carry)
        return hidden + (module.post_feedforward_layernorm(out) if sandwich else out), None

    def _layer_rope(self, position_embeddings: Mapping[str | None, tuple], layer: int) -> tuple:
        return position_embeddings[self.skeleton.rope_types[layer]]

    def _mark_run(self, layer: int) -> None:
        if layer not in self.layer_first_run_at:
            self.layer_first_run_at[layer] = time.monotonic()

    def head(self, hidden: "torch.Tensor", last_only: bool) -> "torch.Tensor":
        """Final norm and LM head: logits of every position, or of the last one only."""
        return self.lm_head(self.final_norm(hidden, last_only))

    def final_norm(self, hidden: "torch.Tensor", last_only: bool) -> "torch.Tensor":
        """The final norm of every position, or of the last one only (the LM head's input)."""
        import torch

        hidden = self._inner.norm(hidden)
        if last_only and hidden.shape[1] > 1:
            # A plain slice keeps the prompt's batch stride, which sends CPU bf16 matmuls down a path ~20x
            # slower (measured: SmolLM2's head 78 ms instead of 4 ms after a 128-token prompt); the copy
            # gives the row its own dense strides.
            hidden = hidden[:, -1:, :].clone(memory_format=torch.contiguous_format)
        return hidden

    def lm_head(self, normed: "torch.Tensor") -> "torch.Tensor":
        """The LM head: logits of :meth:`final_norm`'s output (softcapped where the config says, as Gemma's)."""
        import torch

        logits = self.skeleton.model.lm_head(normed)
        if self._logit_cap is not None:  # transformers' three operations, in its order: bitwise its logits
            logits = torch.tanh(logits / self._logit_cap) * self._logit_cap
        return logits

    def window(self, layer: int) -> int | None:
        """Sliding-window size of ``layer``'s attention, or None for full attention."""
        return self.skeleton.windows[layer]

    def forward_logits(self, input_ids: "torch.Tensor", timeout: float | None) -> "torch.Tensor":
        """Logits of every position of ``input_ids`` [batch, seq] (no padding), waiting for each part.

        Each wait is bounded by ``timeout`` seconds. Equal to transformers' ``model(input_ids).logits``.
        """
        import torch

        from pipecast.engine.kv_cache import prefill_mask

        with torch.inference_mode():
            self.wait_ready(EMBED, timeout)
            ids = input_ids.to(self.device)
            hidden = self.embed(ids)
            positions = torch.arange(ids.shape[1], device=self.device).unsqueeze(0)
            rope = self.position_embeddings(hidden, positions)
            masks = {w: prefill_mask(ids.shape[1], w, self.device) for w in set(self.skeleton.windows)}
            for layer in range(self.num_layers):
                self.wait_ready(layer, timeout)
                hidden = self.run_layer(layer, hidden, position_embeddings=rope, position_ids=positions,
                                        mask=masks[self.window(layer)], cache=None)
            self.wait_ready(HEAD, timeout)
            return self.head(hidden, last_only=False)


def _part_name(part: Part) -> str:
    if part in (FINAL_NORM, LM_HEAD):
        return "the final norm" if part == FINAL_NORM else "the LM head"
    if isinstance(part, tuple):
        return f"stage {part[1]} of layer {part[0]}"
    return {EMBED: "the embeddings", HEAD: "the final norm and LM head"}.get(part, f"layer {part}")
