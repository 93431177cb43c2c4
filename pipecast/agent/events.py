"""A machine-readable record of what an agent did (``--events FILE``): one JSON object per line.

Each line has ``t`` (time.time(), comparable between the processes of one host), ``node`` and ``event``
plus the event's fields. Benchmarks and tests read it to time every block on every node.
"""

import json
import time
from pathlib import Path
from typing import IO, Any


class EventLog:
    """Appends events to a file, flushed per line; does nothing without a path."""

    def __init__(self, path: Path | None, node_id: str) -> None:
        self.node_id = node_id
        self._file: IO[str] | None = Path(path).open("a", buffering=1) if path else None

    def emit(self, event: str, at: float | None = None, **fields: Any) -> None:
        """Record ``event`` (at ``at``, default now) with ``fields``."""
        if self._file is not None:
            record = {"t": time.time() if at is None else at, "node": self.node_id, "event": event, **fields}
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: Path) -> list[dict]:
    """Every event recorded in ``path``, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
