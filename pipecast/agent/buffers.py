"""Memory that holds blocks: one buffer per block, shareable with local processes without a copy.

Every buffer is a shared mapping a process on the same node can map by path: received blocks live in
anonymous shared memory (memfd, freed by the kernel when the agent exits, even on SIGKILL), blocks from a
package folder or the disk cache are read-only mappings of their files. Allocators sit behind
:class:`BufferAllocator` so page-locked or device memory can be added without touching the store.
"""

import ctypes
import functools
import logging
import mmap
import os
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipecast.agent.reserve import MemoryReserve

log = logging.getLogger(__name__)

# Linux >= 5.14; Python 3.11's mmap module neither names it nor releases the GIL in madvise.
_MADV_POPULATE_WRITE = 23
#: Bytes a buffer populates at a time from a memory reserve (freed there, then taken here): small enough that
#: the freed pages are taken again at once, large enough that the system calls cost nothing.
POPULATE_STEP_BYTES = 64 << 20


@functools.cache
def _madvise() -> ctypes._CFuncPtr:
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # ctypes calls run without the GIL
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def address_of(mapping: mmap.mmap) -> int:
    """The address of ``mapping``'s first byte (for madvise and friends), without keeping an export of it."""
    anchor = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(anchor)
    del anchor  # a buffer export would keep the mapping from closing
    return address


def populate(address: int, nbytes: int) -> bool:
    """Populate ``nbytes`` of writable shared memory mapped at ``address`` (blocking, GIL-free); False, logged,
    where the kernel cannot (before Linux 5.14 the pages fault in as they are first written)."""
    if _madvise()(address, nbytes, _MADV_POPULATE_WRITE) != 0:
        log.debug("cannot prefault shared memory (%s); pages fault in as they are received",
                  os.strerror(ctypes.get_errno()))
        return False
    return True


class BlockBuffer(ABC):
    """Memory of one block: ``view`` for this process, ``path`` for another process on the node."""

    view: memoryview
    path: str
    #: Whether every page is in memory already (a prefault would do nothing).
    populated: bool = True

    @abstractmethod
    def close(self) -> None:
        """Release the memory; views handed out must have been released first."""

    def prefault(self) -> None:
        """Map every page now, so that receiving into the buffer does not stop on page faults.

        Blocking and GIL-free: call it from a worker thread ahead of the transfer. Buffers whose pages
        come from elsewhere (files in the page cache) need nothing.
        """


class _MappedBuffer(BlockBuffer):
    """A shared mapping of a file descriptor it owns, exposed as a memoryview; another process maps the same
    file through ``/proc/<pid>/fd/<fd>``, whatever later takes the file's name."""

    def __init__(self, fd: int, nbytes: int, writable: bool) -> None:
        self._fd = fd
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        except BaseException:
            os.close(fd)
            raise
        self.view = memoryview(self._map)
        self.path = f"/proc/{os.getpid()}/fd/{fd}"

    def close(self) -> None:
        try:
            self.view.release()
            self._map.close()
        finally:
            os.close(self._fd)  # the mapping, if still held, keeps the memory alive by itself


class SharedMemoryBuffer(_MappedBuffer):
    """Anonymous shared memory (memfd); another process maps it through ``/proc/<pid>/fd/<fd>``.

    With a ``reserve`` its prefault takes its pages from there (:mod:`pipecast.agent.reserve`).
    """

    def __init__(self, label: str, nbytes: int, reserve: "MemoryReserve | None" = None) -> None:
        self._reserve = reserve
        self.populated = False
        self._populating = threading.Lock()  # the fetcher and the local API may prefault it at once
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        super().__init__(fd, nbytes, writable=True)

    def prefault(self) -> None:
        # A first touch of shared memory costs a page fault per 4 KiB page (~0.6 ms per MB measured
        # here, more than the receive itself); populating ahead takes that off the critical path. Once
        # only: a second caller waits for the first, then has nothing to do.
        with self._populating:
            if not self.populated:
                self._populate()
                self.populated = True  # or the kernel cannot: the pages fault in as they are written

    def _populate(self) -> None:
        address = address_of(self._map)
        if self._reserve is None:
            populate(address, len(self._map))
            return
        # A step of the reserve freed, then at once the same amount of the buffer populated: it gets those pages.
        for start in range(0, len(self._map), POPULATE_STEP_BYTES):
            step = min(POPULATE_STEP_BYTES, len(self._map) - start)
            self._reserve.hand_over(step)
            if not populate(address + start, step):
                return


class FileBuffer(_MappedBuffer):
    """A read-only mapping of a block file (package folder, disk cache); pages come from the page cache. The
    engine maps it by its descriptor, not its name: the very file verified, though a package packed again in
    place (a new file renamed over it) gave the engine another package's unverified bytes under the old id."""

    def __init__(self, path: Path, nbytes: int) -> None:
        super().__init__(os.open(path, os.O_RDONLY | os.O_CLOEXEC), nbytes, writable=False)


class BufferAllocator(ABC):
    """Makes writable buffers for blocks being received."""

    @abstractmethod
    def allocate(self, label: str, nbytes: int) -> BlockBuffer:
        """A zero-filled writable buffer of ``nbytes`` (> 0); ``label`` names it in /proc for operators."""


class SharedMemoryAllocator(BufferAllocator):
    """Host shared memory (memfd): what the agent uses on CPU nodes; its buffers populate from ``reserve``
    where there is one."""

    def __init__(self, reserve: "MemoryReserve | None" = None) -> None:
        self.reserve = reserve

    def allocate(self, label: str, nbytes: int) -> BlockBuffer:
        return SharedMemoryBuffer(label, nbytes, self.reserve)
