"""A serving worker's ``GET /health`` answer: what the worker reports and what the router reads of it.

A worker that serves, or will, answers 200 with the status ``loading`` (nothing to run yet), ``partial``
(blocks arriving; prompts run layer by layer as they do) or ``ready`` (fully loaded); one that cannot
answers 503 with ``failed`` or ``draining``. The router acts on the status and the counts, and reads
only 200 answers. This module imports nothing heavy: the router uses it too.
"""

import dataclasses
from dataclasses import dataclass

from pipecast.core.errors import PipecastError
from pipecast.core.strictjson import describe

#: The statuses of a worker that serves or will (answered 200); the last two can serve requests.
STATES = ("loading", "partial", "ready")
SERVING = ("partial", "ready")

_COUNTS = ("blocks_present", "blocks_total", "queue_depth", "running", "max_queue")
# 0 when a worker does not report them: no per-batch cap; no pipelined sessions
_OPTIONAL_COUNTS = ("max_batch", "pipeline_sessions", "pipeline_moved", "pipeline_kept")
_TEXTS = ("stage", "model", "package_id", "error")  # optional text fields (None when not reported)
#: The largest count a worker may report (the router's reading of a vLLM worker's gauges too): far above any real
#: queue or block count, and far below the 2**53 the scaler reads of a router's /stats, summed over its workers.
MAX_COUNT = 2 ** 31


class HealthFormatError(PipecastError):
    """A ``/health`` answer is not what the protocol says (the worker's fault)."""


@dataclass(frozen=True)
class WorkerHealth:
    """One ``GET /health`` answer; the JSON object's fields, in this order."""

    status: str                 # loading | partial | ready, or failed | draining (answered 503)
    blocks_present: int
    blocks_total: int
    queue_depth: int
    running: int
    max_queue: int
    max_batch: int = 0
    pipeline_sessions: int = 0  # requests of cross-node pipelines whose stage state this worker holds
    pipeline_moved: int = 0     # requests moved here off a pipeline that dissolved under them (as its head)
    pipeline_kept: int = 0      # such requests left on their pipeline by the auto choice
    #: Engine steps run since the worker started, modulo MAX_COUNT (None: not reported, as a vLLM worker's): the
    #: router tells a worker busy with long generations from a hung one by it (a request's answer may be silent
    #: for long, a non-streaming one until it is whole).
    steps: int | None = None
    stage: str | None = None    # the worker's loading stage (see pipecast.serve.worker)
    model: str | None = None
    package_id: str | None = None
    error: str | None = None

    @property
    def http_status(self) -> int:
        """200 while the worker serves or will (the router reads the status), 503 when it cannot."""
        return 200 if self.status in STATES else 503

    @property
    def can_serve(self) -> bool:
        """Whether the worker says it serves, and its own queue has room."""
        return self.status in SERVING and not (self.max_queue and self.queue_depth >= self.max_queue)

    @property
    def fraction_present(self) -> float:
        """The fraction of the model's blocks the worker holds (1.0 when it reports no blocks)."""
        return self.blocks_present / self.blocks_total if self.blocks_total else 1.0

    def to_json(self) -> dict:
        """The JSON answer; ``error`` and ``steps`` only when there is one."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k not in ("error", "steps")}

    @classmethod
    def from_json(cls, answer: object) -> "WorkerHealth":
        """Check a decoded 200 answer and return it typed.

        Raises :class:`HealthFormatError` when the answer is not an object with a known status and
        integer counts within 0..:data:`MAX_COUNT`; a descriptive field that is not text is read as absent.
        """
        if not isinstance(answer, dict):
            raise HealthFormatError(f"/health answered {type(answer).__name__}, not a JSON object")
        status = answer.get("status")
        if not isinstance(status, str) or status not in STATES:
            raise HealthFormatError(f"/health status {describe(status)} is not one of {', '.join(STATES)}")
        counts = {name: _count(name, answer.get(name, 0 if name in _OPTIONAL_COUNTS else None))
                  for name in _COUNTS + _OPTIONAL_COUNTS}
        if answer.get("steps") is not None:
            counts["steps"] = _count("steps", answer["steps"])
        texts = {name: answer[name] for name in _TEXTS if isinstance(answer.get(name), str)}
        return cls(status=status, **counts, **texts)


def _count(name: str, value: object) -> int:
    # bool is an int in Python; a JSON true is still not a count.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HealthFormatError(f"/health field {name!r} is {describe(value)}, not a count")
    if value > MAX_COUNT:
        raise HealthFormatError(f"/health field {name!r} is {describe(value)}, more than {MAX_COUNT}")
    return value
