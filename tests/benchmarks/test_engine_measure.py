"""`pipecast bench engine`'s memory figures (:mod:`benchmarks.engine_measure`, :mod:`pipecast.engine.memory`)."""

from benchmarks.engine_measure import memory_report
from pipecast.engine.memory import MemoryReport, ProcessMemory
from tests.support.packages import tiny_package

MIB = 1 << 20


def test_the_memory_report_counts_the_kv_cache_its_generation_allocated(tmp_path):
    """Read while the engine runs: closing it frees the KV cache."""
    report = memory_report(tiny_package(tmp_path / "pkg").path)
    assert report.kv_cache_bytes > 0 and report.device_bytes is None
    assert "; KV cache " in str(report)
    assert "device memory" not in str(report)


def test_on_a_gpu_the_report_puts_the_kv_cache_with_the_device_memory_not_the_hosts():
    """Found in review: on a GPU the report said the KV cache was part of the host's anonymous growth."""
    before = ProcessMemory(rss=100 * MIB, peak_rss=100 * MIB, anon=50 * MIB, file=0, shmem=0)
    after = ProcessMemory(rss=100 * MIB, peak_rss=110 * MIB, anon=50 * MIB, file=0, shmem=0)
    text = str(MemoryReport(256 * MIB, 8 * MIB, before, after, device_bytes=264 * MIB))
    assert text.startswith("package 256.0 MiB: device memory +264.0 MiB (1.03x package; KV cache 8.0 MiB), host peak "
                           "RSS +10.0 MiB"), text
    assert text.count("KV cache") == 1
