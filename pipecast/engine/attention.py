"""The attention function the engine's decoder layers call: transformers' SDPA, made batch invariant.

A decode step whose rows hold different lengths cannot share one SDPA call without padding the shorter rows' key
spans with masked keys, and masked keys change SDPA's arithmetic (bf16 tokens then differ from the row's decoded
alone). Such a step passes each row's key span (``row_spans``, see :func:`pipecast.engine.kv_cache.decode_attention`):
attention then runs once per row over exactly that row's keys, as it does for a lone sequence, while the linear
layers around it stay batched.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ATTN_IMPLEMENTATION = "pipecast_sdpa"


def register() -> None:
    """Make :data:`ATTN_IMPLEMENTATION` an attention implementation transformers' layers can be set to."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)


def attention_forward(module: "torch.nn.Module", query: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor",
                      attention_mask: "torch.Tensor | None", row_spans: Any = None,
                      **kwargs: Any) -> tuple["torch.Tensor", None]:
    """transformers' ``sdpa_attention_forward``; given ``row_spans`` (one ``(start, stop, mask)`` per row), once
    per row over the keys ``start:stop`` with the row's own mask (its GQA packing then chosen per row, as alone)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if row_spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = [sdpa_attention_forward(module, query[row:row + 1], key[row:row + 1, :, start:stop],
                                   value[row:row + 1, :, start:stop], mask, **kwargs)[0]
            for row, (start, stop, mask) in enumerate(row_spans)]
    return torch.cat(rows), None
