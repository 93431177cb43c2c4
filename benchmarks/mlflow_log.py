"""``pipecast bench NAME ... --mlflow-uri URI``: a benchmark run logged to an MLflow tracking server (extra
``mlflow``).

The bench group gives every command ``--mlflow-uri`` and ``--mlflow-experiment`` (:func:`with_mlflow_logging`).
With a server given, the command runs as the MLflow run "bench NAME" of the experiment (created if new) and
logs: its options as parameters (those left unset are not logged), every number of its JSON result as a
metric named by its path in the JSON (``pack_seconds``, ``results.2.seconds``; lists of plain numbers are raw
samples and stay in the JSON), the JSON as an artifact (written to a temporary file when ``--json`` is not
given), and every PNG it wrote (``--plot FILE``, or into a folder option such as ``--plots``) under
``plots/``. The server is checked before the benchmark starts, so an unreachable one costs no benchmark; a
benchmark that fails leaves a FAILED run with what it wrote. MLflow itself is imported, and the run created,
only once the benchmark is done: the import grows this process by ~170 MB, and a child started meanwhile
would inherit that peak RSS (Linux keeps it across exec), inflating what the pack benchmark measures.
"""

import contextlib
import functools
import json
import logging
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import click

from benchmarks.runinfo import versions
from pipecast.core.mlflow_tracking import (
    MlflowError,
    check_reachable,
    import_mlflow,
    require_mlflow,
    server_calls,
    shown_uri,
)

logger = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "pipecast-bench"
JSON_OPTION = "json_path"  # the parameter name of every bench command's --json
_KEY_DISALLOWED = re.compile(r"[^\w.\- ]")  # MLflow's metric name characters, less "/" and ":" (not portable)
_MAX_KEY = 250  # MLflow's longest metric name


def with_mlflow_logging(command: click.Command) -> click.Command:
    """Give the bench ``command`` the options ``--mlflow-uri`` and ``--mlflow-experiment`` (in place; returned):
    with a URI, each run is logged to that server (see the module doc)."""
    command.params += [
        click.Option(["--mlflow-uri"], metavar="URI",
                     help="Log this run to the MLflow tracking server URI (options, figures, JSON, plots; extra: "
                          "mlflow)."),
        click.Option(["--mlflow-experiment"], default=DEFAULT_EXPERIMENT, show_default=True,
                     help="The MLflow experiment of the run (with --mlflow-uri)."),
    ]
    bench = command.callback

    @functools.wraps(bench)
    def run(*, mlflow_uri: str | None, mlflow_experiment: str, **params):
        if mlflow_uri is None:
            return bench(**params)
        return log_bench_run(command.name, bench, params, uri=mlflow_uri, experiment=mlflow_experiment)

    command.callback = run
    return command


def log_bench_run(name: str, bench: Callable[..., object], params: dict, *, uri: str, experiment: str) -> object:
    """Run ``bench(**params)`` (the bench command ``name``) as an MLflow run in ``experiment`` on the tracking
    server ``uri``, logging what the module doc lists; return what ``bench`` returns."""
    require_mlflow()
    check_reachable(uri)
    with tempfile.TemporaryDirectory(prefix="pipecast-mlflow-") as tmp:
        run_params = dict(params)
        if JSON_OPTION in params and params[JSON_OPTION] is None:
            run_params[JSON_OPTION] = Path(tmp) / f"{name}.json"
        before = _outputs(run_params)
        started_ms = _now_ms()
        status = "FAILED"
        try:
            result = bench(**run_params)
            status = "FINISHED"
            return result
        finally:
            try:
                run_id = _log_run(uri, experiment, name, params, run_params, before, started_ms, status)
            except MlflowError as exc:
                if status == "FINISHED":
                    raise
                # The benchmark's own error, on its way up, says more than this one.
                logger.warning("the failed run was not logged: %s", exc)
            else:
                click.echo(f"logged run {run_id} ({status}) to experiment {experiment!r} at {shown_uri(uri)}",
                           err=True)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _log_run(uri: str, experiment: str, name: str, params: dict, run_params: dict, before: dict[Path, int],
             started_ms: int, status: str) -> str:
    """Create the run of a benchmark that ended with ``status`` and log it (module doc); return its id."""
    ended_ms = _now_ms()
    check_reachable(uri)  # again: a server gone during a long benchmark would be retried for minutes
    client = import_mlflow().MlflowClient(uri)
    # MLflow prints the run's web links to stdout, which holds the benchmark's report: to stderr with them.
    with server_calls(uri), contextlib.redirect_stdout(sys.stderr):
        run_id = _create_run(client, experiment, name, params, started_ms)
        _log_outputs(client, run_id, run_params, before, ended_ms)
        client.set_terminated(run_id, status, end_time=ended_ms)
    return run_id


def _create_run(client, experiment: str, name: str, params: dict, started_ms: int) -> str:
    """A new run "bench NAME" in ``experiment`` (created if new), its options logged as parameters."""
    from mlflow.entities import Param

    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    tags = {"pipecast.bench": name, **{f"version.{dist}": v for dist, v in versions().items()}}
    run_id = client.create_run(experiment_id, start_time=started_ms, run_name=f"bench {name}", tags=tags).info.run_id
    client.log_batch(run_id, params=[Param(key, str(value)) for key, value in params.items() if value is not None])
    return run_id


def _outputs(params: dict) -> dict[Path, int]:
    """The output files the options name as they are now (path -> modification time, ns): the --json file
    and PNG files, named by a path option or inside a folder option. Compared before and after a run, they
    tell what the run wrote (a file left from an earlier run is not logged again)."""
    candidates = []
    for key, value in params.items():
        if not isinstance(value, Path):
            continue
        if value.is_dir():
            candidates += value.glob("*.png")
        elif key == JSON_OPTION or value.suffix == ".png":
            candidates.append(value)
    return {path: path.stat().st_mtime_ns for path in candidates if path.is_file()}


def _log_outputs(client, run_id: str, params: dict, before: dict[Path, int], ended_ms: int) -> None:
    """Log what the run wrote: its JSON (as an artifact and as metrics) and its PNGs."""
    from mlflow.entities import Metric

    written = [path for path, mtime in _outputs(params).items() if before.get(path) != mtime]
    json_path = params.get(JSON_OPTION)
    if json_path in written:
        client.log_artifact(run_id, str(json_path))
        metrics = figures(json.loads(json_path.read_text()))
        client.log_batch(run_id, metrics=[Metric(key, value, ended_ms, 0) for key, value in metrics.items()])
    for png in sorted(p for p in written if p.suffix == ".png"):
        client.log_artifact(run_id, str(png), "plots")


def figures(result) -> dict[str, float]:
    """Every number of a benchmark's JSON ``result`` as a metric: named by its path (``results.2.seconds``,
    characters MLflow refuses replaced by ``_``), booleans as 0 and 1. A list of plain numbers is a series of
    raw samples, not a figure: left out. A name longer than MLflow allows is left out with a warning."""
    found: dict[str, float] = {}

    def walk(value, path: str) -> None:
        if isinstance(value, (bool, int, float)):
            if len(path) <= _MAX_KEY:
                found[path] = float(value)
            else:
                logger.warning("not logged: metric name longer than %d characters: %s...", _MAX_KEY, path[:80])
        elif isinstance(value, dict):
            for key, item in value.items():
                part = _KEY_DISALLOWED.sub("_", key)
                walk(item, f"{path}.{part}" if path else part)
        elif isinstance(value, list) and not all(isinstance(item, (int, float)) for item in value):
            for i, item in enumerate(value):
                walk(item, f"{path}.{i}" if path else str(i))

    walk(result, "")
    return found
