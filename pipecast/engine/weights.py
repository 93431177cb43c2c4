"""Binding a block's tensors to the skeleton's parameters.

On CPU a parameter *is* the block's tensor: a view of the provider's buffer (the package file's mapping or
the agent's shared memory), so weights are never held twice. On a GPU each tensor is copied to the device
once, on a dedicated CUDA stream, so the copy overlaps the compute of layers already bound.

Parameters are grouped into *parts*: each decoder layer (its index), the embeddings (:data:`EMBED`) and the
head, i.e. final norm and LM head (:data:`HEAD`), itself made of :data:`FINAL_NORM` and :data:`LM_HEAD` (a
pipeline's last stage may apply the norm only, while the first stage, holding the tied embeddings, applies
the LM head). A part is usable once every parameter in it is bound.
A layer's parameters are also grouped into *stages*, ``(layer, stage)``, in the order its forward pass uses
them (:data:`ATTENTION`, :data:`MLP_IN`, :data:`MLP_OUT`): a prefill can run a layer's attention while its
MLP weights are still arriving.
"""

import logging
import re
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from pipecast.engine.architectures import DERIVED_TENSOR_SUFFIXES
from pipecast.engine.errors import BlockBindError

if TYPE_CHECKING:
    import torch

    from pipecast.v1.manifest_pb2 import Manifest

logger = logging.getLogger(__name__)

EMBED = -1
HEAD = -2
# The stages of a decoder layer: attention (its norm, projections, residual add); the MLP's norm and input
# projections; the MLP's output projection and residual add. Sandwich norms (Gemma's norms of the attention's
# and the MLP's outputs) go with the attention and the output projection.
ATTENTION, MLP_IN, MLP_OUT = 0, 1, 2
LAYER_STAGES = (ATTENTION, MLP_IN, MLP_OUT)
FINAL_NORM, LM_HEAD = (HEAD, 0), (HEAD, 1)
_LAYER_PARAM = re.compile(r"^model\.layers\.(\d+)\.")
_EMBED_PARAM = re.compile(r"^model\.embed_tokens\.")
_MLP_IN_PARAM = re.compile(r"\.(?:pre_feedforward_layernorm|mlp\.gate_proj|mlp\.up_proj)\.")
_MLP_OUT_PARAM = re.compile(r"\.(?:mlp\.down_proj|post_feedforward_layernorm)\.")
# The MLP's norm, except in layers with sandwich norms (Gemma), where it norms the attention's output.
_POST_ATTENTION_NORM = re.compile(r"\.post_attention_layernorm\.")

Part = int | tuple[int, int]
"""A layer index, EMBED, HEAD, a layer's stage ``(layer, stage)``, FINAL_NORM or LM_HEAD."""


def part_of(name: str) -> int:
    """The part a parameter belongs to: its layer index, EMBED or HEAD."""
    match = _LAYER_PARAM.match(name)
    if match:
        return int(match.group(1))
    return EMBED if _EMBED_PARAM.match(name) else HEAD


def stage_of(name: str, sandwich_norms: bool = False) -> Part:
    """The finest part a parameter belongs to: ``(layer, stage)`` for a layer's, else EMBED or HEAD.

    ``sandwich_norms``: the model's layers norm their attention's and MLP's outputs too (Gemma; see
    :attr:`~pipecast.engine.architectures.Skeleton.sandwich_norms`). A layer parameter no pattern knows
    belongs to ATTENTION, the first stage: waiting for it too early is slower but never wrong.
    """
    part = part_of(name)
    if part < 0:
        return part
    if _MLP_OUT_PARAM.search(name):
        stage = MLP_OUT
    elif _MLP_IN_PARAM.search(name) or (not sandwich_norms and _POST_ATTENTION_NORM.search(name)):
        stage = MLP_IN
    else:
        stage = ATTENTION
    return part, stage


class WeightBinder:
    """Replaces a meta-device model's parameters by real tensors, block by block.

    Not thread-safe: one loader thread binds; readers use only parts reported complete.
    """

    def __init__(self, model: "torch.nn.Module", *, dtype: "torch.dtype", device: "torch.device",
                 tied_embeddings: bool, sandwich_norms: bool):
        import torch

        self.dtype, self.device = dtype, device
        self._model = model
        self._sandwich = sandwich_norms
        self._shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        # With tied embeddings the head's weight *is* the embedding's: bound together, never from a tensor.
        self._tied = {"lm_head.weight": "model.embed_tokens.weight"} if tied_embeddings else {}
        self._missing: dict[Part, set[str]] = {}
        for name in self._shapes:
            for part in _parts(name, sandwich_norms):
                self._missing.setdefault(part, set()).add(name)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._warned_convert = False

    def missing(self, part: Part) -> set[str]:
        """Parameter names of ``part`` (a part or a stage) not bound yet."""
        return set(self._missing.get(part, ()))

    def unbound(self, held: Collection[str] = ()) -> list[str]:
        """Parameter names not bound yet, less those that tensors named ``held`` (still to come) would bind."""
        names = set().union(*self._missing.values()) - set(held)
        return sorted(n for n in names if self._tied.get(n) not in held)

    def bind(self, block: int, tensors: Mapping[str, "torch.Tensor"], origin: str) -> set[Part]:
        """Bind a block's tensors; return the parts and stages this completed. Raise BlockBindError if they
        misfit."""
        wanted = {}
        for name, tensor in tensors.items():
            if name.endswith(DERIVED_TENSOR_SUFFIXES) or name in self._tied:
                continue
            if name not in self._shapes:
                raise BlockBindError(block, origin, f"tensor {name!r} is not a parameter of "
                                                    f"{type(self._model).__name__}")
            if tuple(tensor.shape) != self._shapes[name]:
                raise BlockBindError(block, origin, f"tensor {name!r} has shape {list(tensor.shape)} but "
                                                    f"config.json implies {list(self._shapes[name])}")
            if not tensor.dtype.is_floating_point:
                raise BlockBindError(block, origin, f"tensor {name!r} has dtype {tensor.dtype}, not a "
                                                    "floating-point type")
            wanted[name] = tensor
        placed = self._place(block, wanted)
        for name, value in placed.items():
            self._set(name, value)
            for alias, target in self._tied.items():
                if target == name:
                    self._set(alias, value)
        done = set()
        for name in list(placed) + [a for a, t in self._tied.items() if t in placed]:
            for part in _parts(name, self._sandwich):
                self._missing[part].discard(name)
                if not self._missing[part]:
                    done.add(part)
        return done

    def _place(self, block: int, tensors: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
        """The tensors as the model will hold them: the same tensors where possible, else one copy."""
        if self.device.type == "cpu":
            converted = {n: t for n, t in tensors.items() if t.dtype != self.dtype}
            if converted and not self._warned_convert:
                self._warned_convert = True
                logger.warning("block %d holds %s weights but the engine runs in %s: converting (a copy "
                               "per block; pass the package's dtype to share its memory)", block,
                               next(iter(converted.values())).dtype, self.dtype)
            return {n: t.to(self.dtype) for n, t in tensors.items()}
        import torch

        # The loader thread waits for its own stream only; compute on the default stream runs meanwhile.
        with torch.cuda.stream(self._stream):
            placed = {n: t.to(self.device, self.dtype, non_blocking=True) for n, t in tensors.items()}
        self._stream.synchronize()
        return placed

    def _set(self, name: str, value: "torch.Tensor") -> None:
        import torch

        module_name, _, attr = name.rpartition(".")
        setattr(self._model.get_submodule(module_name), attr, torch.nn.Parameter(value, requires_grad=False))


def _parts(name: str, sandwich_norms: bool) -> tuple[Part, ...]:
    """The part of parameter ``name`` and, for a layer's, its stage; for the head's, FINAL_NORM or LM_HEAD."""
    stage = stage_of(name, sandwich_norms)
    if isinstance(stage, tuple):
        return stage[0], stage
    if stage == HEAD:
        return HEAD, (LM_HEAD if name.startswith("lm_head.") else FINAL_NORM)
    return (stage,)


_SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def package_dtype(manifest: "Manifest", config: dict) -> "torch.dtype":
    """The dtype to run a package in: its weights' one floating dtype, else config.json's, else float32.

    Running in the weights' dtype is what lets CPU parameters be views of the block buffers.
    """
    import torch

    floats = [_SAFETENSORS_FLOATS[d] for d in manifest.dtypes if d in _SAFETENSORS_FLOATS]
    name = floats[0] if len(floats) == 1 else config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
