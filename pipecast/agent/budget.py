"""The agent's host-memory budget: packages are admitted whole or refused, never swapped."""

import logging
import threading
from dataclasses import dataclass, field

from pipecast.agent.errors import MemoryBudgetError
from pipecast.core.units import format_bytes

log = logging.getLogger(__name__)


@dataclass
class Reservation:
    """Bytes held against a :class:`MemoryBudget` until :meth:`release`."""

    budget: "MemoryBudget"
    nbytes: int
    what: str
    released: bool = False

    def release(self) -> None:
        """Give the bytes back (idempotent)."""
        if not self.released:
            self.released = True
            self.budget._give_back(self)


@dataclass
class MemoryBudget:
    """A byte limit shared by every package an agent holds in memory (PIPECAST_AGENT_MEMORY_BYTES)."""

    limit_bytes: int
    used_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reserve(self, nbytes: int, what: str) -> Reservation:
        """Hold ``nbytes`` for ``what`` or raise :class:`MemoryBudgetError` saying what does not fit."""
        with self._lock:
            free = self.limit_bytes - self.used_bytes
            if nbytes > free:
                raise MemoryBudgetError(
                    f"{what} needs {format_bytes(nbytes)} ({nbytes} bytes) of host memory but the agent's "
                    f"budget has {format_bytes(free)} ({free} bytes) free of {format_bytes(self.limit_bytes)} "
                    f"(raise --memory / PIPECAST_AGENT_MEMORY_BYTES or free a package)"
                )
            self.used_bytes += nbytes
        log.debug("reserved %s for %s", format_bytes(nbytes), what)
        return Reservation(self, nbytes, what)

    def _give_back(self, reservation: Reservation) -> None:
        with self._lock:
            self.used_bytes -= reservation.nbytes
