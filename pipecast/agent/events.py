"""A machine-readable record of what an agent did (``--events FILE``): one JSON object per line.

Each line has ``t`` (time.time(), comparable between the processes of one host), ``node`` and ``event``
plus the event's fields. Benchmarks and tests read it to time every block on every node.

The record is bounded whatever peers do: each event kind has a token bucket (:data:`EVENT_BURST` lines,
refilled at :data:`EVENT_RATE_PER_S` a second). Lines over it are dropped and counted, and an
``events_dropped`` line (``kind``, ``dropped``, ``since``) says how many, before the next line of that
kind that is written and when the log closes. An agent's own events (blocks, assignments) stay far
below the bucket; a flood of peers' requests or failures does not. The file is bounded too: past
:data:`EVENTS_MAX_BYTES` it moves to ``FILE.1`` (replacing the one before) and a new ``FILE`` begins, so a
seeding agent's lines (one per block served) take at most twice that on disk. Processes writing one file (an
agent restarted while the old one still ends) share it: each measures the file on disk and follows the path to
the new ``FILE`` once another moved it aside.

The record never fails the agent: a line the disk does not take (full, failing) is lost and counted, and said
once in the log, while the agent goes on serving its peers.
"""

import contextlib
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

EVENT_RATE_PER_S = 200.0
EVENT_BURST = 5000.0
#: Bytes of the events file before it is rotated: far more than a benchmark's run writes (benchmarks and
#: tests read the whole file at its end), bounded for an agent that runs for months.
EVENTS_MAX_BYTES = 64 << 20


class _Bucket:
    """Tokens of one event kind, and what was dropped since the last line of that kind."""

    __slots__ = ("tokens", "stamp", "dropped", "since")

    def __init__(self, now: float, tokens: float) -> None:
        self.tokens, self.stamp, self.dropped, self.since = tokens, now, 0, 0.0


class EventLog:
    """Appends events to a file, flushed per line, at a bounded rate per kind; does nothing without a path."""

    def __init__(self, path: Path | None, node_id: str, rate_per_s: float = EVENT_RATE_PER_S,
                 burst: float = EVENT_BURST, max_bytes: int = EVENTS_MAX_BYTES) -> None:
        self.node_id = node_id
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_bytes = max_bytes
        self._buckets: dict[str, _Bucket] = {}
        self.lost = 0  # lines the disk did not take
        self._path = Path(path) if path else None
        self._file: IO[str] | None = self._path.open("a", buffering=1) if self._path else None

    def emit(self, event: str, at: float | None = None, **fields: Any) -> None:
        """Record ``event`` (at ``at``, default now) with ``fields``, unless its kind is over its rate."""
        if self._file is None:
            return
        now = time.monotonic()
        bucket = self._buckets.get(event)
        if bucket is None:
            bucket = self._buckets[event] = _Bucket(now, self.burst)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.stamp) * self.rate_per_s)
        bucket.stamp = now
        if bucket.tokens < 1:
            if not bucket.dropped:
                bucket.since = time.time()
            bucket.dropped += 1
            return
        bucket.tokens -= 1
        if bucket.dropped:
            self._summary(event, bucket)
        self._write({"t": time.time() if at is None else at, "node": self.node_id, "event": event, **fields})

    def _summary(self, kind: str, bucket: _Bucket) -> None:
        self._write({"t": time.time(), "node": self.node_id, "event": "events_dropped", "kind": kind,
                     "dropped": bucket.dropped, "since": bucket.since})
        bucket.dropped = 0

    def _write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"  # ASCII (json.dumps escapes the rest): as many bytes as characters
        # The file on disk decides, not what this process wrote: another process (an agent restarted while the old
        # one still ends) may append to it or move it aside.
        try:
            size = self._follow_path()
            if size and size + len(line) > self.max_bytes:
                self._rotate()
            self._file.write(line)
        except OSError as exc:
            # A full or failing disk costs lines, not the caller's work (a peer's request is answered after its line).
            if not self.lost:
                log.warning("events file %s: a line is lost (%s); the lines lost are counted, and said at close",
                            self._path, exc)
            self.lost += 1

    def _rotate(self) -> None:
        # Under an exclusive lock of the full file (released as it closes): another process crossing the limit at
        # the same time waits, then finds the path moved and follows it, instead of moving the new file over the
        # lines just moved aside.
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        if self._names_open_file():
            os.replace(self._path, rotated(self._path))
        self._reopen()

    def _follow_path(self) -> int:
        # Reopens the path where it no longer names the open file (moved aside or removed); returns its size.
        if not self._names_open_file():
            self._reopen()
        return os.fstat(self._file.fileno()).st_size

    def _reopen(self) -> None:
        # The path is opened first: where that fails the file held stays open, for the next line to try again.
        opened = self._path.open("a", buffering=1)
        held, self._file = self._file, opened
        _close(held)

    def _names_open_file(self) -> bool:
        try:
            on_disk = os.stat(self._path)
        except FileNotFoundError:
            return False
        held = os.fstat(self._file.fileno())
        return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)

    def close(self) -> None:
        if self._file is not None:
            for kind, bucket in self._buckets.items():
                if bucket.dropped:
                    self._summary(kind, bucket)
            held, self._file = self._file, None
            _close(held)
            if self.lost:
                log.warning("events file %s: %d lines were lost", self._path, self.lost)


def _close(file: IO[str]) -> None:
    # Closing flushes a line whose write failed (still buffered, already counted lost): that fails again, and the
    # file is closed all the same.
    with contextlib.suppress(OSError):
        file.close()


def rotated(path: Path) -> Path:
    """Where the events file ``path`` moves when full (:data:`EVENTS_MAX_BYTES`)."""
    return path.with_name(path.name + ".1")


def read_events(path: Path) -> list[dict]:
    """Every event still recorded for ``path``, in order: those of its rotated file (:func:`rotated`) first."""
    path, before = Path(path), rotated(Path(path))
    text = (before.read_text() if before.exists() else "") + path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]
