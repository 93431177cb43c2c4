"""The memory reserve: populated ahead, handed over to block buffers as they populate, pages counted by the
kernel (a memfd's allocated blocks), not by the reserve's own bookkeeping alone."""

import mmap
import os

import pytest

from pipecast.agent.buffers import POPULATE_STEP_BYTES, SharedMemoryAllocator, SharedMemoryBuffer
from pipecast.agent.errors import MemoryBudgetError
from pipecast.agent.reserve import MemoryReserve

MIB = 1 << 20


def allocated(fd: int) -> int:
    """Bytes of memory the kernel holds for memfd ``fd``."""
    return os.fstat(fd).st_blocks * 512


@pytest.fixture
def reserve():
    reserve = MemoryReserve(8 * MIB)
    yield reserve
    reserve.close()


def test_a_reserve_holds_nothing_until_filled_then_its_whole_size(reserve):
    assert (reserve.size, reserve.held_bytes, allocated(reserve._fd)) == (8 * MIB, 0, 0)
    assert reserve.fill() == 8 * MIB
    assert reserve.held_bytes == allocated(reserve._fd) == 8 * MIB
    assert reserve.fill() == 8 * MIB  # full: nothing more to do


def test_a_fill_stops_at_its_limit_what_the_budget_has_free(reserve):
    """Found in review: after a drop the reserve filled to its whole size while other packages were held, which
    took memory as large as the budget again (up to twice --memory resident)."""
    assert reserve.fill(3 * MIB) == 3 * MIB == allocated(reserve._fd)
    assert reserve.fill(2 * MIB) == 3 * MIB  # holds what it has: a fill frees nothing
    assert reserve.fill(0) == 3 * MIB and reserve.fill(-5) == 3 * MIB
    assert reserve.fill(64 * MIB) == 8 * MIB  # at most its size


def test_a_fill_to_a_limit_inside_a_page_still_lets_the_reserve_fill_again(reserve):
    """Found in review: a limit of whole bytes (the budget's free bytes) left the reserve held to inside a page;
    every later fill then failed (madvise EINVAL) and the reserve stayed drained."""
    assert reserve.fill(3 * MIB - 1205) == 3 * MIB - mmap.PAGESIZE == allocated(reserve._fd)
    assert reserve.hand_over(MIB) == MIB
    assert reserve.fill() == 8 * MIB == allocated(reserve._fd)


def test_a_hand_over_frees_whole_pages_of_the_reserve_up_to_what_it_holds(reserve):
    reserve.fill()
    assert reserve.hand_over(3 * MIB + 1) == 3 * MIB + mmap.PAGESIZE  # whole pages
    assert reserve.held_bytes == allocated(reserve._fd) == 5 * MIB - mmap.PAGESIZE
    assert reserve.hand_over(100 * MIB) == 5 * MIB - mmap.PAGESIZE
    assert (reserve.held_bytes, allocated(reserve._fd), reserve.hand_over(MIB)) == (0, 0, 0)
    assert reserve.handed_over_bytes == 8 * MIB
    assert reserve.fill() == 8 * MIB  # filled again, as after a package is dropped
    assert allocated(reserve._fd) == 8 * MIB


def test_a_buffer_populating_takes_its_size_from_the_reserve_and_is_populated_whole(reserve):
    reserve.fill()
    buffer = SharedMemoryAllocator(reserve).allocate("block", 5 * MIB + 3)
    try:
        assert allocated(buffer._fd) == 0
        buffer.prefault()
        assert allocated(buffer._fd) == 5 * MIB + mmap.PAGESIZE
        assert reserve.handed_over_bytes == 5 * MIB + mmap.PAGESIZE
        assert reserve.held_bytes == allocated(reserve._fd) == 3 * MIB - mmap.PAGESIZE
        assert bytes(buffer.view[-3:]) == b"\0\0\0"  # zero-filled, as every new block buffer
    finally:
        buffer.close()


def test_a_buffer_larger_than_the_reserve_empties_it_and_is_populated_whole(reserve):
    reserve.fill()
    size = POPULATE_STEP_BYTES + 2 * MIB  # two steps
    buffer = SharedMemoryBuffer("block", size, reserve)
    try:
        buffer.prefault()
        assert allocated(buffer._fd) == size
        assert (reserve.held_bytes, allocated(reserve._fd), reserve.handed_over_bytes) == (0, 0, 8 * MIB)
    finally:
        buffer.close()


def test_a_closed_reserve_frees_its_memory_and_ignores_fills_and_hand_overs(reserve):
    reserve.fill()
    reserve.close()
    assert reserve._map.closed
    assert (reserve.fill(), reserve.hand_over(MIB), reserve.held_bytes) == (0, 0, 0)
    reserve.close()  # idempotent


@pytest.mark.parametrize("size", [0, -1])
def test_a_reserve_needs_a_size(size):
    with pytest.raises(ValueError, match=f"a memory reserve needs a size > 0, got {size}"):
        MemoryReserve(size)


def test_a_reserve_larger_than_the_address_space_is_a_typed_error_naming_its_size():
    """Found in review: --memory 200TiB --reserve 200TiB failed with a raw OSError traceback (ENOMEM) from mmap."""
    with pytest.raises(MemoryBudgetError, match=r"^cannot map a memory reserve of 200\.0 TiB \(219902325555200 "
                                                r"bytes, --reserve\): Cannot allocate memory$"):
        MemoryReserve(200 << 40)
