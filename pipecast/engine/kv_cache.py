"""Keys and values of running sequences, and the attention masks that go with them.

A prompt's keys/values are kept per sequence while it is prefilled layer by layer (:class:`PrefillCache`);
when its first token is out, they move into the shared :class:`SlotKVCache`, where every decoding sequence
owns one row and rows ``0..n-1`` are in use, so a batched decode step attends over a view of the cache
(no gather). Each object passed to a decoder layer follows transformers' cache protocol as far as the
layers use it: ``update(keys, values, layer_idx) -> (all_keys, all_values)``.

Masks follow transformers' sdpa rule so single sequences match it bit for bit: no mask where SDPA's own
``is_causal`` (prefill) or full attention (one new token) is exact; an explicit boolean mask where rows
have different lengths or a sliding window is reached. A decode step of a sliding-window layer attends over
the keys from :func:`window_start` on, as transformers' sliding-window cache, which drops older keys, does:
masking them instead is the same attention but not the same arithmetic (bf16 tokens differ).
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CAPACITY_STEP = 256


def prefill_mask(length: int, window: int | None, device: "torch.device") -> "torch.Tensor | None":
    """Mask of a prompt of ``length`` tokens attending to itself, or None when causal SDPA is exact."""
    import torch

    if window is None or length < window:
        return None
    pos = torch.arange(length, device=device)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    return allowed[None, None]


def window_start(positions: Sequence[int], window: int | None) -> int:
    """The first key position a decode step of rows at ``positions`` attends over: 0, or with a sliding
    ``window`` the first that any row's window holds."""
    return 0 if window is None else max(min(positions) - window + 1, 0)


def decode_mask(positions: list[int], window: int | None, device: "torch.device") -> "torch.Tensor | None":
    """Mask for one new token per row, row ``s`` at ``positions[s]`` attending to its keys ``0..positions[s]``
    (within its window), over the keys from :func:`window_start` to the furthest position.

    None when every row has the same length and no window is reached (the view then holds no padding).
    """
    import torch

    span = max(positions) + 1
    if len(set(positions)) == 1 and (window is None or span < window):
        return None
    keys = torch.arange(window_start(positions, window), span, device=device)[None, :]
    pos = torch.tensor(positions, device=device)[:, None]
    allowed = keys <= pos
    if window is not None:
        allowed &= keys > pos - window
    return allowed[:, None, None, :]


class PrefillCache:
    """Keys and values of one prompt, filled one layer at a time while the prompt is prefilled."""

    def __init__(self) -> None:
        self.keys: dict[int, "torch.Tensor"] = {}
        self.values: dict[int, "torch.Tensor"] = {}

    def update(self, keys: "torch.Tensor", values: "torch.Tensor",
               layer_idx: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        self.keys[layer_idx], self.values[layer_idx] = keys, values
        return keys, values


class SlotKVCache:
    """Per layer, keys and values of shape [rows, kv_heads, capacity, head_dim]; one row per sequence.

    ``windows``: each layer's sliding-window size, or None for full attention (one per layer); ``rows``: the
    most rows (sequences decoding at once).
    Memory is allocated on first use, for the rows in use (a power of two of them, at most ``rows``), and grows in
    steps of CAPACITY_STEP tokens (at least doubling), never past ``max_positions`` (the model's, when it has a
    limit); :meth:`fit` gives back what the rows in use no longer need, :meth:`shrink` what grew once none is,
    and a growth allocates for the rows in use, not for those a burst left. Every row has the longest row's
    capacity (a batched step attends over one view of them): held, a long request's room is paid for by each
    row held beside it, not by every row the batch could have.
    Unused positions hold zeros, never garbage: masked positions still enter SDPA's products.
    """

    def __init__(self, *, windows: Sequence[int | None], num_kv_heads: int, head_dim: int, rows: int,
                 dtype: "torch.dtype", device: "torch.device", max_positions: int | None = None):
        self.windows = tuple(windows)
        self.num_layers, self.num_kv_heads, self.head_dim, self.max_rows = len(windows), num_kv_heads, head_dim, rows
        self.dtype, self.device, self.max_positions = dtype, device, max_positions
        self.capacity = 0
        self.rows = 0  # rows allocated
        self.keys: list["torch.Tensor"] = []
        self.values: list["torch.Tensor"] = []

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def reserve(self, tokens: int, rows: int = 1) -> None:
        """Make room for ``tokens`` positions in each of ``rows`` rows, the rows in use (keeping what they store;
        rows past them are not in use, and a growth does not keep them).

        Layers grow one at a time, each old tensor freed as its grown one replaces it: the peak is what is held
        plus one grown tensor, not a second copy of every layer. ``capacity`` and ``rows`` are set once all have
        grown, so an allocation that fails (out of memory) leaves every layer usable at the old size at least
        (some at the new), and a later call grows only the rest.
        """
        if tokens <= self.capacity and rows <= self.rows:
            return
        capacity = self.capacity
        if tokens > capacity:
            capacity = max(2 * capacity, -(-tokens // CAPACITY_STEP) * CAPACITY_STEP)
            if self.max_positions:  # requests are refused past the model's positions: room beyond them is waste
                capacity = min(capacity, self.max_positions)
        # Not ``max(self.rows, ...)``: every row held gets the new capacity, and rows a burst left would each be
        # paid for at a long request's room.
        self._resize(capacity, self._rows_for(rows), grow=True)

    def fit(self, tokens: int, rows: int) -> None:
        """Give back what ``rows`` rows in use of at most ``tokens`` positions do not need: the capacity once it is
        twice theirs or more (a long request ended beside short ones), the rows once they are twice or more."""
        capacity = max(-(-tokens // CAPACITY_STEP) * CAPACITY_STEP, CAPACITY_STEP)
        held = self._rows_for(rows)
        if self.capacity >= 2 * capacity or self.rows >= 2 * held:
            self._resize(min(capacity, self.capacity), min(held, self.rows), grow=False)

    def _rows_for(self, rows: int) -> int:
        """The rows allocated for ``rows`` in use: the power of two at or above (so that a batch filling up
        reallocates log2 times, not once per sequence), at most ``max_rows``."""
        return min(1 << max(rows - 1, 0).bit_length(), self.max_rows)

    def _resize(self, capacity: int, rows: int, *, grow: bool) -> None:
        try:
            for layer in range(self.num_layers):
                for store in (self.keys, self.values):
                    self._replace(store, layer, capacity, rows, grow)
        except BaseException:
            # Failed part way (out of memory): what every layer holds at least is what may be used.
            if len(self.values) == self.num_layers:
                held = self.keys + self.values
                self.capacity, self.rows = min(t.shape[2] for t in held), min(t.shape[0] for t in held)
            raise
        self.capacity, self.rows = capacity, rows

    def _replace(self, store: list["torch.Tensor"], layer: int, capacity: int, rows: int, grow: bool) -> None:
        import torch

        old = store[layer] if layer < len(store) else None
        if old is not None and (old.shape[0], old.shape[2]) == (rows, capacity):
            return  # done by an earlier call that failed on a later layer
        if grow and old is not None:
            if old.shape[0] >= rows and old.shape[2] >= capacity:
                return
            # Grown further by a failed call already (capacity): what it holds is kept. Rows past ``rows`` are
            # not in use: they are not copied into the new tensor.
            capacity = max(capacity, old.shape[2])
        new = torch.zeros((rows, self.num_kv_heads, capacity, self.head_dim), dtype=self.dtype, device=self.device)
        if old is None:
            store.append(new)
            return
        kept_rows, kept = min(rows, old.shape[0]), min(capacity, old.shape[2])
        new[:kept_rows, :, :kept] = old[:kept_rows, :, :kept]
        store[layer] = new

    def shrink(self) -> None:
        """Free the keys and values once any grew past CAPACITY_STEP or holds more than one row (call it when no
        row is in use): neither a long request's room nor a burst's rows are kept after them; the next use
        allocates what it needs."""
        # The tensors, not ``capacity`` and ``rows``: a growth that failed part way left some layers larger.
        if any(t.shape[0] > 1 or t.shape[2] > CAPACITY_STEP for t in self.keys + self.values):
            self.free()

    def free(self) -> None:
        """Free the keys and values whatever their size (the engine closed: on a GPU they are device memory, held
        for as long as anything still refers to the engine, a finished stream's reader say)."""
        self.keys, self.values, self.capacity, self.rows = [], [], 0, 0

    def write_prompt(self, row: int, prompt: PrefillCache, length: int) -> None:
        """Store a prefilled prompt's ``length`` positions in ``row`` (zeros after them)."""
        self.reserve(length, row + 1)
        for layer in range(self.num_layers):
            self.keys[layer][row, :, :length] = prompt.keys[layer][0]
            self.values[layer][row, :, :length] = prompt.values[layer][0]
        self._clear_tail(row, length)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` to row ``dst`` (to keep rows 0..n-1 dense), zeros
        after them."""
        for store in (self.keys, self.values):
            for layer in range(self.num_layers):
                store[layer][dst, :, :length] = store[layer][src, :, :length]
        self._clear_tail(dst, length)

    def _clear_tail(self, row: int, length: int) -> None:
        # The row's previous sequence left its keys and values there: masked, they still enter SDPA's products
        # (an fp16 inf among them would make 0 * inf = NaN).
        for store in (self.keys, self.values):
            for layer in range(self.num_layers):
                store[layer][row, :, length:].zero_()

    def step(self, positions: list[int]) -> "DecodeStep":
        """The cache view of one decode step: row ``s`` writes its new token at ``positions[s]``."""
        self.reserve(max(positions) + 1, len(positions))
        return DecodeStep(self, positions)


class DecodeStep:
    """What a decoder layer sees as its cache during one batched decode step of rows 0..n-1."""

    def __init__(self, cache: SlotKVCache, positions: list[int]):
        import torch

        self._cache = cache
        self._n = len(positions)
        self._rows = torch.arange(self._n, device=cache.device)
        self._positions = torch.tensor(positions, device=cache.device)
        self._span = max(positions) + 1
        self._starts = {w: window_start(positions, w) for w in set(cache.windows)}

    def update(self, keys: "torch.Tensor", values: "torch.Tensor",
               layer_idx: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        k_all, v_all = self._cache.keys[layer_idx], self._cache.values[layer_idx]
        k_all[self._rows, :, self._positions] = keys[:, :, 0]
        v_all[self._rows, :, self._positions] = values[:, :, 0]
        start = self._starts[self._cache.windows[layer_idx]]
        return k_all[: self._n, :, start : self._span], v_all[: self._n, :, start : self._span]
