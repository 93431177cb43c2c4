"""The KV cache: masks only where SDPA's own causal rule is not exact, a prompt's keys moving into a row of
the shared cache, rows kept dense, capacity that grows without losing what is stored, and the view one
batched decode step attends over."""

import weakref

import pytest
import torch

from pipecast.engine.kv_cache import (CAPACITY_STEP, PrefillCache, SlotKVCache, decode_mask, prefill_mask,
                                      window_start)

CPU = torch.device("cpu")
LAYERS, HEADS, DIM = 2, 2, 4


def cache(rows: int = 3, windows=(None,) * LAYERS, max_positions: int | None = None) -> SlotKVCache:
    return SlotKVCache(windows=windows, num_kv_heads=HEADS, head_dim=DIM, rows=rows, dtype=torch.float32,
                       device=CPU, max_positions=max_positions)


def prompt_cache(length: int, seed: int) -> PrefillCache:
    """A prefilled prompt's cache: each layer's keys and values, [1, heads, length, dim]."""
    generator = torch.Generator().manual_seed(seed)
    prompt = PrefillCache()
    for layer in range(LAYERS):
        keys, values = (torch.randn(1, HEADS, length, DIM, generator=generator) for _ in range(2))
        assert prompt.update(keys, values, layer) == (keys, values)
    return prompt


def test_a_prompt_needs_a_mask_only_once_it_reaches_the_sliding_window():
    assert prefill_mask(5, None, CPU) is None and prefill_mask(5, 6, CPU) is None
    mask = prefill_mask(5, 3, CPU)
    assert mask.shape == (1, 1, 5, 5)
    # query i sees keys i-2..i: causal, and no further back than the window
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0],
                                         [0, 0, 1, 1, 1]]


def test_a_decode_step_needs_a_mask_only_for_rows_of_different_lengths_or_past_the_window():
    assert decode_mask([4, 4], None, CPU) is None and decode_mask([4, 4], 6, CPU) is None
    mask = decode_mask([1, 3], None, CPU)
    assert mask.shape == (2, 1, 1, 4)
    assert mask[:, 0, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    # Past the window, over the keys from the first any row's window holds (those before are left out)
    assert decode_mask([3, 3], 2, CPU)[:, 0, 0].int().tolist() == [[1, 1], [1, 1]]
    assert decode_mask([2, 4], 2, CPU)[:, 0, 0].int().tolist() == [[1, 1, 0, 0], [0, 0, 1, 1]]
    assert window_start([2, 4], 2) == 1 and window_start([0, 4], 2) == 0 and window_start([9], None) == 0


def test_capacity_grows_in_steps_at_least_doubling_and_keeps_what_is_stored():
    slots = cache()
    assert slots.capacity == 0 and slots.nbytes == 0  # nothing allocated before first use
    slots.write_prompt(1, prompt := prompt_cache(5, seed=1), 5)
    assert slots.capacity == CAPACITY_STEP and slots.rows == 2  # rows 0 and 1, not the 3 the cache may have
    assert slots.nbytes == 2 * LAYERS * 2 * HEADS * CAPACITY_STEP * DIM * 4
    slots.reserve(CAPACITY_STEP + 1, rows=2)
    assert slots.capacity == 2 * CAPACITY_STEP
    slots.reserve(5 * CAPACITY_STEP - 10, rows=2)
    assert slots.capacity == 5 * CAPACITY_STEP
    for layer in range(LAYERS):
        assert torch.equal(slots.keys[layer][1, :, :5], prompt.keys[layer][0])
        assert torch.equal(slots.values[layer][1, :, :5], prompt.values[layer][0])
        assert not slots.keys[layer][1, :, 5:].any() and not slots.keys[layer][0].any()  # zeros, not garbage


def test_a_decode_step_writes_each_rows_token_and_attends_over_a_view_of_the_used_rows():
    slots = cache()
    short, long = prompt_cache(2, seed=1), prompt_cache(4, seed=2)
    slots.write_prompt(2, short, 2)  # a sequence in row 2, moved down when row 0 is free
    slots.write_prompt(1, long, 4)
    slots.move_row(2, 0, 2)
    step = slots.step([2, 4])  # row 0 writes at position 2, row 1 at position 4
    new_keys, new_values = torch.randn(2, HEADS, 1, DIM), torch.randn(2, HEADS, 1, DIM)
    keys, values = step.update(new_keys, new_values, layer_idx=1)
    assert keys.shape == values.shape == (2, HEADS, 5, DIM)
    assert keys.data_ptr() == slots.keys[1].data_ptr()  # a view of the cache, not a gather
    assert torch.equal(keys[0, :, :2], short.keys[1][0]) and torch.equal(keys[1, :, :4], long.keys[1][0])
    assert torch.equal(keys[0, :, 2], new_keys[0, :, 0]) and torch.equal(values[1, :, 4], new_values[1, :, 0])
    assert not keys[0, :, 3:].any()  # row 0's future positions stay empty (masked by decode_mask)


def test_a_sliding_window_layer_attends_over_the_keys_from_the_first_window_position_only():
    slots = cache(rows=2, windows=(None, 2))
    slots.write_prompt(0, prompt_cache(4, seed=1), 4)
    slots.write_prompt(1, prompt := prompt_cache(2, seed=2), 2)
    step = slots.step([4, 2])
    new = torch.randn(2, HEADS, 1, DIM)
    assert step.update(new, new, layer_idx=0)[0].shape[2] == 5  # full attention: every position
    keys, _ = step.update(new, new, layer_idx=1)
    assert keys.shape[2] == 4  # positions 1-4: row 1's window (1-2) starts there
    assert torch.equal(keys[1, :, 0], prompt.keys[1][0, :, 1]) and torch.equal(keys[1, :, 1], new[1, :, 0])


def test_capacity_never_grows_past_the_models_positions():
    slots = cache(max_positions=CAPACITY_STEP + 100)
    slots.reserve(CAPACITY_STEP)
    slots.reserve(CAPACITY_STEP + 1)  # doubling would give 2 * CAPACITY_STEP for every row
    assert slots.capacity == CAPACITY_STEP + 100


def test_shrinking_frees_what_grew_past_one_step_and_the_next_use_allocates_what_it_needs():
    slots = cache()
    slots.reserve(CAPACITY_STEP)
    slots.shrink()
    assert slots.capacity == CAPACITY_STEP  # one step is kept: no allocation for every short request
    slots.reserve(3 * CAPACITY_STEP)
    slots.shrink()
    assert slots.capacity == 0 and slots.nbytes == 0
    slots.write_prompt(0, prompt := prompt_cache(5, seed=1), 5)
    assert slots.capacity == CAPACITY_STEP and torch.equal(slots.keys[1][0, :, :5], prompt.keys[1][0])


def test_rows_are_allocated_for_the_rows_in_use_a_power_of_two_of_them_at_most_the_caches():
    """Every row the batch could have was allocated at the longest row's capacity: one long request alone held
    max_batch times its room."""
    slots = cache(rows=6)
    slots.step([5])
    assert slots.rows == 1 and slots.nbytes == 2 * LAYERS * 1 * HEADS * CAPACITY_STEP * DIM * 4
    slots.write_prompt(2, prompt := prompt_cache(5, seed=1), 5)  # a third row in use
    assert slots.rows == 4 and torch.equal(slots.keys[1][2, :, :5], prompt.keys[1][0])
    slots.step([1] * 5)
    assert slots.rows == 6


def test_a_growth_allocates_for_the_rows_in_use_not_the_rows_an_earlier_burst_held():
    """Rows held were ``max(rows held, rows in use)``: after a burst of 16 short requests, one long request alone
    grew every one of the 16 rows to its room (16 GiB instead of 1 for one 8k request of Llama-8B bf16)."""
    slots = cache(rows=8)
    slots.reserve(5, rows=8)  # the burst
    slots.write_prompt(0, prompt := prompt_cache(5, seed=1), 5)  # ... then one request alone, growing
    slots.reserve(3 * CAPACITY_STEP, rows=1)
    assert (slots.capacity, slots.rows) == (3 * CAPACITY_STEP, 1)
    assert [tuple(t.shape) for t in slots.keys + slots.values] == [(1, HEADS, 3 * CAPACITY_STEP, DIM)] * 2 * LAYERS
    assert torch.equal(slots.keys[1][0, :, :5], prompt.keys[1][0]) and not slots.keys[1][0, :, 5:].any()


def test_shrinking_frees_the_rows_a_burst_left_though_none_grew_past_one_step():
    """Looking at the capacity alone, an idle cache kept every row of the last burst for good."""
    slots = cache(rows=8)
    slots.reserve(5, rows=8)
    slots.shrink()
    assert (slots.capacity, slots.rows, slots.nbytes) == (0, 0, 0)
    slots.reserve(5)
    slots.shrink()
    assert (slots.capacity, slots.rows) == (CAPACITY_STEP, 1)  # one short row is kept: no allocation per request


def test_fitting_gives_back_the_room_the_rows_in_use_no_longer_need_and_keeps_what_they_hold():
    slots = cache(rows=8)
    slots.reserve(3 * CAPACITY_STEP, rows=8)
    slots.write_prompt(1, prompt := prompt_cache(5, seed=1), 5)
    slots.fit(CAPACITY_STEP + 1, 5)  # half the capacity or more, and more than half the rows, still needed
    assert (slots.capacity, slots.rows) == (3 * CAPACITY_STEP, 8)
    slots.fit(6, 2)  # the long request ended: two short rows left
    assert (slots.capacity, slots.rows) == (CAPACITY_STEP, 2)
    assert [tuple(t.shape) for t in slots.keys] == [(2, HEADS, CAPACITY_STEP, DIM)] * LAYERS
    assert torch.equal(slots.keys[1][1, :, :5], prompt.keys[1][0]) and torch.equal(
        slots.values[0][1, :, :5], prompt.values[0][0])


def test_fitting_that_runs_out_of_memory_part_way_leaves_what_every_layer_holds_usable(monkeypatch):
    slots = cache(rows=4)
    slots.reserve(3 * CAPACITY_STEP, rows=4)
    slots.write_prompt(0, prompt := prompt_cache(5, seed=1), 5)
    patch_zeros(monkeypatch, fail_at=2)  # layer 0's keys fit, its values do not
    with pytest.raises(torch.OutOfMemoryError):
        slots.fit(6, 1)
    monkeypatch.undo()
    assert (slots.capacity, slots.rows) == (CAPACITY_STEP, 1)  # the smallest a layer holds now
    keys, _ = slots.step([5]).update(torch.zeros(1, HEADS, 1, DIM), torch.zeros(1, HEADS, 1, DIM), 0)
    assert torch.equal(keys[0, :, :5], prompt.keys[0][0])


def patch_zeros(monkeypatch, fail_at: int | None = None) -> list[weakref.ref]:
    """Patch ``torch.zeros`` (how the cache allocates) to raise out of memory on call ``fail_at`` (from 1); the
    list returned holds a weak reference to each tensor allocated."""
    zeros, made = torch.zeros, []

    def allocate(*args, **kwargs):
        if len(made) + 1 == fail_at:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        tensor = zeros(*args, **kwargs)
        made.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(torch, "zeros", allocate)
    return made


def test_running_out_of_memory_while_growing_leaves_every_layer_usable_and_a_retry_grows_the_rest(monkeypatch):
    """One OOM once left the capacity unset over layers of mixed sizes (every later request that needed the room
    failed); the layers a failed growth did grow are kept, larger than the capacity, and not allocated again."""
    slots = cache(rows=2)
    slots.write_prompt(0, prompt := prompt_cache(5, seed=1), 5)
    patch_zeros(monkeypatch, fail_at=3)  # layer 0's keys and values grow, layer 1's keys do not
    with pytest.raises(torch.OutOfMemoryError):
        slots.reserve(2 * CAPACITY_STEP)
    monkeypatch.undo()
    assert slots.capacity == CAPACITY_STEP
    assert [t.shape[2] for t in slots.keys + slots.values] == [2 * CAPACITY_STEP, CAPACITY_STEP] * 2
    assert torch.equal(slots.keys[0][0, :, :5], prompt.keys[0][0])  # the grown layer kept what was stored
    # Usable at the old capacity: a prompt moves in and a step attends over both rows
    slots.write_prompt(1, other := prompt_cache(3, seed=2), 3)
    keys, _ = slots.step([5, 3]).update(torch.zeros(2, HEADS, 1, DIM), torch.zeros(2, HEADS, 1, DIM), 0)
    assert keys.shape[2] == 6 and torch.equal(keys[0, :, :5], prompt.keys[0][0])
    assert torch.equal(keys[1, :, :3], other.keys[0][0])
    # A longer prompt (in row 1: rows 0-1 in use) then grows only the layers the failed growth left
    made = patch_zeros(monkeypatch)
    slots.write_prompt(1, longer := prompt_cache(CAPACITY_STEP + 9, seed=3), CAPACITY_STEP + 9)
    assert len(made) == 2 and slots.capacity == 2 * CAPACITY_STEP
    assert [t.shape[2] for t in slots.keys + slots.values] == [2 * CAPACITY_STEP] * 2 * LAYERS
    assert torch.equal(slots.values[1][1, :, :CAPACITY_STEP + 9], longer.values[1][0])
    assert torch.equal(slots.values[1][0, :, :5], prompt.values[1][0])


def test_shrinking_frees_the_layers_a_failed_growth_left_larger_than_the_capacity(monkeypatch):
    """Judged by ``capacity`` alone, they were kept while the engine was idle."""
    slots = cache()
    slots.reserve(CAPACITY_STEP)
    patch_zeros(monkeypatch, fail_at=2)
    with pytest.raises(torch.OutOfMemoryError):
        slots.reserve(2 * CAPACITY_STEP)
    monkeypatch.undo()
    slots.shrink()
    assert slots.capacity == 0 and slots.nbytes == 0


def test_growing_holds_no_more_than_the_grown_cache_and_the_one_tensor_being_replaced(monkeypatch):
    """Every layer's grown tensors allocated before the old ones were freed held both caches at once: 6 GiB at
    the peak for a 32-layer model growing from 2 to 4 GiB."""
    slots = cache(rows=2)
    slots.reserve(CAPACITY_STEP)
    old = [weakref.ref(t) for t in slots.keys + slots.values]
    made = patch_zeros(monkeypatch)
    zeros, peak = torch.zeros, 0

    def allocate(*args, **kwargs):
        nonlocal peak
        tensor = zeros(*args, **kwargs)
        peak = max(peak, sum(t.nbytes for t in (ref() for ref in old + made) if t is not None))
        return tensor

    monkeypatch.setattr(torch, "zeros", allocate)
    slots.reserve(4 * CAPACITY_STEP)
    assert len(made) == 2 * LAYERS and slots.capacity == 4 * CAPACITY_STEP
    assert peak == slots.nbytes + slots.nbytes // (2 * LAYERS) // 4  # + one tensor of the old capacity


@pytest.mark.parametrize("positions", [[0], [CAPACITY_STEP]])
def test_a_step_makes_room_for_its_furthest_position(positions):
    slots = cache(rows=1)
    slots.step(positions)
    assert slots.capacity > max(positions)


def test_a_reused_row_holds_zeros_after_its_new_sequence():
    """Masked positions still enter SDPA's products: a previous sequence's keys left there (an fp16 inf among
    them) would turn into NaN."""
    slots = cache(rows=2)
    slots.write_prompt(0, prompt_cache(6, 1), 6)
    slots.write_prompt(1, prompt_cache(5, 2), 5)
    slots.write_prompt(0, prompt_cache(3, 3), 3)  # row 0 taken by a shorter prompt
    slots.move_row(0, 1, 3)  # row 1 refilled from row 0
    for store in (slots.keys, slots.values):
        for layer in range(LAYERS):
            assert store[layer][:, :, :3].all() and not store[layer][:, :, 3:].any()
