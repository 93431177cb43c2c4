"""Process memory readings and the report of a load's growth: the peak is the load's own, not an earlier one."""

import pytest

import pipecast.engine.memory as memory
from pipecast.engine.memory import MemoryReport, ProcessMemory, process_memory

MIB = 1 << 20


def reading(rss: int, peak: int, *, reset: bool = False) -> ProcessMemory:
    return ProcessMemory(rss=rss * MIB, peak_rss=peak * MIB, anon=0, file=0, shmem=0, peak_reset=reset)


def test_an_earlier_peak_of_the_process_is_not_counted_as_the_loads_and_the_figure_says_it_is_a_lower_bound():
    """VmHWM is the peak since the process started: a 200 MiB peak before a load that grew RSS by 10 MiB read as a
    peak growth of 200 MiB during the load."""
    report = MemoryReport(100 * MIB, 0, reading(100, 300), reading(110, 300))
    assert report.peak_growth == 0 and report.peak_is_lower_bound
    assert "peak RSS +0 B at least (an earlier peak of the process could not be reset) (0.00x package)" in str(report)
    report = MemoryReport(100 * MIB, 0, reading(100, 300), reading(110, 340))
    assert report.peak_growth == 40 * MIB and report.peak_is_lower_bound  # past the earlier peak: at least that
    reset = MemoryReport(100 * MIB, 0, reading(100, 100, reset=True), reading(110, 150))
    assert reset.peak_growth == 50 * MIB and not reset.peak_is_lower_bound
    assert "peak RSS +50.0 MiB (0.50x package)" in str(reset)


def test_a_reading_that_resets_the_peak_reads_a_peak_of_what_ran_since():
    before = process_memory()
    block = bytearray(64 * MIB)  # touched: resident until freed (mapped apart, unmapped when freed)
    block[::4096] = b"\1" * len(block[::4096])
    del block
    reset = process_memory(reset_peak=True)
    if not reset.peak_reset:
        pytest.skip("this kernel does not let the process reset its peak RSS")
    assert reset.peak_rss < before.rss + 32 * MIB  # the block's 64 MiB peak is gone


def test_where_the_peak_cannot_be_reset_the_reading_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "CLEAR_REFS", tmp_path / "absent" / "clear_refs")
    reading = process_memory(reset_peak=True)
    assert not reading.peak_reset and reading.peak_rss >= reading.rss > 0
    assert not process_memory().peak_reset  # not asked to
