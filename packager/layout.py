"""Which block each tensor goes to: layer detection across architectures, and block boundaries.

Decoder layers are found by name (``model.layers.N.``, ``h.N.``, ``gpt_neox.layers.N.``,
``decoder.layers.N.`` ...). Embeddings join the first block, the final norm and the LM head the last.
Pure functions of tensor names and sizes.
"""

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from packager.errors import CheckpointError, UnplacedTensorsError
from packager.safetensors_format import DTYPE_BITS, layout_order

# At most 12 digits: a longer index is no layer of any model (and int() refuses 4,300 digits and more)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d{1,12})\.")
_FIRST = re.compile(r"(?:^|\.)(?:embed_tokens|embed_in|wte|wpe|word_embeddings|embed_positions|"
                    r"project_in|rotary_emb|embeddings)\.")
_LAST = re.compile(r"^(?:lm_head|embed_out|output)\.|(?:^|\.)(?:model\.|transformer\.|gpt_neox\.|decoder\.)?"
                   r"(?:norm|ln_f|final_layer_norm|final_layernorm|final_norm|project_out)\.[a-z_]+$")
HEAD_NAMES = re.compile(r"^(?:lm_head|embed_out|output)\.")

FIRST, LAST = -1, -2
MISSING_LAYERS_SHOWN = 10  # missing layers named in the error


def place_tensor(name: str) -> int | None:
    """Layer index of a tensor, FIRST for embeddings, LAST for the final norm/head, None if unknown."""
    match = _LAYER.search(name)
    if match:
        return int(match.group(1))
    if _FIRST.search(name):
        return FIRST
    if _LAST.search(name):
        return LAST
    return None


# Inside a decoder layer, tensors in the order the forward pass uses them: the attention's norm, its
# projections (q, k, v and their norms before the output one), the MLP's norm, its input projections, its
# output one and the norm of its output. Gemma's post_attention_layernorm norms the attention's output, and
# sorts by name before the MLP's pre_feedforward_layernorm in their group. Names no pattern knows go after
# them (the engine waits for such tensors before the layer starts).
_EXECUTION_ORDER = tuple(re.compile(p) for p in (
    r"\.(?:input_layernorm|ln_1|attention_norm|input_norm|pre_attention_layernorm)\.",
    r"\.(?:q_proj|k_proj|v_proj|qkv_proj|query_key_value|c_attn|wq|wk|wv|q_norm|k_norm)\.",
    r"\.(?:self_attn|attention|attn)\.(?:o_proj|out_proj|dense|c_proj|wo)\.",
    r"\.(?:post_attention_layernorm|ln_2|ffn_norm|pre_feedforward_layernorm)\.",
    r"\.(?:gate_proj|up_proj|gate_up_proj|c_fc|fc1|dense_h_to_4h|w1|w3)\.",
    r"\.(?:down_proj|fc2|dense_4h_to_h|w2|post_feedforward_layernorm)\.|\.mlp\.c_proj\.",
))


def _execution_rank(name: str) -> int:
    return next((i for i, pattern in enumerate(_EXECUTION_ORDER) if pattern.search(name)), len(_EXECUTION_ORDER))


def stream_order(tensors: Sequence[tuple[str, str, int]]) -> list[str]:
    """The byte order of a block's tensors, given as (name, dtype, bytes): embeddings, then each layer in
    turn, then the final norm and head; inside a layer, in the order its forward pass uses them.

    A receiver can then run each layer, even each half of a layer, as soon as the (verified) bytes up to
    its last tensor are in, before the rest of the block arrives. The first of these orders that leaves
    every tensor aligned for its dtype is used: execution order inside each layer, else widest dtype first
    inside each layer, else widest dtype first in the whole block (every offset aligned). Alignment is what
    lets engines view the bytes without a copy.
    """
    def layer_rank(name: str) -> int:
        place = place_tensor(name)
        return {FIRST: -1, LAST: 1 << 30, None: 1 << 31}.get(place, place)

    keys = (lambda t: (layer_rank(t[0]), _execution_rank(t[0]), *layout_order(t[1], t[0])),
            lambda t: (layer_rank(t[0]), *layout_order(t[1], t[0])))
    for key in keys:
        ordered = sorted(tensors, key=key)
        if _aligned(ordered):
            break
    else:
        ordered = sorted(tensors, key=lambda t: layout_order(t[1], t[0]))
    return [name for name, _, _ in ordered]


def _aligned(ordered: Sequence[tuple[str, str, int]]) -> bool:
    offset = 0
    for _, dtype, nbytes in ordered:
        if offset % max(DTYPE_BITS[dtype] // 8, 1):
            return False
        offset += nbytes
    return True


@dataclass(frozen=True)
class BlockLayout:
    """One planned block: its layer range and the tensors it holds (sorted names)."""

    index: int
    layer_start: int
    layer_end: int
    tensor_names: tuple[str, ...]


#: Most blocks a package is cut into by default. Pipelines across nodes need blocks small enough for K sources
#: (up to 8) to bring each of K groups of receivers about S/K bytes: with lambda-scale's 8 blocks the demo model's
#: first (the embeddings with layers 0-3, 81 MiB) alone took 0.32 x S/B over one link, and no pipeline answers
#: before its head stage holds it. One-layer blocks cost the whole-model path nothing measurable (docs/benchmarks.md).
DEFAULT_MAX_BLOCKS = 32


def default_layers_per_block(num_layers: int) -> int:
    """The layers a block holds by default: ceil(``num_layers`` / :data:`DEFAULT_MAX_BLOCKS`)."""
    return -(-num_layers // DEFAULT_MAX_BLOCKS)


def plan_blocks(sizes: dict[str, int], *, num_layers: int | None = None, layers_per_block: int | None = None,
                block_bytes: int | None = None, where: str = "checkpoint") -> list[BlockLayout]:
    """Split tensors (name -> bytes) into contiguous layer-range blocks.

    With ``layers_per_block`` each block holds that many layers; with ``block_bytes`` consecutive layers
    are grouped while the block stays within the target (at least one layer each); with neither, the
    model is cut into blocks of :func:`default_layers_per_block` layers (the last may hold fewer). ``where`` names
    the checkpoint in errors.
    """
    if layers_per_block is not None and block_bytes is not None:
        raise ValueError("give layers_per_block or block_bytes, not both")
    by_layer: dict[int, list[str]] = {}
    first, last, unplaced = [], [], []
    for name in sizes:
        place = place_tensor(name)
        if place is None:
            unplaced.append(name)
        elif place == FIRST:
            first.append(name)
        elif place == LAST:
            last.append(name)
        else:
            by_layer.setdefault(place, []).append(name)
    if unplaced:
        raise UnplacedTensorsError(where, sorted(unplaced))
    if not by_layer:
        raise CheckpointError(f"{where}: no decoder layers found in the tensor names")
    count = max(by_layer) + 1
    if num_layers is not None and num_layers != count:
        raise CheckpointError(f"{where}: config.json says {num_layers} layers but the tensors hold {count}")
    if len(by_layer) < count:
        # named lazily and only the first few: one tensor of layer 10**12 would make the full list endless
        missing = list(itertools.islice((i for i in range(count) if i not in by_layer), MISSING_LAYERS_SHOWN))
        more = count - len(by_layer) - len(missing)
        raise CheckpointError(f"{where}: layers {missing}{f' (and {more} more)' if more else ''} have no tensors")
    if layers_per_block is not None and layers_per_block < 1:
        raise ValueError("layers_per_block must be at least 1")
    layer_bytes = [sum(sizes[n] for n in by_layer[i]) for i in range(count)]
    if block_bytes is not None:
        ranges = _ranges_by_bytes(layer_bytes, block_bytes, sum(sizes[n] for n in first),
                                  sum(sizes[n] for n in last))
    else:
        per = layers_per_block or default_layers_per_block(count)
        ranges = [(s, min(s + per, count)) for s in range(0, count, per)]
    blocks = []
    for i, (start, end) in enumerate(ranges):
        names = [n for layer in range(start, end) for n in by_layer[layer]]
        if i == 0:
            names += first
        if i == len(ranges) - 1:
            names += last
        blocks.append(BlockLayout(i, start, end, tuple(sorted(names))))
    return blocks


def _ranges_by_bytes(layer_bytes: list[int], target: int, first_extra: int,
                     last_extra: int) -> list[tuple[int, int]]:
    """Whole layers grouped up to ``target`` bytes a block, the first block's embeddings (``first_extra``) and the
    last one's final norm and head (``last_extra``) counted in theirs."""
    ranges, start, used = [], 0, first_extra
    for i, size in enumerate(layer_bytes):
        if i > start and used + size > target:
            ranges.append((start, i))
            start, used = i, 0
        used += size
    end = len(layer_bytes)
    if used + last_extra > target and end - start > 1:
        # The head does not fit beside the last layers: as many of them as fit with it (one at least) go apart.
        cut, tail = end - 1, layer_bytes[end - 1] + last_extra
        while cut - 1 > start and tail + layer_bytes[cut - 1] <= target:
            cut -= 1
            tail += layer_bytes[cut]
        ranges.append((start, cut))
        start = cut
    ranges.append((start, end))
    return ranges
