"""How much memory the engine costs beyond the weights: process RSS split by kind, against package size.

On CPU the weights are views of the block buffers (the package file's page-cache pages or the agent's
shared memory), so loading shows up as file-backed or shared RSS, while anonymous RSS (private copies)
grows only by the KV cache and activations. A copy of the weights would show as anonymous growth close
to the package size. Linux only (reads /proc/self/status; resets the peak through /proc/self/clear_refs).
"""

from dataclasses import dataclass
from pathlib import Path

from pipecast.core.units import format_bytes

_FIELDS = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
#: Writing "5" here resets this process's VmHWM to its current RSS (Linux 4.0 and later).
CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class ProcessMemory:
    """Resident memory of this process, in bytes."""

    rss: int
    peak_rss: int   # high-water mark of rss since the process started, or since peak_reset
    anon: int       # private memory: heap, tensors the process allocated
    file: int       # file-backed pages: mapped package blocks, libraries
    shmem: int      # shared memory: the agent's block buffers
    peak_reset: bool = False  # the high-water mark was reset just before this reading: peak_rss is rss then


def process_memory(status: Path = Path("/proc/self/status"), *, reset_peak: bool = False) -> ProcessMemory:
    """Read this process's memory counters; with ``reset_peak``, first reset the high-water mark (``peak_rss``)
    to the current RSS where Linux allows (``peak_reset`` says whether it did), so a later reading's peak is of
    what ran since, not of an earlier peak of the process."""
    values: dict = {"peak_reset": reset_peak and _reset_peak()}
    for line in status.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            values[_FIELDS[key]] = int(rest.split()[0]) * 1024  # the kernel reports kB
    return ProcessMemory(**values)


def _reset_peak() -> bool:
    try:
        CLEAR_REFS.write_text("5")
    except OSError:  # not Linux, a kernel before 4.0, or /proc not writable (some sandboxes)
        return False
    return True


@dataclass(frozen=True)
class MemoryReport:
    """Memory growth across a model load (and a short generation), against the package's size."""

    package_bytes: int
    kv_cache_bytes: int  # allocated by the engine for keys and values: part of the anonymous growth (on the CPU)
    before: ProcessMemory
    after: ProcessMemory
    #: On a GPU, the device memory torch allocated across the load (the weights and the KV cache are there, the
    #: RSS figures are the host's); None on the CPU.
    device_bytes: int | None = None

    @property
    def anon_growth(self) -> int:
        return self.after.anon - self.before.anon

    @property
    def peak_growth(self) -> int:
        """Peak RSS reached during the load, above the RSS before it.

        VmHWM is the peak since the process started (or since ``before`` reset it): an earlier peak, higher than
        the RSS before the load, would be counted as the load's. The growth is taken above that earlier peak
        instead; it is then a lower bound, 0 where the load stayed under that peak (:attr:`peak_is_lower_bound`).
        Exact where ``before`` was read with ``reset_peak`` on a Linux that allows it."""
        return max(self.after.peak_rss - max(self.before.peak_rss, self.before.rss), 0)

    @property
    def peak_is_lower_bound(self) -> bool:
        """Whether an earlier peak of the process, never reset, stood above the RSS before the load: then
        :attr:`peak_growth` may be below the load's own."""
        return not self.before.peak_reset and self.before.peak_rss > self.before.rss

    def __str__(self) -> str:
        p = self.package_bytes
        kv = f"KV cache {format_bytes(self.kv_cache_bytes)}"
        device = "" if self.device_bytes is None else (
            f"device memory +{format_bytes(self.device_bytes)} ({self.device_bytes / p:.2f}x package; {kv}), host ")
        bound = " at least (an earlier peak of the process could not be reset)" if self.peak_is_lower_bound else ""
        return (f"package {format_bytes(p)}: {device}peak RSS +{format_bytes(self.peak_growth)}{bound} "
                f"({self.peak_growth / p:.2f}x package), anonymous +{format_bytes(self.anon_growth)} "
                f"({self.anon_growth / p:.2f}x{'' if device else '; ' + kv}), "
                f"file-backed +{format_bytes(self.after.file - self.before.file)}, "
                f"shared +{format_bytes(self.after.shmem - self.before.shmem)}")
