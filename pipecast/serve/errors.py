"""Typed failures of the serving worker; each carries the HTTP status it is answered with and says whose
fault it was."""

from pipecast.core.credentials import SERVING_KEY_HEADER
from pipecast.core.errors import PipecastError


def openai_error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP ``status``, as the worker's errors have it (the router's answer so too)."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class ServeError(PipecastError):
    """Base of every serving-worker failure. ``status`` is the HTTP status, ``kind`` the OpenAI error type."""

    status = 500
    kind = "server_error"
    param: str | None = None
    code: str | None = None


class RequestFieldError(ServeError):
    """A completion request the worker cannot run as given (the client's fault); ``param`` names the field."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


class RequestTooLargeError(ServeError):
    """A request body over the worker's size limit (the client's fault), refused before it is read whole."""

    status = 413
    kind = "invalid_request_error"
    code = "request_too_large"


class ModelNotServedError(ServeError):
    """The request names a model this worker does not serve (the client's fault)."""

    status = 404
    kind = "invalid_request_error"
    param = "model"
    code = "model_not_found"

    def __init__(self, asked: str, served: str) -> None:
        super().__init__(f"model {asked!r} is not served here: this worker serves {served!r}")
        self.asked, self.served = asked, served


class WorkerBusyError(ServeError):
    """The worker's queue is full (too much load, not a failure): the client should retry after a while."""

    status = 429
    kind = "rate_limit_error"
    code = "queue_full"

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"the worker is full: {waiting} requests are already waiting; retry in {retry_after_s} s")
        self.waiting, self.retry_after_s = waiting, retry_after_s


class ServingKeyError(ServeError):
    """A request to a serving endpoint without the cluster's serving key, or with another one (the caller's
    fault: only the cluster's router and serving workers hold it)."""

    status = 401
    kind = "authentication_error"
    code = "invalid_serving_key"

    def __init__(self, presented: bool) -> None:
        what = "holds another key" if presented else "is missing"
        super().__init__(f"this worker takes requests only from its cluster's router and serving workers: the "
                         f"{SERVING_KEY_HEADER} header {what}")
        self.presented = presented


class ServingKeyUnknownError(ServeError):
    """The worker has not yet learned from its node agent the key requests must present, within the wait
    (the agent is not registered with its control plane): it cannot tell who may call it."""

    status = 503
    kind = "server_error"
    code = "credentials_pending"

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"the worker has not learned its cluster's serving key from its node agent within "
                         f"{waited_s:g} s (is the agent registered with its control plane?)")


class ModelUnavailableError(ServeError):
    """The model could not be loaded (the package, the agent or the block source failed): the worker cannot
    serve, and its health says so."""

    status = 503
    kind = "server_error"
    code = "model_unavailable"


class WorkerClosingError(ServeError):
    """The worker is shutting down and takes no more requests."""

    status = 503
    kind = "server_error"
    code = "shutting_down"

    def __init__(self) -> None:
        super().__init__("the worker is shutting down")


class StageFailedError(ServeError):
    """A stage of a cross-node pipeline failed or did not answer in time: ``node`` (its URL) is whose fault
    it was. Answered 503 before the answer started, so the router retries the request elsewhere."""

    status = 503
    kind = "server_error"
    code = "pipeline_stage_failed"

    def __init__(self, node: str, problem: str) -> None:
        super().__init__(f"pipeline stage {node} failed: {problem}")
        self.node, self.problem = node, problem


class StageBusyError(ServeError):
    """A stage of a cross-node pipeline has no room for the request now (its stage calls or its sessions are at
    their bound): load, not a failure. Answered 429 with Retry-After, so the router sends the request elsewhere
    and the pipeline nothing for a while, instead of taking it out as failed."""

    status = 429
    kind = "rate_limit_error"
    code = "pipeline_busy"
    retry_after_s = 1

    def __init__(self, node: str, problem: str) -> None:
        super().__init__(f"pipeline stage {node} is busy: {problem}")
        self.node, self.problem = node, problem


class StageQueueFullError(ServeError):
    """This worker holds as many stage calls (waiting for their layers, for their turn, or computing) as it holds
    pipelined sessions at most: another is refused at once (429), before its hidden states wait in memory."""

    status = 429
    kind = "rate_limit_error"
    code = "stage_queue_full"

    def __init__(self, calls: int) -> None:
        super().__init__(f"this worker already holds {calls} stage calls; retry elsewhere or later")
        self.calls = calls
