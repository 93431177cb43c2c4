"""The cyclic garbage collector in the control plane's process: its settings, and work done with it off.

The control plane holds a large, long-lived state (workers, holdings, plans) and makes short-lived objects by the
hundred thousand (reports, messages, plans), so Python's defaults would set off collections over the whole state
often, each holding the GIL, and with it the event loop, for tens of milliseconds.
"""

import gc
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: The cyclic collector's young-generation threshold in the control plane's process (Python's default: 700).
#: Each block report allocates calls, messages and futures, nearly all freed at once by reference counting, yet
#: at 700, at 5,000 workers, the collector ran ~1,360 young and ~120 middle collections and 10-11 full ones over
#: the whole state in a 30 s bench run (bench control-plane), 1.5 s in all, a full one ~70 ms (up to 136 ms)
#: holding the event loop. At 20,000: ~45 collections, 0.5 s in all, no full one (the longest 74 ms), and block
#: reports/s 5,425-5,675 against 4,971-5,405 (three runs each).
GC_YOUNG_THRESHOLD = 20_000


def tune_collector() -> None:
    """Set the process's collector for a control plane (see :data:`GC_YOUNG_THRESHOLD`); entry points call it."""
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def collector_off(make: Callable[[], T], *, freeze: bool = False) -> T:
    """``make()`` with the cyclic garbage collector off meanwhile (for a thread that makes hundreds of thousands
    of objects, which would otherwise set off full collections over the whole state, each holding the GIL,
    so the event loop's thread with it, for tens of milliseconds), and what exists then frozen if ``freeze``
    (after a collection of the young generations: garbage frozen would never be freed)."""
    if freeze:  # else the garbage cycles made since the last collection (an exception of each failed call: its
        gc.collect(1)  # traceback) would be frozen too, for good: ~145 KB a scale-up at a usual error rate
    enabled = gc.isenabled()
    gc.disable()
    try:
        return make()
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()
