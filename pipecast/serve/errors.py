"""Typed failures of the serving worker; each carries the HTTP status it is answered with and says whose
fault it was."""

from pipecast.core.errors import PipecastError


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
