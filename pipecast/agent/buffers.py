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
from abc import ABC, abstractmethod
from pathlib import Path

log = logging.getLogger(__name__)

# Linux >= 5.14; Python 3.11's mmap module neither names it nor releases the GIL in madvise.
_MADV_POPULATE_WRITE = 23


@functools.cache
def _madvise() -> ctypes._CFuncPtr:
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # ctypes calls run without the GIL
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


class BlockBuffer(ABC):
    """Memory of one block: ``view`` for this process, ``path`` for another process on the node."""

    view: memoryview
    path: str

    @abstractmethod
    def close(self) -> None:
        """Release the memory; views handed out must have been released first."""

    def prefault(self) -> None:
        """Map every page now, so that receiving into the buffer does not stop on page faults.

        Blocking and GIL-free: call it from a worker thread ahead of the transfer. Buffers whose pages
        come from elsewhere (files in the page cache) need nothing.
        """


class _MappedBuffer(BlockBuffer):
    """A shared mapping of a file descriptor, exposed as a memoryview."""

    def __init__(self, fd: int, nbytes: int, path: str, writable: bool) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        self.view = memoryview(self._map)
        self.path = path

    def close(self) -> None:
        self.view.release()
        self._map.close()


class SharedMemoryBuffer(_MappedBuffer):
    """Anonymous shared memory (memfd); another process maps it through ``/proc/<pid>/fd/<fd>``."""

    def __init__(self, label: str, nbytes: int) -> None:
        self._fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            super().__init__(self._fd, nbytes, f"/proc/{os.getpid()}/fd/{self._fd}", writable=True)
        except BaseException:
            os.close(self._fd)
            raise

    def prefault(self) -> None:
        # A first touch of shared memory costs a page fault per 4 KiB page (~0.6 ms per MB measured
        # here, more than the receive itself); populating ahead takes that off the critical path.
        anchor = ctypes.c_char.from_buffer(self._map)
        address = ctypes.addressof(anchor)
        del anchor  # the buffer export would keep the mapping from closing
        if _madvise()(address, len(self._map), _MADV_POPULATE_WRITE) != 0:
            log.debug("cannot prefault shared memory (%s); pages fault in as they are received",
                      os.strerror(ctypes.get_errno()))

    def close(self) -> None:
        try:
            super().close()
        finally:
            os.close(self._fd)  # the mapping, if still held, keeps the memory alive by itself


class FileBuffer(_MappedBuffer):
    """A read-only mapping of a block file (package folder, disk cache); pages come from the page cache."""

    def __init__(self, path: Path, nbytes: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            super().__init__(fd, nbytes, str(path.resolve()), writable=False)
        finally:
            os.close(fd)  # the mapping keeps the file alive


class BufferAllocator(ABC):
    """Makes writable buffers for blocks being received."""

    @abstractmethod
    def allocate(self, label: str, nbytes: int) -> BlockBuffer:
        """A zero-filled writable buffer of ``nbytes`` (> 0); ``label`` names it in /proc for operators."""


class SharedMemoryAllocator(BufferAllocator):
    """Host shared memory (memfd): what the agent uses on CPU nodes."""

    def allocate(self, label: str, nbytes: int) -> BlockBuffer:
        return SharedMemoryBuffer(label, nbytes)
