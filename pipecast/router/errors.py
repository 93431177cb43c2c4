"""Typed failures of the request router; each message says whose fault the failure was."""

from pipecast.core.credentials import SERVING_KEY_HEADER
from pipecast.core.errors import PipecastError


class RouterError(PipecastError):
    """Base of every router failure."""


class QueueFullError(RouterError):
    """The router's own queue is full (too much load for the workers available): the client may retry."""

    def __init__(self, max_queue: int) -> None:
        super().__init__(f"router queue is full ({max_queue} requests waiting); retry later")
        self.max_queue = max_queue


class QueueTimeoutError(RouterError):
    """A queued request found no worker able to take it before its deadline (no capacity, not a bug)."""

    def __init__(self, waited_s: float, known: int, serving: int) -> None:
        super().__init__(f"no worker could take the request within {waited_s:g} s "
                         f"({known} workers known, {serving} able to serve)")
        self.waited_s, self.known, self.serving = waited_s, known, serving


class RouterClosedError(RouterError):
    """The router is shutting down and takes no more requests."""

    def __init__(self) -> None:
        super().__init__("router is shutting down")


class TenantAuthError(RouterError):
    """A request without a known API key while the router requires one (``router_api_keys`` is set)."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem}: send `Authorization: Bearer <key>` with a key the router knows")


class TenantNameError(RouterError):
    """A tenant header that is no printable text of bounded length (the client's fault)."""

    def __init__(self, header: str, max_chars: int) -> None:
        super().__init__(f"the {header} header must be printable text of at most {max_chars} characters")


class ViewKeyError(RouterError):
    """A request for the router's views of its pool (``/stats``, ``/v1/workers``, ``/metrics``) without the
    cluster's serving key, or with another one (the caller's fault: only the cluster's own components hold it)."""

    def __init__(self, path: str, presented: bool) -> None:
        what = "holds another key" if presented else "is missing"
        scrape = "; Prometheus scrapes the router's --metrics-port" if path == "/metrics" else ""
        super().__init__(f"{path} answers only the cluster's own components (the scaling daemon, operators "
                         f"holding the serving key): the {SERVING_KEY_HEADER} header {what}{scrape}")
        self.path, self.presented = path, presented


class ViewKeyPendingError(RouterError):
    """The router has credentials but has not learned its cluster's serving key yet (its control plane has
    not answered), so it cannot tell who may read its views of the pool."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path}: the router has not learned its cluster's serving key yet (from its control "
                         "plane, or derived from a master auth_token); retry shortly")
        self.path = path


class TenantOverLimitError(RouterError):
    """A tenant sent requests faster than its admission limit allows: the client may retry after a while."""

    def __init__(self, tenant: str, rate: float, burst: int, retry_after_s: int) -> None:
        super().__init__(f"tenant {tenant!r} is over its rate of {rate:g} requests/s (burst {burst}); "
                         f"retry after {retry_after_s} s")
        self.tenant, self.rate, self.burst, self.retry_after_s = tenant, rate, burst, retry_after_s


class WorkerUrlError(RouterError):
    """A worker URL from the operator or the control plane is not an http(s) base URL."""

    def __init__(self, url: str, source: str) -> None:
        super().__init__(f"{source}: worker URL {url!r} is not an http:// or https:// base URL")
        self.url, self.source = url, source


class WorkerError(RouterError):
    """A serving worker failed us; ``worker`` names it (its URL)."""

    def __init__(self, worker: str, message: str) -> None:
        super().__init__(f"worker {worker}: {message}")
        self.worker = worker


class WorkerFailedError(WorkerError):
    """The worker failed before anything reached the client (refused, reset, silent, 503): retryable."""


class WorkerTimeoutError(WorkerError):
    """The worker sent nothing of its answer for the upstream timeout while its health showed it working (its engine
    stepping): a generation that long, or a wait behind full batches, not a failure. Not retried (the work would
    be done again elsewhere, and time out again): the client gets 504."""

    def __init__(self, worker: str, path: str, timeout_s: float) -> None:
        super().__init__(worker, f"no answer to POST {path} within {timeout_s:g} s while its engine was working: "
                                 "not retried (the work would be done again); give the router a longer "
                                 "--upstream-timeout (streaming helps a long generation, not a long wait in the "
                                 "worker's queue)")


class WorkerBusyError(WorkerError):
    """The worker's own queue is full (it answered 429): the request waits for room, anywhere."""

    def __init__(self, worker: str, retry_after_s: float) -> None:
        super().__init__(worker, f"queue full (429), retry after {retry_after_s:g} s")
        self.retry_after_s = retry_after_s


class WorkerStreamError(WorkerError):
    """The worker failed after its answer began reaching the client (lost, or silent too long)."""


class HealthAnswerError(WorkerError):
    """The worker's ``/health`` answer is not what the protocol says (the worker's fault)."""


class RetriesExhaustedError(RouterError):
    """Every attempt to serve a request failed on a worker; ``failures`` holds each, in order. ``then``: the
    retry found no worker before the request's queue deadline (the workers' failures are still the cause)."""

    def __init__(self, failures: list[WorkerFailedError], then: QueueTimeoutError | None = None) -> None:
        super().__init__(f"request failed on {len(failures)} attempt(s): "
                         + "; ".join(str(failure) for failure in failures) + (f"; then {then}" if then else ""))
        self.failures, self.then = failures, then


def describe_exception(exc: BaseException, timeout_s: float) -> str:
    """A short reason for a failed exchange with a peer (a bare timeout has no message of its own)."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return f"no answer within {timeout_s:g} s"
    return f"{type(exc).__name__}: {exc}"
