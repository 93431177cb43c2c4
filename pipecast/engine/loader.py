"""The background thread that binds a provider's blocks into the model as they arrive, in any order.

Blocks can arrive out of order (multicast sends rotated orders); the loader binds whichever is present,
lowest index first, and otherwise waits for the lowest missing one in short slices so that a later block
arriving first is not left waiting. From a provider that verifies blocks chunk by chunk (the node agent),
the block in flight is bound part by part: each stage of each layer (its attention, the MLP's input
projections, its output projection) as soon as its own bytes are verified, so the prefill runs a fraction
of a layer behind the transfer rather than a block behind it. If nothing arrives for
``stall_timeout_s`` the origin is declared stalled and the model fails (requests that need the missing
layers get the error); so does a model that every block bound leaves incomplete (a package that does not fit
its config.json), rather than leave requests waiting for parts that will never come.
"""

import logging
import math
import numbers
import threading
import time

from pipecast.core.strictjson import describe
from pipecast.engine.errors import BlockStalledError, BlockWaitTimeout, InvalidRequestError
from pipecast.engine.progressive import ProgressiveModel
from pipecast.engine.providers import BlockProvider, StreamingBlockProvider
from pipecast.engine.weights import stage_of

logger = logging.getLogger(__name__)

POLL_S = 0.05


class BlockLoader:
    """Feeds ``model`` from ``provider`` on a daemon thread; see the module docstring."""

    def __init__(self, provider: BlockProvider, model: ProgressiveModel, *, stall_timeout_s: float = 600.0):
        self.provider = provider
        self.model = model
        self.stall_timeout_s = check_stall_timeout(stall_timeout_s)
        self.started_at: float | None = None
        self.block_bound_at: dict[int, float] = {}
        """``time.monotonic()`` at which each block was bound."""
        self._runs: dict[int, list[list[str]]] = {}  # per block being streamed: the parts still to bind
        self._last_arrival = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipecast-block-loader", daemon=True)

    @property
    def blocks_bound(self) -> int:
        return len(self.block_bound_at)

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Stop waiting for blocks (within one poll slice) and join the thread; True once it has ended (or never
        started)."""
        self._stop.set()
        if self._thread.is_alive():
            interrupt = getattr(self.provider, "interrupt", None)  # a request to the agent in flight ends now
            if interrupt is not None:
                interrupt()
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # every failure of a block origin or a block ends loading: report it
            if self._stop.is_set():  # stopped (the model closes): a request interrupted, no failure to report
                logger.debug("loading from %s stopped: %s", self.provider.origin, exc)
                return
            logger.error("loading from %s failed: %s", self.provider.origin, exc)
            self.model.fail(exc)

    def _load(self) -> None:
        p = self.provider
        streaming = isinstance(p, StreamingBlockProvider)
        missing = list(range(p.num_blocks))
        self._last_arrival = time.monotonic()
        while missing and not self._stop.is_set():
            present_now = p.present_blocks()
            present = next((i for i in missing if i in present_now), None)
            index = missing[0] if present is None else present
            try:
                if streaming and (present is None or index in self._runs):
                    self._stream(index)  # the lowest block still in flight: its layers as they come
                else:
                    self._bind(index, p.wait_block(index, timeout=POLL_S))
            except BlockWaitTimeout:
                if time.monotonic() - self._last_arrival > self.stall_timeout_s:
                    raise BlockStalledError(missing, p.origin, self.stall_timeout_s) from None
                continue
            block = p.manifest.blocks[index]
            self.model.check_block(index, range(block.layer_start, block.layer_end), p.origin)
            self.block_bound_at[index] = time.monotonic()
            missing.remove(index)
            logger.debug("bound block %d (layers %d-%d) from %s", index, block.layer_start,
                         block.layer_end - 1, p.origin)
        if not missing:
            # check_block saw each block's own layers only: the embeddings, the head or other layers may be missing.
            self.model.check_complete(p.origin)
            logger.info("model fully loaded from %s in %.3f s: %d blocks", p.origin,
                        self._last_arrival - self.started_at, p.num_blocks)

    def _stream(self, index: int) -> None:
        """Bind block ``index`` part by part (embeddings, each layer's stages, head) in its byte order, each
        part as soon as its bytes are verified; raises BlockWaitTimeout when the next part is not in yet (the
        parts bound so far stay bound, and the next call goes on from there)."""
        if index not in self._runs:
            header = self.provider.wait_header(index, timeout=POLL_S)
            self._runs[index] = _part_runs(header, self.model.skeleton.sandwich_norms)
        runs = self._runs[index]
        while runs:
            self._bind(index, self.provider.wait_tensors(index, runs[0], timeout=POLL_S))
            runs.pop(0)

    def _bind(self, index: int, tensors) -> None:
        self.model.bind_tensors(index, tensors, self.provider.origin)
        self._last_arrival = time.monotonic()


def check_wait(timeout: float | None) -> float | None:
    """``timeout`` (None: no bound) if it is a number of seconds the agent's waits take too (0 to a day); else
    :class:`InvalidRequestError` (NaN waited without a bound, infinity overflowed threading's timer)."""
    from pipecast.agent.local_client import MAX_TIMEOUT_S, is_timeout

    if timeout is None or is_timeout(timeout):
        return timeout
    raise InvalidRequestError(f"timeout must be None or a number of seconds from 0 to {MAX_TIMEOUT_S:g}, got "
                              f"{describe(timeout)}")


def check_stall_timeout(value: float) -> float:
    """``value`` as a float if it is a positive, finite number of seconds; else :class:`InvalidRequestError` (NaN
    would never declare a stall, a negative value at the first poll, a string fail the loader thread)."""
    if not isinstance(value, bool) and isinstance(value, numbers.Real):
        try:
            seconds = float(value)
        except OverflowError:  # an integer of hundreds of digits
            seconds = math.inf
        if 0 < seconds < math.inf:
            return seconds
    raise InvalidRequestError(f"stall_timeout_s must be a positive number of seconds, got {describe(value)}")


def _part_runs(header, sandwich_norms: bool) -> list[list[str]]:
    """A block's tensors in byte order, cut where the part (a layer's stage, the embeddings, the head)
    changes."""
    runs: list[list[str]] = []
    previous = None
    for name, _ in sorted(header.tensors.items(), key=lambda item: item[1].begin):
        part = stage_of(name, sandwich_norms)
        if not runs or part != previous:
            runs.append([])
        runs[-1].append(name)
        previous = part
    return runs
