"""Which Hugging Face model types the engine runs layer by layer, and how their skeleton is built.

The engine drives transformers' own decoder layers one at a time (so numerics are transformers'), which
relies on three facts of the pinned transformers version (DESIGN 6): ``config._attn_implementation`` must
be set (left None the causal mask is silently dropped), the rotary embedding is computed from the config,
and each layer reads the KV cache at its own ``layer_idx``. A model type is listed here only when the
exactness tests cover it.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipecast.engine.errors import UnsupportedModelError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ATTN_IMPLEMENTATION = "sdpa"
# Tensors some checkpoints carry that are derived from the config, not learned: never bound.
DERIVED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Skeleton:
    """A model built without weights (meta device) plus the parts computed from the config."""

    model: "torch.nn.Module"          # the XForCausalLM; parameters on meta until bound
    rotary: "torch.nn.Module"         # rotary embedding, real buffers on the target device
    windows: tuple[int | None, ...]   # per layer: sliding-window size, or None for full attention
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool


def hf_config(config: dict) -> "PretrainedConfig":
    """The transformers config of a config.json dict, with the attention implementation set."""
    from transformers import AutoConfig

    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(model_type, SUPPORTED_MODEL_TYPES)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    cfg = AutoConfig.for_model(model_type, **fields)
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    return cfg


def build_skeleton(config: dict, *, dtype: "torch.dtype", device: "torch.device") -> Skeleton:
    """Build the model of ``config`` with every parameter on the meta device (no memory, no init)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    # The rotary embedding holds buffers computed from the config, not weights: build it for real.
    rotary = type(model.model.rotary_emb)(config=cfg).to(device)
    model.model.rotary_emb = rotary
    return Skeleton(
        model=model,
        rotary=rotary,
        windows=tuple(_layer_windows(cfg)),
        num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        tied_embeddings=bool(cfg.tie_word_embeddings),
    )


def _layer_windows(cfg: "PretrainedConfig") -> list[int | None]:
    # Qwen2 names each layer's attention type; Mistral applies its window (if any) to every layer.
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * cfg.num_hidden_layers
