"""Reaching an MLflow tracking server (the optional extra ``mlflow``): importing MLflow, choosing the server,
and checking with a deadline that it answers.

MLflow is imported only by the functions that use it, so the commands start fast and run without it. Its
HTTP client retries a server that does not answer for minutes; :func:`check_reachable` asks once, with a
deadline, before the first call, and every later call of a server that answers its health check but not the
call ends after :data:`REQUEST_TIMEOUT_S` x (1 + :data:`REQUEST_RETRIES`) and the backoff between (MLflow's own
defaults: 120 s and 7 retries, ~17 min), unless ``MLFLOW_HTTP_REQUEST_TIMEOUT`` or
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` say otherwise.
"""

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

from pipecast.core.errors import PipecastError
from pipecast.core.urls import http_base_url

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
REACH_TIMEOUT_S = 10.0
#: A call's deadline (s) without a byte from the server, and how often a call is retried; see the docstring.
REQUEST_TIMEOUT_S = 30
REQUEST_RETRIES = 2


class MlflowError(PipecastError):
    """MLflow cannot do what was asked: not installed, no server given, or the server failed a call."""


class MlflowNotInstalledError(MlflowError):
    """The ``mlflow`` extra is not installed."""

    def __init__(self):
        super().__init__("MLflow is not installed: pip install 'pipecast[mlflow]'")


class MlflowUnreachableError(MlflowError):
    """The tracking server did not answer within the deadline."""

    def __init__(self, uri: str, timeout_s: float, reason: str):
        super().__init__(f"MLflow tracking server {shown_uri(uri)} did not answer within {timeout_s:g} s ({reason})")
        self.uri, self.timeout_s, self.reason = uri, timeout_s, reason


def shown_uri(uri: str) -> str:
    """``uri`` for a message: a password in it is replaced by ``***``."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


def require_mlflow() -> None:
    """Raise :class:`MlflowNotInstalledError` unless MLflow is installed, without importing it (an import takes
    a second and grows the process by ~170 MB)."""
    if importlib.util.find_spec("mlflow") is None:
        raise MlflowNotInstalledError()


def import_mlflow():
    """The ``mlflow`` module; :class:`MlflowNotInstalledError` when the extra is not installed."""
    require_mlflow()
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(REQUEST_TIMEOUT_S))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(REQUEST_RETRIES))
    import mlflow

    return mlflow


def tracking_uri(given: str | None) -> str:
    """The tracking server to use: ``given`` (``--mlflow-uri``), else ``$MLFLOW_TRACKING_URI`` (MLflow's own
    convention); :class:`MlflowError` when neither is set, rather than MLflow's default of a local store in
    the working directory, which would hold no model and leave files behind."""
    uri = given or os.environ.get(TRACKING_URI_ENV)
    if not uri:
        raise MlflowError(f"no MLflow tracking server: pass --mlflow-uri URI or set {TRACKING_URI_ENV}")
    return uri


def check_reachable(uri: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raise :class:`MlflowUnreachableError` unless the http(s) tracking server ``uri`` answers ``GET /health``
    within ``timeout_s``. Any HTTP answer counts (an authentication error is reported by the call that meets
    it), so credentials in ``uri`` (``user:password@``, which MLflow sends as Basic auth) are left out of the
    check. Other URIs (a local folder or database, ``databricks``) are not checked."""
    import urllib.error  # here: urllib.request loads http.client and ssl, which a command's start need not wait for
    import urllib.request

    base = http_base_url(uri)
    if base is None:
        return
    # urllib takes "user:password@" for part of the host name: without it, the health check asks the host
    parts = urlsplit(base)
    base = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=timeout_s):
            pass
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as exc:  # refused, unresolvable, timed out (URLError and TimeoutError are OSErrors)
        raise MlflowUnreachableError(uri, timeout_s, str(getattr(exc, "reason", exc))) from None


@contextmanager
def server_calls(uri: str) -> Iterator[None]:
    """Calls to the tracking server ``uri`` in the body: an ``MlflowException`` they raise becomes an
    :class:`MlflowError` carrying MLflow's message (the commands print it without a traceback)."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        raise MlflowError(f"MLflow tracking server {shown_uri(uri)}: {exc.message}") from None
