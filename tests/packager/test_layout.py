"""Layer detection across architectures' tensor naming, and block boundaries (pure, no weights)."""

import pytest

from packager.errors import CheckpointError, UnplacedTensorsError
from packager.layout import FIRST, LAST, place_tensor, plan_blocks, stream_order

NAMING = {
    # architecture: (an embedding, a layer-2 tensor, the final norm, the head or None when tied)
    "llama/mistral/qwen2/qwen3/gemma": ("model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.weight",
                                        "model.norm.weight", "lm_head.weight"),
    "qwen3 q_norm": ("model.embed_tokens.weight", "model.layers.2.self_attn.q_norm.weight",
                     "model.norm.weight", None),
    "gpt2": ("transformer.wte.weight", "transformer.h.2.attn.c_attn.weight", "transformer.ln_f.weight", None),
    "gpt2 bare": ("wpe.weight", "h.2.mlp.c_fc.bias", "ln_f.bias", None),
    "gpt-neox": ("gpt_neox.embed_in.weight", "gpt_neox.layers.2.attention.query_key_value.weight",
                 "gpt_neox.final_layer_norm.weight", "embed_out.weight"),
    "opt": ("model.decoder.embed_positions.weight", "model.decoder.layers.2.fc1.weight",
            "model.decoder.final_layer_norm.weight", "lm_head.weight"),
    "phi": ("model.embed_tokens.weight", "model.layers.2.mlp.fc1.weight", "model.final_layernorm.weight",
            "lm_head.bias"),
}


@pytest.mark.parametrize("arch", sorted(NAMING))
def test_each_architecture_places_embeddings_layers_and_head(arch):
    embed, layer, norm, head = NAMING[arch]
    assert place_tensor(embed) == FIRST
    assert place_tensor(layer) == 2
    assert place_tensor(norm) == LAST
    if head:
        assert place_tensor(head) == LAST


def test_layer_norms_inside_layers_are_not_the_final_norm():
    assert place_tensor("model.layers.7.input_layernorm.weight") == 7
    assert place_tensor("model.layers.7.post_attention_layernorm.weight") == 7
    assert place_tensor("transformer.h.11.ln_2.weight") == 11


def test_unplaceable_tensors_are_listed():
    sizes = {"model.layers.0.a": 4, "vision_tower.patch.weight": 4, "mystery": 4}
    with pytest.raises(UnplacedTensorsError) as info:
        plan_blocks(sizes, where="ckpt")
    assert info.value.names == ["mystery", "vision_tower.patch.weight"]
    assert str(info.value) == ("ckpt: cannot place 2 tensor(s) in a layer, the embeddings or the head: "
                               "mystery, vision_tower.patch.weight")


def _layers(count: int) -> dict[str, int]:
    return {f"model.layers.{i}.w": 10 for i in range(count)} | {"model.embed_tokens.weight": 5,
                                                               "model.norm.weight": 1}


def test_default_is_one_layer_a_block_up_to_32_layers():
    blocks = plan_blocks(_layers(30))
    assert [(b.layer_start, b.layer_end) for b in blocks] == [(i, i + 1) for i in range(30)]
    assert "model.embed_tokens.weight" in blocks[0].tensor_names
    assert "model.norm.weight" in blocks[-1].tensor_names


def test_default_is_at_most_32_blocks_of_equal_layers():
    blocks = plan_blocks(_layers(80))
    assert [(b.layer_start, b.layer_end) for b in blocks] == [(i, i + 3) for i in range(0, 78, 3)] + [(78, 80)]


def test_blocks_stream_in_layer_order_so_each_layer_can_run_before_its_block_is_complete():
    tensors = [("model.layers.10.mlp.weight", "BF16", 8), ("model.layers.9.mlp.weight", "BF16", 8),
               ("model.layers.9.input_layernorm.weight", "F32", 4), ("model.norm.weight", "F32", 4),
               ("model.embed_tokens.weight", "BF16", 16)]
    # Numeric layer order (9 before 10, which a name sort inverts), wide dtypes first inside each part.
    assert stream_order(tensors) == ["model.embed_tokens.weight", "model.layers.9.input_layernorm.weight",
                                     "model.layers.9.mlp.weight", "model.layers.10.mlp.weight",
                                     "model.norm.weight"]


def test_inside_a_layer_tensors_stream_in_the_order_the_forward_pass_uses_them():
    names = ["mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "post_attention_layernorm.weight",
             "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_proj.bias",
             "self_attn.q_proj.weight", "input_layernorm.weight", "self_attn.q_norm.weight", "mlp.lora.weight"]
    tensors = [(f"model.layers.3.{n}", "BF16", 8) for n in names]
    assert [n.removeprefix("model.layers.3.") for n in stream_order(tensors)] == [
        "input_layernorm.weight", "self_attn.k_proj.weight", "self_attn.q_norm.weight", "self_attn.q_proj.bias",
        "self_attn.q_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "mlp.lora.weight"]  # unknown to the patterns: after the rest of its layer


def test_gemma_sandwich_norms_stream_next_to_what_they_norm():
    """Gemma norms the attention's output (post_attention_layernorm) before the MLP's input
    (pre_feedforward_layernorm), and the MLP's output (post_feedforward_layernorm) last."""
    names = ["post_feedforward_layernorm.weight", "mlp.down_proj.weight", "mlp.up_proj.weight",
             "pre_feedforward_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
             "self_attn.k_norm.weight", "self_attn.q_proj.weight", "input_layernorm.weight"]
    tensors = [(f"model.layers.0.{n}", "F32", 8) for n in names]
    assert [n.removeprefix("model.layers.0.") for n in stream_order(tensors)] == [
        "input_layernorm.weight", "self_attn.k_norm.weight", "self_attn.q_proj.weight", "self_attn.o_proj.weight",
        "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "post_feedforward_layernorm.weight"]


def test_an_execution_order_that_would_misalign_falls_back_to_wide_dtypes_first_inside_each_layer():
    # An F32 norm after a 2-byte BF16 projection would start misaligned; widest first per layer keeps all
    # aligned and still streams layer by layer.
    layer0 = [("model.layers.0.input_layernorm.weight", "F32", 4),
              ("model.layers.0.self_attn.q_proj.weight", "BF16", 2),
              ("model.layers.0.post_attention_layernorm.weight", "F32", 4),
              ("model.layers.0.mlp.up_proj.weight", "BF16", 2)]
    tensors = [*layer0, ("model.layers.1.mlp.up_proj.weight", "BF16", 4),
               ("model.layers.1.input_layernorm.weight", "F32", 4)]
    assert stream_order(tensors) == ["model.layers.0.input_layernorm.weight",
                                     "model.layers.0.post_attention_layernorm.weight",
                                     "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                                     "model.layers.1.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight"]


def test_a_layer_order_that_would_misalign_a_tensor_falls_back_to_wide_dtypes_first():
    # Layer 0 ends on a 2-byte offset, so layer 1's F32 tensor would start misaligned.
    tensors = [("model.layers.0.bias", "BF16", 2), ("model.layers.1.norm.weight", "F32", 4)]
    assert stream_order(tensors) == ["model.layers.1.norm.weight", "model.layers.0.bias"]


@pytest.mark.timeout(10)
def test_missing_layers_are_counted_and_only_the_first_few_named():
    """One tensor of layer 10**7 used to build (and print) the list of every missing layer: 28 s, an 88 MB message;
    of layer 10**12 it hung. An index of more than 12 digits is no layer at all (int() refuses 4,300 digits)."""
    sizes = {"model.layers.0.a.weight": 4, "model.layers.2.a.weight": 4, "model.layers.999999999999.a.weight": 4}
    with pytest.raises(CheckpointError) as info:
        plan_blocks(sizes, where="ckpt")
    assert str(info.value) == ("ckpt: layers [1, 3, 4, 5, 6, 7, 8, 9, 10, 11] (and 999999999987 more) have no "
                               "tensors")
    with pytest.raises(CheckpointError, match=r"^ckpt: layers \[1\] have no tensors$"):
        plan_blocks({"model.layers.0.a.weight": 4, "model.layers.2.a.weight": 4}, where="ckpt")
    for digits in (13, 5000):
        with pytest.raises(UnplacedTensorsError):
            plan_blocks({"model.layers.0.a.weight": 4, f"model.layers.{'9' * digits}.a.weight": 4}, where="ckpt")


def test_block_bytes_budget_the_head_into_the_last_block_as_the_embeddings_into_the_first():
    """Found in review: a 4 GB target gave Llama-3-8B blocks of 3.93, 3.93 and 4.54 GB: the final norm and head
    were added to the last block after its layers had filled it."""
    sizes = {"model.embed_tokens.weight": 30, "model.norm.weight": 1, "lm_head.weight": 30,
             **{f"model.layers.{i}.mlp.weight": 10 for i in range(8)}}
    blocks = plan_blocks(sizes, block_bytes=60)
    layers = [(b.layer_start, b.layer_end) for b in blocks]
    assert layers == [(0, 3), (3, 6), (6, 8)]
    per_block = [sum(sizes[name] for name in b.tensor_names) for b in blocks]
    assert max(per_block) <= 60 and per_block == [60, 30, 51]
