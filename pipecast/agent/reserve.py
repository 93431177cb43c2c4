"""Host memory the agent populates ahead of time and hands over to the block buffers it receives into.

Some virtual machines back guest memory lazily and take back what the guest frees (balloon free page
reporting): there the first touch of memory the guest has not used for a few seconds traps to the
hypervisor. Measured on this project's 2-core VM: populating fresh shared memory past the first 2 GiB at
0.07-0.13 GB/s, against 1.5-3.2 GB/s for pages the guest freed a moment before. A surge lands exactly there:
every receiving agent populates a model's worth of memory at once, while its serving worker computes.

A :class:`MemoryReserve` populates its size when the agent starts (off the critical path) and holds it.
A block buffer's prefault frees a step of the reserve just before populating the same amount of its own
memory, so the kernel hands the buffer the pages it has just freed, still backed. Block buffers stay
memory of their own (a serving worker maps each by path; nothing of the reserve is ever shared). When a
package is dropped the agent fills the reserve again, from the pages the package freed. On a machine whose
memory is backed up front the reserve changes nothing but the agent's resident size while it idles.
"""

import ctypes
import functools
import logging
import mmap
import os
import threading

from pipecast.agent.buffers import POPULATE_STEP_BYTES, address_of, populate
from pipecast.agent.errors import MemoryBudgetError
from pipecast.core.units import format_bytes

log = logging.getLogger(__name__)

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _whole_pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


@functools.cache
def _fallocate() -> ctypes._CFuncPtr:
    fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return fallocate


class MemoryReserve:
    """``nbytes`` of private host memory, populated by :meth:`fill` and given up by :meth:`hand_over`.

    Thread-safe: :meth:`fill` runs in a worker thread while prefaults hand bytes over from others.
    """

    def __init__(self, nbytes: int, label: str = "pipecast-reserve") -> None:
        if nbytes <= 0:
            raise ValueError(f"a memory reserve needs a size > 0, got {nbytes!r}")
        self.size = _whole_pages(nbytes)
        self._fd = -1
        try:
            self._fd = os.memfd_create(label, os.MFD_CLOEXEC)
            os.ftruncate(self._fd, self.size)
            self._map = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as exc:
            if self._fd >= 0:
                os.close(self._fd)
            if isinstance(exc, OSError):  # ENOMEM: larger than the address space or the overcommit limit allow
                raise MemoryBudgetError(f"cannot map a memory reserve of {format_bytes(self.size)} ({self.size} "
                                        f"bytes, --reserve): {exc.strerror or exc}") from None
            raise
        self._address = address_of(self._map)
        self._held = 0  # bytes [0, held) are populated
        self._closed = False
        self._said_short = False
        self._lock = threading.Lock()
        self.handed_over_bytes = 0

    @property
    def held_bytes(self) -> int:
        """Bytes populated and held now."""
        return self._held

    def fill(self, limit: int | None = None) -> int:
        """Populate what the reserve lacks now, up to ``limit`` bytes held (default: its size), a step at a time;
        the bytes it holds then.

        Blocking and GIL-free: run it in a worker thread. A hand-over waits for at most one step, and what it
        frees meanwhile stays free: blocks being received while the reserve fills take its pages instead of
        the reserve taking new ones for them.
        """
        target = self.size if limit is None else max(0, min(self.size, limit))
        target -= target % mmap.PAGESIZE  # held stays whole pages: populate() refuses a start inside a page
        with self._lock:
            missing = target - self._held
        while missing > 0:
            with self._lock:
                start = self._held
                if self._closed or start >= self.size:
                    break
                step = min(POPULATE_STEP_BYTES, self.size - start, missing)
                if not populate(self._address + start, step):
                    if not self._said_short:  # populate() logged why (debug); said once, not at every refill
                        self._said_short = True
                        log.warning("the memory reserve (%s) holds %s only: the kernel populates no more of it",
                                    format_bytes(self.size), format_bytes(start))
                    break
                self._held += step
                missing -= step
        return self._held

    def hand_over(self, nbytes: int) -> int:
        """Free up to ``nbytes`` of the reserve (its last populated pages), for memory populated right after
        to take; the bytes freed (0 once the reserve is empty)."""
        with self._lock:
            if self._closed:
                return 0
            amount = min(_whole_pages(nbytes), self._held)
            if amount <= 0:
                return 0
            start = self._held - amount
            if _fallocate()(self._fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, start, amount) != 0:
                log.debug("cannot free part of the memory reserve (%s)", os.strerror(ctypes.get_errno()))
                return 0
            self._held = start
            self.handed_over_bytes += amount
            return amount

    def close(self) -> None:
        """Free the reserve (idempotent); later fills and hand-overs do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._held = 0
            self._map.close()
            os.close(self._fd)
