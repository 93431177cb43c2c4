"""Log lines at a bounded rate: a flood of refused callers must not flood the log."""

import logging
import time
from typing import Any


class LogLimit:
    """At most ``burst`` lines to ``logger``, refilled at ``per_s`` a second; the lines left out are counted and
    said in the next line that is logged."""

    def __init__(self, logger: logging.Logger, per_s: float = 5.0, burst: float = 20.0) -> None:
        self.logger, self.per_s, self.burst = logger, per_s, burst
        self._tokens, self._stamp, self.dropped = burst, time.monotonic(), 0

    def log(self, level: int, message: str, *args: Any) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.per_s)
        self._stamp = now
        if self._tokens < 1:
            self.dropped += 1
            return
        self._tokens -= 1
        if self.dropped:
            message += f" ({self.dropped} similar lines left out)"
            self.dropped = 0
        self.logger.log(level, message, *args)
