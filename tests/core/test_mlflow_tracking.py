"""Reaching an MLflow server: a missing extra, no server given, a server that does not answer within the
deadline. None of these needs MLflow installed."""

import importlib.util
import socket
import sys
import time

import pytest

from pipecast.cli import main
from pipecast.core.mlflow_tracking import (
    MlflowError,
    MlflowNotInstalledError,
    MlflowUnreachableError,
    check_reachable,
    shown_uri,
    tracking_uri,
)
from tests.support.mlflow_server import free_loopback_port


@pytest.fixture
def no_mlflow(monkeypatch):
    """MLflow as if not installed: a None entry in sys.modules makes both find_spec and import say so."""
    monkeypatch.setitem(sys.modules, "mlflow", None)


def test_without_the_extra_pack_and_bench_say_what_to_install(no_mlflow, tmp_path, capsys):
    expected = "error: MLflow is not installed: pip install 'pipecast[mlflow]'\n"
    uri = f"http://127.0.0.1:{free_loopback_port()}"
    assert main(["pack", "models:/tiny/1", str(tmp_path / "pkg"), "--mlflow-uri", uri]) == 2
    assert capsys.readouterr().err == expected
    assert main(["bench", "pack", "--size", "1MB", "--mlflow-uri", uri]) == 2
    assert capsys.readouterr().err == expected  # refused before the benchmark ran
    assert list(tmp_path.iterdir()) == []
    assert issubclass(MlflowNotInstalledError, MlflowError)


def test_the_server_is_the_option_else_the_environment_else_an_error(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert tracking_uri("http://given:5000") == "http://given:5000"
    assert tracking_uri(None) == "http://env:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(MlflowError) as caught:
        tracking_uri(None)
    assert str(caught.value) == "no MLflow tracking server: pass --mlflow-uri URI or set MLFLOW_TRACKING_URI"


def test_a_server_that_never_answers_is_given_up_at_the_deadline():
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(MlflowUnreachableError) as caught:
            check_reachable(uri, timeout_s=0.5)
        assert time.monotonic() - start < 5
    assert str(caught.value) == f"MLflow tracking server {uri} did not answer within 0.5 s (timed out)"


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="needs the mlflow extra")
def test_a_refused_connection_is_unreachable_on_the_cli(tmp_path, capsys):
    uri = f"http://127.0.0.1:{free_loopback_port()}"
    assert main(["pack", "models:/tiny/1", str(tmp_path / "pkg"), "--mlflow-uri", uri]) == 2
    assert capsys.readouterr().err == (f"error: MLflow tracking server {uri} did not answer within 10 s "
                                       "([Errno 111] Connection refused)\n")
    assert list(tmp_path.iterdir()) == []


def test_local_uris_are_not_checked_and_passwords_are_not_shown():
    check_reachable("sqlite:///does/not/matter.db")
    check_reachable("databricks")
    assert shown_uri("https://user:s3cret@mlflow.example:443/x") == "https://user:***@mlflow.example:443/x"
    assert shown_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_a_server_whose_uri_holds_credentials_is_reachable():
    """Finding 5: urllib took ``user:secret@`` for part of the host, so a URI MLflow accepts was refused as
    unreachable. The check asks /health without the credentials (any HTTP answer counts)."""
    import http.server
    import threading

    seen = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check_reachable(f"http://user:secret@127.0.0.1:{server.server_address[1]}/prefix", timeout_s=5)
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [("/prefix/health", None)]


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="needs the mlflow extra")
def test_a_server_that_answers_its_health_check_but_not_a_call_fails_the_pack_at_the_call_deadline(
        tmp_path, capsys, monkeypatch):
    """Found in review: after the health check every call ran on MLflow's defaults (120 s, 7 retries, backoff):
    a server that answered /health but hung on the API held `pipecast pack` for ~17 minutes."""
    import http.server
    import threading

    from pipecast.core import mlflow_tracking

    monkeypatch.setattr(mlflow_tracking, "REQUEST_TIMEOUT_S", 1)
    monkeypatch.setattr(mlflow_tracking, "REQUEST_RETRIES", 0)
    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
        monkeypatch.delenv(name, raising=False)  # and restored (unset) after the test
    release = threading.Event()

    class HealthOnly(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/health":
                release.wait(30)  # a call: never answered while the test runs
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HealthOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        start = time.monotonic()
        assert main(["pack", "models:/tiny/1", str(tmp_path / "pkg"), "--mlflow-uri", uri]) == 2
        assert time.monotonic() - start < 20
    finally:
        release.set()
        server.shutdown()
    err = capsys.readouterr().err
    assert err.startswith(f"error: MLflow tracking server {uri}: ") and "read timeout=1" in err, err
    assert list(tmp_path.iterdir()) == []
