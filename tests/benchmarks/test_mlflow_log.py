"""``pipecast bench ... --mlflow-uri``: a benchmark run logged to a real ``mlflow server``, read back through
the MlflowClient. The pack benchmark's short form is the real command; a toy command shows plots and a
failed run."""

import importlib.util
import json
import logging
from pathlib import Path

import click
import pytest

from benchmarks import mlflow_log
from benchmarks.command import bench_group
from benchmarks.mlflow_log import figures, with_mlflow_logging
from pipecast.cli import main
from pipecast.core.mlflow_tracking import MlflowUnreachableError
from tests.support.mlflow_server import free_loopback_port

needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="needs the mlflow extra: pip install 'pipecast[mlflow]'")


def _only_run(uri: str, experiment: str):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def test_every_bench_command_has_the_mlflow_options():
    for name, command in bench_group.commands.items():
        options = {p.name: p for p in command.params}
        assert {"mlflow_uri", "mlflow_experiment", "json_path"} <= set(options), name
        assert options["mlflow_experiment"].default == "pipecast-bench"


def test_figures_are_the_json_numbers_by_path_without_raw_samples():
    result = {"pack_seconds": 0.5, "passed": True, "name": "x", "samples": [0.1, 0.2],
              "results": [{"strategy": "warm-pool:4", "seconds": 2}], "odd key:/x": {"n": 3}}
    assert figures(result) == {"pack_seconds": 0.5, "passed": 1.0, "results.0.seconds": 2.0, "odd key__x.n": 3.0}


@needs_mlflow
def test_a_bench_run_logs_its_options_figures_and_json(mlflow_server, tmp_path):
    json_path = tmp_path / "pack.json"
    assert main(["bench", "pack", "--size", "2MB", "--repeat", "1", "--workdir", str(tmp_path / "work"),
                 "--json", str(json_path), "--mlflow-uri", mlflow_server.uri, "--mlflow-experiment", "bench-pack"]) == 0
    client, run = _only_run(mlflow_server.uri, "bench-pack")
    assert run.info.status == "FINISHED" and run.info.run_name == "bench pack"
    assert run.data.tags["pipecast.bench"] == "pack"
    assert run.data.params == {"size": "2000000", "repeat": "1", "workdir": str(tmp_path / "work"),
                               "json_path": str(json_path)}
    written = json.loads(json_path.read_text())
    assert run.data.metrics == pytest.approx(figures(written))
    assert run.data.metrics["checkpoint_bytes"] == written["checkpoint_bytes"] > 0
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["pack.json"]
    logged = client.download_artifacts(run.info.run_id, "pack.json", str(tmp_path))
    assert json.loads(Path(logged).read_text()) == written


@click.command("toy")
@click.option("--json", "json_path", type=click.Path(path_type=Path))
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--fail", is_flag=True)
def _toy(json_path: Path | None, plots_dir: Path, fail: bool) -> None:
    """Writes its JSON (a temporary file is given when --json is not) and one plot, then fails if asked."""
    json_path.write_text(json.dumps({"seconds": 1.5, "results": [{"ok": True}]}))
    (plots_dir / "new.png").write_bytes(b"\x89PNG not really")
    if fail:
        raise SystemExit(1)


toy = with_mlflow_logging(_toy)


@needs_mlflow
def test_plots_written_are_logged_and_a_failed_run_is_marked_failed(mlflow_server, tmp_path):
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "old.png").write_bytes(b"from an earlier run")
    with pytest.raises(SystemExit):
        toy.main(["--plots", str(plots), "--fail", "--mlflow-uri", mlflow_server.uri, "--mlflow-experiment", "toy"],
                 standalone_mode=False)
    client, run = _only_run(mlflow_server.uri, "toy")
    assert run.info.status == "FAILED"
    assert run.data.params == {"plots_dir": str(plots), "fail": "True"}  # --json was not given
    assert run.data.metrics == {"seconds": 1.5, "results.0.ok": 1.0}
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["plots", "toy.json"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/new.png"]


@needs_mlflow
def test_a_failed_benchmark_keeps_its_own_error_when_its_run_cannot_be_logged(tmp_path, monkeypatch, caplog):
    def reachable_before_only(uri: str) -> None:  # the server goes away during the benchmark
        monkeypatch.setattr(mlflow_log, "check_reachable", gone)

    def gone(uri: str) -> None:
        raise MlflowUnreachableError(uri, 10, "gone")

    monkeypatch.setattr(mlflow_log, "check_reachable", reachable_before_only)
    with pytest.raises(SystemExit), caplog.at_level(logging.WARNING, logger=mlflow_log.__name__):
        toy.main(["--plots", str(tmp_path), "--fail", "--mlflow-uri", "http://127.0.0.1:9"], standalone_mode=False)
    assert caplog.messages == ["the failed run was not logged: MLflow tracking server http://127.0.0.1:9 did not "
                               "answer within 10 s (gone)"]


@needs_mlflow
def test_an_unreachable_server_is_refused_before_the_benchmark_runs(tmp_path, capsys):
    uri = f"http://127.0.0.1:{free_loopback_port()}"
    json_path = tmp_path / "pack.json"
    assert main(["bench", "pack", "--size", "1MB", "--json", str(json_path), "--mlflow-uri", uri]) == 2
    out = capsys.readouterr()
    assert out.err == (f"error: MLflow tracking server {uri} did not answer within 10 s "
                       "([Errno 111] Connection refused)\n")
    assert out.out == "" and not json_path.exists()
