"""The background thread that binds a provider's blocks into the model as they arrive, in any order.

Blocks can arrive out of order (multicast sends rotated orders); the loader binds whichever is present,
lowest index first, and otherwise waits for the lowest missing one in short slices so that a later block
arriving first is not left waiting. If no block arrives for ``stall_timeout_s`` the source is declared
stalled and the model fails (requests that need the missing layers get the error).
"""

import logging
import threading
import time

from pipecast.engine.errors import BlockStalledError, BlockWaitTimeout
from pipecast.engine.progressive import ProgressiveModel
from pipecast.engine.providers import BlockProvider

logger = logging.getLogger(__name__)

POLL_S = 0.05


class BlockLoader:
    """Feeds ``model`` from ``provider`` on a daemon thread; see the module docstring."""

    def __init__(self, provider: BlockProvider, model: ProgressiveModel, *, stall_timeout_s: float = 600.0):
        self.provider = provider
        self.model = model
        self.stall_timeout_s = stall_timeout_s
        self.started_at: float | None = None
        self.block_bound_at: dict[int, float] = {}
        """``time.monotonic()`` at which each block was bound."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipecast-block-loader", daemon=True)

    @property
    def blocks_bound(self) -> int:
        return len(self.block_bound_at)

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop waiting for blocks (within one poll slice) and join the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # every failure of a block source or a block ends loading: report it
            logger.error("loading from %s failed: %s", self.provider.source, exc)
            self.model.fail(exc)

    def _load(self) -> None:
        p = self.provider
        missing = list(range(p.num_blocks))
        last_arrival = time.monotonic()
        while missing and not self._stop.is_set():
            index = next((i for i in missing if p.is_present(i)), missing[0])
            try:
                tensors = p.wait_block(index, timeout=POLL_S)
            except BlockWaitTimeout:
                if time.monotonic() - last_arrival > self.stall_timeout_s:
                    raise BlockStalledError(missing, p.source, self.stall_timeout_s) from None
                continue
            block = p.manifest.blocks[index]
            self.model.bind_block(index, range(block.layer_start, block.layer_end), tensors, p.source)
            last_arrival = self.block_bound_at[index] = time.monotonic()
            missing.remove(index)
            logger.debug("bound block %d (layers %d-%d) from %s", index, block.layer_start,
                         block.layer_end - 1, p.source)
        if not missing:
            logger.info("model fully loaded from %s in %.3f s: %d blocks", p.source,
                        last_arrival - self.started_at, p.num_blocks)
