"""The C allocator's policy for the agent, a long-running process that moves gigabytes through buffers.

Every byte an agent sends that the socket does not take at once is copied into the event loop's write
buffer, which grows and shrinks by megabytes many times a second. glibc's defaults hand such memory back to
the kernel as soon as it is freed (heap trimmed above 128 KiB free, or a mapping of its own per large block),
so the next growth faults fresh zeroed pages in: measured here, a store sending 8 copies of a 257 MiB model
faulted in about 640 MB of new pages beyond its start-up (180,000 faults; 24,000 with the policy below).
Where memory is backed lazily (a VM whose host takes freed memory back: 10-45 us a page on the machine of
docs/benchmarks.md) that is seconds of CPU per surge; elsewhere a few hundred milliseconds. Keeping freed
memory for reuse, up to a bound, stops it.
"""

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Free memory at the top of the heap kept for reuse instead of being returned to the kernel.
TRIM_THRESHOLD_BYTES = 256 << 20
#: Allocations below this come from the heap (reusable) rather than a mapping of their own; 32 MiB is the
#: most glibc accepts on 64-bit systems.
MMAP_THRESHOLD_BYTES = 32 << 20


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse (up to :data:`TRIM_THRESHOLD_BYTES` at the top of the heap,
    allocations below :data:`MMAP_THRESHOLD_BYTES` from the heap). Process-wide: for entry points only.
    False (nothing changed) where the C library has no glibc ``mallopt`` (musl, macOS)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: freed memory goes back to the kernel as it decides")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt answers 1 on success, 0 for a value it refuses
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
