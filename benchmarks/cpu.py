"""Machine-wide CPU utilisation over a benchmark run, to tell a link-bound result from a CPU-bound one.

The emulated cluster runs every host on this one machine, so a run that keeps the cores busy measures
the CPU, not the links (DESIGN 5). Benchmarks wrap their run in :class:`CpuSampler` and print
:meth:`CpuUsage.summary`, which carries that verdict.
"""

import math
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import psutil

CPU_BOUND_NOTE = "CPU-bound run: measures the CPU, not the links"


def busy_fraction(before: Any, after: Any) -> float:
    """Share of all cores' time that was busy between two ``psutil.cpu_times()`` readings (0..1).

    Guest time is already counted in user/nice, and iowait is idle time, as in ``psutil.cpu_percent``.
    """
    def total(t: Any) -> float:
        return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def idle(t: Any) -> float:
        return t.idle + getattr(t, "iowait", 0.0)

    elapsed = total(after) - total(before)
    if elapsed <= 0:
        return 0.0
    return min(max(1.0 - (idle(after) - idle(before)) / elapsed, 0.0), 1.0)


@dataclass(frozen=True)
class CpuUsage:
    """CPU utilisation of a run, in percent of all cores: the exact mean and the p95 of the samples."""

    mean_percent: float
    p95_percent: float
    samples: int
    cores: int

    def saturated(self, threshold: float = 0.9) -> bool:
        """Whether the machine was busy enough (mean >= threshold) that the CPU bounded the result."""
        return self.mean_percent >= threshold * 100.0

    def summary(self, threshold: float = 0.9) -> str:
        """One line for benchmark output, with the CPU-bound verdict when it applies."""
        line = (f"CPU {self.mean_percent:.0f}% mean, {self.p95_percent:.0f}% p95 of {self.cores} cores "
                f"({self.samples} samples)")
        return f"{line}; {CPU_BOUND_NOTE}" if self.saturated(threshold) else line


def summarize(samples: list[float], mean_percent: float, cores: int) -> CpuUsage:
    """Build a :class:`CpuUsage` from per-interval percentages (p95 by nearest rank)."""
    ordered = sorted(samples)
    p95 = ordered[math.ceil(0.95 * len(ordered)) - 1] if ordered else mean_percent
    return CpuUsage(mean_percent=mean_percent, p95_percent=p95, samples=len(ordered), cores=cores)


class CpuSampler:
    """Samples machine-wide CPU utilisation every ``interval_s`` in a background thread while entered.

    It reads ``psutil.cpu_times()`` itself rather than ``psutil.cpu_percent``, whose "since the last
    call" state is shared by every caller in the process.
    """

    def __init__(self, interval_s: float = 0.25) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._interval_s = interval_s
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: Any = None
        self._last: Any = None

    def __enter__(self) -> "CpuSampler":
        self._samples.clear()
        self._stop.clear()
        self._first = self._last = psutil.cpu_times()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()  # the partial last interval, so even a short run has a sample

    def usage(self) -> CpuUsage:
        """The utilisation recorded so far (complete once the sampler has exited)."""
        if self._first is None:
            raise RuntimeError("CpuSampler.usage() needs the sampler to have been entered")
        mean = busy_fraction(self._first, self._last) * 100.0
        return summarize(list(self._samples), mean, psutil.cpu_count() or 1)

    def saturated(self, threshold: float = 0.9) -> bool:
        """Whether the run was CPU-bound: mean utilisation of all cores >= ``threshold``."""
        return self.usage().saturated(threshold)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        now = psutil.cpu_times()
        self._samples.append(busy_fraction(self._last, now) * 100.0)
        self._last = now
