"""Which Hugging Face model types the engine runs layer by layer, and how their skeleton is built.

The engine drives transformers' own decoder layers one at a time (so numerics are transformers'), which relies on three
facts of the pinned transformers version (DESIGN 6): ``config._attn_implementation`` must be set (left None the causal
mask is silently dropped), the rotary embedding (and Gemma's embedding scale) is computed from the config, and each
layer reads the KV cache at its own ``layer_idx``. A model type is listed here only when the exactness tests cover it.
"""

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipecast.engine.errors import ModelConfigError, UnsupportedModelError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ATTN_IMPLEMENTATION = "sdpa"
# Rotary variants whose frequencies follow the longest position of the batch (transformers' dynamic_rope_update):
# a row batched with a longer one would get the other's rotary.
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Tensors some checkpoints carry that are derived from the config, not learned: never bound.
DERIVED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Skeleton:
    """A model built without weights (meta device) plus the parts computed from the config."""

    model: "torch.nn.Module"          # the XForCausalLM; parameters on meta until bound
    rotary: "torch.nn.Module"         # rotary embedding, real buffers on the target device
    windows: tuple[int | None, ...]   # per layer: sliding-window size, or None for full attention
    rope_types: tuple[str | None, ...]  # per layer: its rotary variant (Gemma 3: its layer type), or None
    sandwich_norms: bool              # layers norm their attention's and MLP's outputs too (Gemma)
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool


def modeling_modules() -> list[str]:
    """transformers' modules that define the supported types' models (Gemma 3's text model is in gemma3's)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    names = map(model_type_to_module_name, SUPPORTED_MODEL_TYPES)
    return [f"transformers.models.{name}.modeling_{name}" for name in names]


def hf_config(config: dict) -> "PretrainedConfig":
    """The transformers config of a config.json dict, with the attention implementation set."""
    from transformers import AutoConfig

    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(model_type, SUPPORTED_MODEL_TYPES)
    if config.get("use_bidirectional_attention"):  # an encoder (EmbeddingGemma): causal masks would be wrong
        raise UnsupportedModelError(model_type, SUPPORTED_MODEL_TYPES, "with bidirectional attention")
    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        cfg = AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # transformers' validation raises whatever its checks hit: type it
        raise ModelConfigError(model_type, exc) from exc
    for rope_type in _rope_types(cfg):
        if rope_type in BATCH_DEPENDENT_ROPE:
            raise UnsupportedModelError(model_type, SUPPORTED_MODEL_TYPES,
                                        f"with rope type {rope_type!r} (its frequencies follow a batch's longest row)")
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    return cfg


def _rope_types(cfg: "PretrainedConfig") -> set[str]:
    # One rotary's parameters, or (Gemma 3) one per layer type.
    params = getattr(cfg, "rope_parameters", None) or {}
    per_type = [params] if "rope_type" in params else [p for p in params.values() if isinstance(p, dict)]
    return {p.get("rope_type", "default") for p in per_type}


def build_skeleton(config: dict, *, dtype: "torch.dtype", device: "torch.device") -> Skeleton:
    """Build the model of ``config`` with every parameter on the meta device (no memory, no init).

    Raises :class:`UnsupportedModelError` for a model type the engine does not run, :class:`ModelConfigError`
    for a config.json transformers cannot build a model of.
    """
    cfg = hf_config(config)
    try:
        return _skeleton(cfg, dtype, device)
    except Exception as exc:  # a config that passed validation can still fail in the modules (a zero head count)
        raise ModelConfigError(cfg.model_type, exc) from exc


def _skeleton(cfg: "PretrainedConfig", dtype: "torch.dtype", device: "torch.device") -> Skeleton:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    # The rotary embedding holds buffers computed from the config, not weights: build it for real.
    rotary = type(model.model.rotary_emb)(config=cfg).to(device)
    model.model.rotary_emb = rotary
    _real_embed_scale(model.model.embed_tokens, device)
    # Gemma 3's rotary embedding takes the layer type: local and global layers have their own bases.
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    return Skeleton(
        model=model,
        rotary=rotary,
        windows=tuple(_layer_windows(cfg)),
        rope_types=tuple(cfg.layer_types) if per_type else (None,) * cfg.num_hidden_layers,
        sandwich_norms=hasattr(model.model.layers[0], "pre_feedforward_layernorm"),
        num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        tied_embeddings=bool(cfg.tie_word_embeddings),
    )


def _real_embed_scale(embed: "torch.nn.Module", device: "torch.device") -> None:
    """Gemma's embeddings scale by sqrt(hidden), a buffer of the config, not a weight: fill it on ``device``
    as transformers' init does (in the buffer's dtype, so rounded as there)."""
    import torch

    if hasattr(embed, "scalar_embed_scale"):
        embed.embed_scale = torch.full((), embed.scalar_embed_scale, dtype=embed.embed_scale.dtype, device=device)


def _layer_windows(cfg: "PretrainedConfig") -> list[int | None]:
    # Qwen2/3 and Gemma 3 name each layer's attention type; Mistral applies its window (if any) to every layer.
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * cfg.num_hidden_layers
